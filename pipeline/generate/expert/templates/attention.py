"""Fused attention on the tensor cores: O = f(Q Kᵀ) V without the L x S score matrix ever leaving the chip
(which attentions it takes, and its plans: families/attention.py).

One block takes BM query rows of one (batch, head), one warp 16 of them, and walks the keys in tiles of
BN. Each warp computes its 16 x BN scores with the warp MMA m16n8k8 on tf32 (the CuTe atom found in the
CUTLASS headers), applies the score chain (a scale, a mask, the reference's own elementwise ops), then
either the online softmax (a running maximum and sum per row, the partial output rescaled) or nothing (an
activation in place of the softmax), and adds P V for the tile. fp32 accuracy comes from 3xTF32: every
operand x splits into hi = tf32(x) and lo = x - hi (read as tf32 by the MMA), and hi·hi + hi·lo + lo·hi
are summed (lo·lo is below fp32's rounding). Each tile's P V is summed from zero and added to the output in fp32 registers, so
the tensor cores' accumulation never runs over more than BN keys (their fp32 sums are biased over long
runs: docs/benchmarks.md).

The MMA sums over its k index in any order, so k = t and t + 4 (the two values a lane holds) are mapped
to the adjacent columns 2t and 2t + 1: every fragment is one 8-byte shared load, and P goes from the
score accumulators straight into the A operand of P V, in registers. K and V (V transposed) are split
once, when the block stages a tile in shared memory; the next tile's loads are issued before the current
one is computed (held in registers) when they fit. Shared rows are padded to 8 words mod 32, so the
fragment loads and the staging stores are free of bank conflicts.

Head dims are compiled in (multiples of 8, up to 128); batch, heads and sequence lengths are not. Q, K and V
may be strided views (heads split out of a projection) as long as each row is contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.generate.expert import atoms
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import Code, chain_function, ctype, launch_bounds
from pipeline.generate.expert.templates.signature import Param, Signature, i64, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.attention import AttnPlan

MMA_TF32 = atoms.Need(
    "warp MMA atom 16x8x8 F32 TF32 TF32 F32 TN register operands",
    "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
    ("cute/arch/mma_sm80.hpp",),
    queries=("SM80 16x8x8 F32TF32TF32F32 TN", "mma m16n8k8 tf32"),
)


@dataclass(frozen=True)
class AttnForm:
    """What the kernel computes, read off the graph (families/attention.py)."""

    q: str  # graph values of the operands
    k: str
    v: str
    k_transposed: bool  # k is given as (..., D, S): the B operand of the reference's Q @ Kᵀ
    rank: int  # 3 (N, L, D) or 4 (B, H, L, D)
    d: int  # head dim of Q and K
    dv: int  # head dim of V
    out: str  # the value the kernel writes
    scale: float | None  # SDPA's scale on the scores (None: the score chain has its own)
    causal: bool  # SDPA's is_causal: key j seen by query i when j <= i
    mask: str | None  # SDPA's attn_mask (bool: keep where true; float: added)
    mask_dtype: str = ""
    softmax: bool = True  # False: the chain's activation is the whole weighting, no normalisation
    chain: Region | None = None  # the reference's elementwise ops on the scores, before the softmax
    chain_main: str = ""  # the chain's input that is the score
    extras: tuple[tuple[str, str], ...] = ()  # (value, dtype) of the chain's other operands
    hg: int = 1  # query heads per key/value head (grouped-query attention)
    # The dims of the (B, H, L, Dv) output in the order its one reader permutes them to (Dv last), the order
    # it is written in, so that the reader's view is contiguous; () for (B, H, L, Dv) itself.
    out_order: tuple[int, ...] = ()
    # Elementwise ops on the scores viewed with their batch split in two, (B / split, split, H, L, S), and
    # viewed back: a shifted-window mask, one per window, added to every image's windows. Their operands
    # broadcast to that 5-D shape; in the kernel, batch b is (b / split, b % split).
    chain2: Region | None = None
    chain2_main: str = ""
    extras2: tuple[tuple[str, str], ...] = ()
    split: int = 0
    # F.normalize over the head dim of Q, of K (its eps; None: none), done as the rows are loaded: q and k
    # then name the raw operands (SwinV2's cosine attention)
    norm_q: float | None = None
    norm_k: float | None = None


def _pad(n: int) -> int:
    """The smallest row stride >= n words that is 8 mod 32 (conflict-free 8-byte fragment loads)."""
    return n + (8 - n) % 32


def smem_bytes(f: AttnForm, rp: AttnPlan) -> int:
    bm = 16 * rp.warps
    return 4 * 2 * (bm * f.d + rp.bn * _pad(f.d) + f.dv * _pad(rp.bn))


def prefetch(f: AttnForm, rp: AttnPlan) -> bool:
    """The next tile's K and V held in registers while this one is computed: when they are few enough."""
    return rp.bn * (f.d + f.dv) // (32 * rp.warps) <= 48


def _helpers(rid: str, atom: atoms.Atom) -> str:
    return f"""#ifndef KP_EMULATED
#include <{atom.header}>
#endif
// building block: {atom.cite()}
namespace kp_{rid} {{
#ifndef KP_EMULATED
using namespace cute;
#endif
// hi: x rounded to the nearest tf32 (half a tf32 ulp added, the low 13 bits dropped; ties away, as
// cvt.rna); lo: the rest, exact in fp32, of which the MMA reads the top 19 bits (truncated: an error of
// about 2^-21 of x). Three instructions; a NaN stays in lo.
__device__ __forceinline__ void split(float x, float& hi, float& lo) {{
    hi = __uint_as_float((__float_as_uint(x) + 0x1000u) & 0xffffe000u);
    lo = x - hi;
}}
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], float2 b) {{
    const unsigned b0 = __float_as_uint(b.x), b1 = __float_as_uint(b.y);
#ifdef KP_EMULATED
    kp_emu_mma_tf32(d, a, b0, b1);
#else
    {atom.name}::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1], d[2], d[3]);
#endif
}}
// d += a·b in 3xTF32, the small products first
__device__ __forceinline__ void mma3(float (&d)[4], const unsigned (&ah)[4], const unsigned (&al)[4], float2 bh, float2 bl) {{
    mma(d, al, bh);
    mma(d, ah, bl);
    mma(d, ah, bh);
}}
__device__ __forceinline__ float4 split4(float4 x, float4& lo) {{
    float4 hi;
    split(x.x, hi.x, lo.x);
    split(x.y, hi.y, lo.y);
    split(x.z, hi.z, lo.z);
    split(x.w, hi.w, lo.w);
    return hi;
}}
}}  // namespace kp_{rid}
"""


# F.normalize's x / max(||x||, eps) on a row of the head dim held as float4s by LANES lanes (consecutive,
# aligned): every lane of the warp calls it. A NaN norm stays NaN, as clamp_min keeps it.
NORMALIZED = """// x / max(||x||, eps) over a row held as float4s by LANES consecutive lanes (every lane of the warp calls it)
template <int LANES>
__device__ __forceinline__ float4 normalized(float4 x, float eps) {
    float ss = x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
    #pragma unroll
    for (int o = 1; o < LANES; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    float n = sqrtf(ss);
    n = n < eps ? eps : n;
    return make_float4(x.x / n, x.y / n, x.z / n, x.w / n);
}"""


def eps_constants(f: AttnForm) -> str:
    """The kernel namespace's EPS_Q and EPS_K, the fused norms' eps (a line, or nothing without a norm)."""
    eps = [f"EPS_{t} = {e!r}f" for t, e in (("Q", f.norm_q), ("K", f.norm_k)) if e is not None]
    return f"\nconstexpr float {', '.join(eps)};" if eps else ""


def norms_fit(d: int) -> bool:
    """Whether a head dim's rows can be normalized in the kernels: its float4 chunks a power of two up to 32."""
    return d % 4 == 0 and 0 < d // 4 <= 32 and (d // 4) & (d // 4 - 1) == 0


def score_lines(f: AttnForm, u: int, guarded: bool) -> list[str]:
    """Lines that turn the raw score `x` at (row r{u}, col) into what the softmax (or P) takes; guarded:
    a column past the keys or a row past the queries (or a causal key after its query) has none."""
    lines = []
    if f.scale is not None and f.scale != 1.0:
        lines.append(f"x *= {f.scale!r}f;")
    if f.mask is not None:
        at = f"m[mr{u} + col * ms3]"
        lines.append(f"x = ld({at}) ? x : -CUDART_INF_F;" if f.mask_dtype == "bool" else f"x += ld({at});")
    chains = ((f.chain, f.chain_main, f.extras, "e", 3), (f.chain2, f.chain2_main, f.extras2, "z", 4))
    for chain, main, extras, e, last in chains:
        if chain is None:
            continue
        extra = {v: j for j, (v, _) in enumerate(extras)}
        args = [
            "x" if i == main else f"ld({e}{extra[i]}[{e}{extra[i]}r{u} + col * {e}{extra[i]}s{last}])"
            for i in chain.inputs
        ]
        lines.append(f"kp_{chain.rid}_f({', '.join([*args, 'x'])});")
    if not guarded:
        return lines
    dead = "-CUDART_INF_F" if f.softmax else "0.f"
    causal = f" || col > r{u}" if f.causal and f.softmax else ""
    inner = "".join(f"\n    {ln}" for ln in lines)
    return [f"if (col >= S || r{u} >= L{causal}) {{\n    x = {dead};\n}} else {{{inner}\n}}"]


def _scores(f: AttnForm, guarded: bool, indent: str) -> str:
    """The score code for one tile, every value of s[n][c] (rows r0 for c < 2, r1 for c >= 2)."""
    out = ["#pragma unroll\nfor (int n = 0; n < BN / 8; ++n) {"]
    for c in range(4):
        body = "\n".join(f"        {x}" for ln in score_lines(f, c // 2, guarded) for x in ln.split("\n"))
        out.append(
            f"    {{\n        const long long col = k0 + n * 8 + 2 * t + {c & 1};\n        float x = s[n][{c}];\n"
            f"{body}\n        s[n][{c}] = x;\n        (void)col;\n    }}"
        )
    out.append("}")
    return "\n".join(indent + x for ln in out for x in ln.split("\n"))


_SOFTMAX = """// online softmax: each row's running maximum (over its quad of lanes); the partial output and sums
// rescaled by exp(old - new), in base 2
float mx0 = m0, mx1 = m1;
#pragma unroll
for (int n = 0; n < BN / 8; ++n) {
    mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
    mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
}
mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
const float base0 = mx0 == -CUDART_INF_F ? 0.f : mx0, base1 = mx1 == -CUDART_INF_F ? 0.f : mx1;
const float al0 = exp2f((m0 - base0) * LOG2E), al1 = exp2f((m1 - base1) * LOG2E);
const float b0l = base0 * LOG2E, b1l = base1 * LOG2E;
m0 = mx0;
m1 = mx1;
float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
for (int n = 0; n < BN / 8; ++n) {
    s[n][0] = exp2f(fmaf(s[n][0], LOG2E, -b0l));
    s[n][1] = exp2f(fmaf(s[n][1], LOG2E, -b0l));
    s[n][2] = exp2f(fmaf(s[n][2], LOG2E, -b1l));
    s[n][3] = exp2f(fmaf(s[n][3], LOG2E, -b1l));
    rs0 += s[n][0] + s[n][1];
    rs1 += s[n][2] + s[n][3];
}
l0 = l0 * al0 + rs0;
l1 = l1 * al1 + rs1;
#pragma unroll
for (int n = 0; n < DV / 8; ++n) {
    o[n][0] *= al0;
    o[n][1] *= al0;
    o[n][2] *= al1;
    o[n][3] *= al1;
}"""


def extra_operands(f: AttnForm) -> list[tuple[str, str]]:
    """(kernel name, dtype) of the mask and of the score chains' other operands (z...: the split chain's,
    5-D)."""
    extras = [("m", f.mask_dtype)] if f.mask is not None else []
    extras += [(f"e{j}", dt) for j, (_, dt) in enumerate(f.extras)]
    return extras + [(f"z{j}", dt) for j, (_, dt) in enumerate(f.extras2)]


def _dims(name: str) -> int:
    return 5 if name.startswith("z") else 4


def chain_functions(f: AttnForm) -> str:
    """The device functions of the score chains."""
    return "\n".join(chain_function(c, list(c.inputs)) for c in (f.chain, f.chain2) if c is not None)


def signature(f: AttnForm, extras: list[tuple[str, str]], *more: Param) -> Signature:
    return Signature((
        ptr("q", "float"), ptr("k", "float"), ptr("v", "float"), ptr("out", "float", const=False),
        *(p for name, dt in extras for p in (
            ptr(name, ctype(dt)), *(i64(f"{name}s{a}", f"{name}.stride({a})") for a in range(_dims(name))))),
        i64("heads", "h"), i64("hg", str(f.hg)), i64("L", "lq"), i64("S", "sk"),
        *(i64(f"{t}s{a}", f"{t}.stride({a})") for t in ("q", "k", "v", "out") for a in range(3)),
        *more,
    ))  # fmt: skip


def row_offsets(extras: list[tuple[str, str]], us: tuple[int, ...], split: int = 0) -> str:
    """Per-row offsets of the mask and the chains' operands (each expanded to (B, H, L, S) by the launcher,
    the split chain's to (B / split, split, H, L, S)), for the rows r{u} of a thread."""
    return "\n    ".join(
        f"const long long {name}r{u} = (b / {split}) * {name}s0 + (b % {split}) * {name}s1 + h * {name}s2"
        f" + r{u} * {name}s3;"
        if _dims(name) == 5
        else f"const long long {name}r{u} = b * {name}s0 + h * {name}s1 + r{u} * {name}s2;"
        for name, _ in extras
        for u in us
    )


def render(r: Region, f: AttnForm, rp: AttnPlan, hunter: object = None) -> Code:
    rid = r.rid
    atom = atoms.find(MMA_TF32, hunter)
    warps, bn = rp.warps, rp.bn
    threads = 32 * warps
    extras = extra_operands(f)
    sig = signature(f, extras)
    rows = row_offsets(extras, (0, 1), f.split)
    chain = chain_functions(f)
    softmax = "\n".join(f"        {ln}" if ln else "" for ln in _SOFTMAX.split("\n")) if f.softmax else ""
    finish = (
        """    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.f / l0, inv1 = 1.f / l1;"""
        if f.softmax
        else "    const float inv0 = 1.f, inv1 = 1.f;"
    )
    # Causal: the keys after the block's last query row are all masked.
    kend = "const long long kend = S < q0 + BM ? S : q0 + BM;" if f.causal else "const long long kend = S;"
    # A tile needs no guard when all its keys exist, all the warp's rows do, and (causal) it ends before
    # the warp's first row.
    inner = "k0 + BN <= S && w0 + 16 <= L" + (" && k0 + BN - 1 <= w0" if f.causal and f.softmax else "")
    pre = prefetch(f, rp)
    norm_defs, q_load, k_norm = _norm_lines(f)
    cuda = f"""{_helpers(rid, atom)}
{chain}
namespace kp_{rid} {{
constexpr int D = {f.d}, DV = {f.dv}, WARPS = {warps}, BM = 16 * WARPS, BN = {bn}, THREADS = 32 * WARPS;
constexpr int KS = {_pad(f.d)}, VS = {_pad(bn)};  // row strides of K and of V transposed, 8 words mod 32
constexpr int KR = D / 4, VR = DV / 4, K4 = BN * KR, V4 = BN * VR;  // float4 chunks: a row, a tile
constexpr int KPER = (K4 + THREADS - 1) / THREADS, VPER = (V4 + THREADS - 1) / THREADS;
constexpr float LOG2E = 1.4426950408889634f;{norm_defs}
}}  // namespace kp_{rid}
extern "C" __global__ void {launch_bounds(threads, rp.min_blocks)} kp_{rid}_attn({sig.decls()}) {{
    using namespace kp_{rid};
    extern __shared__ __align__(16) unsigned char kp_smem[];
    float* qh = reinterpret_cast<float*>(kp_smem);
    float* ql = qh + BM * D;
    float* kh = ql + BM * D;
    float* kl = kh + BN * KS;
    float* vh = kl + BN * KS;  // V transposed: (DV, BN)
    float* vl = vh + DV * VS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const long long bh = blockIdx.x, b = bh / heads, h = bh - b * heads, hk = h / hg;
    const long long q0 = (long long)blockIdx.y * BM, w0 = q0 + warp * 16;
    const float* qb = q + b * qs0 + h * qs1;
    const float* kb = k + b * ks0 + hk * ks1;
    const float* vb = v + b * vs0 + hk * vs1;
    const long long r0 = w0 + g, r1 = r0 + 8;  // this thread's two query rows
    {rows}
    // Q, split once, stored in the A fragments' own order: lane l's four values of a k step are the four
    // floats at ((warp * D / 8 + kk) * 32 + l) * 4, one 16-byte load. Column j of a k step is k = j / 2
    // (j even) or j / 2 + 4 (odd): register (row >= 8) + 2 * (j & 1) of lane 4 * (row % 8) + j / 2.
    for (int e = tid; e < BM * D / 4; e += THREADS) {{
        const int rr = e / (D / 4), cc = (e - rr * (D / 4)) * 4;
        {q_load}
        float4 lo;
        const float4 hi = split4(x, lo);
        const float xh[4] = {{hi.x, hi.y, hi.z, hi.w}}, xl[4] = {{lo.x, lo.y, lo.z, lo.w}};
        const int r16 = rr & 15, base = (rr >> 4) * (D / 8);
        #pragma unroll
        for (int u = 0; u < 4; ++u) {{
            const int j = (cc & 7) + u;
            const int at = ((base + cc / 8) * 32 + 4 * (r16 & 7) + j / 2) * 4 + (r16 >> 3) + 2 * (j & 1);
            qh[at] = xh[u];
            ql[at] = xl[u];
        }}
    }}
    // A tile of K (rows of D) and V (V: 8 keys x 4 chunks of DV a group of 32 chunks, so whole sectors
    // are read and the transposed stores are conflict-free), float4 chunks, KPER and VPER a thread.
    float4 pk[KPER], pv[VPER];
    auto fetch = [&](long long k0) {{
        #pragma unroll
        for (int i = 0; i < KPER; ++i) {{
            const int e = tid + i * THREADS, rr = e / KR, cc = (e % KR) * 4;
            const bool ok = (i < K4 / THREADS || e < K4) && k0 + rr < S;
            pk[i] = ok ? *reinterpret_cast<const float4*>(kb + (k0 + rr) * ks2 + cc) : make_float4(0.f, 0.f, 0.f, 0.f);
        }}
        #pragma unroll
        for (int i = 0; i < VPER; ++i) {{
            const int e = tid + i * THREADS, c = (e >> 3) % VR, rr = (e / (8 * VR)) * 8 + (e & 7);
            const bool ok = (i < V4 / THREADS || e < V4) && k0 + rr < S;
            pv[i] = ok ? *reinterpret_cast<const float4*>(vb + (k0 + rr) * vs2 + 4 * c) : make_float4(0.f, 0.f, 0.f, 0.f);
        }}
    }};
    auto stage = [&]() {{
        #pragma unroll
        for (int i = 0; i < KPER; ++i) {{
            const int e = tid + i * THREADS, rr = e / KR, cc = (e % KR) * 4;
{k_norm}            if (i < K4 / THREADS || e < K4) {{
                float4 lo;
                *reinterpret_cast<float4*>(kh + rr * KS + cc) = split4(pk[i], lo);
                *reinterpret_cast<float4*>(kl + rr * KS + cc) = lo;
            }}
        }}
        #pragma unroll
        for (int i = 0; i < VPER; ++i) {{
            const int e = tid + i * THREADS, c = (e >> 3) % VR, rr = (e / (8 * VR)) * 8 + (e & 7);
            if (i < V4 / THREADS || e < V4) {{
                float4 lo;
                const float4 hi = split4(pv[i], lo);
                float* th = vh + 4 * c * VS + rr;
                float* tl = vl + 4 * c * VS + rr;
                th[0] = hi.x; th[VS] = hi.y; th[2 * VS] = hi.z; th[3 * VS] = hi.w;
                tl[0] = lo.x; tl[VS] = lo.y; tl[2 * VS] = lo.z; tl[3 * VS] = lo.w;
            }}
        }}
    }};
    float o[DV / 8][4];
    #pragma unroll
    for (int n = 0; n < DV / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m0 = -CUDART_INF_F, m1 = -CUDART_INF_F, l0 = 0.f, l1 = 0.f;
    (void)m0; (void)m1; (void)l0; (void)l1;
    {kend}
    const float* qwh = qh + (warp * (D / 8) * 32 + lane) * 4;
    const float* qwl = ql + (warp * (D / 8) * 32 + lane) * 4;
    {"fetch(0);" if pre else ""}
    for (long long k0 = 0; k0 < kend; k0 += BN) {{
        {"" if pre else "fetch(k0);"}
        __syncthreads();  // the previous tile's fragments are read
        stage();
        __syncthreads();
        {"if (k0 + BN < kend) fetch(k0 + BN);  // in flight while this tile is computed" if pre else ""}
        float s[BN / 8][4];
        #pragma unroll
        for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        #pragma unroll
        for (int kk = 0; kk < D / 8; ++kk) {{
            const float4 fh = *reinterpret_cast<const float4*>(qwh + kk * 128), fl = *reinterpret_cast<const float4*>(qwl + kk * 128);
            const unsigned ah[4] = {{__float_as_uint(fh.x), __float_as_uint(fh.y), __float_as_uint(fh.z), __float_as_uint(fh.w)}};
            const unsigned al[4] = {{__float_as_uint(fl.x), __float_as_uint(fl.y), __float_as_uint(fl.z), __float_as_uint(fl.w)}};
            #pragma unroll
            for (int n = 0; n < BN / 8; ++n) {{
                const int at = (n * 8 + g) * KS + kk * 8 + 2 * t;
                mma3(s[n], ah, al, *reinterpret_cast<const float2*>(kh + at), *reinterpret_cast<const float2*>(kl + at));
            }}
        }}
        if ({inner}) {{
{_scores(f, False, "            ")}
        }} else {{
{_scores(f, True, "            ")}
        }}
{softmax}
        float acc[DV / 8][4];
        #pragma unroll
        for (int n = 0; n < DV / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
        #pragma unroll
        for (int n = 0; n < BN / 8; ++n) {{
            // P's k = t and t + 4 are keys 2t and 2t + 1: the score accumulators themselves
            float ph[4], pl[4];
            split(s[n][0], ph[0], pl[0]);
            split(s[n][2], ph[1], pl[1]);
            split(s[n][1], ph[2], pl[2]);
            split(s[n][3], ph[3], pl[3]);
            const unsigned ah[4] = {{__float_as_uint(ph[0]), __float_as_uint(ph[1]), __float_as_uint(ph[2]), __float_as_uint(ph[3])}};
            const unsigned al[4] = {{__float_as_uint(pl[0]), __float_as_uint(pl[1]), __float_as_uint(pl[2]), __float_as_uint(pl[3])}};
            #pragma unroll
            for (int j = 0; j < DV / 8; ++j) {{
                const int at = (j * 8 + g) * VS + n * 8 + 2 * t;
                mma3(acc[j], ah, al, *reinterpret_cast<const float2*>(vh + at), *reinterpret_cast<const float2*>(vl + at));
            }}
        }}
        #pragma unroll
        for (int n = 0; n < DV / 8; ++n) {{
            o[n][0] += acc[n][0];
            o[n][1] += acc[n][1];
            o[n][2] += acc[n][2];
            o[n][3] += acc[n][3];
        }}
    }}
{finish}
    float* ob = out + b * outs0 + h * outs1;
    #pragma unroll
    for (int n = 0; n < DV / 8; ++n) {{
        const int col = n * 8 + 2 * t;
        if (r0 < L) *reinterpret_cast<float2*>(ob + r0 * outs2 + col) = make_float2(o[n][0] * inv0, o[n][1] * inv0);
        if (r1 < L) *reinterpret_cast<float2*>(ob + r1 * outs2 + col) = make_float2(o[n][2] * inv1, o[n][3] * inv1);
    }}
}}
"""
    launcher = _launcher(rid, f, rp, sig, extras)
    return Code(cuda, launcher, f"_attn_{rid}", (f"kp_{rid}_attn",), args(f), (f.out,), at=rp.pv)


def _norm_lines(f: AttnForm) -> tuple[str, str, str]:
    """(the namespace's eps constants and helper, Q's load, K's staging prefix): F.normalize of Q's rows as
    they are loaded, of K's as a tile is staged (the KR lanes of a row consecutive: THREADS is a multiple of
    KR, a power of two); the plain load and nothing where no norm is fused."""
    load = "const float4 x = q0 + rr < L ? *reinterpret_cast<const float4*>(qb + (q0 + rr) * qs2 + cc) : make_float4(0.f, 0.f, 0.f, 0.f);"
    if f.norm_q is None and f.norm_k is None:
        return "", load, ""
    defs = f"{eps_constants(f)}\n{NORMALIZED}"
    # a row's D / 4 chunks are D / 4 consecutive lanes, and every thread runs D / 8 chunks: all call the shuffles
    if f.norm_q is not None:
        load = load.replace("const float4 x = ", "const float4 x = normalized<D / 4>(", 1).replace(
            "0.f, 0.f);", "0.f, 0.f), EPS_Q);"
        )
    k_norm = (
        "            pk[i] = normalized<KR>(pk[i], EPS_K);  // F.normalize of the key's row\n"
        if f.norm_k is not None
        else ""
    )
    return defs, load, k_norm


def args(f: AttnForm) -> tuple[str, ...]:
    return (f.q, f.k, f.v, *((f.mask,) if f.mask else ()), *(v for v, _ in (*f.extras, *f.extras2)))


def _launcher(rid: str, f: AttnForm, rp: AttnPlan, sig: Signature, extras: list[tuple[str, str]]) -> str:
    bm = 16 * rp.warps
    call = (
        f"kernels.kp_{rid}_attn((n * h, -(-lq // {bm})), ({32 * rp.warps},), ({sig.args()}), "
        f"shared_mem={smem_bytes(f, rp)})  # noqa: F821"
    )
    return launcher(
        rid, f, sig, extras, f"3xTF32 on the tensor cores: {bm} query rows a block, {rp.bn} keys a tile", call
    )


def launcher(
    rid: str, f: AttnForm, sig: Signature, extras: list[tuple[str, str]], how: str, call: str
) -> str:
    """The launcher of either attention kernel: the operands as (B, H, L, D) views with 16-byte rows, the
    output, the mask and chain operands broadcast to the scores, then `call` (the kernel launch)."""
    names = ["q", "k", "v", *(n for n, _ in extras)]
    what = "softmax" if f.softmax else "no softmax (the chain's activation weights V)"
    lines = [
        f"def _attn_{rid}(sms, {', '.join(names)}):",
        f'    """Fused attention ({what}), {how}."""',
    ]
    if f.k_transposed:
        lines.append("    k = k.transpose(-2, -1)  # the reference multiplies by Kᵀ: read K itself")
    if f.rank == 3:
        lines.append("    q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)")
    lines += [
        "    n, h, lq, d = q.shape",
        "    sk = k.shape[2]",
        f"    if d != {f.d} or k.shape[-1] != {f.d} or v.shape[-1] != {f.dv} or v.shape[2] != sk "
        f"or k.shape[1] * {f.hg} != h:",
        "        raise ValueError(f'kernelpro expert: attention compiled for head dims "
        f"{f.d}/{f.dv}, got q {{tuple(q.shape)}}, k {{tuple(k.shape)}}, v {{tuple(v.shape)}}')",
        "    # rows read as 16-byte vectors: unit stride along the head dim, 16-byte aligned rows",
        "    q, k, v = (t if t.stride(-1) == 1 and all(s % 4 == 0 for s in t.stride()[:-1]) "
        "and t.data_ptr() % 16 == 0 else _contig(t) for t in (q, k, v))",
    ]
    if f.out_order:
        alloc = ", ".join(("n", "h", "lq", str(f.dv))[d] for d in f.out_order)
        back = tuple(f.out_order.index(d) for d in range(4))
        lines.append(
            f"    out = torch.empty(({alloc}), dtype=torch.float32, device=q.device).permute({back})"
            "  # read permuted next: contiguous then"
        )
    else:
        lines.append(f"    out = torch.empty((n, h, lq, {f.dv}), dtype=torch.float32, device=q.device)")
    if f.split:
        lines += [
            f"    if n % {f.split}:",
            f"        raise ValueError(f'kernelpro expert: the attention splits its batch by {f.split}, got {{n}}')",
        ]
    # The mask and the chain's operands, broadcast to the scores' shape by strides (no copy).
    for name, _ in extras:
        if _dims(name) == 5:
            lines.append(f"    {name} = {name}.expand(n // {f.split}, {f.split}, h, lq, sk)")
            continue
        x = f"{name}.unsqueeze(-3) if {name}.dim() == 3 else {name}" if f.rank == 3 else name
        lines.append(f"    {name} = ({x}).expand(n, h, lq, sk)")
    lines += [
        "    if n * h and lq:",
        f"        {call}",
        f"    return out{'.squeeze(1)' if f.rank == 3 else ''}",
    ]
    return "\n".join(lines)
