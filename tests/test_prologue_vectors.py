"""A reduction whose prologue reads same-shape operands (mean((a - b)^2), a logsumexp of a * b): in the
batched loop the host loads them as 16-byte vectors beside its input, where they were read element by element
(4-byte loads 16 bytes apart a lane, a load instruction an element). In the CPU emulator against float64
PyTorch (rows long enough for the batched loop: a tail after the vectors, several splits of a row), a misaligned operand (the launcher's
scalar kernel), and the SASS of the 16-byte kernel."""

from __future__ import annotations

import pytest
from test_expert import _emulate, needs_nvcc, task_file
from test_expert_decompose import needs_gxx

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy
from pipeline.profile.collect import dump_sass, find_cuobjdump, parse_sass
from pipeline.tasks import probe
from pipeline.types import Status

torch = pytest.importorskip("torch")

MSE = "class Model(nn.Module):\n    def forward(self, a, b):\n        return torch.mean((a - b) ** 2)"
LSE = "class Model(nn.Module):\n    def forward(self, a, b):\n        return torch.logsumexp(a * b, dim=-1)"


def _tuned(path):
    t = probe(path)
    props = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)
    return props[1].candidate


@needs_gxx
@pytest.mark.parametrize(
    ("body", "shape"),
    [(MSE, "5, 40003"), (MSE, "3, 70001"), (LSE, "5, 70001"), (LSE, "2, 3, 40001")],
)
def test_prologue_operands_load_as_vectors_and_match_pytorch(tmp_path, body, shape):
    inputs = f"[torch.randn({shape}), torch.randn({shape}) * 0.5]"
    path = task_file(tmp_path, "prologue", body, inputs)
    cand = _tuned(path)
    assert "fv0_[u] = vload<float, V>(f0 + start + head" in cand.source  # b beside a
    assert "_aligned((x, y, f0,), 4)" in cand.launcher  # the 16-byte kernel only where b is aligned too
    launched = _emulate(path, [cand], 1e-5)
    assert any(k.endswith("_v4") for k in launched), launched


@needs_gxx
def test_a_misaligned_operand_takes_the_scalar_kernel(tmp_path):
    from cuda_emulator import build, load_model

    path = task_file(tmp_path, "mse", MSE, "[torch.randn(3, 50000), torch.randn(3, 50000)]")
    cand = _tuned(path)
    kernels = build(cand.source)
    model = load_model(cand.launcher, kernels, sms=4)()
    a = torch.randn(3, 50000)
    b = torch.randn(3 * 50000 + 1)[1:].view(3, 50000)  # contiguous, 4 bytes past a 16-byte boundary
    got = model(a, b)
    assert {k[0] for k in kernels.launches} & {"kp_mean_v1"}, kernels.launches
    assert not {k[0] for k in kernels.launches} & {"kp_mean_v4"}, kernels.launches
    torch.testing.assert_close(got, torch.mean((a.double() - b.double()) ** 2).float(), rtol=1e-5, atol=1e-6)


@needs_nvcc
def test_the_16_byte_kernel_loads_both_operands_16_bytes_at_a_time(tmp_path):
    """KernelBench level 1's 94 (MSE over two 32768 x 32768 tensors): the tuned kernel's batched loop issues
    16-byte loads of a and of b (4 each: its unroll), and only the head and tail read 4 bytes."""
    path = task_file(tmp_path, "mse", MSE, "[torch.rand(32768, 32768), torch.rand(32768, 32768)]")
    cand = _tuned(path)
    (b,) = compile_candidates([cand], Config(home=tmp_path / "home", arch="sm_90a"))
    assert b.status == Status.OK and not b.log, b.log
    assert all(r.spill_stores == 0 for r in b.resources), b.resources
    if find_cuobjdump() is None:
        return
    ops = parse_sass(dump_sass(b.cubin_path) or "")["kp_mean_v4"].opcodes
    assert sum(n for op, n in ops.items() if op.startswith("LDG.E.128")) == 8, ops
