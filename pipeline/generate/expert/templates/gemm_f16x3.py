"""fp32 GEMMs at fp32 accuracy as three fp16 products on the tensor cores (a form of the 3xTF32 family's
plan, `Tf32Plan.f16`: families/gemm_tf32.py).

Each operand is scaled by a power of two per line (a row of A; a column of B, over K), exact, so that the
line's largest magnitude lands in [2^14, 2^15), inside fp16's range, then cut as hi = fp16(x) and
lo = fp16(x - hi), both rounded to nearest: 11 + 11 significant bits, as tf32's hi and lo (10 + 1 each,
truncated), while an fp16 MMA runs at twice tf32's rate. a.b is accumulated in fp32 as
a_lo.b_hi + a_hi.b_lo + a_hi.b_hi and unscaled by 2^(e_row + e_col) before the epilogue: 1.5 tf32 passes
of tensor-core work where 3xTF32 takes 3. The dropped a_lo.b_lo and lo's rounding are each at most about
2^-22 of |a||b|; an element far below its line's largest (under 2^-28 of it: an fp16 subnormal) is held
with less precision, an absolute error at most about 2^-40 of that largest (benchmarks/fp16x3_probe.py: at or under eager's error on rand,
randn, linear-layer and outlier operands, H100 2026-12-07; benchmarks/split_accuracy.py on the CPU).

The split is a pass of its own before the GEMM (one read of each fp32 operand, mostly from L2 the second
time, and a write of its two fp16 halves: the same bytes): `rowsplit` for rows over K (A, and a linear
layer's (N, K) weight), `colsplit` for a row-major (K, N) B, whose columns it also transposes K-major. A
transposed view (level 1's A.T, B.T) is read in place by the other one, not gathered into a copy first.
Rows of the halves are padded to 8 elements (16 bytes, TMA's rule) with zeros, so any K works.

The GEMM: 384 threads, the producer warpgroup's first thread issues TMA loads of four tiles a stage (a_hi,
a_lo: 128 x 64; b_hi, b_lo: BN x 64; 128-byte swizzle), two consumer warpgroups run the three WGMMA
products on 64 x BN each from shared memory (the implicit-GEMM convolution's consumer loop,
templates/gemm_tf32.py), promoting the tensor cores' sum to fp32 registers every PROMOTE k tiles (the
accumulator's own additions drop bits: without it a 65536-long K was 20x eager's error on the H100).
A plan that splits K keeps its split: each block stores its share's unscaled sums into a workspace slice
and the 3xTF32 kernel's sum kernel adds them (templates/gemm_tf32.py). A grid of more than a wave of tiles may be walked persistently (one block an SM; `persistent`, the 3xTF32
form's knob): the rings run on across a block's tiles, and the stores read the promoted sums.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from pipeline.generate.expert import atoms
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates import gemm, gemm_tf32
from pipeline.generate.expert.templates.code import Code, ctype, torch_dtype
from pipeline.generate.expert.templates.gemm import BM, GROUP, SMEM_LIMIT, Form, GemmEpilogue
from pipeline.generate.expert.templates.signature import Param, Signature, i32, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.gemm_tf32 import Tf32Plan

BK = 64  # fp16 elements: one 128-byte swizzle row
PROMOTE = 2  # k tiles (128 of K, three products each) summed by the tensor cores before a promotion
ALIGN = 8  # fp16 elements per 16 bytes: the halves' rows are padded to it
_HALF = 2


def stage_bytes(bn: int) -> int:
    """A stage: A's and B's hi and lo tiles."""
    return 2 * (BM + bn) * BK * _HALF


def max_stages(bn: int) -> int:
    return (SMEM_LIMIT - 2048) // stage_bytes(bn)


def smem_bytes(bn: int, stages: int) -> int:
    """sizeof(Smem) (tiles in 1024-byte aligned arrays, then the barriers) plus 1024 for aligning the base."""
    return stage_bytes(bn) * stages + 1024 + 1024


def stages_of(rp: Tf32Plan) -> int:
    """The plan's ring, no deeper than fits (the 3xTF32 plan's stages are counted in fp32 tiles)."""
    return max(2, min(rp.stages, max_stages(rp.bn)))


def blocks(bn: int, hunter: Any = None) -> dict[str, atoms.Atom]:
    return {
        "mma": atoms.find(atoms.gmma(bn, "float16"), hunter),
        "tma": atoms.find(atoms.TMA_LOAD_3D, hunter),
        "full": atoms.find(atoms.TX_BARRIER, hunter),
        "empty": atoms.find(atoms.ARRIVE_BARRIER, hunter),
        "smem": atoms.find(atoms.SW128_K, hunter),
    }


def signature(epi: GemmEpilogue | None, out_dt: str) -> Signature:
    tmap = "const __grid_constant__ CUtensorMap"
    ops_ = epi.operands if epi else ()
    return Signature((
        Param("tma_ah", tmap, "tah"), Param("tma_al", tmap, "tal"), Param("tma_bh", tmap, "tbh"),
        Param("tma_bl", tmap, "tbl"), ptr("out", ctype(out_dt), const=False), ptr("ea", "int"), ptr("eb", "int"),
        *(ptr(f"e{k}", ctype(d)) for k, (_, d, _) in enumerate(ops_)), i32("M", "m"), i32("N", "n"), i32("K", "kp"),
    ))  # fmt: skip


def render(r: Region, f: Form, rp: Tf32Plan, epi: GemmEpilogue | None, hunter: Any = None) -> Code:
    """The split kernels, the GEMM and its launcher for an fp32 library region in the form `f`."""
    if rp.staged:
        raise ValueError(f"region {r.rid}: the fp16x3 GEMM stores unstaged")
    persistent = rp.persistent
    if persistent and rp.splits > 1:  # the plan's edits never make this: a split grid is one of few tiles
        raise ValueError(f"region {r.rid}: a persistent grid keeps K whole")
    rid, bn = r.rid, rp.bn
    stages = stages_of(rp)
    b = blocks(bn, hunter)
    smem = smem_bytes(bn, stages)
    out_dt = epi.out_dtype if epi else "float32"
    sig = signature(epi, out_dt)
    if persistent:
        sig = Signature((*sig.params, i32("TILES", "grid")))
    consumers = gemm_tf32.consumers(wait_full=True, ready=False)
    body = (
        (gemm_tf32.PERSISTENT_PROLOGUE if persistent else gemm.PROLOGUE)
        + _producer(persistent).replace("TMA_COPY", b["tma"].name)
        + (_persistent(consumers) if persistent else consumers)
        + gemm.EPILOGUE_HEAD
        + (_sums(_UNSCALE) if persistent else _UNSCALE)
    )
    # Split (few tiles, a long K): each block stores its share's unscaled sums into its workspace slice and
    # the 3xTF32 kernel's sum kernel adds them in order, computing the fused epilogue on the total.
    body, kernel_epi, kernel_dt, kernel_sig = gemm_tf32.split_kernel(
        rid, body, epi, out_dt, sig, rp.splits, signature, loads=4
    )
    lines = [
        *gemm.preamble(rid, b),
        "using T = cutlass::half_t;",
        f"constexpr int BM = {BM}, BN = {bn}, BK = {BK}, STAGES = {stages}, GROUP = {GROUP}, PROMOTE = {PROMOTE}"
        f"{f', SPLITS = {rp.splits}' if rp.splits > 1 else ''};",
        *stage_decls(b),
        f'static_assert(sizeof(Smem) + 1024 <= {smem}, "the launcher\'s shared-memory size is too small");',
        f"}}  // namespace kp_{rid}",
        *gemm.epilogue_function(epi, out_dt),
        f'extern "C" __global__ void __launch_bounds__(384, 1) kp_{rid}_gemm({kernel_sig.decls()}) {{',
        f"    using namespace kp_{rid};",
        f"    using Full = {b['full'].name};",
        f"    using Barrier = {b['empty'].name};",
        body,
        *(_sums(ln) if persistent else ln for ln in gemm.store(kernel_epi, kernel_dt)),
        *(["    }  // the block's next tile"] if persistent else []),
        "}",
        SPLIT.replace("RID", rid),
    ]
    names, values, outs = gemm.region_io(r, epi)
    src = launcher(rid, f, epi, bn, stages, smem, out_dt, names, sig)
    kernels = (f"kp_{rid}_gemm", f"kp_{rid}_rowsplit", f"kp_{rid}_colsplit")
    code = Code("\n".join(lines) + "\n", src, f"_gemm_{rid}", kernels, values, outs)
    if persistent:
        code = gemm_tf32.with_persistent_grid(code, rid, sig, smem)
    if rp.splits > 1:
        return gemm_tf32._with_split_sum(code, rid, sig, kernel_sig, smem, rp.splits, epi, out_dt)
    return code


def stage_decls(b: dict[str, atoms.Atom], ready: bool = False) -> list[str]:
    """The MMA, the ring's layouts (the `smem` block's swizzle) and its Smem: hi and lo of A and B a stage,
    then the barriers; `ready`: a barrier a stage for writers other than TMA (the convolution's gatherers)."""
    return [
        f"using TiledMma = decltype(make_tiled_mma({b['mma'].name}<GMMA::Major::K, GMMA::Major::K>{{}},",
        "                                         Layout<Shape<_2, _1, _1>>{}));  // two consumer warpgroups",
        f"using SmemA = decltype(tile_to_shape({b['smem'].name}<T>{{}}, make_shape(Int<BM>{{}}, Int<BK>{{}}, "
        "Int<STAGES>{})));",
        f"using SmemB = decltype(tile_to_shape({b['smem'].name}<T>{{}}, make_shape(Int<BN>{{}}, Int<BK>{{}}, "
        "Int<STAGES>{})));",
        "struct Smem {",
        "    alignas(1024) T a[cosize_v<SmemA>];  // hi",
        "    alignas(1024) T alo[cosize_v<SmemA>];",
        "    alignas(1024) T b[cosize_v<SmemB>];",
        "    alignas(1024) T blo[cosize_v<SmemB>];",
        "    uint64_t full[STAGES];",
        *(["    uint64_t ready[STAGES];  // a k tile gathered"] if ready else []),
        "    uint64_t empty[STAGES];",
        "};",
    ]


# The producer warpgroup: its first thread loads the four tiles of each k tile, STAGES ahead; on a persistent
# grid across its block's tiles (ring position g: the k tiles it has passed over all of them), so the next
# tile's loads run under this one's MMAs and stores (templates/gemm_tf32.py, the persistent 3xTF32 grid).
_PRODUCER_HEAD = r"""    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; ++i) {
            Full::init(&s.full[i], 1);
            Barrier::init(&s.empty[i], 2);  // one arrive per consumer warpgroup
        }
        cutlass::arch::fence_barrier_init();
    }
    __syncthreads();
    if (wg == 0) {
        cutlass::arch::warpgroup_reg_dealloc<40>();
        if (threadIdx.x == 0) {
"""
_PRODUCER_TAIL = r"""        }
        return;
    }
    cutlass::arch::warpgroup_reg_alloc<232>();
"""
_TILES = (("tma_ah", "s.a", "BM", "m_blk"), ("tma_al", "s.alo", "BM", "m_blk"),
          ("tma_bh", "s.b", "BN", "n_blk"), ("tma_bl", "s.blo", "BN", "n_blk"))  # fmt: skip
_TX = "2 * (BM + BN) * BK * sizeof(T)"


def _producer(persistent: bool) -> str:
    if persistent:
        loop = gemm_tf32.walk_tiles(gemm_tf32.load_stage("g", 20, _TILES, _TX))
    else:
        loop = (
            "            for (int kt = 0; kt < ktiles; ++kt) {\n"
            + gemm_tf32.load_stage("kt", 16, _TILES, _TX)
            + "            }\n"
        )
    return _PRODUCER_HEAD + loop + _PRODUCER_TAIL


def _persistent(consumers: str) -> str:
    """The consumers' loop over the block's tiles: ring positions and phases from g = base + kt. The stores
    read the promoted sums, and acc is cleared once: each tile's last promotion leaves it zero, so nothing
    writes it between two tiles' MMAs (gemm_tf32._persistent_consumers, the 3xTF32 form's own)."""
    setup, rest = consumers.split(gemm_tf32.TILE_START, 1)
    subs = {
        "Barrier::arrive(&s.empty[k % STAGES]);": "Barrier::arrive(&s.empty[(base + k) % STAGES]);",
        "const int st = kt % STAGES;": "const int g = base + kt, st = g % STAGES;",
        "Full::wait(&s.full[st], (kt / STAGES) & 1);": "Full::wait(&s.full[st], (g / STAGES) & 1);",
        "    CUTE_UNROLL\n    for (int i = 0; i < size(acc); ++i) acc(i) = sum(i);\n": "",
    }
    for old, new in subs.items():
        assert rest.count(old) == 1, old
        rest = rest.replace(old, new)
    return gemm_tf32.over_tiles(setup, rest)


def _sums(text: str) -> str:
    """The epilogue's text reading the promoted sums instead of acc."""
    return re.sub(r"\bacc\b", "sum", text)


# The sums unscaled by their row's and column's powers of two (exact unless the result leaves fp32's range).
_UNSCALE = r"""
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) {
        const long long m = m0 + get<0>(tCcC(i)), n = n0 + get<1>(tCcC(i));
        if (m < M && n < N) acc(i) = ldexpf(acc(i), ea[r0 + m] + eb[(long long)batch * N + n]);
    }
"""

# The split: a line's largest magnitude, its exponent e (max * 2^-e in [2^14, 2^15); 0 for a line of zeros
# or one holding inf), then each x * 2^-e cut into hi and lo. ldexpf, not a multiply: 2^-e itself may not
# be a float (a line of subnormals). rowsplit: a block a line (grid-stride), the line read twice (the
# second time from cache). colsplit: 32 columns of a (batch, K, N) B a block, their maxima over K, then
# 32 x 32 tiles transposed through shared memory into (batch, N, ld) rows. CUT (the exponent and the cut)
# is the convolution's too (templates/conv_f16x3.py), and defined once in a source of several such regions.
CUT = r"""#ifndef KP_F16X3_CUT
#define KP_F16X3_CUT
__device__ __forceinline__ int kp_f16x3_exp(float mx) {
    int e;
    frexpf(mx, &e);  // mx = f * 2^e, f in [0.5, 1)
    return (mx > 0.f && isfinite(mx)) ? e - 15 : 0;
}
__device__ __forceinline__ void kp_f16x3_cut(float x, int e, __half& h, __half& l) {
    const float v = ldexpf(x, -e);
    h = __float2half_rn(v);
    l = __float2half_rn(v - __half2float(h));
}
struct alignas(8) kp_f16x3_h4 { __half v[4]; };  // four halves, one 8-byte store
#endif
"""
SPLIT = (
    CUT
    + r"""extern "C" __global__ void __launch_bounds__(256)
kp_RID_rowsplit(const float* __restrict__ src, __half* __restrict__ hi, __half* __restrict__ lo,
                int* __restrict__ exps, long long lines, long long len, long long ld) {
    __shared__ float part[8];
    __shared__ int shared_e;
    // 16-byte loads and 8-byte stores where every line starts 16 bytes in (ld is a multiple of 8 halves)
    const bool vec = (len & 3) == 0 && ((unsigned long long)src & 15) == 0;
    for (long long line = blockIdx.x; line < lines; line += gridDim.x) {
        const float* x = src + line * len;
        const float4* x4 = reinterpret_cast<const float4*>(x);
        float mx = 0.f;
        if (vec) {
            for (long long j = threadIdx.x; j < len / 4; j += 256) {
                const float4 v = x4[j];
                mx = fmaxf(mx, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
            }
        } else {
            for (long long j = threadIdx.x; j < len; j += 256) mx = fmaxf(mx, fabsf(x[j]));
        }
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = mx;
        __syncthreads();
        if (threadIdx.x == 0) {
            float m = part[0];
            for (int w = 1; w < 8; ++w) m = fmaxf(m, part[w]);
            shared_e = kp_f16x3_exp(m);
            exps[line] = shared_e;
        }
        __syncthreads();
        const int e = shared_e;
        __half* h = hi + line * ld;
        __half* l = lo + line * ld;
        if (vec) {
            for (long long j = threadIdx.x; j < ld / 4; j += 256) {
                const float4 v = j < len / 4 ? x4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
                kp_f16x3_h4 hv, lv;
                kp_f16x3_cut(v.x, e, hv.v[0], lv.v[0]);
                kp_f16x3_cut(v.y, e, hv.v[1], lv.v[1]);
                kp_f16x3_cut(v.z, e, hv.v[2], lv.v[2]);
                kp_f16x3_cut(v.w, e, hv.v[3], lv.v[3]);
                reinterpret_cast<kp_f16x3_h4*>(h)[j] = hv;
                reinterpret_cast<kp_f16x3_h4*>(l)[j] = lv;
            }
        } else {
            for (long long j = threadIdx.x; j < ld; j += 256) {
                __half hv = __float2half_rn(0.f), lv = hv;
                if (j < len) kp_f16x3_cut(x[j], e, hv, lv);
                h[j] = hv;
                l[j] = lv;
            }
        }
        __syncthreads();  // part and shared_e are the next line's
    }
}
extern "C" __global__ void __launch_bounds__(256)
kp_RID_colsplit(const float* __restrict__ src, __half* __restrict__ hi, __half* __restrict__ lo,
                int* __restrict__ exps, long long K, long long N, long long ld) {
    __shared__ float tile[32][33];
    __shared__ int es[32];
    const long long b = blockIdx.y, n0 = (long long)blockIdx.x * 32;
    const float* x = src + b * K * N;
    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    float mx = 0.f;
    if (n0 + tx < N)
        for (long long k = ty; k < K; k += 8) mx = fmaxf(mx, fabsf(x[k * N + n0 + tx]));
    tile[ty][tx] = mx;
    __syncthreads();
    if (ty == 0) {
        for (int w = 1; w < 8; ++w) mx = fmaxf(mx, tile[w][tx]);
        es[tx] = kp_f16x3_exp(mx);
        if (n0 + tx < N) exps[b * N + n0 + tx] = es[tx];
    }
    __syncthreads();
    for (long long k0 = 0; k0 < ld; k0 += 32) {
        for (int i = ty; i < 32; i += 8) {
            const long long k = k0 + i, n = n0 + tx;
            tile[i][tx] = (k < K && n < N) ? x[k * N + n] : 0.f;
        }
        __syncthreads();
        for (int i = ty; i < 32; i += 8) {
            const long long n = n0 + i, k = k0 + tx;
            if (n < N && k < ld) {
                __half hv, lv;
                kp_f16x3_cut(tile[tx][i], es[i], hv, lv);
                hi[(b * N + n) * ld + k] = hv;
                lo[(b * N + n) * ld + k] = lv;
            }
        }
        __syncthreads();
    }
}
"""
)


def _split_helpers(rid: str) -> list[str]:
    """The launcher's split calls: lines over K, the rows of t (..., L, K) (A; a linear layer's weight) or the
    columns of t (..., K, L) (a row-major B). A transposed view of a contiguous tensor has its lines the
    other way in memory and is split in place by the other kernel, not gathered into a copy first."""
    rows = f"kernels.kp_{rid}_rowsplit"
    cols = f"kernels.kp_{rid}_colsplit"
    return [
        "    def over_k(t, hi, lo, exps):  # the rows of t (..., L, K) over K",
        "        if t.dim() >= 2 and not t.is_contiguous() and t.transpose(-1, -2).is_contiguous():",
        "            down_k(t.transpose(-1, -2), hi, lo, exps)",
        "            return",
        "        t = _contig(t)",
        "        lines = t.numel() // k",
        f"        {rows}((max(1, min(lines, MAX_GRID_Y * 32)),), (256,), (t, hi, lo, exps, numpy.int64(lines), "
        "numpy.int64(k), numpy.int64(kp)))  # noqa: F821",
        "",
        "    def down_k(t, hi, lo, exps):  # the columns of t (..., K, L) over K",
        "        if not t.is_contiguous() and t.transpose(-1, -2).is_contiguous():",
        "            over_k(t.transpose(-1, -2), hi, lo, exps)",
        "            return",
        "        t = _contig(t)",
        "        lines = t.shape[-1]",
        "        mats = t.numel() // (k * lines)",
        "        if mats > MAX_GRID_Y:",
        "            raise ValueError(f'kernelpro expert: the fp16x3 split takes at most {MAX_GRID_Y} matrices')",
        f"        {cols}((-(-lines // 32), mats), (256,), (t, hi, lo, exps, numpy.int64(k), numpy.int64(lines), "
        "numpy.int64(kp)))  # noqa: F821",
    ]


def launcher(rid: str, f: Form, epi: GemmEpilogue | None, bn: int, stages: int, smem: int, out_dt: str,
             names: list[str], sig: Signature) -> str:  # fmt: skip
    ops_ = epi.operands if epi else ()
    kernel = (
        "our fp16x3 WGMMA kernel (operands split into fp16 halves by our kernel first; TMA, "
        f"128 x {bn} tiles, {stages} stages)"
    )
    lines = [
        *gemm.launcher_head(rid, f, epi, names, kernel),
        "    k = x.shape[-1]",
        "    lead = tuple(x.shape[:-1])",
    ]
    if f.b_major == "K":
        lines += ["    n = w.shape[0]", "    batch, m = 1, x.numel() // k"]
    else:
        rows = "1, x.numel() // k" if not f.batched else "math.prod(lead[:-1]), lead[-1]"
        lines += ["    n = w.shape[-1]", f"    batch, m = {rows}"]
    lines += [
        f"    kp = -(-k // {ALIGN}) * {ALIGN}  # the halves' rows, 16 bytes apart for TMA",
        "",
        *_split_helpers(rid),
        "",
        "    half = dict(dtype=torch.float16, device=x.device)",
        "    ah, al = torch.empty((batch, m, kp), **half), torch.empty((batch, m, kp), **half)",
        "    bh, bl = torch.empty((batch, n, kp), **half), torch.empty((batch, n, kp), **half)",
        "    ea = torch.empty(batch * m, dtype=torch.int32, device=x.device)",
        "    eb = torch.empty(batch * n, dtype=torch.int32, device=x.device)",
        f"    out = torch.empty((batch * m, n), dtype={torch_dtype(out_dt)}, device=x.device)",
        *gemm.operand_lines(ops_, "*lead", "batch * m"),
        "    if batch and m and n:",
        "        over_k(x, ah, al, ea)",
        f"        {'over_k' if f.b_major == 'K' else 'down_k'}(w, bh, bl, eb)",
    ]
    lines += [
        f"        tah = kernels.tensor_map(ah, {BM}, {BK})  # noqa: F821",
        f"        tal = kernels.tensor_map(al, {BM}, {BK})  # noqa: F821",
        f"        tbh = kernels.tensor_map(bh, {bn}, {BK})  # noqa: F821",
        f"        tbl = kernels.tensor_map(bl, {bn}, {BK})  # noqa: F821",
        f"        grid = batch * (-(-m // {BM})) * (-(-n // {bn}))",
        f"        kernels.kp_{rid}_gemm((grid,), (384,), ({sig.args()}), shared_mem={smem})  # noqa: F821",
        "    return out.reshape(*lead, n)",
    ]
    return "\n".join(lines)
