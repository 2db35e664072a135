"""Energy per call and power against the board limit (NVML, measured by the harness over >= 1 s windows).

Near the 700 W limit the GPU lowers its clocks to stay under it (a long bf16 GEMM loop ran at 1.6 GHz
instead of 1.98), so a power-bound kernel gets faster only by doing less work per result: fewer bytes moved
(over-fetch, re-reads), fewer redundant instructions, lower precision. Far from the limit energy is
reported for the record only, at severity 0, so it never crowds the advice.
"""

from __future__ import annotations

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import finding, register
from pipeline.types import Finding

DEFAULT_LIMIT_W = 700.0  # H200 SXM board limit
NEAR_LIMIT = 0.9  # average power at 90% of the limit: clocks are being held back
MAX_SEVERITY = 0.3


class EnergyTool:
    name = "energy"
    applies_to = frozenset(Bound)
    needs = frozenset({"energy"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        e = ev.energy
        if e is None:
            return []
        limit = ev.power_limit_w or DEFAULT_LIMIT_W
        share = e.avg_power_w / limit
        evidence = {
            "joules_per_call": e.joules_per_call,
            "avg_power_w": round(e.avg_power_w, 1),
            "power_limit_w": limit,
        }
        if share >= NEAR_LIMIT:
            diagnosis = (
                f"The GPU draws {e.avg_power_w:.0f} W of its {limit:.0f} W limit running this kernel "
                f"({1e3 * e.joules_per_call:.2f} mJ per call): it is power-bound and its clocks are "
                "throttled, so wasted work costs time as well as energy."
            )
            advice = (
                "Cut work per result: remove over-fetch and re-reads, redundant instructions, and use the "
                "lowest precision the tolerance allows (bf16/fp8 tensor cores). A bandwidth-bound kernel can "
                "stream from part of the SMs (a persistent grid over 50-75% of them) at the same speed while "
                "the idle SMs draw less."
            )
            # At the limit the clocks drop, which slows compute-bound kernels most; a saturating kernel of
            # any kind reaches the limit on the H200 (good elementwise kernels draw ~715 W), so this stays a
            # side note, never above the level of a healthy kernel's findings.
            near = min(1.0, (share - NEAR_LIMIT) / (1 - NEAR_LIMIT))
            weight = 1.0 if cls.bound == Bound.COMPUTE else 0.5
            severity = round(MAX_SEVERITY * near * weight, 3)
            return [finding(self.name, severity, evidence, diagnosis, advice, ("lower_power",), 0.05)]
        diagnosis = (
            f"{1e3 * e.joules_per_call:.3f} mJ per call at {e.avg_power_w:.0f} W "
            f"({100 * share:.0f}% of the {limit:.0f} W limit): not power-bound."
        )
        return [finding(self.name, 0.0, evidence, diagnosis, "Nothing to change for energy.", (), 0.0)]


register(EnergyTool())
