"""fp32 GEMMs (linear layers, matmul, mm, addmm, bmm) on the tensor cores at fp32 accuracy: our 3xTF32 WGMMA
kernel (templates/gemm_tf32.py), with the elementwise region after it fused on its stores. Left to
cuBLAS's fp32 path they run on the CUDA cores (about 50 TFLOP/s on the H200). The plain plan keeps
cuBLAS, the tuned one takes our kernel, a failing one goes back to cuBLAS in a repair. Knobs and edits:
gemm_kit.py (tiles 128 x 128, 32 deep; templates/gemm_tf32.py says why not 256). A row-major B is
gathered K-major before the kernel (tf32 WGMMA reads K-major operands only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.generate.expert.families import gemm_kit
from pipeline.generate.expert.families.gemm_kit import GemmPlan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates import gemm_tf32
from pipeline.generate.expert.templates.gemm import Form


@dataclass(frozen=True)
class Tf32Plan(GemmPlan):
    TAG: ClassVar[str] = "wgmma_3xtf32"
    BK: ClassVar[int] = gemm_tf32.BK


SPEC = gemm_kit.Spec(
    knobs=Tf32Plan,
    dtypes=("float32",),
    what="fp32",
    align=4,
    tiles=lambda f: gemm_tf32.TILE_N,
    max_stages=lambda bn, f: gemm_tf32.max_stages(bn),
    render=gemm_tf32.render,
    kernel="3xTF32 WGMMA kernel (fp32 accuracy on the tensor cores)",
    order=21,
)
FAMILY = gemm_kit.family(SPEC)


def form(r: Region, low: Lowered) -> Form | str:
    """The operands' form when our 3xTF32 kernel can compute this library region, else why not."""
    return gemm_kit.form(r, low, SPEC)


__all__ = ["FAMILY", "SPEC", "Tf32Plan", "form"]
