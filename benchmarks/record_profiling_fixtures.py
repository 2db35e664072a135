"""Record the profiling fixtures on a GPU: for each case under tests/fixtures/profiling/kernels/, the harness
verdict and timing, the curated ncu counters, ncu's own guided-analysis rules, SASS and a system profile.

    python benchmarks/record_profiling_fixtures.py --out DIR [--only a,b] [--no-rules]

Writes DIR/<case>/{eval.json, task.json, ncu.csv, ncu.json, sass.txt, system.json, rules.txt} and
DIR/{ceilings.json, metrics_known.txt}. The CPU tests read these files from tests/fixtures/profiling/recorded/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import jobs, stages  # noqa: E402
from pipeline.candidates import load_candidate  # noqa: E402
from pipeline.config import Config, load  # noqa: E402
from pipeline.profile import collect, warm  # noqa: E402
from pipeline.static_check import check_launcher  # noqa: E402
from pipeline.types import Status, to_dict  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "profiling"
NCU_LAUNCH_COUNT = collect.PER_CONFIG  # one launch per distinct kernel configuration, as the loop does


def rules_text(ncu: str, job: jobs.Ncu, cfg: Config, timeout_s: float) -> str:
    """ncu's own analysis (--set full, rules on) as a person would read it: the baseline we compare to.
    Started as run_ncu starts ncu: through the sandbox, since the target runs the candidate."""

    def command(scratch: Path, _log: Path, plan) -> list[str]:
        job_path = scratch / "job.json"
        job_path.write_bytes(jobs.encode(dataclasses.replace(job, sandbox=plan.to_json()) if plan else job))
        return [
            ncu,
            "--clock-control",
            "none",
            "--profile-from-start",
            "off",
            "-c",
            "4",
            "--set",
            "full",
            "--page",
            "details",
            "--print-details",
            "all",
            sys.executable,
            "-m",
            "pipeline.profile.target",
            str(job_path),
        ]

    proc, _, _ = warm.spawn_tree(cfg, job, command, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"(ncu --set full did not finish in {timeout_s:.0f} s)"
    return out + ("\n" + err[-2000:] if proc.returncode else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="")
    ap.add_argument("--no-rules", action="store_true")
    args = ap.parse_args()
    out_root: Path = args.out
    out_root.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="kp-record-"))
    cfg = load(home=home, baselines=("eager",), energy=True, energy_window_s=1.0, energy_repeats=3)
    ncu = collect.find_ncu()
    assert ncu, "ncu not found"
    known = collect.query_metrics(ncu)
    (out_root / "metrics_known.txt").write_text("\n".join(sorted(known)) + "\n")
    metrics = tuple(m for m in collect.curated_metrics() if collect.metric_known(m, known))
    print(f"{len(metrics)} of {len(collect.curated_metrics())} curated metrics known to ncu", flush=True)
    # flawed cases first: if the run is cut short, the good ones are the cheaper loss
    cases = sorted(
        (p for p in (FIXTURES / "kernels").iterdir() if (p / "expect.toml").is_file()),
        key=lambda p: (p.name.startswith("good"), p.name),
    )
    if args.only:
        wanted = set(args.only.split(","))
        cases = [c for c in cases if c.name in wanted]
    with stages.open_pool(cfg) as pool:
        ceil = stages.ceilings(pool, cfg)
        (out_root / "ceilings.json").write_text(json.dumps(ceil.__dict__, indent=2))
        for case in cases:
            t0 = time.time()
            expect = tomllib.loads((case / "expect.toml").read_text())
            task_path = FIXTURES / "tasks" / f"{expect['task']}.py"
            dest = out_root / case.name
            dest.mkdir(exist_ok=True)
            cand = load_candidate(case, task_path.stem)
            (r,) = stages.evaluate_candidates(task_path, [cand], cfg, pool=pool)
            task = stages.probe_task(pool, task_path)
            # Paths are stored relative to the repository (cubins by name): recordings travel between machines.
            task_record = {k: v for k, v in to_dict(task).items() if k != "source"}
            task_record["path"] = str(task_path.relative_to(ROOT))
            (dest / "task.json").write_text(json.dumps(task_record, indent=2))
            (dest / "eval.json").write_text(
                json.dumps(
                    {
                        "build": {**to_dict(r.build), "cubin_path": Path(r.build.cubin_path or "").name}
                        if r.build
                        else None,
                        "verdict": to_dict(r.verdict),
                        "measurement": to_dict(r.measurement) if r.measurement else None,
                    },
                    indent=2,
                )
            )
            print(f"{case.name}: {r.verdict.status.value} {list(r.verdict.reasons)[:2]}", flush=True)
            if r.build is None or r.build.cubin_path is None:
                continue
            sass = collect.dump_sass(r.build.cubin_path)
            if sass:
                (dest / "sass.txt").write_text(sass)
            code = stages.candidate_code(cand, r.build, check_launcher(cand.launcher))
            s = pool.first.request(jobs.SystemProfile(task, jobs.Settings(seed=0), code), timeout_s=120)
            if isinstance(s.answer, jobs.SystemProfiled):
                recorded = {"system": s.answer.system, "loaded_modules": s.answer.loaded_modules}
            else:
                recorded = {"error": s.reason}
            (dest / "system.json").write_text(json.dumps(recorded, indent=2))
            job = jobs.Ncu(str(task_path), 0, code)
            res = collect.run_ncu(job, cfg, metrics=metrics, timeout_s=150, launch_count=NCU_LAUNCH_COUNT)
            (dest / "ncu.csv").write_text(res.raw)
            (dest / "ncu.json").write_text(
                json.dumps(
                    {
                        "status": res.status.value,
                        "seconds": res.seconds,
                        "kernels": len(res.kernels),
                        "missing": res.missing_metrics,
                        "log": res.log if res.status != Status.OK else "",
                    },
                    indent=2,
                )
            )
            if not args.no_rules:
                (dest / "rules.txt").write_text(rules_text(ncu, job, cfg, timeout_s=120))
            print(
                f"  ncu {res.status.value} {len(res.kernels)} kernels in {res.seconds:.1f} s; case {time.time() - t0:.1f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
