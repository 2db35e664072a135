"""`kernelpro optimize` over tasks on a GPU: eager, torch.compile and the best kernel found, its fraction of
the roofline floor and its energy per call, per task. The run logs it leaves for the built-in tasks are the
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
import itertools
import json
import math
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import config, selfcheck  # noqa: E402
from pipeline.generate.expert.plan import plan_of  # noqa: E402
from pipeline.generate.expert.render import uses_cute  # noqa: E402
from pipeline.loop import OptimizeError, optimize  # noqa: E402
from pipeline.runlog import read_events  # noqa: E402
from pipeline.runstate import RunState, fold  # noqa: E402
from pipeline.types import speedup  # noqa: E402

# Where a run's seconds went: each gap between two events of its log counts for the later one's stage.
STAGE_OF = {"baselines": "baselines", "result": "evaluations", "profile": "profile"}


def seconds_by_stage(events: list) -> dict[str, float]:
    """The run's wall time from its start to its last event, by stage (baselines, candidate evaluations,
    profiling, the rest: proposing, compiling while nothing else is logged, bookkeeping)."""
    out = dict.fromkeys((*STAGE_OF.values(), "other"), 0.0)
    for prev, e in itertools.pairwise(events):
        out[STAGE_OF.get(e.type, "other")] += max(0.0, e.t - prev.t)
    return {k: round(v, 1) for k, v in out.items()}


def summarise(folder: Path) -> dict:
    events = read_events(folder / "log.jsonl")
    state = fold(events)
    base, final, end = state.baselines, state.final, state.end
    assert base is not None, f"{folder}: no baselines"
    compile_ms = base.timings["compile"].median_ms if "compile" in base.timings else None
    row = {
        "eager_ms": base.timings["eager"].median_ms,
        "compile_ms": compile_ms,
        "floor_ms": base.floor_ms,
        "eager_energy_mj": 1e3 * base.energy_eager_j if base.energy_eager_j else None,
        "evaluations": end.evaluations if end else None,
        "statuses": {s.value: n for s, n in state.statuses.items()},
        "stop": end.reason if end else None,
    }
    m = final.evaluation.measurement if final else None
    if final and m and m.timing:
        ours = m.timing.median_ms
        comp = m.baselines.get("compile")
        row.update(
            ours_ms=ours,
            kind=final.evaluation.verdict.kind.value if final.evaluation.verdict.kind else None,
            eager_alongside_ms=m.baselines["eager"].median_ms,
            compile_alongside_ms=comp.median_ms if comp else None,
            energy_mj=1e3 * m.energy.joules_per_call if m.energy else None,
            power_w=m.energy.avg_power_w if m.energy else None,
        )
        row["speedup_eager"] = speedup(row["eager_alongside_ms"], ours)
        if row["compile_alongside_ms"]:
            row["speedup_compile"] = speedup(row["compile_alongside_ms"], ours)
        if row["floor_ms"]:
            row["fraction_of_floor"] = row["floor_ms"] / ours
    row.update(own_gemm(state, row["floor_ms"]))
    row["seconds"] = seconds_by_stage(events)
    return row


def own_gemm(state: RunState, floor_ms: float | None) -> dict:
    """The fastest verified candidate whose GEMM is our own WGMMA kernel (it may not be the run's best: a
    cuBLAS hybrid can win), timed in the search, and its fraction of the floor (the bf16 matmul ceiling)."""
    best = None
    for p in state.points:
        node = state.nodes[p.node]
        plan = plan_of(node.candidate.source) if node.candidate else None
        if plan and uses_cute(plan) and p.time_ms and (best is None or p.time_ms < best[0]):
            best = (p.time_ms, node.edit)
    if best is None:
        return {}
    out = {"own_gemm_ms": best[0], "own_gemm_candidate": best[1]}
    if floor_ms:
        out["own_gemm_fraction_of_floor"] = floor_ms / best[0]
    return out


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summary(rows: list[dict]) -> dict:
    """Geomean speedups over eager (ours, torch.compile) and over torch.compile (ours), measured alongside,
    over the tasks where ours has a time; and the tasks where ours is slower than eager."""
    timed = [r for r in rows if r.get("speedup_eager")]
    both = [r for r in timed if r.get("speedup_compile")]
    out = {
        "tasks": len(rows),
        "timed": len(timed),
        "errors": sum(1 for r in rows if "error" in r),
        "ours_over_eager": geomean([r["speedup_eager"] for r in timed]),
        "compile_over_eager": geomean([r["eager_alongside_ms"] / r["compile_alongside_ms"] for r in both]),
        "ours_over_compile": geomean([r["speedup_compile"] for r in both]),
        "slower_than_eager": sorted(r.get("key", "?") for r in timed if r["speedup_eager"] < 1),
    }
    return out


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
        t0 = time.monotonic()
        try:
            outcome = optimize(path, cfg)
        except OptimizeError as e:
            row = {"error": str(e)}
        else:
            row = summarise(outcome.folder)
            row.update(run_id=outcome.run_id, notes=list(outcome.notes))
        row.update(key=key, wall_s=round(time.monotonic() - t0, 1))
        slowest = max(slowest, row["wall_s"])
        results[key] = row
        print(f"{key}: {json.dumps(row)}", flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        if args.store:
            with args.store.open("a") as f:
                f.write(json.dumps(row) + "\n")
    rows = selfcheck.read_store(args.store) if args.store else list(results.values())
    print(json.dumps(summary(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
