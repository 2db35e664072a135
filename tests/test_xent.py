"""Cross-entropy and NLL in one pass over the logits (families/xent.py): in the CPU emulator against float64
eager for each reduction, with label smoothing, class weights, ignored targets (all of them: NaN, as eager),
rows of a multiple of 4 (float4 loads) and not, more rows than a block's warps, and (N, C, d...) scores a
thread a position; compiled for sm_90a."""

from __future__ import annotations

import pytest
from test_expert import _emulate, needs_nvcc, task_file
from test_expert_decompose import needs_gxx

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, supports
from pipeline.static_check import check_launcher
from pipeline.tasks import probe
from pipeline.types import Kind, Status

torch = pytest.importorskip("torch")

BODY = """class Model(nn.Module):
    def forward(self, x, t):
        return (F.cross_entropy(x, t), F.cross_entropy(x, t.clamp(min=0), reduction="sum", ignore_index=1),
                F.cross_entropy(x, t, reduction="none"), F.nll_loss(F.log_softmax(x, 1), t),
                F.cross_entropy(x, t, label_smoothing=0.15), F.cross_entropy(x, t, reduction="none",
                label_smoothing=1.0), F.cross_entropy(x, t, reduction="sum", label_smoothing=0.3))"""


def _path(tmp_path, rows: int, classes: int):
    inputs = (f"[torch.randn({rows}, {classes}) * 3, torch.where(torch.rand({rows}) < 0.2, -100, "
              f"torch.randint(0, {classes}, ({rows},)))]")  # fmt: skip
    return task_file(tmp_path, f"xent_{rows}_{classes}", BODY, inputs)


def _candidates(path):
    task = probe(path)
    return [
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    ]


@needs_gxx
@pytest.mark.parametrize(("rows", "classes"), [(37, 301), (70, 64), (3, 5)])
def test_emulated_fused_losses_match_eager(tmp_path, rows, classes):
    path = _path(tmp_path, rows, classes)
    ok, why = supports(path)
    assert ok and "xent" in why, why
    cands = _candidates(path)
    launched = _emulate(path, cands, 1e-5)
    assert any(k.endswith(("_rows", "_rows4")) for k in launched) and any(
        k.endswith("_total") for k in launched
    )
    assert ("_rows4" in " ".join(launched)) == (classes % 4 == 0), launched  # the tuned plan's float4 kernel
    for c in cands:  # nothing but the model's own clamp of its targets is PyTorch's (a clone of misaligned
        report = check_launcher(c.launcher)  # logits was, once)
        assert report.ok and set(report.library_ops) == {"torch.ops.aten.clamp.default"}, (c.edit, report)


@needs_gxx
def test_every_target_ignored_gives_nan_as_eager(tmp_path):
    from cuda_emulator import build, load_model

    body = "class Model(nn.Module):\n    def forward(self, x, t):\n        return F.cross_entropy(x, t)"
    path = task_file(tmp_path, "ignored", body, "[torch.randn(9, 12), torch.full((9,), -100)]")
    for cand in _candidates(path):
        assert check_launcher(cand.launcher).kind is Kind.CUSTOM, cand.edit  # a plain loss: all ours
        model = load_model(cand.launcher, build(cand.source), sms=4)()
        assert torch.isnan(model(torch.randn(9, 12), torch.full((9,), -100))), cand.edit


WEIGHTED = """class Model(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.register_buffer("w", torch.rand(classes) + 0.25)
    def forward(self, x, t, s, u):
        return (F.cross_entropy(x, t, weight=self.w), F.cross_entropy(x, t, weight=self.w, reduction="none"),
                F.nll_loss(F.log_softmax(x, 1), t, weight=self.w, reduction="sum"),
                F.cross_entropy(s, u), F.cross_entropy(s, u, weight=self.w, reduction="none"),
                F.cross_entropy(s[:, :, 1:], u[:, 1:], label_smoothing=0.2, reduction="sum"),
                F.nll_loss(F.log_softmax(s, 1), u, weight=self.w))"""


@needs_gxx
@pytest.mark.parametrize(("rows", "classes"), [(37, 13), (5, 8)])
def test_emulated_weighted_and_spatial_losses_match_eager(tmp_path, rows, classes):
    """Class weights (a weighted mean divides by the kept targets' weights), and (N, C, d...) scores with
    (N, d...) targets, a thread a position: against float64 eager."""
    tgt = f"torch.where(torch.rand({{0}}) < 0.2, -100, torch.randint(0, {classes}, {{0}}))"
    inputs = (f"[torch.randn({rows}, {classes}) * 3, {tgt.format(f'({rows},)')}, "
              f"torch.randn(3, {classes}, 7, 5) * 3, {tgt.format('(3, 7, 5)')}]")  # fmt: skip
    path = task_file(tmp_path, f"weighted_{rows}", WEIGHTED, inputs, f"[{classes}]")
    ok, why = supports(path)
    assert ok and "xent" in why and "left to PyTorch" not in why, why
    cands = _candidates(path)
    launched = _emulate(path, cands, 1e-5)
    assert any(k.endswith("_cols") for k in launched) and any(
        k.endswith(("_rows", "_rows4")) for k in launched
    )
    for c in cands:
        assert check_launcher(c.launcher).kind is Kind.CUSTOM, c.edit


def test_weights_with_label_smoothing_stay_with_pytorch(tmp_path):
    body = ("class Model(nn.Module):\n    def forward(self, x, t, w):\n"
            "        return F.cross_entropy(x, t, weight=w, label_smoothing=0.1) * 2")  # fmt: skip
    path = task_file(
        tmp_path, "smooth", body, "[torch.randn(8, 10), torch.randint(0, 10, (8,)), torch.rand(10)]"
    )
    ok, why = supports(path)
    assert ok and "left to PyTorch (xent: label smoothing with class weights)" in why, why


@needs_nvcc
def test_loss_kernels_compile_for_sm90a_without_spills(tmp_path):
    weighted = task_file(tmp_path, "weighted", WEIGHTED, "[torch.randn(64, 1000), torch.randint(0, 1000, (64,)), "
                         "torch.randn(8, 1000, 16, 16), torch.randint(0, 1000, (8, 16, 16))]", "[1000]")  # fmt: skip
    cands = [
        *_candidates(_path(tmp_path, 4096, 32000)),
        *_candidates(_path(tmp_path, 5, 10)),
        *_candidates(weighted),
    ]
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status == Status.OK and not b.log, (c.edit, b.log)
        ours = [
            r for r in b.resources if r.name.endswith(("_rows", "_cols", "_total"))
        ]  # the log-softmax is not ours here
        assert ours and all(r.spill_stores == 0 for r in ours), (c.edit, ours)
