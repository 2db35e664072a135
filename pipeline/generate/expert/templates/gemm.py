"""Our own Hopper GEMM for 16-bit linear layers, matmul and batched matmul, with the elementwise region
after it fused on its stores (which GEMMs it takes, and its plans: families/gemm16.py).

out = epilogue(a @ b), bf16 or fp16 operands, fp32 accumulators. A is (..., M, K), K contiguous. B is a
linear layer's weight (N, K), K contiguous ("K-major"), or the second operand of mm / matmul / bmm,
(..., K, N) with N contiguous ("MN-major"). Batched operands have equal leading dims: one GEMM per batch.
A warp-specialised kernel: one producer warpgroup issues TMA loads of 128 x 64 (A) and BN x 64 (B)
tiles into a ring of shared-memory stages (128-byte swizzle; an MN-major B arrives as BN/64 boxes of
64 x 64), two consumer warpgroups run WGMMA on them (64 x BN each), released stage by stage through
mbarriers. Tiles are rasterised in groups of GROUP row-tiles so that neighbouring blocks share B tiles
in L2. The epilogue applies the fused elementwise chain in fp32 to the accumulators and stores once,
guarded at the edges; TMA fills reads outside each batch's matrices with zeros, so any M, any N and
any K work that keep TMA's rows 16-byte aligned (K, and N for an MN-major B, multiples of 8).

The MMA atom, the TMA copy, the barriers and the swizzled layout are looked up by what they do
(atoms.py), not written in by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.generate.expert import atoms, ops
from pipeline.generate.expert.layout import Bcast
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import Code, chain_function, ctype, torch_dtype
from pipeline.generate.expert.templates.signature import Param, Signature, i32, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.gemm_kit import GemmPlan

BM, BK, GROUP = 128, 64, 8
TILE_N = (128, 256)
SMEM_LIMIT = 227 * 1024  # opt-in dynamic shared memory per block on sm_90
CUTE_TYPES = {"bfloat16": "cutlass::bfloat16_t", "float16": "cutlass::half_t"}  # the operand types it takes
_GATHER = {"bfloat16": "bf16", "float16": "f16"}  # the gather kernels every generated source carries


@dataclass(frozen=True)
class GemmEpilogue:
    region: Region
    main: str  # the GEMM output, bound to the chain's operand
    operands: tuple[tuple[str, str, Bcast], ...]  # (value, dtype, FULL, SCALAR, COL or ROW) of the others
    out: str
    out_dtype: str
    # A gated epilogue (SwiGLU and kin): the chain reads the GEMM output's two halves along N, `main` the
    # first and `up` the second; the tile then holds BN / 2 columns of each, and writes BN / 2 out.
    up: str = ""


@dataclass(frozen=True)
class Form:
    """How the GEMM's operands lie in memory."""

    b_major: str  # "K": B is a linear layer's (N, K) weight; "MN": B is (..., K, N), row-major
    batched: bool  # (..., M, K) @ (..., K, N) with equal leading dims; otherwise A's leading dims are rows
    pad_rows: bool = False  # K (or N of a row-major B) not a 16-byte multiple: rows copied wider for TMA


def max_stages(bn: int) -> int:
    stage = (BM + bn) * BK * 2
    return max(2, (SMEM_LIMIT - 2048) // stage)


def smem_bytes(bn: int, stages: int) -> int:
    """sizeof(Smem) (tiles padded to 1024 bytes, then the barriers) plus 1024 for aligning the base."""
    tiles = (BM + bn) * BK * stages * 2
    return tiles + 1024 + 1024


def blocks(rp: GemmPlan, dtype: str, f: Form, hunter: Any = None) -> dict[str, atoms.Atom]:
    found = {
        "mma": atoms.find(atoms.gmma(rp.bn, dtype), hunter),
        "tma": atoms.find(atoms.TMA_LOAD_3D, hunter),
        "full": atoms.find(atoms.TX_BARRIER, hunter),
        "empty": atoms.find(atoms.ARRIVE_BARRIER, hunter),
        "smem": atoms.find(atoms.SW128_K, hunter),
    }
    if f.b_major == "MN":
        found["smem_b"] = atoms.find(atoms.SW128_MN, hunter)
    return found


def render(r: Region, f: Form, rp: GemmPlan, epi: GemmEpilogue | None, hunter: Any = None) -> Code:
    """The kernel and its launcher for a library region in the form `f`; raises atoms.AtomNotFound."""
    rid = r.rid
    dt = r.node.dtype
    bn, stages = rp.bn, rp.stages
    b = blocks(rp, dt, f, hunter)
    smem = smem_bytes(bn, stages)
    out_dt = epi.out_dtype if epi else dt
    lines = [
        *preamble(rid, b),
        f"using T = {CUTE_TYPES[dt]};",
        f"constexpr int BM = {BM}, BN = {bn}, BK = {BK}, STAGES = {stages}, GROUP = {GROUP};",
        f"using TiledMma = decltype(make_tiled_mma({b['mma'].name}<GMMA::Major::K, GMMA::Major::{f.b_major}>{{}},",
        "                                         Layout<Shape<_2, _1, _1>>{}));  // two consumer warpgroups",
        f"using SmemA = decltype(tile_to_shape({b['smem'].name}<T>{{}}, make_shape(Int<BM>{{}}, Int<BK>{{}}, "
        "Int<STAGES>{})));",
        _smem_b(f, b),
        "struct Smem {",
        "    alignas(1024) T a[cosize_v<SmemA>];",
        "    alignas(1024) T b[cosize_v<SmemB>];",
        "    uint64_t full[STAGES];",
        "    uint64_t empty[STAGES];",
        "};",
        f'static_assert(sizeof(Smem) + 1024 <= {smem}, "the launcher\'s shared-memory size is too small");',
    ]
    lines.append(f"}}  // namespace kp_{rid}")
    lines += epilogue_function(epi, out_dt)
    sig = signature(epi, out_dt)
    lines += [
        f'extern "C" __global__ void __launch_bounds__(384, 1) kp_{rid}_gemm({sig.decls()}) {{',
        f"    using namespace kp_{rid};",
        f"    using Full = {b['full'].name};",
        f"    using Empty = {b['empty'].name};",
        _BODY.replace("LOAD_B", _LOAD_B[f.b_major]).replace("TMA_COPY", b["tma"].name) + EPILOGUE_HEAD,
        *store(epi, out_dt),
        "}",
    ]
    return code(r, f, epi, rp, lines, smem, out_dt, sig, boxes(f, rp, dt))


def preamble(rid: str, b: dict[str, atoms.Atom]) -> list[str]:
    """The includes the building blocks need, where each is defined, and the kernel's namespace opened."""
    headers = sorted({a.header for a in b.values()})
    return [
        "#include <cuda.h>",
        *(f"#include <{h}>" for h in headers),
        "#include <cute/tensor.hpp>",
        "#include <cutlass/arch/reg_reconfig.h>",
        "",
        *(f"// building block: {a.cite()}" for a in b.values()),
        f"namespace kp_{rid} {{",
        "using namespace cute;",
    ]


def code(r: Region, f: Form, epi: GemmEpilogue | None, rp: GemmPlan, lines: list[str], smem: int, out_dt: str,
         sig: Signature, bx: Boxes) -> Code:  # fmt: skip
    """The region's Code: the kernel's lines, and the launcher that feeds it x, w and the epilogue's operands."""
    rid = r.rid
    names, values, outs = region_io(r, epi)
    pad = f.pad_rows
    src = launcher(rid, f, epi, rp, smem, out_dt, names, sig, bx, pad)
    cuda = "\n".join(lines + (pad_kernel(rid, r.node.dtype) if pad else [])) + "\n"
    kernels = (f"kp_{rid}_gemm", *((f"kp_{rid}_pad",) if pad else ()))
    return Code(cuda, src, f"_gemm_{rid}", kernels, values, outs)


def region_io(r: Region, epi: GemmEpilogue | None) -> tuple[list[str], tuple[str, ...], tuple[str, ...]]:
    """A GEMM launcher's parameter names (x, w, then e0... for the epilogue's operands), the values fed to
    them, and the region's outputs (the epilogue's, where there is one)."""
    a, w = r.node.args[:2]
    ops_ = epi.operands if epi else ()
    inputs = [("x", a.name), ("w", w.name), *((f"e{k}", v) for k, (v, _, _) in enumerate(ops_))]
    outs = (epi.out,) if epi else r.outputs
    return [name for name, _ in inputs], tuple(v for _, v in inputs), outs


# The consumer warpgroups' start: their registers, the MMA slice and fragments over the stages, the accumulators.
CONSUMER = r"""    cutlass::arch::warpgroup_reg_alloc<232>();
    TiledMma mma;
    auto thr = mma.get_slice(threadIdx.x - 128);
    Tensor sA = make_tensor(make_smem_ptr(s.a), SmemA{});
    Tensor sB = make_tensor(make_smem_ptr(s.b), SmemB{});
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    Tensor acc = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
"""
# The shared memory, this block's tile and batch: the start of every WGMMA kernel body here.
SMEM = r"""    extern __shared__ char smem_raw[];
    // 1024-byte aligned by an offset from the shared array itself, so the compiler still knows the address
    // is shared memory (aligned through an integer, every access to s became a generic LD/ST)
    Smem& s = *reinterpret_cast<Smem*>(smem_raw + ((1024 - (unsigned)(__cvta_generic_to_shared(smem_raw) & 1023)) & 1023));
    const int wg = threadIdx.x / 128;
"""
PROLOGUE = (
    SMEM
    + r"""    const int ktiles = (K + BK - 1) / BK;
    // Grouped rasterisation within each batch: GROUP row-tiles run together and share B tiles in L2.
    const int mt = (M + BM - 1) / BM, nt = (N + BN - 1) / BN;
    const int batch = blockIdx.x / (mt * nt), tile = blockIdx.x % (mt * nt);
    const int per_group = GROUP * nt;
    const int first = (tile / per_group) * GROUP;
    const int rows = min(mt - first, GROUP);
    const int m_blk = first + (tile % per_group) % rows;
    const int n_blk = (tile % per_group) / rows;
"""
)
_BODY = (
    PROLOGUE
    + r"""    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; ++i) {
            Full::init(&s.full[i], 1);
            Empty::init(&s.empty[i], 2);  // one arrive per consumer warpgroup
        }
        cutlass::arch::fence_barrier_init();
    }
    __syncthreads();
    if (wg == 0) {  // producer: one thread issues the TMA loads, STAGES tiles ahead of the consumers
        cutlass::arch::warpgroup_reg_dealloc<40>();
        if (threadIdx.x == 0) {
            for (int kt = 0; kt < ktiles; ++kt) {
                const int st = kt % STAGES;
                if (kt >= STAGES) Empty::wait(&s.empty[st], ((kt / STAGES) - 1) & 1);
                Full::arrive_and_expect_tx(&s.full[st], (BM + BN) * BK * sizeof(T));
                TMA_COPY::copy(&tma_a, &s.full[st], 0, s.a + st * BM * BK, kt * BK, m_blk * BM, batch);
LOAD_B
            }
        }
        return;
    }
"""
    + CONSUMER
    + r"""    clear(acc);
    for (int kt = 0; kt < ktiles; ++kt) {
        const int st = kt % STAGES;
        Full::wait(&s.full[st], (kt / STAGES) & 1);
        warpgroup_fence_operand(acc);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tCrA); ++kb) cute::gemm(mma, tCrA(_, _, kb, st), tCrB(_, _, kb, st), acc);
        warpgroup_commit_batch();
        warpgroup_wait<1>();  // keep this tile's MMAs in flight; the previous tile's are done
        warpgroup_fence_operand(acc);
        if (kt > 0 && threadIdx.x % 128 == 0) Empty::arrive(&s.empty[(kt - 1) % STAGES]);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
"""
)
# After the main loop, before the stores: where each accumulator lies in the output.
PAIRS_LINE = (
    "\n    const bool pairs = (N & 1) == 0;  // two adjacent columns per store when rows stay aligned"
)
EPILOGUE_HEAD = (
    r"""    Tensor tCcC = thr.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
    const long long m0 = (long long)m_blk * BM, n0 = (long long)n_blk * BN;
    const long long r0 = (long long)batch * M;  // the batch's first row of the output (and of row operands)"""
    + PAIRS_LINE
)


def epilogue_function(epi: GemmEpilogue | None, out_dt: str) -> list[str]:
    """The fused chain as a device function, at global scope beside the prelude's helpers it calls."""
    if epi is None:
        return []
    # A 16-bit output keeps about 2^-9 of each value: the hardware tanh (error about 2^-11) is
    # exact enough, and the exact tanhf costs the epilogue, which does not overlap the MMAs, ~6%.
    mufu = out_dt in ("bfloat16", "float16")
    return [*([MUFU] if mufu else []), chain_function(epi.region, list(epi.region.inputs), mufu)]


def signature(epi: GemmEpilogue | None, out_dt: str) -> Signature:
    """The kernel's parameters: both tensor maps, the output, the epilogue's operands, the sizes."""
    tmap = "const __grid_constant__ CUtensorMap"
    ops_ = epi.operands if epi else ()
    return Signature((
        Param("tma_a", tmap, "ta"), Param("tma_b", tmap, "tb"), ptr("out", ctype(out_dt), const=False),
        *(ptr(f"e{k}", ctype(d)) for k, (_, d, _) in enumerate(ops_)), i32("M", "m"), i32("N", "n"), i32("K", "k"),
    ))  # fmt: skip


def _smem_b(f: Form, b: dict[str, atoms.Atom]) -> str:
    if f.b_major == "K":
        return (
            f"using SmemB = decltype(tile_to_shape({b['smem'].name}<T>{{}}, make_shape(Int<BN>{{}}, Int<BK>{{}}, "
            "Int<STAGES>{})));"
        )
    # K fastest across atoms: each 64-wide column block of a stage is one contiguous 64 x 64 TMA box
    return (
        f"using SmemB = decltype(tile_to_shape({b['smem_b'].name}<T>{{}}, make_shape(Int<BN>{{}}, Int<BK>{{}}, "
        "Int<STAGES>{}), Step<_2, _1, _3>{}));"
    )


# Guarded: each fused epilogue that uses it emits it, and one source may hold several GEMMs' (an MoE block's).
MUFU = r"""#ifndef KP_MUFU_DEFINED
#define KP_MUFU_DEFINED
__device__ __forceinline__ float kp_tanh_mufu(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float kp_gelu_tanh_mufu(float x) {
    return 0.5f * x * (1.0f + kp_tanh_mufu(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
#endif"""
_LOAD_B = {
    "K": "                TMA_COPY::copy(&tma_b, &s.full[st], 0, s.b + st * BN * BK, kt * BK, n_blk * BN, batch);",
    "MN": "                for (int i = 0; i < BN / 64; ++i)\n"
    "                    TMA_COPY::copy(&tma_b, &s.full[st], 0, s.b + st * BN * BK + i * 64 * BK, n_blk * BN + 64 * i,\n"
    "                                   kt * BK, batch);",
}


# A gated epilogue's premise, checked where it is used: column c and c + BN / 2 are i and i + size(acc) / 2.
PAIRING = "        if (get<1>(tCcC(i + size(acc) / 2)) != get<1>(tCcC(i)) + BN / 2) __trap();"


def epilogue_call(epi: GemmEpilogue, main: str, up: str, col: str, out: str) -> str:
    """The fused chain's call on one output: `main` (and `up`, gated) its accumulator values, `col` its
    column; `m` (its row in its matrix) and `r` (its row in the output) are in scope where it is used."""
    # a positional chain's row and column in its matrix (families/gemm_kit.py: only per-matrix rows)
    args = ["m", col] if ops.positional(epi.region.nodes) else []
    for i in epi.region.inputs:
        if i == epi.main or (epi.up and i == epi.up):
            args.append(main if i == epi.main else up)
            continue
        j = next(j for j, (v, _, _) in enumerate(epi.operands) if v == i)
        at = {Bcast.FULL: f"r * N + {col}", Bcast.COL: col, Bcast.ROW: "r", Bcast.SCALAR: "0"}
        args.append(f"kp::ld(e{j}[{at[epi.operands[j][2]]}])")
    return f"kp_{epi.region.rid}_f({', '.join([*args, out])})"


# An output type's two-value vector and the expression that packs v0, v1 into it
_PAIR = {
    "float": ("float2", "make_float2(v0, v1)"),
    "__half": ("__half2", "__floats2half2_rn(v0, v1)"),
    "__nv_bfloat16": ("__nv_bfloat162", "__floats2bfloat162_rn(v0, v1)"),
}


def store(epi: GemmEpilogue | None, out_dt: str) -> list[str]:
    """The epilogue: accumulator pairs (i, i + 1) are adjacent columns of one row in the GMMA layout."""
    ot = ctype(out_dt)

    gated = epi is not None and bool(epi.up)

    def value(k: int) -> str:
        if epi is None:
            return f"acc(i + {k})"
        # the GMMA accumulators hold columns c and c + BN / 2 at i and i + size(acc) / 2
        return epilogue_call(epi, f"acc(i + {k})", f"acc(i + {k} + size(acc) / 2)", f"n + {k}", f"v{k}")

    pair, make = _PAIR[ot]
    return [
        "    CUTE_UNROLL",
        f"    for (int i = 0; i < size(acc){' / 2' if gated else ''}; i += 2) {{",
        *([PAIRING] if gated else []),
        "        const long long m = m0 + get<0>(tCcC(i)), n = n0 + get<1>(tCcC(i));",
        "        if (m >= M || n >= N) continue;",
        "        const long long r = r0 + m;",
        "        float v0, v1;",
        f"        {value(0) if epi else 'v0 = acc(i)'};",
        "        if (pairs && n + 1 < N) {",
        f"            {value(1) if epi else 'v1 = acc(i + 1)'};",
        f"            *reinterpret_cast<{pair}*>(out + r * N + n) = {make};",
        "        } else {",
        f"            out[r * N + n] = kp::cv<{ot}>(v0);",
        "            if (n + 1 < N) {",
        f"                {value(1) if epi else 'v1 = acc(i + 1)'};",
        f"                out[r * N + n + 1] = kp::cv<{ot}>(v1);",
        "            }",
        "        }",
        "    }",
    ]


def staging_bytes(out_dt: str) -> int:
    """Shared memory of staged_store: two warpgroups' 64 x 64 blocks, each row padded by 16 bytes."""
    size = 4 if ctype(out_dt) == "float" else 2
    return 2 * 64 * (64 + 16 // size) * size


def staged_store(epi: GemmEpilogue | None, out_dt: str, halves: bool = False) -> list[str]:
    """The epilogue through shared memory (`s.c`, staging_bytes): each consumer warpgroup writes its 64 rows of
    the tile into its own block 64 columns at a time, then stores the block in 16-byte vectors, a row's 128
    bytes by 8 lanes. Direct stores (store) put two columns of 8 rows in each warp store: 8 partly written
    lines a store, 8 times the lines per byte. The 16-byte pad of a block's rows puts the 8 rows a warp writes
    at once on 8 bank groups. Values past the output's rows or columns are neither computed (the fused chain's
    operands end there) nor stored; the block's bytes for them are never read.
    `halves`: the warpgroup holds a whole 128-row tile (ping-pong consumers: accumulators (values, 2, 1)),
    staged as two 64-row halves through the same block (gated: the up value size<0>(acc) / 2 after the gate's
    in the same half)."""
    ot = ctype(out_dt)
    gated = epi is not None and bool(epi.up)
    at, half = (", h, 0", "size<0>(acc) / 2") if halves else ("", "size(acc) / 2")

    def value(k: int) -> str:
        if epi is None:
            return f"v{k} = acc(i + {k}{at})"
        return epilogue_call(epi, f"acc(i + {k}{at})", f"acc(i + {k} + {half}{at})", f"n + {k}", f"v{k}")

    pair, make = _PAIR[ot]
    shape = (
        "static_assert(size<0>(acc) == BN / 2 && size<1>(acc) == 2 && TN % 64 == 0, \"a warpgroup's 128 x BN "
        'accumulators, two 64-row halves, 64-column blocks");'
        if halves
        else "static_assert(size(acc) == BN / 2 && TN % 64 == 0, \"a warpgroup's 64 x BN accumulators, 64-column "
        'blocks");'
    )
    lines = [
        f"    constexpr int VEC = 16 / sizeof({ot}), CP = 64 + VEC;  // a block row, padded by 16 bytes",
        f"    {shape}",
        f"    {ot}* const cs = s.c + (wg - 1) * 64 * CP;",
        "    const bool rows16 = N % VEC == 0;  // every output row starts 16-byte aligned",
        *(
            ["    CUTE_UNROLL", "    for (int h = 0; h < 2; ++h) {", "    const int wrow = 64 * h;"]
            if halves
            else ["    const int wrow = 64 * (wg - 1);"]
        ),
        "    CUTE_UNROLL",
        "    for (int j = 0; j < TN / 64; ++j) {",
        "        // GMMA's accumulator layout: values 4c..4c+3 are columns 8c, 8c + 1 of two rows, so block j is",
        "        // values 32j..32j+31" + (f" (the gate's; the up value is {half} further)" if gated else ""),
        "        CUTE_UNROLL",
        "        for (int i = 32 * j; i < 32 * j + 32; i += 2) {",
        *(
            [
                f"            if (get<1>(tCcC(i + {half}{at})) != get<1>(tCcC(i{at})) + BN / 2) __trap();"
                "  // gate and up pair"
            ]
            if gated
            else []
        ),
        f"            const int tr = get<0>(tCcC(i{at})), tc = get<1>(tCcC(i{at}));",
        "            const long long m = m0 + tr, n = n0 + tc;",
        "            if (m >= M || n >= N) continue;",
        "            [[maybe_unused]] const long long r = r0 + m;  // the fused chain's row operands' row",
        "            float v0, v1 = 0.f;",
        f"            {value(0)};",
        f"            if (n + 1 < N) {value(1)};",
        f"            *reinterpret_cast<{pair}*>(cs + (tr - wrow) * CP + tc % 64) = {make};",
        "        }",
        '        asm volatile("bar.sync %0, 128;" ::"r"(wg) : "memory");  // this warpgroup\'s block is written',
        "        for (int v = threadIdx.x % 128; v < 64 * 64 / VEC; v += 128) {",
        "            const int br = v / (64 / VEC), bc = v % (64 / VEC) * VEC;",
        "            const long long m = m0 + wrow + br, n = n0 + 64 * j + bc;",
        "            if (m >= M || n >= N) continue;",
        f"            const {ot}* src = cs + br * CP + bc;",
        f"            {ot}* dst = out + (r0 + m) * N + n;",
        "            if (rows16 && n + VEC <= N) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);",
        "            else for (int e = 0; e < VEC && n + e < N; ++e) dst[e] = src[e];",
        "        }",
        '        asm volatile("bar.sync %0, 128;" ::"r"(wg) : "memory");  // read before block j + 1 is written',
        "    }",
    ]
    return lines + (["    }"] if halves else [])


def operand_lines(ops_: tuple[tuple[str, str, Bcast], ...], lead: str, rows: str) -> list[str]:
    """Launcher lines shaping the epilogue's operands as the kernel indexes them: a full (rows, n) matrix, a
    column vector (n,), a row vector (rows,), or a scalar. `lead` is the output's leading dims."""
    lines = []
    for k, (_, _, cls) in enumerate(ops_):
        e = f"e{k}"
        if cls is Bcast.FULL:
            lines.append(f"    {e} = _full({e}, ({lead}, n)).reshape({rows}, n)")
        elif cls is Bcast.COL:
            lines.append(f"    {e} = _contig({e}.reshape(n))")
        elif cls is Bcast.ROW:
            lines.append(f"    {e} = _full({e}, ({lead}, 1)).reshape({rows})")
        else:
            lines.append(f"    {e} = _scalar({e})")
    return lines


@dataclass(frozen=True)
class Boxes:
    """What the launcher needs of a kernel's tiles: TMA boxes (rows, cols) and the 16-byte row rule."""

    a: tuple[int, int]
    b: tuple[int, int]
    align: int  # elements per 16 bytes: K (and N of a row-major B) must be multiples of it
    gather: str  # the gather kernel that copies a misaligned operand
    kind: str  # how the doc line names the kernel
    transpose_b: bool = False  # the kernel reads B K-major only: a row-major B is gathered K-major first


def boxes(f: Form, rp: GemmPlan, dt: str) -> Boxes:
    b = (rp.bn, BK) if f.b_major == "K" else (BK, 64)
    return Boxes((BM, BK), b, 8, _GATHER[dt], "WGMMA kernel")


def pad_kernel(rid: str, dt: str) -> list[str]:
    """Our copy of an operand into rows a 16-byte multiple apart (what TMA reads); the columns past its width
    are never read: the tensor map stops at the width, and TMA fills what lies beyond it with zeros."""
    ct = ctype(dt)
    return [
        'extern "C" __global__ void __launch_bounds__(256)',
        f"kp_{rid}_pad(const {ct}* __restrict__ src, {ct}* __restrict__ dst, long long rows, long long w, "
        "long long wp) {",
        "    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * w;",
        "         i += (long long)gridDim.x * blockDim.x) {",
        "        const long long r = i / w;",
        "        dst[r * wp + (i - r * w)] = src[i];",
        "    }",
        "}",
    ]


def tma_rows(rid: str, q: int) -> list[str]:
    """A launcher's nested helper (after tma_ready): t as TMA can read it, its rows copied by our kernel into
    rows a multiple of q elements apart when its width is not (a view of the width: no torch copy)."""
    return [
        "",
        "    def tma_rows(t):  # rows 16 bytes apart for TMA: else copied into wider rows by our kernel",
        "        t = tma_ready(t)",
        "        width = t.shape[-1]",
        f"        if width % {q} == 0 or t.numel() == 0:",
        "            return t",
        f"        wp = -(-width // {q}) * {q}",
        "        wide = torch.empty((*t.shape[:-1], wp), dtype=t.dtype, device=t.device)",
        "        args = (t, wide, numpy.int64(t.numel() // width), numpy.int64(width), numpy.int64(wp))",
        f"        kernels.kp_{rid}_pad((max(1, min(-(-t.numel() // 256), MAX_GRID_Y * 32)),), (256,), args)"
        "  # noqa: F821",
        "        return wide[..., :width]",
    ]


def tma_ready(gather: str) -> list[str]:
    """A launcher's nested helper: t contiguous on a 16-byte aligned base, as TMA needs; else our gather
    kernel copies it (not torch: the candidate stays our kernels only)."""
    return [
        "    def tma_ready(t):  # contiguous on a 16-byte aligned base, as TMA needs: else our gather copies it",
        "        t = _contig(t)",
        "        if t.data_ptr() % 16 == 0 or t.numel() == 0:",
        "            return t",
        "        c = torch.empty(t.shape, dtype=t.dtype, device=t.device)",
        "        pad = 8 - t.dim()",
        "        args = (t, c, numpy.int64(t.numel()), numpy.int32(t.dim()),",
        "                *(numpy.int64(v) for v in (*t.shape, *[1] * pad, *t.stride(), *[0] * pad)))",
        f"        kernels.kp_gather_{gather}((max(1, min(-(-t.numel() // 256), MAX_GRID_Y * 32)),), (256,), args)"
        "  # noqa: F821",
        "        return c",
    ]


def launcher_head(rid: str, f: Form, epi: GemmEpilogue | None, names: list[str], kernel: str) -> list[str]:
    """A GEMM launcher's def line and docstring: what it computes, then `kernel` (which, and its tiles)."""
    what = {"K": "x @ w^T", "MN": "x @ w"}[f.b_major] + (" per batch" if f.batched else "")
    return [
        f"def _gemm_{rid}(sms, {', '.join(names)}):",
        f'    """{what}{" and the fused epilogue" if epi else ""}: {kernel}."""',
    ]


def launcher(rid: str, f: Form, epi: GemmEpilogue | None, rp: GemmPlan, smem: int, out_dt: str,
              names: list[str], sig: Signature, bx: Boxes, pad: bool = False) -> str:  # fmt: skip
    ops_ = epi.operands if epi else ()
    lines = [
        *launcher_head(rid, f, epi, names, f"our {bx.kind} (TMA, 128 x {rp.bn} tiles, {rp.stages} stages)"),
        "",
        *tma_ready(bx.gather),
        *(tma_rows(rid, bx.align) if pad else ()),
        "",
        "    k = x.shape[-1]",
        "    lead = tuple(x.shape[:-1])",
    ]
    ready = "tma_rows" if pad else "tma_ready"
    if f.b_major == "K":
        lines += [
            "    n = w.shape[0]",
            "    batch, m = 1, x.numel() // k",
            f"    b = {ready}(w).reshape(1, n, k)",
        ]
    else:
        rows = "1, x.numel() // k" if not f.batched else "math.prod(lead[:-1]), lead[-1]"
        lead_b = "batch" if f.batched else "1"
        b = f"{ready}(_contig(w.transpose(-1, -2))).reshape({lead_b}, n, k)" if bx.transpose_b else (
            f"{ready}(w).reshape({lead_b}, k, n)")  # fmt: skip
        lines += ["    n = w.shape[-1]", f"    batch, m = {rows}", f"    b = {b}"]
    if not pad:
        q = bx.align
        rows16 = f"k % {q}" if f.b_major == "K" else f"k % {q} or n % {q}"  # rows of A and B that TMA reads
        lines += [
            f"    if {rows16}:",
            f"        raise ValueError(f'kernelpro expert: our {bx.kind} needs 16-byte rows for TMA (K, and N of "
            f"a row-major B, multiples of {q}), not K={{k}}, N={{n}}')",
        ]
    lines += [
        f"    a = {ready}(x).reshape(batch, m, k)",
        f"    out = torch.empty((batch * m, n), dtype={torch_dtype(out_dt)}, device=x.device)",
    ]
    lines += operand_lines(ops_, "*lead", "batch * m")
    lines += [
        "    if batch and m and n:",
        f"        ta = kernels.tensor_map(a, {bx.a[0]}, {bx.a[1]})  # noqa: F821",
        f"        tb = kernels.tensor_map(b, {bx.b[0]}, {bx.b[1]})  # noqa: F821",
        f"        grid = batch * (-(-m // {BM})) * (-(-n // {rp.bn}))",
        f"        kernels.kp_{rid}_gemm((grid,), (384,), ({sig.args()}), shared_mem={smem})  # noqa: F821",
        "    return out.reshape(*lead, n)",
    ]
    return "\n".join(lines)
