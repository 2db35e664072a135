"""benchmarks/plan_forms.py's forms: knobs on every region that has them, or on one family's regions only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_forms  # noqa: E402

from pipeline.generate.expert.plan import plan_of  # noqa: E402

GEMV = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)


def get_inputs():
    return [torch.randn(256, 65536), torch.randn(65536, 1)]


def get_init_inputs():
    return []
"""


def test_a_tagged_set_moves_only_its_familys_regions(tmp_path):
    """A GEMV: an element-wise product region (x * v) feeding the row-wise sum. `unroll=4` moves both;
    `row:unroll=4` the sum's alone, so one region's knob can be timed against the tuned plan."""
    path = tmp_path / "gemv.py"
    path.write_text(GEMV)
    assert plan_forms.tag_and_knobs("row:unroll=4, warp_rows=true") == (
        "row",
        {"unroll": 4, "warp_rows": True},
    )
    assert plan_forms.tag_and_knobs("unroll=4") == ("", {"unroll": 4})
    got = dict(plan_forms.forms(path, ["unroll=4", "row:unroll=4", "pool:rows=8"]))
    assert set(got) == {"tuned", "unroll=4", "row:unroll=4"}  # no pool region: reported and skipped

    def unrolls(cand) -> dict[str, int]:
        return {rp.TAG: rp.unroll for rp in plan_of(cand.source).regions}

    assert unrolls(got["tuned"]) == {"ew": 1, "row": 2}  # 256 rows, more than the SMs: two loads
    assert unrolls(got["unroll=4"]) == {"ew": 4, "row": 4}
    assert unrolls(got["row:unroll=4"]) == {"ew": 1, "row": 4}
    with pytest.raises(SystemExit, match="is not knob=value"):
        plan_forms.tag_and_knobs("row:unroll")
