"""Max and average pooling, 1-D to 3-D, on the CUDA cores (which pools it takes: families/pool.py).

A pool reads each input about (window / stride^dims) times and does one compare or add per read: bound by
memory, so each thread computes `outs` outputs of one output row (consecutive threads take consecutive
pixels: a warp's loads coalesce at the stride), the window's rows read once for all of them through the
cache. The geometry is compiled in (1-D and 2-D pools are 3-D ones with unit extents in front), the batch
and channel count are not. Max pooling propagates NaN as PyTorch does; average pooling divides as PyTorch
does: by the window clipped to the padded input (count_include_pad), by its valid elements, or by the
divisor override.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import Code, ctype, launch_bounds, torch_dtype
from pipeline.generate.expert.templates.signature import Signature, i64, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.pool import PoolPlan


@dataclass(frozen=True)
class PoolForm:
    op: str  # "max" or "avg"
    dims: int  # 1, 2 or 3
    size: tuple[int, int, int]  # input (D, H, W), unit extents in front for fewer dims
    out: tuple[int, int, int]
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int]
    pad: tuple[int, int, int]
    dil: tuple[int, int, int]
    include_pad: bool = True  # average: the padding counts in the divisor
    divisor: int = 0  # average: the divisor override (0: none)


def lanes(f: PoolForm, outs: int) -> int:
    return -(-f.out[2] // outs)


WARP_SMEM_MAX = 48 * 1024  # a block's static shared memory: its warps' staged spans and output tiles
WINDOW_MAX = 64  # floats of a thread's window span held in registers


def span(f: PoolForm, outs: int) -> int:
    """The inputs one window row of `outs` consecutive outputs reads."""
    return (outs - 1) * f.stride[2] + (f.kernel[2] - 1) * f.dil[2] + 1


def vec_window(f: PoolForm, outs: int) -> bool:
    """Whether a thread's window span starts on a 16-byte boundary of its warp's staged row (read as float4)."""
    return outs * f.stride[2] % 4 == 0


def window_regs(f: PoolForm, outs: int) -> int:
    n = span(f, outs)
    return -(-n // 4) * 4 if vec_window(f, outs) else n


def win_floats(f: PoolForm, outs: int) -> int:
    """A warp's staged window row: its 32 * outs outputs' span, rounded up for a lane's last float4 read."""
    last = (32 - 1) * outs * f.stride[2] + window_regs(f, outs)
    return -(-max(span(f, 32 * outs), last) // 4) * 4


def lane_loads(f: PoolForm, outs: int) -> int:
    """The loads a lane issues to stage one window row of its warp's run."""
    return -(-span(f, 32 * outs) // 32)


STAGED_LOADS_MAX = 48  # a lane's loads in flight while its warp stages all its window rows (registers)


def overlaps(f: PoolForm) -> bool:
    """Whether neighbouring windows share inputs along W (what staging saves)."""
    return (f.kernel[2] - 1) * f.dil[2] + 1 > f.stride[2]


def staged(f: PoolForm, rp: PoolPlan) -> bool:
    """Whether the plan's warp stages the window rows of its outputs (all of them at once: every load of them
    in flight before any is used) in its shared memory, with its output tile."""
    if not (rp.stage and overlaps(f)):
        return False
    t = rows_span(f, columns(f, rp))
    smem = (t * win_floats(f, rp.outs) + 32 * (rp.outs + 1)) * 4 * (rp.threads // 32)
    loads = t * lane_loads(f, rp.outs)
    return window_regs(f, rp.outs) <= WINDOW_MAX and loads <= STAGED_LOADS_MAX and smem <= WARP_SMEM_MAX


def overlaps_rows(f: PoolForm) -> bool:
    """Whether vertically neighbouring windows share input rows (what a thread's column of outputs saves)."""
    return f.dims >= 2 and (f.kernel[1] - 1) * f.dil[1] + 1 > f.stride[1]


def rows_span(f: PoolForm, ro: int) -> int:
    """The input rows the windows of a column of `ro` outputs span."""
    return (ro - 1) * f.stride[1] + (f.kernel[1] - 1) * f.dil[1] + 1


def columns(f: PoolForm, rp: PoolPlan) -> int:
    """Outputs along H a thread computes: its window rows are read once for all of them (at most 64 rows,
    the bits of the mask of those some window takes)."""
    fits = rows_span(f, rp.rows) <= 64
    return rp.rows if rp.rows > 1 and overlaps_rows(f) and fits else 1


def render(r: Region, f: PoolForm, rp: PoolPlan, dtype: str) -> Code:
    rid = r.rid
    t = ctype(dtype)
    sig = Signature((ptr("x", t), ptr("out", t, const=False), i64("rows")))
    (kd, kh, kw), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = f.kernel, f.stride, f.pad, f.dil
    (idp, ih, iw), (od, oh, ow) = f.size, f.out
    if f.op == "max":
        init, step = "-CUDART_INF_F", "acc[v] = (xv > acc[v] || xv != xv) ? xv : acc[v];"
        finish = "const float res = acc[u];"
    else:
        init, step = "0.f", "acc[v] += xv;"
        if f.divisor:
            finish = f"const float res = acc[u] / {float(f.divisor)!r}f;"
        elif f.include_pad:  # the window clipped to the padded input
            finish = (
                "const int x0 = ox * SW - PW, x1 = min(x0 + KW, IW + PW);\n"
                "        const float res = acc[u] / (float)((z1 - z0) * (y1 - y0) * (x1 - x0));"
            )
        else:  # the window's elements inside the input
            finish = (
                "const int x0 = ox * SW - PW, x1 = min(x0 + KW, IW);\n"
                "        const float res = acc[u] / (float)((min(z1, ID) - max(z0, 0)) * (min(y1, IH) - max(y0, 0)) "
                "* (x1 - max(x0, 0)));"
            )
    ro, st = columns(f, rp), staged(f, rp)
    body, tiling = _DIRECT, f"constexpr int LANES = {lanes(f, rp.outs)};"
    if ro > 1 or st:
        used = sorted({r * sh + ky * dh for r in range(ro) for ky in range(kh)})
        hstep = step.replace("acc[v]", "h[v]")
        merge = step.replace("acc[v]", "acc[r][v]").replace("xv", "h[v]")
        body = _fill(_fill(_STAGED if st else _ROWS, "acc_init", _ACC_INIT), "merge_rows", _MERGE_ROWS)
        body = body.replace("{hstep}", hstep).replace("{merge}", merge)
        tiling = (
            ("" if st else f"constexpr int LANES = {lanes(f, rp.outs)};\n")
            + f"constexpr int RO = {ro}, OHB = (OH + RO - 1) / RO;\n"
            f"constexpr int T = {rows_span(f, ro)};  // the input rows a thread's RO windows span\n"
            f"constexpr unsigned long long USED = {sum(1 << t for t in used):#x}ull;"
            "  // the rows some window takes (dilation may skip some), a bit each"
        )
        finish = finish.replace("acc[u]", "acc[r][u]")
    if st:
        tiling += (
            f"\nconstexpr int WARPS = {rp.threads // 32}, WT = 32 * OUTS, TILES = (OW + WT - 1) / WT;"
            "  // a warp's run of a row\n"
            "constexpr int WSPAN = (WT - 1) * SW + (KW - 1) * DW + 1;  // the inputs one window row of it reads\n"
            f"constexpr int NW = {window_regs(f, rp.outs)}, NL = (WSPAN + 31) / 32;"
            "  // a lane's window registers, its loads of a staged row\n"
            f"constexpr int WIN = {win_floats(f, rp.outs)}, OT = 32 * (OUTS + 1);"
            "  // a staged row, the output tile (floats)\n"
            f"constexpr bool VEC = {'true' if vec_window(f, rp.outs) else 'false'};"
            "  // a thread's window starts on a 16-byte boundary"
        )
    consts = f"""namespace kp_{rid} {{
constexpr int OUTS = {rp.outs};
constexpr int ID = {idp}, IH = {ih}, IW = {iw}, OD = {od}, OH = {oh}, OW = {ow};
constexpr int KD = {kd}, KH = {kh}, KW = {kw}, SD = {sd}, SH = {sh}, SW = {sw};
constexpr int PD = {pd}, PH = {ph}, PW = {pw}, DD = {dd}, DH = {dh}, DW = {dw};
{tiling}
}}  // namespace kp_{rid}
extern "C" __global__ void {launch_bounds(rp.threads, 0)} kp_{rid}_pool({sig.decls()}) {{
    using namespace kp_{rid};
"""
    fill = "-CUDART_INF_F" if f.op == "max" else "0.f"  # (staged) outside the input: no effect on the result
    window = textwrap.indent(_WINDOW.format(t=t, init=init), "    ")
    cuda = consts + body.format(t=t, step=step, finish=finish, fill=fill, window=window, init=init) + "}\n"
    n = r.node
    x = n.args[0]
    in_shape = tuple(n.shape or ())[: -f.dims]  # (N, C) or (C,): the leading dims
    lead = len(in_shape)
    sp_in = ", ".join(str(v) for v in f.size[3 - f.dims :])
    sp_out = ", ".join(str(v) for v in f.out[3 - f.dims :])
    if st:  # a warp a run of 32 * OUTS outputs of a row (or of RO rows), blocks over the runs
        grid = f"min(-(-rows * {-(-f.out[2] // (32 * rp.outs))} // {rp.threads // 32}), MAX_GRID_X)"
    else:
        grid = f"-(-rows * {lanes(f, rp.outs)} // {rp.threads})"
    # the thread rows: output rows, or with a column of RO outputs a thread, groups of RO of them
    nrows = f"out.numel() // {oh * ow} * {-(-oh // ro)}" if ro > 1 else f"out.numel() // {ow}"
    launcher = "\n".join([
        f"def _pool_{rid}(sms, x):",
        f'    """{f.op.capitalize()} pooling ({f.dims}-D) on the CUDA cores: {rp.outs} outputs a thread, '
        f'{rp.threads} threads a block{", window rows staged in shared memory a warp" if st else ""}'
        f'{f", a column of {ro} outputs" if ro > 1 else ""}."""',
        f"    if tuple(x.shape[{lead}:]) != ({sp_in},):",
        f"        raise ValueError(f'kernelpro expert: the pool was compiled for inputs (..., {sp_in}), not "
        "{tuple(x.shape)}')",
        "    x = _contig(x)",
        f"    out = torch.empty((*x.shape[:{lead}], {sp_out}), dtype={torch_dtype(dtype)}, device=x.device)",
        f"    rows = {nrows}",
        "    if rows:",
        f"        kernels.kp_{rid}_pool(({grid},), ({rp.threads},), ({sig.args()}))  # noqa: F821",
        "    return out",
    ])  # fmt: skip
    return Code(cuda, launcher, f"_pool_{rid}", (f"kp_{rid}_pool",), (x.name,), r.outputs)


# An output row's plane, its window's first input row and plane (and, for the average, the padded window's
# ends) and the accumulators: the start of both kernels' work on a row, indented to where it goes.
_WINDOW = """const int oy = (int)(row % OH), oz = (int)((row / OH) % OD);
const {t}* xp = x + (row / ((long long)OH * OD)) * ((long long)ID * IH * IW);
const int z0 = oz * SD - PD, y0 = oy * SH - PH;
const int z1 = min(z0 + KD, ID + PD), y1 = min(y0 + KH, IH + PH);  // (average) the padded window's end
(void)z1; (void)y1;
float acc[OUTS];
#pragma unroll
for (int v = 0; v < OUTS; ++v) acc[v] = {init};"""


# Consecutive threads take consecutive pixels (OUTS of them LANES apart): each warp load is one run, the
# window's other taps hit the cache.
_DIRECT = """    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * LANES) return;
    const long long row = i / LANES;  // (plane * OD + oz) * OH + oy, plane = n * C + c
    const int lane = (int)(i - row * LANES);
{window}
    #pragma unroll
    for (int kz = 0; kz < KD; ++kz) {{
        const int iz = z0 + kz * DD;
        if ((unsigned)iz >= (unsigned)ID) continue;
        #pragma unroll
        for (int ky = 0; ky < KH; ++ky) {{
            const int iy = y0 + ky * DH;
            if ((unsigned)iy >= (unsigned)IH) continue;
            const {t}* xr = xp + ((long long)iz * IH + iy) * IW;
            #pragma unroll
            for (int kx = 0; kx < KW; ++kx) {{
                #pragma unroll
                for (int v = 0; v < OUTS; ++v) {{
                    const int ox = lane + v * LANES, ix = ox * SW - PW + kx * DW;
                    if (ox < OW && (unsigned)ix < (unsigned)IW) {{
                        const float xv = ld(xr[ix]);
                        {step}
                    }}
                }}
            }}
        }}
    }}
    #pragma unroll
    for (int u = 0; u < OUTS; ++u) {{
        const int ox = lane + u * LANES;
        if (ox >= OW) continue;
        {finish}
        out[row * OW + ox] = cv<{t}>(res);
    }}
"""


def _fill(body: str, name: str, snippet: str) -> str:
    """The body with its line `{name}` replaced by the snippet, at that line's indentation."""
    lines = body.split("\n")
    at = [i for i, line in enumerate(lines) if line.strip() == "{" + name + "}"]
    assert len(at) == 1, name
    pad = lines[at[0]][: len(lines[at[0]]) - len(lines[at[0]].lstrip())]
    lines[at[0]] = textwrap.indent(snippet, pad)
    return "\n".join(lines)


# What both column kernels (_ROWS, _STAGED) share: RO x OUTS accumulators, and the merge of an input row's
# reduction across the window's width (h) into each output whose window holds the row (r * SH + ky * DH ==
# t: known at compile time, unrolled away).
_ACC_INIT = """float acc[RO][OUTS];
#pragma unroll
for (int r = 0; r < RO; ++r)
    #pragma unroll
    for (int v = 0; v < OUTS; ++v) acc[r][v] = {init};"""
_MERGE_ROWS = """#pragma unroll
for (int r = 0; r < RO; ++r)
    #pragma unroll
    for (int ky = 0; ky < KH; ++ky)
        if (r * SH + ky * DH == t) {{
            #pragma unroll
            for (int v = 0; v < OUTS; ++v) {merge}
        }}"""


# A column of RO outputs a thread (and OUTS of each row, LANES apart): each input row its RO windows span is
# read once, reduced across the window's width for every column (h), and that reduction merged into each
# output whose window holds the row (r * SH + ky * DH == t: known at compile time, unrolled away). A 4 x 4
# max pool then loads 7 window rows for 4 outputs where one output a thread loaded 16: the loads hit L1,
# whose wavefronts, not DRAM, set the pace of a pool with a large window.
_ROWS = """    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * LANES) return;
    const long long row = i / LANES;  // (plane * OD + oz) * OHB + its group of RO output rows
    const int lane = (int)(i - row * LANES);
    const int oy0 = (int)(row % OHB) * RO, oz = (int)((row / OHB) % OD);
    const long long plane = row / ((long long)OHB * OD);
    const {t}* xp = x + plane * ((long long)ID * IH * IW);
    const int z0 = oz * SD - PD, z1 = min(z0 + KD, ID + PD);  // (average) the padded window's end
    (void)z1;
    {acc_init}
    #pragma unroll
    for (int kz = 0; kz < KD; ++kz) {{
        const int iz = z0 + kz * DD;
        if ((unsigned)iz >= (unsigned)ID) continue;
        #pragma unroll
        for (int t = 0; t < T; ++t) {{
            const int iy = oy0 * SH - PH + t;
            if (!((USED >> t) & 1) || (unsigned)iy >= (unsigned)IH) continue;
            const {t}* xr = xp + ((long long)iz * IH + iy) * IW;
            float h[OUTS];
            #pragma unroll
            for (int v = 0; v < OUTS; ++v) h[v] = {init};
            #pragma unroll
            for (int kx = 0; kx < KW; ++kx) {{
                #pragma unroll
                for (int v = 0; v < OUTS; ++v) {{
                    const int ox = lane + v * LANES, ix = ox * SW - PW + kx * DW;
                    if (ox < OW && (unsigned)ix < (unsigned)IW) {{
                        const float xv = ld(xr[ix]);
                        {hstep}
                    }}
                }}
            }}
            {merge_rows}
        }}
    }}
    #pragma unroll
    for (int r = 0; r < RO; ++r) {{
        const int oy = oy0 + r;
        if (oy >= OH) continue;
        const int y0 = oy * SH - PH, y1 = min(y0 + KH, IH + PH);  // (average) the padded window's rows
        (void)y1;
        #pragma unroll
        for (int u = 0; u < OUTS; ++u) {{
            const int ox = lane + u * LANES;
            if (ox >= OW) continue;
            {finish}
            out[((plane * OD + oz) * OH + oy) * OW + ox] = cv<{t}>(res);
        }}
    }}
"""

# Overlapping windows (stride < window along W): a warp takes a run of WT = 32 * OUTS outputs of a row (or of
# RO rows). The input rows their windows span are staged in the warp's shared memory, coalesced (the op's
# identity outside the input), every row's loads issued before any is stored (a load then its store, row
# after row, left one load in flight a lane); each lane then reads its OUTS consecutive outputs' window span
# of each row into registers (as float4 where it starts on a 16-byte boundary): every tap is a register,
# where the direct kernel issued a load per tap and output. The results go out through a padded tile of
# the warp's own, so the stores coalesce whatever the row's alignment. Only __syncwarp: warps never wait for
# each other.
_STAGED = """    __align__(16) __shared__ float smem[WARPS][T * WIN + OT];  // WIN and OT are multiples of 4
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    float* const win = smem[wid];
    float* const tile = smem[wid] + T * WIN;
    const long long items = rows * TILES;
    for (long long it = (long long)blockIdx.x * WARPS + wid; it < items; it += (long long)gridDim.x * WARPS) {{
        const long long row = it / TILES;  // (plane * OD + oz) * OHB + its group of RO output rows: warp-uniform
        const int ox0 = (int)(it - row * TILES) * WT, ix0 = ox0 * SW - PW;
        const int oy0 = (int)(row % OHB) * RO, oz = (int)((row / OHB) % OD);
        const long long plane = row / ((long long)OHB * OD);
        const {t}* xp = x + plane * ((long long)ID * IH * IW);
        const int z0 = oz * SD - PD, z1 = min(z0 + KD, ID + PD);  // (average) the padded window's end
        (void)z1;
        {acc_init}
        for (int kz = 0; kz < KD; ++kz) {{
            const int iz = z0 + kz * DD;
            if ((unsigned)iz >= (unsigned)ID) continue;
            __syncwarp();  // the last plane's window reads are done
            {{
                float v_[T][NL];
                #pragma unroll
                for (int t = 0; t < T; ++t) {{
                    const int iy = oy0 * SH - PH + t;
                    const bool used = ((USED >> t) & 1) && (unsigned)iy < (unsigned)IH;
                    const {t}* xr = xp + ((long long)iz * IH + iy) * IW;
                    #pragma unroll
                    for (int k = 0; k < NL; ++k) {{
                        const int e = lane + 32 * k, ix = ix0 + e;
                        v_[t][k] = used && e < WSPAN && (unsigned)ix < (unsigned)IW ? ld(xr[ix]) : {fill};
                    }}
                }}
                #pragma unroll
                for (int t = 0; t < T; ++t)
                    #pragma unroll
                    for (int k = 0; k < NL; ++k)
                        if (((USED >> t) & 1) && lane + 32 * k < WSPAN) win[t * WIN + lane + 32 * k] = v_[t][k];
            }}
            __syncwarp();
            #pragma unroll
            for (int t = 0; t < T; ++t) {{
                const int iy = oy0 * SH - PH + t;
                if (!((USED >> t) & 1) || (unsigned)iy >= (unsigned)IH) continue;  // warp-uniform
                float w[NW];
                const float* const mine = win + t * WIN + lane * OUTS * SW;
                if constexpr (VEC) {{
                    #pragma unroll
                    for (int j = 0; j < NW / 4; ++j) {{
                        const float4 q = reinterpret_cast<const float4*>(mine)[j];
                        w[4 * j] = q.x; w[4 * j + 1] = q.y; w[4 * j + 2] = q.z; w[4 * j + 3] = q.w;
                    }}
                }} else {{
                    #pragma unroll
                    for (int j = 0; j < NW; ++j) w[j] = mine[j];
                }}
                float h[OUTS];
                #pragma unroll
                for (int v = 0; v < OUTS; ++v) h[v] = {init};
                #pragma unroll
                for (int kx = 0; kx < KW; ++kx) {{
                    #pragma unroll
                    for (int v = 0; v < OUTS; ++v) {{
                        const float xv = w[v * SW + kx * DW];
                        {hstep}
                    }}
                }}
                {merge_rows}
            }}
        }}
        #pragma unroll
        for (int r = 0; r < RO; ++r) {{
            const int oy = oy0 + r;
            if (oy >= OH) continue;  // warp-uniform
            const int y0 = oy * SH - PH, y1 = min(y0 + KH, IH + PH);  // (average) the padded window's rows
            (void)y1;
            #pragma unroll
            for (int u = 0; u < OUTS; ++u) {{
                const int ox = ox0 + lane * OUTS + u;  // (average) the divisor's window
                (void)ox;
                {finish}
                tile[lane * (OUTS + 1) + u] = res;
            }}
            __syncwarp();
            #pragma unroll
            for (int j = 0; j < OUTS; ++j) {{
                const int e = j * 32 + lane, ox = ox0 + e;
                if (ox < OW)
                    out[((plane * OD + oz) * OH + oy) * OW + ox] = cv<{t}>(tile[e / OUTS * (OUTS + 1) + e % OUTS]);
            }}
            __syncwarp();  // the tile is refilled by the next row
        }}
    }}
"""
