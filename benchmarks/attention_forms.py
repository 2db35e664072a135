"""A fused attention's forms, and short-row reductions by lanes or by warps, measured through the harness.

    python benchmarks/attention_forms.py --out DIR TASK.py [TASK.py ...] [--repeat 2]

For each task, candidates of the same lowering: the expert's tuned plan; its attention regions with 2, 3 and
4 blocks an SM in the launch bounds (registers capped so they fit; the tuned plan lets ptxas take all, one
block) and in the CUDA-core form (a query row to a group of lanes, plain fp32: offered up to 64 keys); and
its one-pass short-row reductions with a warp a row (lanes=0), as before several rows shared a warp. E.g.
Swin's window attention (49 keys, heads of 32, a few thousand windows x heads) and its F.normalize norms.
All verified and timed against eager (L2 flushed, median of the harness's trials) `--repeat` times in
separate passes, so a difference is believed only when the passes agree. Writes DIR/results.json as it goes.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from expert_plans import tuned  # noqa: E402  (the tests' helper: the expert's tuned candidate)
from harness_forms import compare, kernel_note, lowered, parser, plan_form, plan_line  # noqa: E402

from pipeline.generate.expert.families.attention import AttnPlan  # noqa: E402
from pipeline.generate.expert.families.base import RenderError  # noqa: E402
from pipeline.generate.expert.families.rowwise import RowPlan  # noqa: E402
from pipeline.generate.expert.plan import Plan, plan_of  # noqa: E402


def candidates(path: Path) -> list[tuple[str, object]]:
    base = tuned(path)
    plan, low = plan_of(base.source), lowered(path)

    def variant(label: str, kind: type, **knobs: object) -> tuple[str, object] | None:
        rps = [dataclasses.replace(rp, **knobs) if isinstance(rp, kind) else rp for rp in plan.regions]
        if rps == list(plan.regions):
            return None  # nothing of that kind, or already so
        try:
            return plan_form(base.task_id, low, Plan(tuple(rps), plan.version, plan.graph), label)
        except RenderError as e:  # e.g. more blocks than shared memory holds
            print(f"{path.name}: {label}: {e}", flush=True)
            return None

    forms = [
        variant(f"attention, {b} blocks an SM", AttnPlan, min_blocks=b, rows=False) for b in (1, 2, 3, 4)
    ]
    forms += [variant("attention on the CUDA cores", AttnPlan, rows=True)]
    forms += [variant("short rows, a warp each", RowPlan, lanes=0)]
    return [("tuned", base), *(f for f in forms if f is not None)]


def main() -> int:
    args = parser(__doc__).parse_args()
    compare(args.out, args.tasks, args.repeat, candidates, 50, 2.0, kernel_note("_attn", "kp_div"), plan_line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
