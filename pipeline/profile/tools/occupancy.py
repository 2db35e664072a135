"""Too few warps resident per SM to hide memory and pipeline latency, and what caps them.

An H200 SM holds 64 warps, 32 blocks, 65,536 registers and 228 KB of shared memory (1 KB of it reserved
per block). ncu reports how many blocks each resource allows (launch__occupancy_limit_*); the smallest is
the limiter, and the fix depends on which it is. Latency-bound kernels suffer most; a compute-bound GEMM
at low occupancy is normal, so this tool does not run there.
"""

from __future__ import annotations

from pipeline.profile.collect import KernelCounters
from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register
from pipeline.types import Finding

MAX_WARPS = 64
THEORETICAL_FIRES = 50.0  # % of 64 warps; below this the latency-hiding pool is thin
GAP_FIRES = 20.0  # achieved this many points under theoretical: warps leave early or blocks are uneven
LIMITS = ("registers", "shared_mem", "warps", "blocks")


# limiter -> (cause, fix, edits), formatted with the kernel's launch figures
# fmt: off
WHY: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "registers": ("{regs:.0f} registers per thread x {threads:.0f} threads allow only {blocks:.0f} block(s) in 65,536 "
                  "registers", "Cap registers with __launch_bounds__({threads:.0f}, minBlocksPerSM) or shrink per-thread "
                  "state (fewer accumulators, less unrolling, recompute cheap indices)",
                  ("reduce_registers", "increase_occupancy")),
    "shared_mem": ("{smem_kb:.1f} KB of shared memory per block (+1 KB reserved) allow only {blocks:.0f} block(s) in "
                   "228 KB", "Use smaller tiles or fewer pipeline stages, or reuse one buffer across phases, so that "
                   "more blocks fit", ("increase_occupancy", "resize_grid")),
    "blocks": ("blocks of only {threads:.0f} threads: the 32-blocks-per-SM limit leaves {threads:.0f} warps' worth",
               "Launch at least 128-256 threads per block (give each block more rows or elements)",
               ("resize_grid", "increase_occupancy")),
    "warps": ("{threads:.0f}-thread blocks do not divide 2,048 threads per SM evenly",
              "Use a block size that divides 2,048 (128, 256, 512)", ("resize_grid",)),
}
# fmt: on


def _why(limiter: str, k: KernelCounters, blocks: float) -> tuple[str, str, tuple[str, ...]]:
    smem = k.get("launch__shared_mem_per_block_static") + k.get("launch__shared_mem_per_block_dynamic")
    figures = {"regs": k.get("launch__registers_per_thread"), "threads": k.get("launch__block_size"),
               "smem_kb": smem / 1024, "blocks": blocks}  # fmt: skip
    cause, fix, edits = WHY.get(limiter, WHY["warps"])
    return cause.format(**figures), fix.format(**figures), edits


class Occupancy:
    name = "occupancy"
    applies_to = frozenset({Bound.LATENCY, Bound.MEMORY})
    needs = frozenset({"ncu"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        k = ev.dominant()
        if k is None or "sm__maximum_warps_per_active_cycle_pct" not in k.metrics:
            return []
        theoretical = k.get("sm__maximum_warps_per_active_cycle_pct")
        achieved = k.get("sm__warps_active.avg.pct_of_peak_sustained_active")
        waves = k.get("launch__waves_per_multiprocessor", 1.0)
        limits = {
            n: k.metrics[f"launch__occupancy_limit_{n}"]
            for n in LIMITS
            if f"launch__occupancy_limit_{n}" in k.metrics
        }
        evidence = {
            "sm__maximum_warps_per_active_cycle_pct": theoretical,
            "sm__warps_active.avg.pct_of_peak_sustained_active": achieved,
            "launch__registers_per_thread": k.get("launch__registers_per_thread"),
            "launch__block_size": k.get("launch__block_size"),
            **{f"launch__occupancy_limit_{n}": v for n, v in limits.items()},
        }
        weight = 1.0 if cls.bound == Bound.LATENCY else 0.7  # memory-bound kernels need bytes in flight too
        if k.get("sm__inst_executed_pipe_tensor_op_hmma.sum") > 0:
            weight *= 0.5  # MMA kernels hide latency with large tiles, ILP and async copies, not with warps
        if theoretical < THEORETICAL_FIRES and limits:
            limiter = min(limits, key=lambda n: limits[n])
            cause, fix, edits = _why(limiter, k, limits[limiter])
            warps = theoretical * MAX_WARPS / 100
            diagnosis = (
                f"Only {warps:.0f} of 64 warps can be resident per SM ({theoretical:.0f}% theoretical, "
                f"{achieved:.0f}% achieved): {cause}, too few to hide memory latency."
            )
            advice = f"{fix}; aim for at least 32 resident warps."
            severity = capped(0.9 * (1 - theoretical / 100) * weight, cls)
            gain = round(min(headroom(cls), 1 - theoretical / THEORETICAL_FIRES / 2), 2)
            return [finding(self.name, severity, evidence, diagnosis, advice, edits, max(0.0, gain))]
        if theoretical - achieved >= GAP_FIRES and waves >= 1.0:
            diagnosis = (
                f"Achieved occupancy is {achieved:.0f}% against {theoretical:.0f}% possible: "
                "warps retire unevenly (blocks with unequal work, early exits) or the last wave "
                "leaves SMs half empty."
            )
            advice = (
                "Balance work across blocks (grid-stride loop over equal chunks) and size the grid "
                "to whole waves."
            )
            severity = capped(0.6 * (theoretical - achieved) / max(theoretical, 1) * weight, cls)
            return [
                finding(
                    self.name,
                    severity,
                    evidence,
                    diagnosis,
                    advice,
                    ("resize_grid",),
                    round(min(headroom(cls), (theoretical - achieved) / 200), 2),
                )
            ]
        return []


register(Occupancy())
