"""Losses and similarities that one kernel of ours computes whole (families/triplet.py, families/cosine.py), so
the lowering leaves their node as it is rather than decomposing it into element-wise ops and row sums: the
one place both ask what qualifies."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.generate.expert.graph import Node, Ref


@dataclass(frozen=True)
class Triplet:
    rows: int
    cols: int
    margin: float
    p: float  # 1 or 2
    eps: float
    reduction: int  # 0 none, 1 mean, 2 sum (ATen's numbering)


def triplet_args(n: Node) -> tuple[float, float, float, bool, object]:
    """A triplet_margin_loss node's (margin, p, eps, swap, reduction), positional or keyword, with ATen's
    defaults (the decomposition in regions.py reads them here too)."""
    margin, p, eps, swap, reduction = [*n.args[3:], *(None,) * 5][:5]
    margin = n.kw("margin", 1.0) if margin is None else margin
    p = n.kw("p", 2.0) if p is None else p
    eps = n.kw("eps", 1e-6) if eps is None else eps
    swap = n.kw("swap", False) if swap is None else swap
    reduction = n.kw("reduction", 1) if reduction is None else reduction
    return float(margin), float(p), float(eps), bool(swap), reduction


def triplet(n: Node, by_name: dict[str, Node]) -> Triplet | str:
    """triplet_margin_loss over three fp32 (N, D) tensors of one shape, p = 1 or 2, no swap: the form our
    one-pass kernel takes, else why not (the lowering then decomposes it)."""
    if n.op != "triplet_margin_loss":
        return "not a triplet margin loss"
    ins = [by_name.get(r.name) if isinstance(r, Ref) else None for r in n.args[:3]]
    margin, p, eps, swap, reduction = triplet_args(n)
    if any(x is None or x.shape is None for x in ins):
        return "an operand that is not a tensor of known shape"
    shape = ins[0].shape
    if len(shape) != 2 or any(x.shape != shape for x in ins) or 0 in shape:
        return "not three (N, D) tensors of one shape"
    if any(x.dtype != "float32" for x in ins):
        return "not fp32 (16-bit inputs: eager rounds each distance to their dtype)"
    if p not in (1.0, 2.0) or swap or reduction not in (0, 1, 2):
        return "a norm other than 1 or 2, the swap, or an unknown reduction"
    return Triplet(shape[0], shape[1], margin, p, eps, int(reduction))


@dataclass(frozen=True)
class Cosine:
    shape: tuple[int, ...]  # each operand's; the similarity is over the last dim
    eps: float

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def cols(self) -> int:
        return self.shape[-1]


def cosine_args(n: Node) -> tuple[object, float]:
    """A cosine_similarity node's (dim, eps), positional or keyword, with ATen's defaults (the decomposition
    in regions.py reads them here too)."""
    a = n.args
    return (a[2] if len(a) > 2 else n.kw("dim", 1)), float(a[3] if len(a) > 3 else n.kw("eps", 1e-8))


def cosine(n: Node, by_name: dict[str, Node]) -> Cosine | str:
    """cosine_similarity of two fp32 tensors of one shape over their last dim: the form our one-pass kernel
    takes, else why not (the lowering then decomposes it into three row sums)."""
    if n.op != "cosine_similarity":
        return "not a cosine similarity"
    x1, x2 = (by_name.get(r.name) if isinstance(r, Ref) else None for r in n.args[:2])
    dim, eps = cosine_args(n)
    if x1 is None or x2 is None or not x1.shape or x1.shape != x2.shape or 0 in x1.shape:
        return "not two non-empty tensors of one shape"
    if not isinstance(dim, int) or dim % len(x1.shape) != len(x1.shape) - 1:
        return "a similarity over a dim other than the last"
    if x1.dtype != "float32" or x2.dtype != "float32" or n.dtype != "float32":
        return "not fp32"
    return Cosine(tuple(x1.shape), eps)
