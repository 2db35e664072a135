"""Everything the profiling tools may read about one candidate, gathered in one frozen value.

Built on the GPU by `pipeline.stages` (ncu, SASS, system profile, harness timing) or, in the CPU tests, from
files recorded on the H200 (`load_recorded`). Tools read evidence; they never run anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.calibrate import Ceilings
from pipeline.profile.collect import KernelCounters, SassStats, parse_ncu_csv, parse_sass
from pipeline.types import Build, Energy, KernelResources, Measurement, Task, Timing, from_dict


@dataclass(frozen=True)
class Evidence:
    task: Task
    ours: tuple[str, ...]  # names of the candidate's own kernels
    timing: Timing | None = None  # harness: CUDA events, L2 flushed
    energy: Energy | None = None
    ceilings: Ceilings | None = None
    kernels: tuple[KernelCounters, ...] = ()  # ncu, one per profiled launch: ours and library ones
    resources: tuple[KernelResources, ...] = ()  # ptxas
    sass: dict[str, SassStats] = field(default_factory=dict)
    system: dict[str, Any] | None = None  # kernels per call, GPU busy time, wall time (PyTorch profiler)
    power_limit_w: float | None = None

    @property
    def our_counters(self) -> tuple[KernelCounters, ...]:
        return tuple(k for k in self.kernels if k.name in self.ours)

    @property
    def library_counters(self) -> tuple[KernelCounters, ...]:
        return tuple(k for k in self.kernels if k.name not in self.ours)

    def dominant(self) -> KernelCounters | None:
        """Our kernel launch that ran longest under ncu (where the time goes)."""
        ours = self.our_counters or self.kernels
        return max(ours, key=lambda k: k.get("gpu__time_duration.sum"), default=None)

    def resources_of(self, name: str) -> KernelResources | None:
        return next((r for r in self.resources if r.name == name), None)

    def weight(self, k: KernelCounters) -> float:
        """Launches per call that this profiled launch stands for: ncu profiles one launch per distinct
        configuration, the system profile counts them all. 1 when either is missing or names differ."""
        per_call = (self.system or {}).get("kernels", {}).get(k.name, {}).get("count_per_call")
        if not per_call:
            return 1.0
        profiled = sum(1 for other in self.kernels if other.name == k.name)
        return max(1.0, per_call / profiled)

    def total(self, metric: str, kernels: tuple[KernelCounters, ...] | None = None) -> float:
        """A metric summed over one call: each profiled launch times the launches it stands for."""
        return sum(k.get(metric) * self.weight(k) for k in (self.kernels if kernels is None else kernels))

    @property
    def launches_per_call(self) -> float:
        if self.system and self.system.get("kernels_per_call"):
            return float(self.system["kernels_per_call"])
        return float(len(self.kernels))


def load_recorded(folder: str | Path, ceilings: Ceilings | None = None) -> Evidence:
    """Evidence from a folder written by benchmarks/record_profiling_fixtures.py."""
    folder = Path(folder)
    task_data = json.loads((folder / "task.json").read_text())
    task_data.setdefault("source", "")
    task = from_dict(Task, task_data)
    ev = json.loads((folder / "eval.json").read_text())
    build = from_dict(Build, ev["build"]) if ev.get("build") else None
    m = from_dict(Measurement, ev["measurement"]) if ev.get("measurement") else None
    kernels = parse_ncu_csv((folder / "ncu.csv").read_text()) if (folder / "ncu.csv").exists() else ()
    sass = parse_sass((folder / "sass.txt").read_text()) if (folder / "sass.txt").exists() else {}
    system = None
    if (folder / "system.json").exists():
        system = json.loads((folder / "system.json").read_text()).get("system")
    if ceilings is None and (folder.parent / "ceilings.json").exists():
        ceilings = Ceilings(**json.loads((folder.parent / "ceilings.json").read_text()))
    ours = tuple(r.name for r in build.resources) if build else ()
    power = float(m.environment["power_limit_w"]) if m and m.environment.get("power_limit_w") else None
    return Evidence(
        task=task,
        ours=ours,
        timing=m.timing if m else None,
        energy=m.energy if m else None,
        ceilings=ceilings,
        kernels=kernels,
        resources=build.resources if build else (),
        sass=sass,
        system=system,
        power_limit_w=power,
    )
