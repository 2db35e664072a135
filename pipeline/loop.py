"""The only module that knows the order of stages, and the search run:
generate -> compile -> verify + time -> profile -> search backprop, every step appended to the run's log.

The stages themselves are pipeline/stages.py's (reached through an evaluator, pipeline/evaluators.py). Every
call into the search is preceded (proposals) or followed (results, closes) by a run-log event, so a resumed
run replays the same calls in the same order (pipeline/runstate.py folds them out of the log) and rebuilds
the same tree; only the evaluations in flight when a run died are redone.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import events as ev
from pipeline import report, runlog
from pipeline.candidates import CandidateError, export_standalone, save_candidate
from pipeline.compile import resolve_arch
from pipeline.config import Config
from pipeline.evaluators import Evaluator, GpuEvaluator, ReplayEvaluator
from pipeline.generate.base import Context, Outcome, Proposal, ProposalStatus, Tried
from pipeline.runstate import ROOT, NodeState, NotOneTree, RunState, fold
from pipeline.search import make_search, matched
from pipeline.search.reward import Objective, objective_value, reward_at_speed
from pipeline.tasks import TaskError
from pipeline.types import Baselines, Candidate, Evaluation, Measurement, Status, Task, speedup, to_dict
from pipeline.worker import WorkerPool

REPAIRABLE = frozenset({Status.COMPILE_ERROR, Status.MISMATCH, Status.LAUNCH_ERROR})


class OptimizeError(Exception):
    """A run that cannot start or go on, in one line a user can act on (the run log stays intact)."""


class UnsupportedTask(OptimizeError):
    """The policy cannot write kernels for this task: a property of the task, not of the run (a suite
    counts these apart from failures)."""


class ReferenceFailed(OptimizeError):
    """The task's reference could not be measured (its eager baseline failed)."""


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
    statuses: dict[Status, int] = field(default_factory=dict)
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


def _make_policy(name: str, cfg: Config, task_path: Path, toolbox: Any = None, hunter: Any = None) -> Any:
    if name == "expert":
        from pipeline.generate.expert.policy import ExpertPolicy, supports

        ok, why = supports(task_path)
        if not ok:
            raise UnsupportedTask(f"the expert policy cannot write kernels for {task_path.name}: {why}")
        return ExpertPolicy(hunter=hunter)
    if name == "llm":
        from pipeline.generate.llm import LLMConfigError, LLMPolicy

        try:
            return LLMPolicy(cfg, toolbox=toolbox)
        except LLMConfigError as e:
            raise OptimizeError(str(e)) from None
    raise OptimizeError(f"unknown policy {name!r}: use llm, expert or auto")


def resolve_policy(cfg: Config) -> str:
    if cfg.policy == "auto":
        return "llm" if cfg.llm_base_url or cfg.llm_api_key else "expert"
    return cfg.policy


# Fields a resumed run takes from its own start event, so it continues the same search; budgets may grow.
_RESUME_FIXED = (
    "policy", "search", "objective", "speed_tolerance", "seed", "widen_c", "widen_alpha", "prune_after",
    "repair_rounds", "children_per_expand", "feedback", "llm_model",
)  # fmt: skip
_BUDGETS = ("max_evals", "max_wall_s", "max_tokens", "max_cost_usd")
# The expert renders a fresh node's moves while its batch is timed only when its moves take at most this
# long each (a small task's take milliseconds, a level-3 plan's seconds: the loop waits for the move in hand)
SPECULATE_RENDER_S = 0.1


class _Run:
    def __init__(self, cfg: Config, log: runlog.RunLog, evaluator: Evaluator, policy: Any, policy_name: str,
                 task: Task, baselines: Baselines, state: RunState, memory: Any, hunter: Any, live: Live,
                 progress: Callable[[Live], None] | None, started: float) -> None:  # fmt: skip
        self.cfg, self.log, self.ev, self.policy, self.policy_name = cfg, log, evaluator, policy, policy_name
        self.task, self.base, self.state, self.memory, self.hunter = task, baselines, state, memory, hunter
        self.live, self.progress, self.started = live, progress, started
        self.prior_s = state.elapsed_s
        self.objective = Objective(cfg.objective)
        self.search = make_search(cfg.search, seed=cfg.seed, cfg_like=cfg)
        self.keys: dict[str, int] = {}
        self.notes: list[str] = []
        self.unprofiled: list[tuple[int, float]] = []  # (node, share of the floor): expanded, not profiled
        # a replay's is its recording's
        self.headroom = getattr(evaluator, "profile_headroom", cfg.profile_headroom)
        self.refusals = 0
        self._spec: tuple[threading.Thread, threading.Event] | None = None  # children's moves being rendered
        self._render_s = float(
            "inf"
        )  # the most seconds a move of the policy's took to render (inf: none yet)

    @property
    def nodes(self) -> dict[int, NodeState]:
        return self.state.nodes

    # -- bookkeeping ----------------------------------------------------------------------------------
    def _append(self, event: ev.TypedEvent) -> None:
        _record(self.log, self.state, event)

    def _tell(self, step: str) -> None:
        s, live = self.state, self.live
        live.step, live.evaluations, live.iteration = step, s.evaluations, s.iteration
        live.statuses, live.tokens, live.cost_usd = dict(s.statuses), s.usage.tokens, s.usage.cost_usd
        if self.progress:
            self.progress(live)

    def elapsed(self) -> float:
        return self.prior_s + time.monotonic() - self.started

    def _eager_ms(self, m: Measurement | None = None) -> float:
        eager = m.baselines.get("eager") if m else None
        return eager.median_ms if eager else self.base.timings["eager"].median_ms

    def _score(self, r: Evaluation) -> tuple[float, float | None]:
        m = r.measurement
        time_ms = joules = None
        if r.status == Status.OK and m is not None and m.timing is not None:
            time_ms, joules = m.timing.median_ms, m.energy.joules_per_call if m.energy else None
        # The fastest so far: the reference, every verified candidate before this one, and this one.
        eager = self.base.timings.get("eager")
        fastest = matched.fastest(self.state.at_speed(), eager.median_ms if eager else None)
        if time_ms is not None and time_ms > 0:
            fastest = min(fastest, time_ms) if fastest is not None else time_ms
        rew = reward_at_speed(r.status, time_ms, joules, self._eager_ms(m), self.base.energy_eager_j,
                              self.objective, fastest, self.cfg.speed_tolerance)  # fmt: skip
        value = objective_value(self.objective, time_ms, joules) if time_ms is not None else None
        return rew, value

    def chosen(self) -> int | None:
        """The run's best node: under `time` the search's highest reward; under `energy` and `edp` the
        lowest figure at matched speed beyond noise (pipeline/search/matched.py), or the search's highest
        reward when no candidate is at speed with an energy reading."""
        best = self.search.best()
        if self.objective is Objective.TIME:
            return best
        eager = self.base.timings.get("eager")
        pick = matched.choose(self.state.at_speed(), self.objective, eager.median_ms if eager else None,
                              self.cfg.speed_tolerance)  # fmt: skip
        return pick.node if pick is not None else best

    def _best(self) -> None:
        """The live view's best: the run's chosen node, and its speedups measured alongside."""
        best = self.chosen()
        if best is None or best == ROOT or self.nodes[best].evaluation is None:
            return
        node = self.nodes[best]
        m = node.evaluation.measurement if node.evaluation else None
        comp = self.base.timings.get("compile")
        self.live.best_key = node.key
        self.live.best_speedup_eager = m.speedup_eager if m else None
        self.live.best_speedup_compile = speedup(
            comp.median_ms if comp else None, m.timing.median_ms if m and m.timing else None
        )

    # -- resume: the search's calls, as the log's fold gives them ------------------------------------
    def restore(self) -> None:
        for call in self.state.calls:
            nid = self.search.apply(call)
            if call["op"] == "add" and nid != call["node"]:
                raise OptimizeError(
                    f"run log and search disagree at seq {call['seq']} (node {nid} vs {call['node']}): "
                    "the search code changed since this run was written"
                )
        self.keys = {n.candidate.key: n.id for n in self.nodes.values() if n.candidate is not None}
        self._best()

    # -- one step ---------------------------------------------------------------------------------------
    def _evaluate(self, nids: list[int]) -> None:
        cands = [self.nodes[n].candidate for n in nids]
        self._tell(f"evaluating {len(cands)} candidate(s)")
        self._speculate(nids)
        results = self.ev.evaluate(cands)
        for nid, r in zip(nids, results, strict=True):
            rew, value = self._score(r)
            self._append(ev.Result(r, nid, rew, value, round(self.elapsed(), 3)))
            self.search.record(nid, r.status, rew)
            self._best()
            self._lesson(nid)
        self._tell("evaluated")

    def _add(self, parent: int, proposals: list[Proposal], repair_of: int | None = None) -> list[int]:
        nids = []
        for p in proposals:
            cand = p.candidate
            assert cand is not None
            nid = self.search.add_child(parent, cand.key, p.edit)
            self._append(ev.Proposal(nid, parent, p.edit, repair_of, cand, p.reason, tuple(p.notes)))
            self.keys[cand.key] = nid
            nids.append(nid)
        return nids

    def _usage(self, proposals: list[Proposal]) -> None:
        for p in proposals:
            if p.usage.calls or p.usage.tokens:
                self._append(ev.Llm(p.usage, p.status.value))

    def _fresh(self, proposals: list[Proposal], limit: int | None = None) -> tuple[list[Proposal], list[str]]:
        """The proposals that are new candidates, the first `limit` of them; why the others were not."""
        fresh, reasons, batch = [], [], set()
        for p in proposals:
            if limit is not None and len(fresh) >= limit:
                break
            if p.status != ProposalStatus.OK or p.candidate is None:
                reasons.append(f"{p.status.value}: {p.reason}")
                self._append(ev.ProposalFailed(p.status, p.reason))
                continue
            if p.candidate.key in self.keys or p.candidate.key in batch:
                reasons.append(f"duplicate of an earlier candidate ({p.edit})")
                continue
            batch.add(p.candidate.key)
            fresh.append(p)
        return fresh, reasons

    def _close(self, nid: int, reason: str) -> None:
        self.search.close(nid, reason)
        self._append(ev.Closed(nid, reason))

    def _new_moves(self, nid: int, limit: int) -> int | None:
        """How many candidates not yet in the tree the expert can make of this node, up to `limit`, whatever
        its profile would say; None where that is not known before the profile (another policy, a profiled
        node). The advice only orders the expert's vocabulary (edits.legal_edits makes the same edits either
        way), so this is known before the Nsight Compute run (~3-10 s on the H200). Only the first `limit`
        new moves are rendered: a level-3 plan has hundreds (rendering all of SwinV2's root took minutes)."""
        node = self.nodes[nid]
        if self.policy_name != "expert" or nid == ROOT or node.profile is not None or node.candidate is None:
            return None
        proposals = self._propose(nid, limit)
        new = self._ahead(proposals)  # built while the profile runs: the advice only orders them
        return len({c.key for c in new})

    def _ahead(self, proposals: list[Proposal], skip: int = 0) -> list[Candidate]:
        """The proposals' candidates not yet in the tree, past the first `skip` of them, handed to the
        evaluator to build in the background; returns them all (skipped ones included)."""
        new = [
            p.candidate
            for p in proposals
            if p.candidate is not None and p.status == ProposalStatus.OK and p.candidate.key not in self.keys
        ]
        if new[skip:]:
            self.ev.prefetch(new[skip:])
        return new

    def _propose(self, nid: int, n: int) -> list[Proposal]:
        self._settle()
        t0 = time.perf_counter()
        proposals = self.policy.propose(self._context(nid), n)
        each = (time.perf_counter() - t0) / max(1, len(proposals))
        # the slowest seen: a proposal whose moves were rendered before (cached) says nothing of the plan's
        self._render_s = each if math.isinf(self._render_s) else max(self._render_s, each)
        return proposals

    def _speculate(self, nids: list[int]) -> None:
        """While the GPU verifies and times these candidates, render each one's first moves and hand them
        over to be built: the one the search expands next then finds them built, where a node expanded
        without a profile (nothing to overlap its nvcc with) waited 1-2 s for them on the H100. The expert's
        moves of a fresh node depend on its plan alone while it has no findings, so they are the ones its
        expansion proposes unless its profile reorders them. Only where moves render fast (a level-3 plan
        takes seconds) and the evaluator builds ahead; a thread of its own, settled before the policy is
        asked anything else, so the policy never runs twice at once."""
        cands = [self.nodes[n].candidate for n in nids]
        if (
            self.policy_name != "expert"
            or not getattr(self.ev, "builds_ahead", False)
            or self._render_s > SPECULATE_RENDER_S
        ):
            return
        self._settle()
        stop = threading.Event()
        moves = max(1, math.ceil(self.cfg.widen_c))  # a fresh node's first widening step
        contexts = [self._fresh_context(c) for c in cands if c is not None]

        def render() -> None:
            for ctx in contexts:
                if stop.is_set():
                    return
                try:
                    props = self.policy.propose(ctx, moves)
                except Exception:  # a move that cannot be rendered now fails again, with its reason, later
                    continue
                self._ahead(props)

        t = threading.Thread(target=render, name="expert-ahead", daemon=True)
        self._spec = (t, stop)
        t.start()

    def _settle(self) -> None:
        """Stop rendering children's moves ahead: the policy is the loop's again (the move in hand finishes)."""
        if self._spec is not None:
            t, stop = self._spec
            stop.set()
            t.join()
            self._spec = None

    def _fresh_context(self, cand: Candidate) -> Context:
        """A node's context before its evaluation: no profile, nothing tried of it yet."""
        return Context(
            task=self.task, reference=self.task.source, parent=cand, arch=resolve_arch(self.cfg),
            extra=self._extra(), known=frozenset(self.keys),
        )  # fmt: skip

    def _sees_findings(self) -> bool:
        # The findings are the tools' reading of the counters: under "raw" and "none" no policy gets them
        # (the expert then picks its edits blind, in an order drawn from the run's seed).
        return self.cfg.feedback in ("advice", "json")

    def _extra(self, evidence: Any = None) -> dict[str, Any]:
        """Context.extra: the objective, the node's build evidence, and the blind seed where no findings are shown."""
        seed = {} if self._sees_findings() else {"blind_seed": self.cfg.seed}
        return {"evidence": evidence, "objective": self.cfg.objective} | seed

    def _near_floor(self, nid: int) -> float | None:
        """The node's share of the task's roofline floor by its own timing, when that leaves a profile under
        the time objective less than `profile_headroom` to find; else None (profile it)."""
        headroom, floor = self.headroom, self.base.floor_ms
        r = self.nodes[nid].evaluation
        if self.objective is not Objective.TIME or headroom <= 0 or not floor or r is None:
            return None
        m = r.measurement if r.status == Status.OK else None
        if m is None or m.timing is None or m.timing.median_ms <= 0:
            return None
        share = floor / m.timing.median_ms
        return share if share >= 1.0 - headroom else None

    def _profile(self, nid: int) -> None:
        node = self.nodes[nid]
        if nid == ROOT or node.profile is not None or node.evaluation is None:
            return
        if node.evaluation.status != Status.OK:
            return
        self._tell(f"profiling node {nid}")
        assert node.candidate is not None
        self._append(ev.ProfileEvent(self.ev.profile(node.candidate, node.evaluation), nid))

    def _outcome(self, nid: int) -> Outcome | None:
        node = self.nodes[nid]
        r = node.evaluation
        if r is None or node.candidate is None:
            return None
        m = r.measurement
        errors = ""
        if r.status != Status.OK:
            errors = r.build.log if r.build and r.build.status != Status.OK else "\n".join(r.verdict.reasons)
        return Outcome(
            key=node.key, status=r.status.value, edit=node.edit,
            time_ms=m.timing.median_ms if m and m.timing else None,
            speedup_eager=m.speedup_eager if m else None, reward=node.reward, errors=errors[-4000:],
        )  # fmt: skip

    def _tried(self) -> tuple[Tried, ...]:
        out = []
        for parent, child, edit, status, _ in self.search.history():
            gain = speedup(self.nodes[parent].value, self.nodes[child].value)
            out.append(Tried(self.nodes[parent].key, edit, status.value, gain))
        return tuple(out)

    def _context(self, nid: int) -> Context:
        node = self.nodes[nid]
        prof = node.profile
        findings = tuple(prof.findings) if prof and self._sees_findings() else ()
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
        evidence = getattr(self.ev, "evidence", {}).get(node.key) if node.candidate else None
        return Context(
            task=self.task,
            reference=self.task.source,
            parent=node.candidate,
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
            extra=self._extra(evidence),
            known=frozenset(self.keys),
        )

    def _lesson(self, nid: int) -> None:
        node = self.nodes[nid]
        parent = self.nodes[node.parent] if node.parent is not None else None
        if self.memory is None or parent is None or parent.candidate is None or node.evaluation is None:
            return
        top = parent.profile.findings[0] if parent.profile and parent.profile.findings else None
        gain = speedup(parent.value, node.value)
        try:
            from pipeline.memory import lessons_from_result

            lesson = lessons_from_result(
                self.task, self.log.run_id, parent.key, node.edit, top, node.evaluation.status, gain,
                bound=parent.profile.bound if parent.profile else "",
            )  # fmt: skip
            self.memory.add([lesson])
            self._append(ev.LessonEvent(nid, node.edit, gain))
        except Exception as e:
            self.notes.append(f"memory unavailable, going on without it: {e}")
            self.memory = None

    def _repairs(self) -> None:
        """Failed children that compiled wrong or computed wrong get a repair round with their errors."""
        while True:
            todo = [
                n.id for n in sorted(self.nodes.values(), key=lambda n: n.id)
                if n.evaluation is not None and n.evaluation.status in REPAIRABLE and not n.repair_done
                and not any(j.repair_of == n.id for j in self.nodes.values())
                and self._repair_depth(n.id) < self.cfg.repair_rounds
            ]  # fmt: skip
            if not todo or self._budget_stop():
                return
            for n in todo:
                if self._budget_stop():
                    return
                node = self.nodes[n]
                assert node.evaluation is not None and node.candidate is not None and node.parent is not None
                self._tell(f"repairing node {n} ({node.evaluation.status.value})")
                self._settle()
                p = self.policy.repair(self._context(node.parent), node.candidate, self._outcome(n))
                self._usage([p])
                fresh, reasons = self._fresh([p])
                if not fresh:
                    why = reasons[0] if reasons else p.reason
                    self._append(ev.RepairFailed(n, p.status, why))
                    if p.status == ProposalStatus.BUDGET:
                        return
                    continue
                self._evaluate(self._add(node.parent, fresh, repair_of=n))

    def _repair_depth(self, n: int) -> int:
        depth = 0
        while (up := self.nodes[n].repair_of) is not None:
            n = up
            depth += 1
        return depth

    def _budget_stop(self) -> str | None:
        cfg, s = self.cfg, self.state
        if s.evaluations >= cfg.max_evals:
            return f"evaluation budget spent ({cfg.max_evals})"
        if self.elapsed() >= cfg.max_wall_s:
            return f"wall-time budget spent ({cfg.max_wall_s:.0f} s)"
        if self.policy_name == "llm" and s.usage.tokens >= cfg.max_tokens:
            return f"token budget spent ({cfg.max_tokens})"
        if self.policy_name == "llm" and s.usage.cost_usd >= cfg.max_cost_usd:
            return f"cost budget spent (${cfg.max_cost_usd:.2f})"
        return None

    def run(self) -> str:
        try:
            return self._run()
        finally:
            self._settle()

    def _run(self) -> str:
        if self.state.pending:  # in flight when the run died
            self._evaluate(self.state.pending)
        self._repairs()
        while True:
            stop = self._budget_stop()
            if stop:
                return stop
            nid = self.search.select()
            if nid is None:
                return "the search has nothing left to expand"
            self._append(ev.Iteration(self.state.iteration + 1, nid))
            new = self._new_moves(nid, self.cfg.children_per_expand + 1)
            if new == 0:  # closed before the profile that would have preceded finding that out
                self._close(nid, "every edit the expert can make of it gives a candidate already tried")
                continue
            room = min(
                self.search.room(nid),
                self.cfg.children_per_expand,
                self.cfg.max_evals - self.state.evaluations,
            )
            if room <= 0:
                self._close(nid, "no room")
                continue
            if new is not None and new <= room and self.hunter is None and self.memory is None:
                # every new move fits this expansion: the advice could only order them (and, with a source
                # index or a memory, pick blocks or lessons: then the profile is taken)
                self._tell(f"no profile of node {nid}: all {new} of its new moves fit this expansion")
            elif (near := self._near_floor(nid)) is not None:
                self.unprofiled.append((nid, near))
                self._tell(f"no profile of node {nid}: at {near:.0%} of its roofline floor")
            else:
                self._profile(nid)
            self._tell(f"{self.policy_name} policy: proposing {room} from node {nid}")
            # The expert skips the moves that repeat a candidate in the tree (its top moves may repeat a
            # sibling's while later ones are new): its first `room` proposals are new, and `room` more are
            # rendered to be built ahead for the next expansion (the root's next batch)
            expert = self.policy_name == "expert"
            proposals = self._propose(nid, 2 * room if expert else room)
            self._usage(proposals)
            fresh, reasons = self._fresh(proposals, room)
            if not fresh:
                statuses = {p.status for p in proposals}
                if statuses == {ProposalStatus.BUDGET}:
                    return "LLM budget spent"
                if statuses == {ProposalStatus.UNSUPPORTED}:
                    raise UnsupportedTask(reasons[0] if reasons else "the policy cannot write this task")
                if statuses and statuses <= {ProposalStatus.REFUSED}:
                    self.refusals += 1  # the endpoint's trouble, not the node's: try again, then give up
                    if self.refusals >= 3:
                        raise OptimizeError(
                            f"the LLM endpoint {endpoint_url(self.cfg)} keeps refusing: {reasons[0]}"
                        )
                    continue
                why = list(dict.fromkeys(reasons))  # the expert's every move: say the first few
                more = f"; and {len(why) - 3} more" if len(why) > 3 else ""
                self._close(nid, "; ".join(why[:3]) + more or "no proposals")
                continue
            self.refusals = 0
            if expert:  # the moves past this expansion's room come up in later ones (the root's do)
                self._ahead(proposals, skip=len(fresh))
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
    pool: WorkerPool | None = None,
) -> OptimizeOutcome:
    """Search for the fastest correct kernel for a task; every step lands in runs/<run-id>/log.jsonl.

    `replay`: answer evaluations from a run log recorded on a GPU instead of running them (tests, demos).
    `resume`: continue that run with its recorded search settings and budgets; the budget fields named in
    `budgets_given` (set on purpose by the caller) win. A finished run comes back as it is, nothing appended
    (`finished_before`), unless `more` asks for that many more evaluations. `pool`: GPU workers already
    running (a bench's, kept across its tasks: a confined worker takes ~11 s to start); the caller closes it.
    """
    task_path = Path(task_path)
    log: runlog.RunLog | None = None
    state: RunState | None = None
    if more is not None and not resume:
        raise OptimizeError("more evaluations are for a run that exists: give its id to resume")
    try:
        if resume:
            log = runlog.RunLog.open(cfg.runs_dir, resume, secrets=_secrets(cfg))
            state = _resume_state(log)
            if state.finished and more is None:
                log.close()
                return _finished(log, state)
            cfg, task_path, replay = _reopen(state, cfg, task_path, replay, more, budgets_given)
        if not task_path.is_file():
            raise TaskError(f"task file not found: {task_path}")
        policy_name = resolve_policy(cfg)
        if policy_name == "llm":
            _check_endpoint(cfg)  # an unreachable URL is one line, before any run folder exists
        try:
            evaluator: Evaluator = (
                ReplayEvaluator(
                    [Path(replay)] if isinstance(replay, str | Path) else [Path(r) for r in replay]
                )
                if replay
                else GpuEvaluator(
                    task_path, cfg, feedback=cfg.feedback, energy=cfg.objective != "time", pool=pool
                )
            )
        except FileNotFoundError as e:
            raise OptimizeError(str(e)) from None
    except BaseException:
        if log is not None:
            log.close()
        raise
    try:
        task = evaluator.task()
        hunter, hunter_notes = _open_hunter(cfg)
        memory = _open_memory(cfg)
        toolbox = None
        if policy_name == "llm":
            from pipeline.generate.toolbox import LocalToolBox

            toolbox = LocalToolBox(hunter=hunter)
        policy = _make_policy(policy_name, cfg, task_path, toolbox=toolbox, hunter=hunter)
        if log is None:
            start = ev.Start(
                runlog.new_run_id(task.id), to_dict(task), str(task_path), cfg.public(), policy_name, cfg.search,
                evaluator.name, [str(p) for p in evaluator.paths] if isinstance(evaluator, ReplayEvaluator) else None,
            )  # fmt: skip
            _, header = ev.encode(start)
            log = runlog.RunLog.create(cfg.runs_dir, start.run_id, header, secrets=_secrets(cfg))
            state = fold(log.events())
        assert state is not None
        logged = state.events  # what the log held when this process took it over
        live = Live(log.run_id, task.id, policy_name, cfg.search, cfg.objective, cfg.max_evals)
        base = state.baselines
        if base is None:
            if progress:
                live.step = "measuring eager and torch.compile baselines"
                progress(live)
            try:
                base = evaluator.baselines()
            except Exception as e:
                log.append(*ev.encode(ev.End(reason=f"the reference failed: {e}")))
                raise ReferenceFailed(f"the task's reference could not be measured: {e}") from None
            _record(log, state, ev.BaselinesEvent(base))
            ceil = evaluator.ceilings()
            if ceil is not None:
                _record(log, state, ev.CeilingsEvent(ceil))
        run = _Run(cfg, log, evaluator, policy, policy_name, task, base, state, memory, hunter, live, progress,
                   time.monotonic())  # fmt: skip
        run.notes.extend(hunter_notes)
        try:
            run.restore()
        except (KeyError, TypeError, ValueError) as e:
            raise OptimizeError(f"run {log.run_id} cannot be resumed: its log is malformed ({e!r})") from None
        if resume:
            budgets = {k: getattr(cfg, k) for k in _BUDGETS}
            run._append(ev.Resume(logged, state.elapsed_s, more, budgets))
        stop = run.run()
        return _finish(run, stop, evaluator)
    except KeyboardInterrupt:
        if log is None:
            raise  # nothing written yet: nothing to resume
        with contextlib.suppress(runlog.RunLogError, OSError):  # resume reads the results, not this mark
            log.resync()  # the interrupt may have landed inside an append
            done = fold(log.events()).evaluations
            log.append(*ev.encode(ev.Interrupted(done)))
        raise RunInterrupted(log.run_id, cfg.runs_dir) from None
    finally:
        evaluator.close()
        if log is not None:
            log.close()


def _record(log: runlog.RunLog, state: RunState, event: ev.TypedEvent) -> None:
    """Into the log, then into the run's state: the same fold a resume makes of the log."""
    state.apply(event, log.append(*ev.encode(event)))


def _resume_state(log: runlog.RunLog) -> RunState:
    try:
        return fold(log.events())
    except runlog.RunLogError as e:
        what = "does not make one search tree" if isinstance(e, NotOneTree) else "is malformed"
        raise OptimizeError(f"run {log.run_id} cannot be resumed: its log {what}: {e}") from None


def _reopen(
    state: RunState,
    cfg: Config,
    task_path: Path,
    replay: Any,
    more: int | None,
    budgets_given: Collection[str],
) -> tuple[Config, Path, Any]:
    """The config, task and recordings to continue a run with: the recorded search settings, the budgets of
    its start (or of its last resume, which may have raised them) unless given now, and `more` evaluations
    on top of those done."""
    recorded: dict[str, Any] = {**state.header.config, **state.budgets}
    keep = [k for k in (*_RESUME_FIXED, *_BUDGETS) if k in recorded and k not in budgets_given]
    cfg = cfg.replace(**{k: _typed(cfg, k, recorded[k]) for k in keep})
    if more is not None:
        cfg = cfg.replace(max_evals=state.evaluations + more)
    if not str(task_path) or str(task_path) == ".":
        task_path = Path(state.header.task["path"])
    return cfg, task_path, replay or state.header.replay  # a replayed run resumes against its recordings


def _finished(log: runlog.RunLog, state: RunState) -> OptimizeOutcome:
    end = state.end
    assert end is not None
    folder = log.folder
    rep, exported = folder / "report.md", folder / "best_model_new.py"
    return OptimizeOutcome(
        log.run_id, folder, end.reason or "finished", end.best_key, end.best_speedup_eager,
        end.best_speedup_compile, end.evaluations or state.evaluations,
        rep if rep.is_file() else None, exported if exported.is_file() else None,
        tuple(end.notes), finished_before=True,
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


def _finish(run: _Run, stop: str, evaluator: Evaluator) -> OptimizeOutcome:
    folder = run.log.folder
    best = run.chosen()
    exported = None
    pool_notes = getattr(getattr(evaluator, "pool", None), "notes", [])  # Ray: GPU actors lost or drained
    notes = list(dict.fromkeys([*run.notes, *pool_notes]))
    if run.unprofiled:
        nodes = ", ".join(f"{n} ({share:.0%})" for n, share in run.unprofiled)
        notes.append(
            f"{len(run.unprofiled)} node(s) expanded without a profile, within "
            f"{run.headroom:.0%} of the roofline floor by their own timing: {nodes}"
        )
    if best is not None and best != ROOT:
        node = run.nodes[best]
        assert node.candidate is not None and node.evaluation is not None
        save_candidate(node.candidate, folder / "best")
        if isinstance(evaluator, GpuEvaluator):
            energy = run.cfg.energy or run.cfg.objective != "time"  # --no-energy: time only, ~10-30 s less
            run._tell(f"re-measuring the best candidate{' with energy' if energy else ''}")
            run._append(ev.Final(evaluator.remeasure(node.candidate, energy=energy), best))
        build = node.evaluation.build
        try:
            if build is not None and build.cubin_path and Path(build.cubin_path).is_file():
                exported = export_standalone(node.candidate, build, folder / "best_model_new.py")
            else:
                notes.append("no standalone export: the best candidate's cubin is not on this machine")
        except CandidateError as e:
            notes.append(f"no standalone export: {e}")
    live = run.live
    run._append(ev.End(stop, best, live.best_key, live.best_speedup_eager, live.best_speedup_compile,
                       run.state.evaluations, tuple(notes)))  # fmt: skip
    rep = report.write_report(folder)
    return OptimizeOutcome(
        run.log.run_id, folder, stop, live.best_key, live.best_speedup_eager, live.best_speedup_compile,
        run.state.evaluations, rep, exported, tuple(notes),
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


def _open_hunter(cfg: Config) -> tuple[Any, list[str]]:
    """The source hunter over the corpora of the config's `corpus` whose index was built (`make index`), one
    Hunter or a Hunters for several, and a note for each corpus without one; the search runs without
    building blocks from a corpus whose index is missing, and with none at all under "none"."""
    from corpora import index_commands
    from pipeline.config import corpus_names

    try:
        names = corpus_names(cfg.corpus)
    except ValueError as e:  # a resumed run's recorded corpus that this checkout no longer defines
        return None, [f"no building blocks: {e}"]
    if not names:
        return None, ["corpus none: no building blocks from a source index"]
    try:
        from index.hunt import open_corpora

        hunter, missing = open_corpora(cfg, names)
    except Exception as e:  # the index stack is not installed
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return None, [f"no building blocks from the source index ({why}); run `make index`"]
    notes = []
    for name, why in missing.items():
        note = f"no building blocks from the source index of corpus {name} ({why})"
        if "index build" not in why:
            note += f"; build it with `{index_commands(name)[1]}`"
        notes.append(note)
    return hunter, notes


def _open_memory(cfg: Config) -> Any:
    if not cfg.memory:
        return None
    from pipeline.memory import Memory

    return Memory(cfg, cfg.memory_collection)
