"""Capture of references with GRU, LSTM and plain RNN layers: their outputs' shapes come from the shape
rule (pipeline/generate/expert/recurrent.py) instead of PyTorch's per-time-step decomposition, and must be
the shapes eager PyTorch returns, for every layout the modules offer."""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import pytest

from pipeline.generate.expert import recurrent
from pipeline.generate.expert.graph import capture
from pipeline.tasks import load_module

torch = pytest.importorskip("torch")

TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(6, 5, num_layers=2, batch_first=True, bidirectional=True)
        self.lstm = nn.LSTM(6, 7, num_layers=3, proj_size=4)
        self.lstm2 = nn.LSTM(6, 3, bidirectional=True, bias=False)
        self.rnn = nn.RNN(6, 4, nonlinearity="relu", batch_first=True)
        self.rnn2 = nn.RNN(6, 2, num_layers=2, bidirectional=True)

    def forward(self, x, s, u):
        g, gh = self.gru(x)
        out, (h, c) = self.lstm(s)
        b, (bh, bc) = self.lstm2(u)  # unbatched: (time, features)
        r, rh = self.rnn(x)
        q, qh = self.rnn2(s, torch.ones(4, 3, 2))
        return g * 2, gh + 1, out, h, c, b, bh, bc, r, rh, q, qh


def get_inputs():
    return [torch.randn(3, 8, 6), torch.randn(8, 3, 6), torch.randn(9, 6)]


def get_init_inputs():
    return []
"""


def test_captured_recurrent_outputs_have_eager_shapes(tmp_path: Path):
    path = tmp_path / "recurrent_layouts.py"
    path.write_text(textwrap.dedent(TASK))
    graph = capture(path)
    module = load_module(path)
    torch.manual_seed(0)
    eager = module.Model()(*module.get_inputs())
    captured = [graph.node(name).shape for name in graph.output_names()]
    assert captured == [tuple(t.shape) for t in eager]
    kinds = {n.op for n in graph.nodes}
    assert {"gru", "lstm", "rnn_relu", "rnn_tanh"} <= kinds  # each layer one node, left to PyTorch


def _kernels() -> dict[str, dict]:
    return {name: dict(getattr(torch.ops.aten, name).input.py_kernels) for name in recurrent._OPS}


def test_the_ops_decompositions_are_back_after_capture():
    """The swap lasts only while capture exports: outside it, a GRU on fake tensors runs PyTorch's own
    decomposition again (a failing capture restores them too)."""
    kernels = _kernels()
    with pytest.raises(RuntimeError), recurrent.shapes_only():
        assert torch.ops.aten.gru.input.py_kernels != kernels["gru"]
        raise RuntimeError("capture failed")
    assert _kernels() == kernels


def test_captures_in_several_threads_leave_the_decompositions_in_place():
    """Overlapping swaps would save each other's rule as the original and leave it installed."""
    kernels = _kernels()

    def capture_slowly() -> None:
        with recurrent.shapes_only():
            time.sleep(0.05)

    threads = [threading.Thread(target=capture_slowly) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _kernels() == kernels
