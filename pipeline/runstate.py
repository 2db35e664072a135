"""The one fold of a run's events into its state: the search tree, the evaluations in order, the budgets
spent and how the run ended. Resume, the report, the run list and the replay evaluator all take a run's
state from `fold`; the loop folds each event it appends the same way (`RunState.apply`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.calibrate import Ceilings
from pipeline.events import (
    BaselinesEvent,
    CeilingsEvent,
    Closed,
    End,
    Final,
    Interrupted,
    Iteration,
    Llm,
    MalformedEvent,
    ProfileEvent,
    Proposal,
    RepairFailed,
    Result,
    Resume,
    Start,
    TypedEvent,
    decode,
)
from pipeline.generate.base import Usage
from pipeline.runlog import LOG, Event, RunLogError, is_locked, read_events
from pipeline.search import matched
from pipeline.types import Baselines, Candidate, Evaluation, Profile, Status, speedup

ROOT = 0  # the node of the task's reference


class NotOneTree(RunLogError):
    """The events do not make one search tree (a log edited by hand, or written by other code)."""


@dataclass
class NodeState:
    """One node of the search tree as the log tells it; the loop keeps it up to date as the run goes on."""

    id: int
    parent: int | None
    edit: str = ""
    candidate: Candidate | None = None  # None for the root (the reference)
    repair_of: int | None = None
    evaluation: Evaluation | None = None
    reward: float | None = None
    value: float | None = None  # the objective's figure (ms, J, J*ms)
    profile: Profile | None = None
    repair_done: bool = False
    children: list[int] = field(default_factory=list)

    @property
    def key(self) -> str:
        return self.candidate.key if self.candidate else ""

    @property
    def status(self) -> Status | None:
        """The verdict's status; None while pending. The reference is OK by definition."""
        if self.id == ROOT:
            return Status.OK
        return self.evaluation.status if self.evaluation else None

    @property
    def time_ms(self) -> float | None:
        """The measured median of a correct candidate."""
        m = self.evaluation.measurement if self.evaluation else None
        if self.status != Status.OK or m is None or m.timing is None:
            return None
        return m.timing.median_ms

    @property
    def speedup(self) -> float | None:
        """Over eager, timed alongside it in the same worker (the reference: 1)."""
        if self.id == ROOT:
            return 1.0
        m = self.evaluation.measurement if self.evaluation else None
        eager = m.baselines.get("eager") if m else None
        return speedup(eager.median_ms if eager else None, self.time_ms)

    @property
    def top_finding(self) -> str:
        f = self.profile.findings[0] if self.profile and self.profile.findings else None
        return f"[{f.tool}] {f.diagnosis}" if f else ""


@dataclass(frozen=True)
class Point:
    """One evaluation, in the order the run made them."""

    n: int  # 1-based
    node: int
    edit: str
    status: Status
    time_ms: float | None
    speedup: float | None  # over eager, timed alongside
    energy_j: float | None


@dataclass
class RunState:
    """Everything a run's events say: the tree, the evaluations in order, the budgets spent, how it ended."""

    header: Start = field(default_factory=Start)
    nodes: dict[int, NodeState] = field(default_factory=lambda: {ROOT: NodeState(ROOT, None)})
    # The search's mutating calls in log order (pipeline/search/tree.py's apply format): a resumed run
    # replays them to rebuild the same tree.
    calls: list[dict[str, Any]] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (evaluation, best speedup so far)
    statuses: dict[Status, int] = field(default_factory=dict)
    usage: Usage = field(default_factory=Usage)
    iteration: int = 0
    elapsed_s: float = 0.0  # the wall time the run had spent when it last logged a result
    baselines: Baselines | None = None
    ceilings: Ceilings | None = None
    final: Final | None = None
    end: End | None = None  # None unless the run ended after its last resume
    last_end: End | None = None  # the last end, resumed after or not
    budgets: dict[str, Any] = field(default_factory=dict)  # the budgets of the last resume that set them
    interrupted: int = 0
    events: int = 0

    @property
    def evaluations(self) -> int:
        return len(self.points)

    @property
    def finished(self) -> bool:
        """The run stopped by itself (a resumed run that ended again counts)."""
        return self.end is not None

    @property
    def pending(self) -> list[int]:
        """Proposed nodes never evaluated (in flight when the run died), in node order."""
        return [
            n.id for n in sorted(self.nodes.values(), key=lambda n: n.id) if n.candidate and not n.evaluation
        ]

    @property
    def best_speedup(self) -> float | None:
        """The run's best over eager: its end's word when it has one, else the best evaluation's."""
        if self.last_end is not None and self.last_end.best_speedup_eager is not None:
            return self.last_end.best_speedup_eager
        return max((p.speedup for p in self.points if p.speedup), default=None)

    def at_speed(self) -> list[matched.Candidate]:
        """Every verified, timed candidate as the matched-speed rule sees it, in node order."""
        out = []
        for n in sorted(self.nodes.values(), key=lambda n: n.id):
            m = n.evaluation.measurement if n.evaluation else None
            if n.id == ROOT or n.time_ms is None or m is None:
                continue
            e = m.energy
            out.append(
                matched.Candidate(n.id, n.time_ms, e.joules_per_call if e else None, e.spread if e else None)
            )
        return out

    def apply(self, ev: TypedEvent | None, seq: int = -1) -> None:
        """One more event (the loop folds each event it appends, as `fold` does each one it reads)."""
        self.events += 1
        match ev:
            case Start():
                self.header = ev
            case BaselinesEvent():
                self.baselines = self.baselines or ev.baselines
            case CeilingsEvent():
                self.ceilings = self.ceilings or ev.ceilings
            case Proposal():
                self.nodes[ev.node] = NodeState(ev.node, ev.parent, ev.edit, ev.candidate, ev.repair_of)
                self.nodes[ev.parent].children.append(ev.node)
                key = ev.candidate.key if ev.candidate else ""
                self.calls.append({"op": "add", "parent": ev.parent, "key": key, "edit": ev.edit, "node": ev.node,
                                   "seq": seq})  # fmt: skip
            case Result():
                self._result(ev)
            case ProfileEvent():
                self.nodes[ev.node].profile = ev.profile
            case Llm():
                self.usage = self.usage + ev.usage
            case Closed():
                self.calls.append({"op": "close", "node": ev.node, "reason": ev.reason})
            case Iteration():
                self.iteration = ev.iteration
            case RepairFailed():
                self.nodes[ev.node].repair_done = True
            case Resume():
                self.end = (
                    None  # continued after it ended (`--resume --more N`): not finished until it ends again
                )
                self.budgets.update(ev.budgets)
            case Interrupted():
                self.interrupted += 1
            case Final():
                self.final = ev
            case End():
                self.end = self.last_end = ev

    def _result(self, ev: Result) -> None:
        n = self.nodes[ev.node]
        n.evaluation, n.reward, n.value = ev.evaluation, ev.reward, ev.value
        status = ev.evaluation.status
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.calls.append({"op": "record", "node": ev.node, "status": status, "reward": ev.reward})
        if ev.elapsed_s is not None:
            self.elapsed_s = max(self.elapsed_s, ev.elapsed_s)
        m = ev.evaluation.measurement
        energy = m.energy.joules_per_call if m and m.energy else None
        self.points.append(Point(len(self.points) + 1, n.id, n.edit, status, n.time_ms, n.speedup, energy))
        best = max(self.curve[-1][1] if self.curve else 0.0, n.speedup or 0.0)
        if best:
            self.curve.append((len(self.points), best))


def fold(events: Iterable[Event]) -> RunState:
    """The state of a run from its events. NotOneTree when they do not make one search tree (a proposal under
    a node no proposal made, a node proposed twice, an event naming a node that does not exist);
    MalformedEvent when an event lacks what the fold needs. Both are RunLogErrors with one line."""
    state = RunState()
    for e in events:
        problem = _tree_problem(state, e)
        if problem:
            raise NotOneTree(problem)
        try:
            state.apply(decode(e), e.seq)
        except (KeyError, TypeError, ValueError, AttributeError) as x:
            raise MalformedEvent(f"event {e.seq} ({e.type}): {x!r}") from None
    return state


def _tree_problem(state: RunState, e: Event) -> str | None:
    nodes = state.nodes
    node = e.data.get("node")
    if e.type == Proposal.TYPE:
        parent = e.data.get("parent")
        if not isinstance(node, int) or parent not in nodes:
            return f"event {e.seq} proposes node {node} under node {parent}, which does not exist"
        if node in nodes:
            return f"event {e.seq} proposes node {node} a second time"
    elif isinstance(node, int) and node not in nodes:
        return f"event {e.seq} ({e.type}) names node {node}, which no proposal made"
    elif e.type == End.TYPE and e.data.get("best_node") not in (None, *nodes):
        return f"event {e.seq} (end) names node {e.data['best_node']} as the best, which no proposal made"
    return None


# -- the run list -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSummary:
    run_id: str
    task_id: str
    started: float | None  # unix time of the start event
    events: int
    evaluations: int  # result events
    status: str  # finished | interrupted | running | corrupt
    best_speedup: float | None = None


def list_runs(runs_dir: Path) -> list[RunSummary]:
    """Every run under runs_dir, oldest first (ids start with the time)."""
    runs_dir = Path(runs_dir)
    folders = sorted(p for p in runs_dir.iterdir() if (p / LOG).is_file()) if runs_dir.is_dir() else []
    return [_summary(folder) for folder in folders]


def _summary(folder: Path) -> RunSummary:
    try:
        events = read_events(folder)
    except (RunLogError, OSError):
        return RunSummary(folder.name, "?", None, 0, 0, "corrupt")
    try:
        state: RunState | None = fold(events)
    except RunLogError:  # neither resume nor a report could fold it
        state = None
    if is_locked(folder):
        status = "running"  # its writer holds it: the log may be mid-step
    else:
        status = "corrupt" if state is None else "finished" if state.finished else "interrupted"
    started = events[0].t if events else None
    if state is None:
        return RunSummary(folder.name, _task_id(events), started, len(events), 0, status)
    return RunSummary(
        folder.name,
        state.header.task_id,
        started,
        state.events,
        state.evaluations,
        status,
        state.best_speedup,
    )


def _task_id(events: Sequence[Event]) -> str:
    head = events[0].data if events and events[0].type == Start.TYPE else {}
    task = head.get("task")
    return str(task.get("id", "?")) if isinstance(task, dict) else str(task or "?")
