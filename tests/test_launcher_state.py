"""The forward's reads of a model's parameters and buffers (render._state_reads): with many (16 or more),
through the holder modules the launcher built (`_kp_holders`, a plain tuple: no state-dict keys), where
get_parameter would resolve each dotted name anew on every call (~10 us each: 2 ms a call of a SwinV2).
Each read is of the holder's current tensor, so weights loaded in place or assigned (load_state_dict with
assign=True) are the ones used. Emulated against the reference on the CPU; the static check passes."""

from __future__ import annotations

import pytest
from expert_plans import tuned
from test_expert import task_file
from test_expert_decompose import needs_gxx

from pipeline.static_check import check_launcher
from pipeline.tasks import load_module
from pipeline.types import Kind

torch = pytest.importorskip("torch")

DEEP = """class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.LayerNorm(64) for _ in range(9)])
        self.scale = nn.Parameter(torch.ones(64))
        self.register_buffer("shift", torch.zeros(64))

    def forward(self, x):
        for ln in self.layers:
            x = torch.relu(ln(x)) + x
        return x * self.scale + self.shift"""
SHALLOW = """class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(64)

    def forward(self, x):
        return torch.relu(self.ln(x))"""


def test_many_parameters_are_read_through_their_holders_and_few_by_name(tmp_path):
    deep = tuned(task_file(tmp_path, "deep", DEEP, "[torch.randn(8, 64)]"))
    forward = deep.launcher.split("def forward", 1)[1]
    assert "get_parameter" not in forward and "get_buffer" not in forward
    assert "self._kp_holders[" in forward and "self.scale" in forward and "self.shift" in forward
    report = check_launcher(deep.launcher)
    assert report.ok and report.kind is Kind.CUSTOM, report.violations
    shallow = tuned(task_file(tmp_path, "shallow", SHALLOW, "[torch.randn(8, 64)]"))
    assert "self.get_parameter('ln.weight')" in shallow.launcher and "_kp_holders" not in shallow.launcher


@needs_gxx
@pytest.mark.parametrize("assign", [False, True])
def test_holder_reads_use_the_weights_loaded_in_place_or_assigned(tmp_path, assign):
    from cuda_emulator import build, load_model

    path = task_file(tmp_path, "deep", DEEP, "[torch.randn(8, 64)]")
    cand = tuned(path)
    ref = load_module(path).Model()
    torch.manual_seed(3)
    with torch.no_grad():
        for t in (*ref.parameters(), *ref.buffers()):
            t.copy_(torch.randn_like(t))
    model = load_model(cand.launcher, build(cand.source, tmp_path), sms=4)()
    assert set(model.state_dict()) == set(ref.state_dict())  # the holders' tuple adds no keys
    x = load_module(path).get_inputs()[0]
    with torch.no_grad():
        model(x)  # a call before the weights arrive: nothing of them is kept across calls
        state = {k: v.clone() for k, v in ref.state_dict().items()}
        model.load_state_dict(state, assign=assign)
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)


BCAST = """class Model(nn.Module):
    def forward(self, a, b, c):
        return torch.relu(a) * b + c"""


@needs_gxx
@pytest.mark.parametrize("shapes", ["(37, 301), (37, 301), (37, 301)", "(37, 301), (301,), (37, 1)"])
def test_elementwise_launchers_skip_broadcast_shapes_where_operands_agree(tmp_path, shapes):
    """torch.broadcast_shapes costs 12-25 us a call on the host: a launcher of several operands takes the
    first's shape where they agree, and broadcasts where they do not (the emulated result says which ran)."""
    from test_expert import _emulate

    inputs = ", ".join(f"torch.randn{s}" for s in shapes.replace("), (", ")|(").split("|"))
    path = task_file(tmp_path, "bcast", BCAST, f"[{inputs}]")
    cand = tuned(path)
    line = next(ln.strip() for ln in cand.launcher.splitlines() if ln.strip().startswith("shape = "))
    assert line.startswith("shape = a0.shape if a1.shape == a0.shape and a2.shape == a0.shape else"), line
    assert check_launcher(cand.launcher).ok
    _emulate(path, [cand], 1e-6)
