"""F.fold / nn.Fold (col2im) as our kernel (families/fold.py), where it was left to PyTorch: in the CPU
emulator against float64 eager for square and uneven kernels, strides, dilations and padding, blocks that
overlap and blocks that skip pixels, an unbatched input, bf16, and fold(unfold(x)); compiled for sm_90a."""

from __future__ import annotations

import pytest
from test_expert import _emulate, needs_nvcc, task_file
from test_expert_decompose import needs_gxx

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, supports
from pipeline.static_check import check_launcher
from pipeline.tasks import probe
from pipeline.types import Kind, Status

torch = pytest.importorskip("torch")

BODY = """class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fold = nn.Fold((9, 11), (2, 3), dilation=(1, 2), padding=(0, 1), stride=(2, 1))
    def forward(self, x, y, z):
        return (F.fold(x, (7, 8), 3, padding=1), self.fold(y), F.fold(z, (6, 6), 2, stride=3),
                F.fold(F.unfold(x[:, :4, :42].reshape(2, 4, 6, 7) * 1.0, 3), (6, 7), 3))"""
# (2, 4 * 9, 7 * 8) blocks of 3 x 3 (padding 1); (3, 5 * 6, 4 * 9) of 2 x 3 dilated; (1 * 4, 2 * 2) of 2 x 2 at
# stride 3 over 6 x 6 (a pixel row and column no block covers), unbatched
INPUTS = "[torch.randn(2, 36, 56), torch.randn(3, 30, 36), torch.randn(4, 4)]"


def _candidates(path):
    task = probe(path)
    return [
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    ]


@needs_gxx
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_emulated_folds_match_eager(tmp_path, dtype):
    inputs = INPUTS if dtype == "float32" else INPUTS.replace(")", ", dtype=torch.bfloat16)")
    path = task_file(tmp_path, f"fold_{dtype}", BODY, inputs)
    ok, why = supports(path)
    assert ok and "fold" in why and "left to PyTorch" not in why, why
    cands = _candidates(path)
    launched = _emulate(path, cands, 1e-5 if dtype == "float32" else 1e-2)
    assert sum(k.endswith("_fold32") for k in launched) == 8, launched  # four folds a candidate
    for c in cands:
        assert check_launcher(c.launcher).kind is Kind.CUSTOM, c.edit


@needs_nvcc
def test_fold_kernels_compile_for_sm90a_without_spills(tmp_path):
    cands = _candidates(task_file(tmp_path, "fold", BODY, INPUTS))
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status == Status.OK and not b.log, (c.edit, b.log)
        assert all(r.spill_stores == 0 for r in b.resources), (c.edit, b.resources)
