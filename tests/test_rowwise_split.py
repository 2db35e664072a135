"""Two-pass row ops (layer and RMS norm, softmax, log-softmax) over rows too few to fill the GPU: each row split
across blocks, the partial statistics of every block merged in the second kernel (templates/rowwise.py),
emulated against PyTorch on the CPU, with the split path checked to be the one that ran."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from cuda_emulator import build, load_model
from expert_plans import op_task, tuned

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy
from pipeline.generate.expert.templates.reduce_ops import KINDS
from pipeline.profile.collect import dump_sass
from pipeline.static_check import check_launcher
from pipeline.tasks import load_module, probe
from pipeline.types import Kind, Status

CASES = {  # name -> (module, what forward returns of y, input shape): 2-3 rows of 16K-40K columns
    "layer_norm_relu": ("nn.LayerNorm((16, 33, 31))", "torch.relu(y)", "3, 16, 33, 31"),
    "rms_norm": ("nn.RMSNorm((16, 33, 31))", "y", "3, 16, 33, 31"),
    "softmax_scaled": ("nn.Softmax(dim=-1)", "y * 2", "3, 40000"),
    "log_softmax_odd": ("nn.LogSoftmax(dim=-1)", "y", "2, 40001"),  # rows not 16-byte multiples
}


def _task(folder: Path, name: str) -> Path:
    return op_task(folder, name, *CASES[name])


@pytest.mark.parametrize("name", sorted(CASES))
def test_few_long_rows_are_split_across_blocks_and_match_pytorch(tmp_path, name):
    path = _task(tmp_path, name)
    module = load_module(path)
    torch.manual_seed(0)
    ref = module.Model()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
    x = module.get_inputs()[0]
    want = ref(x).detach()
    cand = tuned(path)
    assert '"splits":1' in cand.source.splitlines()[0]
    report = check_launcher(cand.launcher)  # every launch resolved by name: our kernels only
    assert report.ok and report.kind == Kind.CUSTOM, (report.library_ops, report.violations)
    kernels = build(cand.source, tmp_path)
    model = load_model(cand.launcher, kernels, sms=4)()  # 4 SMs, 2-3 rows: too few, so split
    model.load_state_dict(ref.state_dict())
    got = model(x)
    names = [launch[0] for launch in kernels.launches]
    assert any("_part_" in n for n in names) and any("_apply_" in n for n in names), names
    splits = {launch[1][1] for launch in kernels.launches if "_part_" in launch[0]}
    assert splits and min(splits) > 1, splits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_split_kernels_compile_for_sm90a_without_spills(tmp_path):
    cands = []
    for name in sorted(CASES):
        cands.append(tuned(_task(tmp_path, name)))
    for b in compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a")):
        assert b.status == Status.OK and not b.log, b.log
        split = [r for r in b.resources if "_part_" in r.name or "_apply_" in r.name]
        assert len(split) >= 2 and all(r.spill_stores == 0 for r in split), split


# Whole-tensor reductions (a loss's mean, a Frobenius norm): one long row split over the SMs' blocks, each
# thread with `unroll` 16-byte loads in flight.
WHOLE = {  # name -> (forward's body, inputs)
    "mse": ("return torch.mean((a - b) ** 2)", "torch.randn(3, 40003), torch.randn(3, 40003)"),
    "frobenius": ("return a / torch.norm(a, p='fro')", "torch.randn(2, 3, 33331)"),
}


def _whole_task(folder: Path, name: str) -> Path:
    body, inputs = WHOLE[name]
    args = "a, b" if "b" in body else "a"
    return _forward_task(folder, name, args, body, inputs)


def _forward_task(folder: Path, name: str, args: str, body: str, inputs: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
        f"    def forward(self, {args}):\n        {body}\n\n\n"
        f"def get_inputs():\n    return [{inputs}]\n\n\ndef get_init_inputs():\n    return []\n"
    )
    return path


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_whole_tensor_reductions_batch_their_loads_and_match_pytorch(tmp_path, name):
    path = _whole_task(tmp_path, name)
    module = load_module(path)
    torch.manual_seed(0)
    xs = module.get_inputs()
    want = module.Model()(*xs)
    cand = tuned(path)
    assert '"unroll":4' in cand.source.splitlines()[0], cand.source.splitlines()[0]
    kernels = build(cand.source, tmp_path)
    got = load_model(cand.launcher, kernels, sms=4)()(*xs)
    assert any(launch[1][1] > 1 for launch in kernels.launches), kernels.launches  # split over blocks
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # In the vector kernel's SASS, the unrolled 16-byte loads are issued before any of them is used (the
    # unroll pragma alone kept one load in flight: each followed by its FMAs).
    (b,) = compile_candidates([cand], Config(home=tmp_path / "home", arch="sm_90a"))
    assert b.status == Status.OK and not b.log, b.log
    sass = dump_sass(b.cubin_path) or ""
    body = sass[sass.index("_v4") :]
    ops = [m.group(1) for m in _OP.finditer(body)]
    run = longest = 0
    for op in ops:
        if op.startswith("LDG.E.128"):
            run += 1
            longest = max(longest, run)
        elif op.startswith(("FFMA", "FADD", "FMUL")):
            run = 0
    assert longest >= 4, ops


_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def test_a_long_sum_is_compensated(tmp_path):
    """Each thread of a whole-tensor sum (the plain plan's: split over the blocks of 2 SMs here) adds
    thousands of elements; Kahan's compensation keeps its result at
    fp32's own accuracy (uncompensated, each 1000.x added to a running sum past 2^23 loses its .x: rounded
    down every time, 1e-4 of the sum)."""
    path = tmp_path / "big_sum.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
        "        return x.sum()\n\n\ndef get_inputs():\n    return [torch.rand(1 << 22) * 0.25 + 1000]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    t = probe(path)
    plain = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 1)[0].candidate
    assert "kahan_add(acc.a" in plain.source and '"splits":1' in plain.source.splitlines()[0]
    assert "kahan_add(acc.b" not in plain.source and "cb_" not in plain.source  # a sum has no second moment
    assert "kahan_add(acc.b, cb_" in KINDS["var"].push("acc", "v", "c", compensated=True)  # a variance has
    torch.manual_seed(0)
    x = load_module(path).get_inputs()[0]
    kernels = build(plain.source, tmp_path)
    got = load_model(plain.launcher, kernels, sms=2)()(x)
    assert any(launch[1][1] > 1 for launch in kernels.launches), kernels.launches  # even plain, over blocks
    want = x.double().sum()
    assert abs(got.double() - want) / want < 1e-6, (got.item(), want.item())


def test_long_rows_that_outnumber_the_sms_keep_two_loads_a_thread_in_32_registers(tmp_path):
    """A GEMV of 256 rows of 131072 (rowwise.long_row_unroll): two 16-byte loads in flight a thread, so the
    1024-thread kernel fits 32 registers and two blocks share an SM (four loads took 58: one block an SM,
    two waves for 256 rows). Rows no more than the SMs (96) keep four: a block alone on its SM."""
    dot = "return torch.matmul(a, b)"
    many = _forward_task(
        tmp_path, "many_rows", "a, b", dot, "torch.randn(256, 131072), torch.randn(131072, 1)"
    )
    few = _forward_task(tmp_path, "few_rows", "a, b", dot, "torch.randn(96, 131072), torch.randn(131072, 1)")
    plans = [tuned(p).source.splitlines()[0] for p in (many, few)]
    assert '"threads":1024,"unroll":2' in plans[0] and '"threads":1024,"unroll":4' in plans[1], plans
    (b,) = compile_candidates([tuned(many)], Config(home=tmp_path / "home", arch="sm_90a"))
    assert b.status == Status.OK and not b.log, b.log
    (vec,) = [r for r in b.resources if r.name.endswith("_v4")]
    assert vec.registers <= 32 and vec.spill_stores == 0, vec
