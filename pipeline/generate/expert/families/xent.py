"""Cross-entropy and NLL losses over (N, C) fp32 logits (log-probabilities for NLL) and int64 class targets,
or (N, C, d...) scores and (N, d...) targets (a thread a position), with or without class weights or label
smoothing (cross-entropy; not both), any ignore_index and reduction, in one pass over the logits
(templates/xent.py): the fused log-softmax, pick and mean that issue 15 asks of a loss. Eager runs a
log-softmax (written and read back), then the NLL. Both plans take our kernel (no library anchor). Edits:
vectorize_loads (float4 rows, the tuned plan's), resize_grid (threads x2 and /2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.generate.expert.families import common
from pipeline.generate.expert.graph import Node, Ref
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates import xent
from pipeline.generate.expert.templates.code import Code

OPS = ("cross_entropy_loss", "nll_loss", "nll_loss_nd")


@dataclass(frozen=True)
class XentPlan(common.WarpRowPlan):
    TAG: ClassVar[str] = "xent"


@dataclass(frozen=True)
class Form:
    classes: int
    ignore: int
    nll: bool
    reduction: int
    smoothing: float = 0.0
    weighted: bool = False
    spatial: bool = False  # (N, C, d...) scores and (N, d...) targets


def form(n: Node, low: Lowered) -> Form | str:
    """The loss our kernel computes for this node, else why not."""
    if n.op not in OPS:
        return "not a cross-entropy or NLL loss"
    a = n.args
    x, t = (low.by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:2])
    weight = a[2] if len(a) > 2 else n.kw("weight", None)
    reduction = a[3] if len(a) > 3 else n.kw("reduction", 1)
    ignore = a[4] if len(a) > 4 else n.kw("ignore_index", -100)
    smoothing = a[5] if len(a) > 5 and n.op == "cross_entropy_loss" else n.kw("label_smoothing", 0.0)
    if x is None or t is None or x.shape is None or t.shape is None or len(x.shape) < 2:
        return "not (N, C) scores and (N,) targets, nor (N, C, d...) and (N, d...)"
    spatial = len(x.shape) > 2
    if tuple(t.shape) != (x.shape[0], *x.shape[2:]):
        return f"targets of shape {t.shape} for scores of {x.shape}"
    if spatial and n.op == "nll_loss":  # nll_loss takes (N, C) only; the N-D form is nll_loss_nd / 2d
        return "an N-D nll_loss"
    if x.dtype != "float32" or t.dtype != "int64":
        return f"{x.dtype} scores or {t.dtype} targets (fp32 and int64 only)"
    w = low.by_name.get(weight.name) if isinstance(weight, Ref) else None
    if weight is not None and (w is None or w.dtype != "float32" or tuple(w.shape or ()) != (x.shape[1],)):
        return "class weights that are not C fp32 values"
    if reduction not in (0, 1, 2) or not isinstance(ignore, int):
        return "an unknown reduction"
    if not isinstance(smoothing, (int, float)) or not 0.0 <= smoothing <= 1.0:
        return f"a label smoothing of {smoothing!r}"
    if smoothing and weight is not None:
        return "label smoothing with class weights"
    if not 1 <= x.shape[1] < 2**31 or abs(ignore) >= 2**62:
        return "an empty class dim"
    return Form(x.shape[1], ignore, n.op != "cross_entropy_loss", int(reduction), float(smoothing),
                weight is not None, spatial)  # fmt: skip


def _render(r: Region, f: Form, threads: int, vec: bool) -> Code:
    return xent.render(
        r, f.classes, f.ignore, f.nll, f.reduction, threads, vec, f.smoothing, f.weighted, f.spatial
    )


FAMILY = common.warp_row_family(XentPlan, OPS, form, _render, "loss")
