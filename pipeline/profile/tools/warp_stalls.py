"""Why warps are not issuing: the top stall reason, in source terms.

smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio is the average number of warps stalled
on <reason> per issued instruction. Stalls are a symptom; the direct tools (coalescing, bank conflicts,
occupancy, spills) name causes, so this one is capped below them and speaks only when the scheduler is
short of work (issue slots idle) and the kernel is far from its floor. It fires like ncu's CPIStall rule:
one reason holding over 30% of the stall cycles.
"""

from __future__ import annotations

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register
from pipeline.profile.tools.register_spills import local_share
from pipeline.types import Finding

PREFIX = "smsp__average_warps_issue_stalled_"
SUFFIX = "_per_issue_active.ratio"
SHARE_FIRES = 0.3
ISSUE_BUSY = 0.8  # issue slots used on 80% of cycles: the scheduler is fed, stalls are hidden
CAP = 0.4  # a symptom ranks below the tools that name a cause
LOCAL = 0.3  # local bytes share of L1 traffic above which load stalls are local-memory stalls
HEALTHY = {"not_selected", "selected", "sleeping", "misc"}  # eligible-but-waiting is not a problem

# reason -> (what it means in source terms, the fix, edits)
# fmt: off
REASONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "long_scoreboard": ("warps wait on global or local memory loads: each thread issues a load and uses it at "
                        "once, so only one load per thread is in flight", "keep several independent loads in "
                        "flight before first use (unroll by 4, prefetch the next tile with cp.async/TMA double "
                        "buffering)", ("pipeline_loads",)),
    "lg_throttle": ("the load/store queue is full of small global accesses", "issue fewer, wider accesses "
                    "(16 bytes per thread) and coarsen threads", ("vectorize_loads", "coarsen_threads")),
    "mio_throttle": ("the shared-memory/special-function queue is full: many small LDS/STS, bank conflicts or "
                     "MUFU-heavy math", "use 16-byte shared accesses, remove bank conflicts, use __expf-class "
                     "intrinsics", ("fix_bank_conflicts",)),
    "short_scoreboard": ("warps wait on shared-memory or special-function results", "avoid bank conflicts, "
                         "overlap shared loads with math (load the next fragment first)", ("fix_bank_conflicts",)),
    "barrier": ("warps wait at __syncthreads for the slowest warp of the block", "balance work across warps, use "
                "fewer barriers (warp shuffles for reductions), double-buffer tiles", ("pipeline_loads",)),
    "math_pipe_throttle": ("a math pipe is saturated", "move the contraction to tensor cores or cut redundant "
                           "arithmetic (a libm log or exp to the special-function unit)",
                           ("use_tensor_cores", "use_intrinsics")),
    "wait": ("fixed-latency dependencies: each instruction waits on the one before", "give each thread "
             "independent work to interleave (several outputs per thread)", ("coarsen_threads",)),
    "gmma": ("warps wait on warpgroup MMA completion (WARPGROUP.DEPBAR)", "keep more MMAs in flight: deeper "
             "pipeline, wait on the previous stage only", ("pipeline_loads",)),
    "branch_resolving": ("warps wait on branch targets: divergent control flow", "make branches uniform per warp",
                         ("remove_divergence",)),
    "no_instruction": ("the instruction cache misses: very large unrolled code", "unroll less", ()),
    "membar": ("memory fences or atomics serialise the warps", "batch atomics per warp or block first", ()),
    "imc_miss": ("a __constant__ array is indexed with a per-thread value", "use uniform indices, or read the "
                 "table through __ldg", ()),
    "drain": ("warps wait for their stores to drain at exit", "coarsen threads so fewer exit", ()),
    "tex_throttle": ("the texture queue is full", "issue fewer texture/LDG.CONSTANT requests", ()),
}
# fmt: on


class WarpStalls:
    name = "warp_stalls"
    applies_to = frozenset({Bound.MEMORY, Bound.LATENCY, Bound.COMPUTE})
    needs = frozenset({"ncu"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        k = ev.dominant()
        if k is None:
            return []
        stalls = {
            m[len(PREFIX) : -len(SUFFIX)]: v
            for m, v in k.metrics.items()
            if m.startswith(PREFIX) and m.endswith(SUFFIX)
        }
        total = sum(v for r, v in stalls.items() if r != "selected")
        issue = k.get("smsp__issue_active.avg.per_cycle_active", 0.0)
        if not total or issue >= ISSUE_BUSY:
            return []
        top = max((r for r in stalls if r not in HEALTHY), key=lambda r: stalls[r], default=None)
        if top is None or top not in REASONS or stalls[top] / total < SHARE_FIRES:
            return []
        share = stalls[top] / total
        meaning, fix, edits = REASONS[top]
        local = local_share(ev) or 0.0
        if top in ("long_scoreboard", "lg_throttle") and local >= LOCAL:
            # Local-memory loads stall on the same scoreboard: the waits are on spills or a local array.
            meaning = f"warps wait on local-memory loads ({100 * local:.0f}% of L1 traffic is local: spills or a local array)"
            fix, edits = (
                "keep per-thread data in registers or shared memory",
                ("reduce_registers", "avoid_local_arrays"),
            )
        evidence = {
            f"{PREFIX}{top}{SUFFIX}": stalls[top],
            "stall_share": round(share, 2),
            "smsp__issue_active.avg.per_cycle_active": issue,
        }
        diagnosis = (
            f"The top stall is {top} ({stalls[top]:.1f} warps per issued instruction, "
            f"{100 * share:.0f}% of stalls; issue slots busy {100 * issue:.0f}%): {meaning}."
        )
        severity = min(CAP, capped(0.1 + 0.35 * share * (1 - issue), cls))
        return [
            finding(
                self.name,
                severity,
                evidence,
                diagnosis,
                fix[0].upper() + fix[1:] + ".",
                edits,
                round(headroom(cls) * share * 0.5, 2),
            )
        ]


register(WarpStalls())
