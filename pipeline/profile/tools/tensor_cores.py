"""A matmul-heavy task computed on the wrong units: FP32 FFMA instead of tensor cores, or Ampere-style
mma.sync (HMMA) instead of Hopper's asynchronous warpgroup MMA (HGMMA, wgmma.mma_async).

Peaks on the H200: ~67 TFLOP/s FP32 FFMA, ~495 TF32 and ~989 BF16 dense on tensor cores; mma.sync reaches
well under the WGMMA rate because a warp, not a warpgroup, feeds the tensor core synchronously from
registers. ncu: sm__inst_executed_pipe_tensor_op_hmma counts HMMA *and* HGMMA, _gmma only HGMMA, so
legacy mma.sync = hmma - gmma. The SASS opcode counts back this up when ncu is missing a metric.
"""

from __future__ import annotations

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register, sass_for
from pipeline.types import Finding

FFMA_SHARE = 0.5  # FFMA FLOPs at least half the task's FLOPs: the math runs on the FMA pipe
MIN_FLOPS = 1e8  # smaller contractions finish in microseconds whatever units they use
# Below the ridge, FFMA-heavy code is a contraction only if its FMAs consume loaded operands: a naive GEMM
# loads ~2 values per FMA, a register-tiled one ~1 per 4-16; a Horner polynomial loads 1 per 127.
OPERANDS_PER_FFMA = 0.05


def _counts(ev: Evidence) -> dict[str, float]:
    ours = ev.kernels  # every kernel of the call: a hybrid's GEMM runs in a library kernel
    c = {
        "ffma": sum(k.get("sm__sass_thread_inst_executed_op_ffma_pred_on.sum") for k in ours),
        "hmma": sum(k.get("sm__inst_executed_pipe_tensor_op_hmma.sum") for k in ours),
        "gmma": sum(k.get("sm__inst_executed_pipe_tensor_op_gmma.sum") for k in ours),
    }
    loads = sum(k.get(f"smsp__sass_inst_executed_op_{m}_ld.sum") for k in ours for m in ("global", "shared"))
    c["operands_per_ffma"] = 32 * loads / c["ffma"] if c["ffma"] else 0.0  # warp instructions x 32 lanes
    dom = ev.dominant()
    sass = sass_for(ev, dom.name if dom else None)
    c["sass.HMMA"] = float(sum(s.count("HMMA") for s in sass))
    c["sass.HGMMA"] = float(sum(s.count("HGMMA") + s.count("QGMMA") for s in sass))
    c["sass.FFMA"] = float(sum(s.count("FFMA") for s in sass))
    return c


def _contraction(c: dict[str, float], cls: Classification, flops: float) -> bool:
    above_ridge = cls.ridge is not None and cls.task_intensity > cls.ridge
    ffma_share = 2 * c["ffma"] / flops if flops else 0.0
    fed = ffma_share >= FFMA_SHARE and c["operands_per_ffma"] >= OPERANDS_PER_FFMA
    return flops >= MIN_FLOPS and (above_ridge or fed)


def is_contraction(ev: Evidence, cls: Classification) -> bool:
    """A matmul-like task: above the ridge, or FFMA-heavy with the FMAs fed by loaded operands."""
    return _contraction(_counts(ev), cls, ev.task.flops)


class TensorCores:
    name = "tensor_cores"
    applies_to = frozenset({Bound.COMPUTE, Bound.LATENCY, Bound.MEMORY})  # a naive GEMM is often L1-bound
    needs = frozenset({"ncu"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        flops = ev.task.flops
        if flops < MIN_FLOPS:
            return []
        c = _counts(ev)
        ffma_share = 2 * c["ffma"] / flops
        legacy = max(c["hmma"] - c["gmma"], 0.0) or (c["sass.HMMA"] if not c["sass.HGMMA"] else 0.0)
        tensor = c["hmma"] + c["gmma"] + c["sass.HMMA"] + c["sass.HGMMA"]
        evidence = {
            "sm__sass_thread_inst_executed_op_ffma_pred_on.sum": c["ffma"],
            "sm__inst_executed_pipe_tensor_op_hmma.sum": c["hmma"],
            "sm__inst_executed_pipe_tensor_op_gmma.sum": c["gmma"],
            "sass.HMMA": c["sass.HMMA"],
            "sass.HGMMA": c["sass.HGMMA"],
            "task_flops": flops,
            "task_intensity": round(cls.task_intensity, 1),
            "ridge": round(cls.ridge or 0.0, 1),
            "fraction_of_floor": round(1 - headroom(cls), 4),
        }
        room = headroom(cls)
        contraction = _contraction(c, cls, flops)
        evidence["operands_per_ffma"] = round(c["operands_per_ffma"], 3)
        if not tensor and contraction and ffma_share >= 0.25:
            fp32 = ev.task.dtype == "float32"
            c_ = ev.ceilings  # measured on this GPU (cuBLAS); else the datasheet's 67 / 495 / 989
            tc = (c_.tf32_flops if fp32 else c_.bf16_flops) / 1e12 if c_ else (495.0 if fp32 else 989.0)
            rates = (c_.fp32_flops / 1e12 if c_ else 67.0, tc)
            diagnosis = (
                f"The task is a matmul-like contraction ({cls.task_intensity:.0f} FLOP/byte against a "
                f"ridge of {cls.ridge or 0:.0f}) but {100 * min(ffma_share, 1):.0f}% of its FLOPs run as "
                f"FP32 FFMA with no tensor-core instruction: FP32 math tops out near {rates[0]:.0f} TFLOP/s "
                f"against ~{rates[1]:.0f} ({'TF32' if fp32 else 'BF16'}) on tensor cores."
            )
            advice = (
                "Tile the product through shared memory and compute the tiles on tensor cores: WGMMA "
                "(wgmma.mma_async / CuTe SM90 GMMA atoms, CUTLASS example 48) fed by TMA"
                + ("; for fp32 accuracy use 3xTF32 (big+small split, CUTLASS example 27)." if fp32 else ".")
            )
            edits = ("use_tensor_cores", "tile_shared_memory", "use_wgmma")
            severity = capped(0.55 + 0.4 * room, cls)
        elif legacy and not c["gmma"] and not c["sass.HGMMA"]:
            diagnosis = (
                f"The tensor-core work runs as Ampere-style mma.sync (HMMA: {legacy / 1e6:.1f} M warp "
                "instructions, no HGMMA): on Hopper a single warp feeding the tensor core "
                "synchronously from registers reaches well under the warpgroup MMA rate "
                f"({100 * (1 - room):.0f}% of the floor)."
            )
            advice = (
                "Move the mainloop to wgmma.mma_async on 64xNx16 warpgroup tiles with operands in "
                "shared memory (swizzled layouts), loaded by TMA into a 3-4 stage mbarrier pipeline "
                "(CuTe tutorial hopper/wgmma_tma_sm90.cu)."
            )
            edits = ("use_wgmma", "use_tma", "pipeline_loads")
            severity = capped(0.45 + 0.45 * room, cls)
        else:
            return []
        return [finding(self.name, severity, evidence, diagnosis, advice, edits, round(room * 0.8, 2))]


register(TensorCores())
