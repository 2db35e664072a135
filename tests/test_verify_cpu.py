"""The verification protocol, run for real in a CPU worker on Python stand-in candidates."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import jobs, reasons
from pipeline.types import Kind, Status, Task, Verdict

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow
FIX = ROOT / "tests" / "fixtures" / "tasks"


@pytest.fixture(scope="module")
def probed(cpu_worker):
    out = {}
    for name in ("small_chain", "small_norm", "small_softmax"):
        r = cpu_worker.request(jobs.Probe(str(FIX / f"{name}.py")))
        assert isinstance(r.answer, jobs.Probed), r.reason
        out[name] = r.answer.task
    return out


def evaluate(worker, task: Task, launcher: str) -> Verdict:
    job = jobs.Evaluate(
        task, jobs.CandidateCode("standin", launcher), jobs.Settings(device="cpu", trials=3, seed=0)
    )
    r = worker.request(job)
    assert isinstance(r.answer, jobs.Evaluated), r.reason
    v = r.answer.verdict
    # Every reason starts with a registered code, and a failure names one that carries its status.
    assert all(
        reasons.code_of(x) in reasons.CODES or reasons.code_of(x).startswith("static:") for x in v.reasons
    )
    if v.status != Status.OK:
        assert any(reasons.status_of(reasons.code_of(x)) == v.status for x in v.reasons), v.reasons
    return v


HEADER = "import torch\nimport torch.nn as nn\n\n"
CHAIN_HONEST = (
    HEADER
    + """
class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        out = torch.empty_like(x)
        torch.tanh(x * self.scale, out=out)
        return out.add_(x, alpha=0.5)
"""
)


def chain(body: str, init: str = "self.scale = scale") -> str:
    return (
        HEADER
        + f"""
class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        {init}

    def forward(self, x):
{body}
"""
    )


CASES = {
    "honest": (CHAIN_HONEST, Status.OK, None),
    "in_place": (
        chain("        x.mul_(1.0)\n        return x.copy_(torch.tanh(x * self.scale) + 0.5 * x)"),
        Status.REJECTED,
        "output_aliases_input",
    ),
    "mutates_input": (
        chain("        y = torch.tanh(x * self.scale) + 0.5 * x\n        x.add_(1)\n        return y"),
        Status.REJECTED,
        "input_mutated",
    ),
    "view_of_input": (
        chain("        return x.view(-1).view(x.shape)"),
        Status.REJECTED,
        "output_aliases_input",
    ),
    "wrong_dtype": (
        chain("        return (torch.tanh(x * self.scale) + 0.5 * x).half()"),
        Status.MISMATCH,
        "dtype_mismatch",
    ),
    "wrong_shape": (
        chain("        return (torch.tanh(x * self.scale) + 0.5 * x)[:-1]"),
        Status.MISMATCH,
        "shape_mismatch",
    ),
    "low_precision": (
        chain("        return (torch.tanh(x.bfloat16() * self.scale) + 0.5 * x.bfloat16()).float()"),
        Status.MISMATCH,
        "mismatch",
    ),
    "memoised": (
        chain(
            "        if self.cache is None:\n            self.cache = torch.tanh(x * self.scale) + 0.5 * x\n"
            "        return self.cache.clone()",
            init="self.scale = scale\n        self.cache = None",
        ),
        Status.MISMATCH,
        "mismatch",
    ),
    "forgets_scale": (
        chain("        return torch.tanh(x * 1.3) + 0.5 * x"),
        Status.OK,
        None,
    ),  # scale is fixed
    "raises": (
        chain("        raise RuntimeError('kernel launch failed: too many resources requested')"),
        Status.LAUNCH_ERROR,
        "launch_error",
    ),
    "thread": (
        chain(
            "        import threading, time\n        threading.Thread(target=time.sleep, args=(5,)).start()\n"
            "        return torch.tanh(x * self.scale) + 0.5 * x"
        ),
        Status.REJECTED,
        "background_thread",
    ),
    "nan_out": (
        chain(
            "        y = torch.tanh(x * self.scale) + 0.5 * x\n        y[0, 0] = float('nan')\n        return y"
        ),
        Status.MISMATCH,
        "unwritten_output",
    ),
    "no_model_new": (HEADER + "class Model2(nn.Module):\n    pass\n", Status.REJECTED, "static:no_model_new"),
    "bad_ctor": (
        HEADER + "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n",
        Status.LAUNCH_ERROR,
        "launch_error",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_chain_candidates(cpu_worker, probed, name):
    launcher, status, code = CASES[name]
    v = evaluate(cpu_worker, probed["small_chain"], launcher)
    assert v.status == status, v.reasons
    if code:
        assert any(r.startswith(code) for r in v.reasons), v.reasons
    else:
        assert v.trials_passed == v.trials == 3
        # Not bit-exact: in up to one run in five, PyTorch's own CPU result for the honest candidate's very
        # first call in a fresh worker came out 1.54e-5 (relative) off eager's, and bit-exact on every later
        # call (instrumented in an earlier session: always those values). The harness's tolerance takes it,
        # as it should; the bound here still tells an exact chain from a bf16 one (low_precision, a mismatch).
        assert v.worst_rel_error is not None and v.worst_rel_error < 1e-4
        assert v.kind == Kind.CUSTOM


NORM_HONEST = (
    HEADER
    + """
class ModelNew(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, unbiased=False, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.norm.eps) * self.norm.weight + self.norm.bias
"""
)
NORM_IGNORES_AFFINE = NORM_HONEST.replace(" * self.norm.weight + self.norm.bias", "")


def test_norm_honest_passes(cpu_worker, probed):
    v = evaluate(cpu_worker, probed["small_norm"], NORM_HONEST)
    assert v.status == Status.OK, v.reasons


def test_norm_ignoring_weight_and_bias_fails_on_the_redrawn_init(cpu_worker, probed):
    # With LayerNorm's default ones and zeros this candidate would pass; trial 1 redraws them.
    v = evaluate(cpu_worker, probed["small_norm"], NORM_IGNORES_AFFINE)
    assert v.status == Status.MISMATCH
    assert v.trials_passed == 1 and any("(trial 1" in r for r in v.reasons), v.reasons


def test_constant_softmax_is_caught_by_norm_and_spread(cpu_worker, probed):
    const = (
        HEADER
        + "class ModelNew(nn.Module):\n    def forward(self, x):\n        return torch.full_like(x, 1 / x.shape[-1])\n"
    )
    v = evaluate(cpu_worker, probed["small_softmax"], const)
    assert v.status == Status.MISMATCH
    assert any(r.startswith("near_constant") for r in v.reasons), v.reasons
    assert not any("elements outside" in r for r in v.reasons)  # the loose atol alone would have passed it


def test_softmax_honest(cpu_worker, probed):
    honest = HEADER + (
        "class ModelNew(nn.Module):\n    def forward(self, x):\n"
        "        e = torch.exp(x - x.amax(-1, keepdim=True))\n        return e / e.sum(-1, keepdim=True)\n"
    )
    v = evaluate(cpu_worker, probed["small_softmax"], honest)
    assert v.status == Status.OK, v.reasons
