"""Our own Hopper GEMM for fp32 operands at fp32 accuracy on the tensor cores: 3xTF32 (which GEMMs it takes,
and its plans: families/gemm_tf32.py).

tf32 WGMMA reads an fp32 value's sign, exponent and top 10 mantissa bits and ignores the other 13. Each
operand is split as x = hi + lo, hi = x with its low 13 bits cleared (what the hardware reads of x itself)
and lo = x - hi (exact in fp32), and a.b is accumulated in fp32 as a_lo.b + a.b_lo + a.b. The dropped
a_lo.b_lo and the truncation of lo are each below 2^-20 of |a||b|: the error stays near fp32's own (the
harness's anchored tolerance holds it to a small multiple of eager's), at a third of the tf32 rate, about
three times the H200's fp32 CUDA-core rate. A single tf32 product (10 bits) would not pass.

384 threads. Warpgroup 0 is the producer: its first thread issues TMA loads of fp32 tiles (A: 128 x 32,
B: BN x 32, 128-byte swizzle) into a ring of STAGES; its other three warps split B's tile once it lands,
writing b_lo into a ring of LO_STAGES in the same swizzled layout (the element at offset i of a stage has
its lo at offset i of its lo stage). Two consumer warpgroups load their 64 rows of A into registers, split
them there (a_hi, a_lo), run the three WGMMA passes on 64 x BN each (A from registers, B from shared
memory) and release both stages. Memory traffic stays one read of each operand. The epilogue (the fused
elementwise chain, guarded stores) is the 16-bit kernel's.

Why A in registers: with both operands in shared memory, each k tile (BN = 128) asked shared memory for
about 240 KB (three passes of A and B for each warpgroup, the split's reads and writes of both, the TMA's
writes), 1900 cycles at 128 bytes a cycle against 1540 of MMA at the tf32 peak, and a stage with its lo was
64 KB, three deep, two held by the MMAs in flight: the kernel ran at about 60% of the 3xTF32 peak
(docs/benchmarks.md). With A read once into registers and only B split, a k tile asks for about 176 KB, and
the raw ring (32 KB a stage) goes five deep beside a lo ring of B alone.

The tensor cores' fp32 accumulation is not fp32's rounded add: summing all of K in the WGMMA accumulator
was off by up to 9e-3 on randn @ randn at K = 4096 (eager: 1e-4; docs/benchmarks.md), an error that grows
with |acc| and keeps its sign. So the accumulator holds PROMOTE k tiles from zero, and each such chunk is
added to fp32 registers on the CUDA cores, rounded to nearest (DeepSeek-V3's promotion for fp8).

tf32 WGMMA reads K-major operands only. A row-major (K, N) B ("MN-major") is first copied K-major by our
tiled transpose (32 x 32 tiles through shared memory): one more read and write of B, about 1% of an 8192^3
product at copy speed (the generic gather used before read B column-wise, far slower). A transposing split inside the
kernel (a staging tile, 4 x 4 register transposes) was tried on the H200 before the promotion above and
failed the same way; it may be right, and is not retried yet.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipeline.generate.expert import atoms
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates import gemm
from pipeline.generate.expert.templates.code import Code, ctype
from pipeline.generate.expert.templates.gemm import BM, GROUP, SMEM_LIMIT, Boxes, Form, GemmEpilogue
from pipeline.generate.expert.templates.signature import Signature, i32, i64, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.gemm_tf32 import Tf32Plan

BK = 32  # one 128-byte swizzle row of fp32
# 128 at the widest: the promoted sums double the accumulators' registers, and at 256 they spilled (512 B a
# thread) and ran at half the speed of 128 on the H200. 64 and 32 are for grids of few tiles (the tuned
# plan's cost model chooses: families/gemm_tf32.py); the implicit-GEMM convolution runs the same split and
# consumer loops at widths 8 to 128.
TILE_N = (32, 64, 128)  # each with a ring of at least two stages (tests/test_gemm.py)
PROMOTE = 4  # k tiles (128 of K) accumulated by the tensor cores before their sum is added on the CUDA cores
MAX_SPLITS = 32  # K split across this many blocks at most (split-K: few output tiles, a long K)
SPLITTERS = 96  # the producer warpgroup's warps 1-3
LO_STAGES = 3  # the lo ring of B: the consumers hold two k tiles' lo, the splitters write the third
_FLOAT = 4


def stage_bytes(bn: int) -> int:
    """A raw stage: A and B (K-major, whatever the form: a row-major B is gathered K-major first)."""
    return (BM + bn) * BK * _FLOAT


def lo_bytes(bn: int) -> int:
    """The lo ring: B's lo for LO_STAGES k tiles (A's lo lives in the consumers' registers)."""
    return LO_STAGES * bn * BK * _FLOAT


def max_stages(bn: int, staging: int = 0) -> int:
    """The deepest ring that fits beside the lo ring (and `staging` bytes of staged stores)."""
    return (SMEM_LIMIT - 2048 - lo_bytes(bn) - staging) // stage_bytes(bn)


def smem_bytes(bn: int, stages: int, staging: int = 0) -> int:
    """sizeof(Smem) (tiles in 1024-byte aligned arrays, then the barriers) plus 1024 for aligning the base."""
    return stage_bytes(bn) * stages + lo_bytes(bn) + staging + 1024 + 1024


def why_unstaged(rp: Tf32Plan, out_dt: str) -> str:
    """Why the plan's stores cannot go through shared memory (gemm.staged_store), or "" when they can: its
    blocks are 64 columns wide, a split's partials are stored apart, and the staging takes ~34 KB."""
    if rp.bn % 64:
        return f"a {rp.bn}-wide tile (staged blocks are 64 columns)"
    if rp.splits > 1:
        return "a split's partials are stored directly"
    if rp.stages > (top := max_stages(rp.bn, gemm.staging_bytes(out_dt))):
        return f"{rp.stages} stages and the staging do not fit shared memory ({top} stages at most)"
    return ""


def blocks(rp: Tf32Plan, hunter: Any = None, a_regs: bool = False) -> dict[str, atoms.Atom]:
    """The building blocks; a_regs: the MMA atom that reads A from registers (the GEMM's, not the
    convolution's)."""
    return {
        "mma": atoms.find(atoms.gmma_tf32(rp.bn, a_regs), hunter),
        "tma": atoms.find(atoms.TMA_LOAD_3D, hunter),
        "full": atoms.find(atoms.TX_BARRIER, hunter),
        "empty": atoms.find(atoms.ARRIVE_BARRIER, hunter),
        "smem": atoms.find(atoms.SW128_K, hunter),
        "fence": atoms.find(atoms.FENCE_ASYNC_SHARED, hunter),
    }


def split_stages(b: dict[str, atoms.Atom], smem: int, a_regs: bool = False, staged: str = "") -> list[str]:
    """The MMA, the ring of swizzled K-major A and B stages, the lo halves, the barriers and the split
    helpers: the 3xTF32 kernel's (a_regs: B's lo alone, in a ring of LO_STAGES) and the implicit-GEMM
    convolution's (A's and B's lo beside each stage: its gatherers write A and a_lo at once). `staged`: the
    output's C type, whose blocks of staged stores (gemm.staged_store) the Smem holds."""
    swz = b["smem"].name
    lo = (
        [
            f"using SmemBl = decltype(tile_to_shape({swz}<T>{{}}, make_shape(Int<BN>{{}}, Int<BK>{{}}, "
            "Int<LO_STAGES>{})));"
        ]
        if a_regs
        else ["constexpr int LO_STAGES = STAGES;", "using SmemBl = SmemB;"]
    )
    return [
        f"using TiledMma = decltype(make_tiled_mma({b['mma'].name}{{}}, Layout<Shape<_2, _1, _1>>{{}}));",
        f"using SmemA = decltype(tile_to_shape({swz}<T>{{}}, make_shape(Int<BM>{{}}, Int<BK>{{}}, "
        "Int<STAGES>{})));",
        f"using SmemB = decltype(tile_to_shape({swz}<T>{{}}, make_shape(Int<BN>{{}}, Int<BK>{{}}, "
        "Int<STAGES>{})));",
        *lo,
        "struct Smem {",
        "    alignas(1024) float a[cosize_v<SmemA>];",
        *([] if a_regs else ["    alignas(1024) float alo[cosize_v<SmemA>];"]),
        "    alignas(1024) float b[cosize_v<SmemB>];",
        "    alignas(1024) float blo[cosize_v<SmemBl>];",
        *(
            [f"    alignas(16) {staged} c[2 * 64 * (64 + 16 / sizeof({staged}))];  // staged stores"]
            if staged
            else []
        ),
        "    uint64_t full[STAGES];",
        "    uint64_t ready[LO_STAGES];  // a k tile split (the GEMM) or gathered (the convolution)",
        "    uint64_t empty[STAGES];",
        *(["    uint64_t lo_empty[LO_STAGES];"] if a_regs else []),
        "};",
        f'static_assert(sizeof(Smem) + 1024 <= {smem}, "the launcher\'s shared-memory size is too small");',
        LO,
    ]


def render(r: Region, f: Form, rp: Tf32Plan, epi: GemmEpilogue | None, hunter: Any = None) -> Code:
    """The kernel and its launcher for an fp32 library region in the form `f`; raises atoms.AtomNotFound."""
    if rp.f16:  # the same products as three fp16 ones
        from pipeline.generate.expert.templates import gemm_f16x3

        return gemm_f16x3.render(r, f, rp, epi, hunter)
    rid = r.rid
    bn, stages = rp.bn, rp.stages
    b = blocks(rp, hunter, a_regs=True)
    out_dt = epi.out_dtype if epi else "float32"
    if rp.staged and (why := why_unstaged(rp, out_dt)):
        raise ValueError(f"region {rid}: staged stores: {why}")
    smem = smem_bytes(bn, stages, gemm.staging_bytes(out_dt) if rp.staged else 0)
    lines = [
        *gemm.preamble(rid, b),
        "using T = cutlass::tfloat32_t;  // the MMA's operand type; the splitters move the raw fp32 bits",
        f"constexpr int BM = {BM}, BN = {bn}, BK = {BK}, STAGES = {stages}, GROUP = {GROUP}, "
        f"SPLITTERS = {SPLITTERS}, PROMOTE = {PROMOTE}, LO_STAGES = {LO_STAGES}"
        f"{f', SPLITS = {rp.splits}' if rp.splits > 1 else ''}{', TN = BN' if rp.staged else ''};",
        *split_stages(b, smem, a_regs=True, staged=ctype(out_dt) if rp.staged else ""),
        f"}}  // namespace kp_{rid}",
        *gemm.epilogue_function(epi, out_dt),
    ]
    sig = gemm.signature(epi, out_dt)
    splits, persistent = rp.splits, rp.persistent
    if persistent and splits > 1:  # the plan's edits never make this: a split grid is one of few tiles
        raise ValueError(f"region {rid}: a persistent grid keeps K whole")
    body = (
        (_PERSISTENT if persistent else _BODY)
        .replace("TMA_COPY", b["tma"].name)
        .replace("FENCE", b["fence"].name)
    )
    if persistent:
        sig = Signature((*sig.params, i32("TILES", "grid")))
    # Split, the GEMM stores raw fp32 partials and the sum kernel computes the fused epilogue on the total.
    body, kernel_epi, kernel_dt, kernel_sig = split_kernel(
        rid, body, epi, out_dt, sig, splits, gemm.signature
    )
    # Staged (rp.staged): each consumer warpgroup's 64 rows through shared memory, stored in whole 16-byte row
    # pieces, where the accumulators' own layout stores 8 bytes of 8 rows a warp instruction
    stores = gemm.staged_store(kernel_epi, kernel_dt) if rp.staged else gemm.store(kernel_epi, kernel_dt)
    head = gemm.EPILOGUE_HEAD.replace(gemm.PAIRS_LINE, "") if rp.staged else gemm.EPILOGUE_HEAD
    if persistent:  # the stores read the tile's sums: acc stays zero for the next tile (see _PERSISTENT)
        stores = [re.sub(r"\bacc\b", "sum", ln) for ln in stores]
    lines += [
        f'extern "C" __global__ void __launch_bounds__(384, 1) kp_{rid}_gemm({kernel_sig.decls()}) {{',
        f"    using namespace kp_{rid};",
        f"    using Full = {b['full'].name};",
        f"    using Barrier = {b['empty'].name};",
        body + head,
        *stores,
        *(["    }  // the block's next tile"] if persistent else []),
        "}",
    ]
    bx = Boxes((BM, BK), (bn, BK), 4, "f32", "3xTF32 WGMMA kernel", transpose_b=True)
    code = gemm.code(r, f, epi, rp, lines, smem, out_dt, sig, bx)
    if persistent:
        code = with_persistent_grid(code, rid, sig, smem)
    if f.b_major == "MN":
        code = _with_transpose(code, rid)
    return _with_split_sum(code, rid, sig, kernel_sig, smem, splits, epi, out_dt) if splits > 1 else code


def _with_transpose(code: Code, rid: str) -> Code:
    """A row-major B made K-major by a tiled transpose (32 x 32 tiles through shared memory: reads and writes
    both coalesced) instead of the generic gather, which reads B column-wise: for level 1's (524288, 256) B
    that gather took most of the product's time."""
    gather = "_contig(w.transpose(-1, -2))"
    anchor = "    k = x.shape[-1]\n"
    assert code.launcher.count(gather) == 1 and code.launcher.count(anchor) == 1, "the launcher changed"
    helper = "\n".join([
        "    def transposed(t):  # (..., K, N) as a contiguous (..., N, K): our tiled transpose, else the gather",
        "        if t.numel() == 0 or not t.is_contiguous() or t.dtype != torch.float32:",
        "            return _contig(t.transpose(-1, -2))",
        "        rows, cols = t.shape[-2], t.shape[-1]",
        "        batch = t.numel() // (rows * cols)",
        "        if -(-rows // 32) > MAX_GRID_Y or batch > MAX_GRID_Y:",
        "            return _contig(t.transpose(-1, -2))",
        "        out = torch.empty((*t.shape[:-2], cols, rows), dtype=t.dtype, device=t.device)",
        "        grid = (-(-cols // 32), -(-rows // 32), batch)",
        f"        kernels.kp_{rid}_transpose(grid, (32, 8), (t, out, numpy.int64(rows), numpy.int64(cols)))"
        "  # noqa: F821",
        "        return out",
        "",
    ])  # fmt: skip
    launcher = code.launcher.replace(gather, "transposed(w)").replace(anchor, helper + anchor)
    cuda = code.cuda + TRANSPOSE.replace("RID", rid)
    return dataclasses.replace(
        code, cuda=cuda, launcher=launcher, kernels=(*code.kernels, f"kp_{rid}_transpose")
    )


# B (..., rows, cols) into (..., cols, rows), one 32 x 32 tile a block; the +1 column keeps the tile's
# column reads on 32 banks.
TRANSPOSE = r"""extern "C" __global__ void __launch_bounds__(256)
kp_RID_transpose(const float* __restrict__ src, float* __restrict__ dst, long long rows, long long cols) {
    __shared__ float tile[32][33];
    const long long base = (long long)blockIdx.z * rows * cols;
    const long long c0 = (long long)blockIdx.x * 32, r0 = (long long)blockIdx.y * 32;
    for (int j = threadIdx.y; j < 32; j += 8) {
        const long long r = r0 + j, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[j][threadIdx.x] = src[base + r * cols + c];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += 8) {
        const long long c = c0 + j, r = r0 + threadIdx.x;
        if (c < cols && r < rows) dst[base + c * rows + r] = tile[threadIdx.x][j];
    }
}
"""


def split_kernel(rid: str, body: str, epi: GemmEpilogue | None, out_dt: str, sig: Signature, splits: int,
                 signature: Callable[[GemmEpilogue | None, str], Signature], loads: int = 2,
                 ) -> tuple[str, GemmEpilogue | None, str, Signature]:  # fmt: skip
    """The GEMM kernel's body, epilogue, output dtype and signature: as given, or with K split `splits` ways
    (each block's raw fp32 partial into its workspace slice, no epilogue: the sum kernel computes it).
    `signature(epi, dtype)`: the kernel's parameters; `loads`: its TMA loads a k tile (_split_k)."""
    if splits <= 1:
        return body, epi, out_dt, sig
    if epi is not None and epi.up:  # the plan's edits never make this: gated pairs live in the tile
        raise ValueError(f"region {rid}: split-K keeps no gated epilogue")
    return _split_k(body, loads), None, "float32", signature(None, "float32")


def _split_k(body: str, loads: int = 2) -> str:
    """The kernel body with K split over blockIdx.y: each block sums its share of the k tiles into its own
    slice of the fp32 workspace (out, SPLITS slices of batch x M x N); the sum kernel adds the slices.
    `loads`: the body's TMA loads a k tile (the fp16x3 kernel's four)."""
    whole = "    const int ktiles = (K + BK - 1) / BK;\n"
    share = (
        "    const int kall = (K + BK - 1) / BK, kchunk = (kall + SPLITS - 1) / SPLITS;\n"
        "    const int kbeg = blockIdx.y * kchunk;  // this block's first k tile\n"
        "    const int ktiles = max(0, min(kall, kbeg + kchunk) - kbeg);\n"
    )
    assert body.count(whole) == 1 and body.count("kt * BK, ") == loads, "the body's K loop changed"
    body = body.replace(whole, share).replace("kt * BK, ", "(kbeg + kt) * BK, ")
    # After the prologue's tile indices: this split's slice of the workspace.
    anchor = "    const int n_blk = (tile % per_group) / rows;\n"
    assert body.count(anchor) == 1
    return body.replace(
        anchor, anchor + "    out += (long long)blockIdx.y * (gridDim.x / (mt * nt)) * M * N;\n"
    )


def _with_split_sum(code: Code, rid: str, sig: Signature, kernel_sig: Signature, smem: int, splits: int,
                    epi: GemmEpilogue | None, out_dt: str) -> Code:  # fmt: skip
    """The launcher runs the GEMM into a workspace of `splits` slices, then the sum kernel into the output
    (computing the fused epilogue on each total, where there is one)."""
    call = f"        kernels.kp_{rid}_gemm((grid,), (384,), ({sig.args()}), shared_mem={smem})  # noqa: F821"
    assert code.launcher.count(call) == 1, "the GEMM launch line changed"
    into_ws = Signature(
        tuple(dataclasses.replace(p, value="ws") if p.name == "out" else p for p in kernel_sig.params)
    )
    if epi is None:
        sum_src, sum_args = (
            SPLIT_SUM.replace("RID", rid),
            f"ws, out, numpy.int64(total), numpy.int32({splits})",
        )
    else:
        sum_sig = _sum_signature(epi, out_dt, splits)
        sum_src, sum_args = _split_sum_epilogue(rid, epi, out_dt, sum_sig), sum_sig.args()
    split_call = "\n".join([
        f"        ws = torch.empty(({splits}, batch * m, n), dtype=torch.float32, device=x.device)",
        f"        kernels.kp_{rid}_gemm((grid, {splits}), (384,), ({into_ws.args()}), shared_mem={smem})  # noqa: F821",
        "        total = batch * m * n",
        "        blocks = max(1, min(-(-total // 1024), 65535 * 32))",
        f"        kernels.kp_{rid}_splitk((blocks,), (256,), ({sum_args}))  # noqa: F821",
    ])  # fmt: skip
    cuda = code.cuda + sum_src
    launcher = code.launcher.replace(call, split_call).replace(
        'stages)."""', f'stages, K split {splits} ways)."""', 1
    )
    return dataclasses.replace(
        code, cuda=cuda, launcher=launcher, kernels=(*code.kernels, f"kp_{rid}_splitk")
    )


# The split-K partial sums added in split order (deterministic), 16 bytes at a time when rows allow.
SPLIT_SUM = r"""extern "C" __global__ void __launch_bounds__(256)
kp_RID_splitk(const float* __restrict__ ws, float* __restrict__ out, long long n, int splits) {
    const long long step = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((n & 3) == 0) {
        const long long n4 = n / 4;
        for (long long i = first; i < n4; i += step) {
            float4 acc = reinterpret_cast<const float4*>(ws)[i];
            for (int z = 1; z < splits; ++z) {
                const float4 v = reinterpret_cast<const float4*>(ws + z * n)[i];
                acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
            }
            reinterpret_cast<float4*>(out)[i] = acc;
        }
    } else {
        for (long long i = first; i < n; i += step) {
            float acc = ws[i];
            for (int z = 1; z < splits; ++z) acc += ws[z * n + i];
            out[i] = acc;
        }
    }
}
"""


def _sum_signature(epi: GemmEpilogue, out_dt: str, splits: int) -> Signature:
    return Signature((
        ptr("ws", "float"), ptr("out", ctype(out_dt), const=False),
        *(ptr(f"e{k}", ctype(d)) for k, (_, d, _) in enumerate(epi.operands)),
        i64("total"), i32("M", "m"), i32("N", "n"), i32("splits", str(splits)),
    ))  # fmt: skip


def _split_sum_epilogue(rid: str, epi: GemmEpilogue, out_dt: str, sig: Signature) -> str:
    """The sum kernel of a split GEMM with a fused epilogue: the partials added in split order, then the
    chain on the total, indexed as the GEMM's own store indexes it (r: the output's row, m: the matrix's)."""
    call = gemm.epilogue_call(epi, "a", "", "n", "v")
    return (
        f'extern "C" __global__ void __launch_bounds__(256)\nkp_{rid}_splitk({sig.decls()}) {{\n'
        "    const long long step = (long long)gridDim.x * blockDim.x;\n"
        "    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {\n"
        "        float a = ws[i];\n"
        "        for (int z = 1; z < splits; ++z) a += ws[z * total + i];\n"
        "        const long long r = i / N, n = i % N, m = r % M;\n"
        "        (void)r;\n"
        "        (void)m;\n"
        "        float v;\n"
        f"        {call};\n"
        f"        out[i] = kp::cv<{ctype(out_dt)}>(v);\n"
        "    }\n"
        "}\n"
    )


LO = r"""// x minus the part tf32 reads of it (the low 13 mantissa bits): exact in fp32.
__device__ __forceinline__ float lo(float x) { return x - __uint_as_float(__float_as_uint(x) & 0xffffe000u); }
__device__ __forceinline__ float4 lo4(float4 v) { return make_float4(lo(v.x), lo(v.y), lo(v.z), lo(v.w)); }
// 4 bytes of shared memory as such (CuTe's element copy of tfloat32_t went through generic loads).
__device__ __forceinline__ uint32_t lds1(const void* p) {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"((unsigned)__cvta_generic_to_shared(p)) : "memory");
    return v;
}
// lo of one stage's tile, written at the same offsets (the same swizzled layout).
// Unrolled: several loads in flight a thread (the split is on the MMAs' critical path when it is slow).
__device__ __forceinline__ void split_same(const float* x, float* l, int n, int t) {
    #pragma unroll 2
    for (int i = t; i < n / 4; i += SPLITTERS)
        reinterpret_cast<float4*>(l)[i] = lo4(reinterpret_cast<const float4*>(x)[i]);
}"""

# The convolution's promotion: every PROMOTE k tiles the tensor cores' sum is added to fp32 registers on the
# CUDA cores (the module doc says why); between, the previous k tile's MMAs are waited for and its stages
# released while this tile's run. (The GEMM's, in its consumers' step below, loads the next A first.)
_PROMOTE = r"""        if (kt % PROMOTE == PROMOTE - 1 || kt == ktiles - 1) {  // the chunk's end: promote it
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc);
            CUTE_UNROLL
            for (int i = 0; i < size(acc); ++i) {
                sum(i) += acc(i);
                acc(i) = 0.f;
            }
            if (threadIdx.x % 128 == 0) {
                if (held >= 0) release(held);
                release(kt);
            }
            held = -1;
        } else {
            warpgroup_wait<1>();  // keep this tile's MMAs in flight; the previous tile's are done
            warpgroup_fence_operand(acc);
            if (held >= 0 && threadIdx.x % 128 == 0) release(held);
            held = kt;
        }
"""

# After the k loop, before the accumulators are written: the last k tile always promoted (a wait for all its
# MMAs), but ptxas cannot tell, and on the loop's exit path it sees the accumulators written while MMAs may
# run. Without this wait it inserts its own: at the loop's latch, every second k tile, in the GEMM (C7517)
# and before every MMA in the convolution (C7518, the MMAs serialized: 12 waits for 12 HGMMAs, 3 with it).
_DRAINED = "    warpgroup_wait<0>();  // a no-op at run time: ptxas's proof that no MMA is left running\n"

# The convolution's consumers: both operands and their lo from shared memory (a_lo.b + a.b_lo + a.b).
_CONSUMERS_SS = r"""    TiledMma mma;
    auto thr = mma.get_slice(threadIdx.x - 128);
    Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<T*>(s.a)), SmemA{});
    Tensor sAl = make_tensor(make_smem_ptr(reinterpret_cast<T*>(s.alo)), SmemA{});
    Tensor sB = make_tensor(make_smem_ptr(reinterpret_cast<T*>(s.b)), SmemB{});
    Tensor sBl = make_tensor(make_smem_ptr(reinterpret_cast<T*>(s.blo)), SmemB{});
    Tensor tA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor tAl = thr.make_fragment_A(thr.partition_A(sAl));
    Tensor tB = thr.make_fragment_B(thr.partition_B(sB));
    Tensor tBl = thr.make_fragment_B(thr.partition_B(sBl));
    Tensor acc = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
    Tensor sum = make_fragment_like(acc);  // the chunks' sums, added on the CUDA cores (rounded to nearest)
    clear(acc);
    clear(sum);
    int held = -1;  // a k tile whose stage this warpgroup has not released (its MMAs may still run)
    auto release = [&](int k) { Barrier::arrive(&s.empty[k % STAGES]); };
    for (int kt = 0; kt < ktiles; ++kt) {
        const int st = kt % STAGES;
WAIT_FULL        Barrier::wait(&s.ready[st], (kt / STAGES) & 1);
        warpgroup_fence_operand(acc);
        warpgroup_arrive();
        // The small products first, then the large one: a_lo.b + a.b_lo + a.b
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tA); ++kb) cute::gemm(mma, tAl(_, _, kb, st), tB(_, _, kb, st), acc);
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tA); ++kb) cute::gemm(mma, tA(_, _, kb, st), tBl(_, _, kb, st), acc);
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tA); ++kb) cute::gemm(mma, tA(_, _, kb, st), tB(_, _, kb, st), acc);
        warpgroup_commit_batch();
PROMOTE    }
DRAINED    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) acc(i) = sum(i);
""".replace("DRAINED", _DRAINED).replace("PROMOTE", _PROMOTE)

# The GEMM's consumers: their rows of A copied from the raw stage into registers and split there, B and its
# lo from shared memory. Two register sets alternate by k tile: a set is written again only once the MMAs
# that read it are done (the wait before it, and the fences that keep its registers live until then). The
# next k tile's A is loaded while this one's MMAs run, before a promotion's drain: loaded after it, its
# barrier waits, loads and split stood between the two warpgroups' MMAs (both promote on the same k tile)
# and the tensor cores idled through them.
_CONSUMERS_RS = r"""    TiledMma mma;
    auto thr = mma.get_slice(threadIdx.x - 128);
    Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<T*>(s.a)), SmemA{});
    Tensor sB = make_tensor(make_smem_ptr(reinterpret_cast<T*>(s.b)), SmemB{});
    Tensor sBl = make_tensor(make_smem_ptr(reinterpret_cast<T*>(s.blo)), SmemBl{});
    Tensor tsA = thr.partition_A(sA);  // this thread's elements of A in each raw stage
    Tensor tB = thr.make_fragment_B(thr.partition_B(sB));
    Tensor tBl = thr.make_fragment_B(thr.partition_B(sBl));
    Tensor ah0 = thr.make_fragment_A(tsA(_, _, _, 0));  // a_hi and a_lo, two sets
    Tensor al0 = make_fragment_like(ah0);
    Tensor ah1 = make_fragment_like(ah0);
    Tensor al1 = make_fragment_like(ah0);
    Tensor acc = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
    Tensor sum = make_fragment_like(acc);  // the chunks' sums, added on the CUDA cores (rounded to nearest)
    clear(acc);
    clear(sum);
    int held = -1;  // a k tile whose stages this warpgroup has not released (its MMAs may still run)
    auto release = [&](int k) {
        Barrier::arrive(&s.empty[k % STAGES]);
        Barrier::arrive(&s.lo_empty[k % LO_STAGES]);
    };
    auto load = [&](const int kt, auto& ah, auto& al) {  // k tile kt's rows of A, split, once B's is split
        const int st = kt % STAGES, sl = kt % LO_STAGES;
        Barrier::wait(&s.ready[sl], (kt / LO_STAGES) & 1);  // B split
        Full::wait(&s.full[st], (kt / STAGES) & 1);  // done already: makes A's TMA writes ours to read
        Tensor as = tsA(_, _, _, st);
        CUTE_UNROLL
        for (int i = 0; i < size(ah); ++i) {  // hi: the bits tf32 reads; lo: the rest, exact in fp32
            const uint32_t x = lds1(&as(i)), h = x & 0xffffe000u;
            al(i) = T::bitcast(__float_as_uint(__uint_as_float(x) - __uint_as_float(h)));
            ah(i) = T::bitcast(h);
        }
    };
    // k tile kt's MMAs on (ah, al), loaded already; (ph, pl): the previous tile's set, the next one's
    auto step = [&](const int kt, auto& ah, auto& al, auto& ph, auto& pl) {
        const int st = kt % STAGES, sl = kt % LO_STAGES;
        warpgroup_fence_operand(ah);
        warpgroup_fence_operand(al);
        warpgroup_fence_operand(acc);
        warpgroup_arrive();
        // The small products first, then the large one: a_lo.b + a.b_lo + a.b
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(ah); ++kb) cute::gemm(mma, al(_, _, kb), tB(_, _, kb, st), acc);
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(ah); ++kb) cute::gemm(mma, ah(_, _, kb), tBl(_, _, kb, sl), acc);
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(ah); ++kb) cute::gemm(mma, ah(_, _, kb), tB(_, _, kb, st), acc);
        warpgroup_commit_batch();
        warpgroup_wait<1>();  // keep this tile's MMAs in flight; the previous tile's are done
        warpgroup_fence_operand(acc);
        warpgroup_fence_operand(ph);
        warpgroup_fence_operand(pl);
        if (held >= 0 && threadIdx.x % 128 == 0) release(held);
        held = kt;
        if (kt + 1 < ktiles) load(kt + 1, ph, pl);
        if (kt % PROMOTE == PROMOTE - 1 || kt == ktiles - 1) {  // the chunk's end: promote it
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc);
            warpgroup_fence_operand(ah);
            warpgroup_fence_operand(al);
            warpgroup_fence_operand(ph);
            warpgroup_fence_operand(pl);
            CUTE_UNROLL
            for (int i = 0; i < size(acc); ++i) {
                sum(i) += acc(i);
                acc(i) = 0.f;
            }
            if (threadIdx.x % 128 == 0) release(kt);
            held = -1;
        }
    };
    if (ktiles > 0) load(0, ah0, al0);
    for (int kt = 0; kt < ktiles; kt += 2) {
        step(kt, ah0, al0, ah1, al1);
        if (kt + 1 < ktiles) step(kt + 1, ah1, al1, ah0, al0);
    }
DRAINED    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) acc(i) = sum(i);
""".replace("DRAINED", _DRAINED)


_READY = "        Barrier::wait(&s.ready[st], (kt / STAGES) & 1);\n"


def consumers(wait_full: bool, ready: bool = True) -> str:
    """The convolution's consumer warpgroups' loop. wait_full: they wait for the stage's TMA themselves (its
    gatherers write A while B lands); ready: and for its gatherers (the fp16x3 GEMM's stages hold TMA's
    tiles alone)."""
    wait = "        Full::wait(&s.full[st], (kt / STAGES) & 1);  // B's TMA\n" if wait_full else ""
    body = _CONSUMERS_SS.replace("WAIT_FULL", wait)
    assert body.count(_READY) == 1, "the consumers' ready wait changed"
    return body if ready else body.replace(_READY, "")


# The barriers' set-up and the producer warpgroup's start, shared by both bodies.
_INIT = r"""    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; ++i) {
            Full::init(&s.full[i], 1);
            Barrier::init(&s.empty[i], 2);  // one arrive per consumer warpgroup
        }
        for (int i = 0; i < LO_STAGES; ++i) {
            Barrier::init(&s.ready[i], SPLITTERS);  // every splitter arrives once its writes are fenced
            Barrier::init(&s.lo_empty[i], 2);
        }
        cutlass::arch::fence_barrier_init();
    }
    __syncthreads();
    if (wg == 0) {
        cutlass::arch::warpgroup_reg_dealloc<40>();  // 128 x 40 + 256 x 232 registers: the SM's 65536
"""

# The producer warpgroup's splitting warps and the consumers' registers: the end of the producer branch.
_SPLIT = r"""        } else if (threadIdx.x >= 32) {  // the split, one stage at a time as it lands
            const int t = threadIdx.x - 32;
            for (int kt = 0; kt < ktiles; ++kt) {
                const int st = kt % STAGES, sl = kt % LO_STAGES;
                Full::wait(&s.full[st], (kt / STAGES) & 1);
                if (kt >= LO_STAGES) Barrier::wait(&s.lo_empty[sl], ((kt / LO_STAGES) - 1) & 1);
                split_same(s.b + st * BN * BK, s.blo + sl * BN * BK, BN * BK, t);
                FENCE();  // our writes, visible to the WGMMAs' async proxy
                Barrier::arrive(&s.ready[sl]);
            }
        }
        return;
    }
    cutlass::arch::warpgroup_reg_alloc<232>();  // two sets of A's hi and lo beside the sums
"""


def _splitters(count: str, k: str) -> str:
    """_SPLIT over `count` k tiles counted by `k` (B's lo written one stage at a time as it lands)."""
    head = "for (int kt = 0; kt < ktiles; ++kt)"
    loop = f"for (int {k} = 0; {k} < {count}; ++{k})"
    return _SPLIT.replace(head, "@LOOP@").replace("kt", k).replace("@LOOP@", loop)


TILES = (("tma_a", "s.a", "BM", "m_blk"), ("tma_b", "s.b", "BN", "n_blk"))  # (map, smem, rows, block)


def load_stage(g: str, indent: int, tiles: tuple = TILES, tx: str = "(BM + BN) * BK * sizeof(float)") -> str:
    """The producer thread's loads of k tile kt (`tiles`, by TMA: `tx` bytes) into ring position `g`, once
    the consumers have freed it: the one-tile and the persistent bodies' own (the fp16x3 kernel's four)."""
    lines = [
        f"const int st = {g} % STAGES;",
        f"if ({g} >= STAGES) Barrier::wait(&s.empty[st], (({g} / STAGES) - 1) & 1);",
        f"Full::arrive_and_expect_tx(&s.full[st], {tx});",
        *(f"TMA_COPY::copy(&{m}, &s.full[st], 0, {dst} + st * {rows} * BK, kt * BK, {blk} * {rows}, batch);"
          for m, dst, rows, blk in tiles),
    ]  # fmt: skip
    return "".join(" " * indent + ln + "\n" for ln in lines)


def walk_tiles(load: str) -> str:
    """The producer thread's loop over its block's tiles on a persistent grid, `load` its loads of k tile kt
    into ring position g (the k tiles it has passed over all of them)."""
    return (
        "            int g = 0;\n"
        "            for (int j = 0; j < mine; ++j) {\n"
        "                int batch, m_blk, n_blk;\n"
        "                coords((int)blockIdx.x + j * (int)gridDim.x, batch, m_blk, n_blk);\n"
        "                for (int kt = 0; kt < ktiles; ++kt, ++g) {\n" + load + "                }\n"
        "            }\n"
    )


_BODY = (
    gemm.PROLOGUE
    + _INIT
    + r"""        if (threadIdx.x == 0) {  // TMA: STAGES tiles ahead of the consumers
            for (int kt = 0; kt < ktiles; ++kt) {
"""
    + load_stage("kt", 16)
    + r"""            }
"""
    + _splitters("ktiles", "kt")
    + _CONSUMERS_RS
)


def with_persistent_grid(code: Code, rid: str, sig: Signature, smem: int) -> Code:
    """The launch of a persistent plan: one block an SM (at most one a tile), each walking its tiles."""
    call = f"        kernels.kp_{rid}_gemm((grid,), (384,), ({sig.args()}), shared_mem={smem})  # noqa: F821"
    assert code.launcher.count(call) == 1, "the GEMM launch line changed"
    launch = call.replace("((grid,), (384,)", "((max(1, min(grid, sms)),), (384,)")
    launcher = code.launcher.replace(call, launch).replace('stages)."""', 'stages, persistent)."""', 1)
    return dataclasses.replace(code, launcher=launcher)


# A persistent grid: block b takes tiles b, b + gridDim.x, ... (TILES of them in all, in the one-tile
# kernel's grouped order), the rings running on across its tiles (g: the k tiles a thread has passed, over
# all of them), so the producer loads the next tile's first k tiles while the consumers store this one, and
# a block's launch, barrier set-up and first fill are paid once an SM instead of once a tile: on a grid of
# several waves over a short K (Swin's stage-1 layers: K = 96, three k tiles) those were most of a tile's
# time. The stores read the promoted sums (`sum`), not `acc`: the last k tile's promotion leaves acc zero
# for the next tile, so no instruction between two tiles' MMAs writes the accumulators (zeroing them there
# made ptxas serialize the grouped GEMM's MMAs, C7515: templates/grouped_gemm.py).
PERSISTENT_PROLOGUE = (
    gemm.SMEM
    + r"""    const int ktiles = (K + BK - 1) / BK;
    const int mt = (M + BM - 1) / BM, nt = (N + BN - 1) / BN;
    const int per_group = GROUP * nt;
    auto coords = [&](const int tile_id, int& batch, int& m_blk, int& n_blk) {  // the one-tile kernel's order
        batch = tile_id / (mt * nt);
        const int tile = tile_id % (mt * nt);
        const int first = (tile / per_group) * GROUP;
        const int rows = min(mt - first, GROUP);
        m_blk = first + (tile % per_group) % rows;
        n_blk = (tile % per_group) / rows;
    };
    const int mine = (TILES - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;  // this block's tiles
"""
)
_PERSISTENT = (
    PERSISTENT_PROLOGUE
    + _INIT
    + "        if (threadIdx.x == 0) {  // TMA: STAGES k tiles ahead of the consumers, across the block's tiles\n"
    + walk_tiles(load_stage("g", 20))
    + _splitters("mine * ktiles", "g")
)


def _persistent_consumers() -> str:
    """_CONSUMERS_RS in a loop over the block's tiles: ring positions and phases from g = base + kt."""
    setup, rest = _CONSUMERS_RS.split(TILE_START, 1)
    subs = {
        "Barrier::arrive(&s.empty[k % STAGES]);": "Barrier::arrive(&s.empty[(base + k) % STAGES]);",
        "Barrier::arrive(&s.lo_empty[k % LO_STAGES]);": "Barrier::arrive(&s.lo_empty[(base + k) % LO_STAGES]);",
        "const int st = kt % STAGES, sl = kt % LO_STAGES;":  # in the load and the step
        "const int g = base + kt, st = g % STAGES, sl = g % LO_STAGES;",
        "(kt / LO_STAGES) & 1": "(g / LO_STAGES) & 1",
        "(kt / STAGES) & 1": "(g / STAGES) & 1",
        "    for (int i = 0; i < size(acc); ++i) acc(i) = sum(i);\n": "",
    }  # fmt: skip
    for old, new in subs.items():
        assert rest.count(old) == (2 if old.startswith("const int st") else 1), old
        rest = rest.replace(old, new)
    assert rest.endswith("CUTE_UNROLL\n"), "the consumers' tail changed"
    rest = rest[: -len("    CUTE_UNROLL\n")]
    return over_tiles(setup, rest)


TILE_START = "    clear(acc);\n    clear(sum);\n    int held = -1;"  # where a consumer loop's tile begins


def over_tiles(setup: str, rest: str) -> str:
    """A consumer loop split at TILE_START, its tile part run over the block's tiles (base: the k tiles
    before this one); acc cleared once, since each tile's last promotion leaves it zero."""
    return (
        setup
        + "    clear(acc);  // once: each tile's last promotion leaves it zero\n"
        + "    for (int j = 0, base = 0; j < mine; ++j, base += ktiles) {\n"
        + "    int batch, m_blk, n_blk;\n"
        + "    coords((int)blockIdx.x + j * (int)gridDim.x, batch, m_blk, n_blk);\n"
        + "    clear(sum);\n"
        + "    int held = -1;"
        + rest
    )


_PERSISTENT += _persistent_consumers()
