"""Scatters (families/scatter.py): scatter_add and scatter_reduce(sum), index_add and index_put, fp32.

Two launches: the destination's copy (16-byte accesses where both ends are aligned), then one thread an
element of the source, which finds its destination row by the index (the element's own entry for a scatter,
its row's entry for index_add / index_put, a negative one counted from the end for index_put as eager does) and
adds its value there by an atomic (or stores it, for index_put without accumulate). The tensors are seen as
[outer, rows along dim, inner]: the source's and the destination's rows differ in count only. An index
outside the destination is skipped (eager stops with a device-side assert there). The atomics' order is the
hardware's: sums of repeated destinations round as eager's own atomics do, in some order.
"""

from __future__ import annotations

from pipeline.generate.expert import ops
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import Code, launch_bounds
from pipeline.generate.expert.templates.signature import Signature, i64, ptr

_BODY = r"""namespace kp_{rid} {{
constexpr bool ACCUMULATE = {accumulate}, PER_ROW = {per_row}, WRAP = {wrap};
}}  // namespace kp_{rid}
template <int VEC>
__device__ __forceinline__ void kp_{rid}_copy_body(const float* __restrict__ x, float* __restrict__ out, long long n) {{
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i = first; i < n / VEC; i += stride)
        kp::vstore<float, VEC>(out + i * VEC, kp::vload<float, VEC>(x + i * VEC));
    for (long long i = n / VEC * VEC + first; i < n; i += stride) out[i] = x[i];
}}
extern "C" __global__ void {bounds} kp_{rid}_copy(const float* __restrict__ x, float* __restrict__ out, long long n) {{
    kp_{rid}_copy_body<1>(x, out, n);
}}
extern "C" __global__ void {bounds} kp_{rid}_copy4(const float* __restrict__ x, float* __restrict__ out, long long n) {{
    kp_{rid}_copy_body<4>(x, out, n);
}}
extern "C" __global__ void {bounds} kp_{rid}_scatter({decls}) {{
    using namespace kp_{rid};
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {{
        const long long k = i % inner, t = i / inner, j = t % rows, o = t / rows;
        long long to = idx[PER_ROW ? j : i];
        if (WRAP && to < 0) to += dest_rows;
        if (to < 0 || to >= dest_rows) continue;  // eager asserts on the device here
        const float v = {value};
        float* at = out + (o * dest_rows + to) * inner + k;
        if (ACCUMULATE) atomicAdd(at, v);
        else *at = v;
    }}
}}
"""


def render(r: Region, dim: int, per_row: bool, accumulate: bool, alpha: float, threads: int) -> Code:
    """dim: the scattered dim (of the destination, non-negative); per_row: the index holds one entry a source
    row (index_add, index_put) rather than one an element (scatter); alpha scales the source (index_add)."""
    rid = r.rid
    sig = Signature((
        ptr("idx", "long long", "ic"), ptr("src", "float", "sc"), ptr("out", "float", const=False), i64("n"),
        i64("rows"), i64("inner"), i64("dest_rows"),
    ))  # fmt: skip
    value = "src[i]" if alpha == 1 else f"src[i] * {ops.lit(alpha)}"
    cuda = _BODY.format(rid=rid, accumulate="true" if accumulate else "false", per_row="true" if per_row else "false",
                        wrap="true" if r.node.op == "index_put" else "false", value=value,
                        bounds=launch_bounds(threads, 0), decls=sig.decls())  # fmt: skip
    node = r.node
    if node.op == "index_put":
        x, index, src = node.args[0], node.args[1][0], node.args[2]
    else:
        x, index, src = node.args[0], node.args[2], node.args[3]
    blocks = f"max(1, min(-(-{{0}} // {threads}), sms * {max(1, 2048 // threads)}))"
    what = ("adds" if accumulate else "stores") + (
        " each source row at its index" if per_row else " each element"
    )
    launcher = "\n".join([
        f"def _scatter_{rid}(sms, x, index, src):",
        f'    """a copy of the destination, then {what} along dim {dim}."""',
        "    xc, ic, sc = _contig(x), _contig(index), _contig(src)",
        "    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)",
        "    m = xc.numel()",
        "    if m:",
        "        args = (xc, out, numpy.int64(m))",
        "        if xc.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0:",
        f"            kernels.kp_{rid}_copy4(({blocks.format('m // 4 + 1')},), ({threads},), args)  # noqa: F821",
        "        else:",
        f"            kernels.kp_{rid}_copy(({blocks.format('m')},), ({threads},), args)  # noqa: F821",
        "    n = sc.numel()",
        f"    rows = sc.shape[{dim}] if sc.dim() else 1",
        f"    inner = math.prod(sc.shape[{dim + 1}:])",
        f"    dest_rows = x.shape[{dim}] if x.dim() else 1",
        "    if n and m:",
        f"        kernels.kp_{rid}_scatter(({blocks.format('n')},), ({threads},), ({sig.args()}))  # noqa: F821",
        "    return out",
    ])  # fmt: skip
    return Code(cuda, launcher, f"_scatter_{rid}", (f"kp_{rid}_copy", f"kp_{rid}_copy4", f"kp_{rid}_scatter"),
                (x.name, index.name, src.name), r.outputs)  # fmt: skip


__all__ = ["render"]
