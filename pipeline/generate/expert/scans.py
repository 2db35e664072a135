"""Scans written around flips and concatenations, folded into one scan before lowering.

  reverse    flip(cumsum(flip(x, D), d), D) with d in D: cumsum(x, d) from the far end (kwarg reverse).
             A scan of a flip is the flip of a scan, reversed when the flip covers the scanned dim; two
             flips in a row cancel dim by dim. A flip of another dim only moves (and cancels with its pair):
             it is never taken for a reversal.
  exclusive  cat((zeros, cumsum(y, d)), d), the zeros one element long along d (ones for cumprod):
             y[i] = x[0] op ... op x[i - 1], one element longer than y (kwarg exclusive). A y that is
             narrow(x, d, 0, m) is read from x itself: no element past m is ever used.

The folded scan reads x with length L along d and writes `L + grow` elements (grow = 1 without a narrow);
`torch_expr` writes it back with torch for a launcher that leaves it to PyTorch.
"""

from __future__ import annotations

import dataclasses

from pipeline.generate.expert import ops
from pipeline.generate.expert.graph import Graph, Node, Ref

# Fills of the identity element: op -> (value the first argument or the `fill` argument must hold)
_FILLS = {"zeros_like": 0.0, "zeros": 0.0, "new_zeros": 0.0, "ones_like": 1.0, "ones": 1.0, "new_ones": 1.0}
_IDENTITY = {"cumsum": 0.0, "cumprod": 1.0}


def fold(graph: Graph) -> Graph:
    """The graph with reverse and exclusive scans folded (the nodes they no longer need are left for the
    caller's dead-code pass); the same graph when nothing matches."""
    outputs = set(graph.output_names())
    users: dict[str, int] = {}
    for n in graph.nodes:
        for r in n.refs():
            users[r] = users.get(r, 0) + 1
    for o in outputs:
        users[o] = users.get(o, 0) + 1
    by_name: dict[str, Node] = {n.name: n for n in (*graph.inputs, *graph.params)}
    rename: dict[str, str] = {}  # a value that is another one (two flips that cancel)
    nodes: list[Node] = []
    for n in graph.nodes:
        n = _renamed(n, rename)
        for m in _fold_node(n, by_name, users):
            if m.op == "alias" and m.target == "expert.fold":
                rename[m.name] = m.args[0].name
                continue
            nodes.append(m)
            by_name[m.name] = m
    if not rename and tuple(nodes) == graph.nodes:
        return graph
    outs = tuple(Ref(rename.get(o.name, o.name)) if isinstance(o, Ref) else o for o in graph.outputs)
    return dataclasses.replace(graph, nodes=tuple(nodes), outputs=outs)


def _renamed(n: Node, rename: dict[str, str]) -> Node:
    if not rename or not any(r in rename for r in n.refs()):
        return n

    def sub(a: object) -> object:
        if isinstance(a, Ref):
            return Ref(rename.get(a.name, a.name))
        if isinstance(a, tuple):
            return tuple(sub(x) for x in a)
        return a

    return dataclasses.replace(n, args=sub(n.args), kwargs=tuple((k, sub(v)) for k, v in n.kwargs))


def _src(n: Node, by_name: dict[str, Node], i: int = 0) -> Node | None:
    a = n.args[i] if len(n.args) > i else None
    return by_name.get(a.name) if isinstance(a, Ref) else None


def _flip_dims(n: Node) -> frozenset[int] | None:
    nd = len(n.shape or ())
    dims = n.args[1] if len(n.args) > 1 else n.kw("dims")
    if n.op != "flip" or not nd or not isinstance(dims, tuple) or not all(isinstance(d, int) for d in dims):
        return None
    return frozenset(d % nd for d in dims)


def _fold_node(n: Node, by_name: dict[str, Node], users: dict[str, int]) -> list[Node]:
    floating = n.dtype in ops.FLOAT_DTYPES
    if n.op in ops.FOLDABLE_SCANS and floating and n.shape and not n.kw("exclusive"):
        f = _src(n, by_name)
        dims = _flip_dims(f) if f is not None else None
        if f is not None and dims is not None and users.get(f.name) == 1:
            # scan(flip(x, D), d) = flip(scan(x, d), D), the scan reversed when d is in D
            d = int(n.args[1]) % len(n.shape)
            reverse = (d in dims) != bool(n.kw("reverse"))
            kw = tuple((k, v) for k, v in n.kwargs if k != "reverse") + (
                (("reverse", True),) if reverse else ()
            )
            scan = dataclasses.replace(n, name=f"{n.name}_scan", args=(f.args[0], d), kwargs=kw)
            return [scan, _flip(n, Ref(scan.name), dims)]
    if n.op == "flip" and (dims := _flip_dims(n)) is not None:
        g = _src(n, by_name)
        inner = _flip_dims(g) if g is not None else None
        if g is not None and inner is not None and users.get(g.name) == 1:
            left = dims ^ inner
            if not left:  # the flips cancel: the value is the inner flip's input
                return [Node(n.name, "alias", "default", (g.args[0],), (), n.shape, n.dtype, "expert.fold")]
            return [_flip(n, g.args[0], left)]
        if not dims:
            return [Node(n.name, "alias", "default", (n.args[0],), (), n.shape, n.dtype, "expert.fold")]
    if n.op == "cat" and floating and n.shape:
        return [_exclusive(n, by_name, users) or n]
    return [n]


def _flip(n: Node, x: Ref, dims: frozenset[int]) -> Node:
    return Node(
        n.name, "flip", "default", (x, tuple(sorted(dims))), (), n.shape, n.dtype, "aten.flip.default"
    )


def _exclusive(n: Node, by_name: dict[str, Node], users: dict[str, int]) -> Node | None:
    """cat((identity fill, scan(y, d)), d) as one exclusive scan of y (or of the x y narrows from 0)."""
    parts = n.args[0] if n.args else ()
    assert n.shape is not None
    nd = len(n.shape)
    d = int(n.args[1] if len(n.args) > 1 else n.kw("dim", 0)) % nd
    if not isinstance(parts, tuple) or len(parts) != 2 or not all(isinstance(p, Ref) for p in parts):
        return None
    fill, scan = (by_name.get(p.name) for p in parts)
    if fill is None or scan is None or scan.op not in _IDENTITY or scan.kwargs or scan.shape is None:
        return None
    if users.get(scan.name) != 1 or int(scan.args[1]) % nd != d or scan.dtype != n.dtype:
        return None
    want = (*scan.shape[:d], 1, *scan.shape[d + 1 :])
    if fill.shape != want or fill.dtype != n.dtype or _fill_value(fill) != _IDENTITY[scan.op]:
        return None
    y = _src(scan, by_name)
    if y is None or not y.shape:
        return None
    x = scan.args[0]
    if users.get(y.name) == 1 and _prefix_of(y, d, nd):
        x = y.args[0]  # y[i] sums x[j < i] with i <= m: past the prefix's end nothing is read
    return Node(n.name, scan.op, "default", (x, d), (("exclusive", True),), n.shape, n.dtype, scan.target)


def _prefix_of(y: Node, d: int, nd: int) -> bool:
    """Whether y is its input's first elements along d: narrow(x, d, 0, m) or x[..., :m] (a unit-step slice)."""
    a = (*y.args, None, None, None, None)
    if a[1] not in (d, d - nd) or a[2] not in (0, None):
        return False
    return y.op == "narrow" or (y.op == "slice" and a[4] in (1, None))


def _fill_value(n: Node) -> float | None:
    if n.op in _FILLS:
        return _FILLS[n.op]
    value = {"full": 1, "full_like": 1, "new_full": 2}.get(n.op)
    if value is not None and len(n.args) > value and isinstance(n.args[value], int | float):
        return float(n.args[value])
    return None


def grow(n: Node, x: Node) -> int:
    """How many more elements a folded scan writes along its dim than it reads (0 unless exclusive)."""
    d = int(n.args[1])
    return (n.shape or ())[d] - (x.shape or ())[d] if n.kw("exclusive") else 0


def torch_expr(n: Node, x: str, grown: int) -> str:
    """A folded scan as torch calls (its dim d, the input's name x)."""
    d, op = int(n.args[1]), n.op
    if n.kw("exclusive"):
        fill = "zeros_like" if op == "cumsum" else "ones_like"
        body = f"{x}.narrow({d}, 0, {x}.shape[{d}] + {grown - 1}).{op}({d})"
        return f"torch.cat((torch.{fill}({x}.narrow({d}, 0, 1)), {body}), {d})"
    if n.kw("reverse"):
        return f"{x}.flip({d}).{op}({d}).flip({d})"
    return f"{x}.{op}({d})"
