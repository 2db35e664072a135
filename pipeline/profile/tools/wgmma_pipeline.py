"""Hopper warpgroup MMAs that ptxas serialized, or waited for on its own: read from the compile's report.

wgmma.mma_async is asynchronous: a warpgroup issues a batch of MMAs, commits it, and waits for an older
batch (wgmma.wait_group N) only before it touches the registers those MMAs read or write. ptxas checks this
on every path. Where it finds a path on which the accumulators (or the A operand's registers) are used
with MMAs possibly in flight, it inserts a wait itself (C7517, "warpgroup.wait is injected"): the pipeline
drains there, every time the path runs. Where that wait would sit in a branch it cannot prove uniform, it
gives up and serializes every MMA of the function (C7518, "wgmma.mma_async instructions are serialized"):
each waits for the one before, and the tensor cores idle while the warpgroup issues. Typical causes in
source terms: a wait inside an `if` (a k loop's promotion or epilogue branch) with no wait on the loop's
exit path, accumulators read or zeroed after the loop without a final wait, non-MMA code writing the
accumulators between arrive and commit, or an MMA pipeline crossing a non-inlined call.
"""

from __future__ import annotations

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register
from pipeline.types import Finding

# A serialized MMA pipeline runs at about one MMA's latency each instead of back to back: on the 3xTF32
# convolution the fix (one wait after the k loop) took the MMAs' waits from 12 to 3 for 12 HGMMAs.
SERIALIZED_SEVERITY = 0.8
# An injected wait drains the pipeline once a pass of its path (every second k tile in the 3xTF32 GEMM).
INJECTED_SEVERITY = 0.45


class WgmmaPipeline:
    name = "wgmma_pipeline"
    applies_to = frozenset({Bound.COMPUTE, Bound.LATENCY, Bound.MEMORY})
    needs = frozenset({"ptxas"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        flagged = [r for r in ev.resources if r.wgmma_serialized or r.wgmma_waits_injected]
        if not flagged:
            return []
        dom = ev.dominant()
        # The kernel that takes the time first; else the worst (serialized before injected).
        r = next((r for r in flagged if dom is not None and r.name == dom.name), None) or max(
            flagged, key=lambda r: (bool(r.wgmma_serialized), r.wgmma_waits_injected)
        )
        evidence = {
            "ptxas.wgmma_serialized": 1.0 if r.wgmma_serialized else 0.0,
            "ptxas.wgmma_waits_injected": float(r.wgmma_waits_injected),
        }
        if r.wgmma_serialized:
            diagnosis = (
                f"ptxas serialized every warpgroup MMA of {r.name} (due to {r.wgmma_serialized}): each "
                "HGMMA waits for the one before, so the tensor cores idle while the warpgroup issues. ptxas "
                "needed a wait on a path it could not prove uniform: a wgmma wait inside a branch, or the "
                "accumulators touched on a path (often the k loop's exit) with no wait before it."
            )
            severity, gain = SERIALIZED_SEVERITY, min(headroom(cls), 0.5)
        else:
            diagnosis = (
                f"ptxas inserted {r.wgmma_waits_injected} warpgroup wait(s) of its own in {r.name}: on some "
                "path the registers the MMAs write or read are used with MMAs possibly in flight, so the "
                "pipeline drains there each time the path runs (a wait at the loop's latch drains it "
                "every iteration)."
            )
            severity, gain = INJECTED_SEVERITY, min(headroom(cls), 0.15)
        advice = (
            "Make every use of the accumulators and of the A registers follow an explicit "
            "warpgroup_wait on all paths: put a wait<0> after the k loop (before the epilogue reads or "
            "zeroes them) even where the last iteration already waited, keep waits out of branches ptxas "
            "cannot see are uniform, and keep the MMA batch (arrive, MMAs, commit) free of other writes "
            "to its registers. Check that the compile's report no longer names the function (C7517/C7518)."
        )
        return [finding(self.name, capped(severity, cls), evidence, diagnosis, advice, ("pipeline_loads",),
                        round(gain, 2))]  # fmt: skip


register(WgmmaPipeline())
