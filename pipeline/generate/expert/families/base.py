"""What an op family declares, and the helpers its edits share.

An op family is one module in this package that defines `FAMILY`, a Family: the regions it claims, its
plan knobs (a RegionPlan subclass), its first plans, its render function and its edits. The registry
(`families/__init__.py`) finds every such module; the policy, the plan, the renderer and the edits ask it
and name no family themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates.code import Code

# (plan, the region's entry in it, the region, the lowered graph) -> (label, plan) pairs, each one legal
# change of that entry. The entry is None only for an `optional` family's region the plan leaves out.
Edit = Callable[[Plan, Any, Region, Lowered], Iterable[tuple[str, Plan]]]


class RenderError(Exception):
    """The plan cannot be rendered for this graph (a stale plan, an argument we cannot write)."""


def _unchanged(plan: Plan, region: Region, low: Lowered, tuned: bool) -> Plan:
    return plan


def _defaults(rp: RegionPlan) -> RegionPlan | None:
    return type(rp)(rp.rid)


def _no_note(regions: list[Region], low: Lowered) -> str:
    return ""


def _any_arch(arch: str) -> bool:
    return True


@dataclass(frozen=True)
class Family:
    """One op family.

    knobs     its RegionPlan subclass; the subclass's TAG names the family in a plan's JSON
    claims    whether its template computes this region (a pure function of the region and the graph)
    first     the region's entry in the plain (tuned=False) or the tuned first plan, or None for none
    render    the region's Code for its entry; raises RenderError when the entry no longer fits
    edits     edit name (the profiler's vocabulary) -> Edit
    order     claiming precedence and settling order, lower first
    settle    decisions across regions once every first entry is in (fusing a neighbour...): families
              settle in `order`, the regions of one order together in graph order, so the hosts of fused
              neighbours (order 10) win a neighbour a GEMM (order 20) would also take
    plainest  its entry in a repair: the family's defaults, or None to hand the region to the library
    note      a line for the proposals' notes about the regions it claims, or ""
    declines  why it does not claim a region of one of its ops (rows too long, a mode it lacks), or "" for
              a region that is not its op at all: the note of a region left to PyTorch says it
    cute      its source includes CuTe (nvcc then needs CUTE_FLAGS)
    runs_on   whether its kernels run on an arch ("sm_90a"); a plan for another arch drops its entries
    optional  a region it claims may have no entry: the library (cuBLAS, cuDNN) computes it then
    hedges    the edits that undo a bet a region's entry makes (a form faster on some GPUs and shapes, slower
              on others): with no advice to follow they are the entry's first edits, so its first batch
              times the bet against the form it replaced
    """

    knobs: type[RegionPlan]
    claims: Callable[[Region, Lowered], bool]
    first: Callable[[Region, Lowered, bool], RegionPlan | None]
    render: Callable[[Region, Any, Lowered, Any], Code]
    edits: Mapping[str, Edit]
    order: int = 0
    settle: Callable[[Plan, Region, Lowered, bool], Plan] = _unchanged
    plainest: Callable[[Any], RegionPlan | None] = _defaults
    note: Callable[[list[Region], Lowered], str] = _no_note
    declines: Callable[[Region, Lowered], str] = lambda r, low: ""
    cute: bool = False
    runs_on: Callable[[str], bool] = _any_arch
    optional: bool = False
    hedges: Callable[[Any], tuple[str, ...]] = lambda rp: ()

    @property
    def tag(self) -> str:
        return self.knobs.TAG


def label(edit: str, rid: str, **changes: object) -> str:
    return f"{edit}({rid}: {', '.join(f'{k}={v}' for k, v in changes.items())})"


def changed(plan: Plan, rp: RegionPlan, **changes: object) -> Plan:
    return plan.replace(dataclasses.replace(rp, **changes))


def change(edit: str, plan: Plan, rp: RegionPlan, **changes: object) -> Iterator[tuple[str, Plan]]:
    """The one (label, plan) pair of an edit that sets these knobs of rp."""
    yield label(edit, rp.rid, **changes), changed(plan, rp, **changes)
