"""Interpolation (F.interpolate, nn.Upsample) and adaptive average pooling whose windows do not tile the
input, as our own kernel (families/resample.py): written where they were left to PyTorch; in the CPU emulator nearest and nearest-exact pick eager's very elements (fractional and
integer scales, given sizes) and linear, bilinear, trilinear and bicubic blend within fp32 rounding of eager, with and
without align_corners, in fp32 and bf16, and adaptive windows average within rounding; compiled for
sm_90a."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_expert import _emulate, needs_nvcc, task_file
from test_expert_decompose import needs_gxx

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, supports
from pipeline.tasks import probe
from pipeline.types import Status

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent

# name -> (forward's body, inputs, whether every output is an exact pick of input elements)
CASES = {
    "nearest": (
        "return (F.interpolate(x, scale_factor=2), F.interpolate(x, scale_factor=1.7), F.interpolate(x, size=(5, 21)),"
        " F.interpolate(x, scale_factor=(3, 0.5), mode='nearest-exact'), nn.Upsample(size=(9, 9))(x.mT))",
        "[torch.randn(2, 3, 7, 10)]",
        True,
    ),
    "nearest_1d_3d": (
        "return F.interpolate(x, scale_factor=2.5), F.interpolate(x.view(2, 3, 2, 5, 2), size=(3, 7, 5))",
        "[torch.randn(2, 3, 20)]",
        True,
    ),
    "bilinear": (
        "return (F.interpolate(x, scale_factor=2, mode='bilinear'), F.interpolate(x, scale_factor=1.3,"
        " mode='bilinear', align_corners=True), F.interpolate(x, size=(4, 25), mode='bilinear'),"
        " F.interpolate(x, size=(1, 1), mode='bilinear', align_corners=True) * 2)",
        "[torch.randn(2, 3, 7, 10)]",
        False,
    ),
    "linear_trilinear": (
        "return (F.interpolate(x, scale_factor=3, mode='linear'), F.interpolate(x.view(2, 3, 4, 5, 1),"
        " size=(6, 3, 4), mode='trilinear', align_corners=True), F.interpolate(x, size=11, mode='linear'))",
        "[torch.randn(2, 3, 20)]",
        False,
    ),
    "adaptive_avg": (  # windows that do not tile the input (area interpolation is this pool)
        "return (F.adaptive_avg_pool2d(x, (3, 5)), F.adaptive_avg_pool1d(x[:, :, 0], 7),"
        " F.adaptive_avg_pool3d(x.unsqueeze(1), (2, 3, 4)), F.interpolate(x, size=(4, 6), mode='area'))",
        "[torch.randn(2, 3, 7, 11)]",
        False,
    ),
    "adaptive_max": (  # values and indices in the plane; a NaN wins its window (the last one), as eager's
        "x = torch.where(x > 2.0, float('nan'), x)\n        v, i = F.adaptive_max_pool2d(x, (3, 5), return_indices=True)\n"
        "        return v, i, F.adaptive_max_pool1d(x[:, :, 0], 4), nn.AdaptiveMaxPool3d((2, 2, 3))(x.unsqueeze(1))",
        "[torch.randn(2, 3, 7, 11)]",
        True,
    ),
    "bicubic": (  # Keys' cubic convolution over 4 x 4 taps clamped into the input, both corner conventions
        "return (F.interpolate(x, scale_factor=2, mode='bicubic'), F.interpolate(x, size=(5, 13), mode='bicubic',"
        " align_corners=True), F.interpolate(x, scale_factor=0.6, mode='bicubic'))",
        "[torch.randn(2, 3, 7, 9)]",
        False,
    ),
    "bilinear_bf16": (
        "return F.interpolate(x, scale_factor=2, mode='bilinear'), F.interpolate(x, scale_factor=0.6)",
        "[torch.randn(2, 4, 9, 8, dtype=torch.bfloat16)]",
        False,
    ),
}


def _path(tmp_path, name: str):
    body, inputs, _ = CASES[name]
    return task_file(
        tmp_path, name, f"class Model(nn.Module):\n    def forward(self, x):\n        {body}", inputs
    )


def _candidates(path):
    task = probe(path)
    return [
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    ]


@needs_gxx
@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_interpolation_matches_eager(tmp_path, name):
    from cuda_emulator import build, load_model
    from fuzz_expert import as_tuple, reference

    path = _path(tmp_path, name)
    ok, why = supports(path)
    assert ok and "resample" in why and "left to PyTorch" not in why, why
    exact = CASES[name][2]
    r = reference(path, None)
    for cand in _candidates(path):
        kernels = build(cand.source)
        model = load_model(cand.launcher, kernels, sms=8)(*r.module.get_init_inputs())
        with torch.no_grad():
            out = as_tuple(model(*r.inputs))
        assert any(k.endswith("_resample32") for k, *_ in kernels.launches)  # small: 32-bit indices
        for i, (o, n) in enumerate(zip(out, r.native, strict=True)):
            assert o.shape == n.shape and o.dtype == n.dtype, (cand.edit, i, o.shape, n.shape)
            if exact:  # the same elements eager picks
                assert torch.equal(o.nan_to_num(9.0), n.nan_to_num(9.0)), (cand.edit, i)
            else:  # blends differ from eager's by the order of their roundings (bf16: one bf16 rounding)
                tol = 1e-2 if o.dtype == torch.bfloat16 else 1e-5
                assert torch.allclose(o.float(), n.float(), rtol=tol, atol=tol), (cand.edit, i)


@pytest.mark.parametrize(
    "expr",
    [
        "F.interpolate(x, scale_factor=2, mode='bilinear', antialias=True)",
    ],
)
def test_other_modes_stay_with_pytorch(tmp_path, expr):
    body = f"class Model(nn.Module):\n    def forward(self, x):\n        return {expr} * 2"
    ok, why = supports(task_file(tmp_path, "kept", body, "[torch.randn(2, 3, 8, 8)]"))
    assert ok and "left to PyTorch" in why and "resample" not in why, why


@needs_gxx
def test_antialiased_interpolation_is_left_to_pytorch_by_its_public_call(tmp_path):
    """aten._upsample_bilinear2d_aa is private (the launcher's check bars it): the launcher calls
    F.interpolate(antialias=True) instead, and the task is written (it was refused)."""
    body = ("class Model(nn.Module):\n    def forward(self, x):\n"
            "        return F.interpolate(x, scale_factor=0.5, mode='bilinear', antialias=True) * 2")  # fmt: skip
    path = task_file(tmp_path, "aa", body, "[torch.randn(2, 3, 9, 12)]")
    ok, why = supports(path)
    assert ok and "_upsample_bilinear2d_aa.vec left to PyTorch" in why, why
    _emulate(path, _candidates(path), 1e-6)


@needs_nvcc
def test_interpolation_kernels_compile_for_sm90a_without_spills(tmp_path):
    names = (
        "nearest",
        "bilinear",
        "bicubic",
        "linear_trilinear",
        "bilinear_bf16",
        "adaptive_avg",
        "adaptive_max",
    )
    cands = [c for name in names for c in _candidates(_path(tmp_path, name))]
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status == Status.OK and not b.log, (c.edit, b.log)
        assert all(r.spill_stores == 0 for r in b.resources), (c.edit, b.resources)


def test_the_resample_suite_is_written_by_our_kernel_alone():
    """tasks/resample (the suite a GPU bench times against eager and torch.compile): every task ours."""
    paths = sorted((ROOT / "tasks" / "resample").glob("*.py"))
    assert len(paths) == 3
    for path in paths:
        ok, why = supports(path)
        assert ok and "resample" in why and "left to PyTorch" not in why, (path.name, why)


@needs_gxx
def test_the_64_bit_index_kernel_computes_the_same_outputs(tmp_path):
    """Outputs of 2^31 elements or more take the 64-bit index kernel: the same body at another index type,
    run here directly on a small output, element for element equal to the 32-bit one."""
    import numpy
    from cuda_emulator import build

    path = _path(tmp_path, "bilinear_bf16")
    tuned = _candidates(path)[1]
    kernels = build(tuned.source)
    name = "kp_upsample_bilinear2d_resample"  # the case's first output: bilinear x2
    assert f"{name}32(" in tuned.source
    x = torch.randn(2, 4, 9, 8, dtype=torch.bfloat16)
    outs = []
    for k in (name, name + "32"):
        y = torch.empty(2, 4, 18, 16, dtype=torch.bfloat16)
        getattr(kernels, k)((3,), (256,), (x, y, numpy.int64(y.numel())))
        outs.append(y)
    ref = torch.nn.functional.interpolate(x.float(), scale_factor=2, mode="bilinear")
    assert torch.equal(outs[0], outs[1]) and torch.allclose(outs[0].float(), ref, rtol=1e-2, atol=1e-2)
