"""The only module that knows the order of stages: probe -> static check -> compile -> verify + time.

(The search loop of later issues will extend this with profiling and generation.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import calibrate
from pipeline.candidates import load_candidate
from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.static_check import LauncherReport, check_launcher
from pipeline.tasks import TaskError
from pipeline.types import Build, Candidate, Measurement, Status, Task, Timing, Verdict, from_dict, to_dict
from pipeline.worker import JobResult, WorkerPool, visible_gpus

Progress = Callable[[str, int, int], None]  # (stage, done, total)


class NoGPUError(Exception):
    pass


@dataclass(frozen=True)
class EvalResult:
    candidate: Candidate
    build: Build | None
    verdict: Verdict
    measurement: Measurement | None


def open_pool(cfg: Config) -> WorkerPool:
    if cfg.device == "cpu":
        return WorkerPool(cfg, [None])
    gpus = visible_gpus()
    if not gpus:
        raise NoGPUError("no NVIDIA GPU found (nvidia-smi lists none); run this on a GPU machine")
    return WorkerPool(cfg, gpus)


def settings(cfg: Config, **extra: Any) -> dict[str, Any]:
    s = {
        "device": cfg.device,
        "trials": cfg.trials,
        "seed": cfg.seed,
        "timing_trials": cfg.timing_trials,
        "timing_budget_s": cfg.timing_budget_s,
        "warmup": cfg.warmup,
        "energy": cfg.energy,
        "energy_window_s": cfg.energy_window_s,
        "energy_repeats": cfg.energy_repeats,
        "baselines": list(cfg.baselines),
        "suspicious_speedup": cfg.suspicious_speedup,
        "time": True,
    }
    s.update(extra)
    return s


def probe_task(pool: WorkerPool, path: str | Path) -> Task:
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"task file not found: {path}")
    r = pool.first.request({"kind": "probe", "path": str(path.resolve())}, timeout_s=120)
    if not r.ok:
        raise TaskError(
            r.reason if r.data.get("task_error") else f"{path.name}: probing the task failed: {r.reason}"
        )
    return from_dict(Task, r.data["task"])


def ceilings(pool: WorkerPool, cfg: Config, force: bool = False) -> calibrate.Ceilings | None:
    """This GPU's measured ceilings, from the cache or measured now (a few seconds)."""
    if cfg.device != "cuda":
        return None
    env = pool.first.request({"kind": "environment", "device": "cuda"}, timeout_s=120)
    gpu = env.data.get("environment", {}).get("gpu") if env.ok else None
    if gpu and not force:
        cached = calibrate.load_cached(cfg.home, gpu)
        if cached is not None:
            return cached
    r = pool.first.request({"kind": "calibrate"}, timeout_s=300)
    if not r.ok:
        raise RuntimeError(f"calibration failed: {r.reason}")
    c = calibrate.Ceilings(**r.data["ceilings"])
    calibrate.save(cfg.home, c)
    return c


def evaluate_job(
    task: Task,
    candidate: Candidate,
    build: Build | None,
    report: LauncherReport,
    cfg: Config,
    ceil: calibrate.Ceilings | None,
    **extra: Any,
) -> dict[str, Any]:
    names = tuple(r.name for r in build.resources) if build else ()
    return {
        "kind": "evaluate",
        "task": to_dict(task),
        "candidate": {
            "key": candidate.key,
            "launcher": candidate.launcher,
            "cubin_path": str(Path(build.cubin_path).resolve()) if build and build.cubin_path else None,
            "kernel_names": sorted(set(names) | set(report.kernels_used)),
            "kind": report.kind.value,
            "library_ops": list(report.library_ops),
        },
        "settings": settings(cfg, **extra),
        "ceilings": ceil.__dict__ if ceil else None,
    }


def result_from_job(candidate: Candidate, build: Build | None, r: JobResult) -> EvalResult:
    if r.ok and "verdict" in r.data:
        verdict = from_dict(Verdict, r.data["verdict"])
        m = r.data.get("measurement")
        return EvalResult(candidate, build, verdict, from_dict(Measurement, m) if m else None)
    status = r.status or Status.CRASH
    reason = r.reason or "worker gave no verdict"
    code = status.value if status in (Status.CRASH, Status.TIMEOUT) else "error"
    return EvalResult(candidate, build, Verdict(candidate.key, status, reasons=(f"{code}: {reason}",)), None)


def evaluate_candidates(
    task_path: str | Path,
    candidates: Sequence[Candidate | str | Path],
    cfg: Config,
    progress: Progress | None = None,
    pool: WorkerPool | None = None,
) -> list[EvalResult]:
    """Every candidate through static check, compile and the worker; one result per candidate, in order."""
    task_path = Path(task_path)
    if not task_path.is_file():
        raise TaskError(f"task file not found: {task_path}")
    # Bad input is reported before any worker or GPU is touched.
    cands = [c if isinstance(c, Candidate) else load_candidate(c, task_path.stem) for c in candidates]
    own_pool = pool is None
    pool = pool or open_pool(cfg)
    try:
        task = probe_task(pool, task_path)
        reports = [check_launcher(c.launcher) for c in cands]
        to_build = [i for i, rep in enumerate(reports) if rep.ok]
        builds: list[Build | None] = [None] * len(cands)
        built = compile_candidates(
            [cands[i] for i in to_build],
            cfg,
            progress=(lambda d, t: progress("compile", d, t)) if progress else None,
        )
        for i, b in zip(to_build, built, strict=True):
            builds[i] = b
        ceil = ceilings(pool, cfg)
        results: list[EvalResult | None] = [None] * len(cands)
        jobs, where = [], []
        for i, (c, rep, b) in enumerate(zip(cands, reports, builds, strict=True)):
            if not rep.ok:
                reasons = tuple(f"static:{v}" for v in rep.violations)
                results[i] = EvalResult(
                    c, None, Verdict(c.key, Status.REJECTED, kind=rep.kind, reasons=reasons), None
                )
            elif b is None or b.status != Status.OK:
                status = b.status if b else Status.COMPILE_ERROR
                results[i] = EvalResult(
                    c, b, Verdict(c.key, status, reasons=(f"{status.value}: {b.log if b else ''}",)), None
                )
            else:
                jobs.append(evaluate_job(task, c, b, rep, cfg, ceil))
                where.append(i)
        done = [0]

        def on_result(_: int, __: JobResult) -> None:
            done[0] += 1
            if progress:
                progress("evaluate", done[0], len(jobs))

        for i, r in zip(where, pool.map(jobs, on_result=on_result), strict=True):
            results[i] = result_from_job(cands[i], builds[i], r)
        return [r for r in results if r is not None]
    finally:
        if own_pool:
            pool.close()


def run_baselines(
    task_path: str | Path, cfg: Config, pool: WorkerPool | None = None
) -> tuple[Task, dict[str, Any]]:
    """Eager and torch.compile baselines of a task, measured in one worker run; compile time reported apart."""
    if not Path(task_path).is_file():
        raise TaskError(f"task file not found: {task_path}")
    own_pool = pool is None
    pool = pool or open_pool(cfg)
    try:
        task = probe_task(pool, task_path)
        r = pool.first.request(
            {"kind": "baseline", "task": to_dict(task), "settings": settings(cfg)},
            timeout_s=max(cfg.job_timeout_s, 900),
        )
        if not r.ok:
            raise RuntimeError(f"baseline run failed: {r.reason}")
        data = dict(r.data)
        data["timings"] = {k: from_dict(Timing, v) for k, v in data["timings"].items()}
        ceil = ceilings(pool, cfg)
        if ceil is not None:
            data["floor_ms"] = calibrate.floor_ms(task, ceil)
        return task, data
    finally:
        if own_pool:
            pool.close()


@dataclass(frozen=True)
class ProfileResult:
    result: EvalResult
    evidence: Any | None  # pipeline.profile.evidence.Evidence, once the candidate is verified
    notes: tuple[str, ...] = ()


def profile_candidate(
    task_path: str | Path, candidate: Candidate | str | Path, cfg: Config, pool: WorkerPool | None = None
) -> ProfileResult:
    """Evaluate, then gather the evidence the profiling tools read: SASS, ncu counters, a system profile.
    Only a verified candidate is profiled: advice on a wrong kernel is wasted."""
    from pipeline.profile import collect
    from pipeline.profile.evidence import Evidence

    own_pool = pool is None
    pool = pool or open_pool(cfg)
    try:
        (res,) = evaluate_candidates(task_path, [candidate], cfg, pool=pool)
        if res.verdict.status != Status.OK or res.build is None or res.build.cubin_path is None:
            return ProfileResult(res, None, ("not profiled: the candidate did not pass verification",))
        task = probe_task(pool, task_path)
        notes: list[str] = []
        names = tuple(
            sorted(
                {k.name for k in res.build.resources}
                | set(check_launcher(res.candidate.launcher).kernels_used)
            )
        )
        cand = {
            "key": res.candidate.key,
            "launcher": res.candidate.launcher,
            "cubin_path": str(Path(res.build.cubin_path).resolve()),
            "kernel_names": list(names),
        }
        sass_text = collect.dump_sass(cand["cubin_path"])
        if sass_text is None:
            notes.append("no SASS: cuobjdump not found")
        system = pool.first.request(
            {"kind": "system_profile", "task": to_dict(task), "candidate": cand, "settings": settings(cfg)},
            timeout_s=300,
        )
        if not system.ok:
            notes.append(f"no system profile: {system.reason}")
        ncu = collect.run_ncu({"task_path": str(Path(task_path).resolve()), "seed": cfg.seed, **cand}, cfg)
        if ncu.status != Status.OK:
            notes.append(f"no hardware counters: {ncu.log.splitlines()[0] if ncu.log else ncu.status.value}")
        m = res.measurement
        env = m.environment if m else {}
        evidence = Evidence(
            task=task,
            ours=names,
            timing=m.timing if m else None,
            energy=m.energy if m else None,
            ceilings=ceilings(pool, cfg),
            kernels=ncu.kernels,
            resources=res.build.resources,
            sass=collect.parse_sass(sass_text) if sass_text else {},
            system=system.data.get("system") if system.ok else None,
            power_limit_w=float(env["power_limit_w"]) if env.get("power_limit_w") else None,
        )
        return ProfileResult(res, evidence, tuple(notes))
    finally:
        if own_pool:
            pool.close()
