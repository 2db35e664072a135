"""Resampling (families/resample.py): F.interpolate / nn.Upsample in nearest, nearest-exact, linear,
bilinear, trilinear and bicubic modes, and adaptive average pooling whose windows do not tile the input evenly,
1-D to 3-D, on the CUDA cores.

One thread an output element, consecutive threads along the output's last dim, so each warp stores one
run and its loads fall on one or two input rows. The source coordinate is eager's: the scale is the
input over the output size, or one over the given scale factor (rounded to fp32 as eager rounds it), or for
align_corners (in - 1) / (out - 1); nearest takes floor(o * scale) (nearest-exact floor((o + 0.5) * scale),
the sum in double as eager computes it), linear the two inputs around scale * (o + 0.5) - 0.5 (at least 0)
weighted by the distance, dim by dim; bicubic the 4 x 4 inputs around floor(scale * (o + 0.5) - 0.5) (not
clamped), indices clamped into the input, weighted by Keys' cubic convolution (A = -0.75), rows first then
the column, as eager computes it. An adaptive pool's window along a dim runs from floor(o * in / out)
to ceil((o + 1) * in / out), summed in order and divided by each dim's extent in turn, as eager does; an
adaptive max pool keeps the window's first largest value and its index in the plane (a NaN wins, the
last one, as eager's `> or isnan`). The
sizes and the scales are constants of the kernel; values are read and blended in fp32 and stored in the
output's dtype. With `vec` > 1 (not the max pool) a thread computes `vec` consecutive outputs along the last
dim and stores them as one access (16 bytes at most): the stores are the traffic an upsampling is made of,
and the index split of the other dims is paid once per `vec` outputs. The index arithmetic is unsigned,
32 bits wide where the output has fewer than 2^31 elements (a second kernel), so the divisions by the
constant sizes compile to a 32-bit multiply each.
"""

from __future__ import annotations

import struct
import textwrap
from dataclasses import dataclass

from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import Code, ctype, launch_bounds, torch_dtype
from pipeline.generate.expert.templates.signature import Signature, i64, ptr

MODES = ("nearest", "nearest-exact", "linear", "cubic", "adaptive_avg", "adaptive_max")
POOLS = ("adaptive_avg", "adaptive_max")


@dataclass(frozen=True)
class Resample:
    mode: str  # one of MODES
    align_corners: bool  # linear only
    size: tuple[int, ...]  # the input's spatial sizes (1 to 3 dims)
    out: tuple[int, ...]  # the output's
    scales: tuple[float | None, ...]  # the given scale factor per dim, None where the sizes set the scale

    def scale(self, d: int) -> float:
        """Eager's fp32 scale from output coordinates to input ones along spatial dim d."""
        i, o, s = self.size[d], self.out[d], self.scales[d]
        if self.mode in ("linear", "cubic") and self.align_corners:
            return _f32((i - 1) / (o - 1)) if o > 1 else 0.0
        if s is not None and s > 0:
            return _f32(1.0 / s)
        return _f32(_f32(i) / _f32(o))  # fp32 division of two exactly held sizes: one rounding


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def _lit(v: float) -> str:
    """An fp32 value as an exact C literal."""
    return f"{v.hex()}f" if v else "0.0f"


_NEAREST = """        const int s{d} = min((int)floorf({coord}), I{d} - 1);"""
_WINDOW = """        const int s{d} = (int)((long long)o{d} * I{d} / O{d});
        const int n{d} = (int)((((long long)o{d} + 1) * I{d} + O{d} - 1) / O{d});"""
_CUBIC = """        const float r{d} = {coord};
        const int s{d} = (int)floorf(r{d});
        float c{d}[4];
        kp_cubic_weights(c{d}, r{d} - (float)s{d});"""
# Keys' cubic convolution weights of the 4 taps at distance t past the second one (ATen's A = -0.75).
CUBIC_WEIGHTS = r"""#ifndef KP_CUBIC_DEFINED
#define KP_CUBIC_DEFINED
__device__ __forceinline__ void kp_cubic_weights(float (&c)[4], float t) {
    const float A = -0.75f;
    const float x1 = t + 1.0f, x2 = 1.0f - t, x3 = x2 + 1.0f;
    c[0] = ((A * x1 - 5.0f * A) * x1 + 8.0f * A) * x1 - 4.0f * A;
    c[1] = ((A + 2.0f) * t - (A + 3.0f)) * t * t + 1.0f;
    c[2] = ((A + 2.0f) * x2 - (A + 3.0f)) * x2 * x2 + 1.0f;
    c[3] = ((A * x3 - 5.0f * A) * x3 + 8.0f * A) * x3 - 4.0f * A;
}
#endif
"""
_LINEAR = """        float r{d} = {coord};
        r{d} = r{d} < 0.f ? 0.f : r{d};
        const int s{d} = (int)r{d}, n{d} = s{d} < I{d} - 1 ? s{d} + 1 : s{d};
        const float w{d}1 = r{d} - (float)s{d}, w{d}0 = 1.f - w{d}1;"""


def _coord(f: Resample, d: int) -> str:
    scale = _lit(f.scale(d))
    if f.mode == "nearest":
        return f"(float)o{d} * {scale}"
    if f.mode == "nearest-exact":
        return f"(float)(((double)o{d} + 0.5) * (double){scale})"
    if f.align_corners:
        return f"{scale} * (float)o{d}"
    return f"{scale} * ((float)o{d} + 0.5f) - 0.5f"  # not clamped at 0 for cubic


def _blend(f: Resample, t: str) -> str:
    """The output value: one load (nearest), or the 2^dims inputs blended dim by dim, the last dim first."""
    nd = len(f.size)
    at = [f"(long long)s{d}" for d in range(nd)]

    def index(picks: list[str]) -> str:
        expr = picks[0]
        for d in range(1, nd):
            expr = f"({expr}) * I{d} + {picks[d]}"
        return expr

    loops = "".join(f"{'    ' * d}        for (int k{d} = s{d}; k{d} < n{d}; ++k{d})\n" for d in range(nd))
    picks = [f"(long long)k{d}" for d in range(nd)]
    if f.mode == "adaptive_max":  # the first largest, or the last NaN; its flat index in the plane
        inner = "    " * nd
        return (f"        float v = -CUDART_INF_F;\n        long long arg = {index(at)};\n{loops}"
                f"{inner}        {{\n{inner}            const long long q = {index(picks)};\n"
                f"{inner}            const float u = ld(xp[q]);\n"
                f"{inner}            if (u > v || u != u) {{ v = u; arg = q; }}\n{inner}        }}")  # fmt: skip
    if f.mode == "adaptive_avg":  # the window's sum, dim by dim in order, then eager's divisions
        div = "".join(f" / (float)(n{d} - s{d})" for d in range(nd))
        return (f"        float acc = 0.f;\n{loops}{'    ' * nd}            acc += ld(xp[{index(picks)}]);\n"
                f"        const float v = acc{div};")  # fmt: skip
    if f.mode == "cubic":  # each of the 4 rows blended along the last dim, then the rows (eager's order)

        def tap(d: int, k: int) -> str:
            return f"(long long)min(max(s{d} - 1 + {k}, 0), I{d} - 1)"

        rows = [" + ".join(f"ld(xp[{index([tap(0, kr), tap(1, kc)])}]) * c1[{kc}]" for kc in range(4))
                for kr in range(4)]  # fmt: skip
        return (
            "        const float v = "
            + " + ".join(f"({row}) * c0[{kr}]" for kr, row in enumerate(rows))
            + ";"
        )
    if f.mode != "linear":
        return f"        const float v = ld(xp[{index(at)}]);"

    def mix(d: int, picks: list[str]) -> str:
        if d == nd:
            return f"ld(xp[{index(picks)}])"
        lo = mix(d + 1, [*picks, f"(long long)s{d}"])
        hi = mix(d + 1, [*picks, f"(long long)n{d}"])
        return f"(w{d}0 * {lo} + w{d}1 * {hi})"

    return f"        const float v = {mix(0, [])};"


def vec_ok(f: Resample, vec: int) -> bool:
    """Whether a thread may compute `vec` consecutive outputs (one store): the last dim splits into whole
    groups, and the max pool (two outputs a point) keeps one a thread."""
    return vec == 1 or (f.mode != "adaptive_max" and f.out[-1] % vec == 0)


def render(r: Region, f: Resample, dtype: str, threads: int, vec: int = 1) -> Code:
    rid = r.rid
    t = ctype(dtype)
    nd = len(f.size)
    arg = f.mode == "adaptive_max"
    if not vec_ok(f, vec):
        raise ValueError(f"{vec} outputs a thread do not split the last dim of {f.out}")
    sig = Signature((ptr("x", t), ptr("y", t, const=False), *([ptr("yi", "long long", const=False)] if arg else []),
                     i64("total")))  # fmt: skip
    sizes = ", ".join(
        [*(f"I{d} = {v}" for d, v in enumerate(f.size)), *(f"O{d} = {v}" for d, v in enumerate(f.out))]
    )
    last = nd - 1
    split = [f"        const int q{last} = (int)(rest % Q{last});", f"        rest /= Q{last};"]
    for d in reversed(range(last)):
        split.append(f"        const int o{d} = (int)(rest % O{d});")
        split.append(f"        rest /= O{d};")
    per_dim = {"linear": _LINEAR, "cubic": _CUBIC}.get(f.mode, _WINDOW if f.mode in POOLS else _NEAREST)
    coords = [
        per_dim.strip("\n").format(d=d, coord=_coord(f, d) if f.mode not in POOLS else "") for d in range(nd)
    ]
    plane_in = " * ".join(f"(unsigned long long)I{d}" for d in range(nd))
    pad = "    " if vec > 1 else ""
    inner = textwrap.indent(f"{coords[last]}\n{_blend(f, t)}", pad)
    if vec > 1:  # the group's outputs in registers, then one store
        body = f"""        Vec<{t}, {vec}> pk;
#pragma unroll
        for (int j = 0; j < {vec}; ++j) {{
            const int o{last} = q{last} * {vec} + j;
{inner}
            pk.v[j] = cv<{t}>(v);
        }}
        vstore<{t}, {vec}>(y + (unsigned long long)i * {vec}, pk);"""
    else:
        body = f"""        const int o{last} = q{last};
{inner}
        y[i] = cv<{t}>(v);{chr(10) + "        yi[i] = arg;" if arg else ""}"""
    cuda = (
        (CUBIC_WEIGHTS if f.mode == "cubic" else "")
        + f"""namespace kp_{rid} {{
constexpr int {sizes}, Q{last} = O{last} / {vec};
}}  // namespace kp_{rid}
// I: the index type, 32 bits where the output has fewer than 2^31 elements (cheaper divisions by the sizes)
template <typename I>
__device__ __forceinline__ void kp_{rid}_body({sig.decls()}) {{
    using namespace kp_{rid};
    const I groups = (I)((unsigned long long)total / {vec});
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < groups; i += (I)gridDim.x * blockDim.x) {{
        I rest = i;
{chr(10).join(split)}
        const {t}* xp = x + (unsigned long long)rest * ({plane_in});  // rest: the (n, c) plane
{chr(10).join(coords[:last])}
{body}
    }}
}}
extern "C" __global__ void {launch_bounds(threads, 0)} kp_{rid}_resample({sig.decls()}) {{
    kp_{rid}_body<unsigned long long>({sig.names()});
}}
extern "C" __global__ void {launch_bounds(threads, 0)} kp_{rid}_resample32({sig.decls()}) {{
    kp_{rid}_body<unsigned>({sig.names()});
}}
"""
    )
    n = r.node
    x = n.args[0]
    sp_in = ", ".join(str(v) for v in f.size) + ("," if nd == 1 else "")
    sp_out = ", ".join(str(v) for v in f.out)
    what = f"{f.mode.replace('_', ' ')}{' (align_corners)' if f.align_corners else ''}"
    launcher = "\n".join([
        f"def _resample_{rid}(sms, x):",
        f'    """{what} {"pooling" if f.mode in POOLS else "interpolation"} ({nd}-D) on the CUDA cores, {vec} output(s) a thread, {threads} threads a block."""',
        f"    if tuple(x.shape[-{nd}:]) != ({sp_in}):",
        f"        raise ValueError(f'kernelpro expert: the resampling was compiled for inputs (..., {sp_in.rstrip(',')}), "
        "not {tuple(x.shape)}')",
        "    x = _contig(x)",
        f"    y = torch.empty((*x.shape[:-{nd}], {sp_out}), dtype={torch_dtype(dtype)}, device=x.device)",
        *(["    yi = torch.empty(y.shape, dtype=torch.int64, device=x.device)"] if arg else []),
        "    total = y.numel()",
        "    if total:",
        f"        grid = max(1, min(-(-total // {threads * vec}), sms * {2048 // threads} * 4))",
        "        if total < 2**31:",
        f"            kernels.kp_{rid}_resample32((grid,), ({threads},), ({sig.args()}))  # noqa: F821",
        "        else:",
        f"            kernels.kp_{rid}_resample((grid,), ({threads},), ({sig.args()}))  # noqa: F821",
        f"    return {'y, yi' if arg else 'y'}",
    ])  # fmt: skip
    kernels = (f"kp_{rid}_resample", f"kp_{rid}_resample32")
    return Code(cuda, launcher, f"_resample_{rid}", kernels, (x.name,), r.outputs)


__all__ = ["MODES", "POOLS", "Resample", "render", "vec_ok"]
