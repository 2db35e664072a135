"""The tool interface, the shared edit vocabulary, and the registry (extensible by other packages).

A tool says which bottleneck classes it applies to and what evidence it needs, and turns evidence into
Findings: severity (0..1, worst first), the metric values it rests on, a diagnosis naming the cause in
source terms, advice naming the fix, suggested edits from EDITS, and an expected gain.
Third-party tools register with `register(tool)` or through the entry-point group `kernelpro.tools`.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import ClassVar, Protocol, runtime_checkable

from pipeline.profile.collect import SassStats
from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.types import Finding

# The edit vocabulary shared by the tools, the policies and the search's memory.
EDITS = frozenset({
    "vectorize_loads", "coalesce_accesses", "tile_shared_memory", "use_tensor_cores", "use_wgmma",
    "fuse_epilogue", "reduce_registers", "increase_occupancy", "fix_bank_conflicts", "use_tma",
    "coarsen_threads", "persistent_grid", "fuse_kernels", "avoid_local_arrays", "remove_divergence",
    "more_parallelism", "resize_grid", "pipeline_loads", "lower_power", "use_intrinsics", "capture_graph",
})  # fmt: skip

ALL_BOUNDS = frozenset(Bound)


@runtime_checkable
class Tool(Protocol):
    name: ClassVar[str]
    applies_to: ClassVar[frozenset[Bound]]
    needs: ClassVar[frozenset[str]]  # of "ncu", "sass", "ptxas", "system", "energy", "timing"

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]: ...


_REGISTRY: dict[str, Tool] = {}
_LOADED = False  # built-ins and entry points loaded (a tool registered earlier must not keep them out)


def register(tool: Tool) -> Tool:
    if not isinstance(tool, Tool):
        raise TypeError(f"{tool!r} does not implement the Tool interface")
    _REGISTRY[tool.name] = tool
    return tool


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def registry() -> dict[str, Tool]:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        from pipeline.profile.tools import builtin  # noqa: F401 - registers the built-in tools

        for ep in entry_points(group="kernelpro.tools"):
            register(ep.load()())
    return dict(_REGISTRY)


def available(ev: Evidence, needs: frozenset[str]) -> bool:
    have = {
        "ncu": bool(ev.kernels),
        "sass": bool(ev.sass),
        "ptxas": bool(ev.resources),
        "system": ev.system is not None,
        "energy": ev.energy is not None,
        "timing": ev.timing is not None,
    }
    return all(have.get(n, False) for n in needs)


def finding(tool: str, severity: float, evidence: dict[str, float], diagnosis: str, advice: str,
            edits: tuple[str, ...], expected_gain: float | None = None) -> Finding:  # fmt: skip
    unknown = set(edits) - EDITS
    if unknown:
        raise ValueError(f"{tool}: edits outside the vocabulary: {sorted(unknown)}")
    return Finding(tool=tool, severity=round(max(0.0, min(1.0, severity)), 3), evidence=evidence,
                   diagnosis=diagnosis, advice=advice, edits=edits, expected_gain=expected_gain)  # fmt: skip


def headroom(cls: Classification) -> float:
    """The share of the time any fix could save: 1 - floor/time, or 1 - the busiest unit's share of peak
    when there is no floor. A kernel at its floor has no severe flaw left, whatever a counter says."""
    frac = cls.fraction_of_floor
    if frac is None:
        frac = max(cls.dram_pct, cls.sm_pct) / 100.0
    return max(0.0, min(1.0, 1.0 - frac))


def capped(severity: float, cls: Classification, slack: float = 0.2) -> float:
    """Severity no higher than the headroom plus a little slack (timing noise, an imperfect floor)."""
    return min(severity, headroom(cls) + slack)


def sass_for(ev: Evidence, kernel: str | None) -> list[SassStats]:
    """The SASS of one kernel by name, else of all our kernels, else of every function in the dump."""
    if kernel and kernel in ev.sass:
        return [ev.sass[kernel]]
    ours = [s for name, s in ev.sass.items() if name in ev.ours]
    return ours or list(ev.sass.values())
