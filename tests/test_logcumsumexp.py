"""logcumsumexp as a scan (templates/scan.py) whose operator is log-add-exp: the values PyTorch gives where a
naive exp overflows or meets infinities and NaN."""

from __future__ import annotations

import pytest
from test_expert import task_file
from test_expert_decompose import needs_gxx

from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy
from pipeline.tasks import probe

torch = pytest.importorskip("torch")


@needs_gxx
def test_logcumsumexp_keeps_infinities_nans_and_large_values():
    """log-add-exp as the scan's operator: no overflow at 100 (exp(100) is inf in fp32), -inf the identity,
    +inf and NaN carried as PyTorch carries them, in the chunked row, warp-row and column kernels."""
    import tempfile
    from pathlib import Path

    from cuda_emulator import build, load_model

    body = (
        "class Model(nn.Module):\n    def forward(self, x):\n"
        "        return torch.logcumsumexp(x, -1), torch.logcumsumexp(x, 0)"
    )
    path = task_file(Path(tempfile.mkdtemp()), "lcse", body, "[torch.randn(6, 520)]")
    x = torch.randn(6, 520) * 3
    x[0, 5:] = 100.0
    x[1, :7] = -float("inf")
    x[2, 10] = float("inf")
    x[3, 200] = float("nan")
    x[4] = -float("inf")
    task = probe(path)
    for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2):
        kernels = build(p.candidate.source)
        model = load_model(p.candidate.launcher, kernels, sms=64)()
        with torch.no_grad():
            got = model(x)
        want = (torch.logcumsumexp(x, -1), torch.logcumsumexp(x, 0))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
