"""The stage functions: probe a task, evaluate candidates (static check, compile, verify and time in the
workers), time the baselines, measure the GPU's ceilings, gather a verified candidate's profiling evidence.
Typed records in and out; a bad candidate is a status with reasons, never an exception. Which stage runs
when is pipeline/loop.py's business, not theirs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import baseline_cache, calibrate, jobs, reasons
from pipeline.candidates import load_candidate
from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.phases import phase
from pipeline.static_check import LauncherReport, check_launcher
from pipeline.tasks import TaskError
from pipeline.types import Baselines, Build, Candidate, Evaluation, Status, Task, Verdict
from pipeline.worker import JobResult, WorkerPool, visible_gpus

_log = logging.getLogger("kernelpro.calibrate")

Progress = Callable[[str, int, int], None]  # (stage, done, total)


class NoGPUError(Exception):
    pass


def open_pool(cfg: Config) -> WorkerPool:
    """Confined workers for candidates, one per GPU; the pool's reference worker (trusted work: probing
    tasks, calibration, torch.compile baselines) starts on first use."""
    if cfg.ray:  # one actor per GPU of the cluster, each wrapping a worker like these
        from pipeline import cluster

        cluster.connect(cfg.ray)
        return cluster.RayPool(cfg)  # type: ignore[return-value]
    if cfg.device == "cpu":
        return WorkerPool(cfg, [None])
    gpus = visible_gpus()
    if not gpus:
        raise NoGPUError("no NVIDIA GPU found (nvidia-smi lists none); run this on a GPU machine")
    return WorkerPool(cfg, gpus)


def settings(cfg: Config, **extra: Any) -> jobs.Settings:
    return jobs.Settings.of(cfg, **extra)


def probe_task(pool: WorkerPool, path: str | Path) -> Task:
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"task file not found: {path}")
    r = pool.reference.request(jobs.Probe(str(path.resolve())), timeout_s=120)
    if isinstance(r.answer, jobs.Probed):
        return r.answer.task
    failed = r.answer if isinstance(r.answer, jobs.Failed) else None
    raise TaskError(
        r.reason if failed and failed.task_error else f"{path.name}: probing the task failed: {r.reason}"
    )


def gpu_environment(pool: WorkerPool) -> dict[str, str]:
    """What the reference worker reports of its GPU and software (empty when it cannot)."""
    r = pool.reference.request(jobs.Environment("cuda"), timeout_s=120)
    return r.answer.environment if isinstance(r.answer, jobs.EnvironmentAnswer) else {}


def ceilings(
    pool: WorkerPool, cfg: Config, force: bool = False, environment: dict[str, str] | None = None
) -> calibrate.Ceilings | None:
    """This GPU's measured ceilings, from the cache or measured now (a few seconds). `environment`: the
    reference worker's, when the caller has it already."""
    if cfg.device != "cuda":
        return None
    gpu = (gpu_environment(pool) if environment is None else environment).get("gpu")
    if gpu and not force:
        cached = calibrate.load_cached(cfg.home, gpu)
        if cached is not None:
            return cached
        if time.monotonic() - REFUSED.get(gpu, ("", -math.inf))[1] < BUSY_RETRY_S:
            return None  # refused a moment ago: not measured again for every batch
    r = pool.reference.request(jobs.Calibrate(), timeout_s=300)
    if not isinstance(r.answer, jobs.Calibrated):
        raise RuntimeError(f"calibration failed: {r.reason or 'the worker gave no ceilings'}")
    c = r.answer.ceilings
    if (why := calibrate.untrusted(c)) is not None:
        REFUSED[c.gpu] = (why, time.monotonic())
        _log.warning("%s", why)
        return None
    calibrate.save(cfg.home, c)
    return c


# Calibrations refused on a busy GPU, by GPU name: (why, when); measured again after BUSY_RETRY_S.
REFUSED: dict[str, tuple[str, float]] = {}
BUSY_RETRY_S = 600.0


def candidate_code(candidate: Candidate, build: Build, report: LauncherReport) -> jobs.CandidateCode:
    """A compiled candidate as the workers load it; its kernels are those ptxas built and the launcher uses."""
    names = {r.name for r in build.resources} | set(report.kernels_used)
    return jobs.CandidateCode(
        key=candidate.key,
        launcher=candidate.launcher,
        cubin_path=str(Path(build.cubin_path).resolve()) if build.cubin_path else None,
        kernel_names=tuple(sorted(names)),
        kind=report.kind,
        library_ops=tuple(report.library_ops),
    )


def evaluate_job(
    task: Task,
    candidate: Candidate,
    build: Build,
    report: LauncherReport,
    cfg: Config,
    ceil: calibrate.Ceilings | None,
    **extra: Any,
) -> jobs.Evaluate:
    return jobs.Evaluate(task, candidate_code(candidate, build, report), settings(cfg, **extra), ceil)


def result_from_job(candidate: Candidate, build: Build | None, r: JobResult) -> Evaluation:
    if r.ok and isinstance(r.answer, jobs.Evaluated):
        return Evaluation(candidate.key, build, r.answer.verdict, r.answer.measurement)
    status = r.status or Status.CRASH  # the worker died, was killed, or its handler raised
    reason = r.reason or "worker gave no verdict"
    return Evaluation(
        candidate.key, build, Verdict(candidate.key, status, reasons=(f"{status.value}: {reason}",)), None
    )


def _static_or_build_failure(c: Candidate, rep: LauncherReport, b: Build | None) -> Evaluation | None:
    """The evaluation of a candidate that never reaches a worker, or None for one that does."""
    if not rep.ok:
        why = tuple(f"{reasons.STATIC}:{v}" for v in rep.violations)
        return Evaluation(c.key, None, Verdict(c.key, Status.REJECTED, kind=rep.kind, reasons=why), None)
    if b is None or b.status != Status.OK:
        status = b.status if b else Status.COMPILE_ERROR
        return Evaluation(
            c.key, b, Verdict(c.key, status, reasons=(f"{status.value}: {b.log if b else ''}",)), None
        )
    return None


def evaluate_candidates(
    task_path: str | Path,
    candidates: Sequence[Candidate | str | Path],
    cfg: Config,
    progress: Progress | None = None,
    pool: WorkerPool | None = None,
) -> list[Evaluation]:
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
        results: list[Evaluation | None] = [None] * len(cands)
        batch: list[jobs.Job] = []
        where: list[int] = []
        for i, (c, rep, b) in enumerate(zip(cands, reports, builds, strict=True)):
            results[i] = _static_or_build_failure(c, rep, b)
            if results[i] is None and b is not None:
                batch.append(evaluate_job(task, c, b, rep, cfg, ceil))
                where.append(i)
        done = [0]

        def on_result(_: int, __: JobResult) -> None:
            done[0] += 1
            if progress:
                progress("evaluate", done[0], len(batch))

        for i, r in zip(where, pool.map(batch, on_result=on_result), strict=True):
            results[i] = result_from_job(cands[i], builds[i], r)
        done_results = [r for r in results if r is not None]
        return _with_compiled_baselines(task_path, done_results, cfg, pool)
    finally:
        if own_pool:
            pool.close()


def _with_compiled_baselines(
    task_path: Path, results: list[Evaluation], cfg: Config, pool: WorkerPool
) -> list[Evaluation]:
    """Eager is timed beside each candidate in its (confined) worker; torch.compile needs to run ptxas, so
    its modes are timed once in the reference worker, the same way, and added to every measurement."""
    modes = tuple(m for m in cfg.baselines if m != "eager")
    if not modes or not any(r.measurement for r in results):
        return results
    try:
        _, base = run_baselines(task_path, cfg.replace(baselines=modes, energy=False), pool=pool)
        extra, notes = base.timings, tuple(reasons.as_note(n) for n in base.notes)
    except (RuntimeError, TaskError) as e:  # the candidates' results stand without them
        extra, notes = {}, (reasons.as_note(f"{', '.join(modes)} not measured: {e}"),)
    out = []
    for r in results:
        if r.measurement is not None:
            m = r.measurement
            m = dataclasses.replace(m, baselines={**m.baselines, **extra}, reasons=m.reasons + notes)
            r = dataclasses.replace(r, measurement=m)
        out.append(r)
    return out


def run_baselines(
    task_path: str | Path, cfg: Config, pool: WorkerPool | None = None, cached: bool = False
) -> tuple[Task, Baselines]:
    """Eager and torch.compile baselines of a task, measured in one worker run; compile time reported apart.
    `cached`: reuse the ones measured for this task's source, settings and GPU software before
    (pipeline/baseline_cache.py), and keep these for next time."""
    if not Path(task_path).is_file():
        raise TaskError(f"task file not found: {task_path}")
    own_pool = pool is None
    pool = pool or open_pool(cfg)
    try:
        task = probe_task(pool, task_path)
        env = gpu_environment(pool) if cfg.device == "cuda" else {}
        key = baseline_cache.key(task, settings(cfg), env) if cached and env.get("gpu") else None
        base = baseline_cache.load(cfg.home, key) if key else None
        if base is None:
            # torch.compile runs ptxas and process pools: only the unconfined reference worker can.
            job = jobs.Baseline(task, settings(cfg))
            r = pool.reference.request(job, timeout_s=max(cfg.job_timeout_s, 900))
            if not isinstance(r.answer, jobs.BaselinesAnswer):
                raise RuntimeError(f"baseline run failed: {r.reason or 'the worker gave no timings'}")
            base = r.answer.baselines
            if key and set(cfg.baselines) <= set(base.timings):  # a mode that failed is tried again next time
                baseline_cache.save(cfg.home, key, base)
        ceil = ceilings(pool, cfg, environment=env)
        if ceil is not None:
            base = dataclasses.replace(base, floor_ms=calibrate.floor_ms(task, ceil))
        return task, base
    finally:
        if own_pool:
            pool.close()


@dataclass(frozen=True)
class Profiling:
    """A candidate's evaluation and, when it verified, the evidence the profiling tools read."""

    evaluation: Evaluation
    evidence: Any | None  # pipeline.profile.evidence.Evidence
    notes: tuple[str, ...] = ()
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each part: sass, system, ncu


def profile_candidate(
    task_path: str | Path,
    candidate: Candidate | str | Path,
    cfg: Config,
    pool: WorkerPool | None = None,
    evaluation: Evaluation | None = None,
    warm_next: bool = False,
) -> Profiling:
    """Evaluate (unless `evaluation` is this candidate's already), then gather the evidence the profiling
    tools read: SASS, ncu counters, a system profile. Only a verified candidate is profiled: advice on a
    wrong kernel is wasted. `warm_next`: more profiles will follow (a search), so ncu's target for the next
    is started once this one is done (pipeline/profile/warm.py)."""
    from pipeline.profile import collect
    from pipeline.profile.evidence import Evidence

    cand = candidate if isinstance(candidate, Candidate) else load_candidate(candidate, Path(task_path).stem)
    own_pool = pool is None
    pool = pool or open_pool(cfg)
    try:
        (res,) = (
            [evaluation] if evaluation is not None else evaluate_candidates(task_path, [cand], cfg, pool=pool)
        )
        if res.status != Status.OK or res.build is None or res.build.cubin_path is None:
            return Profiling(res, None, ("not profiled: the candidate did not pass verification",))
        task = probe_task(pool, task_path)
        notes: list[str] = []
        code = candidate_code(cand, res.build, check_launcher(cand.launcher))
        assert code.cubin_path is not None
        seconds: dict[str, float] = {}
        sass_seconds: dict[str, float] = {}

        def dump_sass() -> str | None:  # cuobjdump on the CPU, while the GPU parts below run
            with phase(sass_seconds, "sass"):
                return collect.dump_sass(code.cubin_path)

        sass_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sass")
        sass_job = sass_pool.submit(dump_sass)
        sass_pool.shutdown(wait=False)  # the submitted dump still runs; nothing else will be
        with phase(seconds, "system"):
            system = pool.first.request(jobs.SystemProfile(task, settings(cfg), code), timeout_s=300)
        if not isinstance(system.answer, jobs.SystemProfiled):
            notes.append(f"no system profile: {system.reason}")
        with phase(seconds, "ncu"):
            ncu = collect.run_ncu(
                jobs.Ncu(str(Path(task_path).resolve()), cfg.seed, code), cfg, warm_next=warm_next
            )
        seconds.update({f"ncu_{k}": v for k, v in ncu.parts.items()})
        if ncu.warm:
            notes.append("ncu's target was started ahead (its start is not in the ncu seconds)")
        if ncu.cuda_ahead:
            notes.append("ncu's target brought CUDA up before its job (not in the ncu seconds)")
        if ncu.status != Status.OK:
            notes.append(f"no hardware counters: {ncu.reason}")
        sass_text = sass_job.result()
        seconds.update(sass_seconds)  # not added to the wall time: it ran beside the system profile and ncu
        if sass_text is None:
            notes.append("no SASS: cuobjdump not found")
        m = res.measurement
        env = m.environment if m else {}
        evidence = Evidence(
            task=task,
            ours=code.kernel_names,
            timing=m.timing if m else None,
            energy=m.energy if m else None,
            ceilings=ceilings(pool, cfg),
            kernels=ncu.kernels,
            resources=res.build.resources,
            sass=collect.parse_sass(sass_text) if sass_text else {},
            system=system.answer.system if isinstance(system.answer, jobs.SystemProfiled) else None,
            power_limit_w=float(env["power_limit_w"]) if env.get("power_limit_w") else None,
        )
        return Profiling(res, evidence, tuple(notes), seconds)
    finally:
        if own_pool:
            pool.close()
