"""Our persistent grouped GEMM for MoE experts on Hopper: out[rows of e] = epilogue(x[rows of e] @ w[e]) for every
expert e in one launch, the groups read on the device (no host sync, no launch per expert).

x is (M, K) with the tokens sorted by expert; the groups are read from the device as the routing gives them
(tokens per expert, or the end of each expert's rows, int32 or int64);
w is (E, K, N) ("MN-major", rows of N) or the transpose of an (E, N, K) stack ("K-major"). bf16 operands,
fp32 accumulators, 128 x BN tiles. The same pipeline as templates/gemm.py (one producer warpgroup issuing
TMA loads into a ring of stages, two consumer warpgroups on WGMMA), made persistent:
- one block per SM; each first turns the groups into two tables in shared memory, the end of every group's
  rows and its first tile (ceil(rows / 128) row tiles per expert, times the column tiles), then walks tiles
  blockIdx.x, blockIdx.x + gridDim.x, ... over all groups: an idle expert has no tile, a crowded one many,
  so skewed routing balances by itself;
- a tile's group is found by binary search in the table; its rows start at the group's first row, so a
  tile may read past the group (the next expert's rows, or zeros past M) and stores only its own rows;
- the ring's stage and phase run on across tiles, and the consumers release each stage as its MMAs
  retire, so the producer loads the next tile while the consumers store this one.
With a cluster of two (the plan's `cluster`), the blocks of a cluster take the two row tiles of one
(group, column tile) pair, and each loads half of the weight tile and multicasts it to both: the weight's
traffic from L2, two thirds of a 128 x 256 tile's loads, halves (at K = 768 the loads of 128 x 256 tiles ask
L2 for about 5 TB/s at the measured speed). A stage is then released by the consumers of both blocks (an
arrive on the peer's barrier too), the block without a row tile in a pair's tail loads and releases its
half all the same, and a producer waits for its last stages' releases before its block exits, so no
remote arrive lands after it.
Stores are staged in shared memory by default (`staged`, gemm.staged_store: whole 16-byte row pieces); with
`pingpong` each consumer warpgroup takes every other tile (128 x 128) and stores it while the other's MMAs
run (_PP below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.generate.expert import atoms
from pipeline.generate.expert.families.base import RenderError
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates import gemm
from pipeline.generate.expert.templates.code import Code, ctype, torch_dtype
from pipeline.generate.expert.templates.gemm import BK, BM, CUTE_TYPES, GemmEpilogue
from pipeline.generate.expert.templates.signature import Param, Signature, i32, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.gemm_kit import GemmPlan

TILE_N = (128, 256)
DTYPES = ("bfloat16",)  # what torch._grouped_mm, the library it stands in for, takes


@dataclass(frozen=True)
class Groups:
    """What the kernel reads to find the groups: the routing itself, so the offsets torch._grouped_mm wants
    (a cumsum, an int32 copy) are never computed apart: each block's scan builds them in shared memory."""

    value: str  # the graph value read
    dtype: str  # int32 or int64
    counts: bool = False  # rows per expert (else the end of each expert's rows)
    skip: int = 0  # 1: ends after a leading zero (E + 1 entries)


@dataclass(frozen=True)
class GroupedForm:
    b_major: str  # "MN": w is (E, K, N); "K": w is the transpose of an (E, N, K) stack
    experts: int
    groups: Groups | None = None  # None: the int32 ends given to torch._grouped_mm, read as they are
    batched: bool = False  # gemm.Form's field, read by its helpers: a grouped GEMM is one problem


def _tables(experts: int) -> int:
    return 4 * (2 * experts + 1)  # first_tile and row_end


def max_stages(bn: int, experts: int) -> int:
    """The deepest ring beside the group tables and a bf16 output's staging blocks (staged stores): the same
    ring depth whether the stores are staged or not, so the two differ in their stores alone."""
    stage = (BM + bn) * BK * 2
    return max(2, (gemm.SMEM_LIMIT - 2048 - _tables(experts) - gemm.staging_bytes("bfloat16")) // stage)


def misfit(rp: Any) -> bool:
    """A ping-pong plan the template does not take: its consumers need 128 x 128 tiles (a warpgroup holds a
    whole tile's accumulators), one block a tile and staged stores."""
    return bool(getattr(rp, "pingpong", False)) and (
        getattr(rp, "cluster", 1) > 1 or rp.bn != 128 or not getattr(rp, "staged", False)
    )


def smem_bytes(bn: int, stages: int, experts: int, staging: int = 0) -> int:
    return gemm.smem_bytes(bn, stages) + _tables(experts) + staging


def _rows_of(g: Groups) -> str:
    """C++ for expert e's row count, read from the groups array `offs`."""
    if g.counts:
        return "(int)offs[e]"
    if (
        g.skip
    ):  # ends after a leading entry: the rows of torch._grouped_mm(offs=ends[1:]), row_end[e] = offs[e + 1]
        return "(int)(offs[e + 1] - (e ? offs[e] : 0))"
    return "(int)(offs[e] - (e ? offs[e - 1] : 0))"


def render(r: Region, f: GroupedForm, rp: GemmPlan, epi: GemmEpilogue | None, hunter: Any = None) -> Code:
    """The kernel and its launcher for a gemm_grouped region; raises atoms.AtomNotFound."""
    rid = r.rid
    dt = r.node.dtype
    b = gemm.blocks(rp, dt, f, hunter)  # type: ignore[arg-type]
    cluster = getattr(rp, "cluster", 1)
    if cluster > 1:
        b["tma_mc"] = atoms.find(atoms.TMA_LOAD_MULTICAST_3D, hunter)
    out_dt = epi.out_dtype if epi else dt
    staged = getattr(rp, "staged", False)
    pingpong = getattr(rp, "pingpong", False)
    gated = epi is not None and bool(epi.up)
    if misfit(rp):
        raise RenderError(
            f"region {rid}: ping-pong consumers take 128 x 128 tiles, one block a tile, stores staged"
        )
    smem = smem_bytes(rp.bn, rp.stages, f.experts, gemm.staging_bytes(out_dt) if staged else 0)
    if smem > gemm.SMEM_LIMIT:
        raise RenderError(
            f"region {rid}: 128 x {rp.bn} tiles with {rp.stages} stages and {out_dt} stores staged need {smem} "
            f"bytes of shared memory, over the {gemm.SMEM_LIMIT} a block may have"
        )
    groups = f.groups or Groups(r.node.args[2].name, "int32")
    lines = [
        *gemm.preamble(rid, b),
        f"using T = {CUTE_TYPES[dt]};",
        f"constexpr int BM = {BM}, BN = {rp.bn}, BK = {BK}, STAGES = {rp.stages}, GROUPS = {f.experts};",
        f"constexpr int CLUSTER = {cluster};  // blocks sharing each weight tile (multicast)",
        f"constexpr int TN = {rp.bn // 2 if gated else rp.bn};  // output columns a tile writes"
        + ("  (gated: BN / 2 gate and BN / 2 up columns)" if gated else ""),
        f"using TiledMma = decltype(make_tiled_mma({b['mma'].name}<GMMA::Major::K, GMMA::Major::{f.b_major}>{{}},",
        "                                         Layout<Shape<_1, _1, _1>>{}));  // a warpgroup a tile (ping-pong)"
        if pingpong
        else "                                         Layout<Shape<_2, _1, _1>>{}));  // two consumer warpgroups",
        f"using SmemA = decltype(tile_to_shape({b['smem'].name}<T>{{}}, make_shape(Int<BM>{{}}, Int<BK>{{}}, "
        "Int<STAGES>{})));",
        gemm._smem_b(f, b),  # type: ignore[arg-type]
        "struct Smem {",
        "    alignas(1024) T a[cosize_v<SmemA>];",
        "    alignas(1024) T b[cosize_v<SmemB>];",
        "    uint64_t full[STAGES];",
        "    uint64_t empty[STAGES];",
        "    int first_tile[GROUPS + 1];  // group e's tiles are [first_tile[e], first_tile[e + 1])",
        "    int row_end[GROUPS];  // group e's rows are [row_end[e - 1], row_end[e])",
        *(
            [
                f"    alignas(16) {ctype(out_dt)} c[2 * 64 * (64 + 16 / sizeof({ctype(out_dt)}))];  // staged stores"
            ]
            if staged
            else []
        ),
        "};",
        f'static_assert(sizeof(Smem) + 1024 <= {smem}, "the launcher\'s shared-memory size is too small");',
        f"}}  // namespace kp_{rid}",
        *gemm.epilogue_function(epi, out_dt),
    ]
    sig = signature(epi, out_dt, groups)
    lines += [
        f'extern "C" __global__ void __launch_bounds__(384, 1){f" __cluster_dims__({cluster}, 1, 1)" if cluster > 1 else ""} '
        f"kp_{rid}_gemm({sig.decls()}) {{",
        f"    using namespace kp_{rid};",
        f"    using Full = {b['full'].name};",
        f"    using Empty = {b['empty'].name};",
        (_pingpong(_BODY) if pingpong else _BODY)
        .replace("LOAD_B", _load_b(f.b_major, gated, cluster))
        .replace("PAIRS", "" if staged else _PAIRS)
        .replace("TMA_MULTICAST", b["tma_mc"].name if cluster > 1 else "")
        .replace("TMA_COPY", b["tma"].name)
        .replace("ROWS_OF_E", _rows_of(groups)),
        *(
            "    " + ln
            for ln in (gemm.staged_store(epi, out_dt, pingpong) if staged else gemm.store(epi, out_dt))
        ),
        "    }",
        "}",
    ]
    a, w = r.node.args[:2]
    ops_ = epi.operands if epi else ()
    inputs = [
        ("x", a.name),
        ("w", w.name),
        ("offs", groups.value),
        *((f"e{k}", v) for k, (v, _, _) in enumerate(ops_)),
    ]
    src = launcher(rid, f, groups, epi, rp, smem, out_dt, [name for name, _ in inputs], sig, gated, cluster)
    outs = (epi.out,) if epi else r.outputs
    return Code(
        "\n".join(lines) + "\n", src, f"_gemm_{rid}", (f"kp_{rid}_gemm",), tuple(v for _, v in inputs), outs
    )


def signature(epi: GemmEpilogue | None, out_dt: str, groups: Groups) -> Signature:
    tmap = "const __grid_constant__ CUtensorMap"
    ops_ = epi.operands if epi else ()
    return Signature((
        Param("tma_a", tmap, "ta"), Param("tma_b", tmap, "tb"), ptr("out", ctype(out_dt), const=False),
        *(ptr(f"e{k}", ctype(d)) for k, (_, d, _) in enumerate(ops_)), ptr("offs", ctype(groups.dtype)),
        i32("M_all", "m"), i32("N", "n"), i32("K", "k"),
    ))  # fmt: skip


# Gated: the gate columns of this tile's outputs into the first half of the B tile, their up columns (N further
# on: N is the output's width, half the weight's) into the second.
_GATED_B = {
    "K": "                    TMA_COPY::copy(&tma_b, &s.full[st], 0, s.b + st * BN * BK, kt * BK, n_blk * TN, group);\n"
    "                    TMA_COPY::copy(&tma_b, &s.full[st], 0, s.b + st * BN * BK + TN * BK, kt * BK,\n"
    "                                   N + n_blk * TN, group);",
    "MN": "                    for (int i = 0; i < BN / 64; ++i)\n"
    "                        TMA_COPY::copy(&tma_b, &s.full[st], 0, s.b + st * BN * BK + i * 64 * BK,\n"
    "                                       (i < TN / 64 ? 0 : N - TN) + n_blk * TN + 64 * i, kt * BK, group);",
}
_LOAD_B = {
    "K": "                    TMA_COPY::copy(&tma_b, &s.full[st], 0, s.b + st * BN * BK, kt * BK, n_blk * BN, "
    "group);",
    "MN": "                    for (int i = 0; i < BN / 64; ++i)\n"
    "                        TMA_COPY::copy(&tma_b, &s.full[st], 0, s.b + st * BN * BK + i * 64 * BK,\n"
    "                                       n_blk * BN + 64 * i, kt * BK, group);",
}


def _load_b(major: str, gated: bool, cluster: int) -> str:
    """The producer's B loads for one stage: all of the tile, or (cluster) this block's half, multicast."""
    if cluster == 1:
        return (_GATED_B if gated else _LOAD_B)[major]
    mask = f"(uint16_t){(1 << cluster) - 1}"
    if major == "K" and gated:  # the first block loads the gate columns, the second the up columns
        return (
            "                    if (rank == 0)\n"
            f"                        TMA_MULTICAST::copy(&tma_b, &s.full[st], {mask}, 0, s.b + st * BN * BK, kt * BK,\n"
            "                                            n_blk * TN, group);\n"
            "                    else\n"
            f"                        TMA_MULTICAST::copy(&tma_b, &s.full[st], {mask}, 0, s.b + st * BN * BK + TN * BK,\n"
            "                                            kt * BK, N + n_blk * TN, group);"
        )
    if major == "K":  # a box of BN / CLUSTER rows of N
        return (
            f"                    TMA_MULTICAST::copy(&tma_b, &s.full[st], {mask}, 0,\n"
            "                                        s.b + st * BN * BK + rank * (BN / CLUSTER) * BK, kt * BK,\n"
            "                                        n_blk * BN + rank * (BN / CLUSTER), group);"
        )
    col = "(i < TN / 64 ? 0 : N - TN) + n_blk * TN + 64 * i" if gated else "n_blk * BN + 64 * i"
    return (  # MN: boxes of 64 columns, this block's share of them
        "                    for (int i = rank * (BN / 64 / CLUSTER); i < (rank + 1) * (BN / 64 / CLUSTER); ++i)\n"
        f"                        TMA_MULTICAST::copy(&tma_b, &s.full[st], {mask}, 0, s.b + st * BN * BK + i * 64 * BK,\n"
        f"                                            {col}, kt * BK, group);"
    )


_PAIRS = "    const bool pairs = (N & 1) == 0;  // two adjacent columns per store when rows stay aligned\n"
# The persistent body up to the stores: the group table, then tiles in turn, the ring running on across them.
_BODY = (
    r"""    extern __shared__ char smem_raw[];
    Smem& s = *reinterpret_cast<Smem*>(smem_raw + ((1024 - (unsigned)(__cvta_generic_to_shared(smem_raw) & 1023)) & 1023));
    const int wg = threadIdx.x / 128;
    const int ktiles = (K + BK - 1) / BK;
    const int nt = (N + TN - 1) / TN;
    if (threadIdx.x < 32) {  // warp 0: the group tables, 32 experts a step (inclusive scans of tiles and rows)
        int carry = 0, row_carry = 0;
        if (threadIdx.x == 0) s.first_tile[0] = 0;
        for (int e0 = 0; e0 < GROUPS; e0 += 32) {
            const int e = e0 + threadIdx.x;
            int tiles = 0, rows = 0;
            if (e < GROUPS) {
                rows = max(ROWS_OF_E, 0);
                tiles = rows > 0 ? ((rows + BM * CLUSTER - 1) / (BM * CLUSTER)) * nt : 0;  // a cluster's pairs
            }
            for (int d = 1; d < 32; d *= 2) {
                const int v = __shfl_up_sync(0xffffffffu, tiles, d), w = __shfl_up_sync(0xffffffffu, rows, d);
                if (threadIdx.x >= d) tiles += v, rows += w;
            }
            if (e < GROUPS) s.first_tile[e + 1] = carry + tiles, s.row_end[e] = row_carry + rows;
            carry += __shfl_sync(0xffffffffu, tiles, 31);
            row_carry += __shfl_sync(0xffffffffu, rows, 31);
        }
    }
    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; ++i) {
            Full::init(&s.full[i], 1);
            Empty::init(&s.empty[i], 2 * CLUSTER);  // one arrive per consumer warpgroup of each block
        }
        cutlass::arch::fence_barrier_init();
    }
    __syncthreads();
    if constexpr (CLUSTER > 1) {  // the peer's barriers are set up before any multicast or remote arrive
        cute::cluster_arrive_relaxed();
        cute::cluster_wait();
    }
    const int rank = CLUSTER > 1 ? (int)cute::block_rank_in_cluster() : 0;
    const int first = blockIdx.x / CLUSTER, step = gridDim.x / CLUSTER;  // a cluster walks the tiles as one
    const int total = s.first_tile[GROUPS];
    // tile -> (group, its first row, its rows, this block's row and column blocks); column-major within a
    // group, so the blocks running together share the expert's B tile (in a cluster, a tile is a pair of
    // row blocks, one a block: the second may be past the group's end)
    auto locate = [&](int tile, int& group, int& row0, int& rows, int& m_blk, int& n_blk) {
        int lo = 0, hi = GROUPS;  // the last group whose first tile is <= tile (empty groups share it)
        while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if (s.first_tile[mid] <= tile) lo = mid; else hi = mid;
        }
        group = lo;
        row0 = group ? s.row_end[group - 1] : 0;
        rows = s.row_end[group] - row0;
        const int mt = (rows + BM - 1) / BM, mp = (mt + CLUSTER - 1) / CLUSTER, local = tile - s.first_tile[group];
        m_blk = (local % mp) * CLUSTER + rank;
        n_blk = local / mp;
    };
    if (wg == 0) {  // producer: one thread issues the TMA loads, STAGES k-tiles ahead of the consumers
        cutlass::arch::warpgroup_reg_dealloc<40>();
        if (threadIdx.x == 0) {
            int it = 0;
            for (int tile = first; tile < total; tile += step) {
                int group, row0, rows, m_blk, n_blk;
                locate(tile, group, row0, rows, m_blk, n_blk);
                const bool has_rows = m_blk * BM < rows;  // false only for a cluster pair's missing second
                for (int kt = 0; kt < ktiles; ++kt, ++it) {
                    const int st = it % STAGES;
                    if (it >= STAGES) Empty::wait(&s.empty[st], ((it / STAGES) - 1) & 1);
                    // this block's A rows, and the whole B tile (in a cluster, half of it comes from the peer)
                    Full::arrive_and_expect_tx(&s.full[st], ((has_rows ? BM : 0) + BN) * BK * sizeof(T));
                    if (has_rows)
                        TMA_COPY::copy(&tma_a, &s.full[st], 0, s.a + st * BM * BK, kt * BK, row0 + m_blk * BM, 0);
LOAD_B
                }
            }
            if constexpr (CLUSTER > 1)  // the peer's consumers release our last stages remotely: let them
                for (int j = max(0, it - STAGES); j < it; ++j) Empty::wait(&s.empty[j % STAGES], (j / STAGES) & 1);
        }
        return;
    }
"""
    + gemm.CONSUMER
    + r"""    Tensor tCcC = thr.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
PAIRS    // a stage is free once the consumers of every block it was loaded into are done with it
    auto release = [&](int st) {
        Empty::arrive(&s.empty[st]);
        if constexpr (CLUSTER > 1) Empty::arrive(&s.empty[st], (uint32_t)(rank ^ 1), 1u);
    };
    int it = 0;
    for (int tile = first; tile < total; tile += step) {
        int group, row0, M, m_blk, n_blk;
        locate(tile, group, row0, M, m_blk, n_blk);
        // A group's last tile may end within its first 64 rows: the warpgroup of the other 64 then issues no
        // MMA (it still keeps the ring's barriers), and its partner has the tensor cores to itself. With
        // many small groups (256 experts, 128 tokens each on average) a third of the rows tiles cover are
        // past their group's end.
        const bool busy = m_blk * BM + 64 * (wg - 1) < M;
        // The tile's first MMA overwrites the sums (scale-d 0) rather than clear(acc): zeroing them with
        // other instructions inside the persistent loop made ptxas serialize every MMA (C7515: 12 waits for
        // 12 HGMMAs, 4 this way). A warpgroup that is not busy keeps stale sums: it stores no row.
        mma.accumulate_ = GMMA::ScaleOut::Zero;
        for (int kt = 0; kt < ktiles; ++kt, ++it) {
            const int st = it % STAGES;
            Full::wait(&s.full[st], (it / STAGES) & 1);
            if (busy) {
                warpgroup_fence_operand(acc);
                warpgroup_arrive();
                CUTE_UNROLL
                for (int kb = 0; kb < size<2>(tCrA); ++kb) {
                    cute::gemm(mma, tCrA(_, _, kb, st), tCrB(_, _, kb, st), acc);
                    mma.accumulate_ = GMMA::ScaleOut::One;
                }
                warpgroup_commit_batch();
                warpgroup_wait<1>();  // keep this k-tile's MMAs in flight; the previous one's are done
                warpgroup_fence_operand(acc);
            }
            if (kt > 0 && threadIdx.x % 128 == 0) release((it - 1) % STAGES);
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc);
        if (threadIdx.x % 128 == 0) release((it - 1) % STAGES);  // the tile's last stage
        const long long m0 = (long long)m_blk * BM, n0 = (long long)n_blk * TN;
        const long long r0 = row0;  // the group's first row of the output (and of row operands)"""
)


# Ping-pong consumers: each warpgroup takes every other tile of its block (a 128 x BN tile a warpgroup), so one
# stores its tile while the other's MMAs run. The producer fills the ring in tile order, a tile's k-tiles in
# a row; a warpgroup skips the other's k-tiles (ring positions) and takes its turn on the tensor cores after
# the other's main loop is issued (named barriers 3 and 4), so it never waits on a stage a lap ahead of
# the producer (an mbarrier's parity cannot tell those laps apart). One warpgroup releases each stage.
_PP = {
    "            Empty::init(&s.empty[i], 2 * CLUSTER);  // one arrive per consumer warpgroup of each block":
    "            Empty::init(&s.empty[i], 1);  // ping-pong: one warpgroup consumes a stage",
    "    auto thr = mma.get_slice(threadIdx.x - 128);": "    auto thr = mma.get_slice(threadIdx.x % 128);",
    "    int it = 0;\n    for (int tile = first; tile < total; tile += step) {":
    "    const int me = wg - 1;  // this warpgroup's tiles: the block's me-th, me + 2-th, ...\n"
    "    int it = me * ktiles;\n"
    "    bool turn = me == 0;  // the first tile's main loop waits for no one\n"
    "    for (int tile = first + me * step; tile < total; tile += 2 * step, it += ktiles) {",
    "        const bool busy = m_blk * BM + 64 * (wg - 1) < M;":
    "        const bool busy = true;  // the whole tile is this warpgroup's\n"
    "        if (!turn) asm volatile(\"bar.sync %0, 256;\" ::\"r\"(3 + me));  // the other's main loop is issued\n"
    "        turn = false;",
    "        warpgroup_wait<0>();\n        warpgroup_fence_operand(acc);\n":
    "        if (tile + step < total) asm volatile(\"bar.arrive %0, 256;\" ::\"r\"(4 - me));  // its turn\n"
    "        warpgroup_wait<0>();\n        warpgroup_fence_operand(acc);\n",
}  # fmt: skip


def _pingpong(body: str) -> str:
    for old, new in _PP.items():
        if body.count(old) != 1:
            raise AssertionError(f"the grouped template changed: {old.strip()!r}")
        body = body.replace(old, new)
    return body


def launcher(rid: str, f: GroupedForm, groups: Groups, epi: GemmEpilogue | None, rp: GemmPlan, smem: int,
             out_dt: str, names: list[str], sig: Signature, gated: bool, cluster: int = 1) -> str:  # fmt: skip
    ops_ = epi.operands if epi else ()
    b = "w.transpose(-1, -2)" if f.b_major == "K" else "w"
    tn = rp.bn // 2 if gated else rp.bn
    # K-major: a box of the tile's rows of N (half of them a block in a cluster: its multicast share)
    box_b = f"{tn if gated else rp.bn // cluster}, {BK}" if f.b_major == "K" else f"{BK}, 64"
    lines = [
        f"def _gemm_{rid}(sms, {', '.join(names)}):",
        f'    """x @ w[e] for each expert\'s rows{" and the fused epilogue" if epi else ""}: our persistent '
        f'grouped WGMMA kernel (TMA, 128 x {rp.bn} tiles, {rp.stages} stages)."""',
        "    m, k = x.shape",
        f"    n = w.shape[-1]{' // 2  # gated: the output is half the product' if gated else ''}",
        f"    if k % 8 or n % 8 or w.shape[0] != {f.experts}:",
        "        raise ValueError(f'kernelpro expert: our grouped WGMMA kernel needs 16-byte rows (K and N "
        f"multiples of 8) and {f.experts} experts, not K={{k}}, N={{n}}, {{w.shape[0]}} experts')",
        "",
        *gemm.tma_ready("bf16"),
        "",
        "    a = tma_ready(x)",
        f"    b = tma_ready({b})",
        f"    if offs.dim() != 1 or offs.shape[0] != {f.experts + groups.skip} or offs.dtype != "
        f"{torch_dtype(groups.dtype)}:",
        f"        raise ValueError(f'kernelpro expert: the grouped kernel reads {f.experts + groups.skip} "
        f"{groups.dtype} {'counts' if groups.counts else 'offsets'}, not {{offs.dtype}} of shape "
        "{tuple(offs.shape)}')",
        "    offs = _contig(offs)",
        f"    out = torch.empty((m, n), dtype={torch_dtype(out_dt)}, device=x.device)",
    ]
    lines += gemm.operand_lines(ops_, "m", "m")
    lines += [
        "    if m and n:",
        f"        ta = kernels.tensor_map(a.reshape(1, m, k), {BM}, {BK})  # noqa: F821",
        f"        tb = kernels.tensor_map(b, {box_b})  # noqa: F821",
        f"        tiles = (-(-m // {BM * cluster}) + {f.experts}) * (-(-n // {tn}))  # at most: each group's "
        "last tile partial",
        *(
            [
                f"        kernels.kp_{rid}_gemm((max(1, min(sms, tiles)),), (384,), ({sig.args()}), shared_mem={smem})"
                "  # noqa: F821"
            ]
            if cluster == 1
            else [
                f"        blocks = {cluster} * max(1, min(sms // {cluster}, tiles))  # whole clusters",
                f"        kernels.kp_{rid}_gemm((blocks,), (384,), ({sig.args()}), shared_mem={smem})  # noqa: F821",
            ]
        ),
        "    return out",
    ]
    return "\n".join(lines)
