"""Our own grouped and depthwise convolution, forward or transposed, on the CUDA cores (which convolutions it
takes, and its plans: families/conv_direct.py). A transposed one gathers: each output sums the inputs whose
taps land on it (i * stride - pad + k * dilation == o), so no atomics and the same epilogue on the store.

A depthwise or grouped convolution does little work per output (C_in / groups x taps products), too little
for the tensor cores' tiles: an implicit GEMM per group would be an N of one output channel. So each thread
computes `outs` outputs of one output row (pixels lane, lane + lanes, ...: consecutive threads take
consecutive pixels, so a warp's loads coalesce at stride 1) in `chans` output channels of one group,
summing in fp32 over the group's input channels and the taps: each weight read once for its outputs, each
input once for its channels (a grouped convolution with 8 or 16 channels a group reads its inputs that
many times less than one channel a thread would). With 4 channels or more the weight is re-laid
channel-innermost first (vector loads of a tap's channels), and with `ci_inner` the input channels are the
innermost loop (a tap's coordinates and bounds computed once for all of them). A transposed one with a
stride along the
row takes its pixels one phase (ox mod stride) at a time: a warp's threads then agree on which taps land,
where consecutive pixels would each skip a different (stride - 1) in stride of them, the warp running
all, and they read consecutive inputs. Where the windows of vertically neighbouring outputs share input
rows (a forward convolution whose window is taller than its stride), a thread may take a column of `rows`
output rows: each input row their windows span read once for all of them, where a thread an output row
read it again for each (through L2). The geometry is compiled in (1-D and 2-D
convolutions are 3-D ones with unit extents in front), the batch size is not.
"""

from __future__ import annotations

import math
import textwrap
from typing import TYPE_CHECKING

from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates import gemm
from pipeline.generate.expert.templates.code import Code, ctype, launch_bounds, torch_dtype
from pipeline.generate.expert.templates.conv_tf32 import (
    ConvEpilogue,
    ConvForm,
    chain_value,
    prepare_operands,
    sinks_blocked,
)
from pipeline.generate.expert.templates.signature import Signature, i64, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.conv_direct import DirectPlan


def phases(f: ConvForm) -> int:
    """A transposed convolution's output columns split by ox mod stride: the columns of one phase all take the
    same taps (those with (ox + pad - kx * dil) % stride == 0), and their inputs are consecutive."""
    return f.stride[2] if f.transposed else 1


def lanes(f: ConvForm, outs: int) -> int:
    """Threads a row of OW outputs takes (over all its phases)."""
    per = -(-f.out[2] // phases(f))
    return phases(f) * -(-per // outs)


# Staged stores (DirectPlan.staged): a block computes a segment of a row, all its phases (a warp a phase's
# PL consecutive lanes), puts the sums in shared memory and stores the segment's columns in order. Unstaged,
# consecutive lanes of a phase write columns `stride` apart: a warp's store touches `stride` times the
# sectors it fills (5 for KernelBench's stride-5 transposed convolution, whose output is 830 MB).
STAGE_BYTES = 48 * 1024  # static shared memory of a block


def stage_lanes(f: ConvForm) -> int:
    """Threads of a phase in a staged block: a warp, two while that keeps the block under 128 threads."""
    return 64 if phases(f) * 64 <= 128 else 32


def segment(f: ConvForm, rp: DirectPlan) -> int:
    """Output columns a staged block stores: every phase's stage_lanes x outs columns."""
    return phases(f) * stage_lanes(f) * rp.outs


def why_unstageable(f: ConvForm, rp: DirectPlan) -> str:
    """Why a plan's stores cannot be staged, or "" when they can."""
    if phases(f) == 1:
        return "a convolution without phases stores consecutive columns already"
    if phases(f) * stage_lanes(f) > 1024:
        return f"{phases(f)} phases of a warp each are more than a block's 1024 threads"
    if rp.chans * segment(f, rp) * 4 > STAGE_BYTES:
        return (
            f"{rp.chans} channels of {segment(f, rp)} columns do not fit {STAGE_BYTES} bytes of shared memory"
        )
    return ""


def block_threads(f: ConvForm, rp: DirectPlan) -> int:
    return phases(f) * stage_lanes(f) if rp.staged else rp.threads


def grid_expr(f: ConvForm, rp: DirectPlan) -> str:
    """The launcher's block count for `rows` (the batch's output rows of CH channels, or with a column of RO
    rows a thread, their columns)."""
    if rp.staged:
        return f"rows * {-(-f.out[2] // segment(f, rp))}"
    return f"-(-rows * {lanes(f, rp.outs)} // {rp.threads})"


# A column of output rows a thread (DirectPlan.rows): where the windows of vertically neighbouring outputs
# share input rows, a thread computes RO of them (OUTS outputs of each) and reads each input row their windows
# span once, the products merged into every output row whose window holds it; a thread an output row read
# KH rows, its neighbours the same rows again through L2 (KernelBench's depthwise 3 x 3 at stride 1: L2 at 89%
# of its peak with 3x the input in L2 traffic, the DRAM read once).
ROWS_SPAN_MAX = 64  # input rows a column's windows span: the bits of USED, the rows some window takes


def overlaps_rows(f: ConvForm) -> bool:
    """Whether vertically neighbouring outputs' windows share input rows (what a column of outputs saves). A
    transposed one gathers: which taps land on an output depends on the output's own coordinates."""
    return not f.transposed and (f.kernel[1] - 1) * f.dil[1] + 1 > f.stride[1]


def rows_span(f: ConvForm, ro: int) -> int:
    """The input rows the windows of `ro` consecutive output rows span."""
    return (ro - 1) * f.stride[1] + (f.kernel[1] - 1) * f.dil[1] + 1


def why_no_rows(f: ConvForm, rp: DirectPlan) -> str:
    """Why a thread cannot take the plan's column of rp.rows output rows, or "" when it can (or rows is 1)."""
    if rp.rows == 1:
        return ""
    if rp.rows < 1:
        return f"{rp.rows} output rows a thread"
    if not overlaps_rows(f):
        return "neighbouring output rows share no input row (a transposed one, or a stride past the window)"
    if rows_span(f, rp.rows) > ROWS_SPAN_MAX:
        return f"{rp.rows} output rows span {rows_span(f, rp.rows)} input rows, more than {ROWS_SPAN_MAX}"
    return ""


# A tap loop is unrolled while its body stays within this many FMAs a thread: KernelBench's grouped 3-D one
# fully unrolled (105 taps x 8 outputs of one channel) took 255 registers and ran 3.2x slower than 2 outputs
# (80 registers) on the H200.
UNROLLED_FMAS = 256
# A column of rows with its width taps unrolled too: ptxas hoisted the loads of the rows ahead, 3 x 5 and
# 3 x 7 windows (no padding) at 4 rows of 8 outputs took 176 and 214 registers (64 with the width taps
# rolled), 3 x 3 ones 64 either way.
ROWS_UNROLLED_KW = 3


def unrolled(f: ConvForm, rp: DirectPlan) -> tuple[str, str, str]:
    """The unroll pragmas' counts for the depth, height and width tap loops ("" all, "1" none), each while
    the body stays within UNROLLED_FMAS: the width taps always with input channels outermost (their
    phase test is uniform), with them innermost only while small too (7 taps x 4 channels x 16 products
    took 128 registers and spilled). With a column of rows the input rows' loop is unrolled whatever the
    height flag says (which outputs a row feeds must be known at compile time), and the width taps only
    for a window at most ROWS_UNROLLED_KW wide."""
    (kd, kh, kw) = f.kernel
    per = rp.outs * rp.chans * rp.rows * (ci_unroll(f, rp) if rp.ci_inner else 1)
    kx = (not rp.ci_inner or per * kw <= UNROLLED_FMAS) and (rp.rows == 1 or kw <= ROWS_UNROLLED_KW)
    body = per * kw if kx else per
    ky = kx and body * kh <= UNROLLED_FMAS
    kz = ky and body * kh * kd <= UNROLLED_FMAS
    return ("" if kz else "1"), ("" if ky else "1"), ("" if kx else "1")


_XV = """// each input read once for the CH channels; a tap off the input adds a zero (a flag an
// output would be a predicate each, and a thread has 7: they spilled)"""


def _fma(t: str, vw: bool, w4: str, w1: str, indent: str) -> str:
    """The products of one input channel and tap: the CH weights (CH / 4 vector loads at w4 + q * 4 when
    channel-inner, else scalar loads at w1 with c the channel) times the OUTS inputs xv."""
    if vw:
        body = f"""#pragma unroll
for (int q = 0; q < CH / 4; ++q) {{
    const Vec<{t}, 4> b = vload<{t}, 4>({w4} + q * 4);
    #pragma unroll
    for (int e = 0; e < 4; ++e)
        #pragma unroll
        for (int v = 0; v < OUTS; ++v) acc[q * 4 + e][v] = fmaf(xv[v], ld(b.v[e]), acc[q * 4 + e][v]);
}}"""
    else:
        body = f"""#pragma unroll
for (int c = 0; c < CH; ++c) {{
    const float wv = ld({w1});
    #pragma unroll
    for (int v = 0; v < OUTS; ++v) acc[c][v] = fmaf(xv[v], wv, acc[c][v]);
}}"""
    return "\n".join(indent + line for line in body.splitlines())


def _tap_loops(t: str, rolled: tuple[str, str, str], xr: str, body: str) -> str:
    """The depth, height and width tap loops (taps off the input skipped; with a stride along the row, the
    taps of another phase), xr the input row of the tap's (iz, iy), around `body`."""
    return f"""#pragma unroll {rolled[0]}
for (int kz = 0; kz < KD; ++kz) {{
    const int iz = src(oz, kz, SD, PD, DD, ID);
    if (iz < 0) continue;
    #pragma unroll {rolled[1]}
    for (int ky = 0; ky < KH; ++ky) {{
        const int iy = src(oy, ky, SH, PH, DH, IH);
        if (iy < 0) continue;
        const {t}* xr = {xr};
        #pragma unroll {rolled[2]}
        for (int kx = 0; kx < KW; ++kx) {{
            if (TRANSPOSED && (phase + PW - kx * DW) % SW != 0) continue;  // no column of this phase
{textwrap.indent(body.rstrip(), " " * 12)}
        }}
    }}
}}"""


def _row_loops(t: str, rolled: tuple[str, str, str], xr: str, body: str) -> str:
    """A column of output rows' tap loops: the depth taps, the input rows its windows span (each read once
    for all of them), the width taps, xr the input row of (iz, iy), around `body`. Unrolled along the rows:
    which output rows and taps a row feeds must be known at compile time (acc's row index a register, not
    local memory)."""
    return f"""#pragma unroll {rolled[0]}
for (int kz = 0; kz < KD; ++kz) {{
    const int iz = src(oz, kz, SD, PD, DD, ID);
    if (iz < 0) continue;
    #pragma unroll
    for (int t = 0; t < T; ++t) {{
        const int iy = oy0 * SH - PH + t;
        if (!((USED >> t) & 1) || (unsigned)iy >= (unsigned)IH) continue;
        const {t}* xr = {xr};
        #pragma unroll {rolled[2]}
        for (int kx = 0; kx < KW; ++kx) {{
{textwrap.indent(body.rstrip(), " " * 12)}
        }}
    }}
}}"""


def _merged(fma: str, tap: str = "") -> str:
    """A column of rows: the products of input row t go to each output row r whose window takes it at tap ky
    (r * SH + ky * DH == t: known at compile time, the other pairs unrolled away); `tap` declares what the
    products need of ky."""
    inner = "\n".join(filter(None, [tap, fma.replace("acc[", "acc[r][")]))
    return f"""#pragma unroll
for (int r = 0; r < RO; ++r)
    #pragma unroll
    for (int ky = 0; ky < KH; ++ky)
        if (r * SH + ky * DH == t) {{
{textwrap.indent(inner, " " * 12)}
        }}"""


def _outer_nest(t: str, vw: bool, rolled: tuple[str, str, str], _u: int, ro: int = 1) -> str:
    """Input channels outermost: each tap's input coordinates recomputed for every channel."""
    w4 = "wc + (ci * TAPS + (kz * KH + ky) * KW + kx) * COUT_G"
    w1 = "wc[ci * WCI + c * WCO + (kz * KH + ky) * KW + kx]"
    fma = _fma(t, vw, w4, w1, "")
    body = f"""{_XV}
float xv[OUTS];
#pragma unroll
for (int v = 0; v < OUTS; ++v) {{
    const int ox = ox_of(v), ix = ox < OW ? src(ox, kx, SW, PW, DW, IW) : -1;
    xv[v] = ix >= 0 ? ld(xr[ix]) : 0.f;
}}
{_merged(fma) if ro > 1 else fma}"""
    xr = "xg + ci * CHW + ((long long)iz * IH + iy) * IW"
    loops = (
        _row_loops(t, rolled, xr, body)
        if ro > 1
        else _tap_loops(t, rolled, xr, textwrap.indent(body, " " * 12))
    )
    return (
        "    #pragma unroll 1\n    for (int ci = 0; ci < CIN_G; ++ci) {\n"
        + textwrap.indent(loops, " " * 8)
        + "\n    }"
    )


def _inner_nest(t: str, vw: bool, rolled: tuple[str, str, str], u: int, ro: int = 1) -> str:
    """Input channels innermost: a tap's input columns and their bounds computed once for all channels (its
    inputs CHW apart), the weights of a tap (channel-inner: (groups, taps, C_in / groups, C_out / groups))
    read in order. With a column of rows the tap (its ky) is known only where a product lands."""
    w4 = "wt + ci * COUT_G"
    w1 = "wc[ci * WCI + c * WCO + tap]"
    wt = f"\nconst {t}* wt = wc + tap * CIN_G * COUT_G;" if vw else ""
    tap = "const int tap = (kz * KH + ky) * KW + kx;"
    if ro > 1:
        products = textwrap.indent(_merged(_fma(t, vw, w4, w1, ""), tap + wt), "    ")
        tap = wt = ""
    else:
        products, tap = _fma(t, vw, w4, w1, "    "), tap + "\n"
    body = f"""{tap}int ix[OUTS];
#pragma unroll
for (int v = 0; v < OUTS; ++v) {{
    const int ox = ox_of(v);
    ix[v] = ox < OW ? src(ox, kx, SW, PW, DW, IW) : -1;
}}{wt}
#pragma unroll {u}
for (int ci = 0; ci < CIN_G; ++ci) {{
{textwrap.indent(_XV, "    ")}
    float xv[OUTS];
    #pragma unroll
    for (int v = 0; v < OUTS; ++v) xv[v] = ix[v] >= 0 ? ld(xr[ci * CHW + ix[v]]) : 0.f;
{products}
}}"""
    loops = (_row_loops if ro > 1 else _tap_loops)(t, rolled, "xg + ((long long)iz * IH + iy) * IW", body)
    return textwrap.indent(loops, " " * 4)


def ci_unroll(f: ConvForm, rp: DirectPlan) -> int:
    """Input channels a channels-innermost loop unrolls: all of a group's while its body stays within
    UNROLLED_FMAS / 4 FMAs a thread (128 took 128 registers and spilled at 8 channels x 2 outputs)."""
    per = rp.outs * rp.chans * rp.rows
    return max(1, min(f.cin // f.groups, UNROLLED_FMAS // 4 // per))


def min_blocks(rp: DirectPlan, threads: int) -> int:
    """The launch bounds' blocks an SM: with several channels a thread, 512 threads (128 registers a thread;
    with the block size alone ptxas aimed at 64 registers and spilled the accumulators of 8 channels).
    With one, the block size alone: ptxas then kept a depthwise kernel of 8 outputs at 47 registers (5
    blocks an SM), where a 128-register cap let it take 110 and 2 blocks, 0.477 -> 0.629 ms (KernelBench's
    85 on the H200)."""
    return max(1, 512 // threads) if rp.chans > 1 else 0


def channel_inner(rp: DirectPlan) -> bool:
    """Whether the kernel reads a weight re-laid channel-innermost, (C_in, taps, C_out / groups): a thread's
    channels then come in chans / 4 vector loads a tap, not chans scalar ones. The loads are warp-uniform
    broadcasts, but each is an instruction: with 8 channels of 2 outputs, 10 loads fed 16 FMAs, and a load
    issues at a quarter of an FMA's rate."""
    return rp.chans % 4 == 0


def relayout_kernel(rid: str, f: ConvForm, t: str, inner: bool) -> str:
    """The kernel that writes the channel-inner weight, a thread an element: (C_in, taps, C_out / groups),
    or with input channels innermost (groups, taps, C_in / groups, C_out / groups)."""
    cin_g, cout_g, taps = f.cin // f.groups, f.cout // f.groups, math.prod(f.kernel)
    if inner:
        decompose = "cl = i % COUT_G, ci = i / (COUT_G * TAPS * CIN_G) * CIN_G + i / COUT_G % CIN_G,\n" + (
            "                    tap = i / (COUT_G * CIN_G) % TAPS"
        )
    else:
        decompose = "cl = i % COUT_G, tap = i / COUT_G % TAPS, ci = i / (COUT_G * TAPS)"
    # source: forward (C_out, C_in / groups, taps), transposed (C_in, C_out / groups, taps)
    src = (
        "(ci * COUT_G + cl) * TAPS + tap"
        if f.transposed
        else "((ci / CIN_G * COUT_G + cl) * CIN_G + ci % CIN_G) * TAPS + tap"
    )
    uses_cin_g = inner or not f.transposed
    return f"""
extern "C" __global__ void __launch_bounds__(256)
kp_{rid}_dw(const {t}* __restrict__ w, {t}* __restrict__ wt) {{
    constexpr long long CIN = {f.cin}, COUT_G = {cout_g}, TAPS = {taps};{f" constexpr long long CIN_G = {cin_g};" if uses_cin_g else ""}
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= CIN * TAPS * COUT_G) return;
    const long long {decompose};
    wt[i] = w[{src}];
}}
"""


# A thread's row and columns: a thread a LANES-th of a row (its phase's PLANES lanes, OUTS columns each).
_HEAD = """    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * LANES) return;
    const long long row = i / LANES;  // ((n * CBLK + cb) * OD + oz) * OH + oy
    const int j = (int)(i - row * LANES), phase = j / PLANES, lane = j - phase * PLANES;
    // output column v of this thread: a phase's columns phase, phase + PHASES, ... (all of them if PHASES = 1)
    const auto ox_of = [&](int v) { return phase + PHASES * (lane + v * PLANES); };
"""
# Staged: a block a segment of SEG columns of a row (every thread reaches the barrier before the stores).
_STAGED_HEAD = """    const long long row = blockIdx.x / NSEG;  // ((n * CBLK + cb) * OD + oz) * OH + oy
    if (row >= rows) return;
    const int base = (int)(blockIdx.x - row * NSEG) * SEG;  // the segment's first column
    const int phase = threadIdx.x / PLANES, lane = threadIdx.x - phase * PLANES;
    // output column v of this thread: the segment's base + phase, + PHASES, ...
    const auto ox_of = [&](int v) { return base + phase + PHASES * (lane + v * PLANES); };
"""


def _stores(staged: bool, at: str, value: str, ot: str, ro: int = 1) -> str:
    """The sums' stores, the chain on them (`value` sets v from VALUE): a thread its own columns (of each
    of its RO rows), or staged, the block's channels x SEG columns through shared memory, consecutive
    threads consecutive columns."""
    one = f"""const long long o = {at} + oz) * OH + oy) * OW + ox;
float v;
{value};
out[o] = cv<{ot}>(v);"""
    if ro > 1:  # a column's rows (a forward convolution's: never staged)
        rows = _stores(False, at, value, ot).replace("acc[c][u]", "acc[r][c][u]")
        return f"""    #pragma unroll
    for (int r = 0; r < RO; ++r) {{
        const int oy = oy0 + r;
        if (oy >= OH) continue;  // the last column's rows past the output
{textwrap.indent(rows, "    ")}    }}
"""
    if not staged:
        return f"""    #pragma unroll
    for (int c = 0; c < CH; ++c) {{
        const int co = co0 + c;
        #pragma unroll
        for (int u = 0; u < OUTS; ++u) {{
            const int ox = ox_of(u);
            if (ox >= OW) continue;
{textwrap.indent(one.replace("VALUE", "acc[c][u]"), " " * 12)}
        }}
    }}
"""
    return f"""    __shared__ float stage[CH][SEG];
    #pragma unroll
    for (int c = 0; c < CH; ++c)
        #pragma unroll
        for (int u = 0; u < OUTS; ++u) stage[c][ox_of(u) - base] = acc[c][u];
    __syncthreads();
    for (int k = threadIdx.x; k < CH * SEG; k += PHASES * PLANES) {{
        const int c = k / SEG, col = k - c * SEG, ox = base + col, co = co0 + c;
        if (ox >= OW) continue;
{textwrap.indent(one.replace("VALUE", "stage[c][col]"), " " * 8)}
    }}
"""


def render(
    r: Region, f: ConvForm, rp: DirectPlan, dtype: str, epi: ConvEpilogue | None, sinkable: bool = False
) -> Code:
    """The kernel and its launcher for a grouped convolution region, with the chain after it fused on its
    stores when the plan says so (epi). sinkable: its one output feeds a cat or stack, which may hand the
    launcher a slice to write into (out=, one contiguous block an image at a batch stride `ldo`), unless a
    fused operand is read at the output's own offsets."""
    rid = r.rid
    t = ctype(dtype)
    out_dt = epi.out_dtype if epi else dtype
    into = out_dt if sinkable and not sinks_blocked(epi) else ""
    ot = ctype(out_dt)
    ops_ = epi.operands if epi else ()
    (kd, kh, kw), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = f.kernel, f.stride, f.pad, f.dil
    (idp, ih, iw), (od, oh, ow) = f.size, f.out
    cin_g, cout_g = f.cin // f.groups, f.cout // f.groups
    sig = Signature((
        ptr("x", t), ptr("w", t), ptr("out", ot, const=False),
        *(ptr(f"e{j}", ctype(d)) for j, (_, _, d, _) in enumerate(ops_)), i64("rows"),
        *([i64("ldo")] if into else []),
    ))  # fmt: skip
    chain = "\n".join(gemm.epilogue_function(epi, out_dt))
    ch = rp.chans
    if cout_g % ch:
        raise ValueError(f"{ch} channels a thread do not divide the group's {cout_g} output channels")
    if rp.staged and (why := why_unstageable(f, rp)):
        raise ValueError(f"staged stores: {why}")
    if why := why_no_rows(f, rp):
        raise ValueError(f"{rp.rows} output rows a thread: {why}")
    ro = rp.rows
    vw, inner = channel_inner(rp), rp.ci_inner
    rolled = unrolled(f, rp)
    w_steps = (
        ""
        if vw
        else """// from one input channel's taps to the next, and from one output channel's to the next
constexpr long long WCI = TRANSPOSED ? COUT_G * TAPS : TAPS, WCO = TRANSPOSED ? TAPS : CIN_G * TAPS;
"""
    )
    if vw:  # re-laid channel-innermost: (C_in, taps, C_out / groups), or (groups, taps, C_in / groups, ...)
        w_base = f"    const {t}* wc = w + (long long)grp * CIN_G * TAPS * COUT_G + co0 % COUT_G;"
    else:
        w_base = f"""    const {t}* wc = TRANSPOSED ? w + ((long long)grp * CIN_G * COUT_G + co0 % COUT_G) * TAPS
                               : w + (long long)co0 * CIN_G * TAPS;"""
    nest = (_inner_nest if inner else _outer_nest)(t, vw, rolled, ci_unroll(f, rp), ro)
    ohb = -(-oh // ro)  # a thread's columns of output rows along H
    if ro > 1:  # a column of RO output rows a thread: where it starts, RO x CH x OUTS sums
        used = sum(1 << y for y in {r * sh + k * dh for r in range(ro) for k in range(kh)})
        column = f"""constexpr int RO = {ro}, OHB = {ohb}, T = {rows_span(f, ro)};  // output rows a thread, its columns, the input rows they span
constexpr unsigned long long USED = {used:#x}ull;  // the rows some window takes (dilation may skip some), a bit each
"""
        locate = _HEAD.replace("* OH + oy", "* OHB + oy / RO") + (
            "    const int oy0 = (int)(row % OHB) * RO, oz = (int)((row / OHB) % OD);\n"
        )
        acc = """    float acc[RO][CH][OUTS];
    #pragma unroll
    for (int r = 0; r < RO; ++r)
        #pragma unroll
        for (int c = 0; c < CH; ++c)
            #pragma unroll
            for (int v = 0; v < OUTS; ++v) acc[r][c][v] = 0.f;"""
    else:
        column = ""
        locate = (_STAGED_HEAD if rp.staged else _HEAD) + (
            "    const int oy = (int)(row % OH), oz = (int)((row / OH) % OD);\n"
        )
        acc = """    float acc[CH][OUTS];
    #pragma unroll
    for (int c = 0; c < CH; ++c)
        #pragma unroll
        for (int v = 0; v < OUTS; ++v) acc[c][v] = 0.f;"""
    oh_ = "OHB" if ro > 1 else "OH"
    cuda = (
        chain
        + f"""
namespace kp_{rid} {{
constexpr int CIN_G = {cin_g}, COUT = {f.cout}, COUT_G = {cout_g}, OUTS = {rp.outs}{"" if rp.staged else f", LANES = {lanes(f, rp.outs)}"};
constexpr int CH = {ch}, CBLK = COUT / CH;  // output channels a thread computes, all of one group
constexpr int PHASES = {phases(f)}, PLANES = {stage_lanes(f) if rp.staged else "LANES / PHASES"};  // threads a phase of the row{" segment" if rp.staged else ""} takes
{f"constexpr int SEG = {segment(f, rp)}, NSEG = {-(-f.out[2] // segment(f, rp))};  // columns a block stores, segments a row" if rp.staged else ""}
constexpr int ID = {idp}, IH = {ih}, IW = {iw}, OD = {od}, OH = {oh}, OW = {ow};
constexpr int KD = {kd}, KH = {kh}, KW = {kw}, SD = {sd}, SH = {sh}, SW = {sw};
constexpr int PD = {pd}, PH = {ph}, PW = {pw}, DD = {dd}, DH = {dh}, DW = {dw};
constexpr long long CHW = (long long)ID * IH * IW, TAPS = (long long)KD * KH * KW;
constexpr bool TRANSPOSED = {"true" if f.transposed else "false"};  // weight (C_in, C_out / groups, taps)
{w_steps}{column}// The input coordinate a tap reads for an output coordinate, or -1: forward, o * S - P + k * D; transposed,
// the i with i * S - P + k * D == o (none unless S divides it).
__device__ __forceinline__ int src(int o, int k, int S, int P, int D, int n) {{
    if (!TRANSPOSED) {{
        const int i = o * S - P + k * D;
        return (unsigned)i < (unsigned)n ? i : -1;
    }}
    const int t = o + P - k * D;
    if (t < 0 || t % S) return -1;
    return t / S < n ? t / S : -1;
}}
}}  // namespace kp_{rid}
extern "C" __global__ void {launch_bounds(block_threads(f, rp), min_blocks(rp, block_threads(f, rp)))} kp_{rid}_dconv({sig.decls()}) {{
    using namespace kp_{rid};
{locate}    const int co0 = (int)((row / ((long long){oh_} * OD)) % CBLK) * CH, grp = co0 / COUT_G;
    const long long n = row / ((long long){oh_} * OD * CBLK);
    const {t}* xg = x + (n * (CIN_G * (COUT / COUT_G)) + (long long)grp * CIN_G) * CHW;  // its group
{w_base}
{acc}
{nest}
{_stores(rp.staged, "n * ldo + ((co * OD" if into else "(((n * COUT + co) * OD", chain_value(epi, "VALUE"), ot, ro)}}}
"""
    )
    if vw:
        cuda += relayout_kernel(rid, f, t, inner)
    dims = f.dims
    in_shape = (f.cin, *f.size[3 - dims :])
    w_shape = (
        (f.cin, cout_g, *f.kernel[3 - dims :]) if f.transposed else (f.cout, cin_g, *f.kernel[3 - dims :])
    )
    out_sp = ", ".join(str(o) for o in f.out[3 - dims :])
    x, w = r.node.args[:2]
    inputs = [("x", x.name), ("w", w.name), *((f"e{j}", v) for j, (_, v, _, _) in enumerate(ops_))]
    launcher = "\n".join([
        f"def _dconv_{rid}(sms, {', '.join(n for n, _ in inputs)}{', out=None' if into else ''}):",
        f'    """The {"depthwise" if cin_g == 1 else "grouped"}{" transposed" if f.transposed else ""} convolution ({f.groups} groups) on the CUDA '
        f'cores: {rp.outs} outputs of {ch} channels a thread{f" in each of {ro} output rows" if ro > 1 else ""}, {rp.threads} threads a block{", the chain fused" if epi else ""}."""',
        f"    if tuple(x.shape[1:]) != {in_shape} or tuple(w.shape) != {w_shape}:",
        "        raise ValueError(f'kernelpro expert: the convolution was compiled for inputs (N, "
        f"{', '.join(map(str, in_shape))}) and a weight {w_shape}, not {{tuple(x.shape)}} and "
        "{tuple(w.shape)}')",
        "    x, w = _contig(x), _contig(w)",
        *(
            [
                f"    wt = torch.empty(({f.cin * math.prod(f.kernel) * cout_g},), dtype=w.dtype, device=w.device)"
                "  # the weight channel-innermost",
                f"    kernels.kp_{rid}_dw(({-(-f.cin * math.prod(f.kernel) * cout_g // 256)},), (256,), (w, wt))"
                "  # noqa: F821",
                "    w = wt",
            ]
            if vw
            else []
        ),
        *(
            [
                "    if out is None:",
                f"        out = torch.empty((x.shape[0], {f.cout}, {out_sp}), dtype={torch_dtype(out_dt)}, device=x.device)",
                f"    ldo = _batch_stride(out, (x.shape[0], {f.cout}, {out_sp}), {torch_dtype(out_dt)})",
            ]
            if into
            else [
                f"    out = torch.empty((x.shape[0], {f.cout}, {out_sp}), dtype={torch_dtype(out_dt)}, device=x.device)"
            ]
        ),
        *prepare_operands(epi),
        f"    rows = x.shape[0] * {f.cout // ch * od * ohb}",
        "    if rows:",
        f"        kernels.kp_{rid}_dconv(({grid_expr(f, rp)},), ({block_threads(f, rp)},), "
        f"({sig.args()}))  # noqa: F821",
        "    return out",
    ])  # fmt: skip
    outs = (epi.out,) if epi else r.outputs
    names = (f"kp_{rid}_dconv", f"kp_{rid}_dw") if vw else (f"kp_{rid}_dconv",)
    slot = f"({{0}}.shape[0], {f.cout}, {out_sp})" if into else ""
    return Code(
        cuda, launcher, f"_dconv_{rid}", names, tuple(v for _, v in inputs), outs, into=into, slot=slot
    )
