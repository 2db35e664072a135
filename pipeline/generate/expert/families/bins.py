"""Binning (templates/bins.py), where it was left to PyTorch: torch.histc of fp32 values over a constant
range (min < max; min == max takes the data's own range, which fixed kernels do not know), and bucketize /
searchsorted of fp32, fp16 or bf16 values among float or integer boundaries (1-D, or for searchsorted rows
matching the values' rows; no sorter). Both plans take our kernel.
Edits: resize_grid (threads x2 and /2); tile_shared_memory (histc: more shared copies of the histogram, or
none, counting in global atomics; search: the boundaries staged in shared memory or read from global).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from pipeline.generate.expert import ops
from pipeline.generate.expert.families import common
from pipeline.generate.expert.families.base import RenderError, change
from pipeline.generate.expert.graph import Node
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates import bins
from pipeline.generate.expert.templates.code import Code

OPS = ("histc", "bucketize", "searchsorted")
SEQ_DTYPES = (*ops.FLOAT_DTYPES, "int32", "int64")


@dataclass(frozen=True)
class BinsPlan(RegionPlan):
    TAG: ClassVar[str] = "bins"
    SHOWN: ClassVar[tuple[str, ...]] = ("threads", "shared", "copies")

    threads: int = 256
    shared: bool = True  # histc: a histogram a block in shared memory; search: the boundaries staged there
    copies: int = 1  # histc: copies of that histogram, one per group of warps


@dataclass(frozen=True)
class Histc:
    bins: int
    lo: float
    hi: float


@dataclass(frozen=True)
class Search:
    length: int  # boundaries a search runs over
    per_row: bool  # N-D boundaries: the row matching the value's row
    right: bool
    seq_dtype: str


def form(n: Node, low: Lowered) -> Histc | Search | str:
    """What our kernel computes for this node, else why not."""
    if n.op not in OPS:
        return "not a histogram or a search"
    if n.op == "histc":
        x = common.operand(n.args[0], low)
        if x is None or x.dtype != "float32" or n.dtype != "float32":
            return f"{x.dtype if x else 'unknown'} values (ours: fp32)"
        nb, lo, hi = ops._arg(n, 1, "bins", 100), ops._arg(n, 2, "min", 0), ops._arg(n, 3, "max", 0)
        if not isinstance(nb, int) or not 1 <= nb <= 1 << 24:
            return f"{nb} bins"
        if not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in (lo, hi)
        ):
            return "the range is not two finite constants"
        if not float(lo) < float(hi):  # min == max: the data's own min and max, known only when it runs
            return f"the range [{lo}, {hi}] is empty (eager takes the data's own range)"
        return Histc(nb, float(lo), float(hi))
    if n.overload != "Tensor":
        return "a scalar searched"
    seq_ref, x_ref = (n.args[0], n.args[1]) if n.op == "searchsorted" else (n.args[1], n.args[0])
    seq, x = common.operand(seq_ref, low), common.operand(x_ref, low)
    if x is None or seq is None or x.dtype not in ops.FLOAT_DTYPES or seq.dtype not in SEQ_DTYPES:
        return "values or boundaries of a type ours does not compare (ours: float values, float or int boundaries)"
    if n.dtype not in ("int64", "int32") or not seq.shape or x.shape is None:
        return "an output other than int64 or int32 positions"
    if n.kw("sorter") is not None:
        return "a sorter given"
    right, side = bool(n.kw("right", False)), n.kw("side")
    if side is not None:
        right = side == "right"
    per_row = len(seq.shape) > 1
    if per_row and tuple(seq.shape[:-1]) != tuple(x.shape[:-1]):
        return (
            f"boundaries of shape {seq.shape} for values of shape {x.shape} (their leading dims must match)"
        )
    if seq.shape[-1] == 0:
        return "no boundaries"
    return Search(seq.shape[-1], per_row, right, seq.dtype or "float32")


def first(r: Region, low: Lowered, tuned: bool) -> BinsPlan:
    f = form(r.node, low)
    # a histogram too large for shared memory counts in global atomics
    return BinsPlan(r.rid, shared=not isinstance(f, Histc) or f.bins <= bins.MAX_PRIVATE_BINS)


def _emit(r: Region, rp: BinsPlan, f: Histc | Search, low: Lowered) -> Code:
    if isinstance(f, Histc):
        if rp.shared and f.bins * rp.copies > bins.MAX_PRIVATE_BINS:
            raise RenderError(f"region {r.rid}: {rp.copies} copies of {f.bins} bins exceed shared memory")
        return bins.histc(r, "float32", f.bins, f.lo, f.hi, rp.threads, rp.shared, rp.copies)
    x_ref = r.node.args[1] if r.node.op == "searchsorted" else r.node.args[0]
    dtype = low.by_name[x_ref.name].dtype or "float32"
    return bins.search(r, dtype, f.seq_dtype, f.length, f.per_row, f.right, r.node.dtype or "int64", rp.threads,
                       rp.shared)  # fmt: skip


def shared_memory(plan: Plan, rp: BinsPlan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    """histc: twice the copies while they fit (fewer warps queue on one copy's busy bins), or global atomics
    instead; a search: the boundaries staged or not."""
    f = form(r.node, low)
    if isinstance(f, Histc):
        if (
            rp.shared
            and f.bins * rp.copies * 2 <= bins.MAX_PRIVATE_BINS
            and rp.copies * 2 <= rp.threads // 32
        ):
            yield from change("tile_shared_memory", plan, rp, copies=rp.copies * 2)
        if rp.shared:
            yield from change("tile_shared_memory", plan, rp, shared=False, copies=1)
        elif f.bins <= bins.MAX_PRIVATE_BINS:
            yield from change("tile_shared_memory", plan, rp, shared=True)
    elif isinstance(f, Search) and not f.per_row and f.length <= bins.MAX_STAGED:
        yield from change("tile_shared_memory", plan, rp, shared=not rp.shared)


FAMILY = common.torch_family(
    BinsPlan,
    OPS,
    form,
    _emit,
    "binning",
    edits={"resize_grid": common.resize_grid, "tile_shared_memory": shared_memory},
    first=first,
)
