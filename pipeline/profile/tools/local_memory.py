"""A per-thread array in local memory with no register spills: a run-time index keeps it out of registers.

Registers cannot be addressed indirectly, so an array indexed by a value the compiler cannot resolve at
compile time (`table[idx[i]]`, a loop that is not fully unrolled) lives in the thread's stack frame in
local memory: every access is an LDL/STL through L1 and L2. ptxas shows it as a stack frame with zero
spill bytes; SASS shows LDL/STL; ncu shows the local bytes moved.
"""

from __future__ import annotations

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register, sass_for
from pipeline.profile.tools.register_spills import local_share
from pipeline.types import Finding


class LocalMemory:
    name = "local_memory"
    applies_to = frozenset({Bound.MEMORY, Bound.LATENCY, Bound.COMPUTE})
    needs = frozenset({"ptxas"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        arrays = [r for r in ev.resources if r.stack_frame > 0 and not r.spill_stores and not r.spill_loads]
        if not arrays:
            return []
        r = max(arrays, key=lambda r: r.stack_frame)
        sass = sass_for(ev, r.name)
        ldl = sum(s.count("LDL") for s in sass)
        stl = sum(s.count("STL") for s in sass)
        share = local_share(ev)
        evidence = {
            "ptxas.stack_frame": float(r.stack_frame),
            "ptxas.spill_stores": 0.0,
            "sass.LDL": float(ldl),
            "sass.STL": float(stl),
        }
        if share is not None:
            evidence["local_bytes_share"] = round(share, 3)
        if sass and not ldl and not stl:
            return []  # a frame with no local accesses (an ABI call frame, printf): nothing to fix
        diagnosis = (
            f"{r.name} keeps a {r.stack_frame}-byte per-thread array in local memory (stack frame, "
            f"no spills; {ldl} LDL and {stl} STL in the SASS): it is indexed with a run-time value, "
            "so it cannot live in registers and every access is a memory round trip."
        )
        if share is not None:
            diagnosis += f" Local memory is {100 * share:.0f}% of the kernel's L1 traffic."
        advice = (
            "Make every index compile-time (fully unroll constant-trip loops with #pragma unroll), "
            "replace the table lookup by arithmetic or a select, or put the shared table in shared "
            "memory (one copy per block) instead of one per thread."
        )
        hot = 0.5 if share is None else min(1.0, 3 * share)
        severity = capped(0.35 + 0.55 * hot, cls)
        return [
            finding(
                self.name,
                severity,
                evidence,
                diagnosis,
                advice,
                ("avoid_local_arrays",),
                round(min(headroom(cls), 0.6 * hot), 2),
            )
        ]


register(LocalMemory())
