"""`kernelpro optimize` over tasks on a GPU: eager, torch.compile and the best kernel found, its fraction of
the roofline floor and its energy per call, per task. `kernelpro bench` grew out of this script; the rows,
their statuses and the summary are pipeline/bench.py's, and this stays for its flags (built-in tasks by
name, --levels, --limit, a store apart from --out). The run logs it leaves for the built-in tasks are the
recordings the CPU tests replay (tests/fixtures/runs/).

    python benchmarks/bench_optimize.py --out DIR [--tasks softmax,layernorm] [--evals 12] [--policy expert]
                                        [--search mcts|greedy]
    python benchmarks/bench_optimize.py --out DIR --suite ../shared/kernelbench --levels level2 \
        --match 'Conv|Gemm|Matmul' --store benchmarks/results/optimize-level2.jsonl --budget-s 540

Writes DIR/results.json and DIR/runs/<run-id>/ (log, report, best kernel) per task. With --store, each
task's row is appended to a JSON-lines store as soon as it is done, and a second run with the same store
skips the tasks already in it: a suite sweep runs in parts (--budget-s stops before a task would start
too late). --summary STORE prints the geomeans of a store without running anything.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import config, selfcheck  # noqa: E402
from pipeline.bench import (  # noqa: E402, F401  (the sweep's bookkeeping lives in pipeline/bench.py)
    STAGE_OF,
    append_row,
    geomean,
    own_gemm,
    run_task,
    seconds_by_stage,
    summarise,
    summary,
)


def task_paths(args: argparse.Namespace) -> dict[str, Path]:
    """key -> task file: the built-in tasks by name, or a suite's tasks (levels, name pattern, limit)."""
    if not args.suite:
        names = [t for t in args.tasks.split(",") if t] or sorted(
            p.stem for p in (ROOT / "tasks").glob("*.py")
        )
        return {name: ROOT / "tasks" / f"{name}.py" for name in names}
    paths = selfcheck.task_files(args.suite, args.levels)
    if args.match:
        paths = [p for p in paths if re.search(args.match, p.stem)]
    return {selfcheck.task_key(p): p for p in paths[: args.limit]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tasks", default="", help="built-in tasks by name (default: all of them)")
    ap.add_argument("--suite", nargs="+", type=Path, default=None, help="task folders or files instead")
    ap.add_argument("--levels", nargs="+", default=None, help="only these folders of the suite")
    ap.add_argument("--match", default="", help="only suite tasks whose file name matches this regex")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument(
        "--store", type=Path, default=None, help="JSON-lines store: rows appended, done tasks skipped"
    )
    ap.add_argument("--budget-s", type=float, default=None, help="start no task after this many seconds")
    ap.add_argument("--summary", type=Path, default=None, help="print a store's summary and exit")
    ap.add_argument("--evals", type=int, default=12)
    ap.add_argument("--policy", default="expert")
    ap.add_argument("--search", default="mcts")
    args = ap.parse_args(argv)
    if args.summary:
        print(json.dumps(summary(selfcheck.read_store(args.summary)), indent=1))
        return 0
    if args.out is None:
        ap.error("--out is required to run tasks")
    cfg = config.load(
        runs_dir=args.out / "runs",
        home=args.out / "home",
        policy=args.policy,
        search=args.search,  # it was parsed and never passed on
        max_evals=args.evals,
        memory=False,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    if args.store:
        args.store.parent.mkdir(parents=True, exist_ok=True)
    done = {r["key"] for r in selfcheck.read_store(args.store)} if args.store else set()
    results: dict[str, dict] = {}
    started = time.monotonic()
    slowest = 0.0
    for key, path in task_paths(args).items():
        if key in done:
            continue
        elapsed = time.monotonic() - started
        if args.budget_s is not None and elapsed + slowest > args.budget_s:
            print(f"budget: stopping before {key} ({elapsed:.0f} s used)", flush=True)
            break
        row = run_task(key, path, cfg)  # a task that fails is a row with its status
        slowest = max(slowest, row["wall_s"])
        results[key] = row
        print(f"{key}: {json.dumps(row)}", flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        if args.store:
            append_row(args.store, row)
    rows = selfcheck.read_store(args.store) if args.store else list(results.values())
    print(json.dumps(summary(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
