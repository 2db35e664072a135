"""The only module that knows the order of stages: probe -> static check -> compile -> verify + time.

(The search loop of later issues will extend this with profiling and generation.)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import calibrate
from pipeline.candidates import load_candidate
from pipeline.compile import compile_candidates, resolve_arch
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
    """Confined workers for candidates, one per GPU; the pool's reference worker (trusted work: probing
    tasks, calibration, torch.compile baselines) starts on first use."""
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
    r = pool.reference.request({"kind": "probe", "path": str(path.resolve())}, timeout_s=120)
    if not r.ok:
        raise TaskError(
            r.reason if r.data.get("task_error") else f"{path.name}: probing the task failed: {r.reason}"
        )
    return from_dict(Task, r.data["task"])


def ceilings(pool: WorkerPool, cfg: Config, force: bool = False) -> calibrate.Ceilings | None:
    """This GPU's measured ceilings, from the cache or measured now (a few seconds)."""
    if cfg.device != "cuda":
        return None
    env = pool.reference.request({"kind": "environment", "device": "cuda"}, timeout_s=120)
    gpu = env.data.get("environment", {}).get("gpu") if env.ok else None
    if gpu and not force:
        cached = calibrate.load_cached(cfg.home, gpu)
        if cached is not None:
            return cached
    r = pool.reference.request({"kind": "calibrate"}, timeout_s=300)
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
        done_results = [r for r in results if r is not None]
        return _with_compiled_baselines(task_path, done_results, cfg, pool)
    finally:
        if own_pool:
            pool.close()


def _with_compiled_baselines(
    task_path: Path, results: list[EvalResult], cfg: Config, pool: WorkerPool
) -> list[EvalResult]:
    """Eager is timed beside each candidate in its (confined) worker; torch.compile needs to run ptxas, so
    its modes are timed once in the reference worker, the same way, and added to every measurement."""
    import dataclasses

    modes = tuple(m for m in cfg.baselines if m != "eager")
    if not modes or not any(r.measurement for r in results):
        return results
    try:
        _, data = run_baselines(task_path, cfg.replace(baselines=modes, energy=False), pool=pool)
    except (RuntimeError, TaskError) as e:  # the candidates' results stand without them
        data = {"timings": {}, "notes": [f"{', '.join(modes)} not measured: {e}"]}
    extra = data["timings"]
    notes = tuple(n if n.startswith("note:") else f"note: {n}" for n in data.get("notes", ()))
    out = []
    for r in results:
        if r.measurement is not None:
            m = r.measurement
            r = dataclasses.replace(
                r,
                measurement=dataclasses.replace(
                    m, baselines={**m.baselines, **extra}, reasons=m.reasons + notes
                ),
            )
        out.append(r)
    return out


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
        # torch.compile runs ptxas and process pools: only the unconfined reference worker can.
        r = pool.reference.request(
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
    task_path: str | Path,
    candidate: Candidate | str | Path,
    cfg: Config,
    pool: WorkerPool | None = None,
    result: EvalResult | None = None,
) -> ProfileResult:
    """Evaluate (unless `result` is this candidate's evaluation already), then gather the evidence the
    profiling tools read: SASS, ncu counters, a system profile. Only a verified candidate is profiled:
    advice on a wrong kernel is wasted."""
    from pipeline.profile import collect
    from pipeline.profile.evidence import Evidence

    own_pool = pool is None
    pool = pool or open_pool(cfg)
    try:
        (res,) = (
            [result] if result is not None else evaluate_candidates(task_path, [candidate], cfg, pool=pool)
        )
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


# -- the closed loop: generate -> compile -> verify + time -> profile -> search backprop -----------------
# Every call into the search is preceded (proposals) or followed (results, closes) by a run-log event, so a
# resumed run replays the same calls in the same order and rebuilds the same tree; only the evaluations in
# flight when a run died are redone.

REPAIRABLE = frozenset({Status.COMPILE_ERROR, Status.MISMATCH, Status.LAUNCH_ERROR})
ROOT = 0


class OptimizeError(Exception):
    """A run that cannot start or go on, in one line a user can act on (the run log stays intact)."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run whose log exists: it is marked and intact, and `run_id` says what to resume."""

    def __init__(self, run_id: str, runs_dir: Path) -> None:
        super().__init__(run_id)
        self.run_id, self.runs_dir = run_id, runs_dir


@dataclass
class Live:
    """What the live view shows; updated after every step."""

    run_id: str
    task_id: str
    policy: str
    search: str
    objective: str
    max_evals: int
    evaluations: int = 0
    iteration: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    best_key: str | None = None
    best_speedup_eager: float | None = None
    best_speedup_compile: float | None = None
    tokens: int = 0
    cost_usd: float = 0.0
    step: str = ""


@dataclass(frozen=True)
class OptimizeOutcome:
    run_id: str
    folder: Path
    stop_reason: str
    best_key: str | None
    best_speedup_eager: float | None
    best_speedup_compile: float | None
    evaluations: int
    report: Path | None = None
    exported: Path | None = None
    notes: tuple[str, ...] = ()
    finished_before: bool = False  # resumed without more evaluations: returned as it was, nothing appended


@dataclass
class _NodeInfo:
    candidate: Candidate | None  # None for the root (the reference)
    parent: int | None
    edit: str = ""
    repair_of: int | None = None
    result: Any = None  # evaluators.Evaluated
    reward: float | None = None
    value: float | None = None  # objective value (ms, J, J*ms)
    profile: Any = None  # evaluators.Profiled
    repair_done: bool = False


def _make_policy(
    name: str, cfg: Config, task_path: Path, toolbox: Any = None, budget: Any = None, hunter: Any = None
) -> Any:
    if name == "expert":
        from pipeline.generate.expert.policy import ExpertPolicy, supports

        ok, why = supports(task_path)
        if not ok:
            raise OptimizeError(f"the expert policy cannot write kernels for {task_path.name}: {why}")
        return ExpertPolicy(hunter=hunter)
    if name == "llm":
        from pipeline.generate.llm import LLMConfigError, LLMPolicy

        try:
            return LLMPolicy(cfg, toolbox=toolbox, budget=budget)
        except LLMConfigError as e:
            raise OptimizeError(str(e)) from None
    raise OptimizeError(f"unknown policy {name!r}: use llm, expert or auto")


def resolve_policy(cfg: Config) -> str:
    if cfg.policy == "auto":
        return "llm" if cfg.llm_base_url or cfg.llm_api_key else "expert"
    return cfg.policy


# Fields a resumed run takes from its own start event, so it continues the same search; budgets may grow.
_RESUME_FIXED = (
    "policy", "search", "objective", "seed", "widen_c", "widen_alpha", "prune_after", "repair_rounds",
    "children_per_expand", "feedback", "llm_model",
)  # fmt: skip


class _Run:
    def __init__(self, cfg: Config, log: Any, evaluator: Any, policy: Any, policy_name: str, task: Task,
                 baselines: Any, memory: Any, hunter: Any, live: Live,
                 progress: Callable[[Live], None] | None, started: float, prior_s: float) -> None:  # fmt: skip
        from pipeline.search import make_search
        from pipeline.search.reward import Objective

        self.cfg, self.log, self.ev, self.policy, self.policy_name = cfg, log, evaluator, policy, policy_name
        self.task, self.base, self.memory, self.hunter, self.live = task, baselines, memory, hunter, live
        self.progress, self.started, self.prior_s = progress, started, prior_s
        self.objective = Objective(cfg.objective)
        self.search = make_search(cfg.search, seed=cfg.seed, cfg_like=cfg)
        self.info: dict[int, _NodeInfo] = {ROOT: _NodeInfo(None, None)}
        self.keys: dict[str, int] = {}
        self.notes: list[str] = []
        self.refusals = 0

    # -- bookkeeping ----------------------------------------------------------------------------------
    def _tell(self, step: str) -> None:
        self.live.step = step
        if self.progress:
            self.progress(self.live)

    def elapsed(self) -> float:
        import time

        return self.prior_s + time.monotonic() - self.started

    def _baseline_value(self, m: Measurement | None) -> float | None:
        from pipeline.search.reward import objective_value

        eager = m.baselines.get("eager") if m else None
        eager_ms = eager.median_ms if eager else self.base.timings["eager"].median_ms
        return objective_value(self.objective, eager_ms, self.base.energy_eager_j)

    def _score(self, r: Any) -> tuple[float, float | None]:
        from pipeline.search.reward import objective_value, reward

        m = r.measurement
        value = None
        if r.verdict.status == Status.OK and m is not None and m.timing is not None:
            value = objective_value(
                self.objective, m.timing.median_ms, m.energy.joules_per_call if m.energy else None
            )
        return reward(r.verdict.status.value, value, self._baseline_value(m), self.objective), value

    def _on_result(self, nid: int, r: Any, rew: float, value: float | None) -> None:
        info = self.info[nid]
        info.result, info.reward, info.value = r, rew, value
        self.live.evaluations += 1
        st = r.verdict.status.value
        self.live.statuses[st] = self.live.statuses.get(st, 0) + 1
        best = self.search.best()
        if best is not None and best != ROOT and self.info[best].result is not None:
            m = self.info[best].result.measurement
            self.live.best_key = self.info[best].candidate.key
            self.live.best_speedup_eager = m.speedup_eager if m else None
            comp = self.base.timings.get("compile")
            self.live.best_speedup_compile = (
                comp.median_ms / m.timing.median_ms if comp and m and m.timing else None
            )

    # -- replaying the log (resume) --------------------------------------------------------------------
    def replay(self, events: list[Any]) -> None:
        from pipeline.evaluators import evaluated_from_dict, profiled_from_dict

        for e in events:
            d = e.data
            if e.type == "proposal":
                cand = from_dict(Candidate, d["candidate"])
                nid = self.search.add_child(d["parent"], cand.key, d["edit"])
                if nid != d["node"]:
                    raise OptimizeError(
                        f"run log and search disagree at seq {e.seq} (node {nid} vs {d['node']}): "
                        "the search code changed since this run was written"
                    )
                self.info[nid] = _NodeInfo(cand, d["parent"], d["edit"], d.get("repair_of"))
                self.keys[cand.key] = nid
            elif e.type == "result":
                r = evaluated_from_dict(d)
                self.search.record(d["node"], r.verdict.status.value, d["reward"])
                self._on_result(d["node"], r, d["reward"], d.get("value"))
            elif e.type == "repair_failed":
                self.info[d["node"]].repair_done = True
            elif e.type == "closed":
                self.search.close(d["node"], d.get("reason", ""))
            elif e.type == "profile":
                self.info[d["node"]].profile = profiled_from_dict(d)
            elif e.type == "llm":
                self.live.tokens += d.get("prompt_tokens", 0) + d.get("completion_tokens", 0)
                self.live.cost_usd += d.get("cost_usd", 0.0)
            elif e.type == "iteration":
                self.live.iteration = d["iteration"]

    # -- one step ---------------------------------------------------------------------------------------
    def _evaluate(self, nids: list[int]) -> None:
        from pipeline.evaluators import evaluated_to_dict

        cands = [self.info[n].candidate for n in nids]
        self._tell(f"evaluating {len(cands)} candidate(s)")
        results = self.ev.evaluate(cands)
        for nid, r in zip(nids, results, strict=True):
            rew, value = self._score(r)
            self.log.append(
                "result",
                {**evaluated_to_dict(r), "node": nid, "reward": rew, "value": value,
                 "elapsed_s": round(self.elapsed(), 3)},
            )  # fmt: skip
            self.search.record(nid, r.verdict.status.value, rew)
            self._on_result(nid, r, rew, value)
            self._lesson(nid)
        self._tell("evaluated")

    def _add(self, parent: int, proposals: list[Any], repair_of: int | None = None) -> list[int]:
        nids = []
        for p in proposals:
            cand = p.candidate
            nid = self.search.add_child(parent, cand.key, p.edit)
            self.log.append(
                "proposal",
                {"node": nid, "parent": parent, "edit": p.edit, "repair_of": repair_of,
                 "candidate": to_dict(cand), "reason": p.reason, "notes": list(p.notes)},
            )  # fmt: skip
            self.info[nid] = _NodeInfo(cand, parent, p.edit, repair_of)
            self.keys[cand.key] = nid
            nids.append(nid)
        return nids

    def _usage(self, proposals: list[Any]) -> None:
        for p in proposals:
            u = p.usage
            if u.calls or u.tokens:
                self.log.append("llm", {**to_dict(u), "status": p.status.value})
                self.live.tokens += u.tokens
                self.live.cost_usd += u.cost_usd

    def _fresh(self, proposals: list[Any]) -> tuple[list[Any], list[str]]:
        from pipeline.generate.base import ProposalStatus

        fresh, reasons, batch = [], [], set()
        for p in proposals:
            if p.status != ProposalStatus.OK or p.candidate is None:
                reasons.append(f"{p.status.value}: {p.reason}")
                self.log.append("proposal_failed", {"status": p.status.value, "reason": p.reason})
                continue
            if p.candidate.key in self.keys or p.candidate.key in batch:
                reasons.append(f"duplicate of an earlier candidate ({p.edit})")
                continue
            batch.add(p.candidate.key)
            fresh.append(p)
        return fresh, reasons

    def _profile(self, nid: int) -> Any:
        from pipeline.evaluators import profiled_to_dict

        info = self.info[nid]
        if nid == ROOT or info.profile is not None or info.result is None:
            return info.profile
        if info.result.verdict.status != Status.OK:
            return None
        self._tell(f"profiling node {nid}")
        info.profile = self.ev.profile(info.candidate, info.result)
        self.log.append("profile", {**profiled_to_dict(info.profile), "node": nid})
        return info.profile

    def _outcome(self, nid: int) -> Any:
        from pipeline.generate.base import Outcome

        info = self.info[nid]
        r = info.result
        if r is None or info.candidate is None:
            return None
        m = r.measurement
        errors = ""
        if r.verdict.status != Status.OK:
            errors = r.build.log if r.build and r.build.status != Status.OK else "\n".join(r.verdict.reasons)
        return Outcome(
            key=info.candidate.key, status=r.verdict.status.value, edit=info.edit,
            time_ms=m.timing.median_ms if m and m.timing else None,
            speedup_eager=m.speedup_eager if m else None, reward=info.reward, errors=errors[-4000:],
        )  # fmt: skip

    def _tried(self) -> tuple[Any, ...]:
        from pipeline.generate.base import Tried

        out = []
        for parent, child, edit, status, _ in self.search.history():
            pv, cv = self.info[parent].value, self.info[child].value
            pkey = self.info[parent].candidate.key if self.info[parent].candidate else ""
            gain = pv / cv if pv and cv else None
            out.append(Tried(pkey, edit, status, gain))
        return tuple(out)

    def _context(self, nid: int) -> Any:
        from pipeline.generate.base import Context

        info = self.info[nid]
        prof = info.profile
        findings = tuple(prof.findings) if prof else ()
        bound = prof.bound if prof else ""
        best = self.search.best()
        blocks: tuple[Any, ...] = ()
        if self.hunter is not None and findings:
            query = " ".join([*findings[0].edits, findings[0].tool.replace("_", " "), "sm90 cuda kernel"])
            try:
                blocks = tuple(self.hunter.hunt(query, k=3, arch="sm90"))
            except Exception as e:  # retrieval helps; its failure must not stop the search
                self.notes.append(f"source hunt failed: {e}")
        lessons: tuple[Any, ...] = ()
        if self.memory is not None:
            try:
                lessons = tuple(self.memory.for_context(self.task, bound, list(findings), k=4))
            except Exception as e:
                self.notes.append(f"memory unavailable, going on without it: {e}")
                self.memory = None
        return Context(
            task=self.task,
            reference=self.task.source,
            parent=info.candidate,
            parent_outcome=self._outcome(nid),
            bound=bound,
            findings=findings,
            feedback=prof.feedback if prof else "",
            blocks=blocks,
            lessons=lessons,
            tried=self._tried(),
            siblings=tuple(o for c in self.search.children(nid) if (o := self._outcome(c)) is not None),
            best=self._outcome(best) if best not in (None, ROOT) else None,
            arch=resolve_arch(self.cfg),  # what the candidates are compiled for (the GPU's, with "auto")
            extra={
                "evidence": getattr(self.ev, "evidence", {}).get(info.candidate.key)
                if info.candidate
                else None
            },
        )

    def _lesson(self, nid: int) -> None:
        info = self.info[nid]
        parent = self.info[info.parent] if info.parent is not None else None
        if self.memory is None or parent is None or parent.candidate is None:
            return
        top = parent.profile.findings[0] if parent.profile and parent.profile.findings else None
        gain = parent.value / info.value if parent.value and info.value else None
        try:
            from pipeline.memory import lessons_from_result

            lesson = lessons_from_result(
                self.task, self.log.run_id, parent.candidate.key, info.edit, top,
                info.result.verdict.status.value, gain, bound=parent.profile.bound if parent.profile else "",
            )  # fmt: skip
            self.memory.add([lesson])
            self.log.append("lesson", {"node": nid, "edit": info.edit, "gain": gain})
        except Exception as e:
            self.notes.append(f"memory unavailable, going on without it: {e}")
            self.memory = None

    def _repairs(self) -> None:
        """Failed children that compiled wrong or computed wrong get a repair round with their errors."""
        from pipeline.generate.base import ProposalStatus

        while True:
            todo = [
                n for n, i in sorted(self.info.items())
                if i.result is not None and i.result.verdict.status in REPAIRABLE and not i.repair_done
                and not any(j.repair_of == n for j in self.info.values()) and self._repair_depth(n) < self.cfg.repair_rounds
            ]  # fmt: skip
            if not todo or self._budget_stop():
                return
            for n in todo:
                if self._budget_stop():
                    return
                info = self.info[n]
                self._tell(f"repairing node {n} ({info.result.verdict.status.value})")
                p = self.policy.repair(self._context(info.parent), info.candidate, self._outcome(n))
                self._usage([p])
                fresh, reasons = self._fresh([p])
                if not fresh:
                    why = reasons[0] if reasons else p.reason
                    self.log.append("repair_failed", {"node": n, "status": p.status.value, "reason": why})
                    info.repair_done = True
                    if p.status == ProposalStatus.BUDGET:
                        return
                    continue
                self._evaluate(self._add(info.parent, fresh, repair_of=n))

    def _repair_depth(self, n: int) -> int:
        depth = 0
        while self.info[n].repair_of is not None:
            n = self.info[n].repair_of
            depth += 1
        return depth

    def _budget_stop(self) -> str | None:
        cfg = self.cfg
        if self.live.evaluations >= cfg.max_evals:
            return f"evaluation budget spent ({cfg.max_evals})"
        if self.elapsed() >= cfg.max_wall_s:
            return f"wall-time budget spent ({cfg.max_wall_s:.0f} s)"
        if self.policy_name == "llm" and self.live.tokens >= cfg.max_tokens:
            return f"token budget spent ({cfg.max_tokens})"
        if self.policy_name == "llm" and self.live.cost_usd >= cfg.max_cost_usd:
            return f"cost budget spent (${cfg.max_cost_usd:.2f})"
        return None

    def run(self) -> str:
        from pipeline.generate.base import ProposalStatus

        pending = [n for n, i in sorted(self.info.items()) if i.candidate is not None and i.result is None]
        if pending:  # in flight when the run died
            self._evaluate(pending)
        self._repairs()
        while True:
            stop = self._budget_stop()
            if stop:
                return stop
            nid = self.search.select()
            if nid is None:
                return "the search has nothing left to expand"
            self.live.iteration += 1
            self.log.append("iteration", {"iteration": self.live.iteration, "node": nid})
            self._profile(nid)
            room = min(
                self.search.room(nid),
                self.cfg.children_per_expand,
                self.cfg.max_evals - self.live.evaluations,
            )
            if room <= 0:
                self.search.close(nid, "no room")
                self.log.append("closed", {"node": nid, "reason": "no room"})
                continue
            self._tell(f"{self.policy_name} policy: proposing {room} from node {nid}")
            proposals = self.policy.propose(self._context(nid), room)
            self._usage(proposals)
            fresh, reasons = self._fresh(proposals)
            if not fresh:
                statuses = {p.status for p in proposals}
                if statuses == {ProposalStatus.BUDGET}:
                    return "LLM budget spent"
                if statuses == {ProposalStatus.UNSUPPORTED}:
                    raise OptimizeError(reasons[0] if reasons else "the policy cannot write this task")
                if statuses and statuses <= {ProposalStatus.REFUSED}:
                    self.refusals += 1  # the endpoint's trouble, not the node's: try again, then give up
                    if self.refusals >= 3:
                        raise OptimizeError(
                            f"the LLM endpoint {endpoint_url(self.cfg)} keeps refusing: {reasons[0]}"
                        )
                    continue
                reason = "; ".join(dict.fromkeys(reasons)) or "no proposals"
                self.search.close(nid, reason)
                self.log.append("closed", {"node": nid, "reason": reason})
                continue
            self.refusals = 0
            self._evaluate(self._add(nid, fresh))
            self._repairs()


def optimize(
    task_path: str | Path,
    cfg: Config,
    resume: str | None = None,
    replay: Sequence[str | Path] | str | Path | None = None,
    progress: Callable[[Live], None] | None = None,
    more: int | None = None,
    budgets_given: Collection[str] = (),
) -> OptimizeOutcome:
    """Search for the fastest correct kernel for a task; every step lands in runs/<run-id>/log.jsonl.

    `replay`: answer evaluations from a run log recorded on a GPU instead of running them (tests, demos).
    `resume`: continue that run with its recorded search settings and budgets; the budget fields named in
    `budgets_given` (set on purpose by the caller) win. A finished run comes back as it is, nothing appended
    (`finished_before`), unless `more` asks for that many more evaluations.
    """
    import contextlib
    import time

    from pipeline import runlog
    from pipeline.evaluators import Baselines, GpuEvaluator, ReplayEvaluator

    task_path = Path(task_path)
    log = None
    if more is not None and not resume:
        raise OptimizeError("more evaluations are for a run that exists: give its id to resume")
    try:
        if resume:
            log = runlog.RunLog.open(cfg.runs_dir, resume, secrets=_secrets(cfg))
            reopened = _reopen(log, cfg, task_path, replay, more, budgets_given)
            if isinstance(reopened, OptimizeOutcome):
                log.close()
                return reopened
            cfg, task_path, replay = reopened
        if not task_path.is_file():
            raise TaskError(f"task file not found: {task_path}")
        policy_name = resolve_policy(cfg)
        if policy_name == "llm":
            _check_endpoint(cfg)  # an unreachable URL is one line, before any run folder exists
        energy = cfg.objective != "time"
        try:
            evaluator = (
                ReplayEvaluator(
                    [Path(replay)] if isinstance(replay, str | Path) else [Path(r) for r in replay]
                )
                if replay
                else GpuEvaluator(task_path, cfg, feedback=cfg.feedback, energy=energy)
            )
        except FileNotFoundError as e:
            raise OptimizeError(str(e)) from None
    except BaseException:
        if log is not None:
            log.close()
        raise
    try:
        task = evaluator.task()
        hunter, hunter_note = _open_hunter(cfg)
        memory = _open_memory(cfg)
        toolbox = None
        if policy_name == "llm":
            from pipeline.generate.toolbox import LocalToolBox

            toolbox = LocalToolBox(hunter=hunter)
        policy = _make_policy(policy_name, cfg, task_path, toolbox=toolbox, hunter=hunter)
        if log is None:
            log = runlog.RunLog.create(
                cfg.runs_dir,
                runlog.new_run_id(task.id),
                {
                    "task": to_dict(task),
                    "task_path": str(task_path),
                    "config": cfg.public(),
                    "policy": policy_name,
                    "search": cfg.search,
                    "evaluator": evaluator.name,
                    "replay": [str(p) for p in evaluator.paths]
                    if isinstance(evaluator, ReplayEvaluator)
                    else None,
                },
                secrets=_secrets(cfg),
            )
        events = log.events()
        prior_s = max((e.data.get("elapsed_s", 0.0) for e in events if e.type == "result"), default=0.0)
        base_ev = next((e for e in events if e.type == "baselines"), None)
        if base_ev is None:
            if progress:
                progress(Live(log.run_id, task.id, policy_name, cfg.search, cfg.objective, cfg.max_evals,
                              step="measuring eager and torch.compile baselines"))  # fmt: skip
            try:
                base = evaluator.baselines()
            except Exception as e:
                log.append("end", {"reason": f"the reference failed: {e}"})
                raise OptimizeError(f"the task's reference could not be measured: {e}") from None
            log.append("baselines", base.to_dict())
            ceil = _ceilings_for(cfg, evaluator, base)
            if ceil:
                log.append("ceilings", ceil)
        else:
            base = Baselines.from_dict(base_ev.data)
        live = Live(log.run_id, task.id, policy_name, cfg.search, cfg.objective, cfg.max_evals)
        run = _Run(cfg, log, evaluator, policy, policy_name, task, base, memory, hunter, live, progress,
                   time.monotonic(), prior_s)  # fmt: skip
        if hunter_note:
            run.notes.append(hunter_note)
        try:
            run.replay(events)
        except (KeyError, TypeError, ValueError) as e:
            raise OptimizeError(f"run {log.run_id} cannot be resumed: its log is malformed ({e!r})") from None
        if resume:
            budgets = {k: getattr(cfg, k) for k in _BUDGETS}
            log.append(
                "resume", {"events": len(events), "elapsed_s": prior_s, "more": more, "budgets": budgets}
            )
        stop = run.run()
        return _finish(run, stop, evaluator)
    except KeyboardInterrupt:
        if log is None:
            raise  # nothing written yet: nothing to resume
        with contextlib.suppress(runlog.RunLogError, OSError):  # resume reads the results, not this mark
            log.resync()  # the interrupt may have landed inside an append
            log.append("interrupted", {"evaluations": sum(e.type == "result" for e in log.events())})
        raise RunInterrupted(log.run_id, cfg.runs_dir) from None
    finally:
        evaluator.close()
        if log is not None:
            log.close()


_BUDGETS = ("max_evals", "max_wall_s", "max_tokens", "max_cost_usd")


def _reopen(
    log: Any, cfg: Config, task_path: Path, replay: Any, more: int | None, budgets_given: Collection[str]
) -> OptimizeOutcome | tuple[Config, Path, Any]:
    """A finished run's outcome, or the config, task and recordings to continue it with: the recorded search
    settings, the budgets of its start (or of its last resume, which may have raised them) unless given now,
    and `more` evaluations on top of those done."""
    from pipeline import runlog

    events = log.events()
    problem = runlog.tree_problem(events)
    if problem:
        raise OptimizeError(
            f"run {log.run_id} cannot be resumed: its log does not make one search tree: {problem}"
        )
    if runlog.is_finished(events) and more is None:
        return _finished(log, events)
    header = log.header.data
    recorded: dict[str, Any] = dict(header.get("config", {}))
    for e in events:
        if e.type == "resume":
            recorded.update(e.data.get("budgets") or {})
    keep = [k for k in (*_RESUME_FIXED, *_BUDGETS) if k in recorded and k not in budgets_given]
    cfg = cfg.replace(**{k: _typed(cfg, k, recorded[k]) for k in keep})
    if more is not None:
        cfg = cfg.replace(max_evals=sum(e.type == "result" for e in events) + more)
    if not str(task_path) or str(task_path) == ".":
        task_path = Path(header["task"]["path"])
    return cfg, task_path, replay or header.get("replay")  # a replayed run resumes against its recordings


def _finished(log: Any, events: list[Any]) -> OptimizeOutcome:
    end = next(e for e in reversed(events) if e.type == "end").data
    folder = log.folder
    report, exported = folder / "report.md", folder / "best_model_new.py"
    done = sum(e.type == "result" for e in events)
    return OptimizeOutcome(
        log.run_id, folder, end.get("reason") or "finished", end.get("best_key"),
        end.get("best_speedup_eager"), end.get("best_speedup_compile"), end.get("evaluations") or done,
        report if report.is_file() else None, exported if exported.is_file() else None,
        tuple(end.get("notes") or ()), finished_before=True,
    )  # fmt: skip


def endpoint_url(cfg: Config) -> str:
    from pipeline.generate.llm import DEFAULT_BASE_URL

    return cfg.llm_base_url or DEFAULT_BASE_URL


def _check_endpoint(cfg: Config) -> None:
    """One request to the endpoint before a run starts: any answer (even a 401 or a 404) means it is there;
    no connection means it is not, said with its URL instead of a run folder left behind per attempt."""
    import openai

    url = endpoint_url(cfg)
    client = openai.OpenAI(base_url=url, api_key=cfg.llm_api_key or "none", max_retries=0,
                           timeout=min(cfg.llm_timeout_s, 10.0))  # fmt: skip
    try:
        client.models.list()
    except openai.APIConnectionError as e:  # timeouts included
        why = str(e.__cause__ or e).strip() or type(e).__name__
        raise OptimizeError(
            f"the LLM endpoint {url} cannot be reached ({why}); check KERNELPRO_LLM_BASE_URL"
        ) from None
    except openai.APIError:
        pass  # it answered
    finally:
        client.close()


def _ceilings_for(cfg: Config, evaluator: Any, base: Any) -> dict[str, Any] | None:
    """The GPU's measured ceilings for the report's roofline: the calibration the baselines just used (GPU
    runs), or the recording's (replayed runs)."""
    from dataclasses import asdict

    from pipeline import runlog

    if getattr(evaluator, "name", "") == "gpu":
        gpu = base.environment.get("gpu")
        c = calibrate.load_cached(cfg.home, gpu) if gpu else None
        return asdict(c) if c else None
    for path in getattr(evaluator, "paths", ())[:1]:
        try:
            return next((e.data for e in runlog.read_events(path) if e.type == "ceilings"), None)
        except (runlog.RunLogError, OSError):
            return None
    return None


def _finish(run: _Run, stop: str, evaluator: Any) -> OptimizeOutcome:
    from pipeline import report
    from pipeline.candidates import CandidateError, export_standalone, save_candidate
    from pipeline.evaluators import evaluated_to_dict

    folder = run.log.folder
    best = run.search.best()
    exported = None
    notes = list(dict.fromkeys(run.notes))
    if best is not None and best != ROOT:
        info = run.info[best]
        save_candidate(info.candidate, folder / "best")
        if hasattr(evaluator, "remeasure"):
            run._tell("re-measuring the best candidate with energy")
            again = evaluator.remeasure(info.candidate)
            run.log.append("final", {**evaluated_to_dict(again), "node": best})
        build = info.result.build
        try:
            if build is not None and build.cubin_path and Path(build.cubin_path).is_file():
                exported = export_standalone(info.candidate, build, folder / "best_model_new.py")
            else:
                notes.append("no standalone export: the best candidate's cubin is not on this machine")
        except CandidateError as e:
            notes.append(f"no standalone export: {e}")
    run.log.append(
        "end",
        {"reason": stop, "best_node": best, "best_key": run.live.best_key,
         "best_speedup_eager": run.live.best_speedup_eager, "best_speedup_compile": run.live.best_speedup_compile,
         "evaluations": run.live.evaluations, "notes": notes},
    )  # fmt: skip
    rep = report.write_report(folder)
    return OptimizeOutcome(
        run.log.run_id, folder, stop, run.live.best_key, run.live.best_speedup_eager,
        run.live.best_speedup_compile, run.live.evaluations, rep, exported, tuple(notes),
    )  # fmt: skip


def _secrets(cfg: Config) -> tuple[str, ...]:
    return tuple(s for s in (cfg.llm_api_key,) if s)


def _typed(cfg: Config, name: str, text: str) -> Any:
    current = getattr(cfg, name)
    if isinstance(current, bool):
        return text == "True"
    if isinstance(current, int):
        return int(text)
    if isinstance(current, float):
        return float(text)
    return text


def _open_hunter(cfg: Config) -> tuple[Any, str | None]:
    """The source hunter when an index was built (`make index`); the search runs without one otherwise."""
    try:
        from index.hunt import get_hunter

        return get_hunter(cfg), None
    except Exception as e:
        return None, f"no building blocks from the source index ({str(e).splitlines()[0]}); run `make index`"


def _open_memory(cfg: Config) -> Any:
    if not cfg.memory:
        return None
    from pipeline.memory import Memory

    return Memory(cfg)
