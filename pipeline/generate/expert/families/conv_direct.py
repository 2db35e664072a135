"""Grouped and depthwise convolutions (conv1d/2d/3d with groups > 1, forward or transposed), strided
transposed ones with few products an output (ConvForm.sparse) and narrow ungrouped ones (ConvForm.narrow:
few output channels or products an output), on the CUDA cores: a direct kernel
(templates/conv_direct.py). The plain plan keeps cuDNN, the tuned one takes our kernel; the
search keeps whichever measures faster.

The elementwise region after it (the convolution's bias among it) is fused on its stores in the tuned plan
(the same epilogue rule as the implicit GEMM's: families/conv_tf32.py). Edits: use_direct_kernel (from
cuDNN), fuse_epilogue, coarsen_threads (outputs of a row a thread x2, up to 8; or output channels x2, up
to the group's; or, where windows overlap vertically, output rows x2, up to 8; all within MAX_ACC
accumulators), more_parallelism (rows, then channels, then outputs, x1/2), pipeline_loads
(the other loop order: input channels innermost or outermost), resize_grid (threads x2 and /2),
coalesce_accesses (a strided transposed one's stores staged through shared memory, or not).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from pipeline.generate.expert.families import common, gemm_kit
from pipeline.generate.expert.families.base import Family, RenderError, change, label
from pipeline.generate.expert.families.conv_tf32 import epilogue, parse
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates import conv_direct
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.conv_tf32 import ConvForm

DTYPES = ("float32", "float16", "bfloat16")
MAX_OUTS = 8
MAX_CHANS = 16
MAX_ACC = 32  # accumulators a thread (rows x outs x chans): 64 took 255 registers on a grouped 3-D one
MAX_ROWS = 8


@dataclass(frozen=True)
class DirectPlan(RegionPlan):
    TAG: ClassVar[str] = "direct_conv"
    SHOWN: ClassVar[tuple[str, ...]] = ("outs", "chans", "threads")
    ABSORBS: ClassVar[tuple[str, ...]] = ("epilogue",)

    outs: int = 4  # outputs of one row a thread computes (each weight read once for them); 4 measured
    # 1.3x faster than 2 on a large depthwise 3x3 (docs/benchmarks.md)
    threads: int = 256
    chans: int = 1  # output channels of one group a thread computes (each input read once for them)
    ci_inner: bool = False  # input channels innermost: a tap's coordinates computed once for all of them
    staged: bool = False  # a strided transposed one's stores through shared memory, in column order
    epilogue: str = ""  # rid of the ew region computed on the sums before the one store
    rows: int = 1  # output rows a thread computes where windows overlap vertically: each input row read once
    # for them (templates/conv_direct.py)


def form(r: Region, low: Lowered) -> ConvForm | str:
    """The geometry when our direct kernel computes this library region, else why not."""
    f = parse(r, low, DTYPES, "fp32, fp16 or bf16")
    if isinstance(f, str):
        return f
    if not f.direct:
        return "an ungrouped convolution is an implicit GEMM's (families/conv_tf32.py)"
    return f


def claims(r: Region, low: Lowered) -> bool:
    return not isinstance(form(r, low), str)


def chans(f: ConvForm, outs: int) -> int:
    """The most output channels a thread can take: a power of two that divides the group's, within
    MAX_CHANS and MAX_ACC accumulators (`outs` a channel's: outputs of a row x rows)."""
    cout_g = f.cout // f.groups
    return next(c for c in (16, 8, 4, 2, 1) if c <= MAX_CHANS and cout_g % c == 0 and c * outs <= MAX_ACC)


def tuned_plan(rid: str, f: ConvForm) -> DirectPlan:
    """Up to 8 channels a thread, 2 outputs each when 8, else 4: on the H200 8 x 2 (64-72 registers) beat 8
    x 4 (96-128) on 4 of 5 convolutions, 4 x 4 won the fifth, and 1 x 4 is the depthwise one's best. Input
    channels innermost when a group has several: 1.07-1.64x faster on all 6 convolutions timed both ways.
    A strided transposed one's stores staged where they fit (its phases' columns are `stride` apart: a
    warp's store fills 1/stride of the sectors it touches); not yet timed against the unstaged stores, which
    coalesce_accesses gives back. One output row a thread: a column of them (DirectPlan.rows) is
    coarsen_threads' until it is timed."""
    c = min(8, chans(f, 2))
    rp = DirectPlan(rid, outs=2 if c == 8 else 4, chans=c, ci_inner=f.cin // f.groups > 1)
    return replace(rp, staged=not conv_direct.why_unstageable(f, rp))


def first(r: Region, low: Lowered, tuned: bool) -> DirectPlan | None:
    """Plain: cuDNN. Tuned: our kernel, several channels a thread."""
    f = form(r, low)
    if not tuned or isinstance(f, str):
        return None
    return tuned_plan(r.rid, f)


def render(r: Region, rp: DirectPlan, low: Lowered, hunter: Any) -> Code:
    f = form(r, low)
    if isinstance(f, str):
        raise RenderError(f"region {r.rid} cannot be our direct convolution: {f}")
    epi = gemm_kit.planned_epilogue(rp, r, low, epilogue)
    sinkable = common.output_feeds_copy(r, epi, low, max_dim=1)  # whole images a slice
    return conv_direct.render(r, f, rp, r.node.dtype, epi, sinkable=sinkable)


_fuse = gemm_kit.fuse_edit(epilogue)
OUTPUT_EDITS = common.output_edits(MAX_OUTS)


def _coarsen(plan: Plan, rp: DirectPlan | None, r: Region, low: Lowered) -> common.Moves:
    """More outputs of a row a thread, or more channels (inputs read fewer times), or where windows overlap
    vertically more output rows (each input row read once for them, not once for each through L2)."""
    if rp is None:
        return
    f = form(r, low)
    if rp.outs * 2 * rp.chans * rp.rows <= MAX_ACC:
        yield from OUTPUT_EDITS["coarsen_threads"](plan, rp, r, low)
    if isinstance(f, str):
        return
    if chans(f, rp.outs * rp.rows) >= rp.chans * 2:
        yield from change("coarsen_threads", plan, rp, chans=rp.chans * 2)
    taller = replace(rp, rows=rp.rows * 2)
    fits = taller.rows <= MAX_ROWS and rp.outs * rp.chans * taller.rows <= MAX_ACC
    if fits and not conv_direct.why_no_rows(f, taller):
        yield from change("coarsen_threads", plan, rp, rows=taller.rows)


def _order(plan: Plan, rp: DirectPlan | None, r: Region, low: Lowered) -> common.Moves:
    """The other loop order: input channels innermost (a tap's coordinates once for all of them, their
    loads independent) or outermost."""
    f = form(r, low)
    if rp is not None and not isinstance(f, str) and f.cin // f.groups > 1:
        yield from change("pipeline_loads", plan, rp, ci_inner=not rp.ci_inner)


def _parallelism(plan: Plan, rp: DirectPlan | None, r: Region, low: Lowered) -> common.Moves:
    """Fewer output rows a thread first, then fewer channels, then fewer outputs of a row."""
    if rp is not None and rp.rows > 1:
        yield from change("more_parallelism", plan, rp, rows=rp.rows // 2)
    if rp is not None and rp.chans > 1:
        yield from change("more_parallelism", plan, rp, chans=rp.chans // 2)
    yield from OUTPUT_EDITS["more_parallelism"](plan, rp, r, low)


def _stores(plan: Plan, rp: DirectPlan | None, r: Region, low: Lowered) -> common.Moves:
    """Staged stores on or off (a strided transposed convolution's: its columns in order through shared
    memory, or each thread its own columns, a phase's `stride` apart)."""
    f = form(r, low)
    if rp is not None and not isinstance(f, str) and (rp.staged or not conv_direct.why_unstageable(f, rp)):
        yield from change("coalesce_accesses", plan, rp, staged=not rp.staged)


def _staging_kept(edit: Any) -> Any:
    """An edit's moves less those a staged plan cannot take: one whose segment no longer fits, or a block
    size (a staged block is its phases' lanes)."""

    def moves(plan: Plan, rp: DirectPlan | None, r: Region, low: Lowered) -> common.Moves:
        f = form(r, low)
        for name, p in edit(plan, rp, r, low):
            q = p.get(r.rid)
            staged = isinstance(q, DirectPlan) and q.staged and not isinstance(f, str)
            if staged and (conv_direct.why_unstageable(f, q) or (rp is not None and q.threads != rp.threads)):
                continue
            yield name, p

    return moves


def settle(plan: Plan, r: Region, low: Lowered, tuned: bool) -> Plan:
    """Tuned: the chain after the convolution fused on its stores. Plain: cuDNN, unless nothing else would
    be ours (a lone depthwise convolution): then our kernel, nothing fused."""
    if tuned:
        for _, p in _fuse(plan, plan.get(r.rid), r, low):
            plan = p
    elif plan.get(r.rid) is None and all(isinstance(x, DirectPlan) for x in plan.regions):
        plan = plan.add(DirectPlan(r.rid))
    return plan


def _take(plan: Plan, rp: DirectPlan | None, r: Region, low: Lowered) -> Any:
    """From cuDNN into our kernel."""
    f = form(r, low)
    if rp is None and not isinstance(f, str):
        rp = tuned_plan(r.rid, f)
        yield (
            label("use_direct_kernel", r.rid, outs=rp.outs, chans=rp.chans, threads=rp.threads),
            plan.add(rp),
        )


def _note(regions: list[Region], low: Lowered) -> str:
    targets = ", ".join(r.node.target for r in regions)
    return (
        f"our direct (CUDA-core) kernel for the grouped, sparse or narrow {targets} in the tuned plans, cuDNN "
        "in the plain one"
    )


FAMILY = Family(
    knobs=DirectPlan,
    claims=claims,
    first=first,
    render=render,
    edits={
        "use_direct_kernel": _take,
        "fuse_epilogue": _fuse,
        **{name: _staging_kept(edit) for name, edit in OUTPUT_EDITS.items()},
        "coarsen_threads": _staging_kept(_coarsen),
        "more_parallelism": _staging_kept(_parallelism),
        "pipeline_loads": _order,
        "coalesce_accesses": _stores,
    },
    order=23,
    settle=settle,
    plainest=lambda rp: None,
    note=_note,
    optional=True,
)

__all__ = ["FAMILY", "DirectPlan", "form"]
