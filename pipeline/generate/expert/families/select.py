"""Sorting and selection (templates/select.py): torch.sort, argsort (stable or not: ours is the stable
order), topk, median and nanmedian (of a dim or of the whole tensor) and kthvalue along one dim of rows of at most 4096
elements, fp32, fp16 and bf16, where they were left to PyTorch (the top-k of a MoE router, a sort of
scores). Longer rows stay PyTorch's (a multi-block sort).
Both plans take our kernel (no library anchor to keep). Edits: resize_grid (threads x2 and /2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from pipeline.generate.expert import ops
from pipeline.generate.expert.families import common
from pipeline.generate.expert.graph import Node, Ref
from pipeline.generate.expert.plan import RegionPlan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates import select
from pipeline.generate.expert.templates.code import Code

DTYPES = ("float32", "float16", "bfloat16")
OPS = ("topk", "sort", "argsort", "median", "nanmedian", "kthvalue")


@dataclass(frozen=True)
class SelectPlan(RegionPlan):
    TAG: ClassVar[str] = "select"
    SHOWN: ClassVar[tuple[str, ...]] = ("threads",)

    threads: int = 512


@dataclass(frozen=True)
class Form:
    op: str  # topk, sort, argsort, median, nanmedian, kthvalue, median_all, nanmedian_all
    length: int  # the row along dim
    k: int  # elements written a row
    dim: int
    desc: bool
    start: int = 0  # the sorted position of the first one written
    keep: bool = True  # the dim stays in the output (of k elements), else it is dropped


def form(n: Node, low: Lowered) -> Form | str:
    """What our kernel computes for this node, else why not."""
    if n.op not in OPS:
        return "not a sort or top-k"
    x = low.by_name.get(n.args[0].name) if n.args and isinstance(n.args[0], Ref) else None
    if x is None or not x.shape or x.dtype not in DTYPES:
        return (
            f"{x.dtype if x else 'unknown'} values of shape {x.shape if x else None} (ours: fp32, fp16, bf16)"
        )
    if n.op in ("median", "nanmedian") and n.overload == "default":  # of every element
        if not 1 <= math.prod(x.shape) <= select.MAX_ROW:
            return f"{math.prod(x.shape)} elements (our kernel sorts rows of 1 to {select.MAX_ROW})"
        return Form(f"{n.op}_all", math.prod(x.shape), 1, 0, False, (math.prod(x.shape) - 1) // 2)
    if n.op in ("median", "nanmedian", "kthvalue"):
        rank = ops._arg(n, 1, "k", None) if n.op == "kthvalue" else None
        dim = ops._arg(n, 2 if n.op == "kthvalue" else 1, "dim", -1)
        keep = ops._arg(n, 3 if n.op == "kthvalue" else 2, "keepdim", False)
        if not isinstance(dim, int) or not -len(x.shape) <= dim < len(x.shape) or not isinstance(keep, bool):
            return "the dim is not a constant"
        length = x.shape[dim]
        start = (length - 1) // 2 if rank is None else rank - 1
        if not isinstance(start, int) or not 0 <= start < length <= select.MAX_ROW:
            return f"rows of {length} (our kernel sorts rows of 1 to {select.MAX_ROW} in shared memory)"
        return Form(n.op, length, 1, dim, False, start, keep)
    stable = n.overload == "stable"  # dim and descending are keywords there
    dim = n.kw("dim", -1) if stable else ops._arg(n, 2 if n.op == "topk" else 1, "dim", -1)
    if n.op == "topk":
        k, desc = ops._arg(n, 1, "k", None), ops._arg(n, 3, "largest", True)
    else:
        k, desc = None, (n.kw("descending", False) if stable else ops._arg(n, 2, "descending", False))
    if not isinstance(dim, int) or not isinstance(desc, bool) or not -len(x.shape) <= dim < len(x.shape):
        return "the dim or the direction is not a constant"
    length = x.shape[dim]
    k = length if k is None else k
    if not isinstance(k, int) or not 0 <= k <= length or not 1 <= length <= select.MAX_ROW:
        return f"rows of {length} (our kernel sorts rows of 1 to {select.MAX_ROW} in shared memory)"
    return Form(n.op, length, k, dim, desc)


def _emit(r: Region, rp: SelectPlan, f: Form, low: Lowered) -> Code:
    dtype = low.by_name[r.node.args[0].name].dtype or "float32"
    return select.render(r, f.op, dtype, f.length, f.k, f.dim, f.desc, rp.threads, f.start, f.keep)


FAMILY = common.torch_family(SelectPlan, OPS, form, _emit, "sort")
