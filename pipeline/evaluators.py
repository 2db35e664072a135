"""Where the search loop's candidates are evaluated: on this machine's GPUs, or replayed from a run log
recorded on a GPU (how the loop, resume and the search are tested without one).

Both answer the same questions: the task, its baselines and the GPU's ceilings, a batch of candidates'
evaluations, and the profile of one verified candidate (stage-1 class, stage-2 findings, the text a policy
is shown).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from pipeline import calibrate, reasons, stages
from pipeline.calibrate import Ceilings
from pipeline.compile import cancel_prefetch
from pipeline.compile import prefetch as compile_candidates_ahead
from pipeline.config import Config
from pipeline.profile import collect
from pipeline.runlog import read_events
from pipeline.runstate import fold
from pipeline.types import Baselines, Candidate, Evaluation, Finding, Profile, Status, Task, Verdict


class Evaluator(Protocol):
    name: str

    def task(self) -> Task: ...
    def baselines(self) -> Baselines: ...
    def ceilings(self) -> Ceilings | None: ...
    def evaluate(self, candidates: Sequence[Candidate]) -> list[Evaluation]: ...
    def prefetch(self, candidates: Sequence[Candidate]) -> None: ...
    def profile(self, candidate: Candidate, evaluation: Evaluation) -> Profile: ...
    def close(self) -> None: ...


class GpuEvaluator:
    """The real thing: compile on the CPU pool, verify and time in the isolated GPU workers, ncu for profiles."""

    name = "gpu"

    def __init__(
        self,
        task_path: Path,
        cfg: Config,
        feedback: str = "advice",
        energy: bool = False,
        pool: stages.WorkerPool | None = None,
    ) -> None:
        self.task_path = Path(task_path)
        self.cfg = cfg
        self.feedback = feedback
        # A pool handed in (a bench's, shared by its tasks) is its owner's to close; opening one raises
        # NoGPUError before anything is written.
        self._owns_pool = pool is None
        self.pool = pool if pool is not None else stages.open_pool(cfg)
        # Baselines other than eager are measured once per run (run_baselines); each candidate is timed
        # next to a fresh eager call, so its reward compares like with like.
        self.eval_cfg = cfg.replace(baselines=("eager",), energy=energy)
        self._task: Task | None = None
        self._baselines: Baselines | None = None
        self.evidence: dict[str, Any] = {}  # candidate key -> Evidence, for the LLM's profiling tool calls
        # ncu's target for the first profile starts now, while the first batch is built and evaluated.
        collect.prewarm(self.eval_cfg)

    def task(self) -> Task:
        if self._task is None:
            self._task = stages.probe_task(self.pool, self.task_path)
        return self._task

    def baselines(self) -> Baselines:
        cfg = self.cfg.replace(baselines=("eager", "compile"))
        _, self._baselines = stages.run_baselines(
            self.task_path, cfg, pool=self.pool, cached=self.cfg.baseline_cache
        )
        return self._baselines

    def ceilings(self) -> Ceilings | None:
        """The calibration the baselines just used, for the report's roofline."""
        gpu = self._baselines.environment.get("gpu") if self._baselines else None
        return calibrate.load_cached(self.cfg.home, gpu) if gpu else None

    def evaluate(self, candidates: Sequence[Candidate]) -> list[Evaluation]:
        return stages.evaluate_candidates(self.task_path, list(candidates), self.eval_cfg, pool=self.pool)

    @property
    def builds_ahead(self) -> bool:
        """prefetch builds (a GPU machine with prefetch on): worth rendering moves that may come up."""
        return self.cfg.prefetch and self.cfg.device == "cuda"

    def prefetch(self, candidates: Sequence[Candidate]) -> None:
        """Build, in the background, candidates the search will likely evaluate next (while the GPU profiles
        or times others). Only on a GPU machine: elsewhere its cores are the foreground builds'."""
        if self.builds_ahead:
            compile_candidates_ahead(candidates, self.cfg)

    def remeasure(self, candidate: Candidate, energy: bool = True) -> Evaluation:
        """The best candidate timed again with energy on: a difference is believed once seen twice."""
        cfg = self.eval_cfg.replace(energy=energy, baselines=("eager", "compile"))
        (r,) = stages.evaluate_candidates(self.task_path, [candidate], cfg, pool=self.pool)
        return r

    def profile(self, candidate: Candidate, evaluation: Evaluation) -> Profile:
        from pipeline.profile import advice

        try:
            pr = stages.profile_candidate(
                self.task_path,
                candidate,
                self.eval_cfg,
                pool=self.pool,
                evaluation=evaluation,
                warm_next=True,
            )
        except Exception as e:  # a profile is advice, not a verdict: the search goes on without it
            return Profile(candidate.key, False, notes=(f"profiling failed: {type(e).__name__}: {e}",))
        if pr.evidence is None:
            return Profile(candidate.key, False, notes=pr.notes, seconds=pr.seconds)
        cls, findings = advice.analyze(pr.evidence)
        self.evidence[candidate.key] = pr.evidence
        return Profile(
            candidate.key,
            True,
            bound=cls.summary,
            bound_class=cls.bound.value,
            findings=tuple(findings),
            feedback=feedback_text(self.feedback, cls, findings, pr.evidence),
            notes=pr.notes,
            seconds=pr.seconds,
        )

    def close(self) -> None:
        cancel_prefetch()
        if self._owns_pool:
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
    """Answers from run logs recorded on a GPU: the same candidate (same key) gets the recorded evaluation
    and profile. A candidate the recordings never saw is rejected with a reason that says so,
    deterministically. The policy sees the feedback text recorded with each profile, whatever --feedback
    says now."""

    name = "replay"

    def __init__(self, log_paths: Sequence[Path] | Path) -> None:
        paths = [Path(log_paths)] if isinstance(log_paths, str | Path) else [Path(p) for p in log_paths]
        if not paths:
            raise ValueError("replay needs at least one recorded run log")
        self.results: dict[str, Evaluation] = {}
        self.profiles: dict[str, Profile] = {}
        self._task: Task | None = None
        self._baselines: Baselines | None = None
        self._ceilings: Ceilings | None = None
        # The recordings' own profile_headroom (0 before that setting: every expanded node was profiled), so
        # that a replay profiles the nodes the recording did and stays on its landscape
        self.profile_headroom = float("inf")
        for i, path in enumerate(paths):  # several recordings of one task make one landscape
            if path.is_dir():
                path = path / "log.jsonl"
            if not path.is_file():
                raise FileNotFoundError(f"no recorded run log at {path}")
            state = fold(read_events(path))
            if not state.header.task:
                raise ValueError(f"{path}: not a run log (no start event with the task)")
            task = state.header.task_record()
            if self._task is not None and task.source_hash != self._task.source_hash:
                raise ValueError(f"{path}: recorded for another task than {paths[0]}")
            if state.baselines is None:
                raise ValueError(f"{path}: the recording has no baselines")
            if i == 0:  # the first recording's task, baselines and ceilings
                self._task, self._baselines = task, state.baselines
                self._ceilings = state.ceilings
            recorded = (state.header.config or {}).get("profile_headroom")
            self.profile_headroom = min(self.profile_headroom, float(recorded) if recorded else 0.0)
            for p in state.points:
                n = state.nodes[p.node]
                if n.evaluation is not None:
                    self.results.setdefault(n.evaluation.key, n.evaluation)
            for n in state.nodes.values():
                if n.profile is not None:
                    self.profiles.setdefault(n.profile.key, n.profile)
        self.paths = paths

    def task(self) -> Task:
        assert self._task is not None
        return self._task

    def baselines(self) -> Baselines:
        assert self._baselines is not None
        return self._baselines

    def ceilings(self) -> Ceilings | None:
        return self._ceilings

    def evaluate(self, candidates: Sequence[Candidate]) -> list[Evaluation]:
        out = []
        for c in candidates:
            found = self.results.get(c.key)
            if found is None:
                why = f"{reasons.REPLAY}: this candidate is not in the recording"
                found = Evaluation(c.key, None, Verdict(c.key, Status.REJECTED, reasons=(why,)), None)
            out.append(found)
        return out

    def prefetch(self, candidates: Sequence[Candidate]) -> None:
        pass  # nothing is built: the recordings answer

    def profile(self, candidate: Candidate, evaluation: Evaluation) -> Profile:
        found = self.profiles.get(candidate.key)
        if found is None:
            return Profile(
                candidate.key, False, notes=(f"{reasons.REPLAY}: no profile recorded for this candidate",)
            )
        return found

    def close(self) -> None:
        pass
