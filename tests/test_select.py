"""Sorting and selection as our kernel (families/select.py): sort, argsort and topk along any dim of rows up
to 4096 long, written where they were left to PyTorch. In the CPU emulator the values are eager's to the
bit and the indices are the stable order's (NaN above +inf, -0.0 equal to +0.0, ties to the lower index);
compiled for sm_90a."""

from __future__ import annotations

import pytest
from test_expert import needs_nvcc, task_file
from test_expert_decompose import needs_gxx

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, supports
from pipeline.tasks import probe
from pipeline.types import Status

torch = pytest.importorskip("torch")

# Rows with ties (rounded to quarters), NaNs and both zeros, along the last dim and the first.
BODY = """class Model(nn.Module):
    def forward(self, x):
        x = torch.round(x * 4) / 4
        x = torch.where(x.abs() > 2.2, float("nan"), x)
        x = torch.where(x == 0.25, -0.0, x)
        a = torch.sort(x, dim=-1, stable=True)
        b = torch.sort(x, dim=0, descending=True, stable=True)
        t = torch.topk(x, 7, dim=-1)
        s = torch.topk(x, 3, dim=0, largest=False)
        return (a.values, a.indices, b.values, b.indices, x.argsort(dim=-1, stable=True), t.values,
                t.indices, s.values, s.indices, torch.argsort(x, dim=-1, descending=True, stable=True))"""


def _path(tmp_path, dtype: str, shape: str):
    return task_file(tmp_path, f"sorts_{dtype}", BODY, f"[torch.randn({shape}, dtype=torch.{dtype})]")


def _candidates(path):
    task = probe(path)
    return [
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    ]


@needs_gxx
@pytest.mark.parametrize(
    ("dtype", "shape"), [("float32", "9, 37"), ("bfloat16", "5, 130"), ("float16", "4, 9")]
)
def test_emulated_sorts_match_eagers_stable_order(tmp_path, dtype, shape):
    from cuda_emulator import build, load_model
    from fuzz_expert import as_tuple, reference

    path = _path(tmp_path, dtype, shape)
    ok, why = supports(path)
    assert ok and "select" in why and "left to PyTorch" not in why, why
    r = reference(path, None)
    for cand in _candidates(path):
        kernels = build(cand.source)
        model = load_model(cand.launcher, kernels, sms=4)(*r.module.get_init_inputs())
        with torch.no_grad():
            out = as_tuple(model(*r.inputs))
        assert any(k.endswith("_select") for k, *_ in kernels.launches)
        for i, (o, n) in enumerate(zip(out, r.native, strict=True)):
            assert o.shape == n.shape and o.dtype == n.dtype, (cand.edit, i, o.shape, n.shape)
            if i in (5, 6, 7, 8):  # topk: eager's tie order is its own; the values and where they came from
                if o.dtype == torch.int64:
                    continue
                assert torch.equal(o.nan_to_num(9.0), n.nan_to_num(9.0)), (cand.edit, i)
                continue
            assert torch.equal(o.nan_to_num(9.0), n.nan_to_num(9.0)), (cand.edit, i, o, n)
        x = torch.round(r.inputs[0] * 4) / 4  # the model's own rows, to check where topk's values came from
        x = torch.where(x == 0.25, -0.0, torch.where(x.abs() > 2.2, float("nan"), x))
        for vi, ii, d in ((5, 6, -1), (7, 8, 0)):
            picked = torch.gather(x, d, out[ii]).nan_to_num(9.0)
            assert torch.equal(picked, out[vi].nan_to_num(9.0)), (cand.edit, vi)


def test_rows_longer_than_a_block_sorts_stay_with_pytorch(tmp_path):
    body = (
        "class Model(nn.Module):\n    def forward(self, x):\n        return torch.sort(x, dim=-1).values * 2"
    )
    ok, why = supports(task_file(tmp_path, "long", body, "[torch.randn(4, 5000)]"))
    assert ok and "aten.sort.default left to PyTorch (select: rows of 5000" in why, why  # the family says why


@needs_nvcc
def test_sort_kernels_compile_for_sm90a_without_spills(tmp_path):
    cands = _candidates(_path(tmp_path, "bfloat16", "64, 4096")) + _candidates(
        _path(tmp_path, "float32", "8, 9")
    )
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status == Status.OK and not b.log, (c.edit, b.log)
        assert all(r.spill_stores == 0 for r in b.resources), (c.edit, b.resources)


MEDIANS = """class Model(nn.Module):
    def forward(self, x):
        x = torch.where(x > 2.0, float("nan"), x)  # a few rows hold NaN: their median is NaN, as eager's
        a = torch.median(x, dim=1)
        b = torch.kthvalue(x, 3, dim=0, keepdim=True)
        c = x.median(-1, keepdim=True)
        n = torch.where(x < -1.0, float("nan"), x)
        n = torch.cat((n[:4], n[4:5] * float("nan"), n[5:]))  # a row of NaN: its nanmedian is NaN
        d = torch.nanmedian(n, dim=1)
        return (a.values, a.indices, b.values, b.indices, c.values, torch.median(x[:3, :5]), d.values, d.indices,
                torch.nanmedian(n[:3, :7]))"""


@needs_gxx
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_emulated_medians_and_kth_values_match_eager(tmp_path, dtype):
    from cuda_emulator import build, load_model
    from fuzz_expert import as_tuple, reference

    path = task_file(tmp_path, f"medians_{dtype}", MEDIANS, f"[torch.randn(11, 40, dtype=torch.{dtype})]")
    ok, why = supports(path)
    assert ok and "select" in why and "left to PyTorch" not in why, why
    r = reference(path, None)
    x = r.inputs[0]
    x = torch.where(x > 2.0, float("nan"), x)
    for cand in _candidates(path):
        model = load_model(cand.launcher, build(cand.source), sms=4)()
        with torch.no_grad():
            out = as_tuple(model(*r.inputs))
        for i, (o, n) in enumerate(zip(out, r.native, strict=True)):
            assert o.shape == n.shape and o.dtype == n.dtype, (cand.edit, i, o.shape, n.shape)
            if o.dtype != torch.int64:
                assert torch.equal(o.nan_to_num(9.0), n.nan_to_num(9.0)), (cand.edit, i, o, n)
        nx = torch.where(x < -1.0, float("nan"), x)
        nx[4] = float("nan")
        for src, vi, ii, d in ((x, 0, 1, 1), (x, 2, 3, 0), (nx, 6, 7, 1)):  # indices point at the values
            picked = torch.gather(src, d, out[ii] if out[ii].dim() == src.dim() else out[ii].unsqueeze(d))
            assert torch.equal(picked.reshape(out[vi].shape).nan_to_num(9.0), out[vi].nan_to_num(9.0)), (
                cand.edit
            )
