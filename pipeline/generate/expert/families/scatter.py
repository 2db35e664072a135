"""Scatters (templates/scatter.py), where they were left to PyTorch: scatter_add and scatter_reduce with
reduce="sum" over the destination (an index shaped as its source), index_add (alpha too) and index_put on
dim 0 by one int64 index (accumulating or not), fp32, the destination differing from the source only along
the scattered dim. Both plans take our kernels. Edits: resize_grid (threads x2 and /2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert import ops
from pipeline.generate.expert.families import common
from pipeline.generate.expert.graph import Node
from pipeline.generate.expert.plan import RegionPlan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates import scatter
from pipeline.generate.expert.templates.code import Code

OPS = ("scatter_add", "scatter_reduce", "index_add", "index_put")


@dataclass(frozen=True)
class ScatterPlan(RegionPlan):
    TAG: ClassVar[str] = "scatter"
    SHOWN: ClassVar[tuple[str, ...]] = ("threads",)

    threads: int = 256


@dataclass(frozen=True)
class Form:
    dim: int
    per_row: bool  # one index entry a source row (index_add, index_put), else one an element
    accumulate: bool
    alpha: float = 1.0


def _operands(n: Node, low: Lowered) -> tuple[Node | None, Node | None, Node | None, Any]:
    """(destination, index, source, dim) of the node."""
    if n.op == "index_put":
        indices = n.args[1] if len(n.args) > 1 else ()
        index = indices[0] if isinstance(indices, tuple | list) and len(indices) == 1 else None
        return (
            common.operand(n.args[0], low),
            common.operand(index, low),
            common.operand(ops._arg(n, 2, "values", None), low),
            0,
        )
    return (
        common.operand(n.args[0], low),
        common.operand(ops._arg(n, 2, "index", None), low),
        common.operand(ops._arg(n, 3, "src", None), low),
        n.args[1],
    )


def form(n: Node, low: Lowered) -> Form | str:
    """What our kernels compute for this node, else why not."""
    if n.op not in OPS:
        return "not a scatter"
    x, index, src, dim = _operands(n, low)
    if (
        x is None
        or index is None
        or src is None
        or x.shape is None
        or index.shape is None
        or src.shape is None
    ):
        return "operands of unknown shape (ours: three tensors)"
    if (x.dtype, src.dtype, n.dtype, index.dtype) != ("float32", "float32", "float32", "int64"):
        return f"{x.dtype} into {src.dtype} by {index.dtype} (ours: fp32 by int64)"
    rank = len(x.shape)
    if not isinstance(dim, int) or not rank or not -rank <= dim < rank or len(src.shape) != rank:
        return f"dim {dim} of shapes {x.shape} and {src.shape}"
    dim %= rank
    if any(a != b for d, (a, b) in enumerate(zip(x.shape, src.shape, strict=True)) if d != dim):
        return f"a source of shape {src.shape} into {x.shape} (ours: the same but along dim {dim})"
    per_row = n.op in ("index_add", "index_put")
    if per_row and tuple(index.shape) != (src.shape[dim],):
        return f"an index of shape {index.shape} (ours: one entry a source row)"
    if not per_row and tuple(index.shape) != tuple(src.shape):
        return f"an index of shape {index.shape} for a source of {src.shape} (ours: the same)"
    if n.op == "scatter_reduce" and (
        ops._arg(n, 4, "reduce", None) != "sum" or not ops._arg(n, 5, "include_self", True)
    ):
        return "a reduce other than a sum over the destination"
    alpha = ops._arg(n, 4, "alpha", 1) if n.op == "index_add" else 1
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        return "a non-constant alpha"
    accumulate = bool(ops._arg(n, 3, "accumulate", False)) if n.op == "index_put" else True
    return Form(dim, per_row, accumulate, float(alpha))


def _emit(r: Region, rp: ScatterPlan, f: Form, low: Lowered) -> Code:
    return scatter.render(r, f.dim, f.per_row, f.accumulate, f.alpha, rp.threads)


FAMILY = common.torch_family(ScatterPlan, OPS, form, _emit, "scatter")
