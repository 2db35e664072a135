"""use_intrinsics: an fp32 kernel's logs and exponentials by the special-function unit (lg2.approx,
ex2.approx: ops.FAST_CALL, templates/common.py ON_USE) where a libm polynomial an element makes it issue as
much as it moves (KernelBench's KL divergence: two logf an element, ~45 instructions). The edit is offered
only where such an op is computed (in an elementwise kernel, or fused into a row reduction); the emulator
computes the helpers exactly, so it checks the plumbing; the SASS shows the MUFU instructions and fewer
instructions overall; the accuracy is the GPU case's (tests/test_gpu_expert.py, `intrinsics`)."""

from __future__ import annotations

import pytest
from expert_plans import tuned, tuned_with_edit
from test_expert import _emulate, needs_nvcc, task_file
from test_expert_decompose import needs_gxx

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.expert import plan_of
from pipeline.generate.expert.edits import legal_edits
from pipeline.generate.expert.policy import analyse
from pipeline.profile.collect import dump_sass, parse_sass
from pipeline.static_check import check_launcher
from pipeline.types import Kind, Status

torch = pytest.importorskip("torch")

EW = """class Model(nn.Module):
    def forward(self, x):
        return (torch.log(x.abs() + 1e-3) + torch.exp(-x) * torch.sigmoid(x) + F.silu(x)
                + torch.log10(x.abs() + 1.0) + torch.log2(x.abs() + 2.0) + torch.exp2(x * 0.5))"""
KL = """class Model(nn.Module):
    def forward(self, p, t):
        return F.kl_div(torch.log(p), t, reduction="batchmean")"""
PLAIN = """class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2.0 + torch.sqrt(x.abs())"""


def _paths(tmp_path):
    ew = task_file(tmp_path, "ew_transcendentals", EW, "[torch.randn(37, 301) * 3]")
    kl = task_file(
        tmp_path, "kl_div", KL, "[torch.rand(33, 1001).softmax(-1), torch.rand(33, 1001).softmax(-1)]"
    )
    return ew, kl


def _offers(path) -> list[str]:
    low, why = analyse(path)
    assert low is not None, why
    return [
        label for label, _ in legal_edits(plan_of(tuned(path).source), low) if label.startswith("use_intr")
    ]


def test_the_edit_is_offered_only_where_a_log_or_exp_is_computed(tmp_path):
    ew, kl = _paths(tmp_path)
    assert len(_offers(ew)) == 1 and len(_offers(kl)) == 1  # the elementwise kernel; the KL's host reduction
    assert _offers(kl)[0].startswith("use_intrinsics(kl_div:")  # not its fused elementwise neighbour's entry
    assert _offers(task_file(tmp_path, "plain", PLAIN, "[torch.randn(37, 301)]")) == []


@needs_gxx
def test_intrinsic_candidates_render_and_match_in_the_emulator(tmp_path):
    for path, tol in zip(_paths(tmp_path), (1e-5, 1e-5), strict=True):
        cand = tuned_with_edit(path, "use_intrinsics")
        assert '"intrinsics":true' in cand.source.splitlines()[0]
        assert "logf(" not in cand.source.split("// region", 1)[1].split("extern", 1)[0]  # the chain's logs
        report = check_launcher(cand.launcher)
        assert report.ok and report.kind is Kind.CUSTOM, report.library_ops
        _emulate(path, [cand], tol)


@needs_nvcc
def test_intrinsics_put_the_logs_on_the_special_function_unit(tmp_path):
    """sm_90a SASS: MUFU.LG2 / MUFU.EX2 where the tuned kernel ran the libm polynomials, and fewer
    instructions (KL: two logf of ~30 instructions an element each become a MUFU and a multiply)."""
    ew, kl = _paths(tmp_path)
    cands = [c for p in (ew, kl) for c in (tuned(p), tuned_with_edit(p, "use_intrinsics"))]
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    counts = []
    for b in builds:
        assert b.status == Status.OK and not b.log, b.log
        sass = parse_sass(dump_sass(b.cubin_path) or "")
        main = [k for k in sass if k.endswith("_v4")]  # the 16-byte kernel of the elementwise / row region
        assert main, list(sass)
        ops = sass[main[0]].opcodes
        counts.append((sum(ops.values()), ops.get("MUFU.LG2", 0), ops.get("MUFU.EX2", 0)))
    (ew0, ew1, kl0, kl1) = counts
    assert ew1[1] > ew0[1] and ew1[2] >= ew0[2] and ew1[0] < ew0[0], (ew0, ew1)
    assert kl0[1] == 0 and kl1[1] >= 2 and kl1[0] < 0.7 * kl0[0], (kl0, kl1)
