"""Launcher lines that read a row-wise op's sizes from its input's run-time shape: `outer`, `reduced`,
`inner` (the input seen as outer x reduced x inner) and `out_shape`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.generate.expert.layout import RowLayout
from pipeline.generate.expert.regions import Region, RegionKind
from pipeline.generate.expert.templates.code import torch_dtype

if TYPE_CHECKING:
    from pipeline.generate.expert.templates.fused import Fused


def shape_lines(region: Region, lay: RowLayout) -> list[str]:
    if region.kind is RegionKind.REDUCE:
        return _reduce(lay)
    if region.kind in (RegionKind.SOFTMAX, RegionKind.SCAN):
        return [
            "    shape = tuple(x.shape)",
            f"    d = {lay.dims[0]} % max(len(shape), 1)",
            "    outer, reduced, inner = _split3(shape, d, d + 1)",
            "    out_shape = shape",
        ]
    if lay.op == "group_norm":
        return [
            "    shape = tuple(x.shape)",
            "    out_shape = shape",
            f"    outer = shape[0] * {lay.groups or 'shape[1]'}",
            "    reduced, inner = math.prod(shape) // max(outer, 1), 1",
        ]
    return [
        "    shape = tuple(x.shape)",
        "    out_shape = shape",
        f"    reduced, inner = math.prod(shape[len(shape) - {lay.norm_dims}:]), 1",
        "    outer = math.prod(shape) // max(reduced, 1)",
    ]


def _reduce(lay: RowLayout) -> list[str]:
    lines = []
    d0, d1 = (lay.dims[0], lay.dims[-1] + 1) if lay.dims else (lay.static_nd, lay.static_nd)
    nd = lay.static_nd
    dims = {"all": "0, nd", "end": f"nd - {nd - d0}, nd - {nd - d1}", "start": f"{d0}, {d1}"}[lay.dims_from]
    lines += [
        "    shape = tuple(x.shape)",
        "    nd = len(shape)",
        f"    d0, d1 = {dims}",
        "    outer, reduced, inner = _split3(shape, d0, d1)",
    ]
    if not lay.keepdim:
        lines.append("    out_shape = shape[:d0] + shape[d1:]")
    else:
        lines.append("    out_shape = shape[:d0] + (1,) * (d1 - d0) + shape[d1:]")
    return lines


def expect_trailing() -> list[str]:
    """A loud failure when the run-time layout is not the one the row kernel was written for."""
    return [
        "    if inner != 1:",
        "        raise ValueError(f'kernelpro expert: this kernel works on trailing dims; got inner size {inner}')",
        "    rows, cols = outer, reduced",
    ]


def output_lines(
    out_dt: str, indices_only: bool, with_yi: bool, post: Fused | None, empty: str, pair: bool = False
) -> list[str]:
    """Launcher lines allocating a row-wise op's outputs at `out_shape` (y, and yi for indices), preparing
    the epilogue's operands, and returning early (with `ret` holding the outputs) when `empty` holds."""
    out_t = "torch.int64" if indices_only else torch_dtype(out_dt)
    lines = [f"    y = torch.empty(out_shape, dtype={out_t}, device=x.device)"]
    if with_yi:
        lines.append("    yi = torch.empty(out_shape, dtype=torch.int64, device=x.device)")
    if post:
        lines += post.prepare("out_shape")
    lines.append(f"    if {empty}:\n        return {returned(with_yi, pair)}")
    return lines


def returned(with_yi: bool, pair: bool = False) -> str:
    """The launcher's result: a values-only pair keeps the tuple its [0] reads."""
    return "y, yi" if with_yi else "y, None" if pair else "y"
