"""benchmarks/op_probe.py, the operator-coverage probe: every task it writes is a valid reference (it runs in
PyTorch), and its verdicts classify as they say."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.tasks import load_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import op_probe

torch = pytest.importorskip("torch")


def test_every_probe_task_runs_in_pytorch(tmp_path):
    for name in op_probe.OPS:
        module = load_module(op_probe.write(tmp_path, name))
        with torch.no_grad():
            module.Model(*module.get_init_inputs())(*module.get_inputs())


def test_verdicts_count_ours_hybrid_and_refused():
    assert op_probe.verdict(True, "2 region(s) in our kernels (ew, reduce)") == "ours"
    assert (
        op_probe.verdict(True, "1 region(s) in our kernels (ew); aten.erfinv.default left to PyTorch (x)")
        == "hybrid"
    )
    assert op_probe.verdict(False, "nothing for our kernels to compute: ...") == "refused"
