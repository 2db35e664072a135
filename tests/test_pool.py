"""Max and average pooling on the CUDA cores (families/pool.py, templates/pool.py) on the CPU: which pools the
family takes, its kernels run by the CUDA emulator against PyTorch's pools (1-D to 3-D, strides, padding,
dilation, ceil mode, count_include_pad, divisor override, NaN), compiled for sm_90a without spills
(tests/test_gpu_expert.py runs them on the GPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from cuda_emulator import build, load_model
from expert_plans import tuned, tuned_with_edit

from pipeline.candidates import make_candidate
from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, capture, plan_of, supports
from pipeline.generate.expert.families import pool
from pipeline.generate.expert.render import nvcc_flags, prepare, render
from pipeline.tasks import load_module, probe
from pipeline.types import Status

HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"
POOLS = {  # name -> (module, input shape, dtype)
    "max1d_dilated": ("nn.MaxPool1d(8, stride=1, padding=4, dilation=3)", "2, 3, 61", "float32"),
    "max2d": ("nn.MaxPool2d(4, stride=1, padding=1)", "2, 3, 17, 19", "float32"),
    "max3d_ceil": ("nn.MaxPool3d(3, stride=2, padding=1, dilation=2, ceil_mode=True)", "2, 2, 9, 10, 11", "float32"),
    "max2d_rect_f16": ("nn.MaxPool2d((2, 3), stride=(2, 1))", "3, 12, 21", "float16"),
    "avg1d": ("nn.AvgPool1d(8, stride=1, padding=4)", "2, 3, 50", "float32"),
    "avg2d_default_stride": ("nn.AvgPool2d(5)", "2, 3, 23, 17", "float32"),
    "avg2d_no_pad_count": ("nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)",
                           "2, 3, 14, 15", "float32"),
    "avg3d_divisor": ("nn.AvgPool3d(3, stride=2, padding=1, divisor_override=7)", "1, 2, 9, 10, 11", "bfloat16"),
}  # fmt: skip


def _task(folder: Path, name: str, shape: str = "") -> Path:
    mod, default, dt = POOLS[name]
    shape = shape or default
    path = folder / f"{name}.py"
    path.write_text(
        HEADER + "class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        f"        self.p = {mod}\n\n    def forward(self, x):\n        return self.p(x)\n\n\n"
        f"def get_inputs():\n    return [torch.randn({shape}, dtype=torch.{dt})]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    return path


def _region(path: Path) -> tuple:
    low = prepare(capture(path))
    (r,) = [r for r in low.regions if pool.FAMILY.claims(r, low)]
    return r, low


def _candidates(path: Path) -> list:
    t = probe(path)
    policy = ExpertPolicy()
    first = [p.candidate for p in policy.propose(Context(task=t, reference=t.source, parent=None), 2)]
    kids = policy.propose(Context(task=t, reference=t.source, parent=first[-1]), 1)
    return first + [k.candidate for k in kids if k.candidate]


@pytest.mark.parametrize("name", sorted(POOLS))
def test_the_family_takes_pools(tmp_path, name):
    low = prepare(capture(_task(tmp_path, name)))
    assert len([r for r in low.regions if pool.FAMILY.claims(r, low)]) == 1
    ok, why = supports(_task(tmp_path, name))
    assert ok, why


def test_a_pool_that_returns_indices_stays_in_pytorch(tmp_path):
    path = tmp_path / "idx.py"
    path.write_text(
        HEADER + "class Model(nn.Module):\n    def forward(self, x):\n"
        "        return F.max_pool2d(x, 3, return_indices=True)[0] * 2\n\n\n"
        "def get_inputs():\n    return [torch.randn(2, 3, 9, 9)]\n\n\ndef get_init_inputs():\n    return []\n"
    )
    low = prepare(capture(path))
    assert not any(pool.FAMILY.claims(r, low) for r in low.regions)
    assert any("max_pool2d_with_indices" in n for n in low.notes)


@pytest.mark.parametrize("name", sorted(POOLS))
def test_emulated_pools_match_pytorch(tmp_path, name):
    path = _task(tmp_path, name)
    module = load_module(path)
    torch.manual_seed(0)
    x = module.get_inputs()[0]
    x.view(-1)[5] = float("nan")  # max pooling propagates NaN, as PyTorch does
    want = module.Model()(x.float()).to(x.dtype)
    cands = _candidates(path)
    assert len(cands) == 3  # plain, tuned (four outputs a thread), an edit of it
    # where windows overlap vertically the tuned plan's thread takes a column of 4 rows of outputs too
    overlap = name in ("max2d", "max3d_ceil", "avg2d_no_pad_count", "avg3d_divisor")
    assert ("RO = 4" in cands[1].source) == overlap, name
    # where they overlap along W at stride 1, eight outputs a lane from a warp's staged window row
    slide = name in ("max1d_dilated", "max2d_rect_f16", "avg1d")
    (rp,) = plan_of(cands[1].source).regions
    assert (rp.stage and rp.outs == 8 and "WSPAN" in cands[1].source) == slide, (name, rp)
    for cand in cands:
        assert [rp.TAG for rp in plan_of(cand.source).regions] == ["pool"]
        model = load_model(cand.launcher, build(cand.source, tmp_path))()
        got = model(x)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got.isnan(), want.isnan()), cand.edit
        tol = 1e-6 if x.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True, msg=cand.edit)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, shape, knobs",
    [("max1d_dilated", "1, 2, 700", {}), ("avg1d", "2, 1, 530", {}), ("max2d", "1, 1, 9, 300", {"stage": True}),
     ("max2d_rect_f16", "1, 7, 263", {"outs": 2}), ("avg2d_no_pad_count", "1, 1, 11, 1100", {"stage": True, "rows": 2}),
     ("max3d_ceil", "1, 1, 5, 6, 600", {"stage": True, "outs": 2, "rows": 1, "threads": 64})],
)  # fmt: skip
def test_emulated_staged_pools_over_runs_of_several_warps(tmp_path, name, shape, knobs):
    """Rows longer than a warp's run of 32 * OUTS outputs: runs that start inside a row, a tail run, padding
    at both ends, a column of rows (max2d), two outputs a lane read without float4, strides of 2, several
    warps and blocks."""
    path = _task(tmp_path, name, shape)
    x = load_module(path).get_inputs()[0]
    want = load_module(path).Model()(x.float()).to(x.dtype)
    staged = tuned(path)
    if knobs:
        low, plan = prepare(capture(path)), plan_of(staged.source)
        plan = dataclasses.replace(plan, regions=(dataclasses.replace(plan.regions[0], **knobs),))
        source, launcher = render(low, plan)
        staged = make_candidate("t", source, launcher, nvcc_flags(plan))
    (rp,) = plan_of(staged.source).regions
    assert rp.stage and 32 * rp.outs < want.shape[-1], rp
    assert ("VEC = true" in staged.source) == (rp.outs * pool.form(*_region(path)).stride[2] % 4 == 0), rp
    got = load_model(staged.launcher, build(staged.source, tmp_path))()(x)
    tol = 1e-6 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_pools_compile_for_sm90a_without_spills(tmp_path):
    cands = [c for name in sorted(POOLS) for c in _candidates(_task(tmp_path, name))[:2]]
    cands += [
        tuned_with_edit(_task(tmp_path, name), "tile_shared_memory")
        for name in ("avg2d_no_pad_count", "avg3d_divisor")
    ]
    for b in compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a")):
        assert b.status == Status.OK and not b.log, b.log
        (k,) = [r for r in b.resources if r.name.endswith("_pool")]
        assert k.spill_stores == 0, k
