"""The expert's tuned candidate against the same plan with knobs set, measured through the harness on the GPU.

    python benchmarks/plan_forms.py --out DIR --set "rows=8" --set "rows=8,outs=8" TASK.py [...] [--repeat 2]

Each --set is one form: `knob=value` pairs (ints, or true/false) given to every region of the tuned plan
whose family has those knobs, or, after a family's tag and a colon ("row:unroll=4"), to that family's
regions only; a form that changes no region, or that the family cannot render, is reported and skipped. Every form verified and timed against eager (L2 flushed, median of the harness's trials)
`--repeat` times in separate passes, so a difference is believed only when the passes agree
(benchmarks/harness_forms.py). Writes DIR/results.json as it goes.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from expert_plans import tuned, with_knobs  # noqa: E402  (the tests' helpers: the same candidates)
from harness_forms import compare, parser, plan_line  # noqa: E402


def knobs_of(text: str) -> dict[str, int | bool]:
    """Knobs of a --set: "rows=8,stage=true" gives {"rows": 8, "stage": True}; SystemExit on anything else."""
    out: dict[str, int | bool] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise SystemExit(f"--set {text!r}: {part!r} is not knob=value")
        v = value.strip().lower()
        out[name.strip()] = v == "true" if v in ("true", "false") else int(v)
    return out


def tag_and_knobs(text: str) -> tuple[str, dict[str, int | bool]]:
    """A --set's family tag ("" for every family with the knobs) and its knobs."""
    tag, sep, rest = text.partition(":")
    return (tag.strip(), knobs_of(rest)) if sep else ("", knobs_of(text))


def forms(path: Path, sets: list[str]) -> list[tuple[str, object]]:
    base = tuned(path)
    out: list[tuple[str, object]] = [("tuned", base)]
    for text in sets:
        try:
            tag, knobs = tag_and_knobs(text)
            out.append((text, with_knobs(path, base, tag, edit=text, **knobs)))
        except (
            Exception
        ) as e:  # no region changed, or a family's refusal: reported, the other forms still run
            print(f"{path.stem}: --set {text!r}: {e}", flush=True)
    return out


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a form: knob=value,...")
    args = ap.parse_args()
    compare(args.out, args.tasks, args.repeat, lambda p: forms(p, args.sets), 50, 2.0, describe=plan_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
