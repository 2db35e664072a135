"""Where the search loop's candidates are evaluated: on this machine's GPUs, or replayed from a run log
recorded on a GPU (how the loop, resume and the search are tested without one).

Both answer the same three questions: the task and its baselines, a batch of candidates' results, and the
profile of one verified candidate (stage-1 class, stage-2 findings, the text a policy is shown).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pipeline.config import Config
from pipeline.types import (
    Build,
    Candidate,
    Finding,
    Measurement,
    Status,
    Task,
    Timing,
    Verdict,
    from_dict,
    to_dict,
)


@dataclass(frozen=True)
class Baselines:
    timings: dict[str, Timing]  # eager, compile
    energy_eager_j: float | None = None
    floor_ms: float | None = None
    compile_s: dict[str, float] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "timings": {k: to_dict(v) for k, v in self.timings.items()},
            "energy_eager_j": self.energy_eager_j,
            "floor_ms": self.floor_ms,
            "compile_s": self.compile_s,
            "environment": self.environment,
            "notes": list(self.notes),
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Baselines:
        return Baselines(
            timings={k: from_dict(Timing, v) for k, v in d["timings"].items()},
            energy_eager_j=d.get("energy_eager_j"),
            floor_ms=d.get("floor_ms"),
            compile_s=d.get("compile_s", {}),
            environment=d.get("environment", {}),
            notes=tuple(d.get("notes", ())),
        )


@dataclass(frozen=True)
class Evaluated:
    """One candidate's evaluation, as the loop logs it."""

    key: str
    build: Build | None
    verdict: Verdict
    measurement: Measurement | None


@dataclass(frozen=True)
class Profiled:
    key: str
    ok: bool
    bound: str = ""  # stage-1 summary
    bound_class: str = ""  # memory / compute / latency / launch
    findings: tuple[Finding, ...] = ()
    feedback: str = ""  # what a policy is shown (advice block, JSON, raw metrics or nothing)
    notes: tuple[str, ...] = ()


class Evaluator(Protocol):
    name: str

    def task(self) -> Task: ...
    def baselines(self) -> Baselines: ...
    def evaluate(self, candidates: Sequence[Candidate]) -> list[Evaluated]: ...
    def profile(self, candidate: Candidate, result: Evaluated) -> Profiled: ...
    def close(self) -> None: ...


class GpuEvaluator:
    """The real thing: compile on the CPU pool, verify and time in the isolated GPU workers, ncu for profiles."""

    name = "gpu"

    def __init__(self, task_path: Path, cfg: Config, feedback: str = "advice", energy: bool = False) -> None:
        from pipeline import loop

        self.task_path = Path(task_path)
        self.cfg = cfg
        self.feedback = feedback
        self.pool = loop.open_pool(cfg)  # NoGPUError before anything is written
        # Baselines other than eager are measured once per run (run_baselines); each candidate is timed
        # next to a fresh eager call, so its reward compares like with like.
        self.eval_cfg = cfg.replace(baselines=("eager",), energy=energy)
        self._task: Task | None = None
        self.evidence: dict[str, Any] = {}  # candidate key -> Evidence, for the LLM's profiling tool calls

    def task(self) -> Task:
        from pipeline import loop

        if self._task is None:
            self._task = loop.probe_task(self.pool, self.task_path)
        return self._task

    def baselines(self) -> Baselines:
        from pipeline import loop

        cfg = self.cfg.replace(baselines=("eager", "compile"))
        _, data = loop.run_baselines(self.task_path, cfg, pool=self.pool)
        energy = data.get("energy_eager", {}).get("joules_per_call") if data.get("energy_eager") else None
        return Baselines(
            timings=data["timings"],
            energy_eager_j=energy,
            floor_ms=data.get("floor_ms"),
            compile_s=data.get("compile_s", {}),
            environment=data.get("environment", {}),
            notes=tuple(data.get("notes", ())),
        )

    def evaluate(self, candidates: Sequence[Candidate]) -> list[Evaluated]:
        from pipeline import loop

        results = loop.evaluate_candidates(self.task_path, list(candidates), self.eval_cfg, pool=self.pool)
        return [Evaluated(r.candidate.key, r.build, r.verdict, r.measurement) for r in results]

    def remeasure(self, candidate: Candidate, energy: bool = True) -> Evaluated:
        """The best candidate timed again with energy on: a difference is believed once seen twice."""
        from pipeline import loop

        cfg = self.eval_cfg.replace(energy=energy, baselines=("eager", "compile"))
        (r,) = loop.evaluate_candidates(self.task_path, [candidate], cfg, pool=self.pool)
        return Evaluated(r.candidate.key, r.build, r.verdict, r.measurement)

    def profile(self, candidate: Candidate, result: Evaluated) -> Profiled:
        from pipeline import loop
        from pipeline.profile import advice

        res = loop.EvalResult(candidate, result.build, result.verdict, result.measurement)
        try:
            pr = loop.profile_candidate(self.task_path, candidate, self.eval_cfg, pool=self.pool, result=res)
        except Exception as e:  # a profile is advice, not a verdict: the search goes on without it
            return Profiled(candidate.key, False, notes=(f"profiling failed: {type(e).__name__}: {e}",))
        if pr.evidence is None:
            return Profiled(candidate.key, False, notes=pr.notes)
        cls, findings = advice.analyze(pr.evidence)
        self.evidence[candidate.key] = pr.evidence
        return Profiled(
            candidate.key,
            True,
            bound=cls.summary,
            bound_class=cls.bound.value,
            findings=tuple(findings),
            feedback=feedback_text(self.feedback, cls, findings, pr.evidence),
            notes=pr.notes,
        )

    def close(self) -> None:
        self.pool.close()


def feedback_text(mode: str, cls: Any, findings: list[Finding], evidence: Any) -> str:
    from pipeline.profile import advice

    if mode == "advice":
        return advice.advice_block(cls, findings)
    if mode == "json":
        return json.dumps(advice.as_json(cls, findings), indent=1)
    if mode == "raw":
        return advice.raw_block(evidence)
    return ""


class ReplayEvaluator:
    """Answers from a run log recorded on a GPU: the same candidate (same key) gets the recorded result and
    profile. A candidate the recording never saw is rejected with a reason that says so, deterministically."""

    name = "replay"

    def __init__(self, log_paths: Sequence[Path] | Path) -> None:
        # The policy sees the feedback text recorded with each profile, whatever --feedback says now.
        from pipeline.runlog import read_events

        paths = [Path(log_paths)] if isinstance(log_paths, str | Path) else [Path(p) for p in log_paths]
        if not paths:
            raise ValueError("replay needs at least one recorded run log")
        self.results: dict[str, dict[str, Any]] = {}
        self.profiles: dict[str, dict[str, Any]] = {}
        self._task: Task | None = None
        self._baselines: Baselines | None = None
        for path in paths:  # several recordings of one task make one landscape; the first one's baselines
            if path.is_dir():
                path = path / "log.jsonl"
            if not path.is_file():
                raise FileNotFoundError(f"no recorded run log at {path}")
            events = read_events(path)
            start = next((e for e in events if e.type == "start"), None)
            if start is None or "task" not in start.data:
                raise ValueError(f"{path}: not a run log (no start event with the task)")
            task = from_dict(Task, start.data["task"])
            if self._task is not None and task.source_hash != self._task.source_hash:
                raise ValueError(f"{path}: recorded for another task than {paths[0]}")
            base = next((e for e in events if e.type == "baselines"), None)
            if base is None:
                raise ValueError(f"{path}: the recording has no baselines")
            self._task = self._task or task
            self._baselines = self._baselines or Baselines.from_dict(base.data)
            for e in events:
                if e.type == "result":
                    self.results.setdefault(e.data["key"], e.data)
                elif e.type == "profile":
                    self.profiles.setdefault(e.data["key"], e.data)
        self.paths = paths

    def task(self) -> Task:
        assert self._task is not None
        return self._task

    def baselines(self) -> Baselines:
        assert self._baselines is not None
        return self._baselines

    def evaluate(self, candidates: Sequence[Candidate]) -> list[Evaluated]:
        out = []
        for c in candidates:
            d = self.results.get(c.key)
            if d is None:
                v = Verdict(
                    c.key, Status.REJECTED, reasons=("replay: this candidate is not in the recording",)
                )
                out.append(Evaluated(c.key, None, v, None))
                continue
            out.append(evaluated_from_dict(d))
        return out

    def profile(self, candidate: Candidate, result: Evaluated) -> Profiled:
        d = self.profiles.get(candidate.key)
        if d is None:
            return Profiled(candidate.key, False, notes=("replay: no profile recorded for this candidate",))
        return profiled_from_dict(d)

    def close(self) -> None:
        pass


def profiled_to_dict(p: Profiled) -> dict[str, Any]:
    return {
        "key": p.key,
        "ok": p.ok,
        "bound": p.bound,
        "bound_class": p.bound_class,
        "findings": [to_dict(f) for f in p.findings],
        "feedback": p.feedback,
        "notes": list(p.notes),
    }


def profiled_from_dict(d: dict[str, Any]) -> Profiled:
    return Profiled(
        d["key"],
        bool(d.get("ok")),
        bound=d.get("bound", ""),
        bound_class=d.get("bound_class", ""),
        findings=tuple(from_dict(Finding, f) for f in d.get("findings", ())),
        feedback=d.get("feedback", ""),
        notes=tuple(d.get("notes", ())),
    )


def evaluated_to_dict(e: Evaluated) -> dict[str, Any]:
    return {
        "key": e.key,
        "build": to_dict(e.build) if e.build else None,
        "verdict": to_dict(e.verdict),
        "measurement": to_dict(e.measurement) if e.measurement else None,
    }


def evaluated_from_dict(d: dict[str, Any]) -> Evaluated:
    return Evaluated(
        d["key"],
        from_dict(Build, d["build"]) if d.get("build") else None,
        from_dict(Verdict, d["verdict"]),
        from_dict(Measurement, d["measurement"]) if d.get("measurement") else None,
    )
