"""Self-consistency sweep: every task's own reference, submitted as a hybrid candidate, must verify OK.

Run on the GPU machine from the repository root:

    python3 benchmarks/selfcheck_sweep.py --suite ../shared/kernelbench --budget-s 540 \
        --store benchmarks/results/selfcheck-<date>.jsonl --markdown selfcheck.md

One JSON line per task lands in the store as soon as the task is done; a second run with the same store
skips the tasks already there, so the sweep can be done in parts. Timing is kept short (the point is
correctness); verification is the full protocol. See pipeline/selfcheck.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import reasons, selfcheck  # noqa: E402
from pipeline.config import load  # noqa: E402

DEFAULT_SUITE = ROOT.parent / "shared" / "kernelbench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    today = datetime.date.today().isoformat()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--suite",
        nargs="+",
        type=Path,
        default=[DEFAULT_SUITE],
        help="task folders (searched recursively) or task files; default: ../shared/kernelbench beside the repo",
    )
    p.add_argument(
        "--store",
        type=Path,
        default=ROOT / "benchmarks" / "results" / f"selfcheck-{today}.jsonl",
        help="JSON-lines store, one row per task; reused to resume (default: %(default)s)",
    )
    p.add_argument("--budget-s", type=float, default=None, help="stop cleanly before this many seconds")
    p.add_argument("--markdown", type=Path, default=None, help="write the summary as Markdown here")
    p.add_argument("--levels", nargs="+", default=None, help="only these folders, e.g. level1 level2")
    p.add_argument("--limit", type=int, default=None, help="at most this many tasks (after --levels)")
    p.add_argument("--home", type=Path, default=None, help="kernelpro home (caches, calibration)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: protocol only, no timing")
    p.add_argument("--job-timeout-s", type=float, default=None, help="wall-time limit of one worker job")
    p.add_argument("--json", type=Path, default=None, help="write the summary as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    paths = selfcheck.task_files(args.suite, args.levels)
    if args.limit is not None:
        paths = paths[: args.limit]
    if not paths:
        print(f"no task files under {[str(s) for s in args.suite]}", file=sys.stderr)
        return 2
    cfg = selfcheck.sweep_config(load(home=args.home, device=args.device, job_timeout_s=args.job_timeout_s))
    done_before = {r["key"] for r in selfcheck.read_store(args.store)}
    todo = sum(selfcheck.task_key(p) not in done_before for p in paths)
    print(f"{len(paths)} tasks, {len(paths) - todo} already in {args.store}, {todo} to run", flush=True)
    count = [0]

    def on_row(row: dict) -> None:
        count[0] += 1
        first = next((r for r in row["reasons"] if not reasons.is_note(r)), "")
        tail = f"  [{row['cause']}] {first[:140]}" if row["status"] != "ok" else ""
        print(
            f"[{count[0]:>3}/{todo}] {row['key']:<58} {row['status']:<13} {row['seconds']:7.1f} s{tail}",
            flush=True,
        )

    result = selfcheck.run_suite(paths, cfg, args.store, budget_s=args.budget_s, on_row=on_row)
    if result.stopped:
        print(f"stopped: {result.stopped}; {len(result.remaining)} tasks left for the next run", flush=True)
    text = selfcheck.markdown(result.rows)
    print()
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {**result.summary(), "remaining": list(result.remaining), "stopped": result.stopped}
        args.json.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
