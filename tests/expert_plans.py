"""Test helpers: a task's tuned candidate, and that candidate with one edit made on every region that takes
it (what the search reaches in several steps, e.g. a doubled cluster for each long-row region)."""

from __future__ import annotations

from pathlib import Path

from pipeline.candidates import make_candidate
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, plan_of
from pipeline.generate.expert.edits import legal_edits
from pipeline.generate.expert.policy import analyse
from pipeline.generate.expert.render import nvcc_flags, render
from pipeline.tasks import probe
from pipeline.types import Candidate


def tuned(path: Path) -> Candidate:
    """The task's tuned candidate: the expert's second first proposal."""
    t = probe(path)
    return ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate


def tuned_with_edit(path: Path, edit: str) -> Candidate:
    t = probe(path)
    base = tuned(path)
    low, why = analyse(path)  # as the policy lowered it (PyTorch's decompositions included)
    assert low is not None, why
    plan = plan_of(base.source)
    for rid in [rp.rid for rp in plan.regions]:
        plan = next((p for label, p in legal_edits(plan, low) if label.startswith(f"{edit}({rid}:")), plan)
    source, launcher = render(low, plan)
    return make_candidate(t.id, source, launcher, nvcc_flags(plan), parent=base.key, edit=edit)
