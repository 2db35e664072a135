"""How each region looks to a template, worked out from the traced (static) shapes.

Elementwise regions see their output as rows x cols, where cols are the trailing `k` dimensions; each
tensor operand is `full` (same shape as the output), `scalar` (one element), `row` (varies along the leading
dimensions only: read once per row), `col` (varies along the trailing ones) or `dense` (any other broadcast:
the launcher expands it to full). Row-wise ops (reductions, softmax, norms, scans) see (outer, R, inner),
`trailing` when the reduced dimensions are the last ones.
Sizes themselves are read at run time by the launcher, so any batch size works.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from pipeline.generate.expert import ops, scans
from pipeline.generate.expert.graph import Node, Ref
from pipeline.generate.expert.regions import Lowered, Region, RegionKind


class Bcast(enum.StrEnum):
    """How an operand of an elementwise region broadcasts against the region's (rows x cols) output."""

    FULL = "full"
    SCALAR = "scalar"
    ROW = "row"
    COL = "col"
    DENSE = "dense"


@dataclass(frozen=True)
class Operand:
    name: str  # the value read
    dtype: str
    cls: Bcast


@dataclass(frozen=True)
class EwLayout:
    k: int  # trailing dimensions that make up a row (k == ndim: the whole tensor is one row)
    ndim: int
    operands: tuple[Operand, ...]
    outputs: tuple[tuple[str, str], ...]  # (value, dtype)
    rows: int
    cols: int
    max_itemsize: int


def _aligned(shape: tuple[int, ...], nd: int) -> tuple[int, ...]:
    return (1,) * (nd - len(shape)) + tuple(shape)


def operand_class(shape: tuple[int, ...], out: tuple[int, ...], split: int) -> Bcast:
    nd = len(out)
    dims = _aligned(shape, nd)
    if dims == tuple(out):
        return Bcast.FULL
    if math.prod(dims) == 1:
        return Bcast.SCALAR
    live = [i for i in range(nd) if dims[i] != 1]
    a, b = live[0], live[-1] + 1
    if any(dims[i] != out[i] for i in range(a, b)):
        return Bcast.DENSE
    if b <= split:
        return Bcast.ROW
    if a >= split:
        return Bcast.COL
    return Bcast.DENSE


def ew_layout(region: Region, low: Lowered) -> EwLayout:
    out = region.shape
    nd = len(out)
    names = [i for i in region.inputs]
    shapes = {i: low.by_name[i].shape or () for i in names}
    best: tuple[int, int] | None = None
    # Positional ops read the row in the matrix once per row and the column as the index in it: rows x N.
    splits = [nd - 1] if ops.positional(region.nodes) and nd >= 2 else range(nd + 1)
    for split in splits:
        cost = 0
        for i in names:
            c = operand_class(shapes[i], out, split)
            dims = _aligned(shapes[i], nd)
            if c is Bcast.DENSE:
                cost += 100
            elif c is Bcast.COL:
                # its index (c // inner) % mid is c itself when it spans the row, size-1 dims aside
                live = [d for d in range(nd) if dims[d] != 1]
                spans = math.prod(out[split : live[0]]) == 1 and math.prod(out[live[-1] + 1 :]) == 1
                cost += 0 if spans else 10
        cols = math.prod(out[split:]) if out else 1
        # A block walks one row at a time: rows of a few elements leave nearly all its threads idle (level 2's
        # 75_Gemm_GroupNorm_Min_BiasAdd adds N x 1 to 1 x C x 1 x 1, split after dim 3 into rows of one).
        cost += (1 if split > 0 else 0) + (0 if split == 0 or cols >= 64 else 5 if cols >= 16 else 40)
        if best is None or cost < best[0]:
            best = (cost, split)
    split = best[1] if best else 0
    operands = tuple(
        Operand(i, low.by_name[i].dtype or "float32", operand_class(shapes[i], out, split)) for i in names
    )
    outputs = tuple((o, _node(region, o).dtype or "float32") for o in region.outputs)
    sizes = [ops.ITEMSIZE.get(d, 4) for d in (*(o.dtype for o in operands if o.cls in (Bcast.FULL, Bcast.DENSE)),
                                              *(d for _, d in outputs))]  # fmt: skip
    return EwLayout(
        k=nd - split,
        ndim=nd,
        operands=operands,
        outputs=outputs,
        rows=math.prod(out[:split]) if split else 1,
        cols=math.prod(out[split:]) if out else 1,
        max_itemsize=max(sizes) if sizes else 4,
    )


def _node(region: Region, name: str) -> Node:
    return next(n for n in region.nodes if n.name == name)


@dataclass(frozen=True)
class RowLayout:
    """A reduction, softmax, norm or scan over the dims [d0, d1) of its input, seen as (outer, R, inner)."""

    op: str  # reduce kind (sum, argmax, ...), softmax, log_softmax, layer_norm, rms_norm, group_norm, cumsum...
    trailing: bool  # the reduced dims are the last ones (so inner == 1)
    dims: tuple[int, ...]  # reduced dims as written (may be negative); () for norms' static description
    outer: int
    reduced: int
    inner: int
    in_dtype: str
    out_dtype: str
    keepdim: bool = False
    indices: bool = False  # also writes int64 indices (max/min over a dim) or only indices (arg*)
    pair: bool = False  # max/min over a dim whose indices nobody reads: returns (values, None)
    correction: float = 1.0
    eps: float = 0.0
    op_form: str = ""  # rms_col: "div" (x / rms, as written) or "mul" (x * rsqrt)
    has_weight: bool = False
    has_bias: bool = False
    groups: int = 0  # group norm; 0 for instance norm (one group per channel, read at run time)
    norm_dims: int = 0  # layer/rms norm: how many trailing dims are normalised
    static_nd: int = 0  # rank of the traced input
    dims_from: str = "start"  # reduce: dims count from the "start", the "end" (written negative), or "all"
    w_dtype: str = "float32"  # norms' weight and bias
    reverse: bool = False  # scan: from the far end of the dim
    exclusive: bool = False  # scan: each output leaves its own element out (the first is the identity)
    grow: int = 0  # scan: the output's length along the dim minus the input's


def _values_only(name: str, low: Lowered) -> bool:
    """Whether a (values, indices) result is only ever indexed [0]: its int64 indices, twice the values'
    bytes, then need not be written."""
    users = low.users.get(name, ())
    if not users or name in low.graph.output_names():
        return False
    for u in users:
        n = low.by_name.get(u)
        if n is None or n.op != "getitem" or len(n.args) < 2 or n.args[1] != 0:
            return False
    return True


def row_layout(region: Region, low: Lowered) -> RowLayout | None:
    """None when the op's static shape does not fit a template (the region then stays with PyTorch)."""
    n = region.node
    x = low.by_name[n.args[0].name] if n.args and isinstance(n.args[0], Ref) else None
    if x is None or x.shape is None:
        return None
    shape = x.shape
    nd = len(shape)
    in_dt = x.dtype or "float32"
    out_dt = n.dtype or in_dt
    if region.kind is RegionKind.REDUCE:
        red = ops.reduction_of(n)
        if red is None:
            return None
        dims = (
            tuple(range(nd)) if red.dims is None else tuple(sorted({d % nd for d in red.dims})) if nd else ()
        )
        if nd == 0:
            dims = ()
        if dims and dims != tuple(range(dims[0], dims[-1] + 1)):
            return None  # non-adjacent dims that do not compose (var, std): left to PyTorch
        d0, d1 = (dims[0], dims[-1] + 1) if dims else (nd, nd)
        outer, reduced, inner = math.prod(shape[:d0]), math.prod(shape[d0:d1]), math.prod(shape[d1:])
        arg = red.kind in ("argmax", "argmin")
        pair = red.indices and _values_only(n.name, low)
        if red.indices:
            out_dt = in_dt
        return RowLayout(
            op=red.kind,
            trailing=d1 == nd,
            dims=dims,
            outer=outer,
            reduced=reduced,
            inner=inner,
            in_dtype=in_dt,
            out_dtype="int64" if arg else out_dt,
            keepdim=red.keepdim,
            indices=(red.indices and not pair) or arg,
            pair=pair,
            correction=red.correction,
            static_nd=nd,
            dims_from="all" if red.dims is None else "end" if all(d < 0 for d in red.dims) else "start",
        )
    if region.kind in (RegionKind.SOFTMAX, RegionKind.SCAN):
        d = int(n.args[1]) % nd if nd else 0
        op = n.op.lstrip("_")
        return RowLayout(
            op=op,
            trailing=d == nd - 1,
            dims=(int(n.args[1]),),
            outer=math.prod(shape[:d]),
            reduced=shape[d] if nd else 1,
            inner=math.prod(shape[d + 1 :]),
            in_dtype=in_dt,
            out_dtype=out_dt,
            static_nd=nd,
            reverse=bool(n.kw("reverse")),
            exclusive=bool(n.kw("exclusive")),
            grow=scans.grow(n, x) if region.kind is RegionKind.SCAN else 0,
            eps=float(n.args[2]) if n.op == "rms_col" else 0.0,
            op_form=str(n.args[3]) if n.op == "rms_col" else "",
        )
    if region.kind is RegionKind.NORM:
        lay = _norm_layout(n, shape, in_dt, out_dt)
        if lay is None:
            return None
        wts = [low.by_name[r.name].dtype for r in n.args[1:5] if isinstance(r, Ref)]
        return dataclasses.replace(lay, static_nd=nd, w_dtype=wts[0] if wts else in_dt)
    return None


def _norm_layout(n: Node, shape: tuple[int, ...], in_dt: str, out_dt: str) -> RowLayout | None:
    a = n.args
    nd = len(shape)
    if n.op in ("layer_norm", "rms_norm", "l1_norm", "l2_normalize"):
        normalized = tuple(a[1]) if isinstance(a[1], tuple) else (int(a[1]),)
        k = len(normalized)
        if tuple(shape[nd - k :]) != normalized:
            return None
        w = a[2] if len(a) > 2 and n.op in ("layer_norm", "rms_norm") else None
        b = a[3] if n.op == "layer_norm" and len(a) > 3 else None
        eps = float(
            a[4] if n.op == "layer_norm" and len(a) > 4
            else a[3] if n.op == "rms_norm" else a[2] if n.op == "l2_normalize" else 1e-5
        )  # fmt: skip
        return RowLayout(
            op=n.op, trailing=True, dims=(), outer=math.prod(shape[: nd - k]), reduced=math.prod(normalized),
            inner=1, in_dtype=in_dt, out_dtype=out_dt, eps=eps, has_weight=w is not None,
            has_bias=b is not None, norm_dims=k,
        )  # fmt: skip
    if nd < 2:
        return None
    if n.op == "group_norm":
        groups, w, b, eps = int(a[1]), a[2], a[3], float(a[4])
    elif n.op == "instance_norm":
        groups, w, b, eps = 0, a[1], a[2], float(a[7])
    else:
        return None
    g = groups or shape[1]
    if shape[1] % g:
        return None
    per_row = math.prod(shape[1:]) // g
    return RowLayout(
        op="group_norm", trailing=True, dims=(), outer=shape[0] * g, reduced=per_row, inner=1,
        in_dtype=in_dt, out_dtype=out_dt, eps=eps, has_weight=w is not None, has_bias=b is not None,
        groups=groups,
    )  # fmt: skip
