"""Test helpers: a task's tuned candidate, and that candidate with one edit made on every region that takes
it (what the search reaches in several steps, e.g. a doubled cluster for each long-row region) or with knobs
set on its regions (a form no single edit reaches); a task of one module applied to its input."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.candidates import make_candidate
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, plan_of
from pipeline.generate.expert.edits import base_plan, for_arch, legal_edits
from pipeline.generate.expert.policy import analyse
from pipeline.generate.expert.render import nvcc_flags, render
from pipeline.tasks import probe
from pipeline.types import Candidate


def tuned(path: Path) -> Candidate:
    """The task's tuned candidate, as the search's first batch has it; LookupError when it proposes none.
    Where the tuned plan is the plain one (a lone convolution takes its widest tile in both), the policy
    proposes it once, as the plain kernels: the second proposal is then the tuned plan's first edit."""
    t = probe(path)
    props = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)
    by_label = {p.edit: p.candidate for p in props if p.candidate is not None}
    if "expert: tuned kernels" in by_label:
        return by_label["expert: tuned kernels"]
    low, _ = analyse(path)
    plain = by_label.get("expert: plain kernels")
    if low is None or plain is None or plan_of(plain.source) != for_arch(base_plan(low, True), "sm_90a"):
        raise LookupError(f"the expert proposes no tuned candidate ({[p.edit for p in props]})")
    return plain


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


def with_knobs(path: Path, base: Candidate, tag: str = "", edit: str = "", **knobs) -> Candidate:
    """`base` with `knobs` set on its plan's regions of family `tag` (every region with those knobs where
    no tag is given), rendered as the expert would; the plan's other fields (its CUDA graph) kept.
    LookupError where that changes no region."""
    low, why = analyse(path)
    assert low is not None, why
    plan = plan_of(base.source)
    picked = (lambda rp: tag == rp.TAG) if tag else (lambda rp: all(hasattr(rp, k) for k in knobs))
    regions = tuple(dataclasses.replace(rp, **knobs) if picked(rp) else rp for rp in plan.regions)
    if regions == plan.regions:
        raise LookupError(f"{knobs} change no region of {plan.to_json()}")
    plan = dataclasses.replace(plan, regions=regions)
    source, launcher = render(low, plan)
    return make_candidate(
        base.task_id, source, launcher, nvcc_flags(plan), parent=None, edit=edit or str(knobs)
    )


def op_task(folder: Path, name: str, module: str, ret: str, shape: str, dtype: str = "") -> Path:
    """A task file whose model applies `module` (an nn expression) to x, y, and returns `ret` (of y); its
    input torch.randn(shape) * 3 + 2, cast to `dtype` where one is given."""
    x = f"torch.randn({shape}) * 3 + 2"
    path = folder / f"{name}.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n"
        f"        super().__init__()\n        self.op = {module}\n\n    def forward(self, x):\n"
        f"        y = self.op(x)\n        return {ret}\n\n\n"
        f"def get_inputs():\n    return [{f'({x}).to(torch.{dtype})' if dtype else x}]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    return path
