"""The expert's tuned candidate against the same plan with one edit made on every region that takes it,
measured through the harness on the GPU.

    python benchmarks/edit_forms.py --out DIR --edit use_intrinsics TASK.py [TASK.py ...] [--repeat 2]

Both verified and timed against eager (L2 flushed, median of the harness's trials) `--repeat` times in
separate passes, so a difference is believed only when the passes agree (benchmarks/harness_forms.py).
E.g. use_intrinsics on KernelBench's 98_KLDivLoss: two logf polynomials an element on the special-function
unit instead. A task whose tuned plan takes no such edit is reported and skipped. Writes DIR/results.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from expert_plans import tuned, tuned_with_edit  # noqa: E402  (the tests' helpers: the same candidates)
from harness_forms import compare, parser, plan_line  # noqa: E402  (beside this script)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--edit", required=True)
    args = ap.parse_args()

    def forms(path: Path) -> list[tuple[str, object]]:
        base, edited = tuned(path), tuned_with_edit(path, args.edit)
        if edited.key == base.key:
            print(f"{path.name}: its tuned plan takes no {args.edit}", flush=True)
            return [("tuned", base)]
        return [("tuned", base), (args.edit, edited)]

    compare(args.out, args.tasks, args.repeat, forms, 50, 2.0, None, plan_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
