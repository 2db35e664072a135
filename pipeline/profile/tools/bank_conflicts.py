"""Shared-memory bank conflicts: one warp access split into n serial wavefronts.

Shared memory has 32 banks of 4 bytes. A warp reading a column of a [32][32] float tile hits addresses
128 bytes apart, all in one bank: 32 wavefronts instead of 1. ncu counts conflicts and wavefronts per
direction; wavefronts per shared instruction is the n in "n-way" (1 is ideal for 4-byte accesses; 16-byte
accesses need 4 by width alone, so the conflict share, not the raw ratio, decides whether this fires).
"""

from __future__ import annotations

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register
from pipeline.types import Finding

SHARE_FIRES = 0.10  # conflicts / wavefronts, the ncu rule's threshold
MIN_WAVEFRONTS = 10_000
OPS = {"ld": "loads", "st": "stores"}


class BankConflicts:
    name = "bank_conflicts"
    applies_to = frozenset({Bound.MEMORY, Bound.LATENCY, Bound.COMPUTE})
    needs = frozenset({"ncu"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        k = ev.dominant()
        if k is None:
            return []
        evidence: dict[str, float] = {}
        worst: tuple[float, float, str] | None = None  # (share, n-way, op)
        conflicts_total = wavefronts_total = 0.0
        for op in OPS:
            conflicts = k.get(f"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{op}.sum")
            wavefronts = k.get(f"l1tex__data_pipe_lsu_wavefronts_mem_shared_op_{op}.sum")
            instructions = k.get(f"smsp__sass_inst_executed_op_shared_{op}.sum")
            if wavefronts < MIN_WAVEFRONTS:
                continue
            share = min(1.0, conflicts / wavefronts)
            # n-way: wavefronts per instruction when the count is known, else total over conflict-free.
            ways = (
                wavefronts / instructions if instructions else wavefronts / max(1.0, wavefronts - conflicts)
            )
            evidence[f"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{op}.sum"] = conflicts
            evidence[f"l1tex__data_pipe_lsu_wavefronts_mem_shared_op_{op}.sum"] = wavefronts
            evidence[f"wavefronts_per_instruction_{op}"] = round(ways, 2)
            conflicts_total += conflicts
            wavefronts_total += wavefronts
            if share >= SHARE_FIRES and (worst is None or share > worst[0]):
                worst = (share, ways, op)
        if worst is None:
            return []
        share, ways, op = worst
        overall = conflicts_total / wavefronts_total
        diagnosis = (
            f"Shared-memory {OPS[op]} are {ways:.0f}-way bank-conflicted ({100 * share:.0f}% of their "
            f"wavefronts are replays): the lanes of a warp hit addresses a multiple of 128 bytes apart, "
            f"the same bank — typically a column of a tile whose row is 32 floats wide, read across threadIdx.x."
        )
        advice = (
            "Pad each tile row by one element (`__shared__ float tile[32][33]`; by 4 floats for float4 "
            "accesses) or XOR-swizzle the column index (cute::Swizzle) so the 32 lanes fall in 32 different "
            "banks; keep the global side coalesced."
        )
        severity = capped(0.15 + 0.8 * overall, cls)
        gain = round(min(overall, headroom(cls)) * 0.8, 2)
        return [finding(self.name, severity, evidence, diagnosis, advice, ("fix_bank_conflicts",), gain)]


register(BankConflicts())
