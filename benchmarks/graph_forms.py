"""The expert's tuned candidate with its forward replayed from a CUDA graph and without, measured through the
harness on the GPU.

    python benchmarks/graph_forms.py --out DIR TASK.py [TASK.py ...] [--repeat 2] [--baselines eager,reduce-overhead]

The same plan rendered both ways (plan.graph on and off; the tuned plan turns it on from
edits.GRAPH_LAUNCHES launches a call): each verified and timed against eager (L2 flushed, median of the
harness's trials) `--repeat` times in separate passes, so a difference is believed only when the passes
agree (benchmarks/harness_forms.py). A launcher of hundreds of small kernels (level 3's SwinV2: ~440 a
call) spends longer issuing them than the GPU runs them; the graph issues one. `--baselines` adds torch.compile
modes to eager (compile, reduce-overhead: torch.compile's own CUDA graphs, the fair anchor for a replayed
graph). Writes DIR/results.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from expert_plans import tuned  # noqa: E402  (the tests' helper: the same candidate)
from harness_forms import compare, lowered, parser, plan_form, plan_line  # noqa: E402  (beside this script)

from pipeline.generate.expert.edits import launched  # noqa: E402
from pipeline.generate.expert.plan import plan_of  # noqa: E402


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--baselines", default="eager", help="comma-separated: eager and torch.compile modes")
    args = ap.parse_args()
    baselines = tuple(m.strip() for m in args.baselines.split(",") if m.strip())

    def forms(path: Path) -> list[tuple[str, object]]:
        low, plan = lowered(path), plan_of(tuned(path).source)
        assert plan is not None
        print(
            f"{path.name}: {launched(low, plan)} regions launched a call, tuned graph={plan.graph}",
            flush=True,
        )
        return [
            plan_form(path.stem, low, plan.with_graph(False), "no graph"),
            plan_form(path.stem, low, plan.with_graph(True), "graph"),
        ]

    compare(args.out, args.tasks, args.repeat, forms, 50, 2.0, None, plan_line, baselines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
