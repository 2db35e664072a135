"""The GPU idle between launches: many small kernels, or host work, per call.

From the system profile (PyTorch profiler over several calls): kernels per call, the union of their GPU
busy time, and the call's wall time. A launch costs a few microseconds of host time; a call of twenty
2-microsecond kernels is mostly waiting on the host. Fusing them removes both the launches and the
round trips of intermediates through memory; a CUDA graph removes the launches only.
"""

from __future__ import annotations

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import finding, register
from pipeline.types import Finding

IDLE_FIRES = 0.3  # the GPU idles 30% of a call's device time
MANY = 3  # kernels per call above this: fusing them is the fix


class LaunchOverhead:
    name = "launch_overhead"
    applies_to = frozenset(Bound)  # idle time adds to any class
    needs = frozenset({"system"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        s = ev.system or {}
        wall, busy = s.get("wall_us_per_call", 0.0), s.get("gpu_busy_us_per_call", 0.0)
        launches = s.get("kernels_per_call", 0.0)
        device = 1e3 * ev.timing.median_ms if ev.timing else wall
        if device <= 0 or wall <= 0:
            return []
        # The gate: idle even with calls queued back to back (the harness's device time). The profiler's wall
        # time also holds a synchronised call's fixed cost, which no kernel can remove; it sets the severity
        # only when many launches make that cost grow with the kernel count.
        queued_idle = max(0.0, 1 - busy / device)
        wall_idle = max(0.0, 1 - busy / wall)
        if queued_idle < IDLE_FIRES:
            return []
        evidence = {
            "kernels_per_call": launches,
            "gpu_busy_us_per_call": round(busy, 2),
            "device_us_per_call": round(device, 2),
            "wall_us_per_call": round(wall, 2),
            "idle_fraction_queued": round(queued_idle, 3),
        }
        per = busy / launches if launches else 0.0
        if launches > MANY:
            diagnosis = (
                f"Each call launches {launches:.0f} kernels of about {per:.1f} us of GPU work each: the host "
                f"issues launches slower than the GPU runs them, so the GPU idles {100 * queued_idle:.0f}% of "
                f"the call even when calls are queued ({100 * wall_idle:.0f}% of a synchronised call)."
            )
            advice = (
                "Fuse the kernels into one launch over the whole tensor (the loop moves into the grid or the "
                "kernel); if some must stay separate, capture the call in a CUDA graph."
            )
            severity = min(0.95, max(queued_idle, wall_idle))
        else:
            diagnosis = (
                f"The GPU is busy {busy:.0f} us of each call's {device:.0f} us with {launches:.0f} launch(es): "
                "host-side work in forward (allocations, copies, Python) keeps it waiting."
            )
            advice = (
                "Move allocation and setup out of forward (preallocate, cache) and avoid synchronising calls; "
                "capture the call in a CUDA graph."
            )
            severity = min(0.9, queued_idle)
        return [
            finding(
                self.name,
                severity,
                evidence,
                diagnosis,
                advice,
                ("fuse_kernels", "capture_graph"),
                round(queued_idle, 2),
            )
        ]


register(LaunchOverhead())
