"""Reductions and softmax over a dimension that is not the last: threads along the contiguous inner
dimension, the reduced one walked (and for reductions shared and split) across threads and blocks
(templates/colwise.py). It hosts elementwise neighbours like the row-wise family.

Edits: fuse_kernels / fuse_epilogue, vectorize_loads (when the inner size allows), coarsen_threads (a
two-pass op's column held in registers where it fits, else unroll x2) and pipeline_loads (unroll x2),
more_parallelism (a reduction split over more blocks), coalesce_accesses (more threads along the contiguous
dimension), resize_grid, increase_occupancy, reduce_registers (the held column first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from pipeline.generate.expert import ops
from pipeline.generate.expert.families import common
from pipeline.generate.expert.families.base import Family, change, changed
from pipeline.generate.expert.families.rowwise import KINDS, MAX_SPLITS
from pipeline.generate.expert.layout import RowLayout, row_layout
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates import colwise


@dataclass(frozen=True)
class ColPlan(RegionPlan):
    TAG: ClassVar[str] = "col"
    SHOWN: ClassVar[tuple[str, ...]] = ("vec", "threads", "bx")
    ABSORBS: ClassVar[tuple[str, ...]] = ("prologue", "epilogue")

    vec: int = 1  # elements per vector access along the inner dimension (16 bytes at most)
    threads: int = 256
    unroll: int = 1  # rows loaded before any is merged (reductions), loop iterations in flight (softmax)
    min_blocks: int = 0  # __launch_bounds__ minimum blocks per SM (caps registers for occupancy)
    splits: int = 0  # reductions: split the reduced dimension to reach this many blocks per SM (0: never)
    bx: int = 32  # threads along the contiguous inner dimension
    regs: int = 0  # two-pass ops (softmax, rms_col): a column's `regs` rows held in registers; 0: read twice
    prologue: str = ""  # rid of an ew region computed on this region's loads
    epilogue: str = ""  # rid of an ew region computed on this region's stores


def _layout(r: Region, low: Lowered) -> RowLayout | None:
    lay = row_layout(r, low) if r.kind in KINDS else None
    return lay if lay is not None and not lay.trailing else None


def claims(r: Region, low: Lowered) -> bool:
    return _layout(r, low) is not None


def first(r: Region, low: Lowered, tuned: bool) -> ColPlan:
    """Plain: scalar accesses. Tuned: 16-byte vectors when the inner size allows, four rows in flight, and
    a reduction split when the outputs are too few to fill the GPU."""
    lay = _layout(r, low)
    if not tuned or lay is None:
        return ColPlan(r.rid)
    vmax = common.vec_max(ops.ITEMSIZE.get(lay.in_dtype, 4))
    vec = vmax if lay.inner % vmax == 0 else 1
    rp = ColPlan(r.rid, vec=vec, unroll=4, splits=1 if r.kind is RegionKind.REDUCE else 0)
    # a two-pass op's column held in registers, with narrower vectors where the widest do not fit (64
    # channels: one float a row): read once beats 16-byte loads that read every column twice
    while rp.vec > 1 and lay.op in colwise.TWO_PASS and not _column_regs(lay, rp):
        rp = dataclasses.replace(rp, vec=rp.vec // 2)
    if not _column_regs(lay, rp):
        rp = dataclasses.replace(rp, vec=vec)
    return dataclasses.replace(rp, regs=_column_regs(lay, rp))


COLUMN_FLOATS = 64  # floats a thread may hold of its columns' rows (a softmax or RMS norm over channels)


def _column_regs(lay: RowLayout, rp: ColPlan) -> int:
    """A two-pass op's rows a thread holds (softmax, rms_col), where its columns fit COLUMN_FLOATS: each read once (its loads all in
    flight at once), where the streaming kernel reads them twice, the second time missing L2 on large
    tensors (a block's columns take MBs). 0 where they do not fit, or for a reduction."""
    fits = lay.op in colwise.TWO_PASS and lay.reduced * rp.vec <= COLUMN_FLOATS
    return lay.reduced if fits else 0


render = common.hosted_render(_layout, colwise.render)


def _vectorize(plan: Plan, rp: ColPlan, r: Region, low: Lowered) -> common.Moves:
    lay = _layout(r, low)
    vec = rp.vec * 2
    if lay is not None and vec * ops.ITEMSIZE.get(lay.in_dtype, 4) <= 16 and lay.inner % vec == 0:
        yield from change("vectorize_loads", plan, rp, vec=vec)


def _parallelism(plan: Plan, rp: ColPlan, r: Region, low: Lowered) -> common.Moves:
    if r.kind is RegionKind.REDUCE and (rp.splits * 2 or 1) <= MAX_SPLITS:
        yield from change("more_parallelism", plan, rp, splits=rp.splits * 2 or 1)


def _coarsen(plan: Plan, rp: ColPlan, r: Region, low: Lowered) -> common.Moves:
    """A two-pass op's column held in registers where it fits, then more unrolling."""
    lay = _layout(r, low)
    if lay is not None and not rp.regs and (regs := _column_regs(lay, rp)):
        yield from change("coarsen_threads", plan, rp, regs=regs)
    yield from common.unroll("coarsen_threads")(plan, rp, r, low)


def _registers(plan: Plan, rp: ColPlan, r: Region, low: Lowered) -> common.Moves:
    if rp.regs:
        yield from change("reduce_registers", plan, rp, regs=0)
    else:
        yield from common.fewer_registers(plan, rp, r, low)


def _vector_regs(plan: Plan, rp: ColPlan, r: Region, low: Lowered) -> common.Moves:
    """vectorize_loads, its held column dropped where the wider vectors no longer fit."""
    lay = _layout(r, low)
    for label, p in _vectorize(plan, rp, r, low):
        q = p.get(rp.rid)
        if lay is not None and isinstance(q, ColPlan) and q.regs and not _column_regs(lay, q):
            p = changed(p, q, regs=0)
        yield label, p


def _coalesce(plan: Plan, rp: ColPlan, r: Region, low: Lowered) -> common.Moves:
    """More threads along the contiguous dimension (reductions; softmax has one thread per column)."""
    lay = _layout(r, low)
    if r.kind is not RegionKind.REDUCE or lay is None:
        return
    if rp.bx * 2 <= min(rp.threads, 256) and lay.inner >= rp.bx * 2 * rp.vec:
        yield from change("coalesce_accesses", plan, rp, bx=rp.bx * 2)


FAMILY = Family(
    knobs=ColPlan,
    claims=claims,
    first=first,
    render=render,
    edits={
        **common.FUSE_EDITS,
        "vectorize_loads": _vector_regs,
        "coarsen_threads": _coarsen,
        "more_parallelism": _parallelism,
        "pipeline_loads": common.unroll("pipeline_loads"),
        "resize_grid": common.resize_grid,
        "increase_occupancy": common.increase_occupancy,
        "reduce_registers": _registers,
        "coalesce_accesses": _coalesce,
    },
    order=10,
    settle=common.settle_fusions,
)
