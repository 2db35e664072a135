"""The triplet margin loss over fp32 (N, D) rows, p = 1 or 2, no swap, any margin, eps and reduction, in one
pass over its three inputs (templates/triplet.py): the fused loss issue 15 asks for. The lowering leaves
the node whole where this kernel takes it (fused_losses.triplet); elsewhere it decomposes it into
element-wise ops and two row sums, each reading the anchor. Both plans take our kernel (no library anchor).
Edits: vectorize_loads (float4 rows, the tuned plan's), resize_grid (threads x2 and /2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert import fused_losses
from pipeline.generate.expert.families import common
from pipeline.generate.expert.families.base import Family, RenderError
from pipeline.generate.expert.graph import Node
from pipeline.generate.expert.plan import RegionPlan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates import triplet
from pipeline.generate.expert.templates.code import Code

OPS = ("triplet_margin_loss",)


@dataclass(frozen=True)
class TripletPlan(RegionPlan):
    TAG: ClassVar[str] = "triplet"
    SHOWN: ClassVar[tuple[str, ...]] = ("threads",)

    threads: int = 256
    vec: bool = False  # float4 loads of the rows where D % 4 == 0


def form(n: Node, low: Lowered) -> fused_losses.Triplet | str:
    return fused_losses.triplet(n, low.by_name)


why_not, claims, declines = common.torch_region_rules(form, OPS)


def first(r: Region, low: Lowered, tuned: bool) -> TripletPlan:
    return TripletPlan(r.rid, vec=tuned)


def render(r: Region, rp: TripletPlan, low: Lowered, hunter: Any) -> Code:
    f = form(r.node, low)
    if isinstance(f, str):
        raise RenderError(f"region {r.rid} cannot be our triplet loss kernel: {f}")
    return triplet.render(r, f, rp.threads, rp.vec)


FAMILY = Family(
    knobs=TripletPlan,
    claims=claims,
    first=first,
    render=render,
    declines=declines,
    edits={"vectorize_loads": common.vectorize_flag, "resize_grid": common.resize_grid},
    order=11,
)
