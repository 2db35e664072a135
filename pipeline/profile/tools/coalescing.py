"""Global accesses that fetch more 32-byte sectors than the warp uses.

A warp request for 32 consecutive 4-byte values touches 4 sectors (128 B); 16-byte accesses touch 16.
When neighbouring threads read addresses a row apart, each thread lands in a sector of its own (32 per
request) and 7/8 of every sector moved is thrown away. Useful bytes per sector (the ncu rule's own metric)
is the direct measure; sectors per request against the ideal for the SASS access width backs it up.
"""

from __future__ import annotations

from pipeline.profile.collect import KernelCounters
from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register, sass_for
from pipeline.types import Finding

MIN_REQUESTS = 1_000  # fewer requests than this are not worth a finding
WASTE_FIRES = 0.30  # at least 30% of the sectors moved carry no useful byte (ncu fires on any excess)
OPS = {"ld": "loads", "st": "stores"}


def _ideal_sectors(ev: Evidence, kernel: str, op: str) -> float:
    """Sectors a fully coalesced request needs: 32 threads x access bytes / 32-byte sectors."""
    widths: dict[int, int] = {}
    for s in sass_for(ev, kernel):
        for bits, n in (s.global_loads if op == "ld" else s.global_stores).items():
            widths[bits] = widths.get(bits, 0) + n
    if not widths:
        return 4.0
    bits = max(widths, key=lambda b: widths[b])  # the most common width in the code
    return max(1.0, bits / 8)


def _op_stats(ev: Evidence, k: KernelCounters, op: str) -> dict[str, float] | None:
    sectors = k.get(f"l1tex__t_sectors_pipe_lsu_mem_global_op_{op}.sum")
    requests = k.get(f"l1tex__t_requests_pipe_lsu_mem_global_op_{op}.sum")
    if requests < MIN_REQUESTS:
        return None
    per_request = sectors / requests
    ideal = _ideal_sectors(ev, k.name, op)
    bytes_metric = f"smsp__sass_average_data_bytes_per_sector_mem_global_op_{op}.ratio"
    useful = k.metrics.get(bytes_metric)
    # Broadcasts (all lanes on one address) have few sectors per request and are not waste, so a low
    # useful-bytes figure counts only when requests also touch more sectors than the ideal.
    if useful is not None and per_request > 1.25 * ideal:
        efficiency = useful / 32.0
    else:
        efficiency = min(1.0, ideal / per_request) if per_request > 0 else 1.0
    return {
        "sectors": sectors,
        "per_request": per_request,
        "ideal": ideal,
        "efficiency": efficiency,
        **({"useful": useful} if useful is not None else {}),
    }


class Coalescing:
    name = "coalescing"
    applies_to = frozenset({Bound.MEMORY, Bound.LATENCY, Bound.COMPUTE})  # L1 wavefronts count as SM work
    needs = frozenset({"ncu"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        k = ev.dominant()
        if k is None:
            return []
        stats = {op: s for op in OPS if (s := _op_stats(ev, k, op)) is not None}
        total = sum(s["sectors"] for s in stats.values())
        if not total:
            return []
        wasted = sum(s["sectors"] * (1 - s["efficiency"]) for s in stats.values()) / total
        op, worst = min(stats.items(), key=lambda kv: kv[1]["efficiency"])
        if wasted < WASTE_FIRES:
            return []
        evidence = {}
        for o, s in stats.items():
            evidence[f"l1tex__t_sectors_per_request_global_{o}"] = round(s["per_request"], 2)
            evidence[f"ideal_sectors_per_request_{o}"] = s["ideal"]
            if "useful" in s:
                evidence[f"smsp__sass_average_data_bytes_per_sector_mem_global_op_{o}.ratio"] = s["useful"]
        bad = [o for o, st in stats.items() if st["efficiency"] < 0.7]
        which = " and ".join(OPS[o] for o in bad) if bad else OPS[op]
        over = 1 / max(worst["efficiency"], 1 / 32)
        if worst["per_request"] >= 24:
            pattern = "neighbouring threads are a row apart: threadIdx.x walks the strided dimension"
        else:
            pattern = "addresses are strided or misaligned across the warp"
        diagnosis = (
            f"Global {which} use {32 * worst['efficiency']:.1f} of 32 bytes per sector "
            f"({worst['per_request']:.0f} sectors per request, {worst['ideal']:.0f} ideal; {over:.0f}x "
            f"over-fetch, {100 * wasted:.0f}% of sectors wasted): {pattern}."
        )
        advice = (
            "Map threadIdx.x to the contiguous (last) dimension; for a transpose, stage 32x33 tiles (+1 "
            "padding) through shared memory so both sides are coalesced; then use 16-byte (float4) accesses."
        )
        severity = capped(0.15 + wasted, cls)
        return [
            finding(
                self.name,
                severity,
                evidence,
                diagnosis,
                advice,
                ("coalesce_accesses", "tile_shared_memory", "vectorize_loads"),
                expected_gain=round(min(wasted, headroom(cls)), 2),
            )
        ]


register(Coalescing())
