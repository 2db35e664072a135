"""16-bit GEMMs (linear layers, matmul, mm, addmm, bmm) on our own Hopper kernel: TMA loads into a ring of
shared-memory stages, WGMMA on two consumer warpgroups, the elementwise region after it fused on its
stores (templates/gemm.py). The plain plan leaves a GEMM to cuBLAS unless nothing else is ours; the
tuned plan takes it, and a failing one goes back to cuBLAS in a repair. Knobs and edits: gemm_kit.py.
"""

from __future__ import annotations

from pipeline.generate.expert.families import gemm_kit
from pipeline.generate.expert.families.gemm_kit import GemmPlan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates import gemm
from pipeline.generate.expert.templates.gemm import Form, GemmEpilogue

SPEC = gemm_kit.Spec(
    knobs=GemmPlan,
    dtypes=tuple(gemm.CUTE_TYPES),
    what="bf16 or fp16",
    align=8,
    tiles=lambda f: gemm.TILE_N,
    max_stages=lambda bn, f: gemm.max_stages(bn),
    render=gemm.render,
    kernel="WGMMA kernel (TMA, tensor cores)",
)
FAMILY = gemm_kit.family(SPEC)


def form(r: Region, low: Lowered) -> Form | str:
    """The operands' form when our 16-bit WGMMA kernel can compute this library region, else why not."""
    return gemm_kit.form(r, low, SPEC)


def eligible(r: Region, low: Lowered) -> str:
    """ "" when our 16-bit WGMMA kernel can compute this library region, else why not."""
    f = form(r, low)
    return f if isinstance(f, str) else ""


def epilogue(host: Region, low: Lowered) -> GemmEpilogue | None:
    return gemm_kit.epilogue(host, low)


__all__ = ["FAMILY", "GemmPlan", "eligible", "epilogue", "form"]
