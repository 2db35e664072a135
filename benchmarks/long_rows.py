"""Forms of a long-row op (two passes over rows one block cannot cache), measured through the harness on the GPU.

    python benchmarks/long_rows.py --out DIR TASK.py [TASK.py ...] [--repeat 2]

For each task, candidates of the same lowering (templates/rowwise.py), each verified and timed against eager
(L2 flushed, median of the harness's trials) `--repeat` times in separate passes, so a difference is
believed only when the passes agree:
  - the expert's tuned plan;
  - a cluster of 16 whose blocks hold their segments in registers (rows of 1-2 MB, LogSoftmax's 1.5 MB):
    against the cluster of 8 caching its segments in shared memory it replaced, and the block per row;
  - the tiles of a persistent cooperative grid (rows over 3 MB, GroupNorm's 8 MB groups, LayerNorm over
    4M elements): the tuned plan (L2 cache hints: the first read kept for the second) against no hints,
    tiles written 2 steps after they were read, a step's loads issued before the last step's tile is
    written, tiles of 16K and 32K elements (fewer steps); against the block per row it replaced (the split
    two-pass kernels, where the plan has them, for few rows). (On the H100, 2026-12-07, before the hints:
    1 block an SM and 512 threads lost to 2 and 256, 12.5 and 9.5 ms against 9.1.)
Writes DIR/results.json as it goes.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from expert_plans import tuned  # noqa: E402  (the tests' helper: the expert's tuned candidate)
from harness_forms import compare, kernel_note, lowered, parser, plan_form, plan_line  # noqa: E402

from pipeline.generate.expert.families.rowwise import CLUSTER_UNROLL, RowPlan  # noqa: E402
from pipeline.generate.expert.plan import Plan, plan_of  # noqa: E402


def candidates(path: Path) -> list[tuple[str, object]]:
    base = tuned(path)
    plan, low = plan_of(base.source), lowered(path)
    rows = [rp for rp in plan.regions if isinstance(rp, RowPlan) and (rp.cluster or rp.grid_row)]
    if not rows:
        raise SystemExit(f"{path}: the tuned plan spreads no row over a cluster or a grid")

    def variant(label: str, **knobs) -> tuple[str, object]:
        p = Plan(tuple(dataclasses.replace(rp, **knobs) if rp in rows else rp for rp in plan.regions))
        return plan_form(base.task_id, low, p, label)

    forms = [("tuned", base)]
    if any(rp.cluster > 8 for rp in rows):
        forms.append(
            variant("cluster of 8, shared memory", cluster=8, regs=0, threads=1024, unroll=CLUSTER_UNROLL)
        )
    if any(rp.grid_row for rp in rows):
        forms += [
            variant("grid, no cache hints", l2_hints=False),
            variant("grid, 2 steps later, L2 cache hints", grid_lag=2, l2_hints=True),
            variant("grid, loads ahead, L2 cache hints", grid_prefetch=True, l2_hints=True),
            variant("grid, tiles of 16K elements, L2 cache hints", grid_tile=16384, l2_hints=True),
            variant("grid, tiles of 32K elements, L2 cache hints", grid_tile=32768, l2_hints=True),
        ]
    # before: a block per row, or (a plan with splits, few rows) each row split over blocks: read twice
    before = {"cluster": 0, "regs": 0, "grid_row": False, "persistent": 0, "threads": 1024, "unroll": 1}
    forms.append(variant("block per row or split", **before))
    return forms


def main() -> int:
    args = parser(__doc__).parse_args()
    compare(
        args.out, args.tasks, args.repeat, candidates, 50, 2.0, kernel_note("_cluster", "_grid"), plan_line
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
