"""The expert's plan: one parameter set per region, stored as JSON in the first line of the CUDA source,
so that a parent's plan comes back from its Candidate alone (runs resume from their logs).

Each op family (families/) subclasses RegionPlan with its own knobs; the JSON names the family by its tag
and lists the knobs that differ from their defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import ClassVar

MARK = "// kernelpro-expert-plan: "
VERSION = 1


@dataclass(frozen=True)
class RegionPlan:
    """One region's parameters: the region's id, then the family's knobs (fields with defaults)."""

    TAG: ClassVar[str] = ""  # the family's name in the JSON
    SHOWN: ClassVar[tuple[str, ...]] = ()  # knobs `describe` prints even at their defaults
    ABSORBS: ClassVar[tuple[str, ...]] = ()  # knobs naming regions computed inside this region's kernels

    rid: str

    def absorbed(self) -> tuple[str, ...]:
        """The regions this one's kernels compute besides its own (fused neighbours)."""
        return tuple(v for name in self.ABSORBS if (v := getattr(self, name)))

    def changed(self) -> dict[str, object]:
        """The knobs that differ from their defaults."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)[1:]
            if getattr(self, f.name) != f.default
        }

    def describe(self) -> str:
        """A short human-readable summary: the tag, then the knobs in declaration order (flags by name)."""
        parts = [self.TAG]
        for f in dataclasses.fields(self)[1:]:
            v = getattr(self, f.name)
            if isinstance(v, bool):
                parts += [f.name] if v else []
            elif f.name in self.SHOWN or v != f.default:
                parts.append(f"{f.name}={v}")
        return " ".join(parts)


@dataclass(frozen=True)
class Plan:
    regions: tuple[RegionPlan, ...]
    version: int = VERSION
    graph: bool = False  # forward replayed from a CUDA graph (runtime.Graphs): one launch a call

    def with_graph(self, graph: bool) -> Plan:
        return Plan(self.regions, self.version, graph)

    def get(self, rid: str) -> RegionPlan | None:
        return self._by_rid.get(rid)

    # Plans are immutable and asked these once per region and edit: a scan each time was quadratic in the
    # regions (seconds on a thousand-region unrolled RNN).
    @functools.cached_property
    def _by_rid(self) -> dict[str, RegionPlan]:
        by: dict[str, RegionPlan] = {}
        for r in self.regions:
            by.setdefault(r.rid, r)
        return by

    @functools.cached_property
    def _fused(self) -> frozenset[str]:
        return frozenset(x for r in self.regions for x in r.absorbed())

    def replace(self, rp: RegionPlan) -> Plan:
        return Plan(tuple(rp if r.rid == rp.rid else r for r in self.regions), self.version, self.graph)

    def add(self, rp: RegionPlan) -> Plan:
        """The plan with rp added (a region that had no entry: a GEMM taken from cuBLAS)."""
        if self.get(rp.rid) is not None:
            return self.replace(rp)
        return Plan((*self.regions, rp), self.version, self.graph)

    def fused(self) -> frozenset[str]:
        """Regions computed inside another region's kernel."""
        return self._fused

    def to_json(self) -> str:
        regions = [{"rid": r.rid, "family": r.TAG, **r.changed()} for r in self.regions]
        graph = {"graph": True} if self.graph else {}  # absent when off: older plans keep their text
        return json.dumps(
            {"v": self.version, "regions": regions, **graph}, separators=(",", ":"), sort_keys=True
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        from pipeline.generate.expert.families import by_tag  # the families import this module

        data = json.loads(text)
        regions = []
        for r in data["regions"]:
            knobs = by_tag(r["family"]).knobs
            known = {f.name for f in dataclasses.fields(knobs)}
            regions.append(knobs(**{k: v for k, v in r.items() if k in known}))
        return cls(tuple(regions), int(data.get("v", VERSION)), bool(data.get("graph", False)))


def header(plan: Plan) -> str:
    return MARK + plan.to_json()


def plan_of(source: str) -> Plan | None:
    """The plan a generated CUDA source was rendered from, or None for a source the expert did not write."""
    first = source.split("\n", 1)[0]
    if not first.startswith(MARK):
        return None
    try:
        return Plan.from_json(first[len(MARK) :])
    except (ValueError, KeyError, TypeError):
        return None
