"""Warps that run with most lanes idle: divergent branches on the thread index.

smsp__thread_inst_executed_per_inst_executed.ratio is the average number of active threads per executed
warp instruction (32 is full); ncu's ThreadDivergence rule fires below 24. A branch like
`if (tid % 4 == 0) { heavy work }` leaves 8 of 32 lanes doing the work while 24 wait. The predicated-on
variant also counts lanes switched off by predication, a milder form of the same waste.
"""

from __future__ import annotations

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register
from pipeline.types import Finding

ACTIVE = "smsp__thread_inst_executed_per_inst_executed.ratio"
PRED_ON = "smsp__thread_inst_executed_pred_on_per_inst_executed.ratio"
FIRES = 24.0  # the ncu rule's threshold (threads of 32)


class Divergence:
    name = "divergence"
    applies_to = frozenset({Bound.MEMORY, Bound.LATENCY, Bound.COMPUTE})
    needs = frozenset({"ncu"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        k = ev.dominant()
        if k is None or ACTIVE not in k.metrics:
            return []
        active = k.get(ACTIVE)
        pred_on = k.get(PRED_ON, active)
        threads = min(active, pred_on)
        if threads >= FIRES or threads <= 0:
            return []
        evidence = {ACTIVE: active, PRED_ON: pred_on}
        idle = 1 - threads / 32
        if active < FIRES:
            diagnosis = (
                f"On average only {active:.1f} of 32 threads are active per warp instruction: a branch on "
                f"the thread index (e.g. `if (tid % {max(2, round(32 / active))} == 0)`) or a data-dependent "
                "loop count sends lanes of one warp down different paths, and the warp runs them one after "
                "the other."
            )
        else:
            diagnosis = (
                f"Warps run with all lanes scheduled but only {pred_on:.1f} of 32 predicated on: "
                "conditionally executed instructions (bounds checks, guarded updates) waste most lanes."
            )
        advice = (
            "Give whole warps the same path: remap work so the active items are contiguous (e.g. item = "
            "tid * stride handled by consecutive lanes), move the condition to warp granularity "
            "(`(tid / 32) % k`), or sort/compact the work before the heavy branch."
        )
        severity = capped(min(0.9, 1.1 * idle), cls)
        return [
            finding(
                self.name,
                severity,
                evidence,
                diagnosis,
                advice,
                ("remove_divergence",),
                round(min(headroom(cls), idle), 2),
            )
        ]


register(Divergence())
