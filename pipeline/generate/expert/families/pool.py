"""Max and average pooling, 1-D to 3-D (max_pool1d/2d/3d, avg_pool1d/2d/3d; fp32, fp16, bf16), on the CUDA
cores (templates/pool.py): any kernel, stride, padding, dilation (max), ceil mode, count_include_pad and
divisor override. Max pooling that also returns indices stays in PyTorch. Both plans take our kernel (there
is no library anchor to keep). Edits: coarsen_threads (outputs of a row a thread x2, up to 8; or rows of
them x2), more_parallelism (rows, then outputs, x1/2), resize_grid (threads x2 and /2), tile_shared_memory
(windows overlapping along W: each window row's inputs staged in a warp's shared memory, a lane's consecutive
outputs computed from its span of it in registers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert.families import common
from pipeline.generate.expert.families.base import Family, RenderError, change
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates import pool
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.pool import PoolForm

OPS = {f"{kind}_pool{d}d": (kind, d) for kind in ("max", "avg") for d in (1, 2, 3)}
DTYPES = ("float32", "float16", "bfloat16")
MAX_OUTS = 8
MAX_ROWS = 8


@dataclass(frozen=True)
class PoolPlan(RegionPlan):
    TAG: ClassVar[str] = "pool"
    SHOWN: ClassVar[tuple[str, ...]] = ("outs", "rows", "threads", "stage")

    outs: int = 1  # outputs of one row a thread computes
    threads: int = 256
    stage: bool = False  # overlapping windows: window rows staged in shared memory (templates/pool.py)
    rows: int = 1  # outputs along H a thread computes where windows overlap vertically (templates/pool.py)


def _triple(v: Any, dims: int, default: int) -> tuple[int, int, int] | None:
    vals = list(v) if isinstance(v, list | tuple) else [v] if v is not None else []
    vals = vals or [default]
    if len(vals) == 1:
        vals = vals * dims
    if len(vals) != dims or not all(isinstance(x, int) for x in vals):
        return None
    full = [default] * (3 - dims) + vals
    return full[0], full[1], full[2]


def form(r: Region, low: Lowered) -> PoolForm | str:
    """The pool's geometry when our kernel computes this region, else why not."""
    n = r.node
    if r.kind is not RegionKind.TORCH or n.op not in OPS:
        return "not a max or average pool"
    kind, dims = OPS[n.op]
    x = low.by_name.get(getattr(n.args[0], "name", ""))
    if x is None or not x.shape or not n.shape or len(x.shape) not in (dims + 1, dims + 2):
        return "the input's shape is unknown or not (N, C, ...) / (C, ...)"
    if n.dtype not in DTYPES or x.dtype != n.dtype:
        return f"pooling takes fp32, fp16 or bf16, not {n.dtype}"
    a = [*n.args[1:], *([None] * 7)]
    kernel = _triple(a[0], dims, 1)
    stride = _triple(a[1] or a[0], dims, 1)
    pad = _triple(a[2] if a[2] is not None else 0, dims, 0)
    if kind == "max":
        dil = _triple(a[3] if a[3] is not None else 1, dims, 1)
        include, divisor = True, 0
    else:
        dil = (1, 1, 1)
        include = True if a[4] is None else bool(a[4])
        divisor = int(a[5] or 0) if dims > 1 else 0
    if kernel is None or stride is None or pad is None or dil is None:
        return "the pool's window arguments are not constant integers"
    size = (*[1] * (3 - dims), *x.shape[-dims:])
    out = (*[1] * (3 - dims), *n.shape[-dims:])
    return PoolForm(kind, dims, size, out, kernel, stride, pad, dil, include, divisor)


def claims(r: Region, low: Lowered) -> bool:
    return not isinstance(form(r, low), str)


def first(r: Region, low: Lowered, tuned: bool) -> PoolPlan:
    """Plain: an output a thread. Tuned: four of a row (each window row read once for them) and, where windows
    overlap vertically, four rows of them: the loads of a large window hit L1, whose wavefronts kept
    KernelBench's 4 x 4 max pool at 0.51 of its floor on the H200 (16 loads an output; 7 with a column of 4).
    Where windows overlap along W at stride 1 only, eight outputs of a row a lane from a warp's staged
    window row (templates/pool.py): a tap is a register, not a load (KernelBench's 1-D max pool 2.63 ->
    2.46 ms with one staging load in flight a lane). For KernelBench's 2-D one the warp's staged column of
    4 rows took 1.71 ms against the direct column's 1.38, so windows that overlap vertically stay direct."""
    if not tuned:
        return PoolPlan(r.rid)
    f = form(r, low)
    if isinstance(f, str):
        return PoolPlan(r.rid, outs=4)
    if pool.overlaps_rows(f):  # a column of 4 rows, direct: staged, 4 rows of 4 took 1.71 ms against 1.38
        return PoolPlan(r.rid, outs=4, rows=4)
    slide = PoolPlan(r.rid, outs=MAX_OUTS, stage=True)
    return slide if f.stride[2] == 1 and pool.staged(f, slide) else PoolPlan(r.rid, outs=4)


def _coarsen(plan: Plan, rp: PoolPlan, r: Region, low: Lowered) -> common.Moves:
    """More outputs of a row a thread, else (windows overlapping vertically) more rows of them."""
    yield from OUTPUT_EDITS["coarsen_threads"](plan, rp, r, low)
    f = form(r, low)
    if not isinstance(f, str) and pool.overlaps_rows(f) and rp.rows * 2 <= MAX_ROWS:
        yield from change("coarsen_threads", plan, rp, rows=rp.rows * 2)


def _parallelism(plan: Plan, rp: PoolPlan, r: Region, low: Lowered) -> common.Moves:
    """Fewer rows a thread first, then fewer outputs of a row."""
    if rp.rows > 1:
        yield from change("more_parallelism", plan, rp, rows=rp.rows // 2)
    yield from OUTPUT_EDITS["more_parallelism"](plan, rp, r, low)


def _stage(plan: Plan, rp: PoolPlan, r: Region, low: Lowered) -> common.Moves:
    f = form(r, low)
    if not rp.stage and not isinstance(f, str) and pool.staged(f, dataclasses.replace(rp, stage=True)):
        yield from change("tile_shared_memory", plan, rp, stage=True)


OUTPUT_EDITS = common.output_edits(MAX_OUTS)


def render(r: Region, rp: PoolPlan, low: Lowered, hunter: Any) -> Code:
    f = form(r, low)
    if isinstance(f, str):
        raise RenderError(f"region {r.rid} cannot be our pool: {f}")
    return pool.render(r, f, rp, r.node.dtype or "float32")


def declines(r: Region, low: Lowered) -> str:
    """Why a pool stays PyTorch's ("" for any other op)."""
    if r.kind is not RegionKind.TORCH or r.node.op not in OPS:
        return ""
    f = form(r, low)
    return f if isinstance(f, str) else ""


FAMILY = Family(
    knobs=PoolPlan,
    claims=claims,
    first=first,
    render=render,
    declines=declines,
    edits={
        **OUTPUT_EDITS,
        "coarsen_threads": _coarsen,
        "more_parallelism": _parallelism,
        "tile_shared_memory": _stage,
    },
    order=12,
)
