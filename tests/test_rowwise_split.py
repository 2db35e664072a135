"""Two-pass row ops (layer and RMS norm, softmax, log-softmax) over rows too few to fill the GPU: each row split
across blocks, the partial statistics of every block merged in the second kernel (templates/rowwise.py),
emulated against PyTorch on the CPU, with the split path checked to be the one that ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cuda_emulator import build, load_model
from expert_plans import tuned

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.static_check import check_launcher
from pipeline.tasks import load_module
from pipeline.types import Kind, Status

CASES = {  # name -> (module, what forward returns of y, input shape): 2-3 rows of 16K-40K columns
    "layer_norm_relu": ("nn.LayerNorm((16, 33, 31))", "torch.relu(y)", "3, 16, 33, 31"),
    "rms_norm": ("nn.RMSNorm((16, 33, 31))", "y", "3, 16, 33, 31"),
    "softmax_scaled": ("nn.Softmax(dim=-1)", "y * 2", "3, 40000"),
    "log_softmax_odd": ("nn.LogSoftmax(dim=-1)", "y", "2, 40001"),  # rows not 16-byte multiples
}


def _task(folder: Path, name: str) -> Path:
    mod, ret, shape = CASES[name]
    path = folder / f"{name}.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n"
        f"        super().__init__()\n        self.op = {mod}\n\n    def forward(self, x):\n"
        f"        y = self.op(x)\n        return {ret}\n\n\n"
        f"def get_inputs():\n    return [torch.randn({shape}) * 3 + 2]\n\n\ndef get_init_inputs():\n    return []\n"
    )
    return path


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
