"""A long row's cluster segments in registers or in shared memory, measured through the harness on the GPU.

    python benchmarks/cluster_regs.py --out DIR TASK.py [TASK.py ...] [--repeat 2]

For each task (a two-pass row op whose rows one block cannot cache: KernelBench level 1's InstanceNorm,
L1Norm, L2Norm) candidates of the same lowering: the expert's tuned plan, the cluster's blocks holding their
segments in registers (templates/rowwise.py, `_cluster_regs_body`) at 256, 512 and 1024 threads where they
fit, and the segment cached in shared memory by 512 or 1024 threads with 8 loads in flight (regs 0), each at every
cluster from the fewest blocks that cache a row to 16 (and, in shared memory, persistent: as many clusters as
the GPU holds, each looping over rows), and a block per row (two reads). All are
verified and timed against eager (L2 flushed, median of the harness's trials) `--repeat` times in separate
passes, so a difference is believed only when the passes agree. Writes DIR/results.json as it goes.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from expert_plans import tuned  # noqa: E402  (the tests' helper: the expert's tuned candidate)
from harness_forms import compare, kernel_note, lowered, parser, plan_form, plan_line  # noqa: E402

from pipeline.generate.expert.families.rowwise import (  # noqa: E402
    CLUSTER_UNROLL,
    RowPlan,
    _layout,
    cluster_blocks,
    regs_for,
)
from pipeline.generate.expert.plan import Plan, plan_of  # noqa: E402


def candidates(path: Path) -> list[tuple[str, object]]:
    """The tuned candidate, the same cluster with its segments in registers at each block size they fit,
    and the shared-memory plan."""
    base = tuned(path)
    plan, low = plan_of(base.source), lowered(path)
    region = {r.rid: r for r in low.regions}

    def variant(label: str, in_regs: bool, **knobs: int) -> tuple[str, object] | None:
        rps = []
        for rp in plan.regions:
            if isinstance(rp, RowPlan) and rp.cluster:
                rp = dataclasses.replace(rp, **knobs, regs=0)
                if in_regs:
                    regs = regs_for(rp, region[rp.rid], low)
                    if not regs:
                        return None  # the segment does not fit this block's registers
                    rp = dataclasses.replace(rp, regs=regs)
            rps.append(rp)
        return plan_form(base.task_id, low, Plan(tuple(rps)), label)

    forms = [("tuned", base)]
    # every cluster from the fewest blocks whose segments fit a block's shared memory to 16: a cluster of
    # 16 needs a whole GPC's SMs, so fewer may be resident at once than the SMs' count suggests
    fewest = min(
        (cluster_blocks(lay, region[rp.rid]) for rp in plan.regions
         if isinstance(rp, RowPlan) and rp.cluster and (lay := _layout(region[rp.rid], low))),
        default=0,
    )  # fmt: skip
    for c in (x for x in (2, 4, 8, 16) if fewest and x >= fewest):
        forms += [v for t in (256, 512, 1024)
                  if (v := variant(f"cluster {c}, registers, {t} threads", True, cluster=c, threads=t))]  # fmt: skip
        # 512 threads: where two blocks' segments fit an SM's shared memory (a cluster of 16 over 1.5 MB rows),
        # one block's write pass may overlap the other's reads
        forms += [v for t in (512, 1024)
                  if (v := variant(f"cluster {c}, shared, {t} threads", False, cluster=c, threads=t,
                                   unroll=CLUSTER_UNROLL))]  # fmt: skip
        # persistent: as many clusters as the GPU holds, each looping over rows (no cluster launched a row)
        forms.append(variant(f"cluster {c}, shared, persistent", False, cluster=c, threads=1024,
                             unroll=CLUSTER_UNROLL, persistent=1))  # fmt: skip
    forms.append(variant("block per row", False, cluster=0, threads=1024, unroll=1))
    seen: set[str] = set()
    return [f for f in forms if f is not None and not (f[1].key in seen or seen.add(f[1].key))]


def main() -> int:
    args = parser(__doc__).parse_args()
    compare(args.out, args.tasks, args.repeat, candidates, 50, 2.0, kernel_note("_cluster"), plan_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
