"""benchmarks/launcher_host.py: the expert's tuned launcher run on the CPU with kernels that launch nothing,
each launch and the bytes of its tensors counted (what the SwinV2 gather counts of docs/benchmarks.md came
from)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_expert import task_file

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import launcher_host  # noqa: E402


def test_launches_and_their_tensor_bytes_are_counted(tmp_path):
    """A transposed view copied out and a chain over the copy, fused into one region of two outputs: per call
    one gather of the view (2 x 37 x 129 floats read and written) and the chain reading the gathered copy and
    writing both outputs."""
    body = (
        "class Model(nn.Module):\n    def forward(self, x):\n"
        "        y = x.transpose(1, 2).contiguous()\n        return y, torch.relu(y) * 2.0"
    )
    path = task_file(tmp_path, "copy", body, "[torch.randn(2, 129, 37)]")
    kernels = launcher_host._NoLaunch()
    _, launches = launcher_host.host_ms(path, 3, None, kernels)
    n = 2 * 37 * 129 * 4
    gather = "kp_gather_fast_f32"  # a transposed fp32 view: templates/gather.py's kernel
    assert kernels.kinds[gather] == 3 and kernels.bytes[gather] == 3 * 2 * n, kernels.bytes
    chain = [k for k in kernels.kinds if not k.startswith("kp_gather")]
    assert len(chain) == 1 and kernels.kinds[chain[0]] == 3 and kernels.bytes[chain[0]] == 3 * 3 * n, (
        kernels.bytes
    )
    assert launches == 2


def test_a_graphed_forward_runs_its_launches():
    """kernels.graphed(owner, forward, args) runs forward itself: the launches inside are counted, not the
    graph call as one launch."""
    kernels = launcher_host._NoLaunch()

    def forward(x):
        kernels.kp_scale_3_v4((1,), (256,), (x, x))
        return x

    x = torch.ones(8)
    assert kernels.graphed(object(), forward, (x,)) is x
    assert (
        kernels.launches == 1 and kernels.kinds == {"kp_scale_v4": 1} and kernels.bytes["kp_scale_v4"] == 64
    )
