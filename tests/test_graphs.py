"""A forward replayed from a CUDA graph (plan.graph, runtime.Graphs): the tuned plan of a launcher of many
launches turns it on, the capture_graph edit offers it, the launcher's forward hands its body to
`kernels.graphed`, and the static check reads that body as code forward calls (its library ops count, its
parameters are the tensors forward passes). The graphs themselves need a GPU: tests/test_gpu_harness.py."""

from __future__ import annotations

import pytest
from expert_plans import tuned
from test_expert import task_file
from test_expert_decompose import needs_gxx

from pipeline.generate.expert.edits import GRAPH_EDIT, GRAPH_LAUNCHES, base_plan, launched, legal_edits, safer
from pipeline.generate.expert.plan import Plan, plan_of
from pipeline.generate.expert.policy import analyse
from pipeline.static_check import check_launcher
from pipeline.tasks import load_module
from pipeline.types import Kind

torch = pytest.importorskip("torch")

# Six blocks of layer norm, scale, softmax and residual: 19 launches in the tuned plan, 25 in the plain one
DEEP = """class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(129) for _ in range(6))
        self.scales = nn.Parameter(torch.randn(6, 129))

    def forward(self, x):
        for i, n in enumerate(self.norms):
            x = torch.softmax(n(x) * self.scales[i], dim=-1) + x
        return x.sum(dim=-1)"""
SHALLOW = """class Model(nn.Module):
    def forward(self, x, y):
        return torch.softmax(x, dim=-1) * y"""


def _deep(tmp_path):
    return task_file(tmp_path, "deep", DEEP, "[torch.randn(3, 37, 129)]")


def test_the_tuned_plan_replays_a_forward_of_many_launches_and_not_a_short_one(tmp_path):
    low, why = analyse(_deep(tmp_path))
    assert low is not None, why
    plain, tuned_plan = base_plan(low, False), base_plan(low, True)
    assert launched(low, tuned_plan) >= GRAPH_LAUNCHES and tuned_plan.graph and not plain.graph
    short, why = analyse(task_file(tmp_path, "short", SHALLOW, "[torch.randn(5, 7), torch.randn(5, 7)]"))
    assert short is not None, why
    assert launched(short, base_plan(short, True)) < GRAPH_LAUNCHES and not base_plan(short, True).graph


def test_the_plan_keeps_its_text_without_a_graph_and_reads_it_back_with_one(tmp_path):
    low, _ = analyse(_deep(tmp_path))
    plan = base_plan(low, True)
    assert '"graph":true' in plan.to_json() and Plan.from_json(plan.to_json()) == plan
    off = plan.with_graph(False)
    assert "graph" not in off.to_json()  # every plan written before graphs has the same text, so the same key
    assert Plan.from_json(off.to_json()) == off
    rp = off.regions[0]
    assert plan.replace(rp).graph and plan.add(rp).graph  # a region's edit keeps the plan's graph


def test_capture_graph_is_offered_once_where_the_plan_has_no_graph(tmp_path):
    low, _ = analyse(_deep(tmp_path))
    plain = base_plan(low, False)
    edits = legal_edits(plain, low, suggested=[GRAPH_EDIT])
    assert edits[0] == (GRAPH_EDIT, plain.with_graph(True))  # suggested by launch_overhead: first
    assert sum(label == GRAPH_EDIT for label, _ in edits) == 1
    assert all(label != GRAPH_EDIT for label, _ in legal_edits(plain.with_graph(True), low))
    # the repair plan drops a graph the parent did not have, keeps one it had
    assert (
        not safer(plain.with_graph(True), plain).graph
        and safer(plain.with_graph(True), plain.with_graph(True)).graph
    )


def test_the_graphed_launcher_passes_the_static_check_as_the_same_kind(tmp_path):
    cand = tuned(_deep(tmp_path))
    assert plan_of(cand.source).graph
    forward, body = cand.launcher.split("    def forward(self, x):\n", 1)[1].split(
        "    def _kp_forward(self, x):\n"
    )
    assert forward.strip().startswith("return kernels.graphed(self, self._kp_forward, (x,))")
    assert "= _r_softmax_5(self.sms, " in body  # the launch helpers, called from the body
    report = check_launcher(cand.launcher)
    assert report.ok and report.kind is Kind.CUSTOM, report.violations
    assert (
        check_launcher(
            cand.launcher.replace("kernels.graphed(self, self._kp_forward, (x,))", "self._kp_forward(x)")
        ).kernels_used
        == report.kernels_used
    )


GRAPHED_BY_HAND = """
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x, y):
        return kernels.graphed(self, self._body, (x, y))

    def _body(self, a, b):
        out = torch.empty_like(a)
        kernels.k((1,), (32,), (a, out))
        return out * b
"""


def test_the_static_check_reads_a_graphed_body_as_a_call_with_the_tensors_it_is_handed():
    """`a * b` in the body handed to graphed is a tensor product computed by PyTorch: the launcher is hybrid,
    as it would be with the body called directly (its parameters are known tensors only through the call)."""
    report = check_launcher(GRAPHED_BY_HAND)
    assert report.ok, report.violations
    assert report.kind is Kind.HYBRID and "mul (*)" in report.library_ops, report.library_ops
    assert report.kernels_used == ("k",)
    bare = GRAPHED_BY_HAND.replace("kernels.graphed(self, self._body, (x, y))", "self._body(x, y)")
    assert check_launcher(bare).library_ops == report.library_ops


@needs_gxx
def test_the_graphed_launcher_matches_the_reference_emulated(tmp_path):
    from cuda_emulator import build, load_model

    path = _deep(tmp_path)
    cand = tuned(path)
    module = load_module(path)
    torch.manual_seed(5)
    ref = module.Model()
    kernels = build(cand.source, tmp_path)
    model = load_model(cand.launcher, kernels, sms=4)()
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for _ in range(2):
            x = module.get_inputs()[0]
            torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)
    assert kernels.graph_calls == 2


def test_the_graphs_see_a_weight_moved_or_replaced_and_key_their_argument_forms():
    """runtime.Graphs' bookkeeping, which needs no GPU: a weight changed in place keeps the graphs, one whose
    storage moved or that was replaced (and freed) drops them; a form is every tensor's shape, strides,
    dtype and device and every other argument's value, and nothing graphs a CPU tensor or one needing
    gradients."""
    from pipeline.runtime import Graphs, _copies, _form_key

    m = torch.nn.Linear(4, 4)
    g = Graphs(m)
    assert not g._state_moved() and not g._state_moved()  # recorded, then unchanged
    with torch.no_grad():
        m.bias.mul_(2)  # in place: the same storage
    assert not g._state_moved()
    m.weight.data = torch.randn(4, 4)
    assert g._state_moved() and not g._state_moved()  # moved once, then recorded anew
    m.weight = torch.nn.Parameter(torch.randn(4, 4))  # replaced: the old one is freed
    assert g._state_moved()
    assert _form_key((torch.randn(3),)) is None  # a CPU tensor
    assert _form_key((1, 2.5, None, "a")) == ((int, 1), (float, 2.5), (type(None), None), (str, "a"))
    assert _form_key(([1],)) is None  # not a plain value
    x = torch.randn(2, 3)
    y, (z,) = _copies((x, [x]))
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr() and z.data_ptr() != x.data_ptr()
