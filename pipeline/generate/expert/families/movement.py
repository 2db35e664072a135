"""Data movement: flip, roll, cat, stack, repeat (tile), Tensor.unfold, F.unfold (im2col), padding and elements picked
by an int64 index tensor (embedding, index_select, x[:, i], gather) as our own strided copies (templates/movement.py),
any dtype of one to eight bytes, any dims, inputs of any strides; the dims, shifts, repeats, windows and
pads must be constants. Before this family they were left to PyTorch,
and a task of nothing else (a lone flip or roll) was refused. Both plans
take our kernel (a copy has no library anchor worth keeping); the tuned one moves 16 bytes a thread where a
piece's rows align, and a cat or stack sinks its inputs' elementwise producers (`sink`: each writes its
result straight into its slice of the output, whose copy then disappears; render.py). Edits:
vectorize_loads (16-byte units), resize_grid (threads x2 and /2), fuse_kernels (sink).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert.families import common
from pipeline.generate.expert.families.base import Family, RenderError, change
from pipeline.generate.expert.graph import Node, Ref
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates import movement
from pipeline.generate.expert.templates.code import Code

DTYPES = ("float32", "float16", "bfloat16", "bool", "int64", "int32", "uint8", "int8")


@dataclass(frozen=True)
class MovePlan(RegionPlan):
    TAG: ClassVar[str] = "move"
    SHOWN: ClassVar[tuple[str, ...]] = ("threads", "sink")

    threads: int = 256
    vec: bool = False  # 16 bytes a thread where a piece's rows start on 16-byte boundaries
    sink: bool = False  # cat / stack: an input's elementwise producer writes into the output itself


def _ints(v: Any) -> bool:
    return isinstance(v, tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def why_not(r: Region, low: Lowered) -> str:
    """Why our copies do not compute this region, or "" when they do."""
    n = r.node
    if r.kind is not RegionKind.TORCH or n.op not in movement.OPS:
        return "not an op our copies compute"
    if n.dtype not in DTYPES or not n.shape:
        return f"a {n.dtype} result of shape {n.shape}"
    a = n.args
    srcs = a[0] if n.op in ("cat", "stack") else (a[0],) if a else ()
    if not srcs or not all(isinstance(s, Ref) for s in srcs):
        return "its inputs are not tensors of the graph"
    for s in srcs:
        t = low.by_name.get(s.name)
        if t is None or t.dtype != n.dtype or not t.shape:
            return "an input of another dtype (the op would promote it) or of no known shape"
    if n.op == "flip" and not (len(a) == 2 and _ints(a[1])):
        return "the flipped dims are not constants"
    if n.op == "roll":
        shifts = a[1] if len(a) > 1 else None
        shifts = (shifts,) if isinstance(shifts, int) and not isinstance(shifts, bool) else shifts
        dims = a[2] if len(a) > 2 else ()
        if not _ints(shifts) or not _ints(dims) or len(shifts) != max(1, len(dims)):
            return "the shifts and dims are not matching constants"
    if n.op in ("cat", "stack"):
        dim = a[1] if len(a) > 1 else n.kw("dim", 0)
        if not isinstance(dim, int) or isinstance(dim, bool):
            return "the dim is not a constant"
    nd = len(low.by_name[srcs[0].name].shape or ())
    if n.op in movement.TAKES:
        return _take_why_not(n, low, nd)
    # repeat: the output seen as (r0, s0, r1, s1, ...) must fit the kernel's eight dims
    if n.op in ("repeat", "tile") and (len(a) < 2 or not _ints(a[1]) or max(len(a[1]), nd) > 4):
        return "the repeats are not constants, or span more than 4 dims"
    if n.op == "unfold" and not (len(a) == 4 and _ints(tuple(a[1:])) and a[2] > 0 and a[3] > 0 and nd < 8):
        return "the window's dim, size and step are not constants"
    if n.op == "im2col" and not (len(a) == 5 and all(_ints(v) and len(v) == 2 for v in a[1:])):
        return "the kernel, dilation, padding and stride are not pairs of constants"
    if n.op == "im2col" and (
        min(a[1]) < 1 or min(a[2]) < 1 or min(a[4]) < 1 or min(a[3]) < 0 or nd not in (3, 4)
    ):
        return "a window of no size or step, a negative padding, or an input that is not (N, C, H, W) / (C, H, W)"
    if n.op in ("pad", "constant_pad_nd"):
        value = movement.pad_value(n)
        mode = movement.pad_mode(n)
        if mode not in ("constant", "reflect", "replicate", "circular"):
            return f"a {mode} padding"
        if not _ints(a[1] if len(a) > 1 else None) or len(a[1]) % 2:
            return "not a padding by constant amounts"
        if mode != "constant" and (min(a[1], default=0) < 0 or len(a[1]) // 2 > 3 or len(a[1]) // 2 >= nd):
            return f"a {mode} padding that crops, or of more than 3 dims or every dim"
        if len(a[1]) > 2 * nd or not isinstance(value, int | float):
            return "more padded dims than the input has, or a fill that is not a number"
        if (
            n.dtype not in ("float32", "float16", "bfloat16")
            and isinstance(value, float)
            and not value.is_integer()
        ):
            return "a fractional fill of an integer tensor"
    return ""


def _take_why_not(n: Node, low: Lowered, nd: int) -> str:
    """embedding, index_select, indexing by one int64 tensor (x[:, i]) or gather: the index and dims fit."""
    a = n.args
    if n.op == "gather":  # the index has the input's rank; sparse_grad changes nothing forward
        where = a[2] if len(a) > 2 else None
        dim_ok = len(a) > 1 and isinstance(a[1], int) and not isinstance(a[1], bool)
        ref = low.by_name.get(where.name) if isinstance(where, Ref) else None
        ok = dim_ok and ref is not None and ref.shape is not None and len(ref.shape) == nd
    elif n.op == "embedding":
        where, ok = (a[1] if len(a) > 1 else None), nd == 2
    elif n.op == "index_select":
        where, ok = (a[2] if len(a) > 2 else None), len(a) > 1 and isinstance(a[1], int) and nd >= 1
    else:
        k = movement.take_position(n)
        where, ok = (a[1][k] if k >= 0 else None), k >= 0 and len(a[1]) <= nd
    index = low.by_name.get(where.name) if isinstance(where, Ref) else None
    if not ok or index is None or index.dtype != "int64" or index.shape is None:
        return "not rows picked by one int64 index tensor"
    if len(n.shape or ()) > 8:
        return "more than 8 dims"
    return ""


def claims(r: Region, low: Lowered) -> bool:
    return not why_not(r, low)


def first(r: Region, low: Lowered, tuned: bool) -> MovePlan:
    return MovePlan(r.rid, vec=tuned, sink=tuned and r.node.op in movement.SINKS)


def _sink(plan: Plan, rp: MovePlan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    """fuse_kernels for a cat or stack: its inputs' elementwise producers write into its output."""
    if not rp.sink and r.node.op in movement.SINKS:
        yield from change("fuse_kernels", plan, rp, sink=True)


def render(r: Region, rp: MovePlan, low: Lowered, hunter: Any) -> Code:
    why = why_not(r, low)
    if why:
        raise RenderError(f"region {r.rid} cannot be our copy: {why}")
    return movement.render(r, r.node.dtype or "float32", rp.threads, rp.vec, rp.sink)


def declines(r: Region, low: Lowered) -> str:
    """Why a copy-like op stays PyTorch's ("" for any other op)."""
    return why_not(r, low) if r.kind is RegionKind.TORCH and r.node.op in movement.OPS else ""


FAMILY = Family(
    knobs=MovePlan,
    claims=claims,
    first=first,
    render=render,
    declines=declines,
    edits={
        "vectorize_loads": common.vectorize_flag,
        "resize_grid": common.resize_grid,
        "fuse_kernels": _sink,
    },
    order=14,
)
