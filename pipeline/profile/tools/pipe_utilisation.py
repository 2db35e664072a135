"""The busiest SM execution pipe and what it says about the source.

sm__pipe_*_cycles_active: share of cycles a pipe is busy. A saturated FMA pipe is plain FP32 math; a busy
ALU pipe is integer and logic work, mostly index arithmetic (division, modulo, 64-bit address math); any
FP64 activity in a float32 task is a silent promotion (a `1.0` literal, `exp` instead of `expf`), and on
the H200 FP64 runs at half the FP32 rate. The tensor pipe busy is the goal of a GEMM, not a flaw.
"""

from __future__ import annotations

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register
from pipeline.profile.tools.tensor_cores import is_contraction
from pipeline.types import Finding

PIPES = {
    "fma": "FMA (FP32 multiply-add)",
    "alu": "ALU (integer and logic)",
    "fp64": "FP64",
    "tensor_op_hmma": "tensor",
}
BUSY = 60.0  # the ncu rule's "high" band starts here
FP64_FIRES = 5.0  # % of cycles: more than a stray conversion


def _metric(pipe: str) -> str:
    return f"sm__pipe_{pipe}_cycles_active.avg.pct_of_peak_sustained_active"


class PipeUtilisation:
    name = "pipe_utilisation"
    applies_to = frozenset({Bound.COMPUTE, Bound.LATENCY})
    needs = frozenset({"ncu"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        k = ev.dominant()
        if k is None:
            return []
        busy = {p: k.metrics[_metric(p)] for p in PIPES if _metric(p) in k.metrics}
        if not busy:
            return []
        top = max(busy, key=lambda p: busy[p])
        evidence = {_metric(p): v for p, v in busy.items()}
        room = headroom(cls)
        if ev.task.dtype in ("float32", "bfloat16", "float16") and busy.get("fp64", 0) >= FP64_FIRES:
            dfma = k.get("sm__sass_thread_inst_executed_op_dfma_pred_on.sum")
            evidence["sm__sass_thread_inst_executed_op_dfma_pred_on.sum"] = dfma
            diagnosis = (
                f"The FP64 pipe is busy {busy['fp64']:.0f}% of cycles in a {ev.task.dtype} task: "
                "double-precision literals (1.0, 0.5) or functions (exp, sqrt, pow without the f "
                "suffix) promote the arithmetic to double, which runs at half the FP32 rate."
            )
            advice = "Write float literals with the f suffix (1.0f) and call expf/sqrtf/powf or __expf."
            severity = capped(0.3 + 0.6 * busy["fp64"] / 100 + 0.2 * room, cls)
            return [finding(self.name, severity, evidence, diagnosis, advice, (), round(room * 0.5, 2))]
        if busy[top] < BUSY or top == "tensor_op_hmma":
            return []
        if top == "alu":
            diagnosis = (
                f"The ALU pipe is busy {busy['alu']:.0f}% of cycles: integer and logic work — index "
                "arithmetic with division or modulo, 64-bit address math, comparisons — competes "
                "with the useful math."
            )
            advice = (
                "Hoist index math out of inner loops, replace / and % by shifts and masks or "
                "precomputed strides, and give each thread several elements so it is amortised."
            )
            edits: tuple[str, ...] = ("coarsen_threads",)
        elif top == "fp64":
            diagnosis = (
                f"The FP64 pipe is busy {busy['fp64']:.0f}% of cycles: double precision runs at half rate."
            )
            advice = "Keep the arithmetic in FP32 unless the task needs double precision."
            edits = ()
        elif is_contraction(ev, cls):
            diagnosis = (
                f"The FMA pipe is busy {busy['fma']:.0f}% of cycles on a matmul-like task: FP32 FFMA is the "
                "limit, at a seventh of the tensor cores' TF32 rate."
            )
            advice = "Move the contraction onto tensor cores (3xTF32 for fp32 accuracy, WGMMA for bf16)."
            edits = ("use_tensor_cores",)
        else:
            # FMA-bound on work tensor cores cannot do (a polynomial, a stencil): this is the FP32 roofline.
            diagnosis = (
                f"The FMA pipe is busy {busy['fma']:.0f}% of active cycles: while SMs are busy they run at the "
                "FP32 arithmetic limit; only fewer FLOPs per result make that part faster."
            )
            advice = (
                "Cut FP32 work per output (algebraic simplification, reuse of shared subexpressions); a "
                "log or exp computed by its libm polynomial can go to the special-function unit "
                "(lg2.approx / ex2.approx, as __logf and __expf do) within fp32 tolerance."
            )
            edits = ("use_intrinsics",)
            room = min(room, 0.2)  # at a real roofline, whatever the task's tensor-core floor says
        severity = capped(0.15 + 0.3 * room, cls)
        return [finding(self.name, severity, evidence, diagnosis, advice, edits, round(room * 0.3, 2))]


register(PipeUtilisation())
