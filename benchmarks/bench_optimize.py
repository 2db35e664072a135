"""`kernelpro optimize` over the built-in tasks on a GPU: eager, torch.compile and the best kernel found,
its fraction of the roofline floor and its energy per call, per task. The run logs it leaves are the
recordings the CPU tests replay (tests/fixtures/runs/).

    python benchmarks/bench_optimize.py --out DIR [--tasks softmax,layernorm] [--evals 12] [--policy expert]
                                        [--search mcts|greedy]

Writes DIR/results.json and DIR/runs/<run-id>/ (log, report, best kernel) per task.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import config  # noqa: E402
from pipeline.generate.expert.plan import plan_of  # noqa: E402
from pipeline.generate.expert.render import uses_cute  # noqa: E402
from pipeline.loop import OptimizeError, optimize  # noqa: E402
from pipeline.runlog import read_events  # noqa: E402
from pipeline.runstate import RunState, fold  # noqa: E402
from pipeline.types import speedup  # noqa: E402


def summarise(folder: Path) -> dict:
    state = fold(read_events(folder / "log.jsonl"))
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tasks", default="")
    ap.add_argument("--evals", type=int, default=12)
    ap.add_argument("--policy", default="expert")
    ap.add_argument("--search", default="mcts")
    args = ap.parse_args()
    names = [t for t in args.tasks.split(",") if t] or sorted(p.stem for p in (ROOT / "tasks").glob("*.py"))
    cfg = config.load(
        runs_dir=args.out / "runs",
        home=args.out / "home",
        policy=args.policy,
        max_evals=args.evals,
        memory=False,
    )
    results: dict[str, dict] = {}
    for name in names:
        t0 = time.monotonic()
        try:
            outcome = optimize(ROOT / "tasks" / f"{name}.py", cfg)
        except OptimizeError as e:
            results[name] = {"error": str(e)}
            print(f"{name}: {e}", flush=True)
            continue
        row = summarise(outcome.folder)
        row.update(run_id=outcome.run_id, wall_s=round(time.monotonic() - t0, 1), notes=list(outcome.notes))
        results[name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    ratios = [r["speedup_eager"] for r in results.values() if r.get("speedup_eager")]
    comp = [
        r["compile_alongside_ms"] / r["eager_alongside_ms"]
        for r in results.values()
        if r.get("speedup_compile")
    ]
    if ratios:
        print(f"geomean speedup over eager: ours {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
    if comp:
        print(
            f"geomean speedup over eager: torch.compile {1 / math.exp(sum(map(math.log, comp)) / len(comp)):.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
