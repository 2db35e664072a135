"""Softmax, and RMS norms written by hand, over a dim that is not the last with each column's rows held in
registers (families/colwise.py, `regs`): read once, all its loads at once, where the streaming kernel reads
a column twice. In the CPU emulator against eager for softmax and log-softmax (an epilogue fused), the RMS
norm's division and rsqrt forms, float4 and scalar columns, -inf and NaN; the streaming kernel for columns
too tall and for another R at run time; the edits; sm_90a builds."""

from __future__ import annotations

import pytest
import torch
from cuda_emulator import build, load_model
from expert_plans import tuned, tuned_with_edit
from test_expert import needs_nvcc, task_file
from test_expert_decompose import needs_gxx

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.expert import plan_of
from pipeline.generate.expert.policy import analyse
from pipeline.types import Status

BODY = """class Model(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=1) * 2, torch.log_softmax(x, dim=1)"""


def _path(tmp_path, shape: str):
    return task_file(
        tmp_path, "colsm_" + "".join(c for c in shape if c.isdigit()), BODY, f"[torch.randn({shape})]"
    )


def _run(cand, x):
    kernels = build(cand.source)
    got = load_model(cand.launcher, kernels, sms=4)()(x)
    return got, {k[0] for k in kernels.launches}


@needs_gxx
@pytest.mark.parametrize(
    ("shape", "held"),
    [("2, 16, 5, 12", "v4_regs"), ("3, 7, 9", "v1_regs"), ("2, 64, 3", "v1_regs"), ("2, 100, 8", "")],
)
def test_columns_held_in_registers_match_eager(tmp_path, shape, held):
    path = _path(tmp_path, shape)
    cand = tuned(path)
    rows = int(shape.split(", ")[1])
    assert [rp.regs for rp in plan_of(cand.source).regions if rp.TAG == "col"] == [rows if held else 0] * 2
    x = torch.randn(*map(int, shape.split(", "))) * 3
    x[0, :, 0] = float("-inf")  # a column of -inf: NaN, as eager
    x[1, 2, 1] = float("-inf")
    x[-1, 1, -1] = float("nan")  # spreads over its column
    got, launched = _run(cand, x)
    want = (torch.softmax(x, dim=1) * 2, torch.log_softmax(x, dim=1))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert all(k.endswith(held) for k in launched) if held else not any("regs" in k for k in launched), (
        launched
    )


@needs_gxx
def test_another_r_at_run_time_and_the_edits_take_the_streaming_kernel(tmp_path):
    path = _path(tmp_path, "2, 16, 5, 12")
    x = torch.randn(2, 9, 5, 12)  # the launcher reads R at run time: 9 is not the 16 it was compiled for
    got, launched = _run(tuned(path), x)
    torch.testing.assert_close(got[1], torch.log_softmax(x, dim=1), rtol=1e-5, atol=1e-5)
    assert launched and not any("regs" in k for k in launched), launched
    streamed = tuned_with_edit(path, "reduce_registers")
    assert all(rp.regs == 0 for rp in plan_of(streamed.source).regions if rp.TAG == "col")
    x = torch.randn(2, 16, 5, 12)
    got, launched = _run(streamed, x)
    torch.testing.assert_close(got[0], torch.softmax(x, dim=1) * 2, rtol=1e-5, atol=1e-5)
    assert not any("regs" in k for k in launched), launched


@needs_nvcc
def test_held_columns_compile_for_sm90a_without_spills(tmp_path):
    cands = [tuned(_path(tmp_path, s)) for s in ("2, 16, 5, 12", "2, 64, 3")]
    for b in compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a")):
        assert b.status == Status.OK and not b.log, b.log
        held = [r for r in b.resources if r.name.endswith("_regs")]
        assert len(held) >= 2 and all(r.spill_stores == 0 for r in held), held


RMS = """class Model(nn.Module):
    def forward(self, x):
        return (x / torch.sqrt(torch.mean(x ** 2, dim=1, keepdim=True) + 1e-5),
                x * torch.rsqrt(torch.mean(x * x, dim=-3, keepdim=True) + 1e-6) * 0.5)"""


@needs_gxx
@pytest.mark.parametrize(
    ("shape", "vec"), [("2, 16, 5, 12", 4), ("2, 64, 3, 4", 1), ("3, 7, 9, 2", 1), ("2, 80, 8, 1", 4)]
)
def test_rms_norms_over_the_channels_written_by_hand_are_one_column_op(tmp_path, shape, vec):
    """KernelBench's RMSNorm (x / sqrt(mean(x^2, dim=1, keepdim) + eps)) and the rsqrt form: one column op
    (rms_col) each, its column held in registers (narrower vectors where 16-byte ones would not fit: 64
    channels take one float a row), where a column reduction and an element-wise pass read x twice."""
    path = task_file(
        tmp_path, "rms_" + "".join(c for c in shape if c.isdigit()), RMS, f"[torch.randn({shape})]"
    )
    low, why = analyse(path)
    assert low is not None, why
    assert [r.node.op for r in low.regions if r.kind.value != "ew"] == ["rms_col"] * 2
    cand = tuned(path)
    rows = int(shape.split(", ")[1])
    held = rows * vec <= 64
    plans = [rp for rp in plan_of(cand.source).regions if rp.TAG == "col"]
    assert [(rp.vec, rp.regs) for rp in plans] == [(vec, rows if held else 0)] * 2
    x = torch.randn(*map(int, shape.split(", "))) * 2
    x[0, 1, 0] = float("nan")  # its column's norm: NaN over the column, as eager
    got, launched = _run(cand, x)
    want = (x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + 1e-5),
            x * torch.rsqrt(torch.mean(x * x, dim=-3, keepdim=True) + 1e-6) * 0.5)  # fmt: skip
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert all(("regs" in k) == held for k in launched), launched


def test_a_trailing_rms_norm_stays_the_row_family_s(tmp_path):
    body = "class Model(nn.Module):\n    def forward(self, x):\n        return x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6)"
    low, why = analyse(task_file(tmp_path, "rms_row", body, "[torch.randn(4, 33)]"))
    assert low is not None and [r.node.op for r in low.regions] == ["rms_norm"], why
