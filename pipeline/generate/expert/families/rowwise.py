"""Reductions, softmax / log-softmax and layer / RMS / group / instance norms over the trailing dims of
their input: a block (or, for short rows, a warp) per row (templates/rowwise.py). It hosts elementwise
neighbours: a prologue on its loads, an epilogue on its stores.

A two-pass op's row that no cluster can hold (over 3 MB) is cut into tiles of a persistent cooperative grid
(`grid_row`, `persistent` blocks an SM): one step's tiles' statistics, while the last step's are written.

Edits: fuse_kernels / fuse_epilogue (a neighbour on its loads / stores), vectorize_loads, coarsen_threads
(the row, or a cluster block's segment, held in registers when it fits, else unroll x2), pipeline_loads
(unroll x2), more_parallelism (a reduction split over more blocks, else a warp per short row),
tile_shared_memory (two-pass ops keep the
row in shared memory between the passes: a block's, or a thread-block cluster's for a row too long for
one), remove_divergence (warp shuffles, then a warp per short row),
persistent_grid, resize_grid, increase_occupancy (a cluster's or a grid's row back to a block per row),
reduce_registers (registers off: a cluster's segments then cached in shared memory; else unroll /2, else
the occupancy bound).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

from pipeline.generate.expert import fusion, ops
from pipeline.generate.expert.families import common
from pipeline.generate.expert.families.base import Family, change
from pipeline.generate.expert.graph import Ref
from pipeline.generate.expert.layout import RowLayout, row_layout
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates import rowwise
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.reduce_ops import TWO_PASS

KINDS = (RegionKind.REDUCE, RegionKind.SOFTMAX, RegionKind.NORM)
MAX_SPLITS = 8
FEW_ROWS = 256  # rows of a two-pass op below which a split is planned (about 2 an SM on a 132-SM H200)
SHORT_ROW = 1024  # a warp per row below this many elements
LONG_ROW_PASSES = 4  # a reduction's tuned loop is unrolled this far when a row takes that many block passes
SHARED_SM_PASSES = 2  # ... and this far where its rows outnumber the SMs (long_row_unroll)
CLUSTER_SEGMENT = 192 * 1024  # bytes of a row one block of a cluster caches, at most (of its 227 KB)
CLUSTER_UNROLL = 8  # 16-byte loads in flight a thread of a cluster's block (1024 threads: 128 KB an SM)
GRID_SMS_BLOCKS = 2  # a cooperative grid's blocks an SM for rows no cluster holds (a step's reads stay in L2)
GRID_THREADS, GRID_UNROLL = 256, 8  # its block: a tile of 8192 fp32 in one batch of 8 vectors a thread


@dataclass(frozen=True)
class RowPlan(RegionPlan):
    TAG: ClassVar[str] = "row"
    SHOWN: ClassVar[tuple[str, ...]] = ("vec", "threads")
    ABSORBS: ClassVar[tuple[str, ...]] = ("prologue", "epilogue")

    vec: int = 1  # elements per vector access (16 bytes at most)
    threads: int = 256
    unroll: int = 1  # loop iterations in flight per thread
    persistent: int = 0  # blocks per SM for a persistent grid-stride grid; 0: a block per row
    sm_share: int = 0  # percent of the SMs the persistent grid spans (lower_power); 0: all
    min_blocks: int = 0  # __launch_bounds__ minimum blocks per SM (caps registers for occupancy)
    splits: int = 0  # split a row over blocks to reach this many blocks per SM when rows are few (0: never)
    regs: int = 0  # two-pass ops: the row held in registers, this many vectors per thread
    warp_reduce: bool = False  # shuffles instead of a shared-memory tree
    warp_rows: bool = False  # one warp per row (short rows)
    # with warp_rows: lanes a row (a power of two under 32, several rows a warp); 0: a warp's 32
    lanes: int = 0
    smem_row: bool = False  # two-pass ops: the row cached in shared memory between the passes
    cluster: int = 0  # two-pass ops: a row over this many blocks of a thread-block cluster (0: none)
    grid_row: bool = False  # two-pass ops: a row no cluster holds over the tiles of a cooperative grid
    grid_lag: int = 1  # with grid_row: steps between a tile's first read and its second (its write)
    l2_hints: bool = False  # with grid_row: the first read kept in L2 for the second, the stores evict-first
    grid_prefetch: bool = False  # with grid_row: a step's first loads issued before the last tile is written
    grid_tile: int = 0  # with grid_row: a tile's elements, at least (0: rowwise.GRID_TILE)
    intrinsics: bool = False  # fused neighbours' logs and exponentials by the special-function unit
    prologue: str = ""  # rid of an ew region computed on this region's loads
    epilogue: str = ""  # rid of an ew region computed on this region's stores


def _layout(r: Region, low: Lowered) -> RowLayout | None:
    lay = row_layout(r, low) if r.kind in KINDS else None
    return lay if lay is not None and lay.trailing else None


def claims(r: Region, low: Lowered) -> bool:
    return _layout(r, low) is not None


def _short(lay: RowLayout) -> bool:
    return lay.reduced <= SHORT_ROW and lay.op != "group_norm"


def _few_long_rows(lay: RowLayout) -> bool:
    """A two-pass op whose captured rows are too few to give each SM of a large GPU one (a LayerNorm over
    16 rows of 4M): the launcher then splits them across blocks. Many rows keep a block each."""
    return (
        lay.op in TWO_PASS and lay.op != "group_norm" and lay.outer * lay.inner < FEW_ROWS and not _short(lay)
    )


def regs_for(rp: RowPlan, r: Region, low: Lowered, threads: int = 0) -> int:
    """Vectors per thread that hold a whole row in registers (a cluster's plan: its block's segment), 0 when
    the op or the row does not allow it."""
    lay = _layout(r, low)
    if lay is None:
        return 0
    if rp.cluster:
        regs = -(-_segment(lay, rp.cluster, rp.vec) // (rp.vec * (threads or rp.threads)))
        fits = rowwise.cluster_regs_ok(
            lay, dataclasses.replace(rp, regs=regs, threads=threads or rp.threads), r
        )
        return regs if fits else 0
    regs = -(-lay.reduced // (rp.vec * (threads or rp.threads)))
    return regs if rowwise.regs_ok(lay, dataclasses.replace(rp, regs=regs, smem_row=False), r) else 0


def _segment(lay: RowLayout, cluster: int, vec: int) -> int:
    """Columns of a row one block of a cluster takes (as the launcher cuts it: whole vectors)."""
    chunk = -(-lay.reduced // cluster)
    return -(-chunk // vec) * vec


# An FMA or two an element written, and statistics without an exp an element. log_softmax writes x - lse but
# its statistics take an exp an element: on 256 threads (8 warps alone on the SM) their latency was not hidden
# (KernelBench's 24 over a cluster of 16 on the H100: 8.46 ms at 256 threads, 7.69 at 512).
CHEAP_WRITES = ("layer_norm", "group_norm", "rms_norm")


def cluster_threads(lay: RowLayout, cluster: int, vec: int, cheap_write: bool) -> int:
    """The block for a cluster's segment held in registers, 0 where even 1024 threads cannot hold it. The
    block is alone on its SM, so its write pass runs on its own warps with nothing to overlap: a write of an
    FMA an element takes the fewest threads (256 at least) whose shares fit CLUSTER_THREAD_FLOATS, a costlier
    one (a division, an exp, a fused epilogue) the most. On the H100 (benchmarks/cluster_regs.py): instance
    norm over 1 MB rows 5.09 ms at 256 threads x 32 vectors, 5.27 at 1024 x 8; L1 norm (a division an
    element) over 256 KB rows 7.49 at 256 threads, 6.17 at 1024; the segment in shared memory 5.75 and 6.19."""
    seg = _segment(lay, cluster, vec)
    for threads in (256, 512, 1024) if cheap_write else (1024, 512, 256):
        per = -(-seg // (vec * threads)) * vec
        if per <= rowwise.CLUSTER_THREAD_FLOATS and per * threads <= rowwise.CLUSTER_REG_FLOATS:
            return threads
    return 0


def first(r: Region, low: Lowered, tuned: bool) -> RowPlan:
    """Plain: scalar accesses and a shared-memory tree, a long reduction split over the SMs' blocks when its
    rows are too few for them (one block over a whole tensor would leave all SMs but one idle). Tuned:
    16-byte vectors, warp shuffles, a warp per short row, a split of long reductions, and a row that fits
    held in registers."""
    rp = RowPlan(r.rid)
    lay = _layout(r, low)
    if lay is None:
        return rp
    if not tuned:
        return dataclasses.replace(rp, splits=1) if r.kind is RegionKind.REDUCE and not _short(lay) else rp
    vmax = common.vec_max(ops.ITEMSIZE.get(lay.in_dtype, 4))
    short = _short(lay)
    threads = 256 if short else max(128, min(1024, common.pow2(-(-lay.reduced // (vmax * 4)))))
    rp = dataclasses.replace(
        rp, vec=vmax, threads=threads, warp_reduce=True, warp_rows=short,
        splits=1 if not short and (r.kind is RegionKind.REDUCE or _few_long_rows(lay)) else 0,
    )  # fmt: skip
    # Rows that a warp's vectors would half fill (F.normalize over heads of 32 floats: 8 of 32 lanes busy)
    # take a group of lanes each, several rows a warp.
    need = -(-lay.reduced // vmax)
    if short and need <= 16:
        rp = dataclasses.replace(rp, lanes=common.pow2(need))
    # One read of a row that fits in registers, with 256 threads a block: the best of 128 to 1024 for
    # softmax (4096 columns) and layer norm (8192) on the H200.
    if regs := regs_for(rp, r, low, 256):
        rp = dataclasses.replace(rp, threads=256, regs=regs)
    elif r.kind is RegionKind.REDUCE and lay.reduced >= LONG_ROW_PASSES * rp.vec * rp.threads:
        rp = dataclasses.replace(rp, unroll=long_row_unroll(lay))
    # A row too long for one block's shared memory, read twice by a block per row (the second read misses
    # L2: a few hundred MB of rows are in flight), is read once spread over a cluster, each block's segment
    # cached in its shared memory, 8 loads in flight a thread: alone on its SM, a block needs them all to
    # keep DRAM busy. On the H200 (benchmarks/rownorm_variants.py): 4.61 ms against 5.62 for a block per row
    # over 1 MB rows, 3.96 against 4.76 over 1.5 MB rows, 4.62 against 6.03 over 256 KB rows.
    elif (c := cluster_blocks(lay, r)) and not rp.regs:
        # 16-bit inputs take 4: eight vectors of 8 elements a thread spilled at 1024 threads
        unroll = CLUSTER_UNROLL if ops.ITEMSIZE.get(lay.in_dtype, 4) >= 4 else CLUSTER_UNROLL // 2
        rp = dataclasses.replace(rp, cluster=c, threads=1024, unroll=unroll)
        # each block's segment held in registers where it fits (no shared-memory round trip: on the H100
        # 5.09 against 5.75 ms over 1 MB rows; over 256 KB rows with a division an element, 6.17 and 6.19),
        # over twice the blocks where that makes it fit, up to the portable 8: a cluster of 16 lost to 8
        # every way it was measured on the H200 (benchmarks/cluster_regs.py, 2026-12-06): LogSoftmax's 1.5 MB
        # rows 6.20-7.34 ms over 16 blocks (registers or shared memory) against 4.46 over 8 in shared memory;
        # InstanceNorm's 1 MB rows 4.37-8.66 against 3.95-4.58 over 8
        cheap = lay.op in CHEAP_WRITES and fusion.epilogue(r, low) is None
        while c <= rowwise.PORTABLE_CLUSTER:
            wider = dataclasses.replace(rp, cluster=c)
            if (t := cluster_threads(lay, c, rp.vec, cheap)) and (regs := regs_for(wider, r, low, t)):
                return dataclasses.replace(wider, threads=t, regs=regs)
            c *= 2
    # A row no cluster holds (over 3 MB: GroupNorm's 8 MB groups, a LayerNorm over 4M elements) was read
    # twice from DRAM (63% of the floor). Over the tiles of a persistent cooperative grid, a step's tiles'
    # statistics taken while the last step's tiles are written (re-read from L2), it is read once from DRAM.
    # Its first read marked evict_last for the second (l2_hints): GroupNorm's 8 MB groups 9.18 -> 8.20 ms on
    # the H100 (2026-12-07), still behind the block per row's 7.69 there, which the first batch times too.
    elif grid_rows(lay, r):
        rp = dataclasses.replace(rp, grid_row=True, threads=GRID_THREADS, unroll=GRID_UNROLL,
                                 persistent=GRID_SMS_BLOCKS, l2_hints=True)  # fmt: skip
    return rp


def long_row_unroll(lay: RowLayout) -> int:
    """Loads in flight a thread for a long row streamed once (a sum, a GEMV's dot products). Where a block is
    alone on its SM (rows no more than the SMs, a row split over them), four: one at a time left it waiting
    on DRAM between loads. Where rows outnumber the SMs, two: the loop then fits 32 registers, so two blocks
    of 1024 threads (four of 512) share an SM. Four took 48-58 and left half the SM's threads idle: on the
    H100 (2026-12-07) GEMV 256 x 131072 0.062 -> 0.047 ms (71% -> 93% of the floor), 8192^2 0.093 -> 0.091."""
    return LONG_ROW_PASSES if lay.outer * lay.inner <= common.SMS else SHARED_SM_PASSES


def grid_rows(lay: RowLayout, r: Region) -> bool:
    """A two-pass op whose rows neither a block nor a cluster can cache."""
    return (
        lay.op in TWO_PASS and r.kind is not RegionKind.REDUCE and not _short(lay)
        and 4 * lay.reduced > rowwise.MAX_SMEM_ROW and not cluster_blocks(lay, r)
    )  # fmt: skip


def cluster_blocks(lay: RowLayout, r: Region) -> int:
    """Blocks a cluster for a two-pass op's row that one block cannot cache: the fewest (a power of two, 16
    at most) whose segments fit CLUSTER_SEGMENT; 0 where one block can, or a cluster cannot."""
    if lay.op not in TWO_PASS or r.kind is RegionKind.REDUCE or _short(lay):
        return 0
    row = 4 * lay.reduced  # cached as fp32
    if row <= rowwise.MAX_SMEM_ROW:
        return 0
    return next((c for c in (2, 4, 8, 16) if row <= c * CLUSTER_SEGMENT), 0)


_plain = common.hosted_render(_layout, rowwise.render)
_strided = common.hosted_render(_layout, functools.partial(rowwise.render, strided=True))


def render(r: Region, rp: RowPlan, low: Lowered, hunter: object) -> Code:
    """A row op of a strided view (a head of a permuted qkv: F.normalize) reads it in place where the
    template's kernel can (templates/rowwise.py render)."""
    src = r.node.args[0] if r.node.args else None
    strided = isinstance(src, Ref) and common.strided_view(src.name, low)
    return (_strided if strided else _plain)(r, rp, low, hunter)


def _vectorize(plan: Plan, rp: RowPlan, r: Region, low: Lowered) -> common.Moves:
    lay = _layout(r, low)
    if rp.vec * 2 * (ops.ITEMSIZE.get(lay.in_dtype, 4) if lay else 4) <= 16:
        yield from change("vectorize_loads", plan, rp, vec=rp.vec * 2)


def _coarsen(plan: Plan, rp: RowPlan, r: Region, low: Lowered) -> common.Moves:
    """The row held in registers (instead of a shared-memory copy, if it had one), then more unrolling."""
    if not rp.regs and (regs := regs_for(rp, r, low)):
        yield from change(
            "coarsen_threads", plan, rp, regs=regs, **({"smem_row": False} if rp.smem_row else {})
        )
    yield from common.unroll("coarsen_threads")(plan, rp, r, low)


def _parallelism(plan: Plan, rp: RowPlan, r: Region, low: Lowered) -> common.Moves:
    """A reduction split over more blocks, else a warp per short row."""
    lay = _layout(r, low)
    splittable = r.kind is RegionKind.REDUCE or (lay is not None and _few_long_rows(lay))
    if splittable and not rp.warp_rows and (rp.splits * 2 or 1) <= MAX_SPLITS:
        yield from change("more_parallelism", plan, rp, splits=rp.splits * 2 or 1)
    elif not rp.warp_rows and lay is not None and _short(lay):
        yield from change("more_parallelism", plan, rp, warp_rows=True, splits=0)


def _tile(plan: Plan, rp: RowPlan, r: Region, low: Lowered) -> common.Moves:
    """Two-pass ops keep the row in shared memory between the passes: one block's, or a cluster's when the
    row is too long for one (a cluster of twice the blocks when it has one)."""
    lay = _layout(r, low)
    if lay is not None and (c := cluster_blocks(lay, r)):
        if not rp.cluster:
            yield from change("tile_shared_memory", plan, rp, cluster=c, **({"regs": 0} if rp.regs else {}))
        elif rp.cluster * 2 <= rowwise.MAX_CLUSTER:
            wider = dataclasses.replace(rp, cluster=rp.cluster * 2)
            regs = regs_for(wider, r, low) if rp.regs else 0  # the halved segment re-divided (or cached)
            yield from change(
                "tile_shared_memory", plan, rp, cluster=rp.cluster * 2, **({"regs": regs} if rp.regs else {})
            )
    elif not rp.smem_row and r.kind in (RegionKind.SOFTMAX, RegionKind.NORM):
        yield from change("tile_shared_memory", plan, rp, smem_row=True, **({"regs": 0} if rp.regs else {}))


def _divergence(plan: Plan, rp: RowPlan, r: Region, low: Lowered) -> common.Moves:
    lay = _layout(r, low)
    if not rp.warp_reduce:
        yield from change("remove_divergence", plan, rp, warp_reduce=True)
    elif not rp.warp_rows and lay is not None and _short(lay):
        yield from change("remove_divergence", plan, rp, warp_rows=True, splits=0)


def _resize(plan: Plan, rp: RowPlan, r: Region, low: Lowered) -> common.Moves:
    """threads x2 and /2; a register-held row is re-divided over the new block (or dropped if it no longer
    fits)."""
    for threads in (rp.threads * 2, rp.threads // 2):
        if 64 <= threads <= 1024:
            regs = regs_for(rp, r, low, threads) if rp.regs else None
            yield from common.resized("resize_grid", plan, rp, threads, regs)


def _occupancy(plan: Plan, rp: RowPlan, r: Region, low: Lowered) -> common.Moves:
    """A cluster's block, its segment cached, is alone on its SM: the way back is a block per row (several an
    SM, each reading its row twice), which the search can time against it."""
    if rp.cluster:
        yield from change("increase_occupancy", plan, rp, cluster=0, **({"regs": 0} if rp.regs else {}))
    elif rp.grid_row:  # a block per row, several an SM (its row read twice)
        yield from change("increase_occupancy", plan, rp, grid_row=False, persistent=0)
    else:
        yield from common.increase_occupancy(plan, rp, r, low)


MAX_GRID_LAG = 3
# A grid step is a chain of round trips (the tile's DRAM read, the partial's fence and counter, the partials'
# and the tile's L2 reads, the stores): GroupNorm's took ~9 us a step for 8 MB on the H100 with hints, about
# twice its bytes' time. Larger tiles, fewer steps, spread that chain over more bytes (and more L2 a step).
MAX_GRID_TILE = 4 * rowwise.GRID_TILE
_more_unroll = common.unroll("pipeline_loads")


def _pipeline(plan: Plan, rp: RowPlan, r: Region, low: Lowered) -> common.Moves:
    """A grid row's tiles: their first read kept in L2 for the second (cache hints), a step's loads issued
    before the last step's tile is written, written a step later (the blocks drift further apart before one
    waits), or twice as large (fewer steps); other rows: more loads in flight a thread."""
    if rp.grid_row:
        yield from change("pipeline_loads", plan, rp, l2_hints=not rp.l2_hints)
        if not rp.grid_prefetch:
            yield from change("pipeline_loads", plan, rp, grid_prefetch=True)
        if rp.grid_lag < MAX_GRID_LAG:
            yield from change("pipeline_loads", plan, rp, grid_lag=rp.grid_lag + 1)
        if (tile := 2 * (rp.grid_tile or rowwise.GRID_TILE)) <= MAX_GRID_TILE:
            yield from change("pipeline_loads", plan, rp, grid_tile=tile)
    yield from _more_unroll(plan, rp, r, low)


def _hedges(rp: RowPlan) -> tuple[str, ...]:
    """A row over a cluster or a cooperative grid is a bet on the GPU: a cluster of 16 needs a GPC's 16 free
    SMs, a grid's every step waits on the last one. Measured against the block per row it replaced, the
    cluster of 8 lost on LogSoftmax's 1.5 MB rows (H200, 2026-12-05), then won by 4% (4.46 against 4.66 ms,
    H200, 2026-12-06, its statistics merged in parallel), and won on InstanceNorm's 1 MB rows (H100, 5.09
    against 5.75 ms); LogSoftmax over 16 (8.46 ms) and GroupNorm over the grid (9.19 ms, 54% of the floor)
    ran no faster than a row read twice on the H100 (docs/benchmarks.md, 2026-12-06)."""
    return ("increase_occupancy",) if rp.cluster or rp.grid_row else ()


def _registers(plan: Plan, rp: RowPlan, r: Region, low: Lowered) -> common.Moves:
    if rp.regs:
        yield from change("reduce_registers", plan, rp, regs=0)
    else:
        yield from common.fewer_registers(plan, rp, r, low)


FAMILY = Family(
    knobs=RowPlan,
    hedges=_hedges,
    claims=claims,
    first=first,
    render=render,
    edits={
        **common.FUSE_EDITS,
        "vectorize_loads": _vectorize,
        "coarsen_threads": _coarsen,
        "more_parallelism": _parallelism,
        "tile_shared_memory": _tile,
        "remove_divergence": _divergence,
        "persistent_grid": common.persistent_grid,
        "lower_power": common.fewer_sms,
        "pipeline_loads": _pipeline,
        "resize_grid": _resize,
        "increase_occupancy": _occupancy,
        "reduce_registers": _registers,
        "use_intrinsics": common.use_intrinsics,
    },
    order=10,
    settle=common.settle_fusions,
)
