"""Chains of views, cuts and copies composed into one gather.

A model that moves data between layouts by hand writes chains such as Swin's window partition, then its
heads split off:

    x.view(B, H/7, 7, W/7, 7, C).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, 49, C)
     .view(-1, 49, h, C/h).transpose(1, 2).reshape(-1, h * 49, C/h)

Each `.contiguous()` and each reshape that no view can express copies the tensor (a gather by our kernel):
two full copies here, where one would do. Every element of the chain's result is an element of its source:
followed link by link as sizes and strides over the source made contiguous (a reshape splits or merges dims
where the boundaries divide, a slice or select moves the offset and scales a stride), the result is the
source at some strides from some offset. A part of the chain is replaced by: the source viewed at a finer
shape and permuted (when the result is a permutation of the source's digits) or taken at those strides
(`as_strided`, when it cuts), made contiguous (the one gather, up to 8 dims), and viewed at the part's
result shape. Only where the part, as written, copies at least twice (counted on meta tensors, as the
launcher would run it), starts where the tensor is contiguous, and no value inside it is read by anything
else.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from pipeline.generate.expert import ops
from pipeline.generate.expert.graph import Node, Ref

# Ops that only reorder, regroup or cut their operand's elements (the chain's links), and the copies among them.
_REGROUP = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze"})
_REORDER = frozenset({"permute", "transpose", "t", "numpy_T"})
_CUT = frozenset({"slice", "narrow", "select"})
_COPIES = frozenset({"contiguous", "clone"})
LINKS = _REGROUP | _REORDER | _CUT | _COPIES
# what the launcher's gather kernels copy (`_contig`), and how many dims they index
_DTYPES = frozenset({"float32", "float16", "bfloat16", "bool", "int64"})
MAX_DIMS = 8


def _is_link(n: Node) -> bool:
    if n.op not in LINKS or n.shape is None or n.dtype not in _DTYPES or not n.args:
        return False
    if not isinstance(n.args[0], Ref) or not all(
        isinstance(a, int | None) for a in n.args[1:] if n.op in _CUT
    ):
        return False
    if n.op == "clone":  # a clone keeping a strided layout (memory_format=preserve) is not a plain copy here
        return all(k == "memory_format" and v in (None, ("torch", "contiguous_format")) for k, v in n.kwargs)
    return not n.kwargs


def _cut(n: Node, size: int) -> tuple[int, int | None, int] | None:
    """(start, length, step) of a slice, narrow or select (length None: a select) whose dim has `size`
    elements, Python's bounds applied; None for an empty result or a step that is not positive."""
    a = [*n.args[1:], 0, 0, 0]
    if n.op == "select":
        return int(a[1]) + (size if int(a[1]) < 0 else 0), None, 1
    if n.op == "narrow":
        start, length = int(a[1]) + (size if int(a[1]) < 0 else 0), int(a[2])
        return (start, length, 1) if length > 0 else None
    start, stop, step = ([*n.args[2:], None, None, None][:3]) if len(n.args) > 2 else (None, None, None)
    step = 1 if step is None else int(step)
    if step <= 0:
        return None
    begin, end, _ = slice(start, stop, step).indices(size)
    length = len(range(begin, end, step))
    return (begin, length, step) if length > 0 else None


class _Strided:
    """The tensor at some link of a chain, as its source's elements: fine dims (size and stride, in elements
    of the contiguous source) from `offset`, and the tensor's dims as groups of fine dims (outermost
    first). Fine dims of size 1 are dropped."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.dims: dict[int, tuple[int, int]] = {}  # fine dim -> (size, stride)
        self.groups: list[list[int]] = []
        self.offset = 0
        self.made = 0  # fine dims made so far: the next one's id
        stride = 1
        for s in reversed(shape):
            self.groups.insert(0, [self._new(s, stride)] if s != 1 else [])
            stride *= s

    def _new(self, size: int, stride: int) -> int:
        fid, self.made = self.made, self.made + 1
        self.dims[fid] = (size, stride)
        return fid

    def size(self, g: list[int]) -> int:
        n = 1
        for f in g:
            n *= self.dims[f][0]
        return n

    def reorder(self, dims: list[int]) -> None:
        self.groups = [self.groups[d] for d in dims]

    def regroup(self, shape: tuple[int, ...]) -> bool:
        """The tensor reshaped to `shape` (its row-major order kept); False where a new dim's boundary falls
        inside a fine dim at a size that does not divide it."""
        seq = [f for g in self.groups for f in g]
        groups: list[list[int]] = []
        i = 0
        for t in shape:
            g: list[int] = []
            prod = 1
            while prod < t:
                if i >= len(seq):
                    return False
                s, st = self.dims[seq[i]]
                if t % (prod * s) == 0:
                    g.append(seq[i])
                    prod *= s
                    i += 1
                    continue
                k = t // prod  # the outer k of the fine dim ends this dim; its inner s / k begins the next
                if t % prod or s % k:
                    return False
                outer, inner = self._new(k, st * (s // k)), self._new(s // k, st)
                seq[i : i + 1] = [outer, inner]
                g.append(outer)
                prod = t
                i += 1
            groups.append(g)
        if i != len(seq):
            return False
        self.groups = groups
        return True

    def cut(self, d: int, start: int, length: int | None, step: int) -> bool:
        """Dim d cut to `length` elements from `start` by `step` (length None: the one element at `start`,
        the dim dropped); False where the cut crosses the dim's inner fine dims."""
        g = self.groups[d]
        if not 0 <= start < self.size(g):
            return False
        if not g:  # a dim of one element: kept by a slice, dropped by a select
            if length is None:
                del self.groups[d]
            return True
        if length is None:  # a select: the element's digits over the group's fine dims
            rest = start
            for f in reversed(g):
                s, st = self.dims[f]
                self.offset += (rest % s) * st
                rest //= s
            del self.groups[d]
            return True
        inner = self.size(g[1:])
        if len(g) > 1 and (step != 1 or start % inner or length % inner):
            return False
        s, st = self.dims[g[0]]
        self.offset += (start // inner) * st
        self.groups[d] = [self._new(length // inner, st * step), *g[1:]] if length > 1 or inner > 1 else []
        return True

    def gather(self) -> tuple[list[tuple[int, int]], int]:
        """The tensor's (size, stride) dims in its own order, runs that one stride spans merged, and the
        offset."""
        out: list[tuple[int, int]] = []
        for f in (f for g in self.groups for f in g):
            s, st = self.dims[f]
            if s == 1:
                continue
            if out and out[-1][1] == st * s:
                out[-1] = (out[-1][0] * s, st)
            else:
                out.append((s, st))
        return out, self.offset


def _dim(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


def _cut_dim(n: Node, nd: int) -> int:
    """The dim a slice, narrow or select of a tensor of `nd` dims cuts."""
    return _dim(int(n.args[1] or 0) if len(n.args) > 1 else 0, nd)


def _order(n: Node, nd: int) -> list[int]:
    """The operand's dims in the order a permute, transpose, t or numpy_T of a tensor of `nd` dims puts them."""
    if n.op == "permute":
        return [_dim(int(d), nd) for d in n.args[1]]
    if n.op == "transpose":
        a, b = _dim(int(n.args[1]), nd), _dim(int(n.args[2]), nd)
        dims = list(range(nd))
        dims[a], dims[b] = b, a
        return dims
    return list(reversed(range(nd)))


def _walk(src: Node, chain: list[Node]) -> _Strided | None:
    fine = _Strided(tuple(src.shape or ()))
    for n in chain:
        nd = len(fine.groups)
        if n.op in _CUT:
            d = _cut_dim(n, nd)
            cut = _cut(n, fine.size(fine.groups[d])) if d < nd else None
            if cut is None or not fine.cut(d, *cut):
                return None
        elif n.op in _REORDER:
            fine.reorder(_order(n, nd))
        elif n.op in _REGROUP and not fine.regroup(tuple(n.shape or ())):
            return None
    return fine


def _copies(src: Node, chain: list[Node]) -> int:
    """How many times the chain, as the launcher runs it, copies its tensor: `contiguous` and `clone` always
    (their regions write a new tensor), a reshape where no view of its operand has the new shape."""
    import torch

    t = torch.empty(tuple(src.shape or ()), device="meta")
    copies = 0
    for n in chain:
        if n.op in _COPIES:
            copies += 1
            t = t.contiguous()
        elif n.op in _REGROUP:
            try:
                t = t.view(tuple(n.shape or ()))
            except RuntimeError:
                copies += 1
                t = t.contiguous().view(tuple(n.shape or ()))
        elif n.op in _CUT:
            d = _cut_dim(n, t.dim())
            cut = _cut(n, t.shape[d])
            if cut is None:
                raise ValueError("an empty cut, or a step that is not positive")
            start, length, step = cut
            t = (
                t.select(d, start)
                if length is None
                else t.as_strided(
                    (*t.shape[:d], length, *t.shape[d + 1 :]),
                    (*t.stride()[:d], t.stride(d) * step, *t.stride()[d + 1 :]),
                    t.storage_offset() + start * t.stride(d),
                )
            )
        else:
            t = t.permute(*_order(n, t.dim()))
    return copies


def _chains(
    nodes: list[Node], by_name: dict[str, Node], keep: frozenset[str]
) -> Iterator[tuple[Node, list[Node]]]:
    """(source, links) for each maximal chain of links whose every link but the last is read by the next
    link only."""
    users: dict[str, list[str]] = {}
    for n in nodes:
        for r in n.refs():
            users.setdefault(r, []).append(n.name)
    in_chain: set[str] = set()
    for n in nodes:
        if n.name in in_chain or not _is_link(n):
            continue
        src = by_name.get(n.args[0].name)
        if src is None or src.shape is None:
            continue
        chain = [n]
        while chain[-1].name not in keep and len(nxt := users.get(chain[-1].name, [])) == 1:
            m = by_name[nxt[0]]
            if not _is_link(m) or m.args[0] != Ref(chain[-1].name):
                break
            chain.append(m)
        in_chain.update(m.name for m in chain)
        yield src, chain


def _node(name: str, op: str, args: tuple, shape: tuple[int, ...], dtype: str | None) -> Node:
    return Node(name, op, "default", args, (), shape, dtype, f"expert.{op}")


def _contiguous(dims: list[tuple[int, int]]) -> bool:
    run = 1
    for s, st in reversed(dims):
        if st != run:
            return False
        run *= s
    return True


def _replace(src: Node, chain: list[Node]) -> list[Node] | None:
    """The nodes that compute the chain's last value with one gather at most, or None where they cannot."""
    fine = _walk(src, chain)
    if fine is None:
        return None
    dims, offset = fine.gather()
    if len(dims) > MAX_DIMS:
        return None
    end, whole = chain[-1], math.prod(src.shape or ())
    dt, name = end.dtype, end.name
    target = tuple(end.args[1]) if end.op in ("view", "reshape", "_unsafe_view") else tuple(end.shape or ())
    numel = math.prod(s for s, _ in dims)
    # A view of a forward input may reach the outputs, which must not share its memory (the harness rejects
    # that): from an input, a part that needs no copy keeps one.
    own = src.op != "input"
    if offset == 0 and numel == whole and _contiguous(dims):  # the chain only regrouped: a view, no copy
        if own:
            return [_node(name, "view", (Ref(src.name), target), end.shape, dt)]
        seen = _node(f"{name}_fine", "view", (Ref(src.name), target), end.shape, dt)
        return [seen, _node(name, "contiguous", (Ref(seen.name),), end.shape, dt)]
    by_stride = sorted(range(len(dims)), key=lambda i: -dims[i][1])
    if offset == 0 and numel == whole and _contiguous([dims[i] for i in by_stride]):
        # a permutation of the source's digits: seen at the finer shape (its first dim as -1: what leads,
        # the batch, keeps the size it has when the model runs), permuted, gathered
        sizes = [dims[i][0] for i in by_stride]
        perm = tuple(by_stride.index(i) for i in range(len(dims)))
        seen = _node(f"{name}_fine", "view", (Ref(src.name), (-1, *sizes[1:])), tuple(sizes), dt)
        moved_shape = tuple(dims[i][0] for i in range(len(dims)))
        moved = _node(f"{name}_moved", "permute", (Ref(seen.name), perm), moved_shape, dt)
    else:  # cut as well: the source's elements at these strides, from the offset
        moved_shape = tuple(s for s, _ in dims)
        strides = tuple(st for _, st in dims)
        moved = _node(
            f"{name}_moved", "as_strided", (Ref(src.name), moved_shape, strides, offset), moved_shape, dt
        )
        seen = None
        if own and _contiguous(dims):  # one contiguous run of the source: a view from the offset
            return [moved, _node(name, "view", (Ref(moved.name), target), end.shape, dt)]
    copied = _node(f"{name}_gather", "contiguous", (Ref(moved.name),), moved.shape or (), dt)
    out = _node(name, "view", (Ref(copied.name), target), end.shape, dt)
    return [*([seen] if seen is not None else []), moved, copied, out]


def _longest(src: Node, chain: list[Node], i: int) -> tuple[int, list[Node]] | None:
    """(its end, its nodes) for the longest part of the chain from link i that copies twice or more and
    composes, or None."""
    for k in range(len(chain), i + 1, -1):
        part = chain[i:k]
        try:
            if _copies(src, part) < 2:  # nor any shorter part
                return None
        except (RuntimeError, ValueError, IndexError):  # a link meta tensors refuse: left as written
            continue
        new = _replace(src, part)
        if new is not None:
            return k, new
    return None


def _composed(src: Node, chain: list[Node]) -> dict[str, list[Node]]:
    """Replacements (a link's name -> its nodes, none for a link dropped) for the chain's parts that copy
    twice or more: from each link where the tensor is contiguous (the source, after a copy, after a composed
    part), the longest part that composes (a cut that no strides express, such as unpadding rows of windows
    merged again, ends a part)."""
    out: dict[str, list[Node]] = {}
    i = 0
    while i < len(chain) - 1:
        if i and chain[i - 1].op in _COPIES:
            src = chain[i - 1]
        elif i and chain[i - 1].name not in out:
            i += 1
            continue
        found = _longest(src, chain, i)
        if found is None:
            i += 1
            continue
        k, new = found
        out.update((m.name, []) for m in chain[i : k - 1])
        out[chain[k - 1].name] = new
        src, i = new[-1], k
    return out


def compose(nodes: list[Node], by_name: dict[str, Node], keep: frozenset[str] = frozenset()) -> list[Node]:
    """`nodes` with each chain's parts that copy twice or more replaced by one gather each (see the module's
    note); `by_name` updated with the new nodes. A value in `keep` (the graph's outputs) ends its chain."""
    replaced: dict[str, list[Node]] = {}
    for src, chain in _chains(nodes, by_name, keep):
        if src.op not in ops.VIEWS:  # a view's source may not be contiguous, as the rule counts it
            replaced.update(_composed(src, chain))
    if not replaced:
        return nodes
    result: list[Node] = []
    for n in nodes:
        for m in replaced.get(n.name, [n]):
            by_name[m.name] = m
            result.append(m)
    return result
