"""cosine_similarity of two fp32 tensors of one shape over their last dim, in one pass over both
(templates/cosine.py): the dot product and both squared norms summed together, where the decomposition
(regions._cosine, for any other dim) runs three row sums. The lowering leaves the node whole where this
kernel takes it (fused_losses.cosine). Both plans take our kernel (no library anchor). Edits:
vectorize_loads (float4 rows, the tuned plan's), resize_grid (threads x2 and /2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.generate.expert import fused_losses
from pipeline.generate.expert.families import common
from pipeline.generate.expert.graph import Node
from pipeline.generate.expert.regions import Lowered
from pipeline.generate.expert.templates import cosine

OPS = ("cosine_similarity",)


@dataclass(frozen=True)
class CosinePlan(common.WarpRowPlan):
    TAG: ClassVar[str] = "cosine"


def form(n: Node, low: Lowered) -> fused_losses.Cosine | str:
    return fused_losses.cosine(n, low.by_name)


FAMILY = common.warp_row_family(CosinePlan, OPS, form, cosine.render, "cosine similarity")
