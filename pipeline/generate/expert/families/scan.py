"""Scans (cumsum, cumprod, logcumsumexp; inclusive or exclusive, from either end: scans.py folds them; cummax and
cummin, values or indices, over 64-bit keys) along any dimension: a block per row along the last one, a thread per column along the others (templates/scan.py). It hosts elementwise neighbours like the row-wise family.

Edits: fuse_kernels / fuse_epilogue, coarsen_threads (vectors a lane of a warp per row, else items per
thread, x2), tile_shared_memory (chunks staged in shared memory by a block per row: coalesced accesses for
several items a thread), persistent_grid, resize_grid, increase_occupancy, reduce_registers (the same /2,
else the occupancy bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.generate.expert import ops
from pipeline.generate.expert.families import common
from pipeline.generate.expert.families.base import Edit, Family, change
from pipeline.generate.expert.layout import row_layout
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates import scan

MAX_ITEMS = 16


@dataclass(frozen=True)
class ScanPlan(RegionPlan):
    TAG: ClassVar[str] = "scan"
    SHOWN: ClassVar[tuple[str, ...]] = ("threads",)
    ABSORBS: ClassVar[tuple[str, ...]] = ("prologue", "epilogue")

    threads: int = 256
    persistent: int = 0  # blocks per SM for a persistent grid (along the last dim); 0: a block per row
    min_blocks: int = 0  # __launch_bounds__ minimum blocks per SM (caps registers for occupancy)
    items: int = 1  # consecutive items per thread (along the last dim)
    stage: bool = False  # several items a thread: chunks loaded and stored through shared memory, coalesced
    vec_rows: int = 0  # a warp per row, this many 16-byte vectors a lane in flight (fp32 rows that allow it)
    prologue: str = ""  # rid of an ew region computed on this region's loads
    epilogue: str = ""  # rid of an ew region computed on this region's stores


def claims(r: Region, low: Lowered) -> bool:
    return r.kind is RegionKind.SCAN and row_layout(r, low) is not None


def first(r: Region, low: Lowered, tuned: bool) -> ScanPlan:
    """Tuned: a warp per row with eight vectors a lane in flight where the rows allow it, else (and for a
    keyed scan, which has no warp-per-row form) eight consecutive items per thread."""
    return ScanPlan(r.rid, items=8, vec_rows=0 if _keyed(r) else 8) if tuned else ScanPlan(r.rid)


render = common.hosted_render(row_layout, scan.render)


def _keyed(r: Region) -> bool:
    """cummax / cummin: their stores decode a key (a value or a position), with no epilogue to host."""
    return r.node.op in ops.KEYED_SCANS


def _fuse(name: str) -> Edit:
    def apply(plan: Plan, rp: ScanPlan, r: Region, low: Lowered) -> common.Moves:
        for label, p in common.FUSE_EDITS[name](plan, rp, r, low):
            if not (_keyed(r) and p.get(r.rid).epilogue):  # type: ignore[union-attr]
                yield label, p

    return apply


FUSE = {name: _fuse(name) for name in common.FUSE_EDITS}


def _coarsen(plan: Plan, rp: ScanPlan, r: Region, low: Lowered) -> common.Moves:
    if rp.vec_rows:
        if rp.vec_rows * 2 <= MAX_ITEMS:
            yield from change("coarsen_threads", plan, rp, vec_rows=rp.vec_rows * 2)
    elif rp.items * 2 <= MAX_ITEMS:
        yield from change("coarsen_threads", plan, rp, items=rp.items * 2)


def _stage(plan: Plan, rp: ScanPlan, r: Region, low: Lowered) -> common.Moves:
    """Chunks staged in shared memory: the block per row, in place of a warp per row."""
    if not rp.stage and scan.stages(rp.threads, rp.items):
        yield from change("tile_shared_memory", plan, rp, stage=True, vec_rows=0)


def _registers(plan: Plan, rp: ScanPlan, r: Region, low: Lowered) -> common.Moves:
    if rp.vec_rows > 1:
        yield from change("reduce_registers", plan, rp, vec_rows=rp.vec_rows // 2)
    elif rp.items > 1:
        yield from change("reduce_registers", plan, rp, items=rp.items // 2)
    elif not rp.min_blocks:
        yield from change("reduce_registers", plan, rp, min_blocks=common.blocks_per_sm(rp.threads))


FAMILY = Family(
    knobs=ScanPlan,
    claims=claims,
    first=first,
    render=render,
    edits={
        **FUSE,
        "coarsen_threads": _coarsen,
        "tile_shared_memory": _stage,
        "persistent_grid": common.persistent_grid,
        "resize_grid": common.resize_grid,
        "increase_occupancy": common.increase_occupancy,
        "reduce_registers": _registers,
    },
    order=10,
    settle=common.settling(FUSE),
)
