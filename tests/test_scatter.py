"""Scatters as our kernels (families/scatter.py): scatter_add, scatter_reduce(sum), index_add (alpha too),
index_put accumulating or not (and `y[rows] += v`, which PyTorch decomposes into one), where they were left
to PyTorch. In the CPU emulator they give eager's values with repeated destinations, along dim 0 and an inner
dim, negative index_put rows counted from the end; declined forms say why; compiled for sm_90a without
spills."""

from __future__ import annotations

import pytest
from test_expert import needs_nvcc, task_file
from test_expert_decompose import needs_gxx

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, supports
from pipeline.tasks import load_module, probe
from pipeline.types import Status

torch = pytest.importorskip("torch")

BODY = """class Model(nn.Module):
    def forward(self, x, idx, src, rows, v, once, signed):
        y = x.clone()
        y[once] += v[:5]
        return (x.scatter_add(1, idx, src), torch.scatter_reduce(x.t().contiguous(), 0, idx.t(), src.t(), reduce="sum"),
                x.index_add(0, rows, v, alpha=0.5), x.index_add(1, idx[0, :7], src[:, :7]),
                x.index_put((signed,), v, accumulate=True), y)"""

INPUTS = (
    "[torch.randn(9, 40), torch.randint(0, 40, (9, 70)), torch.randn(9, 70), torch.randint(0, 9, (12,)), "
    "torch.randn(12, 40), torch.randperm(9)[:5], torch.randint(-9, 9, (12,))]"
)


def _inputs() -> tuple:
    g = torch.Generator().manual_seed(2)
    x, src = torch.randn(9, 40, generator=g), torch.randn(9, 70, generator=g)
    idx = torch.randint(0, 40, (9, 70), generator=g)
    idx[:, :10] = 3  # one destination taken by many
    signed = torch.randint(-9, 9, (12,), generator=g)  # index_put counts a negative row from the end
    signed[:4] = 2
    once = torch.randperm(9, generator=g)[:5]
    return x, idx, src, signed.clamp(min=0), torch.randn(12, 40, generator=g), once, signed


def test_each_scatter_is_ours_and_the_declined_say_why(tmp_path):
    ok, why = supports(task_file(tmp_path, "scatters", BODY, INPUTS))
    assert ok and "scatter" in why and "left to PyTorch" not in why, why
    body = (
        "class Model(nn.Module):\n    def forward(self, x, idx, src):\n"
        "        return torch.scatter_reduce(x, 1, idx, src, reduce='amax'), x.scatter_add(1, idx[:, :3], src)"
    )
    ok, why = supports(task_file(tmp_path, "amax", body, "[torch.randn(4, 8), torch.randint(0, 8, (4, 5)), "
                                 "torch.randn(4, 5)]"))  # fmt: skip
    assert "aten.scatter_reduce.two left to PyTorch (scatter: a reduce other than a sum" in why, why
    assert "aten.scatter_add.default left to PyTorch (scatter: an index of shape" in why, why


@needs_gxx
def test_emulated_scatters_match_eager_with_repeated_destinations(tmp_path):
    from cuda_emulator import build, load_model

    path = task_file(tmp_path, "scatters", BODY, INPUTS)
    x, idx, src, rows, v, once, signed = _inputs()
    model = load_module(path).Model()
    with torch.no_grad():
        want = model(x, idx, src, rows, v, once, signed)
    task = probe(path)
    for cand in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2):
        kernels = build(cand.candidate.source)
        ours = load_model(cand.candidate.launcher, kernels, sms=3)()
        with torch.no_grad():
            got = ours(x, idx, src, rows, v, once, signed)
        for i, (o, e) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(o, e, rtol=1e-6, atol=1e-5, msg=f"{cand.candidate.edit} output {i}")
        assert sum(k.endswith("_scatter") for k, *_ in kernels.launches) == 6


@needs_nvcc
def test_scatter_kernels_compile_for_sm90a_without_spills(tmp_path):
    task = probe(task_file(tmp_path, "scatters", BODY, INPUTS))
    cands = [
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    ]
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status == Status.OK and not b.log, (c.edit, b.log)
        assert all(r.spill_stores == 0 for r in b.resources), (c.edit, b.resources)
