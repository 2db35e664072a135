"""The reference-anchored tolerance (pipeline/tolerance.py), the memory-aware float64 reference and the
mutation fingerprints (pipeline/verify.py, pipeline/gpu_memory.py), on the CPU with real torch."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch

from pipeline import gpu_memory, jobs, tolerance, verify
from pipeline.types import Status

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "tasks"
ATOL, RTOL, NORM = 1e-4, 1e-3, 1e-4  # the fp32 defaults


def tf32(x: torch.Tensor) -> torch.Tensor:
    """Round to 10 mantissa bits, as a TF32 tensor-core product sees its operands."""
    return ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


@pytest.fixture(scope="module")
def cancel():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 4096, generator=g)
    b = torch.randn(4096, 64, generator=g)
    c = b + 1e-3 * torch.randn(4096, 64, generator=g)
    ref = a.double() @ b.double() - a.double() @ c.double()
    return a, b, c, ref


def split_k(x: torch.Tensor, y: torch.Tensor, parts: int = 8) -> torch.Tensor:
    step = x.shape[1] // parts
    return sum(x[:, i : i + step] @ y[i : i + step] for i in range(0, x.shape[1], step))


def verdict_of(o: torch.Tensor, ref: torch.Tensor, anchor: tolerance.RefError) -> list[str]:
    stats = tolerance.compare_output(o, ref, ATOL, RTOL)
    return stats.reasons(0, ATOL, RTOL, NORM, anchor, tolerance.REF_ERROR_MULTIPLE)


def test_eager_fails_a_fixed_bound_but_passes_the_anchored_rule(cancel):
    a, b, c, ref = cancel
    eager = a @ b - a @ c
    anchor = tolerance.reference_error(eager, ref)
    assert anchor.rel_norm > NORM  # the fixed rule would reject the reference itself
    assert verdict_of(eager, ref, tolerance.RefError())  # ... as it did before the anchor
    assert verdict_of(eager, ref, anchor) == []


def test_honest_reordering_passes_and_low_precision_stand_ins_fail(cancel):
    a, b, c, ref = cancel
    anchor = tolerance.reference_error(a @ b - a @ c, ref)
    assert verdict_of(split_k(a, b) - split_k(a, c), ref, anchor) == []
    for stand_in in (
        tf32(a) @ tf32(b) - tf32(a) @ tf32(c),
        a.half().float() @ b.half().float() - a.half().float() @ c.half().float(),
    ):
        reasons = verdict_of(stand_in, ref, anchor)
        assert any(r.startswith("mismatch: output 0: relative error norm") for r in reasons), reasons
        assert any("elements outside" in r for r in reasons), reasons


def test_chunked_accumulation_matches_one_pass(monkeypatch, cancel):
    a, b, c, ref = cancel
    out = tf32(a) @ tf32(b) - a @ c
    whole = tolerance.compare_output(out, ref, ATOL, RTOL)
    monkeypatch.setattr(tolerance, "CHUNK", 1000)  # 4096 elements in 5 uneven chunks
    parts = tolerance.compare_output(out, ref, ATOL, RTOL)
    assert (parts.over_base, parts.bad_special, parts.numel) == (whole.over_base, whole.bad_special, 4096)
    assert parts.max_abs == whole.max_abs and parts.max_excess == whole.max_excess
    assert parts.rel_error == pytest.approx(whole.rel_error, rel=1e-9)
    assert parts.out_std == pytest.approx(whole.out_std, rel=1e-9)


def test_poison_constant_and_integer_outputs():
    ref = torch.randn(1000, dtype=torch.float64)
    poisoned = ref.float().clone()
    poisoned[7] = float("nan")
    reasons = verdict_of(poisoned, ref, tolerance.RefError())
    assert len(reasons) == 1 and reasons[0].startswith("unwritten_output: output 0 has 1 of 1000"), reasons
    reasons = verdict_of(torch.full((1000,), float(ref.mean())), ref, tolerance.RefError())
    assert any(r.startswith("near_constant") for r in reasons), reasons
    # An argmax may break a near-tie one way in float64 and the other in the task's dtype: either is right.
    ref_idx, eager_idx = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 5])
    ok = tolerance.compare_output(eager_idx, ref_idx, 0, 0, alt=eager_idx)
    assert ok.reasons(0, 0, 0, 0, tolerance.RefError(), 4) == []
    bad = tolerance.compare_output(torch.tensor([0, 1, 9, 5]), ref_idx, 0, 0, alt=eager_idx)
    assert bad.reasons(0, 0, 0, 0, tolerance.RefError(), 4) == [
        "mismatch: output 0 differs in 1 of 4 elements"
    ]


class PerRow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 16)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * 3


class AcrossRows(PerRow):
    def forward(self, x):
        return torch.tanh(self.lin(x)).cumsum(0)


@pytest.mark.parametrize(("model_cls", "free", "mode"), [(PerRow, 1 << 40, "full"), (PerRow, 0, "native")])
def test_reference_plan_full_or_native(model_cls, free, mode):
    model = model_cls().eval()
    x = torch.randn(64, 32)
    native, _ = verify.native_reference(model, [x])
    # With no memory, even a separable model cannot be sliced (zero rows): it falls back to native.
    plan = verify.plan_reference(model, [x], native, 1 << 20, torch.device("cpu"), ATOL, RTOL, free=free)
    assert plan.mode == mode
    assert (plan.note == "") == (mode == "full")


def test_batch_slices_give_the_same_float64_reference():
    model = PerRow().eval()
    x = torch.randn(64, 32)
    native, _ = verify.native_reference(model, [x])
    need = 1 << 20  # pretend the float64 forward needs more than is free: slices of 64 * 0.5 * 0.25 rows
    plan = verify.plan_reference(model, [x], native, need, torch.device("cpu"), ATOL, RTOL, free=need // 4)
    assert plan.mode == "batch" and 0 < plan.rows < 64, plan
    pieces = list(plan.pieces(1))
    assert len(pieces) > 1
    with torch.no_grad():
        whole = copy.deepcopy(model).double()(x.double())
    for rows, (out,) in pieces:
        torch.testing.assert_close(out, whole[rows], rtol=1e-12, atol=1e-12)


def test_not_separable_across_the_batch_falls_back_to_native():
    model = AcrossRows().eval()
    x = torch.randn(64, 32)
    native, _ = verify.native_reference(model, [x])
    plan = verify.plan_reference(model, [x], native, 1 << 20, torch.device("cpu"), ATOL, RTOL, free=1 << 18)
    assert plan.mode == "native" and "not separable" in plan.note


def test_fingerprint_sees_any_change_and_nan_is_stable():
    x = torch.randn(3000, 7)
    x[5, 5] = float("nan")
    kept = gpu_memory.fingerprint(x)
    assert gpu_memory.fingerprint(x.clone()) == kept
    for dtype in (torch.bfloat16, torch.float16, torch.int64, torch.bool):
        y = x.nan_to_num().to(dtype)
        assert gpu_memory.fingerprint(y) == gpu_memory.fingerprint(y.clone())
    y = x.clone()
    y.view(-1)[12345] = torch.nextafter(y.view(-1)[12345], torch.tensor(float("inf")))
    assert gpu_memory.fingerprint(y) != kept  # one ulp of one element
    assert gpu_memory.mutation_reasons([y, 3], [kept, 3]) == [
        "input_mutated: input 0 changed (its fingerprint differs; too large to keep a copy)"
    ]
    assert gpu_memory.mutation_reasons([y], [x.clone()]) == [
        "input_mutated: input 0 changed in 1 of 21000 elements"
    ]


def test_threads_are_attributed_to_the_code_that_started_them():
    verify.install_thread_origins()
    stop = threading.Event()
    ours = threading.Thread(target=stop.wait, name="harness-thread")
    ours.start()
    namespace: dict = {"threading": threading, "stop": stop}
    code = compile(
        "def go():\n    t = threading.Thread(target=stop.wait, name='cand')\n    t.start()\n    return t\n"
        "def body():\n    stop.wait()\n",
        f"{verify.CANDIDATE_FILE_PREFIX}k launcher.py>",
        "exec",
    )
    exec(code, namespace)
    started_by = namespace["go"]()
    runs_candidate_code = threading.Thread(target=namespace["body"], name="harness-started")
    runs_candidate_code.start()
    try:
        assert not verify.started_by_candidate(ours)
        assert verify.started_by_candidate(started_by)
        assert verify.started_by_candidate(runs_candidate_code)
    finally:
        stop.set()
        for t in (ours, started_by, runs_candidate_code):
            t.join()


@pytest.mark.slow
def test_cpu_worker_accepts_eager_and_rejects_tf32_on_the_cancellation_task(cpu_worker):
    r = cpu_worker.request(jobs.Probe(str(FIX / "small_cancel_gemm.py")))
    assert isinstance(r.answer, jobs.Probed), r.reason
    task = r.answer.task
    head = "import torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n    def forward(self, a, b, c):\n"
    eager = head + "        return a @ b - a @ c\n"
    tf = head + (
        "        r = lambda x: ((x.view(torch.int32) + 4096) & -8192).view(torch.float32)\n"
        "        return r(a) @ r(b) - r(a) @ r(c)\n"
    )
    verdicts = {}
    for name, launcher in (("eager", eager), ("tf32", tf)):
        job = jobs.Evaluate(task, jobs.CandidateCode(name, launcher), jobs.Settings(device="cpu", trials=3))
        res = cpu_worker.request(job)
        assert isinstance(res.answer, jobs.Evaluated), res.reason
        verdicts[name] = res.answer.verdict
    assert verdicts["eager"].status == Status.OK, verdicts["eager"].reasons
    assert verdicts["eager"].ref_rel_error > task.norm_tol  # the reference's own error, recorded
    assert verdicts["tf32"].status == Status.MISMATCH
    assert any(r.startswith("mismatch") for r in verdicts["tf32"].reasons)


def test_three_tf32_products_pass_where_one_fails():
    """3xTF32 (a_hi*b_hi + a_hi*b_lo + a_lo*b_hi, each operand split into TF32 parts) stays within the
    anchored fp32 rule; a single TF32 product does not: the split is what makes tensor cores fp32-accurate."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(128, 4096, generator=g), torch.randn(4096, 128, generator=g)
    ref = a.double() @ b.double()
    anchor = tolerance.reference_error(a @ b, ref)
    a_hi, b_hi = tf32(a), tf32(b)
    a_lo, b_lo = tf32(a - a_hi), tf32(b - b_hi)
    three = a_hi @ b_hi + (a_hi @ b_lo + a_lo @ b_hi)
    assert verdict_of(three, ref, anchor) == []
    assert verdict_of(a_hi @ b_hi, ref, anchor)


def test_a_scalar_near_zero_is_judged_by_atol_not_by_its_ratio():
    """A sum that cancels to nearly zero: an honest error of 3e-5 is a ratio of 3e-4, above norm_tol, but
    within atol; the same output 1e-3 off still fails."""
    ref = torch.tensor([0.1], dtype=torch.float64)
    anchor = tolerance.RefError(abs_max=1e-6, rel_norm=1e-5)
    assert verdict_of(torch.tensor([0.1 + 3e-5]), ref, anchor) == []
    reasons = verdict_of(torch.tensor([0.1 + 1e-3]), ref, anchor)
    assert any("relative error norm" in r for r in reasons), reasons


def test_the_one_pass_kernel_leaves_cpu_tensors_to_the_torch_form():
    """pipeline/fused_stats.py works on CUDA tensors only; here the comparison is the torch form's (the GPU
    test holds the two equal and checks what else the kernel refuses)."""
    from pipeline import fused_stats

    x = torch.randn(8, 6)
    assert not fused_stats.usable(x, x)
    assert fused_stats.figures(x, x, 1e-4, 1e-3) is None
    stats = tolerance.OutputStats()
    stats.add(x, x.double(), 1e-4, 1e-3)
    assert stats._settle()["out_n"] == 48 and stats._settle()["max_abs"] == 0.0
