"""Registers spilled to local memory (ptxas "bytes spill stores/loads"), and what the spills cost at run time.

A spill is a register's value parked in per-thread local memory (STL/LDL: L1, then L2 and DRAM) because
more values are live than the kernel may hold. ptxas reports the static spill bytes; ncu's local-memory
bytes say whether the spilled code is hot. Causes in source terms: a big per-thread array or accumulator
tile, full unrolling that keeps many values live, or a register cap (__launch_bounds__, -maxrregcount).
"""

from __future__ import annotations

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register
from pipeline.types import Finding

MAX_REGISTERS = 255


def local_share(ev: Evidence) -> float | None:
    """Local-memory bytes over all L1 global + local bytes of our kernels (None without ncu)."""
    ours = ev.our_counters or ev.kernels
    if not ours:
        return None
    local = sum(k.get(f"l1tex__t_bytes_pipe_lsu_mem_local_op_{op}.sum") for k in ours for op in ("ld", "st"))
    glob = sum(
        32 * k.get(f"l1tex__t_sectors_pipe_lsu_mem_global_op_{op}.sum") for k in ours for op in ("ld", "st")
    )
    return local / (local + glob) if local + glob > 0 else 0.0


class RegisterSpills:
    name = "register_spills"
    applies_to = frozenset({Bound.MEMORY, Bound.LATENCY, Bound.COMPUTE})
    needs = frozenset({"ptxas"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        spilling = [r for r in ev.resources if r.spill_stores or r.spill_loads]
        if not spilling:
            return []
        r = max(spilling, key=lambda r: r.spill_stores + r.spill_loads)
        share = local_share(ev)
        evidence = {
            "ptxas.spill_stores": float(r.spill_stores),
            "ptxas.spill_loads": float(r.spill_loads),
            "ptxas.registers": float(r.registers),
            "ptxas.stack_frame": float(r.stack_frame),
        }
        if share is not None:
            evidence["local_bytes_share"] = round(share, 3)
        capped_by = (
            "at the 255-register ceiling"
            if r.registers >= MAX_REGISTERS
            else f"capped at {r.registers} registers by __launch_bounds__ or -maxrregcount"
        )
        diagnosis = (
            f"{r.name} spills {r.spill_stores} bytes of registers to local memory and reloads "
            f"{r.spill_loads} ({capped_by}): more values are live than fit — a large per-thread "
            "array or accumulator tile, or loops unrolled so far that their values all stay live."
        )
        if share is not None:
            diagnosis += f" Local memory is {100 * share:.0f}% of the kernel's L1 traffic."
        advice = (
            "Shrink per-thread state (a smaller register tile, fewer accumulators), unroll less, or "
            "relax the register cap (a smaller minBlocksPerSM in __launch_bounds__) so ptxas needs no "
            "spills; stage large per-thread data in shared memory."
        )
        # Static spills in a cold path cost little: weigh by the run-time share of local traffic.
        hot = 0.5 if share is None else min(1.0, 4 * share)
        severity = capped(0.35 + 0.6 * hot, cls)
        return [
            finding(
                self.name,
                severity,
                evidence,
                diagnosis,
                advice,
                ("reduce_registers",),
                round(min(headroom(cls), 0.6 * hot), 2),
            )
        ]


register(RegisterSpills())
