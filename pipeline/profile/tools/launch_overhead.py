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

IDLE_FIRES = 0.3  # the GPU idles 30% of a call's wall time
MANY = 3  # kernels per call above this: fusing them is the fix


class LaunchOverhead:
    name = "launch_overhead"
    applies_to = frozenset(Bound)  # idle time adds to any class
    needs = frozenset({"system"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        s = ev.system or {}
        wall, busy = s.get("wall_us_per_call", 0.0), s.get("gpu_busy_us_per_call", 0.0)
        launches = s.get("kernels_per_call", 0.0)
        if wall <= 0:
            return []
        idle = max(0.0, 1 - busy / wall)
        if idle < IDLE_FIRES:
            return []
        evidence = {
            "kernels_per_call": launches,
            "gpu_busy_us_per_call": round(busy, 2),
            "wall_us_per_call": round(wall, 2),
            "idle_fraction": round(idle, 3),
        }
        per = busy / launches if launches else 0.0
        if launches > MANY:
            diagnosis = (
                f"Each call launches {launches:.0f} kernels of about {per:.1f} us of GPU work each "
                f"({busy:.0f} us busy in {wall:.0f} us of wall time): the GPU idles {100 * idle:.0f}% "
                "of the call waiting for the host to issue launches."
            )
            advice = (
                "Fuse the kernels into one that does the whole chain per element or tile (intermediates "
                "in registers); if some must stay separate, capture the call in a CUDA graph."
            )
            edits: tuple[str, ...] = ("fuse_kernels",)
        else:
            diagnosis = (
                f"The GPU is busy {busy:.0f} us of each call's {wall:.0f} us with {launches:.0f} "
                "launch(es): host-side work in forward (allocations, copies, synchronisation, "
                "Python) dominates."
            )
            advice = (
                "Move allocation and setup out of forward (preallocate, cache), avoid .item() and "
                "other synchronising calls, and capture the call in a CUDA graph."
            )
            edits = ("fuse_kernels",)
        severity = min(0.95, idle if launches > MANY else 0.8 * idle)
        return [finding(self.name, severity, evidence, diagnosis, advice, edits, round(idle, 2))]


register(LaunchOverhead())
