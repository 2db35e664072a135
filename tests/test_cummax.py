"""cummax and cummin as scans of 64-bit keys (templates/scan.py, ops.KEYED_SCANS): their values and indices as
PyTorch gives them, ties to the later position, a NaN from where it appears, signed zeros equal; along the
last dim (chunked rows, staged or not) and another (the column walk); with an elementwise prologue fused.
Only the half of a pair that is read is computed."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from test_expert import task_file
from test_expert_decompose import needs_gxx

from pipeline.generate.base import Context, ProposalStatus
from pipeline.generate.expert import ExpertPolicy, supports
from pipeline.generate.expert.plan import plan_of
from pipeline.generate.expert.policy import analyse
from pipeline.tasks import probe

torch = pytest.importorskip("torch")

BOTH = """class Model(nn.Module):
    def forward(self, x):
        a, i = torch.cummax(x, dim=-1)
        return a, i, torch.cummin(x, dim=0).values, torch.cummin(x * 2.0, dim=0).indices"""


def _awkward(rows: int, cols: int) -> torch.Tensor:
    """Few distinct values (ties everywhere), both zeros, NaN in some rows, infinities."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-3, 4, (rows, cols), generator=g).float()
    x[0, 3] = -0.0
    x[1, 50:] = float("nan")
    x[2, 10] = float("nan")
    x[2, 400] = float("nan")
    x[3, 5] = float("inf")
    x[4, 7] = -float("inf")
    x[:, 21] = float("nan")
    x[5] = torch.randn(cols, generator=g)
    return x


def test_the_pair_is_lowered_to_two_scans_and_written():
    path = task_file(Path(tempfile.mkdtemp()), "cm", BOTH, "[torch.randn(6, 520)]")
    low, why = analyse(path)
    assert low is not None, why
    scans = sorted(n.op for r in low.regions for n in r.nodes if r.kind.value == "scan")
    assert scans == ["cummax", "cummax_index", "cummin", "cummin_index"]  # the dead cummin(x * 2) values gone
    ok, why = supports(path)
    assert ok and "left to PyTorch" not in why, why


@needs_gxx
def test_cummax_and_cummin_match_pytorch_on_ties_nans_and_zeros():
    from cuda_emulator import build, load_model

    path = task_file(Path(tempfile.mkdtemp()), "cm", BOTH, "[torch.randn(6, 520)]")
    x = _awkward(6, 520)
    want = (*torch.cummax(x, -1), *torch.cummin(x, 0))
    task = probe(path)
    policy = ExpertPolicy()
    first = policy.propose(Context(task=task, reference=task.source, parent=None), 2)
    staged = [
        p
        for p in policy.propose(Context(task=task, reference=task.source, parent=first[1].candidate), 12)
        if p.status == ProposalStatus.OK and "tile_shared_memory" in (p.candidate.edit or "")
    ]
    cands = [p.candidate for p in (*first, *staged[:1])]
    assert staged and any(getattr(rp, "prologue", "") for c in cands for rp in plan_of(c.source).regions)
    for c in cands:
        model = load_model(c.launcher, build(c.source), sms=8)()
        with torch.no_grad():
            got = model(x)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, c.edit
            if w.dtype == torch.int64:
                assert torch.equal(g, w), (c.edit, (g != w).nonzero()[:5])
            else:
                torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_the_keyed_scans_compile_for_sm_90a_without_spills(tmp_path):
    from pipeline.compile import ToolchainError, compile_candidates, find_nvcc
    from pipeline.config import Config
    from pipeline.types import Status

    try:
        find_nvcc(Config())
    except ToolchainError:
        pytest.skip("no nvcc on this machine")
    path = task_file(tmp_path, "cm", BOTH, "[torch.randn(6, 520)]")
    task = probe(path)
    cands = [
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    ]
    for b in compile_candidates(cands, Config(home=tmp_path, arch="sm_90a")):
        assert b.status == Status.OK, b.log[-2000:]
        assert b.resources and all(r.spill_stores == 0 for r in b.resources), b.resources
