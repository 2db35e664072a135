"""Stage 1: where the candidate stands against the roofline, and which class of bottleneck it has.

memory-bound: DRAM (or L2) throughput is the busiest unit; compute-bound: an SM pipe is; latency-bound:
neither is above 60% of its peak (too little work in flight: occupancy, stalls, a small grid);
launch-bound: the GPU is idle for most of a call's wall time (many small launches, host work).
Only the stage-2 tools that apply to the class run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pipeline.calibrate import floor_ms
from pipeline.profile.evidence import Evidence

BUSY_PCT = 60.0  # below this on both DRAM and SM, the unit is waiting, not working (ncu's own split)
LAUNCH_IDLE = 0.5  # GPU busy under half of a call's device time, calls queued back to back
LAUNCH_MIN_KERNELS = 4  # ... over at least this many launches per call
TINY_KERNEL_US = 5.0  # a kernel shorter than a launch's host cost (a few us) cannot keep the GPU fed


class Bound(enum.StrEnum):
    MEMORY = "memory"
    COMPUTE = "compute"
    LATENCY = "latency"
    LAUNCH = "launch"


@dataclass(frozen=True)
class Classification:
    bound: Bound
    time_ms: float | None
    floor_ms: float | None
    task_intensity: float  # FLOPs per minimal byte
    ridge: float | None  # FLOPs per byte where the task's dtype peak meets copy bandwidth
    dram_pct: float  # ncu, time-weighted over our kernels
    sm_pct: float
    achieved_bytes_per_s: float | None
    achieved_flops: float | None
    busy_fraction: float | None  # GPU busy / device time per call (harness timing; else profiler wall)
    summary: str

    @property
    def fraction_of_floor(self) -> float | None:
        if self.floor_ms is None or not self.time_ms:
            return None
        return self.floor_ms / self.time_ms


def _weighted(ev: Evidence, metric: str) -> float:
    # Over every kernel of the call, library ones included: a hybrid whose cuBLAS GEMM takes 85% of the
    # time is where the GEMM is, not where its small epilogue is.
    kernels = ev.kernels
    total = ev.total("gpu__time_duration.sum")
    if total <= 0:
        return max((k.get(metric) for k in kernels), default=0.0)
    return sum(k.get(metric) * k.get("gpu__time_duration.sum") * ev.weight(k) for k in kernels) / total


def achieved_flops_count(ev: Evidence) -> float:
    """FLOPs the hardware executed: add + mul + 2 x fma per thread instruction, plus tensor-core FLOPs."""
    total = 0.0
    for k in ev.kernels:
        w = ev.weight(k)
        for prec in ("f", "d", "h"):
            total += w * k.get(f"sm__sass_thread_inst_executed_op_{prec}add_pred_on.sum")
            total += w * k.get(f"sm__sass_thread_inst_executed_op_{prec}mul_pred_on.sum")
            total += 2 * w * k.get(f"sm__sass_thread_inst_executed_op_{prec}fma_pred_on.sum")
        for src in ("bf16_dst_fp32", "fp16", "fp8", "tf32_dst_fp32"):
            total += w * k.get(f"sm__ops_path_tensor_src_{src}.sum")  # counts 2 per FMA already
    return total


def classify(ev: Evidence) -> Classification:
    task = ev.task
    time_ms = ev.timing.median_ms if ev.timing else None
    floor = floor_ms(task, ev.ceilings) if ev.ceilings else None
    intensity = task.flops / task.min_bytes if task.min_bytes else 0.0
    ridge = ev.ceilings.peak_flops(task.dtype) / ev.ceilings.copy_bytes_per_s if ev.ceilings else None
    dram = _weighted(ev, "dram__throughput.avg.pct_of_peak_sustained_elapsed")
    sm = _weighted(ev, "sm__throughput.avg.pct_of_peak_sustained_elapsed")
    l2 = _weighted(ev, "lts__throughput.avg.pct_of_peak_sustained_elapsed")
    bytes_moved = ev.total("dram__bytes_read.sum") + ev.total("dram__bytes_write.sum")
    achieved_bw = bytes_moved / (time_ms * 1e-3) if time_ms and bytes_moved else None
    flops = achieved_flops_count(ev)
    achieved_flops = flops / (time_ms * 1e-3) if time_ms and flops else None
    busy = None
    if ev.system and ev.system.get("gpu_busy_us_per_call") is not None:
        # Over the harness's device time (calls queued back to back, so only launches the host cannot issue
        # fast enough leave the GPU idle), not the profiler's wall time: that carries the profiler's own
        # overhead and a synchronised call's fixed cost (0.1-0.6 ms on the H200), which made every single
        # ~70 us kernel look launch-bound.
        per_call_us = time_ms * 1e3 if time_ms else ev.system.get("wall_us_per_call")
        if per_call_us:
            busy = min(1.0, ev.system["gpu_busy_us_per_call"] / per_call_us)
    # Many launches and an idle GPU, or many launches each shorter than it takes the host to issue one:
    # launch-bound. One slow launch is the launch_overhead tool's business, not a class: nothing to fuse.
    launches = ev.system.get("kernels_per_call", 0) if ev.system else 0
    per_kernel_us = ev.system["gpu_busy_us_per_call"] / launches if launches else None
    idle = busy is not None and busy < LAUNCH_IDLE
    tiny = per_kernel_us is not None and per_kernel_us < TINY_KERNEL_US
    if launches >= LAUNCH_MIN_KERNELS and (idle or tiny):
        bound = Bound.LAUNCH
        why = f"{launches:.0f} kernel launches per call, {per_kernel_us:.1f} us of GPU work each" + (
            f", the GPU busy {100 * busy:.0f}% of the call" if busy is not None else ""
        )
    elif max(dram, l2, sm) < BUSY_PCT:
        bound = Bound.LATENCY
        why = f"DRAM at {dram:.0f}%, L2 at {l2:.0f}% and SM at {sm:.0f}% of peak: the units wait more than they work"
    elif max(dram, l2) >= sm:
        bound = Bound.MEMORY
        why = f"memory is the busiest unit (DRAM {dram:.0f}%, L2 {l2:.0f}% of peak; SM {sm:.0f}%)"
    else:
        bound = Bound.COMPUTE
        why = f"the SM pipes are the busiest unit ({sm:.0f}% of peak; DRAM {dram:.0f}%)"
    parts = [f"{bound.value}-bound: {why}"]
    if time_ms is not None and floor is not None:
        parts.append(
            f"{time_ms:.4f} ms against a floor of {floor:.4f} ms ({100 * floor / time_ms:.0f}% of the floor)"
        )
    if ridge:
        kind = "compute" if intensity > ridge else "memory"
        parts.append(
            f"the task needs {intensity:.1f} FLOP/byte against a ridge of {ridge:.0f}: its floor is {kind}"
        )
    return Classification(
        bound=bound, time_ms=time_ms, floor_ms=floor, task_intensity=intensity, ridge=ridge, dram_pct=dram,
        sm_pct=sm, achieved_bytes_per_s=achieved_bw, achieved_flops=achieved_flops, busy_fraction=busy,
        summary="; ".join(parts),
    )  # fmt: skip
