"""Search throughput on one GPU: plain-CUDA candidates verified and timed per GPU-minute (issue 17's figure),
over small memory-bound tasks with their baselines cached.

    python benchmarks/bench_throughput.py --out DIR [--tasks elementwise_chain,softmax,layernorm,reduce_mean]
                                          [--evals 16] [--no-energy]

Two `kernelpro bench` passes over the same tasks, each in its own folder under DIR with one home: the first
(1 evaluation a task) measures the baselines and leaves them in the baseline cache, the second (--evals) is
the one measured, with an empty compile cache (every candidate it evaluates is built in it). A candidate
counts when the harness verified it and timed it; the minutes are the second pass's run logs from each
run's first event to its last (the GPU is held all that time: compiles, proposals, profiles and the final
re-measure included). Prints one JSON document: the figure, where the seconds went
by stage, and the worker's own phases summed over the search's evaluations (verify, timing, eager,
profile_check, energy) and the profiles' parts (SASS, the system profile, Nsight Compute).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import bench, config  # noqa: E402
from pipeline.runlog import read_events  # noqa: E402
from pipeline.runstate import fold  # noqa: E402

DEFAULT_TASKS = "elementwise_chain,softmax,layernorm,reduce_mean"


def run_pass(out: Path, tasks: list[Path], evals: int, home: Path, energy: bool = True,
             prefetch: bool = True, **overrides: float) -> bench.BenchResult:  # fmt: skip
    suite_file = out.with_suffix(".txt")
    suite_file.write_text("".join(f"{p}\n" for p in tasks))
    suite = bench.load_suite(suite_file)
    settings = {"evals": evals, "policy": "expert", "search": None, "energy": energy}
    manifest = bench.open_bench(out, suite, settings, False)
    return bench.run_bench(out, suite, config.load(home=home, prefetch=prefetch, **overrides), manifest)


def throughput(result: bench.BenchResult) -> dict:
    """Verified-and-timed candidates per minute of the runs' wall time, and the seconds by stage."""
    counted, seconds, stages = 0, 0.0, dict.fromkeys((*bench.STAGE_OF.values(), "other"), 0.0)
    worker: dict[str, float] = {}  # the worker's phases, summed over the evaluations (Measurement.seconds)
    profiling: dict[str, float] = {}  # the profiles' parts, summed (Profile.seconds: sass, system, ncu)
    timing: dict[str, float] = {}  # the timing loops' parts (Timing.seconds: inputs, flush, calls, checks)
    per_task = {}
    profiles = warm = 0  # profiles, and those whose ncu target was started ahead (pipeline/profile/warm.py)
    spared = 0  # nodes expanded without a profile, at their floor (the runs' end notes)

    def add(into: dict[str, float], parts: dict[str, float]) -> None:
        for k, v in parts.items():
            into[k] = into.get(k, 0.0) + v

    for row in result.rows:
        if not row.get("run_id"):
            continue
        events = read_events(result.out / bench.RUNS / row["run_id"] / "log.jsonl")
        state = fold(events)
        n = sum(1 for p in state.points if p.time_ms)
        for node in state.nodes.values():
            m = node.evaluation.measurement if node.evaluation else None
            add(worker, m.seconds if m else {})
            add(timing, m.timing.seconds if m and m.timing else {})
            add(profiling, node.profile.seconds if node.profile else {})
            if node.profile and node.profile.seconds.get("ncu"):
                profiles += 1
                warm += any("started ahead" in n for n in node.profile.notes)
        for note in events[-1].data.get("notes", ()) if events[-1].type == "end" else ():
            if m := re.match(r"(\d+) node\(s\) expanded without a profile", note):
                spared += int(m.group(1))
        wall = events[-1].t - events[0].t
        counted, seconds = counted + n, seconds + wall
        for k, v in bench.seconds_by_stage(events).items():
            stages[k] += v
        per_task[row["key"]] = {"timed": n, "wall_s": round(wall, 1), "status": row["status"]}
    return {
        "candidates_timed": counted,
        "gpu_minutes": round(seconds / 60, 3),
        "per_gpu_minute": round(counted / (seconds / 60), 1) if seconds else None,
        "seconds_by_stage": {k: round(v, 1) for k, v in stages.items()},
        "worker_seconds": {k: round(v, 1) for k, v in sorted(worker.items())},
        "profile_seconds": {k: round(v, 1) for k, v in sorted(profiling.items())},
        "profiles": profiles,
        "profiles_started_ahead": warm,
        "expanded_unprofiled_at_floor": spared,
        "timing_seconds": {k: round(v, 1) for k, v in sorted(timing.items())},
        "per_task": per_task,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tasks", default=DEFAULT_TASKS, help="built-in tasks (tasks/NAME.py), comma-separated")
    ap.add_argument("--evals", type=int, default=16)
    ap.add_argument("--no-energy", action="store_true", help="the bench's --no-energy: no final energy")
    ap.add_argument("--headroom", type=float, action="append",
                    help="profile_headroom of a timed pass (repeat for one pass each, e.g. 0 and 0.1: 0 "
                         "profiles every expanded node); default: the configuration's")  # fmt: skip
    args = ap.parse_args(argv)
    tasks = [ROOT / "tasks" / f"{t}.py" for t in args.tasks.split(",") if t]
    args.out.mkdir(parents=True, exist_ok=True)
    home = args.out / "home"
    energy = not args.no_energy
    # The first pass measures the baselines, which their cache keeps; its builds are dropped, so the timed
    # pass compiles every candidate it evaluates (nothing built ahead by the first pass either).
    run_pass(args.out / "warm", tasks, 1, home, energy, prefetch=False)
    doc: dict = {"evals": args.evals, "energy": energy, "tasks": [t.stem for t in tasks]}
    headrooms = args.headroom or [config.load(home=home).profile_headroom]
    for h in headrooms:  # each pass builds every candidate it evaluates
        shutil.rmtree(config.load(home=home).cache_dir / "cubin", ignore_errors=True)
        folder = args.out / ("timed" if len(headrooms) == 1 else f"timed-h{h:g}")
        got = {"profile_headroom": h, **throughput(run_pass(folder, tasks, args.evals, home, energy,
                                                            profile_headroom=h))}  # fmt: skip
        if len(headrooms) == 1:
            doc.update(got)
        else:
            doc.setdefault("passes", []).append(got)
        (args.out / "throughput.json").write_text(json.dumps(doc, indent=1) + "\n")  # kept pass by pass
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
