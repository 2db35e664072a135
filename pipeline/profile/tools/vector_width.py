"""Coalesced but narrow global accesses in a memory-bound kernel (SASS LDG.E rather than LDG.E.128).

Each load instruction carries at most 16 bytes per thread. With 4-byte loads a warp needs four times as many
instructions, and four times as many requests in flight, to keep DRAM busy, so a scalar kernel tops out
below copy bandwidth unless occupancy is high. The width that matters is the executed one: bytes per
request (sectors x useful bytes per sector) over 32 threads, from ncu; the static SASS widths name the
instructions (a vectorised kernel's scalar tail loop would mislead a static count). This fires only when
the accesses are coalesced: a strided access is the coalescing tool's finding, and widening it won't help.
"""

from __future__ import annotations

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register, sass_for
from pipeline.profile.tools.register_spills import local_share
from pipeline.types import Finding

NARROW_BYTES = 12.0  # executed bytes per thread per request below this: not 16-byte accesses
MIN_HEADROOM = 0.15  # a kernel within 15% of its floor gains little from wider accesses
COALESCED = 0.8  # useful bytes per sector at least 80% of 32: the accesses are contiguous
MIN_REQUESTS = 1_000
STALL = "smsp__average_warps_issue_stalled_"


def global_wait_share(ev: Evidence) -> float:
    """Share of warp stalls spent waiting on global memory (long scoreboard, LSU queue), less local memory."""
    k = ev.dominant()
    if k is None:
        return 0.0
    stalls = {m: v for m, v in k.metrics.items() if m.startswith(STALL) and "_selected_" not in m}
    total = sum(stalls.values())
    if not total:
        return 1.0  # no stall counters: do not discount
    waiting = sum(k.get(f"{STALL}{r}_per_issue_active.ratio") for r in ("long_scoreboard", "lg_throttle"))
    return waiting / total * (1 - (local_share(ev) or 0.0))


def _executed_width(ev: Evidence) -> tuple[float, float, dict[str, float]] | None:
    """(bytes per thread per request, sector efficiency, evidence), weighted over loads and stores."""
    k = ev.dominant()
    if k is None:
        return None
    width = eff = weight = 0.0
    evidence: dict[str, float] = {}
    for op in ("ld", "st"):
        requests = k.get(f"l1tex__t_requests_pipe_lsu_mem_global_op_{op}.sum")
        if requests < MIN_REQUESTS:
            continue
        sectors = k.get(f"l1tex__t_sectors_pipe_lsu_mem_global_op_{op}.sum")
        useful = k.get(f"smsp__sass_average_data_bytes_per_sector_mem_global_op_{op}.ratio", 32.0)
        width += sectors * useful / 32  # = requests x (bytes per thread per request)
        eff += requests * useful / 32
        weight += requests
        evidence[f"sectors_per_request_{op}"] = round(sectors / requests, 2)
        evidence[f"bytes_per_thread_{op}"] = round(sectors / requests * useful / 32, 2)
    if not weight:
        return None
    return width / weight, eff / weight, evidence


class VectorWidth:
    name = "vector_width"
    applies_to = frozenset({Bound.MEMORY, Bound.LATENCY})
    needs = frozenset({"sass", "ncu"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        executed = _executed_width(ev)
        if executed is None or headroom(cls) < MIN_HEADROOM:
            return []
        per_thread, efficiency, evidence = executed
        if per_thread >= NARROW_BYTES or efficiency < COALESCED:
            return []  # already wide, or strided (coalescing's finding)
        dom = ev.dominant()
        loads: dict[int, int] = {}
        for s in sass_for(ev, dom.name if dom else None):
            for table in (s.global_loads, s.global_stores):
                for bits, n in table.items():
                    loads[bits] = loads.get(bits, 0) + n
        evidence |= {f"sass_global_access_{b}bit": float(n) for b, n in sorted(loads.items())}
        evidence["fraction_of_floor"] = round(1 - headroom(cls), 3)
        narrow = sum(n for b, n in loads.items() if b < 128)
        element = max(1, round(per_thread))
        factor = max(2, 16 // element)
        diagnosis = (
            f"Global accesses move {per_thread:.1f} bytes per thread per instruction "
            f"({narrow} of {sum(loads.values())} LDG/STG in the SASS lack .128): coalesced, but the kernel "
            f"issues {factor}x more memory instructions than needed and keeps too few bytes in flight to "
            f"saturate DRAM ({100 * (1 - headroom(cls)):.0f}% of the floor)."
        )
        vector = "float4" if element == 4 else f"uint4 ({factor} elements)"
        advice = (
            f"Load and store 16 bytes per thread along the contiguous dimension ({vector} per access), keep "
            "the base 16-byte aligned with a scalar tail for the remainder, and put several loads in flight "
            "before first use."
        )
        # Only the time spent waiting on global memory is the width's to claim: weigh by the share of stalls
        # on global loads (local-memory loads stall the same way, so their share of L1 traffic is taken out).
        waiting = global_wait_share(ev)
        evidence["global_wait_share"] = round(waiting, 2)
        severity = capped((0.3 + 0.6 * headroom(cls)) * waiting, cls)
        gain = round(min(0.5, headroom(cls)) * 0.6, 2)
        return [finding(self.name, severity, evidence, diagnosis, advice, ("vectorize_loads",), gain)]


register(VectorWidth())
