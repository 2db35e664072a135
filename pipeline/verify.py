"""The correctness protocol and its anti-cheat checks (docs/harness.md is the published form).

Runs inside the worker. Device-agnostic where it can be, so that CI exercises it on the CPU with Python
stand-in candidates; the GPU-only parts (allocator poisoning, the profiler) are skipped on the CPU.
Every failure is a reason string that starts with a code (`mismatch: ...`), matched on by tests and reports.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from pipeline.types import Status

NEAR_CONSTANT = 1e-3  # output spread below this fraction of the reference's spread is "near-constant"
POISON_BYTE = 0xFF  # NaN in every float format, -1 in signed integers


@dataclass
class TrialReport:
    passed: bool
    rel_error: float = 0.0
    abs_error: float = 0.0
    reasons: list[str] = field(default_factory=list)
    status: Status = Status.OK


@dataclass
class ProtocolResult:
    status: Status
    trials: int
    trials_passed: int
    worst_rel_error: float | None
    worst_abs_error: float | None
    reasons: list[str]


class CandidateFailure(Exception):
    """The candidate raised while being built or run; carries the status to report."""

    def __init__(self, status: Status, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)


def make_inputs(task_module: ModuleType, seed: int, device: torch.device, getter: str = "get_inputs") -> list:
    """Fresh inputs from the task's own factory, created directly on the device (no host round trip)."""
    seed_all(seed)
    with torch.device(device):
        inputs = list(getattr(task_module, getter)())
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs]
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 1 and not bool(x.any()):
            raise ValueError(f"task input {i} is all zeros; a task must give random, non-zero inputs")
    return inputs


def build_reference(
    task_module: ModuleType, init_args: list, seed: int, device: torch.device, redraw_constant: bool
) -> torch.nn.Module:
    """The reference model; with `redraw_constant`, parameters initialised to one value (LayerNorm's ones and
    zeros) are drawn at random, so a candidate that ignores a weight or bias cannot pass."""
    seed_all(seed)
    with torch.device(device):
        model = task_module.Model(*init_args)
    model = model.to(device).eval()
    if redraw_constant:
        gen = torch.Generator(device="cpu").manual_seed(seed + 7919)
        with torch.no_grad():
            for p in list(model.parameters()) + list(model.buffers()):
                if p.is_floating_point() and p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                    noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                    p.copy_((p.float().cpu() + 0.5 * noise).to(p.dtype))
    return model


def build_candidate(
    factory: Callable[..., torch.nn.Module],
    init_args: list,
    seed: int,
    device: torch.device,
    reference: torch.nn.Module,
) -> tuple[torch.nn.Module, list[str]]:
    """ModelNew with the reference's weights copied in by name (seeded construction covers the rest)."""
    notes: list[str] = []
    seed_all(seed)
    try:
        with torch.device(device):
            model = factory(*init_args)
        model = model.to(device).eval()
    except Exception as e:
        raise CandidateFailure(
            Status.LAUNCH_ERROR, f"launch_error: ModelNew(...) raised {_describe(e)}"
        ) from None
    ref_state = reference.state_dict()
    if ref_state:
        cand_state = model.state_dict()
        matched = {k: v for k, v in ref_state.items() if k in cand_state and cand_state[k].shape == v.shape}
        if matched:
            model.load_state_dict(matched, strict=False)
        if len(matched) < len(ref_state):
            missing = sorted(set(ref_state) - set(matched))
            notes.append(
                f"parameters not matched by name and shape, relying on seeded initialisation: {missing}"
            )
    return model, notes


def poison_allocator(device: torch.device, nbytes: int) -> None:
    """Leave the caching allocator full of NaN-filled free blocks, so that memory a candidate allocates and
    never writes reads back as poison. Both pools: large blocks and the 2 MB segments of small ones."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    big = torch.empty(max(nbytes, 64 << 20), dtype=torch.uint8, device=device)
    big.fill_(POISON_BYTE)
    small = [torch.empty(s, dtype=torch.uint8, device=device) for s in (512, 4096, 65536, 512 << 10) * 8]
    for t in small:
        t.fill_(POISON_BYTE)
    torch.cuda.synchronize(device)
    del big, small


def run_candidate(model: torch.nn.Module, inputs: list) -> list[torch.Tensor]:
    threads_before = {t.ident for t in threading.enumerate()}
    try:
        with torch.no_grad():
            out = model(*inputs)
        if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].is_cuda:
            torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        raise CandidateFailure(
            Status.LAUNCH_ERROR, f"launch_error: out of GPU memory: {_describe(e)}"
        ) from None
    except Exception as e:
        status = Status.LAUNCH_ERROR if cuda_alive() else Status.CRASH
        code = "launch_error" if status == Status.LAUNCH_ERROR else "crash"
        raise CandidateFailure(status, f"{code}: forward raised {_describe(e)}") from None
    new_threads = [t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
    if new_threads:
        raise CandidateFailure(
            Status.REJECTED, f"background_thread: forward left threads running: {new_threads}"
        )
    return _as_list(out)


def cuda_alive() -> bool:
    """False once the CUDA context is broken (illegal address, trap): nothing more can run in this process."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return True
    try:
        torch.cuda.synchronize()
        return bool(torch.ones(1, device="cuda").add_(1).item() == 2)
    except Exception:
        return False


def _as_list(out: Any) -> list:
    return list(out) if isinstance(out, list | tuple) else [out]


def to_double(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    return x


def reference_fp64(reference: torch.nn.Module, inputs: list) -> list[torch.Tensor]:
    """The reference in float64 where the ops allow, else in its own precision."""
    ref64 = copy.deepcopy(reference).double()
    try:
        with torch.no_grad():
            out = _as_list(ref64(*[to_double(x) for x in inputs]))
    except (RuntimeError, NotImplementedError, TypeError):
        with torch.no_grad():
            out = _as_list(reference(*inputs))
    del ref64
    return out


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def check_aliasing(outputs: list, inputs: list) -> list[str]:
    spans = [
        (i, storage_span(x)) for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.numel() > 0
    ]
    reasons = []
    for j, o in enumerate(outputs):
        if not isinstance(o, torch.Tensor) or o.numel() == 0:
            continue
        lo, hi = storage_span(o)
        for i, (a, b) in spans:
            if lo < b and a < hi:
                reasons.append(f"output_aliases_input: output {j} shares memory with input {i}")
    return reasons


def check_inputs_unchanged(inputs: list, originals: list) -> list[str]:
    reasons = []
    for i, (x, x0) in enumerate(zip(inputs, originals, strict=True)):
        if isinstance(x, torch.Tensor) and not torch.equal(x, x0):
            changed = int((x != x0).sum())
            reasons.append(f"input_mutated: input {i} changed in {changed} of {x.numel()} elements")
    return reasons


def compare(
    outputs: list, expected_native: list, expected64: list, atol: float, rtol: float, norm_tol: float
) -> TrialReport:
    """Candidate outputs against the float64 reference: structure, poison, elementwise and norm bounds."""
    report = TrialReport(passed=True)
    if len(outputs) != len(expected64):
        report.reasons.append(
            f"shape_mismatch: {len(outputs)} outputs, the reference returns {len(expected64)}"
        )
    for j, (o, native, r) in enumerate(zip(outputs, expected_native, expected64, strict=False)):
        if not isinstance(o, torch.Tensor):
            report.reasons.append(f"shape_mismatch: output {j} is a {type(o).__name__}, not a tensor")
            continue
        if o.shape != native.shape:
            report.reasons.append(
                f"shape_mismatch: output {j} has shape {tuple(o.shape)}, expected {tuple(native.shape)}"
            )
            continue
        if o.dtype != native.dtype:
            report.reasons.append(f"dtype_mismatch: output {j} is {o.dtype}, expected {native.dtype}")
            continue
        if o.device != native.device:
            report.reasons.append(f"device_mismatch: output {j} is on {o.device}, expected {native.device}")
            continue
        report.reasons += _compare_values(j, o, r, atol, rtol, norm_tol, report)
    report.passed = not report.reasons
    report.status = Status.OK if report.passed else Status.MISMATCH
    return report


def _compare_values(
    j: int, o: torch.Tensor, r: torch.Tensor, atol: float, rtol: float, norm_tol: float, report: TrialReport
) -> list[str]:
    reasons = []
    if not o.is_floating_point():
        wrong = int((o != r.to(o.dtype)).sum())
        if wrong:
            reasons.append(f"mismatch: output {j} differs in {wrong} of {o.numel()} elements")
        return reasons
    od, rd = o.double(), r.double()
    ref_finite = torch.isfinite(rd)
    unwritten = int((torch.isnan(od) & ref_finite).sum())
    if unwritten:
        reasons.append(
            f"unwritten_output: output {j} has {unwritten} of {o.numel()} elements never written (NaN poison)"
        )
        return reasons
    bad_special = int((torch.isfinite(od) != ref_finite).sum())
    diff = (od - rd).abs().nan_to_num(0.0)
    allowed = atol + rtol * rd.abs().nan_to_num(0.0)
    over = int((diff > allowed).sum()) + bad_special
    abs_err = float(diff.max()) if diff.numel() else 0.0
    ref_norm = float(torch.linalg.vector_norm(rd.nan_to_num(0.0)))
    rel = (
        float(torch.linalg.vector_norm(diff)) / ref_norm
        if ref_norm > 0
        else (0.0 if abs_err == 0 else math.inf)
    )
    report.rel_error = max(report.rel_error, rel)
    report.abs_error = max(report.abs_error, abs_err)
    if o.numel() > 16:
        ref_spread = float(rd[ref_finite].std()) if int(ref_finite.sum()) > 1 else 0.0
        out_spread = float(od[torch.isfinite(od)].std()) if int(torch.isfinite(od).sum()) > 1 else 0.0
        if ref_spread > 0 and out_spread < NEAR_CONSTANT * ref_spread:
            reasons.append(
                f"near_constant: output {j} spread {out_spread:.3g} against the reference's {ref_spread:.3g}"
            )
    if over:
        reasons.append(
            f"mismatch: output {j}: {over} of {o.numel()} elements outside atol={atol:g} rtol={rtol:g} "
            f"(max abs error {abs_err:.3g})"
        )
    if rel > norm_tol:
        reasons.append(f"mismatch: output {j}: relative error norm {rel:.3g} above {norm_tol:g}")
    return reasons


def _describe(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def run_protocol(
    task_module: ModuleType,
    init_args: list,
    factory: Callable[..., torch.nn.Module],
    device: torch.device,
    *,
    trials: int,
    seed: int,
    atol: float,
    rtol: float,
    norm_tol: float,
    out_bytes: int,
    getter: str = "get_inputs",
) -> ProtocolResult:
    """Several trials, each: fresh inputs, poison, candidate, reference, candidate again, all checks."""
    reasons: list[str] = []
    worst_rel = worst_abs = 0.0
    passed = 0
    status = Status.OK
    models: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}
    for t in range(trials):
        # Trial 1 uses a second weight initialisation; trial 2 reuses the first instance on new inputs, so a
        # candidate that memoises its first answer is caught.
        init = 1 if t == 1 else 0
        try:
            if init not in models:
                reference = build_reference(
                    task_module, init_args, seed + 1000 * init, device, redraw_constant=init == 1
                )
            inputs = make_inputs(task_module, seed + 17 * (t + 1), device, getter)
        except ValueError as e:
            return ProtocolResult(Status.REJECTED, t, passed, None, None, [f"bad_task: {e}"])
        try:
            if init not in models:
                candidate, notes = build_candidate(factory, init_args, seed + 1000 * init, device, reference)
                models[init] = (reference, candidate)
                reasons += [f"note: {n}" for n in notes]
            reference, candidate = models[init]
            originals = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
            # Sized from the probed output specs: running the reference here would leave its result behind.
            poison_allocator(device, 4 * out_bytes)
            first = run_candidate(candidate, inputs)  # before the reference: nothing stale to find
            native = _as_list(_reference_outputs(reference, inputs))
            structural = check_aliasing(first, inputs) + check_inputs_unchanged(inputs, originals)
            if structural:
                return ProtocolResult(Status.REJECTED, t + 1, passed, None, None, reasons + structural)
            second = run_candidate(candidate, inputs)  # after it: the classic harness order
            structural = check_aliasing(second, inputs) + check_inputs_unchanged(inputs, originals)
            if structural:
                return ProtocolResult(Status.REJECTED, t + 1, passed, None, None, reasons + structural)
        except CandidateFailure as f:
            return ProtocolResult(f.status, t + 1, passed, None, None, [*reasons, f.reason])
        expected64 = reference_fp64(reference, inputs)
        trial_ok = True
        for label, outs in (("first run", first), ("run after the reference", second)):
            report = compare(outs, native, expected64, atol, rtol, norm_tol)
            worst_rel, worst_abs = max(worst_rel, report.rel_error), max(worst_abs, report.abs_error)
            if not report.passed:
                trial_ok = False
                status = Status.MISMATCH
                reasons += [
                    f"{r} (trial {t}, {label})" for r in report.reasons if f"{r} (trial" not in reasons
                ]
        if trial_ok:
            passed += 1
        del first, second, native, expected64, inputs, originals
        if not trial_ok:
            return ProtocolResult(status, t + 1, passed, worst_rel, worst_abs, _dedupe(reasons))
    return ProtocolResult(status, trials, passed, worst_rel, worst_abs, _dedupe(reasons))


def _reference_outputs(reference: torch.nn.Module, inputs: list) -> Any:
    with torch.no_grad():
        return reference(*inputs)


def _dedupe(items: list[str]) -> list[str]:
    seen: set[str] = set()
    return [x for x in items if not (x in seen or seen.add(x))]
