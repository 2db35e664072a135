"""Chains of views and copies composed into one gather.

A model that moves data between layouts by hand writes chains such as Swin's window partition, then its
heads split off:

    x.view(B, H/7, 7, W/7, 7, C).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, 49, C)
     .view(-1, 49, h, C/h).transpose(1, 2).reshape(-1, h * 49, C/h)

Each `.contiguous()` and each reshape that no view can express copies the tensor (a gather by our kernel):
two full copies here, where one would do. Every element of the chain's result is an element of its source,
and when the chain only reorders and regroups whole digits of the source's index (each reshape splitting
or merging dims at boundaries that divide), the result is one permutation of the source seen at a finer
shape. The chain is then replaced by: the source viewed at that finer shape, permuted, made contiguous (the
one gather, up to 8 dims), and viewed at the chain's result shape. Only where the chain, as written, copies
at least twice (counted on meta tensors, as the launcher would run it) and no value inside the chain is read
by anything else.
"""

from __future__ import annotations

from collections.abc import Iterator

from pipeline.generate.expert.graph import Node, Ref

# Ops that only reorder or regroup their operand's elements (the chain's links), and the copies among them.
_REGROUP = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze"})
_REORDER = frozenset({"permute", "transpose", "t", "numpy_T"})
_COPIES = frozenset({"contiguous", "clone"})
LINKS = _REGROUP | _REORDER | _COPIES
# what the launcher's gather kernels copy (`_contig`), and how many dims they index
_DTYPES = frozenset({"float32", "float16", "bfloat16", "bool", "int64"})
MAX_DIMS = 8


def _is_link(n: Node) -> bool:
    if n.op not in LINKS or n.shape is None or n.dtype not in _DTYPES or not n.args:
        return False
    if not isinstance(n.args[0], Ref):
        return False
    if n.op == "clone":  # a clone keeping a strided layout (memory_format=preserve) is not a plain copy here
        return all(k == "memory_format" and v in (None, ("torch", "contiguous_format")) for k, v in n.kwargs)
    return not n.kwargs


class _Fine:
    """The tensor at some link of a chain, as a permutation of its source's digits: the source's dims cut
    into fine dims (`sizes`, in the source's row-major order `order`), and the current tensor's dims as
    groups of fine dims (`groups`, each group's fine dims outermost first). Fine dims of size 1 are dropped."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.sizes: dict[int, int] = {}
        self.order: list[int] = []
        self.made = 0  # fine dims made so far: the next one's id
        self.groups: list[list[int]] = []
        for s in shape:
            self.groups.append(self._new(s, len(self.order)) if s != 1 else [])

    def _new(self, size: int, at: int) -> list[int]:
        fid, self.made = self.made, self.made + 1
        self.sizes[fid] = size
        self.order.insert(at, fid)
        return [fid]

    def reorder(self, dims: list[int]) -> None:
        self.groups = [self.groups[d] for d in dims]

    def regroup(self, shape: tuple[int, ...]) -> bool:
        """The current tensor reshaped to `shape` (its row-major order kept); False where a new dim's boundary
        falls inside a fine dim at a size that does not divide it."""
        seq = [f for g in self.groups for f in g]
        groups: list[list[int]] = []
        i = 0
        for t in shape:
            g: list[int] = []
            prod = 1
            while prod < t:
                if i >= len(seq):
                    return False
                f = seq[i]
                s = self.sizes[f]
                if t % (prod * s) == 0:
                    g.append(f)
                    prod *= s
                    i += 1
                    continue
                k = t // prod  # the outer k of f ends this dim; f's inner s / k begins the next
                if t % prod or s % k:
                    return False
                at = self.order.index(f)
                self.order.remove(f)
                self.sizes.pop(f)
                outer = self._new(k, at)[0]
                inner = self._new(s // k, at + 1)[0]
                seq[i : i + 1] = [outer, inner]
                g.append(outer)
                prod = t
                i += 1
            groups.append(g)
        if i != len(seq):
            return False
        self.groups = groups
        return True

    def gather(self) -> tuple[list[int], list[int]] | None:
        """(the source's fine sizes in its own order, the permutation that gives the current order), runs of
        fine dims adjacent in both orders merged; None when more dims remain than a gather indexes."""
        out = [f for g in self.groups for f in g]
        runs: list[list[int]] = []
        for f in out:
            if runs and self.order.index(f) == self.order.index(runs[-1][-1]) + 1:
                runs[-1].append(f)
            else:
                runs.append([f])
        if len(runs) > MAX_DIMS:
            return None
        by_start = sorted(runs, key=lambda r: self.order.index(r[0]))
        sizes = []
        for r in by_start:
            n = 1
            for f in r:
                n *= self.sizes[f]
            sizes.append(n)
        perm = [by_start.index(r) for r in runs]
        return sizes, perm


def _dim(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


def _walk(src: Node, chain: list[Node]) -> _Fine | None:
    fine = _Fine(tuple(src.shape or ()))
    for n in chain:
        nd = len(fine.groups)
        if n.op == "permute":
            dims = [_dim(int(d), nd) for d in n.args[1]]
        elif n.op == "transpose":
            a, b = _dim(int(n.args[1]), nd), _dim(int(n.args[2]), nd)
            dims = list(range(nd))
            dims[a], dims[b] = b, a
        elif n.op in ("t", "numpy_T"):
            dims = list(reversed(range(nd)))
        else:
            dims = None
        if dims is not None:
            fine.reorder(dims)
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
        elif n.op == "permute":
            t = t.permute(*(int(d) for d in n.args[1]))
        elif n.op == "transpose":
            t = t.transpose(int(n.args[1]), int(n.args[2]))
        else:
            t = t.permute(*reversed(range(t.dim())))
    return copies


def _chains(nodes: list[Node], by_name: dict[str, Node]) -> Iterator[tuple[Node, list[Node]]]:
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
        while len(nxt := users.get(chain[-1].name, [])) == 1:
            m = by_name[nxt[0]]
            if not _is_link(m) or m.args[0] != Ref(chain[-1].name):
                break
            chain.append(m)
        in_chain.update(m.name for m in chain)
        yield src, chain


def _node(name: str, op: str, args: tuple, shape: tuple[int, ...], dtype: str | None) -> Node:
    return Node(name, op, "default", args, (), shape, dtype, f"expert.{op}")


def compose(nodes: list[Node], by_name: dict[str, Node]) -> list[Node]:
    """`nodes` with each chain that copies twice or more replaced by one gather (see the module's note);
    `by_name` updated with the new nodes."""
    replaced: dict[str, list[Node]] = {}
    for src, chain in _chains(nodes, by_name):
        try:
            if _copies(src, chain) < 2:
                continue
        except (RuntimeError, ValueError):  # a link meta tensors refuse: left as written
            continue
        fine = _walk(src, chain)
        plan = fine.gather() if fine is not None else None
        if plan is None or not plan[0]:
            continue
        sizes, perm = plan
        end = chain[-1]
        dt = end.dtype
        target = (
            tuple(end.args[1]) if end.op in ("view", "reshape", "_unsafe_view") else tuple(end.shape or ())
        )
        if perm == sorted(perm):  # the chain only regrouped: a view of its source, no copy at all
            replaced[end.name] = [_node(end.name, "view", (Ref(src.name), target), end.shape, dt)]
        else:
            # the first fine dim as -1: what leads (the batch) keeps the size it has when the model runs
            seen = _node(f"{end.name}_fine", "view", (Ref(src.name), (-1, *sizes[1:])), tuple(sizes), dt)
            moved_shape = tuple(sizes[p] for p in perm)
            moved = _node(f"{end.name}_moved", "permute", (Ref(seen.name), tuple(perm)), moved_shape, dt)
            copied = _node(f"{end.name}_gather", "contiguous", (Ref(moved.name),), moved_shape, dt)
            out = _node(end.name, "view", (Ref(copied.name), target), end.shape, dt)
            replaced[end.name] = [seen, moved, copied, out]
        for m in chain[:-1]:
            replaced[m.name] = []
    if not replaced:
        return nodes
    result: list[Node] = []
    for n in nodes:
        for m in replaced.get(n.name, [n]):
            by_name[m.name] = m
            result.append(m)
    return result
