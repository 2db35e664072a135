"""Which sandbox layers the GPU machine tolerates: one run, under three minutes.

    python benchmarks/sandbox_probe.py OUT.json [--ncu-budget-s 90] [--no-ncu]

(a) A worker per combination of layers (all 16 subsets of userns, netns, landlock, seccomp), started in
    parallel on the first GPU, evaluates the honest softmax candidate (examples/candidates/softmax on
    tasks/softmax.py) in full (verification, timing against eager, the profiler's confirmation, NVML
    energy), then a system profile (the torch profiler). Evaluations run one after another, so timings are
    not disturbed by the other workers.
(b) ncu profiles the same candidate with each combination of layers on its process tree (namespaces through
    the trampoline, Landlock and seccomp inside the target after CUDA's initialisation), as many as fit in
    the budget, most telling first.

Prints a table per part and writes everything, with the probe's findings and startup times, to OUT.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import jobs, sandbox, stages  # noqa: E402
from pipeline.candidates import load_candidate  # noqa: E402
from pipeline.compile import compile_candidates  # noqa: E402
from pipeline.config import SANDBOX_LAYERS, Config, load  # noqa: E402
from pipeline.profile import collect  # noqa: E402
from pipeline.static_check import check_launcher  # noqa: E402
from pipeline.worker import Worker, WorkerPool, visible_gpus  # noqa: E402

TASK = ROOT / "tasks" / "softmax.py"
CANDIDATE = ROOT / "examples" / "candidates" / "softmax"
NCU_METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum")
COMBOS = [c for n in range(len(SANDBOX_LAYERS) + 1) for c in itertools.combinations(SANDBOX_LAYERS, n)]
# ncu: the extremes first, then each layer alone, then the rest
NCU_ORDER = [(), SANDBOX_LAYERS, *((x,) for x in SANDBOX_LAYERS)]
NCU_ORDER += [c for c in COMBOS if c not in NCU_ORDER]


def name(layers: tuple[str, ...]) -> str:
    return "+".join(layers) or "none"


def cfg_for(base: Config, layers: tuple[str, ...], **kw: Any) -> Config:
    return base.replace(sandbox=bool(layers), sandbox_layers=layers, sandbox_ncu_layers=layers, **kw)


def startup(base: Config, gpu: str | None) -> dict[str, float]:
    """Seconds to a first answer, unconfined and fully confined (which warms CUDA up before answering)."""
    out = {}
    for label, layers in (("unconfined", ()), ("confined", SANDBOX_LAYERS)):
        w = Worker(cfg_for(base, layers), gpu, name=f"start-{label}")
        t0 = time.monotonic()
        r = w.request(jobs.Ping())
        out[label] = round(time.monotonic() - t0, 2) if r.ok else -1.0
        w.close()
    return out


def workers_part(base: Config, gpu: str | None, task, cand, build, report) -> list[dict[str, Any]]:
    workers = {c: Worker(cfg_for(base, c), gpu, name=f"w-{name(c)}") for c in COMBOS}
    pings: dict[tuple[str, ...], Any] = {}

    def start(c: tuple[str, ...]) -> None:
        t0 = time.monotonic()
        r = workers[c].request(jobs.Ping(), timeout_s=180)
        pings[c] = (r, time.monotonic() - t0)

    threads = [threading.Thread(target=start, args=(c,)) for c in COMBOS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = []
    for c in COMBOS:
        w = workers[c]
        ping, start_s = pings[c]
        row: dict[str, Any] = {"layers": name(c), "started": ping.ok, "start_s": round(start_s, 1)}
        row["sandbox"] = w.sandbox
        if not ping.ok:
            row["error"] = ping.reason[:400]
            rows.append(row)
            continue
        job = stages.evaluate_job(task, cand, build, report, w.cfg, None)
        t0 = time.monotonic()
        r = w.request(job, timeout_s=120)
        row["evaluate_s"] = round(time.monotonic() - t0, 1)
        if isinstance(r.answer, jobs.Evaluated):
            v, m = r.answer.verdict, r.answer.measurement
            row.update(
                status=v.status.value,
                reasons=list(v.reasons)[:4],
                median_ms=m.timing.median_ms if m and m.timing else None,
                energy=bool(m and m.energy),
            )
        else:
            row.update(status=(r.status.value if r.status else "error"), reasons=[r.reason[:400]])
        s = w.request(jobs.SystemProfile(task, jobs.Settings(seed=0), job.candidate), timeout_s=120)
        row["system_profile"] = "ok" if s.ok else s.reason[:300]
        rows.append(row)
        print(f"  worker {name(c):32s} {row.get('status')} {row['system_profile'][:40]}", flush=True)
    for w in workers.values():
        w.close()
    return rows


def ncu_part(base: Config, task, cand, build, budget_s: float) -> list[dict[str, Any]]:
    code = jobs.CandidateCode(
        cand.key,
        cand.launcher,
        str(Path(build.cubin_path).resolve()),
        tuple(sorted({k.name for k in build.resources})),
    )
    job = jobs.Ncu(str(TASK), 0, code)
    rows = []
    t_start = time.monotonic()
    for c in NCU_ORDER:
        if time.monotonic() - t_start > budget_s:
            rows.append({"layers": name(c), "status": "skipped (budget)"})
            continue
        cfg = cfg_for(base, c)
        before = set((cfg.home / "scratch").glob("ncu-*"))
        res = collect.run_ncu(job, cfg, metrics=NCU_METRICS, timeout_s=60)
        scratch = next(iter(set((cfg.home / "scratch").glob("ncu-*")) - before), None)
        reports = {}
        for f in ("sandbox-early.json", "sandbox.json"):
            p = scratch / f if scratch else None
            if p and p.exists():
                reports[f] = json.loads(p.read_text())
        row = {
            "layers": name(c),
            "status": res.status.value,
            "kernels": len(res.kernels),
            "seconds": round(res.seconds, 1),
            "reports": reports,
            "log": res.log[-600:],
        }
        rows.append(row)
        print(
            f"  ncu {name(c):32s} {res.status.value} {len(res.kernels)} kernels {res.seconds:.1f} s",
            flush=True,
        )
    return rows


def table(rows: list[dict[str, Any]], cols: tuple[str, ...]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))[:60]) for r in rows)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += [
        "  ".join(str(r.get(c, ""))[:60].ljust(w) for c, w in zip(cols, widths, strict=True)) for r in rows
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--ncu-budget-s", type=float, default=90.0)
    ap.add_argument("--no-ncu", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    home = Path(tempfile.mkdtemp(prefix="kp-sandbox-probe-"))
    base = load(
        home=home,
        baselines=("eager",),
        energy=True,
        energy_window_s=0.3,
        energy_repeats=1,
        timing_budget_s=0.3,
        job_timeout_s=120,
    )
    result: dict[str, Any] = {"probe": sandbox.probe(), "landlock_abi": sandbox.landlock_abi()}
    print("probe:", result["probe"], "landlock ABI", result["landlock_abi"], flush=True)
    gpus = visible_gpus()
    gpu = gpus[0] if gpus else None
    cand = load_candidate(CANDIDATE, "softmax")
    (build,) = compile_candidates([cand], base)
    report = check_launcher(cand.launcher)
    with WorkerPool(base, [gpu]) as pool:
        task = stages.probe_task(pool, TASK)
    result["startup_s"] = startup(base, gpu)
    print("startup (s to a first answer):", result["startup_s"], flush=True)
    result["workers"] = workers_part(base, gpu, task, cand, build, report)
    if not args.no_ncu:
        result["ncu"] = ncu_part(base, task, cand, build, args.ncu_budget_s)
    result["seconds"] = round(time.monotonic() - t0, 1)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print("\n(a) the worker on the GPU, softmax candidate")
    print(table(result["workers"], ("layers", "started", "start_s", "status", "system_profile", "reasons")))
    if "ncu" in result:
        print("\n(b) ncu on the same candidate")
        print(table(result["ncu"], ("layers", "status", "kernels", "seconds", "log")))
    print(f"\n{result['seconds']} s; JSON in {args.out}")


if __name__ == "__main__":
    main()
