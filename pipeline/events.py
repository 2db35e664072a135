"""The run log's events, typed: one frozen record per event type the loop appends (pipeline/runlog.py).

`encode` gives the JSON data to append and `decode` reads it back. The data is what the loop wrote before
the events were typed, so old logs read here and new logs read in old code; `decode` gives None for a type
it does not know (an older or newer writer's). pipeline/runstate.py folds them into a run's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from pipeline.calibrate import Ceilings
from pipeline.generate.base import ProposalStatus, Usage
from pipeline.runlog import Event, RunLogError
from pipeline.types import (
    Baselines,
    Candidate,
    Evaluation,
    Profile,
    Task,
    from_dict,
    to_dict,
)

ROOT = 0  # the node of the task's reference


class NotOneTree(RunLogError):
    """The events do not make one search tree (a log edited by hand, or written by other code)."""


class MalformedEvent(RunLogError):
    """An event lacks a field the fold needs, or holds one of the wrong shape."""


# -- the events -------------------------------------------------------------------------------------------
# `FLAT` names a field holding a record that is stored flat, beside the event's own fields.


@dataclass(frozen=True)
class Start:
    TYPE: ClassVar[str] = "start"
    run_id: str = ""
    task: dict[str, Any] = field(default_factory=dict)  # Task in to_dict form (older logs: id, path, hash)
    task_path: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # Config.public()
    policy: str | None = None
    search: str | None = None
    evaluator: str | None = None
    replay: list[str] | None = None  # the recordings a replayed run answers from

    @property
    def task_id(self) -> str:
        return str(self.task.get("id", "?")) if isinstance(self.task, dict) else str(self.task or "?")

    def task_record(self) -> Task:
        return from_dict(Task, self.task)


@dataclass(frozen=True)
class BaselinesEvent:
    TYPE: ClassVar[str] = "baselines"
    FLAT: ClassVar[str] = "baselines"
    baselines: Baselines


@dataclass(frozen=True)
class CeilingsEvent:
    """The GPU's measured ceilings, for the report's roofline; None when the event has another shape."""

    TYPE: ClassVar[str] = "ceilings"
    FLAT: ClassVar[str] = "ceilings"
    ceilings: Ceilings | None


@dataclass(frozen=True)
class Proposal:
    TYPE: ClassVar[str] = "proposal"
    node: int
    parent: int
    edit: str = ""
    repair_of: int | None = None  # the failed node this one repairs
    candidate: Candidate | None = None
    reason: str = ""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Result:
    """One evaluated candidate, failures included: a compile error has a verdict and no measurement."""

    TYPE: ClassVar[str] = "result"
    FLAT: ClassVar[str] = "evaluation"
    evaluation: Evaluation
    node: int
    reward: float | None = None
    value: float | None = None  # the objective's figure (ms, J, J*ms)
    elapsed_s: float | None = None  # the run's wall time so far, across resumes


@dataclass(frozen=True)
class ProfileEvent:
    TYPE: ClassVar[str] = "profile"
    FLAT: ClassVar[str] = "profile"
    profile: Profile
    node: int


@dataclass(frozen=True)
class Llm:
    """One exchange with the LLM: the token and cost ledger (usage flat, or under "usage" in older logs)."""

    TYPE: ClassVar[str] = "llm"
    FLAT: ClassVar[str] = "usage"
    usage: Usage
    status: str = ""  # the proposal's ProposalStatus value


@dataclass(frozen=True)
class LessonEvent:
    TYPE: ClassVar[str] = "lesson"
    node: int | None = None
    edit: str = ""
    gain: float | None = None


@dataclass(frozen=True)
class Closed:
    TYPE: ClassVar[str] = "closed"
    node: int
    reason: str = ""


@dataclass(frozen=True)
class Iteration:
    TYPE: ClassVar[str] = "iteration"
    iteration: int
    node: int | None = None


@dataclass(frozen=True)
class ProposalFailed:
    TYPE: ClassVar[str] = "proposal_failed"
    status: ProposalStatus
    reason: str = ""


@dataclass(frozen=True)
class RepairFailed:
    TYPE: ClassVar[str] = "repair_failed"
    node: int
    status: ProposalStatus
    reason: str = ""


@dataclass(frozen=True)
class Resume:
    TYPE: ClassVar[str] = "resume"
    events: int | None = None  # events in the log when it was resumed
    elapsed_s: float | None = None
    more: int | None = None
    budgets: dict[str, Any] = field(default_factory=dict)  # what a later resume keeps


@dataclass(frozen=True)
class Interrupted:
    TYPE: ClassVar[str] = "interrupted"
    evaluations: int = 0


@dataclass(frozen=True)
class Final:
    """The best candidate re-measured at the end, energy on."""

    TYPE: ClassVar[str] = "final"
    FLAT: ClassVar[str] = "evaluation"
    evaluation: Evaluation
    node: int | None = None


@dataclass(frozen=True)
class End:
    TYPE: ClassVar[str] = "end"
    reason: str = ""
    best_node: int | None = None
    best_key: str | None = None
    best_speedup_eager: float | None = None
    best_speedup_compile: float | None = None
    evaluations: int | None = None
    notes: tuple[str, ...] = ()


TypedEvent = (
    Start | BaselinesEvent | CeilingsEvent | Proposal | Result | ProfileEvent | Llm | LessonEvent | Closed
    | Iteration | ProposalFailed | RepairFailed | Resume | Interrupted | Final | End
)  # fmt: skip
_BY_TYPE: dict[str, type] = {
    c.TYPE: c
    for c in (Start, BaselinesEvent, CeilingsEvent, Proposal, Result, ProfileEvent, Llm, LessonEvent, Closed,
              Iteration, ProposalFailed, RepairFailed, Resume, Interrupted, Final, End)
}  # fmt: skip


def encode(ev: TypedEvent) -> tuple[str, dict[str, Any]]:
    """The (type, data) to append for an event."""
    data = to_dict(ev)
    flat = getattr(ev, "FLAT", None)
    if flat:
        data = {**(data.pop(flat) or {}), **data}
    return ev.TYPE, data


def decode(e: Event) -> TypedEvent | None:
    """The typed form of a stored event; None for a type this code does not know."""
    cls = _BY_TYPE.get(e.type)
    if cls is None:
        return None
    data = e.data
    flat = getattr(cls, "FLAT", None)
    try:
        if cls is CeilingsEvent:
            return CeilingsEvent(_ceilings(data))
        if cls is End and "best_speedup_eager" not in data:  # the oldest logs: a summary
            data = {**data, "best_speedup_eager": (data.get("summary") or {}).get("best_speedup")}
        if flat:
            inner = data.get(flat, data) if cls is Llm else data
            if flat == "evaluation":  # older writers left out what an evaluation did not have
                inner = {"build": None, "measurement": None, **inner}
            data = {**{k: v for k, v in data.items() if k != flat}, flat: inner}
        return from_dict(cls, data)
    except (TypeError, ValueError, KeyError, AttributeError) as x:
        raise MalformedEvent(f"event {e.seq} ({e.type}): {x!r}") from None


def _ceilings(data: dict[str, Any]) -> Ceilings | None:
    try:
        return from_dict(Ceilings, data)
    except TypeError:  # another shape (an older writer's): the report plots without them
        return None
