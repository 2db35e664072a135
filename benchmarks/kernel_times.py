"""Where a candidate's time goes, kernel by kernel, next to eager's: the candidates of recorded runs (a
bench's `logs/*.jsonl.gz` or a run's `log.jsonl`) compiled again, exported standalone and run under
torch.profiler (CUPTI device times), with the reference's weights copied in and fresh random inputs each
call.

    python3 benchmarks/kernel_times.py LOG [LOG ...] --suite DIR [--which best|all] [--calls 10] [--out F.json]
    python3 benchmarks/kernel_times.py TASK.py [TASK.py ...] [--compile] ...

DIR holds the task files (a log records the path it ran from, which may be another machine's). A task file
in place of a log profiles the expert's tuned candidate of it as the code now writes it. --compile adds
torch.compile's (default mode) kernels beside eager's. Prints a
table per task: each kernel's mean time a call, its share, the sum, and a call's median time by CUDA events
(L2 not flushed), eager's the same way. Run on the GPU machine. The candidates are our own recorded
ones, run in this process, not in the sandboxed worker.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from pipeline import events as ev  # noqa: E402
from pipeline.runlog import Event, read_events  # noqa: E402
from pipeline.tasks import load_module  # noqa: E402
from pipeline.types import Candidate, Status  # noqa: E402


def recorded(events: list[Event], which: str) -> tuple[str, list[tuple[str, Candidate]]]:
    """(task id, [(edit, candidate)]): the run's best candidate, or every verified one, in run order."""
    typed = [ev.decode(e) for e in events]
    task_id = next(t.task["id"] for t in typed if isinstance(t, ev.Start))
    proposed = {t.candidate.key: t.candidate for t in typed if isinstance(t, ev.Proposal) and t.candidate}
    if which == "best":
        keys = [t.best_key for t in typed if isinstance(t, ev.End) and t.best_key]
    else:
        verified = (t.evaluation for t in typed if isinstance(t, ev.Result))
        keys = list(dict.fromkeys(e.key for e in verified if e.verdict.status is Status.OK))
    return task_id, [(proposed[k].edit or "", proposed[k]) for k in keys]


def kernel_times(model: Any, task: Any, calls: int) -> tuple[dict[str, float], float]:
    """(mean device ms a call of each kernel the model launches, the median ms of a call by CUDA events):
    fresh inputs each call, all made (and copied to the GPU) before the profiled region, so their
    generators' kernels are not counted. A kernel sum above the events' time means kernels overlapped."""
    import itertools

    import torch
    from event_timing import event_median_ms
    from torch.profiler import ProfilerActivity, profile

    inputs = [[x.cuda() if hasattr(x, "cuda") else x for x in task.get_inputs()] for _ in range(calls + 2)]
    with torch.no_grad():
        for xs in inputs[:2]:
            model(*xs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for xs in inputs[2:]:
                model(*xs)
            torch.cuda.synchronize()
        cycle = itertools.cycle(inputs[2:])
        wall = event_median_ms(lambda: model(*next(cycle)), calls, 0)
    total: dict[str, float] = defaultdict(float)
    for kev in prof.events():
        if kev.device_type.name == "CUDA":
            total[kev.name] += kev.device_time / 1000.0
    return {k: v / calls for k, v in sorted(total.items(), key=lambda kv: -kv[1])}, wall


def _table(title: str, times: dict[str, float], wall: float) -> str:
    s = sum(times.values()) or 1.0
    rows = [f"  {title}: {s:.3f} ms of kernels a call, {wall:.3f} ms a call by events"]
    rows += [f"    {ms:9.3f} ms {100 * ms / s:5.1f}%  {name[:110]}" for name, ms in times.items()]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+", type=Path, help="run logs, or task files (their tuned candidate)")
    ap.add_argument("--suite", type=Path, default=None, help="folder of the logs' task files")
    ap.add_argument("--compile", action="store_true", help="torch.compile's kernels too")
    ap.add_argument("--which", choices=("best", "all"), default="best")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--home", type=Path, default=Path("/tmp/kernelpro-ktimes"))
    args = ap.parse_args()

    import torch

    from pipeline.candidates import export_standalone, load_export
    from pipeline.compile import compile_candidates
    from pipeline.config import Config
    from pipeline.worker_jobs import reference_precision

    reference_precision()  # as the harness runs eager and hybrids: no TF32 in cuBLAS or cuDNN
    report: list[dict[str, Any]] = []
    for log in args.logs:
        if log.suffix == ".py":
            from expert_plans import tuned  # the tests' helper: the expert's tuned candidate

            task_id, task_path, cands = log.stem, log, [("tuned", tuned(log))]
        else:
            if args.suite is None:
                ap.error("--suite is needed to find a log's task file")
            task_id, cands = recorded(read_events(log), args.which)
            task_path = args.suite / f"{task_id}.py"
        task = load_module(task_path)
        torch.manual_seed(0)
        ref = task.Model(*task.get_init_inputs()).cuda().eval()
        kernels, wall = kernel_times(ref, task, args.calls)
        entry: dict[str, Any] = {
            "task": task_id,
            "eager": {"kernels": kernels, "wall_ms": wall},
            "candidates": [],
        }
        print(f"== {task_id}\n{_table('eager', kernels, wall)}", flush=True)
        if args.compile:
            times, wall = kernel_times(torch.compile(ref), task, args.calls)
            entry["compile"] = {"kernels": times, "wall_ms": wall}
            print(_table("torch.compile", times, wall), flush=True)
        builds = compile_candidates([c for _, c in cands], Config(home=args.home, arch="sm_90a"))
        for (edit, c), b in zip(cands, builds, strict=True):
            if b.status.value != "ok":
                print(f"  {edit}: build {b.status.value}")
                continue
            mod = load_export(export_standalone(c, b, args.home / f"{c.key}.py"))
            model = mod.ModelNew(*task.get_init_inputs()).cuda().eval()
            model.load_state_dict(ref.state_dict())
            times, wall = kernel_times(model, task, args.calls)
            entry["candidates"].append({"key": c.key, "edit": edit, "kernels": times, "wall_ms": wall})
            print(_table(f"{c.key} {edit}", times, wall), flush=True)
            del model
        report.append(entry)
        del ref
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
