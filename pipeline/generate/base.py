"""What every policy (LLM or offline expert) receives and returns. Pure data: no I/O here.

The loop builds a `Context` for the node it expands and asks the policy for up to n `Proposal`s. A policy
never raises for a bad reply or an edit it cannot make: it returns a Proposal with a non-OK status and a
reason, and the loop records it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.types import Candidate, Finding, Task


class ProposalStatus(enum.StrEnum):
    OK = "ok"
    UNPARSEABLE = "unparseable"  # the reply held no usable kernel + launcher
    REFUSED = "refused"  # the endpoint refused or failed after retries (rate limit, server error, timeout)
    BUDGET = "budget"  # the token or cost budget ran out
    NO_MOVE = "no_move"  # the policy has nothing new to try from this parent
    UNSUPPORTED = "unsupported"  # the task holds nothing the policy can write


@dataclass(frozen=True)
class Outcome:
    """What became of one evaluated candidate, in the words a policy needs."""

    key: str
    status: str  # pipeline.types.Status value
    edit: str | None = None
    time_ms: float | None = None
    speedup_eager: float | None = None
    reward: float | None = None
    errors: str = ""  # trimmed compiler log or verifier reasons, for repair rounds


@dataclass(frozen=True)
class Tried:
    """One entry of the search memory: an edit tried at a node and what it gave."""

    parent: str  # candidate key of the parent
    edit: str
    status: str
    speedup_vs_parent: float | None = None  # >1 better


@dataclass(frozen=True)
class Lesson:
    """A lesson retrieved from memory (pipeline/memory.py): an edit that helped or hurt on a similar task."""

    task_features: str
    finding: str
    edit: str
    outcome: str  # e.g. "1.8x faster", "mismatch", "no change"
    gain: float | None = None
    similarity: float | None = None


@dataclass(frozen=True)
class Context:
    task: Task
    reference: str  # the task file's source
    parent: Candidate | None  # None: propose first kernels from the reference
    parent_outcome: Outcome | None = None
    bound: str = ""  # stage-1 class summary of the parent ("memory-bound: ..."), always supplied
    findings: tuple[Finding, ...] = ()  # stage-2 findings on the parent, worst first
    feedback: str = ""  # the text shown to an LLM: advice block, JSON, raw metrics, or "" for none
    blocks: tuple[Any, ...] = ()  # index.hunt.Block building blocks retrieved for this step
    lessons: tuple[Lesson, ...] = ()
    tried: tuple[Tried, ...] = ()  # search memory: what was already tried (here and elsewhere in the tree)
    siblings: tuple[Outcome, ...] = ()  # outcomes of this parent's other children
    best: Outcome | None = None
    arch: str = "sm_90a"
    extra: dict[str, Any] = field(default_factory=dict)
    # candidate keys the search holds already: a policy that can tell (the expert) proposes other ones, so
    # asking for n proposals gives n new candidates without rendering the moves past them
    known: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    calls: int = 0  # HTTP requests, retries included
    tool_calls: tuple[str, ...] = ()  # e.g. "hunt(query=...)", "profile_tool(name=...)"
    seconds: float = 0.0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.cost_usd + other.cost_usd,
            self.calls + other.calls,
            self.tool_calls + other.tool_calls,
            self.seconds + other.seconds,
        )

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Proposal:
    status: ProposalStatus
    candidate: Candidate | None = None  # set when status is OK; candidate.parent and .edit filled in
    edit: str = ""  # a short label: "vectorize_loads(width=4)", "llm: fuse the bias add"
    reason: str = ""  # why not OK, or the policy's own one-line rationale
    usage: Usage = Usage()
    notes: tuple[str, ...] = ()  # e.g. ops left to PyTorch


class Policy(Protocol):
    name: str

    def propose(self, ctx: Context, n: int) -> list[Proposal]:
        """Up to n children of ctx.parent (first kernels when it is None); never raises for bad replies."""
        ...

    def repair(self, ctx: Context, failed: Candidate, outcome: Outcome) -> Proposal:
        """One repair round for a child that failed to compile or verify (outcome.errors says why)."""
        ...
