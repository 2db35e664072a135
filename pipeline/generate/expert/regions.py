"""Lower a captured Graph to the ops the templates know, and cut it into regions.

Lowering folds scans written around flips and concatenations into one (scans.py), splits library anchors
from their bias (linear -> matmul + add, conv -> conv without bias + add), turns inference batch norm into elementwise ops and global average pooling into a mean. Regions:

  ew       a fused chain of elementwise ops (broadcast operands, several outputs), one kernel
  reduce   sum/mean/max/min/arg*/prod/var/std/logsumexp/norms over dimensions
  softmax  softmax / log-softmax over one dimension
  norm     layer, RMS, group and instance norm (batch statistics)
  scan     cumsum / cumprod / logcumsumexp, inclusive or exclusive, from either end
  library  GEMM or convolution left to cuBLAS / cuDNN (the candidate is then hybrid)
  view     views and layout changes, done in the launcher with torch's plumbing
  torch    an op we do not cover, left to PyTorch in the launcher (hybrid, with a note)

Which template computes a region is not decided here: the op families (families/) claim regions.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass

from pipeline.generate.expert import chains, fused_losses, ops, scans
from pipeline.generate.expert.graph import Graph, Node, Ref


class RegionKind(enum.StrEnum):
    """What a region's ops are (not how they are computed: that is the claiming family's business)."""

    EW = "ew"
    REDUCE = "reduce"
    SOFTMAX = "softmax"
    NORM = "norm"
    SCAN = "scan"
    LIBRARY = "library"
    VIEW = "view"
    TORCH = "torch"


# Kinds the launcher can always run with torch itself; a region of any other kind that no family claims
# is left to PyTorch (its kind becomes TORCH, with a note).
FALLBACK = frozenset({RegionKind.LIBRARY, RegionKind.VIEW, RegionKind.TORCH})


@dataclass(frozen=True)
class Region:
    rid: str  # stable id: the name of its first node
    kind: RegionKind
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]  # values it writes that others (or forward's return) read
    inputs: tuple[str, ...]  # values it reads from outside
    shape: tuple[int, ...] = ()  # ew: the full (broadcast) shape of its outputs
    inplace: tuple[tuple[str, str], ...] = ()  # ew: (output, input) pairs written into the input's buffer
    note: str = ""

    @property
    def node(self) -> Node:
        return self.nodes[0]


@dataclass(frozen=True)
class Lowered:
    graph: Graph
    nodes: tuple[Node, ...]  # after lowering, topological order
    by_name: dict[str, Node]
    regions: tuple[Region, ...]  # topological order
    notes: tuple[str, ...]
    users: dict[str, tuple[str, ...]]  # value -> names of the nodes that read it

    def region_of(self, value: str) -> Region | None:
        return self._region_by_value.get(value)

    @functools.cached_property
    def _region_by_value(self) -> dict[str, Region]:
        """Each node's (first) region: asked per value by the families, a scan was quadratic in the nodes."""
        by: dict[str, Region] = {}
        for r in self.regions:
            for n in r.nodes:
                by.setdefault(n.name, r)
        return by


# rms_norm's eps when none is given: the epsilon of its opmath type, float32's for 16-bit inputs too (fp16's
# would be 8000 times larger: rows of small values came out 30% off, found by tests/fuzz_expert.py)
_RMS_EPS = 1.1920928955078125e-07


def lower(graph: Graph) -> Lowered:
    """Lower and partition; never raises for an op it does not know (it becomes a `torch` region, whose
    note the caller adds once the families have had their say)."""
    graph = scans.fold(graph)
    by_name: dict[str, Node] = {n.name: n for n in (*graph.inputs, *graph.params)}
    nodes: list[Node] = []
    notes: list[str] = list(graph.notes)
    for n in graph.nodes:
        lowered = _lower_node(n, by_name)
        if not lowered:  # dropped (broadcast_tensors): kept by name for the nodes that take it apart
            by_name[n.name] = n
        for m in lowered:
            nodes.append(m)
            by_name[m.name] = m
    nodes = _unexpanded(nodes, by_name)
    # Dead code: values nothing returned depends on (a layer computed and never used) are not computed.
    live = set(graph.output_names())
    for n in reversed(nodes):
        if n.name in live:
            live.update(n.refs())
    nodes = chains.compose([n for n in nodes if n.name in live], by_name, frozenset(graph.output_names()))
    users: dict[str, list[str]] = {}
    for n in nodes:
        for r in n.refs():
            users.setdefault(r, []).append(n.name)
    regions = _partition(graph, nodes, by_name, {k: tuple(v) for k, v in users.items()})
    return Lowered(
        graph, tuple(nodes), by_name, regions, tuple(notes), {k: tuple(v) for k, v in users.items()}
    )


# ---------------------------------------------------------------------------------------------------------
# Lowering


def _unexpanded(nodes: list[Node], by_name: dict[str, Node]) -> list[Node]:
    """An elementwise op reading an expand (F.normalize's divisor, expand_as, broadcast_tensors' parts) reads
    the expand's source instead: it broadcasts by itself, and the kernels read a smaller operand by its own
    broadcast rule, where an expanded view was gathered into a full-size copy first (114 MB a call of
    SwinV2's copies). Only where another operand of the op has the op's full shape, so the region's operands
    still span its output; not for positional ops, which index the element."""
    for i, n in enumerate(nodes):
        if not ops.is_elementwise(n) or n.op in ops.POSITIONAL or n.shape is None:
            continue
        args, changed = list(n.args), False
        for j, a in enumerate(n.args):
            e = by_name.get(a.name) if isinstance(a, Ref) else None
            if e is None or e.op != "expand" or e.shape != n.shape or not isinstance(e.args[0], Ref):
                continue
            src = by_name.get(e.args[0].name)
            # against the operands as they now stand: of two expands of (4, 1) to (4, 5), one stays
            full = any(
                k != j
                and isinstance(r, Ref)
                and (o := by_name.get(r.name)) is not None
                and o.shape == n.shape
                for k, r in enumerate(args)
            )
            if src is None or src.shape is None or e.dtype != src.dtype or not full:
                continue
            if broadcast(tuple(src.shape), tuple(n.shape)) != tuple(n.shape):
                continue
            args[j], changed = e.args[0], True
        if changed:
            nodes[i] = dataclasses.replace(n, args=tuple(args))
            by_name[n.name] = nodes[i]
    return nodes


def _mk(name: str, op: str, args: tuple, shape, dtype, overload: str = "default", **kw) -> Node:
    return Node(name, op, overload, args, tuple(kw.items()), shape, dtype, f"expert.{op}")


class _Steps:
    """A decomposition's nodes in order, each named `{name}_{tag}`, of dtype `dt` unless told otherwise."""

    def __init__(self, name: str, dt: str) -> None:
        self.name, self.dt, self.nodes = name, dt, []

    def add(self, tag: str, op: str, args: tuple, shape: tuple, overload: str = "default",
            dtype: str | None = None, **kw: object) -> Ref:  # fmt: skip
        return self.node(_mk(f"{self.name}_{tag}", op, args, shape, dtype or self.dt, overload, **kw))

    def node(self, m: Node) -> Ref:
        self.nodes.append(m)
        return Ref(m.name)


def _truth_as_float(name: str, src: Ref, x: Node) -> list[Node]:
    """x's truth as fp32 0.0 / 1.0 (x != 0, so NaN is true; a bool x as it is), the loads of a reduction
    that tests every element (any, all, count_nonzero)."""
    out: list[Node] = []
    if x.dtype != "bool":
        out.append(_mk(f"{name}_true", "ne", (src, 0.0), x.shape, "bool", "Scalar"))
        src = Ref(out[-1].name)
    return [*out, _cast(f"{name}_f", src, x.shape, "float32")]


def _bias_view(name: str, bias: Ref, channels: int, spatial: int, dtype: str) -> Node:
    """bias (C,) seen as (C, 1, ..., 1) so that it broadcasts over an NC... tensor."""
    shape = (channels,) + (1,) * spatial
    return _mk(name, "reshape", (bias, shape), shape, dtype)


def _gemv(n: Node, x: object, v: object, by_name: dict[str, Node], bias: object = None) -> list[Node] | None:
    """A matrix-vector product (`mm` / `matmul` by a (K, 1) or (K,) operand, a linear layer with one output)
    as a row-wise dot product: x * v, summed over the last dim in fp32 (as cuBLAS accumulates 16-bit ones).
    It is bound by reading x once; the row reductions read it once, with the product computed on their loads
    (a prologue), where a GEMM tile would be 1 column wide."""
    xs, vs = (by_name.get(r.name) if isinstance(r, Ref) else None for r in (x, v))
    if xs is None or vs is None or xs.shape is None or vs.shape is None or n.shape is None:
        return None
    if (
        not (n.dtype == xs.dtype == vs.dtype and n.dtype in ops.FLOAT_DTYPES)
        or len(xs.shape) < 1
        or not n.shape
    ):
        return None
    k = xs.shape[-1]
    if k < 1 or vs.shape not in (((1, k),) if n.op == "linear" else ((k,), (k, 1))):
        return None
    keep = len(n.shape) == len(xs.shape)  # (..., M, 1) out of a (K, 1) operand; (..., M) out of a (K,) one
    if n.shape != (*xs.shape[:-1], *((1,) if keep else ())):
        return None
    dt = n.dtype
    vec = _mk(f"{n.name}_vec", "reshape", (v, (k,)), (k,), dt)
    prod = _mk(f"{n.name}_prod", "mul", (x, Ref(vec.name)), xs.shape, dt, "Tensor")
    name = f"{n.name}_dot" if bias is not None else n.name
    dot = dataclasses.replace(
        _mk(name, "sum", (Ref(prod.name), (-1,), keep), n.shape, dt, _OVERLOAD["sum"]), target=n.target
    )
    if bias is None:
        return [vec, prod, dot]
    return [vec, prod, dot, _mk(n.name, "add", (Ref(dot.name), bias), n.shape, dt, "Tensor")]


def _as_permute(n: Node, by_name: dict[str, Node]) -> Node | None:
    """x.mT, x.swapaxes(a, b), x.movedim(s, d) (and x.mH, x.adjoint() of real tensors) as the transpose or
    permute views they are: left as they were, they went to PyTorch as calls."""
    src = by_name.get(n.args[0].name) if n.args and isinstance(n.args[0], Ref) else None
    if (
        src is None
        or src.shape is None
        or n.shape is None
        or n.dtype not in (*ops.FLOAT_DTYPES, "bool", "int64")
    ):
        return None
    nd = len(src.shape)
    if n.op in ("mT", "mH", "adjoint") and nd >= 2:
        return _mk(n.name, "transpose", (n.args[0], -2, -1), n.shape, n.dtype, "int")
    if n.op in ("swapaxes", "swapdims") and len(n.args) == 3:
        return _mk(n.name, "transpose", n.args, n.shape, n.dtype, "int")
    if n.op == "movedim" and len(n.args) == 3 and nd:
        moved = [n.args[1]] if isinstance(n.args[1], int) else list(n.args[1])
        to = [n.args[2]] if isinstance(n.args[2], int) else list(n.args[2])
        if len(moved) != len(to) or not all(isinstance(d, int) for d in (*moved, *to)):
            return None
        order: list[int | None] = [None] * nd
        for d_from, d_to in zip(moved, to, strict=True):
            order[d_to % nd] = d_from % nd
        rest = iter(d for d in range(nd) if d not in {d % nd for d in moved})
        perm = tuple(d if d is not None else next(rest) for d in order)
        return _mk(n.name, "permute", (n.args[0], perm), n.shape, n.dtype)
    return None


def _outer(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """A product with K = 1 ((..., M, 1) @ (..., 1, N), batch dims broadcast as matmul broadcasts them) is
    the broadcast product of its operands: one rounding, as the GEMM's, and no GEMM of depth one."""
    xs, ys = (by_name.get(r.name) if isinstance(r, Ref) else None for r in n.args[:2])
    if xs is None or ys is None or not xs.shape or not ys.shape or n.shape is None:
        return None
    if len(xs.shape) < 2 or len(ys.shape) < 2 or xs.shape[-1] != 1 or ys.shape[-2] != 1:
        return None
    if not (n.dtype == xs.dtype == ys.dtype and n.dtype in ops.FLOAT_DTYPES):
        return None
    return [dataclasses.replace(_mk(n.name, "mul", n.args[:2], n.shape, n.dtype, "Tensor"), target=n.target)]


def _broadcast_matmul(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """A matmul whose batch dims broadcast ((M, K) @ (E, K, N), (B, H, M, K) @ (H, K, N)): a right operand
    with no real batch is viewed as one matrix (the batch stays the left's rows); otherwise both operands
    expanded to the common batch and flattened into one bmm (the expanded one copied by torch's reshape,
    once), the result viewed back. Left as it was, no GEMM template took it."""
    xs, ys = (by_name.get(r.name) if isinstance(r, Ref) else None for r in n.args[:2])
    if xs is None or ys is None or not xs.shape or not ys.shape or n.shape is None:
        return None
    if len(xs.shape) < 2 or len(ys.shape) < 3 or xs.shape[:-2] == ys.shape[:-2]:
        return None  # a 2-D right operand, or equal batches: the GEMM templates take them as they are
    if not (n.dtype == xs.dtype == ys.dtype and n.dtype in ops.FLOAT_DTYPES):
        return None
    (m, k), (k2, cols) = xs.shape[-2:], ys.shape[-2:]
    batch = tuple(n.shape[:-2])
    if k != k2 or n.shape[-2:] != (m, cols):
        return None
    dt, name, out = n.dtype, n.name, []
    if math.prod(ys.shape[:-2]) == 1:  # (..., M, K) @ (1, K, N): one matrix on the right
        out.append(_mk(f"{name}_w", "reshape", (n.args[1], (k, cols)), (k, cols), dt))
        mm = _mk(name, "gemm_matmul", (n.args[0], Ref(out[-1].name)), n.shape, dt)
        return [*out, dataclasses.replace(mm, target=n.target)]
    flat = []
    for tag, ref, rows, inner in (("a", n.args[0], m, k), ("b", n.args[1], k, cols)):
        full = (*batch, rows, inner)
        out.append(_mk(f"{name}_{tag}_bc", "expand", (ref, full), full, dt))
        out.append(_mk(f"{name}_{tag}_3d", "reshape", (Ref(out[-1].name), (math.prod(batch), rows, inner)),
                       (math.prod(batch), rows, inner), dt))  # fmt: skip
        flat.append(Ref(out[-1].name))
    bmm = _mk(f"{name}_bmm", "gemm_bmm", tuple(flat), (math.prod(batch), m, cols), dt)
    out.append(dataclasses.replace(bmm, target=n.target))
    out.append(_mk(name, "reshape", (Ref(bmm.name), n.shape), n.shape, dt))
    return out


def _conv_padding(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """conv(padding="same" / "valid") as the conv with numbers: "valid" pads nothing; "same" pads
    dilation * (k - 1) // 2 on both sides, and where that total is odd the input first gets its extra
    element on the far side, as ATen does (a constant pad). Left as it was, no template took it."""
    a = [*n.args, *(None,) * 7][:7]
    x, w = (by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:2])
    # the export leaves out arguments at their defaults (padding "valid", stride and dilation 1, groups 1)
    mode, stride, dilation = (ops._arg(n, i, k, d) for i, k, d in ((4, "padding", "valid"), (3, "stride", 1),
                                                                  (5, "dilation", 1)))  # fmt: skip
    a[2], a[6] = ops._arg(n, 2, "bias", None), ops._arg(n, 6, "groups", 1)
    if x is None or w is None or not x.shape or not w.shape or mode not in ("same", "valid"):
        return None
    dims = len(w.shape) - 2
    dil = tuple(dilation) if isinstance(dilation, tuple | list) else (dilation,) * dims
    strides = tuple(stride) if isinstance(stride, tuple | list) else (stride,) * dims
    if len(dil) != dims or len(strides) != dims or not all(isinstance(v, int) for v in (*dil, *strides)):
        return None
    totals = [0] * dims if mode == "valid" else [d * (k - 1) for d, k in zip(dil, w.shape[2:], strict=True)]
    if mode == "same" and any(s != 1 for s in strides):
        return None
    out, src = [], a[0]
    if any(t % 2 for t in totals):  # the odd element on the far side of each such dim, last dim first
        pad = tuple(v for t in reversed(totals) for v in (0, t % 2))
        shape = (*x.shape[:-dims], *(s + t % 2 for s, t in zip(x.shape[-dims:], totals, strict=True)))
        out.append(_mk(f"{n.name}_pad", "constant_pad_nd", (src, pad, 0.0), shape, x.dtype))
        src = Ref(out[-1].name)
    groups = a[6] if a[6] is not None else 1
    args = (src, a[1], a[2], strides, tuple(t // 2 for t in totals), dil, groups)
    out.append(dataclasses.replace(n, args=args, kwargs=(), overload="default"))
    return out


def _linear_parts(name: str, x: Ref, w: Ref, b: object, shape: tuple, dt: str) -> list[Node]:
    """x @ w.T (+ b): the GEMM and its bias add, as linear layers are lowered."""
    mm = _mk(f"{name}_mm" if b is not None else name, "gemm_linear", (x, w), shape, dt)
    mm = dataclasses.replace(mm, target="aten.linear.default")
    return [mm] if b is None else [mm, _mk(name, "add", (Ref(mm.name), b), shape, dt, "Tensor")]


def _rnn_cell(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """nn.LSTMCell / nn.GRUCell, one step: the two gate GEMMs (input and hidden) with their biases, then the
    gates' element-wise math, which the GEMMs' epilogues and one ew region take. PyTorch's cell kernels are
    the same GEMMs and a fused point-wise kernel. Outputs (h, c) of an LSTM cell are named `<cell>__out0/1`
    for the getitems that take them apart."""
    a = [*n.args, *(None,) * 6][:6]
    lstm = n.op == "lstm_cell"
    x = by_name.get(a[0].name) if isinstance(a[0], Ref) else None
    state = a[1] if lstm else (a[1],)
    wih, whh, bih, bhh = a[2:6]
    if x is None or not x.shape or len(x.shape) != 2 or not isinstance(state, tuple):
        return None
    if not all(isinstance(r, Ref) and r.name in by_name for r in (*state, wih, whh)):
        return None
    h = by_name[state[0].name]
    dt = x.dtype or ""
    if dt not in ops.FLOAT_DTYPES or not h.shape or len(h.shape) != 2 or h.dtype != dt:
        return None
    rows, hid = h.shape
    g = 4 if lstm else 3
    name, out = n.name, []
    out += _linear_parts(f"{name}_gi", a[0], wih, bih, (rows, g * hid), dt)
    out += _linear_parts(f"{name}_gh", state[0], whh, bhh, (rows, g * hid), dt)
    gi, gh = Ref(f"{name}_gi"), Ref(f"{name}_gh")
    s = (rows, hid)

    def part(src: Ref, k: int, tag: str) -> Ref:
        out.append(_mk(f"{name}_{tag}", "slice", (src, 1, k * hid, (k + 1) * hid, 1), s, dt, "Tensor"))
        return Ref(out[-1].name)

    def op(tag: str, o: str, *args: object, ov: str = "default") -> Ref:
        out.append(_mk(f"{name}_{tag}", o, args, s, dt, ov))
        return Ref(out[-1].name)

    if lstm:  # i, f, g, o: c' = f * c + i * g, h' = o * tanh(c')
        gates = op("gates", "add", gi, gh, ov="Tensor")
        i, f, gg, o = (part(gates, k, t) for k, t in enumerate(("i", "f", "g", "o")))
        c2 = op("c2", "add", op("fc", "mul", op("sf", "sigmoid", f), state[1], ov="Tensor"),
                op("ig", "mul", op("si", "sigmoid", i), op("tg", "tanh", gg), ov="Tensor"), ov="Tensor")  # fmt: skip
        h2 = op("h2", "mul", op("so", "sigmoid", o), op("tc", "tanh", c2), ov="Tensor")
        out.append(_mk(f"{name}__out0", "alias", (h2,), s, dt))
        out.append(_mk(f"{name}__out1", "alias", (c2,), s, dt))
        return out
    # r, z, n: n = tanh(i_n + r * h_n), h' = n + z * (h - n) (ATen's form)
    r = op("r", "sigmoid", op("ar", "add", part(gi, 0, "ir"), part(gh, 0, "hr"), ov="Tensor"))
    z = op("z", "sigmoid", op("az", "add", part(gi, 1, "iz"), part(gh, 1, "hz"), ov="Tensor"))
    new = op("n", "tanh", op("an", "add", part(gi, 2, "in"), op("rn", "mul", r, part(gh, 2, "hn"), ov="Tensor"),
                               ov="Tensor"))  # fmt: skip
    step = op("zd", "mul", z, op("d", "sub", state[0], new, ov="Tensor"), ov="Tensor")
    out.append(_mk(name, "add", (new, step), s, dt, "Tensor"))
    return out


def _cast(name: str, src: Ref, shape: tuple, dt: str) -> Node:
    """src as dtype dt (aten._to_copy with its dtype keyword, as the export writes a cast)."""
    return dataclasses.replace(_mk(name, "_to_copy", (src,), shape, dt), kwargs=(("dtype", ("dtype", dt)),))


def _reduced_over(name: str, kind: str, src: Ref, dims: tuple[int, ...] | None, keep: bool, shape: tuple, dt: str,
                  scope: dict[str, Node]) -> list[Node]:  # fmt: skip
    """A reduction of src over dims (None: every element), split into one a run of adjacent dims; its last
    node is `name`. scope names the nodes whose shapes the split reads."""
    if dims is None:
        red = _mk(name, kind, (src,), shape, dt)
    else:
        red = _mk(name, kind, (src, dims, keep), shape, dt, _OVERLOAD.get(kind, "default"))
    return _split_reduction(red, scope) or [red]


def _one_hot(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """one_hot(t, C): each class index against the column of its row (a positional element-wise op, bool),
    then as int64: one element-wise region, fused with a cast to float after it. An index outside [0, C)
    gives a row of zeros where eager raises; C must be given (-1 reads the data)."""
    a = n.args
    t = by_name.get(a[0].name) if a and isinstance(a[0], Ref) else None
    classes = a[1] if len(a) > 1 else n.kw("num_classes", -1)
    if t is None or t.shape is None or t.dtype != "int64" or not isinstance(classes, int) or classes < 1:
        return None
    if classes >= 2**24 or len(t.shape) < 1 or n.shape != (*t.shape, classes):
        return None
    col = (*t.shape, 1)
    view = _mk(f"{n.name}_t", "reshape", (a[0], col), col, "int64")
    eq = _mk(f"{n.name}_eq", "one_hot_eq", (Ref(view.name),), n.shape, "bool")
    return [view, eq, _cast(n.name, Ref(eq.name), n.shape, "int64")]


def _prelu(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """prelu(x, w) as ATen computes it: x where x > 0, else w * x, w one value or one a channel (dim 1, or
    dim 0 of a 1-D input), seen as (C, 1, ...) against x."""
    a = n.args
    x, w = (by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:2])
    if x is None or w is None or not x.shape or w.shape is None or n.dtype not in ops.FLOAT_DTYPES:
        return None
    if x.dtype != n.dtype or w.dtype != n.dtype or len(w.shape) > 1:
        return None
    c = math.prod(w.shape)
    channel = 1 if len(x.shape) > 1 else 0
    if c not in (1, x.shape[channel]):
        return None
    name, shape, dt = n.name, x.shape, n.dtype
    view = (c, *(1,) * (len(shape) - channel - 1))
    out = [_mk(f"{name}_w", "reshape", (a[1], view), view, dt)]
    out.append(_mk(f"{name}_neg", "mul", (a[0], Ref(out[-1].name)), shape, dt, "Tensor"))
    out.append(_mk(f"{name}_pos", "gt", (a[0], 0.0), shape, "bool", "Scalar"))
    out.append(_mk(name, "where", (Ref(out[-1].name), a[0], Ref(out[-2].name)), shape, dt, "self"))
    return out


def _nanmean(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """nanmean: the sum of the values that are not NaN over their count (NaN where there are none)."""
    a = n.args
    x = by_name.get(a[0].name) if a and isinstance(a[0], Ref) else None
    if (
        x is None
        or x.shape is None
        or n.shape is None
        or n.dtype not in ops.FLOAT_DTYPES
        or x.dtype != n.dtype
    ):
        return None
    if n.kw("dtype") is not None:
        return None
    dims = ops._dims(ops._arg(n, 1, "dim", None))
    keep = bool(ops._arg(n, 2, "keepdim", False))
    name, shape, dt = n.name, x.shape, n.dtype
    nan = _mk(f"{name}_isnan", "isnan", (a[0],), shape, "bool")
    kept = _mk(f"{name}_kept", "where", (Ref(nan.name), 0.0, a[0]), shape, dt, "ScalarSelf")
    real = _mk(f"{name}_real", "logical_not", (Ref(nan.name),), shape, "bool")
    cast = _cast(f"{name}_one", Ref(real.name), shape, dt)
    out = [nan, kept, real, cast]
    for tag, src in (("sum", kept), ("count", cast)):
        out += _reduced_over(f"{name}_{tag}", "sum", Ref(src.name), dims, keep, n.shape, dt,
                             {**by_name, **{m.name: m for m in out}})  # fmt: skip
    return [*out, _mk(name, "div", (Ref(f"{name}_sum"), Ref(f"{name}_count")), n.shape, dt, "Tensor")]


def _addr(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """addr(z, x, y, beta, alpha): beta * z + alpha * (x outer y), a broadcast product and an add."""
    a = n.args
    refs = [by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:3]]
    if any(r is None or r.shape is None for r in refs) or n.shape is None or n.dtype not in ops.FLOAT_DTYPES:
        return None
    z, x, y = refs
    if len(x.shape) != 1 or len(y.shape) != 1 or n.shape != (x.shape[0], y.shape[0]):
        return None
    beta, alpha = n.kw("beta", 1), n.kw("alpha", 1)
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (beta, alpha)):
        return None
    name, dt, shape = n.name, n.dtype, n.shape
    col = _mk(f"{name}_col", "reshape", (a[1], (x.shape[0], 1)), (x.shape[0], 1), dt)
    row = _mk(f"{name}_row", "reshape", (a[2], (1, y.shape[0])), (1, y.shape[0]), dt)
    out = [col, row, _mk(f"{name}_outer", "mul", (Ref(col.name), Ref(row.name)), shape, dt, "Tensor")]
    if alpha != 1:
        out.append(_mk(f"{name}_alpha", "mul", (Ref(out[-1].name), alpha), shape, dt, "Tensor"))
    base: object = a[0]
    if beta == 0:  # eager ignores z (NaN in it too) when beta is 0
        return [*out[:-1], dataclasses.replace(out[-1], name=name)]
    if beta != 1:
        out.append(_mk(f"{name}_beta", "mul", (a[0], beta), z.shape, dt, "Tensor"))
        base = Ref(out[-1].name)
    return [*out, _mk(name, "add", (base, Ref(out[-2 if beta != 1 else -1].name)), shape, dt, "Tensor")]


def _bilinear(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """nn.Bilinear, y[b, o] = x1[b] . W[o] . x2[b] + bias[o], for (B, I) and (B, J) inputs: x1 times W seen
    as (I, O * J) in one GEMM (W's permuted copy made once by torch), then x2 times it summed over J (the
    product on the row reduction's loads), then the bias."""
    a = n.args
    refs = [by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:3]]
    if any(r is None or not r.shape for r in refs) or n.shape is None or n.dtype not in ops.FLOAT_DTYPES:
        return None
    x1, x2, w = refs
    if len(x1.shape) != 2 or len(x2.shape) != 2 or len(w.shape) != 3 or x1.shape[0] != x2.shape[0]:
        return None
    (rows, i), j, o = x1.shape, x2.shape[1], w.shape[0]
    if w.shape != (o, i, j) or {x1.dtype, x2.dtype, w.dtype} != {n.dtype}:
        return None
    name, dt = n.name, n.dtype
    wt = _mk(f"{name}_wt", "permute", (a[2], (1, 0, 2)), (i, o, j), dt)
    w2 = _mk(f"{name}_w2", "reshape", (Ref(wt.name), (i, o * j)), (i, o * j), dt)
    mm = dataclasses.replace(_mk(f"{name}_t", "gemm_mm", (a[0], Ref(w2.name)), (rows, o * j), dt),
                             target="aten.mm.default")  # fmt: skip
    t3 = _mk(f"{name}_t3", "reshape", (Ref(mm.name), (rows, o, j)), (rows, o, j), dt)
    v = _mk(f"{name}_x2", "reshape", (a[1], (rows, 1, j)), (rows, 1, j), dt)
    prod = _mk(f"{name}_prod", "mul", (Ref(t3.name), Ref(v.name)), (rows, o, j), dt, "Tensor")
    bias = a[3] if len(a) > 3 else None
    red = _mk(f"{name}_dot" if bias is not None else name, "sum", (Ref(prod.name), (-1,), False), (rows, o), dt,
              _OVERLOAD["sum"])  # fmt: skip
    out = [wt, w2, mm, t3, v, prod, red]
    if bias is not None:
        out.append(_mk(name, "add", (Ref(red.name), bias), (rows, o), dt, "Tensor"))
    return out


def _gevm(n: Node, v: object, m: object, by_name: dict[str, Node]) -> list[Node] | None:
    """A vector-matrix product (`matmul` of a (K,) or (1, K) vector by a (..., K, N) matrix, `mm` of a (1, K)
    one) as a column-wise dot product: v[:, None] * m summed over m's K dim, the product computed on the
    column reduction's loads, so m is read once where a GEMM tile would be one row high."""
    vs, ms = (by_name.get(r.name) if isinstance(r, Ref) else None for r in (v, m))
    if vs is None or ms is None or vs.shape is None or ms.shape is None or not n.shape or len(ms.shape) < 2:
        return None
    if not (n.dtype == vs.dtype == ms.dtype and n.dtype in ops.FLOAT_DTYPES):
        return None
    k, cols = ms.shape[-2:]
    row = vs.shape == (1, k) and len(ms.shape) == 2  # (1, K) @ (K, N) -> (1, N)
    if not (row or (vs.shape == (k,) and n.op == "matmul")) or k < 1:
        return None
    if n.shape != ((1, cols) if row else (*ms.shape[:-2], cols)):
        return None
    dt = n.dtype
    vec = _mk(f"{n.name}_vec", "reshape", (v, (k, 1)), (k, 1), dt)
    prod = _mk(f"{n.name}_prod", "mul", (Ref(vec.name), m), ms.shape, dt, "Tensor")
    dot = _mk(n.name, "sum", (Ref(prod.name), (-2,), row), n.shape, dt, _OVERLOAD["sum"])
    return [vec, prod, dataclasses.replace(dot, target=n.target)]


def _reduced(n: Node, value: Ref, reduction: object, dt: str) -> Node:
    """A loss's reduction: none (0: the value itself), mean (1) or sum (2) over every element."""
    if reduction == 0:
        return _mk(n.name, "alias", (value,), n.shape, dt)
    return _mk(n.name, "mean" if reduction == 1 else "sum", (value,), n.shape, dt)


def _smooth_l1(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """smooth_l1_loss and huber_loss as elementwise ops and one reduction, d = x - y: 0.5 d^2 / beta where
    |d| < beta, |d| - 0.5 beta elsewhere (|d| for beta = 0); Huber's is that times its delta."""
    a = n.args
    x = by_name.get(a[0].name) if isinstance(a[0], Ref) else None
    reduction = a[2] if len(a) > 2 else n.kw("reduction", 1)
    huber = n.op == "huber_loss"
    beta = float(a[3] if len(a) > 3 else n.kw("delta" if huber else "beta", 1.0))
    scale = beta if huber else 1.0
    if x is None or x.shape is None or n.dtype not in ops.FLOAT_DTYPES or reduction not in (0, 1, 2):
        return None
    shape, dt, name = x.shape, n.dtype, n.name
    d = _mk(f"{name}_d", "sub", (a[0], a[1]), shape, dt, "Tensor")
    ad = _mk(f"{name}_abs", "abs", (Ref(d.name),), shape, dt)
    out = [d, ad]
    if beta > 0:
        sq = _mk(f"{name}_sq", "mul", (Ref(d.name), Ref(d.name)), shape, dt, "Tensor")
        quad = _mk(f"{name}_quad", "mul", (Ref(sq.name), 0.5 * scale / beta), shape, dt, "Tensor")
        lin = _mk(f"{name}_lin", "sub", (Ref(ad.name), 0.5 * beta), shape, dt, "Tensor")
        small = _mk(f"{name}_small", "lt", (Ref(ad.name), beta), shape, "bool", "Scalar")
        out += [sq, quad, lin, small]
        if huber:
            lin = _mk(f"{name}_lin_delta", "mul", (Ref(lin.name), scale), shape, dt, "Tensor")
            out.append(lin)
        out.append(
            _mk(f"{name}_l", "where", (Ref(small.name), Ref(quad.name), Ref(lin.name)), shape, dt, "self")
        )
    else:
        out.append(_mk(f"{name}_l", "alias", (Ref(ad.name),), shape, dt))
    return [*out, _reduced(n, Ref(out[-1].name), reduction, dt)]


def _l1_mse(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """l1_loss and mse_loss: |x - y| or (x - y)^2, then the reduction."""
    a = n.args
    x = by_name.get(a[0].name) if isinstance(a[0], Ref) else None
    reduction = a[2] if len(a) > 2 else n.kw("reduction", 1)
    if x is None or x.shape is None or n.dtype not in ops.FLOAT_DTYPES or reduction not in (0, 1, 2):
        return None
    shape, dt, name = x.shape, n.dtype, n.name
    d = _mk(f"{name}_d", "sub", (a[0], a[1]), shape, dt, "Tensor")
    if n.op == "l1_loss":
        term = _mk(f"{name}_l", "abs", (Ref(d.name),), shape, dt)
    else:
        term = _mk(f"{name}_l", "mul", (Ref(d.name), Ref(d.name)), shape, dt, "Tensor")
    return [d, term, _reduced(n, Ref(term.name), reduction, dt)]


def _triplet(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """triplet_margin_loss (p = 1 or 2, no swap): max(margin + |a - p + eps|_p - |a - n + eps|_p, 0) per
    row (the norms over the last dim), then the reduction: elementwise ops and row sums. None (the node
    kept whole) where our one-pass kernel takes it (families/triplet.py)."""
    if not isinstance(fused_losses.triplet(n, by_name), str):
        return None
    a = n.args
    anchor = by_name.get(a[0].name) if isinstance(a[0], Ref) else None
    margin, p, eps, swap, reduction = fused_losses.triplet_args(n)
    if anchor is None or not anchor.shape or p not in (1.0, 2.0) or swap or reduction not in (0, 1, 2):
        return None
    if n.dtype not in ops.FLOAT_DTYPES:
        return None
    shape, dt, name = anchor.shape, n.dtype, n.name
    rows = shape[:-1]
    out: list[Node] = []
    dists = []
    for tag, other in (("pos", a[1]), ("neg", a[2])):
        diff = _mk(f"{name}_{tag}_diff", "sub", (a[0], other), shape, dt, "Tensor")
        de = _mk(f"{name}_{tag}_eps", "add", (Ref(diff.name), eps), shape, dt, "Tensor")
        if p == 2.0:
            term = _mk(f"{name}_{tag}_sq", "mul", (Ref(de.name), Ref(de.name)), shape, dt, "Tensor")
        else:
            term = _mk(f"{name}_{tag}_abs", "abs", (Ref(de.name),), shape, dt)
        total = _mk(f"{name}_{tag}_sum", "sum", (Ref(term.name), (-1,), False), rows, dt, _OVERLOAD["sum"])
        out += [diff, de, term, total]
        if p == 2.0:
            out.append(_mk(f"{name}_{tag}_dist", "sqrt", (Ref(total.name),), rows, dt))
        dists.append(Ref(out[-1].name))
    gap = _mk(f"{name}_gap", "sub", (dists[0], dists[1]), rows, dt, "Tensor")
    shifted = _mk(f"{name}_shift", "add", (Ref(gap.name), margin), rows, dt, "Tensor")
    hinge = _mk(f"{name}_hinge", "clamp_min", (Ref(shifted.name), 0.0), rows, dt)
    out += [gap, shifted, hinge]
    return [*out, _reduced(n, Ref(hinge.name), reduction, dt)]


def _norm_p(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """A vector norm of an order our reductions have no kind for (p = 3, 0.5, 0, -inf...): sum(|x|^p)^(1/p)
    with the power on the sum's loads and the root on its store; p = 0 counts the nonzeros, -inf is min |x|."""
    a = n.args
    x = by_name.get(a[0].name) if a and isinstance(a[0], Ref) else None
    order = ops._arg(n, 1, "ord", 2)
    if (
        x is None
        or x.shape is None
        or n.shape is None
        or n.dtype not in ops.FLOAT_DTYPES
        or x.dtype != n.dtype
    ):
        return None
    if not isinstance(order, int | float) or isinstance(order, bool) or n.kw("dtype") is not None:
        return None
    p = float(order)
    if p in (1.0, 2.0, math.inf):
        return None  # reductions of their own (norm1, norm2, norminf)
    dims = ops._dims(ops._arg(n, 2, "dim", None))
    keep = bool(ops._arg(n, 3, "keepdim", False))
    name, shape, dt = n.name, x.shape, n.dtype
    ax = _mk(f"{name}_abs", "abs", (a[0],), shape, dt)
    if p == -math.inf:
        term, kind = ax, "amin"
    elif p == 0:
        ne = _mk(f"{name}_nz", "ne", (a[0], 0.0), shape, "bool", "Scalar")
        term = _cast(f"{name}_cnt", Ref(ne.name), shape, dt)
        ax, kind = ne, "sum"
    else:
        term, kind = _mk(f"{name}_pow", "pow", (Ref(ax.name), p), shape, dt, "Tensor_Scalar"), "sum"
    out = [ax] if term is ax else [ax, term]
    total = f"{name}_total" if kind == "sum" and p != 0 else name
    out += _reduced_over(
        total, kind, Ref(term.name), dims, keep, n.shape, dt, {**by_name, **{m.name: m for m in out}}
    )
    if total != name:
        out.append(_mk(name, "pow", (Ref(total), 1.0 / p), n.shape, dt, "Tensor_Scalar"))
    return out


def _any_all(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """any / all (over every dim, a dim or dims) as the max / min of the values' truth as 0.0 or 1.0, an
    fp32 reduction with the test on its loads, then != 0: NaN counts as true, as in eager."""
    a = n.args
    x = by_name.get(a[0].name) if a and isinstance(a[0], Ref) else None
    if x is None or x.shape is None or n.shape is None or n.dtype != "bool":
        return None
    if x.dtype not in (*ops.FLOAT_DTYPES, "bool"):
        return None
    dims = None if n.overload == "default" else ops._dims(ops._arg(n, 1, "dim", None))
    if n.overload != "default" and not dims:
        return None
    keep = bool(ops._arg(n, 2, "keepdim", False))
    name = n.name
    out = _truth_as_float(name, a[0], x)
    kind = "amax" if n.op == "any" else "amin"
    out += _reduced_over(f"{name}_red", kind, Ref(out[-1].name), dims, keep, n.shape, "float32",
                         {**by_name, **{m.name: m for m in out}})  # fmt: skip
    return [*out, _mk(name, "ne", (Ref(f"{name}_red"), 0.0), n.shape, "bool", "Scalar")]


def _multi_margin(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """multi_margin_loss(x, y, p, margin) over (N, C) scores and (N,) int64 targets, no class weights: each
    row's sum over j != y of max(0, margin - x[y] + x[j])^p, over C; then the reduction. x[y] is the row's
    sum of x where its column is the target (one_hot_eq: a positional element-wise test)."""
    a = n.args
    x, t = (by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:2])
    p, margin, weight, reduction = [*a[2:6], *(None,) * 4][:4]
    p = n.kw("p", 1) if p is None else p
    margin = n.kw("margin", 1.0) if margin is None else margin
    weight = n.kw("weight", None) if weight is None else weight
    reduction = n.kw("reduction", 1) if reduction is None else reduction
    if x is None or t is None or x.shape is None or t.shape is None or len(x.shape) != 2:
        return None
    if x.dtype != "float32" or t.dtype != "int64" or t.shape != x.shape[:1] or weight is not None:
        return None
    if p not in (1, 2) or not isinstance(margin, (int, float)) or reduction not in (0, 1, 2):
        return None
    (rows, classes), name, dt = x.shape, n.name, "float32"
    if classes >= 2**24:
        return None
    st = _Steps(name, dt)
    col = st.add("t", "reshape", (a[1], (rows, 1)), (rows, 1), dtype="int64")
    eq = st.add("eq", "one_hot_eq", (col,), x.shape, dtype="bool")
    hot = st.node(_cast(f"{name}_hot", eq, x.shape, dt))
    picked = st.add("xy_each", "mul", (a[0], hot), x.shape, "Tensor")
    xy = st.add("xy", "sum", (picked, (1,), True), (rows, 1), _OVERLOAD["sum"])
    gap = st.add("gap", "sub", (a[0], xy), x.shape, "Tensor")
    shift = st.add("shift", "add", (gap, float(margin)), x.shape, "Scalar")
    hinge = st.add("hinge", "clamp_min", (shift, 0.0), x.shape)
    if p == 2:
        hinge = st.add("sq", "mul", (hinge, hinge), x.shape, "Tensor")
    other = st.add("other", "rsub", (hot, 1.0), x.shape, "Scalar")  # 1 - one-hot: j != y
    kept = st.add("kept", "mul", (hinge, other), x.shape, "Tensor")
    total = st.add("row", "sum", (kept, (1,), False), (rows,), _OVERLOAD["sum"])
    per = st.add("per", "div", (total, float(classes)), (rows,), "Scalar")
    return [*st.nodes, _reduced(n, per, reduction, dt)]


def _cdist(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """cdist(x1, x2) with p = 2 over (P, M) and (R, M) points (one batch dim or none), as PyTorch computes it
    past 25 points (or always, with use_mm_for_euclid_dist): sqrt(max(|a|^2 + |b|^2 - 2 a.b, 0)), the dot
    products one GEMM (ours: 3xTF32 in fp32), the squared norms row reductions.
    "donot_use_mm_for_euclid_dist" and other p stay PyTorch's."""
    a = n.args
    x1, x2 = (by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:2])
    p = float(ops._arg(n, 2, "p", 2.0))
    mode = ops._arg(n, 3, "compute_mode", None)
    if x1 is None or x2 is None or not x1.shape or not x2.shape or n.shape is None or p != 2.0:
        return None
    if mode not in (None, 0, 1) or {x1.dtype, x2.dtype, n.dtype} != {"float32"}:
        return None  # 1: use_mm_for_euclid_dist, 0: ..._if_necessary (None), 2: donot_use_mm
    nd = len(x1.shape)
    if (
        nd not in (2, 3)
        or len(x2.shape) != nd
        or x1.shape[:-2] != x2.shape[:-2]
        or x1.shape[-1] != x2.shape[-1]
    ):
        return None
    m, rows, dt, name = x1.shape[-1], x2.shape[-2], "float32", n.name
    if mode in (None, 0) and x1.shape[-2] <= 25 and rows <= 25:
        return None  # PyTorch takes the exact differences there, with no cancellation to match
    st = _Steps(name, dt)
    sq1 = st.add("sq1", "mul", (a[0], a[0]), x1.shape, "Tensor")
    n1 = st.add("n1", "sum", (sq1, (-1,), True), (*x1.shape[:-1], 1), _OVERLOAD["sum"])
    sq2 = st.add("sq2", "mul", (a[1], a[1]), x2.shape, "Tensor")
    n2 = st.add("n2", "sum", (sq2, (-1,), False), x2.shape[:-1], _OVERLOAD["sum"])
    n2r = st.add("n2r", "unsqueeze", (n2, nd - 2), (*x2.shape[:-2], 1, rows))
    x2t = st.add("x2t", "transpose", (a[1], -1, -2), (*x2.shape[:-2], m, rows), "int")
    gemm = "gemm_mm" if nd == 2 else "gemm_bmm"
    ab = st.node(dataclasses.replace(_mk(f"{name}_ab", gemm, (a[0], x2t), n.shape, dt),
                                     target="aten.mm.default" if nd == 2 else "aten.bmm.default"))  # fmt: skip
    s12 = st.add("s12", "add", (n1, n2r), n.shape, "Tensor")
    d2 = st.add("d2", "sub", (s12, ab), n.shape, "Tensor", alpha=2.0)  # |a|^2 + |b|^2 - 2 a.b
    pos = st.add("pos", "clamp_min", (d2, 0.0), n.shape)
    return [*st.nodes, _mk(name, "sqrt", (pos,), n.shape, dt)]


def _count_nonzero(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """count_nonzero (over every dim, a dim or dims) as the fp32 sum of x != 0 (NaN counts), stored as int64:
    exact while a reduction adds fewer than 2^24 ones."""
    a = n.args
    x = by_name.get(a[0].name) if a and isinstance(a[0], Ref) else None
    if x is None or x.shape is None or n.shape is None or n.dtype != "int64":
        return None
    if (
        x.dtype not in (*ops.FLOAT_DTYPES, "bool")
        or math.prod(x.shape) // max(1, math.prod(n.shape)) >= 1 << 24
    ):
        return None
    dims = ops._dims(ops._arg(n, 1, "dim", None))
    if n.overload != "default" and not dims:
        return None
    name = n.name
    out = _truth_as_float(name, a[0], x)
    red = _reduced_over(name, "sum", Ref(out[-1].name), dims, False, n.shape, "float32",
                        {**by_name, **{m.name: m for m in out}})  # fmt: skip
    last = max(i for i, m in enumerate(red) if m.op == "sum")  # a split's partials stay fp32; views follow
    return out + red[:last] + [dataclasses.replace(m, dtype="int64") for m in red[last:]]


def _pairwise(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """pairwise_distance(x1, x2, p, eps, keepdim) of same-shaped operands, p = 1, 2 or inf: the norm of
    x1 - x2 + eps over the last dim, a row reduction with the difference on its loads."""
    a = n.args
    x = by_name.get(a[0].name) if isinstance(a[0], Ref) else None
    y = by_name.get(a[1].name) if len(a) > 1 and isinstance(a[1], Ref) else None
    p, eps, keep = [*a[2:], *(None,) * 3][:3]
    p = 2.0 if p is None else float(p)
    eps = 1e-6 if eps is None else float(eps)
    if x is None or y is None or not x.shape or x.shape != y.shape or n.dtype not in ops.FLOAT_DTYPES:
        return None
    if p not in (1.0, 2.0, math.inf) or x.dtype != n.dtype or y.dtype != n.dtype:
        return None
    shape, dt, name = x.shape, n.dtype, n.name
    diff = _mk(f"{name}_diff", "sub", (a[0], a[1]), shape, dt, "Tensor")
    de = _mk(f"{name}_eps", "add", (Ref(diff.name), eps), shape, dt, "Tensor")
    norm = _mk(name, "linalg_vector_norm", (Ref(de.name), p, (-1,), bool(keep)), n.shape, dt)
    return [diff, de, dataclasses.replace(norm, target=n.target)]


def _cross(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """linalg_cross(x, y, dim) / cross(x, y, dim) of float operands of one rank, 3 long along dim (None: the
    first dim of size 3, as torch.cross without one): a stack of the three components, each x_i * y_j -
    x_j * y_i of selected views, the other dims broadcast. The elementwise producers then write their
    slices of the stack (sinking): one kernel a component, nothing copied."""
    a = n.args
    x, y = (by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:2])
    dim = a[2] if len(a) > 2 else n.kw("dim", -1 if n.op == "linalg_cross" else None)
    if x is None or y is None or not n.shape or x.shape is None or y.shape is None:
        return None
    nd = len(n.shape)
    if dim is None:
        dim = next((d for d, u in enumerate(x.shape) if u == 3), None)  # as ATen: the first of x's
    if not isinstance(dim, int) or not -nd <= dim < nd or len(x.shape) != nd or len(y.shape) != nd:
        return None
    d, dt = dim % nd, n.dtype
    if dt not in ops.FLOAT_DTYPES or x.dtype != dt or y.dtype != dt or x.shape[d] != 3 or y.shape[d] != 3:
        return None
    name, out = n.name, []
    parts = {}
    for tag, src, node in (("x", a[0], x), ("y", a[1], y)):
        shape = node.shape[:d] + node.shape[d + 1 :]
        for i in range(3):
            part = _mk(f"{name}_{tag}{i}", "select", (src, d, i), shape, dt, "int")
            out.append(part)
            parts[tag, i] = Ref(part.name)
    rows = n.shape[:d] + n.shape[d + 1 :]
    comps = []
    for k, (i, j) in enumerate(((1, 2), (2, 0), (0, 1))):
        left = _mk(f"{name}_c{k}a", "mul", (parts["x", i], parts["y", j]), rows, dt, "Tensor")
        right = _mk(f"{name}_c{k}b", "mul", (parts["x", j], parts["y", i]), rows, dt, "Tensor")
        comp = _mk(f"{name}_c{k}", "sub", (Ref(left.name), Ref(right.name)), rows, dt, "Tensor")
        out += [left, right, comp]
        comps.append(Ref(comp.name))
    stack = _mk(name, "stack", (tuple(comps), d), n.shape, dt)
    return [*out, dataclasses.replace(stack, target=n.target)]


def _diag_embed(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """diag_embed(x) (offset 0, the last two dims) and diag(v) of a vector (diagonal 0): x[..., j] broadcast
    over the rows, kept where i == j by triu and tril of offset 0, positional elementwise ops of one kernel
    that writes the zeros too (reading x, and a constant of its column's shape it never reads)."""
    a = n.args
    x = by_name.get(a[0].name) if a and isinstance(a[0], Ref) else None
    if x is None or x.shape is None or not n.shape or n.dtype not in ops.FLOAT_DTYPES or x.dtype != n.dtype:
        return None
    if n.op == "diag":
        if len(x.shape) != 1 or (a[1] if len(a) > 1 else n.kw("diagonal", 0)) != 0:
            return None
    elif [*a[1:], *(None,) * 3][:3] not in (
        [None] * 3,
        [0, None, None],
        [0, -2, None],
        [0, -2, -1],
    ) or n.kwargs:
        return None
    size = x.shape[-1]
    if n.shape != (*x.shape, size):
        return None
    name, dt = n.name, n.dtype
    # x as a row times ones as a column: the broadcast happens in the kernel (a row operand read by its
    # column index), where an expanded view would be gathered into an n x n copy first; x * 1 keeps -0.0
    row = _mk(f"{name}_row", "unsqueeze", (a[0], -2), (*x.shape[:-1], 1, size), dt)
    col = _mk(f"{name}_col", "unsqueeze", (a[0], -1), (*x.shape, 1), dt)
    ones = _mk(f"{name}_ones", "ones_like", (Ref(col.name),), col.shape, dt)
    full = _mk(f"{name}_full", "mul", (Ref(row.name), Ref(ones.name)), n.shape, dt, "Tensor")
    upper = _mk(f"{name}_upper", "triu", (Ref(full.name), 0), n.shape, dt)
    diag = dataclasses.replace(_mk(name, "tril", (Ref(upper.name), 0), n.shape, dt), target=n.target)
    return [row, col, ones, full, upper, diag]


def _channel_shuffle(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """channel_shuffle(x, g) (ShuffleNet's): x (N, C, ...) seen as (N, g, C / g, ...), the two group dims
    swapped, read back as (N, C, ...): views, the last one gathered by our own copy kernel."""
    a = n.args
    x = by_name.get(a[0].name) if a and isinstance(a[0], Ref) else None
    g = a[1] if len(a) > 1 else n.kw("groups")
    if x is None or x.shape is None or len(x.shape) < 2 or not isinstance(g, int) or g < 1:
        return None
    batch, c, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    if c % g or n.shape != x.shape:
        return None
    name, dt = n.name, n.dtype
    split = _mk(f"{name}_groups", "reshape", (a[0], (batch, g, c // g, *rest)), (batch, g, c // g, *rest), dt)
    swapped = _mk(
        f"{name}_swapped", "transpose", (Ref(split.name), 1, 2), (batch, c // g, g, *rest), dt, "int"
    )
    back = _mk(name, "reshape", (Ref(swapped.name), x.shape), x.shape, dt)
    return [split, swapped, dataclasses.replace(back, target=n.target)]


def _take_along(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """take_along_dim(x, idx, dim) of operands of one rank: both expanded to their broadcast shape but along
    dim, then a gather (the movement family's). The flat form (dim None) is left as it is."""
    a = n.args
    x, idx = (by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:2])
    dim = a[2] if len(a) > 2 else n.kw("dim")
    if x is None or idx is None or x.shape is None or idx.shape is None or not isinstance(dim, int):
        return None
    nd = len(x.shape)
    if not nd or len(idx.shape) != nd or idx.dtype != "int64" or n.shape is None:
        return None
    d = dim % nd
    both = []
    for k, (u, v) in enumerate(zip(x.shape, idx.shape, strict=True)):
        if k != d and u != v and 1 not in (u, v):
            return None
        both.append(max(u, v))
    xs, ids = (*both[:d], x.shape[d], *both[d + 1 :]), (*both[:d], idx.shape[d], *both[d + 1 :])
    if ids != n.shape:
        return None
    out, src, ind = [], a[0], a[1]
    if xs != x.shape:
        out.append(_mk(f"{n.name}_x", "expand", (src, xs), xs, x.dtype))
        src = Ref(out[-1].name)
    if ids != idx.shape:
        out.append(_mk(f"{n.name}_i", "expand", (ind, ids), ids, idx.dtype))
        ind = Ref(out[-1].name)
    return [
        *out,
        dataclasses.replace(_mk(n.name, "gather", (src, d, ind), n.shape, n.dtype), target=n.target),
    ]


def _cosine(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """cosine_similarity(x1, x2, dim, eps) of two same-shaped tensors: the dot product over the norms, each
    norm at least eps (ATen divides each operand by its clamped norm before the sum: the same value up to
    rounding). Three sums over the dim, each with its product on its loads. None (the node kept whole) where
    our one-pass kernel takes it (families/cosine.py: over the last dim)."""
    if not isinstance(fused_losses.cosine(n, by_name), str):
        return None
    a = n.args
    x1, x2 = (by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:2])
    dim, eps = fused_losses.cosine_args(n)
    if x1 is None or x2 is None or not x1.shape or x1.shape != x2.shape or not isinstance(dim, int):
        return None
    dt, shape, name = n.dtype, x1.shape, n.name
    # fp32 only: in 16 bits the three sums would be rounded to 16 bits between kernels, where ATen's norms
    # accumulate and divide before any rounding.
    if dt != "float32" or x1.dtype != dt or x2.dtype != dt or not -len(shape) <= dim < len(shape):
        return None
    d = dim % len(shape)
    rows = shape[:d] + shape[d + 1 :]
    out: list[Node] = []
    sums = []
    for tag, u, v in (("dot", a[0], a[1]), ("sq1", a[0], a[0]), ("sq2", a[1], a[1])):
        prod = _mk(f"{name}_{tag}_prod", "mul", (u, v), shape, dt, "Tensor")
        total = _mk(f"{name}_{tag}", "sum", (Ref(prod.name), (d,), False), rows, dt, _OVERLOAD["sum"])
        out += [prod, total]
        sums.append(Ref(total.name))
    norms = []
    for k in (1, 2):
        root = _mk(f"{name}_norm{k}", "sqrt", (sums[k],), rows, dt)
        floor = _mk(f"{name}_clamped{k}", "clamp_min", (Ref(root.name), eps), rows, dt)
        out += [root, floor]
        norms.append(Ref(floor.name))
    den = _mk(f"{name}_den", "mul", (norms[0], norms[1]), rows, dt, "Tensor")
    cos = dataclasses.replace(_mk(name, "div", (sums[0], Ref(den.name)), rows, dt, "Tensor"), target=n.target)
    return [*out, den, cos]


def _kl_div(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """kl_div(input, target) as elementwise ops and one reduction, as ATen defines it: xlogy(t, t) - t * x
    (0 where t == 0, NaN where t < 0), or exp(t) * (t - x) for a log target. F.kl_div's batchmean is
    already a sum and a division in the graph."""
    a = n.args
    x, t = (by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:2])
    reduction = a[2] if len(a) > 2 else n.kw("reduction", 1)
    log_target = bool(a[3] if len(a) > 3 else n.kw("log_target", False))
    if x is None or t is None or x.shape is None or t.shape is None or reduction not in (0, 1, 2):
        return None
    shape = broadcast(x.shape, t.shape)
    dt, name = n.dtype, n.name
    if shape is None or dt not in ops.FLOAT_DTYPES or x.dtype != dt or t.dtype != dt:
        return None
    if log_target:
        e = _mk(f"{name}_exp", "exp", (a[1],), t.shape, dt)
        d = _mk(f"{name}_d", "sub", (a[1], a[0]), shape, dt, "Tensor")
        out = [e, d, _mk(f"{name}_l", "mul", (Ref(e.name), Ref(d.name)), shape, dt, "Tensor")]
    else:
        lg = _mk(f"{name}_log", "log", (a[1],), t.shape, dt)
        tl = _mk(f"{name}_tlog", "mul", (a[1], Ref(lg.name)), t.shape, dt, "Tensor")
        zero = _mk(f"{name}_zero", "eq", (a[1], 0.0), t.shape, "bool", "Scalar")
        xlogy = _mk(f"{name}_xlogy", "where", (Ref(zero.name), 0.0, Ref(tl.name)), t.shape, dt, "ScalarSelf")
        tx = _mk(f"{name}_tx", "mul", (a[1], a[0]), shape, dt, "Tensor")
        loss = _mk(f"{name}_l", "sub", (Ref(xlogy.name), Ref(tx.name)), shape, dt, "Tensor")
        out = [lg, tl, zero, xlogy, tx, loss]
    return [*out, _reduced(n, Ref(out[-1].name), reduction, dt)]


class _Chain:
    """Element-wise nodes of one shape and dtype, named after the node they lower (a loss's steps)."""

    def __init__(self, name: str, shape: tuple, dt: str):
        self.name, self.shape, self.dt, self.nodes = name, shape, dt, []

    def __call__(
        self, tag: str, op: str, *args: object, overload: str = "default", shape=None, dt=None
    ) -> Ref:
        self.nodes.append(_mk(f"{self.name}_{tag}", op, args, shape or self.shape, dt or self.dt, overload))
        return Ref(self.nodes[-1].name)


def _bce(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """binary_cross_entropy(p, t, weight, reduction) as ATen computes it: (t - 1) * max(log1p(-p), -100)
    - t * max(log(p), -100), times the weight, then the reduction."""
    a = [*n.args, None, None][:4]
    p, t = (by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:2])
    reduction = a[3] if a[3] is not None else n.kw("reduction", 1)
    weight = a[2] if a[2] is not None else n.kw("weight", None)
    if p is None or t is None or not p.shape or p.shape != t.shape or reduction not in (0, 1, 2):
        return None
    if n.dtype not in ops.FLOAT_DTYPES or p.dtype != n.dtype or t.dtype != n.dtype:
        return None
    c = _Chain(n.name, p.shape, n.dtype)
    lo = c("lo", "clamp_min", c("log1m", "log1p", c("negp", "neg", a[0])), -100.0)
    lp = c("lp", "clamp_min", c("log", "log", a[0]), -100.0)
    loss = c("l", "sub", c("a", "mul", c("tm1", "sub", a[1], 1.0, overload="Tensor"), lo, overload="Tensor"),
             c("b", "mul", a[1], lp, overload="Tensor"), overload="Tensor")  # fmt: skip
    if isinstance(weight, Ref):
        loss = c("w", "mul", loss, weight, overload="Tensor")
    return [*c.nodes, _reduced(n, loss, reduction, n.dtype)]


def _embedding_losses(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """hinge_embedding_loss(x, t, margin) and cosine_embedding_loss(x1, x2, t, margin) as ATen writes them:
    the hinge is x where t != -1 plus max(margin - x, 0) where t != 1; the cosine one 1 - cos where t == 1
    and max(cos - margin, 0) where t == -1, cos = x1.x2 / sqrt((|x1|^2 + 1e-12)(|x2|^2 + 1e-12)) over the
    last dim. Targets of either sign convention compare as numbers (int64 ones read exactly)."""
    cosine = n.op == "cosine_embedding_loss"
    k = 3 if cosine else 2
    a = [*n.args, None, None][: k + 2]
    ins = [by_name.get(r.name) if isinstance(r, Ref) else None for r in a[:k]]
    margin = a[k] if a[k] is not None else n.kw("margin", 0.0 if cosine else 1.0)
    reduction = a[k + 1] if a[k + 1] is not None else n.kw("reduction", 1)
    if any(x is None or x.shape is None for x in ins) or reduction not in (0, 1, 2):
        return None
    x, t = ins[0], ins[-1]
    if n.dtype not in ops.FLOAT_DTYPES or x.dtype != n.dtype or not isinstance(margin, int | float):
        return None
    if t.dtype not in (*ops.FLOAT_DTYPES, "int64", "int32"):
        return None
    dt = n.dtype
    if not cosine:
        if x.shape != t.shape:
            return None
        c = _Chain(n.name, x.shape, dt)
        clamp = c("clamp", "clamp_min", c("m", "rsub", a[0], float(margin), overload="Scalar"), 0.0)
        not1 = c("not1", "ne", a[1], 1.0, overload="Scalar", dt="bool")
        notm1 = c("notm1", "ne", a[1], -1.0, overload="Scalar", dt="bool")
        loss = c("l", "add", c("om", "where", not1, clamp, 0.0, overload="ScalarOther"),
                 c("os", "where", notm1, a[0], 0.0, overload="ScalarOther"), overload="Tensor")  # fmt: skip
        return [*c.nodes, _reduced(n, loss, reduction, dt)]
    y = ins[1]
    if y.dtype != dt or x.shape != y.shape or not x.shape or t.shape != x.shape[:-1]:
        return None
    rows = x.shape[:-1]
    c = _Chain(n.name, x.shape, dt)

    def dot(tag: str, u: object, v: object) -> Ref:
        prod = c(f"{tag}_p", "mul", u, v, overload="Tensor")
        return c(tag, "sum", prod, (-1,), False, overload=_OVERLOAD["sum"], shape=rows)

    ps = dot("dot", a[0], a[1])
    m1 = c("m1", "add", dot("s1", a[0], a[0]), 1e-12, overload="Tensor", shape=rows)
    m2 = c("m2", "add", dot("s2", a[1], a[1]), 1e-12, overload="Tensor", shape=rows)
    cos = c("cos", "div", ps, c("den", "sqrt", c("mm", "mul", m1, m2, overload="Tensor", shape=rows), shape=rows),
            overload="Tensor", shape=rows)  # fmt: skip
    pos = c("pos", "rsub", cos, 1.0, overload="Scalar", shape=rows)
    neg = c(
        "neg", "clamp_min", c("cm", "sub", cos, float(margin), overload="Tensor", shape=rows), 0.0, shape=rows
    )
    is1 = c("is1", "eq", a[2], 1.0, overload="Scalar", shape=rows, dt="bool")
    ism1 = c("ism1", "eq", a[2], -1.0, overload="Scalar", shape=rows, dt="bool")
    loss = c("l", "add", c("op", "where", is1, pos, 0.0, overload="ScalarOther", shape=rows),
             c("on", "where", ism1, neg, 0.0, overload="ScalarOther", shape=rows), overload="Tensor",
             shape=rows)  # fmt: skip
    return [*c.nodes, _reduced(n, loss, reduction, dt)]


def _einsum(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """A two-operand einsum that is a product: one contracted index, the last of the first operand and the
    first of a 2-D second ("bijl,lk->bijk": a matmul) or the middle of a 3-D one with the same batch index
    ("bij,bjk->bik": a bmm), the output its free indices in order."""
    eq, operands = n.args[0], n.args[1] if len(n.args) > 1 else ()
    if not isinstance(eq, str) or "->" not in eq or "." in eq or len(operands) != 2:
        return None
    ins, out = eq.replace(" ", "").split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    x, y = parts
    shared = set(x) & set(y)
    if len(set(x)) != len(x) or len(set(y)) != len(y) or not x or not y:
        return None
    if len(y) == 2 and shared == {x[-1]} and y[0] == x[-1] and out == x[:-1] + y[1]:
        return [dataclasses.replace(_mk(n.name, "gemm_matmul", operands, n.shape, n.dtype), target=n.target)]
    if (len(x) == len(y) == 3 and x[0] == y[0] and x[2] == y[1] and shared == {x[0], x[2]}
            and out == x[0] + x[1] + y[2]):  # fmt: skip
        return [dataclasses.replace(_mk(n.name, "gemm_bmm", operands, n.shape, n.dtype), target=n.target)]
    return None


def _trailing_keepdim(red: ops.Reduction | None, xs: Node, kinds: tuple[str, ...]) -> tuple[int, ...] | None:
    """The trailing shape of xs a keepdim reduction of one of `kinds` reduces, or None."""
    if red is None or red.kind not in kinds or not red.keepdim or red.dims is None or not xs.shape:
        return None
    nd = len(xs.shape)
    dims = sorted({d % nd for d in red.dims})
    return tuple(xs.shape[nd - len(dims) :]) if dims == list(range(nd - len(dims), nd)) else None


def _middle_keepdim(red: ops.Reduction | None, xs: Node) -> int | None:
    """The one dim, not the last, that a keepdim mean reduces (an RMS norm over channels), or None."""
    if red is None or red.kind != "mean" or not red.keepdim or red.dims is None or not xs.shape:
        return None
    nd = len(xs.shape)
    dims = {d % nd for d in red.dims}
    return dims.pop() if len(dims) == 1 and max(dims) != nd - 1 else None


def _squares(sq: Node | None, x: Ref) -> bool:
    return sq is not None and (
        (sq.op == "pow" and sq.args[1:] == (2,) and sq.args[0] == x)
        or (sq.op == "mul" and sq.args == (x, x))
        or (sq.op == "square" and sq.args[:1] == (x,))
    )


def _same_float(*nodes: Node) -> bool:
    return len({m.dtype for m in nodes}) == 1 and nodes[0].dtype in ops.FLOAT_DTYPES


def _rms_norm_by_hand(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """`x * rsqrt(mean(x^2, trailing dims, keepdim) + eps)`, or `x / sqrt(...)`, as models write RMSNorm by
    hand (Llama's): one rms_norm over those dims (one rms_col over a single dim that is not the last: the
    channels, KernelBench's RMSNorm), so the norm family reads each row once, where a reduction
    and then an element-wise pass read it twice. A weight multiplied after it stays an element-wise
    neighbour the norm takes on its stores. The square may be pow(x, 2), x * x or square(x); all of one
    float dtype. The reduction's own nodes fall to dead code when nothing else reads them."""
    if n.op not in ("mul", "div") or len(n.args) != 2 or n.kwargs or n.shape is None:
        return None
    pairs = ((n.args[0], n.args[1]), (n.args[1], n.args[0])) if n.op == "mul" else ((n.args[0], n.args[1]),)
    for x, s in pairs:
        xs, root = (by_name.get(v.name) if isinstance(v, Ref) else None for v in (x, s))
        if xs is None or root is None or xs.shape != n.shape or not isinstance(x, Ref):
            continue
        if root.op != ("rsqrt" if n.op == "mul" else "sqrt") or not isinstance(root.args[0], Ref):
            continue
        add = by_name.get(root.args[0].name)
        if add is None or add.op != "add" or len(add.args) != 2 or add.kwargs:
            continue
        m, eps = add.args if isinstance(add.args[0], Ref) else add.args[::-1]
        mean = by_name.get(m.name) if isinstance(m, Ref) else None
        if mean is None or isinstance(eps, (Ref, bool)) or not isinstance(eps, (int, float)) or eps < 0:
            continue
        red = ops.reduction_of(mean)
        shape = _trailing_keepdim(red, xs, ("mean",))
        col = _middle_keepdim(red, xs) if shape is None else None
        sq = by_name.get(mean.args[0].name) if isinstance(mean.args[0], Ref) else None
        if (
            (shape is None and col is None)
            or not _squares(sq, x)
            or not _same_float(n, xs, sq, mean, add, root)
        ):
            continue
        if col is not None:  # over one dim that is not the last (the channels): the column family's
            return [
                _mk(n.name, "rms_col", (x, col, float(eps), n.op), n.shape, n.dtype)
            ]  # x / rms or x * 1/rms
        return [_mk(n.name, "rms_norm", (x, shape, None, float(eps)), n.shape, n.dtype)]
    return None


def _normalize_by_hand(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """`x / ||x||` over trailing dims with keepdim, as written by hand: the 2-norm (`norm(x, 2)` or
    `sqrt(sum(x^2))`) is an rms_norm without eps scaled by 1/sqrt(count); the 1-norm (`norm(x, 1)`,
    `sum(|x|)`, or `mean(|x|)` scaled by count) is an l1_norm. Either way a row op that reads the row once
    and, where it does not stay on chip, a second time from L2, with the scale on its stores; the norm and
    the division read it from DRAM each. A row of zeros gives NaN both ways."""
    if n.op != "div" or len(n.args) != 2 or n.kwargs or n.shape is None:
        return None
    x, d = n.args
    xs, den = (by_name.get(v.name) if isinstance(v, Ref) else None for v in (x, d))
    if xs is None or den is None or xs.shape != n.shape or not isinstance(x, Ref):
        return None
    shape, op, inner = None, "", [den]
    if den.op == "linalg_vector_norm" and den.args[:1] == (x,):
        red = ops.reduction_of(den)
        shape, op = _trailing_keepdim(red, xs, ("norm1", "norm2")), red.kind if red else ""
    elif den.args and isinstance(den.args[0], Ref) and (inside := by_name.get(den.args[0].name)) is not None:
        elem = by_name.get(inside.args[0].name) if inside.args and isinstance(inside.args[0], Ref) else None
        if den.op == "sqrt" and _squares(elem, x):  # sqrt(sum(x^2))
            shape, op = _trailing_keepdim(ops.reduction_of(inside), xs, ("sum",)), "norm2"
            inner += [inside, elem]
        elif den.op in ("sum", "mean") and inside.op == "abs" and inside.args[:1] == (x,):  # sum(|x|)
            shape, op = _trailing_keepdim(ops.reduction_of(den), xs, (den.op,)), f"l1_{den.op}"
            inner.append(inside)
    if shape is None or not _same_float(n, xs, *inner):
        return None
    count = math.prod(shape)
    if op == "norm2":
        row = _mk(f"{n.name}_rms", "rms_norm", (x, shape, None, 0.0), n.shape, n.dtype)
        scale = 1.0 / math.sqrt(count)
    else:
        row = _mk(f"{n.name}_l1", "l1_norm", (x, shape), n.shape, n.dtype)
        scale = float(count) if op == "l1_mean" else 1.0
    if scale == 1.0:
        return [dataclasses.replace(row, name=n.name)]
    return [row, _mk(n.name, "mul", (Ref(row.name), scale), n.shape, n.dtype, "Tensor")]


def _normalize_clamped(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """F.normalize over trailing dims: `x / clamp_min(||x||_2 (keepdim), eps)` (the divisor maybe expanded
    back to x's shape), one l2_normalize: a row op that reads the row once, and where it does not stay on
    chip once more from L2, where the norm and the division read it from DRAM each and launch twice. A NaN
    norm stays NaN (the kernel's max propagates it, as clamp_min does); a row of zeros gives zeros."""
    if n.op != "div" or len(n.args) != 2 or n.kwargs or n.shape is None:
        return None
    x, d = n.args
    xs = by_name.get(x.name) if isinstance(x, Ref) else None
    den = by_name.get(d.name) if isinstance(d, Ref) else None
    if xs is None or den is None or xs.shape != n.shape:
        return None
    inner = [den]
    if den.op in ("expand", "expand_as") and isinstance(den.args[0], Ref):
        den = by_name.get(den.args[0].name)
        inner.append(den)
    if den is None or den.op != "clamp_min" or len(den.args) != 2 or not isinstance(den.args[0], Ref):
        return None
    eps, norm = den.args[1], by_name.get(den.args[0].name)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or norm is None:
        return None
    if norm.op != "linalg_vector_norm" or norm.args[:1] != (x,):
        return None
    shape = _trailing_keepdim(ops.reduction_of(norm), xs, ("norm2",))
    if shape is None or not _same_float(n, xs, norm, *inner):
        return None
    return [_mk(n.name, "l2_normalize", (x, shape, float(eps)), n.shape, n.dtype)]


def _lower_node(n: Node, by_name: dict[str, Node]) -> list[Node]:
    a = n.args
    if (view := _as_permute(n, by_name)) is not None:
        return [view]
    if n.op == "trace" and n.shape == () and isinstance(a[0], Ref):  # the diagonal's sum
        src = by_name.get(a[0].name)
        if src is not None and src.shape is not None and len(src.shape) == 2:
            diag = _mk(f"{n.name}_diag", "diagonal", (a[0], 0, 0, 1), (min(src.shape),), n.dtype)
            return [
                diag,
                dataclasses.replace(_mk(n.name, "sum", (Ref(diag.name),), (), n.dtype), target=n.target),
            ]
    if n.op in ("mul", "div") and (
        rms := _rms_norm_by_hand(n, by_name)
        or _normalize_by_hand(n, by_name)
        or _normalize_clamped(n, by_name)
    ):
        return rms
    if n.op == "einsum" and n.shape is not None and (lowered := _einsum(n, by_name)):
        return lowered
    if n.op == "_grouped_mm" and len(a) == 3 and not n.kwargs:  # (M, K) x (E, K, N), rows grouped by offsets
        return [dataclasses.replace(_mk(n.name, "gemm_grouped", a, n.shape, n.dtype), target=n.target)]
    if n.op == "expand_as" and len(a) == 2 and isinstance(a[0], Ref) and n.shape is not None:
        return [_mk(n.name, "expand", (a[0], n.shape), n.shape, n.dtype)]  # a view (F.normalize's divisor)
    if n.op == "broadcast_tensors":
        return []  # a tuple its getitems take apart: each becomes an expand of its own operand
    if n.op in ("var_mean", "std_mean") and n.overload in ("dim", "correction"):
        return []  # a pair its getitems take apart: each becomes a reduction of its own
    if n.op in ("cummax", "cummin") and n.overload == "default":
        return []  # a pair its getitems take apart: each becomes a scan of its own (ops.KEYED_SCANS)
    if n.op == "getitem" and isinstance(a[0], Ref) and f"{a[0].name}__out{a[1]}" in by_name:  # a lowered cell
        return [_mk(n.name, "alias", (Ref(f"{a[0].name}__out{a[1]}"),), n.shape, n.dtype)]
    if n.op in ("lstm_cell", "gru_cell") and (cell := _rnn_cell(n, by_name)):
        return cell
    if n.op == "one_hot" and (lowered := _one_hot(n, by_name)):
        return lowered
    if n.op == "prelu" and (lowered := _prelu(n, by_name)):
        return lowered
    if n.op == "nanmean" and (lowered := _nanmean(n, by_name)):
        return lowered
    if n.op == "addr" and (lowered := _addr(n, by_name)):
        return lowered
    if n.op == "bilinear" and (lowered := _bilinear(n, by_name)):
        return lowered
    if n.op == "getitem" and isinstance(a[0], Ref) and n.shape is not None:
        src = by_name.get(a[0].name)
        if src is not None and src.op == "broadcast_tensors":
            operand = src.args[0][int(a[1])]
            return [_mk(n.name, "expand", (operand, n.shape), n.shape, n.dtype)]
        if src is not None and src.op in ("cummax", "cummin") and src.overload == "default":
            op = src.op if int(a[1]) == 0 else f"{src.op}_index"
            return [dataclasses.replace(src, name=n.name, op=op, shape=n.shape, dtype=n.dtype)]
        if src is not None and src.op in ("var_mean", "std_mean") and src.overload in ("dim", "correction"):
            if int(a[1]) == 0:  # the spread: var.dim / var.correction of the same arguments
                spread = src.op.removesuffix("_mean")
                return [dataclasses.replace(src, name=n.name, op=spread, shape=n.shape, dtype=n.dtype)]
            dims = ops._arg(src, 1, "dim", None)
            keep = ops._arg(src, 3, "keepdim", False) if src.overload == "dim" else src.kw("keepdim", False)
            return [_mk(n.name, "mean", (src.args[0], dims, bool(keep)), n.shape, n.dtype, "dim")]
    if (
        n.op in ("smooth_l1_loss", "huber_loss")
        and n.shape is not None
        and (lowered := _smooth_l1(n, by_name))
    ):
        return lowered
    if n.op in ("l1_loss", "mse_loss") and n.shape is not None and (lowered := _l1_mse(n, by_name)):
        return lowered
    if n.op == "linalg_vector_norm" and (lowered := _norm_p(n, by_name)):
        return lowered
    if n.op == "multi_margin_loss" and (lowered := _multi_margin(n, by_name)):
        return lowered
    if n.op == "cdist" and (lowered := _cdist(n, by_name)):
        return lowered
    if n.op == "count_nonzero" and (lowered := _count_nonzero(n, by_name)):
        return lowered
    if n.op in ("any", "all") and (lowered := _any_all(n, by_name)):
        return lowered
    if n.op == "pairwise_distance" and n.shape is not None and (lowered := _pairwise(n, by_name)):
        return lowered
    if n.op == "triplet_margin_loss" and n.shape is not None and (lowered := _triplet(n, by_name)):
        return lowered
    if n.op == "kl_div" and n.shape is not None and (lowered := _kl_div(n, by_name)):
        return lowered
    if n.op == "binary_cross_entropy" and (lowered := _bce(n, by_name)):
        return lowered
    if n.op in ("hinge_embedding_loss", "cosine_embedding_loss") and (
        lowered := _embedding_losses(n, by_name)
    ):
        return lowered
    if n.op in ("channel_shuffle", "native_channel_shuffle") and (lowered := _channel_shuffle(n, by_name)):
        return lowered
    if n.op == "take_along_dim" and (lowered := _take_along(n, by_name)):
        return lowered
    if n.op in ("diag_embed", "diag") and (lowered := _diag_embed(n, by_name)):
        return lowered
    if n.op in ("linalg_cross", "cross") and (lowered := _cross(n, by_name)):
        return lowered
    if n.op == "cosine_similarity" and n.shape is not None and (lowered := _cosine(n, by_name)):
        return lowered
    if n.op == "linear" and (gemv := _gemv(n, a[0], a[1], by_name, a[2] if len(a) > 2 else n.kw("bias"))):
        return gemv
    if n.op in ("mm", "matmul", "mv") and (
        gemv := _gemv(n, a[0], a[1], by_name) or _gevm(n, a[0], a[1], by_name)
    ):
        return gemv
    if n.op in ("mm", "matmul", "bmm") and (outer := _outer(n, by_name)):
        return outer
    if n.op == "matmul" and (batched := _broadcast_matmul(n, by_name)):
        return batched
    if n.op == "linear":
        mm = dataclasses.replace(
            _mk(f"{n.name}_mm", "gemm_linear", (a[0], a[1]), n.shape, n.dtype), target=n.target
        )
        bias = a[2] if len(a) > 2 else n.kw("bias")
        if bias is None:
            return [dataclasses.replace(mm, name=n.name)]
        return [mm, _mk(n.name, "add", (Ref(mm.name), bias), n.shape, n.dtype, "Tensor")]
    if n.op in ("addmm", "baddbmm"):
        kind = "gemm_mm" if n.op == "addmm" else "gemm_bmm"
        mm = dataclasses.replace(_mk(f"{n.name}_mm", kind, (a[1], a[2]), n.shape, n.dtype), target=n.target)
        beta, alpha = n.kw("beta", 1), n.kw("alpha", 1)
        out = [mm]
        prod = Ref(mm.name)
        if alpha != 1:
            out.append(_mk(f"{n.name}_alpha", "mul", (prod, alpha), n.shape, n.dtype, "Tensor"))
            prod = Ref(out[-1].name)
        if beta == 0:
            out.append(_mk(n.name, "alias", (prod,), n.shape, n.dtype))
        else:
            out.append(_mk(n.name, "add", (prod, a[0]), n.shape, n.dtype, "Tensor", alpha=beta))
        return out
    if n.op in ("mm", "bmm", "matmul"):
        return [
            dataclasses.replace(_mk(n.name, f"gemm_{n.op}", (a[0], a[1]), n.shape, n.dtype), target=n.target)
        ]
    if n.op in ops.CONVS and n.overload == "padding" and (explicit := _conv_padding(n, by_name)):
        return [*explicit[:-1], *_lower_node(explicit[-1], {**by_name, **{m.name: m for m in explicit}})]
    if n.op in ops.CONVS and n.shape is not None:
        conv = dataclasses.replace(
            _mk(f"{n.name}_conv", n.op, (a[0], a[1], None, *a[3:]), n.shape, n.dtype, n.overload),
            target=n.target,
        )
        bias = a[2] if len(a) > 2 else None
        if bias is None:
            return [dataclasses.replace(conv, name=n.name)]
        view = _bias_view(f"{n.name}_bias", bias, n.shape[1], len(n.shape) - 2, n.dtype or "float32")
        return [conv, view, _mk(n.name, "add", (Ref(conv.name), Ref(view.name)), n.shape, n.dtype, "Tensor")]
    if n.op == "_native_batch_norm_legit_no_training" and len(a) > 6:
        # older exports: (out, mean, rstd) of an inference batch norm; consumers take [0]
        x = by_name.get(a[0].name) if isinstance(a[0], Ref) else None
        if x is not None and x.shape is not None and len(x.shape) >= 2:
            shaped = dataclasses.replace(n, shape=x.shape, dtype=x.dtype)
            return _affine_norm(shaped, a[0], a[1], a[2], a[3], a[4], float(a[6]))
    if n.op == "getitem" and isinstance(a[0], Ref) and a[1] == 0:
        src = by_name.get(a[0].name)
        if src is not None and src.op == "alias" and src.shape is not None:  # [0] of a lowered batch norm
            return [_mk(n.name, "alias", (a[0],), src.shape, src.dtype)]
    if n.op == "batch_norm" and len(a) > 5 and a[5] is False and n.shape is not None:
        return _affine_norm(n, a[0], a[1], a[2], a[3], a[4], float(a[7]))
    if n.op == "batch_norm" and len(a) > 7 and a[5] is True and a[3] is None and a[4] is None:
        return _batch_stats_norm(n, by_name) or [n]
    if n.op == "instance_norm" and len(a) > 5 and a[5] is False and n.shape is not None:
        return _affine_norm(n, a[0], a[1], a[2], a[3], a[4], float(a[7]))
    if n.op in ("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d") and n.shape is not None:
        size = a[1] if isinstance(a[1], tuple) else (a[1],)
        if all(s == 1 for s in size):
            dims = tuple(range(-len(size), 0))
            return [_mk(n.name, "mean", (a[0], dims, True), n.shape, n.dtype, "dim")]
        # each output extent dividing the input's: windows of in / out, as many apart, tile the input
        x = by_name.get(a[0].name) if isinstance(a[0], Ref) else None
        sizes = tuple(x.shape[-len(size) :]) if x is not None and x.shape else ()
        outs = tuple(n.shape[-len(size) :])
        if len(sizes) == len(outs) == len(size) and all(
            o > 0 and i % o == 0 for i, o in zip(sizes, outs, strict=True)
        ):
            k = tuple(i // o for i, o in zip(sizes, outs, strict=True))
            pool = f"avg_pool{len(size)}d"
            return [_mk(n.name, pool, (a[0], k, k, (0,) * len(k)), n.shape, n.dtype)]
    if n.op == "rms_norm" and (len(a) < 4 or a[3] is None) and n.dtype in ops.FLOAT_DTYPES:
        return [dataclasses.replace(n, args=(*a[:3], *((None,) * (3 - len(a[:3]))), _RMS_EPS))]
    if n.op in ("_to_copy", "to") and ops._to_dtype(n) is None and n.dtype is not None:
        return [dataclasses.replace(n, op="alias", args=(a[0],), kwargs=())]
    split = _split_reduction(n, by_name)
    if split:
        return split
    return [n]


# Reductions that compose: reducing some dims, then the others, gives the reduction over all of them.
_COMPOSABLE = {"sum": "sum", "mean": "mean", "amax": "amax", "amin": "amin", "logsumexp": "logsumexp",
               "norm1": "sum", "norm2": "norm2", "norminf": "amax"}  # fmt: skip


def _split_reduction(n: Node, by_name: dict[str, Node]) -> list[Node]:
    """A reduction over non-adjacent dims (sum over dims 0 and 2) as one reduction per run of adjacent
    dims, last run first, so each is a plain (outer, reduced, inner) kernel and no transposed copy is made."""
    red = ops.reduction_of(n)
    x = by_name.get(n.args[0].name) if n.args and isinstance(n.args[0], Ref) else None
    if red is None or red.dims is None or x is None or not x.shape or n.shape is None:
        return []
    nd = len(x.shape)
    dims = sorted({d % nd for d in red.dims})
    runs: list[list[int]] = []
    for d in dims:
        if runs and runs[-1][-1] == d - 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    if len(runs) < 2 or red.kind not in _COMPOSABLE:
        return []
    out: list[Node] = []
    shape = list(x.shape)
    src: Ref = n.args[0]
    for i, run in enumerate(reversed(runs)):
        for d in run:
            shape[d] = 1
        kind = red.kind if i == 0 else _COMPOSABLE[red.kind]
        if kind == "norm1" and i == 0:
            op, args = "linalg_vector_norm", (src, 1.0, tuple(run), True)
        elif kind in ("norm2", "norminf"):
            op, args = "linalg_vector_norm", (src, 2.0 if kind == "norm2" else math.inf, tuple(run), True)
        else:
            op, args = kind, (src, tuple(run), True)
        name = f"{n.name}_part{i}"
        out.append(_mk(name, op, args, tuple(shape), n.dtype, _OVERLOAD.get(op, "default")))
        src = Ref(name)
    if red.keepdim:
        out[-1] = dataclasses.replace(out[-1], name=n.name)
    else:
        out.append(_mk(n.name, "squeeze", (src, tuple(dims)), n.shape, n.dtype, "dims"))
    return out


_OVERLOAD = {"sum": "dim_IntList", "mean": "dim"}


def _batch_stats_norm(n: Node, by_name: dict[str, Node]) -> list[Node] | None:
    """A batch norm on the batch's own statistics with no running ones to update (F.batch_norm(x, None,
    None, training=True), a norm layer with track_running_stats=False): the per-channel mean over the batch
    and every spatial position, the biased variance as the mean of the centred squares (two passes, as
    exact as eager's Welford), then the affine norm. fp32 only: 16-bit statistics would be rounded."""
    a = n.args
    x = by_name.get(a[0].name) if isinstance(a[0], Ref) else None
    if x is None or x.shape is None or len(x.shape) < 2 or n.dtype != "float32" or x.dtype != "float32":
        return None
    shape, c, name = x.shape, x.shape[1], n.name
    dims = (0, *range(2, len(shape)))
    stat = (1, c, *(1,) * (len(shape) - 2))
    scope = dict(by_name)
    out: list[Node] = []

    def add(m: Node, split: bool = False) -> Ref:
        parts = (_split_reduction(m, scope) or [m]) if split else [m]
        for p in parts:
            scope[p.name] = p
        out.extend(parts)
        return Ref(m.name)

    mean = add(_mk(f"{name}_mean", "mean", (a[0], dims, True), stat, "float32", "dim"), split=True)
    # x - mean twice, not stored once and read back: the squares are computed on the variance's loads
    d = add(_mk(f"{name}_dev", "sub", (a[0], mean), shape, "float32", "Tensor"))
    sq = add(_mk(f"{name}_sq", "mul", (d, d), shape, "float32", "Tensor"))
    d = add(_mk(f"{name}_centered", "sub", (a[0], mean), shape, "float32", "Tensor"))
    var = add(_mk(f"{name}_var", "mean", (sq, dims, True), stat, "float32", "dim"), split=True)
    rstd = add(_mk(f"{name}_rstd", "rsqrt", (add(_mk(f"{name}_vareps", "add", (var, float(a[7])), stat, "float32",
                                                        "Tensor")),), stat, "float32"))  # fmt: skip
    y = add(_mk(f"{name}_norm", "mul", (d, rstd), shape, "float32", "Tensor"))
    for tag, op, v in (("w", "mul", a[1]), ("b", "add", a[2])):
        if v is not None:
            view = add(_bias_view(f"{name}_{tag}", v, c, len(shape) - 2, "float32"))
            y = add(_mk(f"{name}_{op}", op, (y, view), shape, "float32", "Tensor"))
    out.append(_mk(name, "alias", (y,), shape, "float32"))
    return out


def _affine_norm(n: Node, x, w, b, mean, var, eps: float) -> list[Node]:
    """Inference batch norm: (x - mean) / sqrt(var + eps) * w + b, per channel, as elementwise ops."""
    assert n.shape is not None
    c, spatial, dt = n.shape[1], len(n.shape) - 2, n.dtype or "float32"
    out: list[Node] = []

    def view(tag: str, ref) -> Ref:
        out.append(_bias_view(f"{n.name}_{tag}", ref, c, spatial, dt))
        return Ref(out[-1].name)

    s = n.shape
    vm, vv = view("mean", mean), view("var", var)
    out.append(_mk(f"{n.name}_centered", "sub", (x, vm), s, dt, "Tensor"))
    out.append(_mk(f"{n.name}_vareps", "add", (vv, eps), (c,) + (1,) * spatial, dt, "Tensor"))
    out.append(_mk(f"{n.name}_rstd", "rsqrt", (Ref(out[-1].name),), (c,) + (1,) * spatial, dt))
    y = _mk(f"{n.name}_norm", "mul", (Ref(f"{n.name}_centered"), Ref(f"{n.name}_rstd")), s, dt, "Tensor")
    out.append(y)
    if w is not None:
        out.append(_mk(f"{n.name}_scaled", "mul", (Ref(y.name), view("w", w)), s, dt, "Tensor"))
        y = out[-1]
    if b is not None:
        out.append(_mk(f"{n.name}_shifted", "add", (Ref(y.name), view("b", b)), s, dt, "Tensor"))
        y = out[-1]
    out.append(_mk(n.name, "alias", (Ref(y.name),), s, dt))
    return out


# ---------------------------------------------------------------------------------------------------------
# Partition


def broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    out = []
    for x, y in zip((1,) * (len(b) - len(a)) + a, (1,) * (len(a) - len(b)) + b, strict=True):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out)


def _kind(n: Node, by_name: dict[str, Node]) -> tuple[RegionKind, str]:
    """(region kind, note) of a node after lowering."""
    if n.op.startswith("gemm_") or n.op in ops.CONVS:
        return RegionKind.LIBRARY, ""
    # an operand of a type our kernels cannot read (float64, complex: float_power's result) keeps it PyTorch's
    readable = all(by_name[r].dtype in ops.C_TYPES for r in n.refs() if r in by_name)
    if ops.is_elementwise(n) and readable:
        return RegionKind.EW, ""
    src0 = by_name.get(n.args[0].name) if n.args and isinstance(n.args[0], Ref) else None
    if (
        n.op in ("_to_copy", "to")
        and n.dtype in ("int64", "int32")
        and src0 is not None
        and src0.dtype == "bool"
    ):
        return RegionKind.EW, ""  # a mask as integers: 0 and 1, exact through our fp32 chains
    if n.op in ops.VIEWS:
        return RegionKind.VIEW, ""
    src = by_name.get(n.args[0].name) if n.args and isinstance(n.args[0], Ref) else None
    floating = n.dtype in ops.FLOAT_DTYPES and src is not None and src.dtype in ops.FLOAT_DTYPES
    if ops.reduction_of(n) is not None and src is not None and src.dtype in ops.FLOAT_DTYPES:
        return RegionKind.REDUCE, ""
    if n.op in ops.SOFTMAX and floating:
        return RegionKind.SOFTMAX, ""
    if (
        n.op in ("layer_norm", "rms_norm", "group_norm", "instance_norm", "l1_norm", "l2_normalize")
        and floating
    ):
        return RegionKind.NORM, ""
    if n.op in ops.SCANS and (
        floating or (n.op in ops.KEYED_SCANS and src is not None and src.dtype in ops.FLOAT_DTYPES)
    ):
        return RegionKind.SCAN, ""
    dtypes = {d for d in (n.dtype, src.dtype if src else None) if d and d not in ops.FLOAT_DTYPES}
    known = (
        n.op in ops.SOFTMAX | ops.NORMS | ops.SCANS
        or ops.reduction_of(n) is not None
        or n.op in ops.ELEMENTWISE
    )
    why = f"dtype {', '.join(sorted(dtypes))}" if known and dtypes else "no template covers it"
    return RegionKind.TORCH, f"{n.target} left to PyTorch ({why})"


def _partition(
    graph: Graph, nodes: list[Node], by_name: dict[str, Node], users: dict[str, tuple[str, ...]]
) -> tuple[Region, ...]:
    outputs = set(graph.output_names())
    index = {n.name: i for i, n in enumerate(nodes)}
    group_of: dict[str, int] = {}  # node -> group id
    groups: dict[int, list[Node]] = {}
    kinds: dict[int, tuple[RegionKind, str]] = {}
    ancestors: dict[str, set[str]] = {}
    for n in nodes:
        anc: set[str] = set()
        for r in n.refs():
            if r in index:
                anc.add(r)
                anc |= ancestors[r]
        ancestors[n.name] = anc

    for gid, n in enumerate(nodes):
        kind, note = _kind(n, by_name)
        groups[gid], kinds[gid] = [n], (kind, note)
        group_of[n.name] = gid
        if kind is not RegionKind.EW:
            continue
        for r in n.refs():
            pg = group_of.get(r)
            if pg is None or pg == group_of[n.name] or kinds[pg][0] is not RegionKind.EW:
                continue
            mine = group_of[n.name]
            if _can_merge(groups[pg], groups[mine], n, ancestors, group_of, users, outputs, by_name):
                for m in groups.pop(pg):
                    groups[mine].append(m)
                    group_of[m.name] = mine
                kinds.pop(pg)

    regions = []
    for gid, members in groups.items():
        members.sort(key=lambda m: index[m.name])
        kind, note = kinds[gid]
        names = {m.name for m in members}
        ins: list[str] = []
        for m in members:
            for r in m.refs():
                if r not in names and r not in ins:
                    ins.append(r)
        outs = [
            m.name for m in members if m.name in outputs or any(u not in names for u in users.get(m.name, ()))
        ]
        if kind is RegionKind.EW:
            shape = _full_shape(members)
            regions.append(
                Region(members[0].name, kind, tuple(members), tuple(outs), tuple(ins), shape, note=note)
            )
        else:
            regions.append(Region(members[0].name, kind, tuple(members), tuple(outs), tuple(ins), note=note))
    regions = _toposort(regions, index)
    return tuple(_with_inplace(r, regions, by_name, users, outputs) for r in regions)


def _full_shape(members: list[Node]) -> tuple[int, ...]:
    shape: tuple[int, ...] = ()
    for m in members:
        shape = broadcast(shape, m.shape or ()) or shape
    return shape


def _can_merge(
    producer: list[Node],
    mine: list[Node],
    n: Node,
    ancestors: dict[str, set[str]],
    group_of: dict[str, int],
    users: dict[str, tuple[str, ...]],
    outputs: set[str],
    by_name: dict[str, Node],
) -> bool:
    merged = producer + mine
    names = {m.name for m in merged}
    shape = _full_shape(merged)
    if any(broadcast(m.shape or (), shape) != shape for m in merged):
        return False
    # A positional op reads the region's element position: its own last two dims must be the region's.
    if any(m.op in ops.POSITIONAL and (m.shape or ())[-2:] != shape[-2:] for m in merged):
        return False
    # Every value that leaves the region must have the full shape: the kernel writes whole tensors only.
    for m in merged:
        leaves = m.name in outputs or any(u not in names for u in users.get(m.name, ()))
        if leaves and m.shape != shape:
            return False
    # No cycle: nothing outside the merged group may sit between the producer and n.
    return all(not (a not in names and ancestors[a] & names) for a in ancestors[n.name])


def _toposort(regions: list[Region], index: dict[str, int]) -> list[Region]:
    owner = {n.name: r.rid for r in regions for n in r.nodes}
    deps = {r.rid: {owner[i] for i in r.inputs if i in owner} for r in regions}
    by_id = {r.rid: r for r in regions}
    first = {r.rid: min(index[n.name] for n in r.nodes) for r in regions}
    done: list[Region] = []
    placed: set[str] = set()
    while len(done) < len(regions):
        ready = [rid for rid in by_id if rid not in placed and deps[rid] <= placed]
        rid = min(ready, key=lambda x: first[x])
        placed.add(rid)
        done.append(by_id[rid])
    return done


_FRESH = frozenset(RegionKind) - {RegionKind.VIEW, RegionKind.TORCH}  # kinds that write fresh buffers


def _with_inplace(
    r: Region,
    regions: list[Region],
    by_name: dict[str, Node],
    users: dict[str, tuple[str, ...]],
    outputs: set[str],
) -> Region:
    """An ew region may write an output over an input that nothing else reads: a fresh library or kernel
    result of the same shape and dtype (the hybrid epilogue works in place on cuBLAS's / cuDNN's output)."""
    if r.kind is not RegionKind.EW:
        return r
    owner = {n.name: q for q in regions for n in q.nodes}
    pairs: list[tuple[str, str]] = []
    used: set[str] = set()
    for out in r.outputs:
        o = next(m for m in r.nodes if m.name == out)
        for i in r.inputs:
            src = by_name.get(i)
            q = owner.get(i)
            if src is None or q is None or q.kind not in _FRESH or i in used or i in outputs:
                continue
            if src.shape != r.shape or src.dtype != o.dtype or len(users.get(i, ())) != 1:
                continue
            pairs.append((out, i))
            used.add(i)
            break
    return dataclasses.replace(r, inplace=tuple(pairs))


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1
