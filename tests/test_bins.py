"""Binning as our kernels (families/bins.py): torch.histc over a constant range and bucketize / searchsorted,
where they were left to PyTorch. In the CPU emulator the counts are eager's (values on the bins' edges, on
min and max, NaN, infinities and values outside the range included) under every shared-memory form, and
the positions are eager's to the element (ties with a boundary on either side, NaN past the end, N-D rows,
int32 output, integer boundaries); compiled for sm_90a without spills."""

from __future__ import annotations

import pytest
from test_expert import needs_nvcc, task_file
from test_expert_decompose import needs_gxx

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context, ProposalStatus
from pipeline.generate.expert import ExpertPolicy, supports
from pipeline.generate.expert.plan import plan_of
from pipeline.tasks import load_module, probe
from pipeline.types import Status

torch = pytest.importorskip("torch")

HISTC = """class Model(nn.Module):
    def forward(self, x):
        return torch.histc(x, bins=37, min=-2, max=2.5), torch.histc(x * 3.0, bins=5, min=0.1, max=1.7)"""

SEARCH = """class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("edges", torch.linspace(-2.0, 2.0, 41))
        self.register_buffer("steps", torch.arange(-3, 4))
    def forward(self, x, rows):
        return (torch.bucketize(x, self.edges), torch.bucketize(x, self.edges, right=True),
                torch.searchsorted(self.edges, x, side="right", out_int32=True),
                torch.searchsorted(rows, x), torch.bucketize(x.to(torch.bfloat16), self.steps).float() * 0.5)"""


def _edgy(rows: int, cols: int, lo: float, hi: float, bins: int) -> torch.Tensor:
    """Random values, then every bin edge as fp32 computes it, min and max, NaN, infinities and values just
    outside the range."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, cols, generator=g) * 1.5
    flat = x.view(-1)
    edges = torch.tensor([lo + k * (hi - lo) / bins for k in range(bins + 1)], dtype=torch.float32)
    flat[: edges.numel()] = edges
    special = [lo, hi, float("nan"), float("inf"), -float("inf"), lo - 1e-6, hi + 1e-6, -0.0, 0.0]
    flat[edges.numel() : edges.numel() + len(special)] = torch.tensor(special)
    return x


def _candidates(path, edit: str = ""):
    """The plain and tuned first candidates, then each child of the tuned one by `edit`."""
    task = probe(path)
    policy = ExpertPolicy()
    first = [p.candidate for p in policy.propose(Context(task=task, reference=task.source, parent=None), 2)]
    if not edit:
        return first
    kids = policy.propose(Context(task=task, reference=task.source, parent=first[1]), 16)
    return first + [
        p.candidate for p in kids if p.status == ProposalStatus.OK and edit in (p.candidate.edit or "")
    ]


def _run(cand, *inputs, state=None):
    from cuda_emulator import build, load_model

    kernels = build(cand.source)
    model = load_model(cand.launcher, kernels, sms=3)()
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        out = model(*inputs)
    return out, kernels


@needs_gxx
def test_emulated_histc_counts_match_eagers_on_edges_nans_and_outside_values(tmp_path):
    path = task_file(tmp_path, "histc", HISTC, "[torch.randn(7, 300)]")
    ok, why = supports(path)
    assert ok and "bins" in why and "left to PyTorch" not in why, why
    x = _edgy(7, 300, -2.0, 2.5, 37)
    want = (torch.histc(x, 37, -2, 2.5), torch.histc(x * 3.0, 5, 0.1, 1.7))
    assert want[0].sum() < x.numel()  # some values were dropped: the NaN, the infinities, the outside ones
    cands = _candidates(path, "tile_shared_memory")
    forms = {(rp.shared, rp.copies) for c in cands for rp in plan_of(c.source).regions if rp.TAG == "bins"}
    assert {(True, 1), (True, 2), (False, 1)} <= forms, forms
    for c in cands:
        got, kernels = _run(c, x)
        assert any("_histc" in k for k, *_ in kernels.launches)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), (c.edit, (g - w).nonzero()[:5], g, w)


@needs_gxx
def test_emulated_histc_of_a_misaligned_view_takes_the_scalar_kernel(tmp_path):
    body = "class Model(nn.Module):\n    def forward(self, x):\n        return torch.histc(x[1:], bins=11, min=-1, max=1)"
    path = task_file(tmp_path, "histc_view", body, "[torch.randn(1001)]")
    x = torch.randn(1001, generator=torch.Generator().manual_seed(5))
    for c in _candidates(path):
        got, kernels = _run(c, x)
        assert torch.equal(got, torch.histc(x[1:], 11, -1, 1)), c.edit
        assert any(
            k.endswith("_histc") for k, *_ in kernels.launches
        )  # the 16-byte form needs an aligned start


@needs_gxx
def test_emulated_searches_match_eagers_positions(tmp_path):
    path = task_file(
        tmp_path, "search", SEARCH, "[torch.randn(6, 70), torch.sort(torch.randn(6, 9), -1).values]"
    )
    ok, why = supports(path)
    assert ok and "bins" in why and "left to PyTorch" not in why, why
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 70, generator=g) * 2
    x[0, :41] = torch.linspace(-2.0, 2.0, 41)  # on every boundary: left and right differ here
    x[1, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    x[2, :7] = torch.arange(-3, 4).float()
    rows = torch.sort(torch.randn(6, 9, generator=g), -1).values
    rows[3, 4] = rows[3, 5]  # a repeated boundary
    model = load_module(path).Model()
    with torch.no_grad():
        want = model(x, rows)
    cands = _candidates(path, "tile_shared_memory")
    assert any(not rp.shared for c in cands for rp in plan_of(c.source).regions if rp.TAG == "bins")
    for c in cands:
        got, kernels = _run(c, x, rows, state=model.state_dict())
        assert any(k.endswith("_search") for k, *_ in kernels.launches)
        for i, (o, w) in enumerate(zip(got, want, strict=True)):
            assert o.dtype == w.dtype and torch.equal(o, w), (c.edit, i, (o != w).nonzero()[:5])


def test_a_histogram_over_the_datas_own_range_stays_with_pytorch(tmp_path):
    body = "class Model(nn.Module):\n    def forward(self, x):\n        return torch.histc(x, bins=10)"
    ok, why = supports(task_file(tmp_path, "own_range", body, "[torch.randn(4, 50)]"))
    assert not ok and "aten.histc.default left to PyTorch (bins: the range [0, 0] is empty" in why, why


@needs_nvcc
def test_binning_kernels_compile_for_sm90a_without_spills(tmp_path):
    cands = _candidates(task_file(tmp_path, "histc", HISTC, "[torch.randn(64, 4096)]"), "tile_shared_memory")
    cands += _candidates(task_file(tmp_path, "search", SEARCH, "[torch.randn(6, 70), torch.randn(6, 9)]"))
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status == Status.OK and not b.log, (c.edit, b.log)
        assert all(r.spill_stores == 0 for r in b.resources), (c.edit, b.resources)
