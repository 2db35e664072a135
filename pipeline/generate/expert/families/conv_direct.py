"""Grouped and depthwise convolutions (conv1d/2d/3d with groups > 1, forward or transposed), and strided
transposed ones with few products an output (ConvForm.sparse), on the CUDA cores: a direct kernel
(templates/conv_direct.py). The plain plan keeps cuDNN, the tuned one takes our kernel; the
search keeps whichever measures faster.

The elementwise region after it (the convolution's bias among it) is fused on its stores in the tuned plan
(the same epilogue rule as the implicit GEMM's: families/conv_tf32.py). Edits: use_direct_kernel (from
cuDNN), fuse_epilogue, coarsen_threads (outputs a thread x2, up to 8), more_parallelism (x1/2),
resize_grid (threads x2 and /2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert.families import common, gemm_kit
from pipeline.generate.expert.families.base import Family, RenderError, label
from pipeline.generate.expert.families.conv_tf32 import epilogue, parse
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates import conv_direct
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.conv_tf32 import ConvForm

DTYPES = ("float32", "float16", "bfloat16")
MAX_OUTS = 8


@dataclass(frozen=True)
class DirectPlan(RegionPlan):
    TAG: ClassVar[str] = "direct_conv"
    SHOWN: ClassVar[tuple[str, ...]] = ("outs", "threads")
    ABSORBS: ClassVar[tuple[str, ...]] = ("epilogue",)

    outs: int = 4  # outputs of one row a thread computes (each weight read once for them); 4 measured
    # 1.3x faster than 2 on a large depthwise 3x3 (docs/benchmarks.md)
    threads: int = 256
    epilogue: str = ""  # rid of the ew region computed on the sums before the one store


def form(r: Region, low: Lowered) -> ConvForm | str:
    """The geometry when our direct kernel computes this library region, else why not."""
    f = parse(r, low, DTYPES, "fp32, fp16 or bf16")
    if isinstance(f, str):
        return f
    if f.groups == 1 and not f.sparse:
        return "an ungrouped convolution is an implicit GEMM's (families/conv_tf32.py)"
    return f


def claims(r: Region, low: Lowered) -> bool:
    return not isinstance(form(r, low), str)


def first(r: Region, low: Lowered, tuned: bool) -> DirectPlan | None:
    """Plain: cuDNN. Tuned: our kernel, four outputs a thread."""
    return DirectPlan(r.rid) if tuned else None


def render(r: Region, rp: DirectPlan, low: Lowered, hunter: Any) -> Code:
    f = form(r, low)
    if isinstance(f, str):
        raise RenderError(f"region {r.rid} cannot be our direct convolution: {f}")
    epi = epilogue(r, low) if rp.epilogue else None
    if rp.epilogue and (epi is None or epi.region.rid != rp.epilogue):
        raise RenderError(f"region {r.rid}: the plan's fusion no longer applies")
    return conv_direct.render(r, f, rp, r.node.dtype, epi)


_fuse = gemm_kit.fuse_edit(epilogue)


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
    if rp is None:
        rp = DirectPlan(r.rid)
        yield label("use_direct_kernel", r.rid, outs=rp.outs, threads=rp.threads), plan.add(rp)


def _note(regions: list[Region], low: Lowered) -> str:
    targets = ", ".join(r.node.target for r in regions)
    return (
        f"our direct (CUDA-core) kernel for the grouped {targets} in the tuned plans, cuDNN in the plain one"
    )


FAMILY = Family(
    knobs=DirectPlan,
    claims=claims,
    first=first,
    render=render,
    edits={
        "use_direct_kernel": _take,
        "fuse_epilogue": _fuse,
        **common.output_edits(MAX_OUTS),
    },
    order=23,
    settle=settle,
    plainest=lambda rp: None,
    note=_note,
    optional=True,
)

__all__ = ["FAMILY", "DirectPlan", "form"]
