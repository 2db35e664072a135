"""Elementwise chains: one fused kernel per region of elementwise ops, broadcast operands included
(templates/elementwise.py). It is also the hybrid epilogue after a library GEMM or convolution.

Edits: vectorize_loads (vec x2, up to 16 bytes), coarsen_threads and pipeline_loads (unroll x2),
more_parallelism (half the block), persistent_grid, resize_grid (threads x2 and /2), increase_occupancy,
reduce_registers (unroll /2, else the occupancy bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.generate.expert.families import common
from pipeline.generate.expert.families.base import Family, change
from pipeline.generate.expert.layout import Bcast, ew_layout
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates import elementwise
from pipeline.generate.expert.templates.code import Code


@dataclass(frozen=True)
class EwPlan(RegionPlan):
    TAG: ClassVar[str] = "ew"
    SHOWN: ClassVar[tuple[str, ...]] = ("vec", "threads")

    vec: int = 1  # elements per vector access (16 bytes at most)
    threads: int = 256
    unroll: int = 1  # vector accesses in flight per thread
    persistent: int = 0  # blocks per SM for a persistent grid-stride grid; 0: a block per piece of work
    sm_share: int = 0  # percent of the SMs the persistent grid spans (lower_power); 0: all
    min_blocks: int = 0  # __launch_bounds__ minimum blocks per SM (caps registers for occupancy)
    intrinsics: bool = False  # logs and exponentials by the special-function unit (use_intrinsics)


def claims(r: Region, low: Lowered) -> bool:
    return r.kind is RegionKind.EW


def first(r: Region, low: Lowered, tuned: bool) -> EwPlan:
    """Plain: scalar accesses. Tuned: one 16-byte vector per thread, a block per piece of work. Measured on
    the H200 (benchmarks/ew_variants.py, a 12.9 GB stream): one vector in flight 3.04-3.05 ms, four 3.16,
    eight 3.15, a persistent grid 3.26-3.40; more in flight only adds DRAM turnarounds."""
    if not tuned:
        return EwPlan(r.rid)
    return EwPlan(r.rid, vec=common.vec_max(ew_layout(r, low).max_itemsize))


def render(r: Region, rp: EwPlan, low: Lowered, hunter: object) -> Code:
    lay = ew_layout(r, low)
    # a strided view, or an operand broadcast along dims that are no run (a window mask over batch and
    # heads): each read at its own row strides where its rows are runs, not expanded and gathered first
    strided = any(o.cls is Bcast.DENSE or common.strided_view(o.name, low) for o in lay.operands)
    return elementwise.render(r, lay, rp, sinkable=common.output_feeds_copy(r, None, low), strided=strided)


def _vectorize(plan: Plan, rp: EwPlan, r: Region, low: Lowered) -> common.Moves:
    if rp.vec * 2 * ew_layout(r, low).max_itemsize <= 16:
        yield from change("vectorize_loads", plan, rp, vec=rp.vec * 2)


def _parallelism(plan: Plan, rp: EwPlan, r: Region, low: Lowered) -> common.Moves:
    """Smaller blocks: more of them for the same work."""
    if rp.threads > 64:
        yield from common.resized("more_parallelism", plan, rp, rp.threads // 2)


FAMILY = Family(
    knobs=EwPlan,
    claims=claims,
    first=first,
    render=render,
    edits={
        "vectorize_loads": _vectorize,
        "coarsen_threads": common.unroll("coarsen_threads"),
        "more_parallelism": _parallelism,
        "persistent_grid": common.persistent_grid,
        "lower_power": common.fewer_sms,
        "pipeline_loads": common.unroll("pipeline_loads"),
        "resize_grid": common.resize_grid,
        "increase_occupancy": common.increase_occupancy,
        "reduce_registers": common.fewer_registers,
        "use_intrinsics": common.use_intrinsics,
    },
    order=0,
)
