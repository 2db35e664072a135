"""cosine_similarity of two fp32 tensors of one shape over their last dim, in one pass over both
(templates/cosine.py): the dot product and both squared norms summed together, where the decomposition
(regions._cosine, for any other dim) runs three row sums. The lowering leaves the node whole where this
kernel takes it (fused_losses.cosine). Both plans take our kernel (no library anchor). Edits:
vectorize_loads (float4 rows, the tuned plan's), resize_grid (threads x2 and /2).
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
from pipeline.generate.expert.templates import cosine
from pipeline.generate.expert.templates.code import Code

OPS = ("cosine_similarity",)


@dataclass(frozen=True)
class CosinePlan(RegionPlan):
    TAG: ClassVar[str] = "cosine"
    SHOWN: ClassVar[tuple[str, ...]] = ("threads",)

    threads: int = 256
    vec: bool = False  # float4 loads of the rows where D % 4 == 0


def form(n: Node, low: Lowered) -> fused_losses.Cosine | str:
    return fused_losses.cosine(n, low.by_name)


why_not, claims, declines = common.torch_region_rules(form, OPS)


def first(r: Region, low: Lowered, tuned: bool) -> CosinePlan:
    return CosinePlan(r.rid, vec=tuned)


def render(r: Region, rp: CosinePlan, low: Lowered, hunter: Any) -> Code:
    f = form(r.node, low)
    if isinstance(f, str):
        raise RenderError(f"region {r.rid} cannot be our cosine similarity kernel: {f}")
    return cosine.render(r, f, rp.threads, rp.vec)


FAMILY = Family(
    knobs=CosinePlan,
    claims=claims,
    first=first,
    render=render,
    declines=declines,
    edits={"vectorize_loads": common.vectorize_flag, "resize_grid": common.resize_grid},
    order=11,
)
