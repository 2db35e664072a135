"""The triplet margin loss over fp32 (N, D) rows, p = 1 or 2, no swap, any margin, eps and reduction, in one
pass over its three inputs (templates/triplet.py): the fused loss issue 15 asks for. The lowering leaves
the node whole where this kernel takes it (fused_losses.triplet); elsewhere it decomposes it into
element-wise ops and two row sums, each reading the anchor. Both plans take our kernel (no library anchor).
Edits: vectorize_loads (float4 rows, the tuned plan's), resize_grid (threads x2 and /2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.generate.expert import fused_losses
from pipeline.generate.expert.families import common
from pipeline.generate.expert.graph import Node
from pipeline.generate.expert.regions import Lowered
from pipeline.generate.expert.templates import triplet

OPS = ("triplet_margin_loss",)


@dataclass(frozen=True)
class TripletPlan(common.WarpRowPlan):
    TAG: ClassVar[str] = "triplet"


def form(n: Node, low: Lowered) -> fused_losses.Triplet | str:
    return fused_losses.triplet(n, low.by_name)


FAMILY = common.warp_row_family(TripletPlan, OPS, form, triplet.render, "triplet loss")
