"""fp32 linear layers over few rows (at most MAX_ROWS: CvT's 20 tokens, classifier heads over a batch of
10), or into few columns from a small x (NARROW_*: SwinV2's position-bias MLP, 169 rows into a column a
head), or over a K of a few (TINY_K: an outer product, one output a thread), on the CUDA cores:
templates/gemm_skinny.py. The 3xTF32 kernel's 128-row tile would compute 6x the
work there and, with few output columns, leave most SMs idle; here the weight is read once and every SM
gets columns. The plain plan keeps cuBLAS, the tuned one takes our kernel with the elementwise region
after it fused on its stores (bias, activations, a residual).

Knobs: rows (rows of x a thread keeps sums for, a power of two up to 16), cols (output columns a block, each
a weight row read once for all its rows). Edits: use_direct_kernel (from cuBLAS), fuse_epilogue,
coarsen_threads (cols x2, up to 8: x re-read by fewer blocks), more_parallelism (cols / 2: more blocks),
resize_grid (rows x2 or / 2: fewer or more groups of rows, each a pass over the weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert.families import gemm_kit
from pipeline.generate.expert.families.base import Family, RenderError, change, label
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates import gemm_skinny
from pipeline.generate.expert.templates.code import Code

# Rows from which the tensor cores win: a 128-row tile then wastes at most 4x, and at 32 rows the CUDA cores'
# fp32 rate (about 60 TFLOP/s) meets the weight's read at the H200's bandwidth (2 flops a row per 4 bytes).
MAX_ROWS = 32
# More rows where the output is narrow and x small: the 3xTF32 grid is then a tile or two of 128 x 32 walking
# all of K on as many SMs (SwinV2's position-bias MLP, (169, 512) by (512, heads): 12.8 us on two SMs, H200),
# while here each group of rows takes its own blocks and x, re-read by every block of columns, stays in L2.
NARROW_COLS, NARROW_ROWS, NARROW_X_BYTES = 32, 256, 4 << 20
# A K of at most TINY_K is an outer product whatever the rows (SwinV2's position-bias MLP, Linear(2, 512)): the
# tensor cores' kernel would copy x and w into rows of 4 for TMA (two pad launches) and run a tile for it.
TINY_K = 8
MAX_COLS = 8
MAX_SUMS = 64  # rows x cols accumulators a thread


@dataclass(frozen=True)
class SkinnyPlan(RegionPlan):
    TAG: ClassVar[str] = "skinny_gemm"
    SHOWN: ClassVar[tuple[str, ...]] = ("rows", "cols")
    ABSORBS: ClassVar[tuple[str, ...]] = ("epilogue",)

    rows: int = 8  # rows of x a thread keeps sums for (a group; the grid's y walks the groups)
    cols: int = 4  # output columns a block
    epilogue: str = ""  # rid of the ew region computed on the totals before the one store


def form(r: Region, low: Lowered) -> int | str:
    """The static row count when our skinny kernel can compute this library region, else why not."""
    n = r.node
    if r.kind is not RegionKind.LIBRARY or n.op != "gemm_linear":
        return "only linear layers have a skinny (CUDA-core) template"
    a, b = (low.by_name.get(getattr(v, "name", "")) for v in n.args[:2])
    if a is None or b is None or not a.shape or not b.shape or len(b.shape) != 2:
        return "the operands' shapes are unknown, or the weight is not (N, K)"
    if not (n.dtype == a.dtype == b.dtype == "float32"):
        return "the skinny template takes fp32 operands"
    if a.shape[-1] != b.shape[-1]:
        return "the weight is not (N, K)"
    rows = math.prod(a.shape[:-1])
    if 0 < a.shape[-1] <= TINY_K:
        return rows
    narrow = b.shape[0] <= NARROW_COLS and rows <= NARROW_ROWS and rows * a.shape[-1] * 4 <= NARROW_X_BYTES
    if rows > MAX_ROWS and not narrow:
        return f"{rows} rows: the tensor cores' (more than {MAX_ROWS}, {b.shape[0]} columns)"
    return rows


def claims(r: Region, low: Lowered) -> bool:
    return not isinstance(form(r, low), str)


def tuned_plan(rid: str, rows: int) -> SkinnyPlan:
    """A group of rows covering them all where it fits 16 sums a column (one pass over the weight)."""
    group = min(16, 1 << max(0, rows - 1).bit_length())
    return SkinnyPlan(rid, rows=max(1, group), cols=4)


def first(r: Region, low: Lowered, tuned: bool) -> SkinnyPlan | None:
    """Plain: cuBLAS. Tuned: our kernel."""
    rows = form(r, low)
    if not tuned or isinstance(rows, str):
        return None
    return tuned_plan(r.rid, rows)


def render(r: Region, rp: SkinnyPlan, low: Lowered, hunter: Any) -> Code:
    rows = form(r, low)
    if isinstance(rows, str):
        raise RenderError(f"region {r.rid} cannot be our skinny GEMM: {rows}")
    if rp.rows * rp.cols > MAX_SUMS or rp.cols > MAX_COLS:
        raise RenderError(f"region {r.rid}: {rp.rows} x {rp.cols} sums a thread do not fit")
    epi = gemm_kit.planned_epilogue(rp, r, low, gemm_kit.epilogue)
    return gemm_skinny.render(r, rp, epi, tiny_k=_tiny_k(r, low))


def _tiny_k(r: Region, low: Lowered) -> int:
    """The static K of a layer over at most TINY_K of it (the outer-product kernel: rows and cols unused), else 0."""
    k = low.by_name[r.node.args[0].name].shape[-1]
    return k if 0 < k <= TINY_K else 0


_fuse = gemm_kit.fuse_edit(gemm_kit.epilogue)


def _cols(edit: str, factor: float) -> Any:
    def apply(plan: Plan, rp: SkinnyPlan | None, r: Region, low: Lowered) -> Any:
        if rp is None or _tiny_k(r, low):
            return
        cols = int(rp.cols * factor)
        if 1 <= cols <= MAX_COLS and rp.rows * cols <= MAX_SUMS:
            yield from change(edit, plan, rp, cols=cols)

    return apply


def _rows(plan: Plan, rp: SkinnyPlan | None, r: Region, low: Lowered) -> Any:
    if rp is None or _tiny_k(r, low):
        return
    for rows in (rp.rows * 2, rp.rows // 2):
        if 1 <= rows <= 16 and rows * rp.cols <= MAX_SUMS:
            yield from change("resize_grid", plan, rp, rows=rows)


def _take(plan: Plan, rp: SkinnyPlan | None, r: Region, low: Lowered) -> Any:
    """From cuBLAS into our kernel."""
    rows = form(r, low)
    if rp is None and not isinstance(rows, str):
        rp = tuned_plan(r.rid, rows)
        yield label("use_direct_kernel", r.rid, rows=rp.rows, cols=rp.cols), plan.add(rp)


def settle(plan: Plan, r: Region, low: Lowered, tuned: bool) -> Plan:
    """Tuned: the chain after the product fused on its stores. Plain: cuBLAS, unless nothing else would be
    ours (a lone linear layer): then our kernel, nothing fused."""
    if tuned:
        for _, p in _fuse(plan, plan.get(r.rid), r, low):
            plan = p
    elif plan.get(r.rid) is None and all(isinstance(x, SkinnyPlan) for x in plan.regions):
        rows = form(r, low)
        if not isinstance(rows, str):
            plan = plan.add(tuned_plan(r.rid, rows))
    return plan


def _note(regions: list[Region], low: Lowered) -> str:
    targets = ", ".join(r.node.target for r in regions)
    return f"our CUDA-core kernel for the few-row {targets} in the tuned plans, cuBLAS in the plain one"


FAMILY = Family(
    knobs=SkinnyPlan,
    claims=claims,
    first=first,
    render=render,
    edits={
        "use_direct_kernel": _take,
        "fuse_epilogue": _fuse,
        "coarsen_threads": _cols("coarsen_threads", 2),
        "more_parallelism": _cols("more_parallelism", 0.5),
        "resize_grid": _rows,
    },
    order=19,  # before the 3xTF32 family (21), which takes the fp32 linear layers with more rows
    settle=settle,
    plainest=lambda rp: None,
    note=_note,
    optional=True,
)

__all__ = ["FAMILY", "SkinnyPlan", "form"]
