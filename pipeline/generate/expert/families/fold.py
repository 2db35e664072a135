"""F.fold / nn.Fold (col2im; templates/fold.py), where it was left to PyTorch: blocks of (N, C * kh * kw, L)
or (C * kh * kw, L), fp32, fp16 and bf16, any kernel, dilation, padding and stride, summed into their
planes by a thread a pixel (no atomics). Both plans take our kernel. Edits: resize_grid (threads x2 and /2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert import ops
from pipeline.generate.expert.families import common
from pipeline.generate.expert.graph import Node, Ref
from pipeline.generate.expert.plan import RegionPlan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates import fold
from pipeline.generate.expert.templates.code import Code

OPS = ("col2im",)


@dataclass(frozen=True)
class FoldPlan(RegionPlan):
    TAG: ClassVar[str] = "fold"
    SHOWN: ClassVar[tuple[str, ...]] = ("threads",)

    threads: int = 256


@dataclass(frozen=True)
class Form:
    channels: int
    out: tuple[int, int]
    kernel: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int]
    stride: tuple[int, int]


def _pair(v: Any) -> tuple[int, int] | None:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v)
    if (
        isinstance(v, tuple | list)
        and len(v) == 2
        and all(isinstance(e, int) and not isinstance(e, bool) for e in v)
    ):
        return (int(v[0]), int(v[1]))
    return None


def form(n: Node, low: Lowered) -> Form | str:
    """What our kernel computes for this node, else why not."""
    if n.op not in OPS:
        return "not a fold"
    x = low.by_name.get(n.args[0].name) if n.args and isinstance(n.args[0], Ref) else None
    if x is None or x.shape is None or len(x.shape) not in (2, 3) or x.dtype not in ops.FLOAT_DTYPES:
        return "not (N, C * kh * kw, L) float blocks"
    pairs = [_pair(v) for v in n.args[1:6]]
    if len(pairs) != 5 or any(p is None for p in pairs):
        return "sizes that are not constants"
    out, kernel, dilation, padding, stride = pairs  # col2im's argument order
    assert out and kernel and dilation and padding and stride
    if min(*kernel, *dilation, *stride) < 1 or min(padding) < 0 or min(out) < 1:
        return "an empty kernel, stride or output"
    rows, length = x.shape[-2], x.shape[-1]
    if rows % (kernel[0] * kernel[1]):
        return f"{rows} rows for a {kernel[0]} x {kernel[1]} kernel"
    blocks = [
        (o + 2 * p - d * (k - 1) - 1) // s + 1
        for o, p, d, k, s in zip(out, padding, dilation, kernel, stride, strict=True)
    ]
    if min(blocks) < 1 or blocks[0] * blocks[1] != length:
        return f"{length} blocks where the sizes give {blocks[0]} x {blocks[1]}"
    return Form(rows // (kernel[0] * kernel[1]), out, kernel, dilation, padding, stride)


def _emit(r: Region, rp: FoldPlan, f: Form, low: Lowered) -> Code:
    dtype = low.by_name[r.node.args[0].name].dtype or "float32"
    return fold.render(r, dtype, f.channels, f.out, f.kernel, f.dilation, f.padding, f.stride, rp.threads)


FAMILY = common.torch_family(FoldPlan, OPS, form, _emit, "fold")
