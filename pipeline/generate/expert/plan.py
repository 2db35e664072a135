"""The expert's plan: one parameter set per region, stored as JSON in the first line of the CUDA source,
so that a parent's plan comes back from its Candidate alone (runs resume from their logs).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

MARK = "// kernelpro-expert-plan: "
VERSION = 1


@dataclass(frozen=True)
class RegionPlan:
    rid: str
    family: str  # ew, row, col, scan (a reduction/softmax/norm/scan region's family comes from its layout),
    # or wgmma: a GEMM (linear, matmul, mm, bmm) in our own Hopper kernel instead of cuBLAS
    vec: int = 1  # elements per vector access (16 bytes at most)
    threads: int = 256
    unroll: int = 1  # vector accesses (ew, col) or loop iterations (row) in flight per thread
    persistent: int = 0  # blocks per SM for a persistent grid-stride grid; 0: a block per piece of work
    min_blocks: int = 0  # __launch_bounds__ minimum blocks per SM (caps registers for occupancy)
    warp_reduce: bool = False  # shuffles instead of a shared-memory tree
    warp_rows: bool = False  # row family: one warp per row (short rows)
    smem_row: bool = False  # row family: the row is cached in shared memory between passes
    regs: int = 0  # row family, two-pass ops: the row held in registers, this many vectors per thread
    splits: int = 0  # reductions: split the reduced dimension to reach this many blocks per SM (0: never)
    bx: int = 32  # col family: threads along the contiguous inner dimension
    items: int = 1  # scan: consecutive items per thread
    prologue: str = ""  # rid of an ew region computed on this region's loads
    epilogue: str = ""  # rid of an ew region computed on this region's stores
    bn: int = 0  # wgmma: tile width along N (the tile is 128 x bn x 64)
    stages: int = 0  # wgmma: shared-memory stages in the TMA ring


@dataclass(frozen=True)
class Plan:
    regions: tuple[RegionPlan, ...]
    version: int = VERSION

    def get(self, rid: str) -> RegionPlan | None:
        return next((r for r in self.regions if r.rid == rid), None)

    def replace(self, rp: RegionPlan) -> Plan:
        return Plan(tuple(rp if r.rid == rp.rid else r for r in self.regions), self.version)

    def add(self, rp: RegionPlan) -> Plan:
        """The plan with rp added (a region that had no entry: a GEMM taken from cuBLAS)."""
        if self.get(rp.rid) is not None:
            return self.replace(rp)
        return Plan((*self.regions, rp), self.version)

    def fused(self) -> set[str]:
        """Regions computed inside another region's kernel."""
        return {x for r in self.regions for x in (r.prologue, r.epilogue) if x}

    def to_json(self) -> str:
        defaults = RegionPlan("", "")
        regions = []
        for r in self.regions:
            d = {"rid": r.rid, "family": r.family}
            for f in dataclasses.fields(RegionPlan)[2:]:
                v = getattr(r, f.name)
                if v != getattr(defaults, f.name):
                    d[f.name] = v
            regions.append(d)
        return json.dumps({"v": self.version, "regions": regions}, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(RegionPlan)}
        regions = tuple(RegionPlan(**{k: v for k, v in r.items() if k in known}) for r in data["regions"])
        return cls(regions, int(data.get("v", VERSION)))


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


def describe(rp: RegionPlan) -> str:
    """A short human-readable summary of one region's plan."""
    if rp.family == "wgmma":
        tail = f" epilogue={rp.epilogue}" if rp.epilogue else ""
        return f"wgmma tile=128x{rp.bn}x64 stages={rp.stages} (TMA, 2 consumer warpgroups){tail}"
    parts = [rp.family, f"vec={rp.vec}", f"threads={rp.threads}"]
    for name in ("unroll", "persistent", "min_blocks", "splits", "items", "regs"):
        v = getattr(rp, name)
        if v and not (name in ("unroll", "items") and v == 1):
            parts.append(f"{name}={v}")
    for name in ("warp_reduce", "warp_rows", "smem_row"):
        if getattr(rp, name):
            parts.append(name)
    if rp.family == "col":
        parts.append(f"bx={rp.bx}")
    for name in ("prologue", "epilogue"):
        if getattr(rp, name):
            parts.append(f"{name}={getattr(rp, name)}")
    return " ".join(parts)
