"""The correctness protocol and its anti-cheat checks (docs/harness.md is the published form).

Runs inside the worker. Device-agnostic where it can be, so that CI exercises it on the CPU with Python
stand-in candidates; the GPU-only parts (allocator poisoning, the profiler) are skipped on the CPU.
Every failure is a reason string that starts with a code (`mismatch: ...`, pipeline/reasons.py), matched
on by tests and reports.
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from pipeline import gpu_memory, reasons, tolerance
from pipeline.types import Status


@dataclass
class ProtocolResult:
    status: Status
    trials: int
    trials_passed: int
    worst_rel_error: float | None
    worst_abs_error: float | None
    reasons: list[str]
    # per output, the worst over trials: how far eager is from float64 (the anchor of the tolerance rule)
    ref_abs: list[float] = field(default_factory=list)
    ref_rel: list[float] = field(default_factory=list)
    reference_mode: str = ""  # full | batch | native: how the float64 reference was made (last trial)


class CandidateFailure(Exception):
    """The candidate raised while being built or run; carries the status to report."""

    def __init__(self, status: Status, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


def raised(e: BaseException, what: str, status: Status = Status.LAUNCH_ERROR) -> CandidateFailure:
    """`what` raised `e`. An out-of-memory has a code of its own: the worker restarts after it."""
    if isinstance(e, torch.OutOfMemoryError):
        return CandidateFailure(
            Status.LAUNCH_ERROR, f"{reasons.OUT_OF_MEMORY}: out of GPU memory: {what} raised {_describe(e)}"
        )
    code = reasons.CRASH if status == Status.CRASH else reasons.LAUNCH_ERROR
    return CandidateFailure(status, f"{code}: {what} raised {_describe(e)}")


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
        raise raised(e, "ModelNew(...)") from None
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


def run_candidate(model: torch.nn.Module, inputs: list) -> list[torch.Tensor]:
    threads_before = {t.ident for t in threading.enumerate()}
    try:
        with torch.no_grad():
            out = model(*inputs)
        if _on_cuda(inputs):
            torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        raise CandidateFailure(
            Status.LAUNCH_ERROR, f"{reasons.OUT_OF_MEMORY}: out of GPU memory: {_describe(e)}"
        ) from None
    except Exception as e:
        raise raised(e, "forward", Status.LAUNCH_ERROR if cuda_alive() else Status.CRASH) from None
    new_threads = [
        t
        for t in threading.enumerate()
        if t.ident not in threads_before and t.is_alive() and started_by_candidate(t)
    ]
    if new_threads:
        raise CandidateFailure(
            Status.REJECTED,
            f"{reasons.BACKGROUND_THREAD}: forward left threads running: {[t.name for t in new_threads]}",
        )
    return as_list(out)


# -- whose thread is it -----------------------------------------------------------------------------------
# A thread torch starts for itself (Inductor's `subproc_worker_timer`, seen rejecting an honest candidate) is
# not the candidate's. Thread.start is wrapped once per worker to note whether candidate code was on the
# stack; a thread whose target is candidate code is the candidate's wherever it was started.
CANDIDATE_FILE_PREFIX = "<candidate "  # the filename worker_jobs.load_launcher compiles launchers under


def _candidate_on_stack(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith(CANDIDATE_FILE_PREFIX):
            return True
        frame = frame.f_back
    return False


def _is_candidate_code(fn: Any) -> bool:
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.startswith(CANDIDATE_FILE_PREFIX)


def install_thread_origins() -> None:
    start = threading.Thread.start
    if getattr(start, "kernelpro_origin", False):
        return

    def traced_start(self: threading.Thread, *args: Any, **kwargs: Any) -> Any:
        self.kernelpro_by_candidate = _candidate_on_stack(sys._getframe(1))  # type: ignore[attr-defined]
        return start(self, *args, **kwargs)

    traced_start.kernelpro_origin = True  # type: ignore[attr-defined]
    threading.Thread.start = traced_start  # type: ignore[method-assign]


def started_by_candidate(t: threading.Thread) -> bool:
    if getattr(t, "kernelpro_by_candidate", False):
        return True
    if _is_candidate_code(getattr(t, "_target", None)):
        return True
    run = type(t).run
    return run is not threading.Thread.run and _is_candidate_code(run)


def cuda_alive() -> bool:
    """False once the CUDA context is broken (illegal address, trap): nothing more can run in this process."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return True
    try:
        torch.cuda.synchronize()
        return bool(torch.ones(1, device="cuda").add_(1).item() == 2)
    except Exception:
        return False


def as_list(out: Any) -> list:
    return list(out) if isinstance(out, list | tuple) else [out]


def to_double(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    return x


def _on_cuda(inputs: list) -> bool:
    return any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs)


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def check_aliasing(outputs: list, inputs: list) -> list[str]:
    spans = [
        (i, storage_span(x)) for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.numel() > 0
    ]
    found = []
    for j, o in enumerate(outputs):
        if not isinstance(o, torch.Tensor) or o.numel() == 0:
            continue
        lo, hi = storage_span(o)
        for i, (a, b) in spans:
            if lo < b and a < hi:
                found.append(f"{reasons.OUTPUT_ALIASES_INPUT}: output {j} shares memory with input {i}")
    return found


# -- the reference ----------------------------------------------------------------------------------------
def native_reference(reference: torch.nn.Module, inputs: list) -> tuple[list[torch.Tensor], int]:
    """The reference in the task's own dtype, and the peak memory it took beyond what was allocated before."""
    cuda = _on_cuda(inputs)
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = as_list(reference(*inputs))
    peak = torch.cuda.max_memory_allocated() - before if cuda else 0
    return out, int(peak)


@dataclass
class Reference:
    """The float64 reference of one trial: whole (`full`), produced slice by slice along the batch dimension
    (`batch`), or, when float64 fits neither way, the task's-dtype reference itself (`native`)."""

    mode: str
    outputs: list[torch.Tensor] | None = None  # full: the float64 outputs
    model64: torch.nn.Module | None = None  # batch: the float64 model, run on row ranges
    inputs: list | None = None
    batch: int = 0
    rows: int = 0
    note: str = ""

    def pieces(self, n_out: int) -> Iterator[tuple[slice, list[torch.Tensor]]]:
        """(rows, float64 outputs for those rows) over the whole batch; a single piece when full."""
        if self.mode == "full":
            assert self.outputs is not None
            yield slice(None), self.outputs
            return
        assert self.model64 is not None and self.inputs is not None
        for start in range(0, self.batch, self.rows):
            rows = slice(start, min(start + self.rows, self.batch))
            with torch.no_grad():
                outs = as_list(self.model64(*[to_double(_rows(x, rows, self.batch)) for x in self.inputs]))
            yield rows, outs[:n_out]
            del outs


def _rows(x: Any, rows: slice, batch: int) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
        return x[rows]
    return x


def _fp64_factor(native: list[torch.Tensor]) -> float:
    sizes = [o.element_size() for o in native if isinstance(o, torch.Tensor) and o.is_floating_point()]
    return 8.0 / min(sizes) if sizes else 2.0


def plan_reference(
    reference: torch.nn.Module,
    inputs: list,
    native: list[torch.Tensor],
    native_peak: int,
    device: torch.device,
    atol: float,
    rtol: float,
    free: int | None = None,
) -> Reference:
    """The float64 reference, in whatever form fits in the memory left (`free` overrides the measurement)."""
    factor = _fp64_factor(native)
    in_bytes = sum(x.numel() * 8 for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point())
    param_bytes = sum(p.numel() * 8 for p in reference.state_dict().values() if p.is_floating_point())
    need = int(factor * native_peak + in_bytes + param_bytes)
    free = gpu_memory.free_bytes(device) if free is None else free
    try:
        model64 = copy.deepcopy(reference).double()
    except (RuntimeError, NotImplementedError, TypeError) as e:
        return Reference(
            "native", note=f"reference in the task's dtype: float64 copy failed ({_describe(e)})"
        )
    if need <= 0.8 * free:
        try:
            with torch.no_grad():
                outs = as_list(model64(*[to_double(x) for x in inputs]))
            return Reference("full", outputs=outs)
        except torch.OutOfMemoryError:
            _release(device)
        except (RuntimeError, NotImplementedError, TypeError) as e:
            return Reference("native", note=f"reference in the task's dtype: float64 failed ({_describe(e)})")
    batch = _batch_size(inputs, native)
    if batch > 1 and _separable(reference, inputs, native, batch, atol, rtol):
        rows = int(batch * 0.5 * free / max(need, 1))
        if 1 <= rows < batch:
            return Reference(
                "batch",
                model64=model64,
                inputs=inputs,
                batch=batch,
                rows=rows,
                note=f"float64 reference in slices of {rows} of {batch} rows (the whole needs "
                f"{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free)",
            )
    return Reference(
        "native",
        note=f"reference in the task's dtype: float64 needs {need / 2**30:.1f} GiB, "
        f"{free / 2**30:.1f} GiB free, and the task is not separable along its batch dimension",
    )


def _batch_size(inputs: list, native: list[torch.Tensor]) -> int:
    """The leading size every output shares with some input: a batch dimension, if the model is per-row."""
    lead = {o.shape[0] if o.dim() else -1 for o in native}
    if len(lead) != 1:
        return 0
    (b,) = lead
    if b <= 1 or not any(isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == b for x in inputs):
        return 0
    return b


def _separable(
    reference: torch.nn.Module, inputs: list, native: list[torch.Tensor], batch: int, atol: float, rtol: float
) -> bool:
    """True when the rows of the output depend only on the same rows of the input: the model run on a quarter
    of the batch from its middle (a prefix would not catch a cumulative op) reproduces those rows of its
    whole-batch output."""
    quarter = max(1, batch // 4)
    rows = slice(batch // 2, batch // 2 + quarter)
    try:
        with torch.no_grad():
            part = as_list(reference(*[_rows(x, rows, batch) for x in inputs]))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    if len(part) != len(native):
        return False
    for p, full in zip(part, native, strict=True):
        if p.shape != full[rows].shape:
            return False
        stats = tolerance.compare_output(p, full[rows], atol, rtol)
        if stats.wrong or stats.unwritten or stats.bad_special or stats.max_excess > 0:
            return False
    return True


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# -- the protocol -----------------------------------------------------------------------------------------
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
    result = ProtocolResult(Status.OK, 0, 0, None, None, [])
    models: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}
    for t in range(trials):
        result.trials = t + 1
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
            result.status, result.reasons = Status.REJECTED, [f"{reasons.BAD_TASK}: {e}"]
            return result
        try:
            if init not in models:
                candidate, notes = build_candidate(factory, init_args, seed + 1000 * init, device, reference)
                models[init] = (reference, candidate)
                result.reasons += [f"{reasons.NOTE}: {n}" for n in notes]
            reference, candidate = models[init]
            ok = _trial(t, reference, candidate, inputs, device, atol, rtol, norm_tol, out_bytes, result)
        except CandidateFailure as f:
            result.status = f.status
            result.reasons.append(f.reason)
            return result
        finally:
            _release(device)
        if not ok:
            result.reasons = _dedupe(result.reasons)
            return result
        result.trials_passed += 1
    result.reasons = _dedupe(result.reasons)
    return result


def _trial(
    t: int,
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    inputs: list,
    device: torch.device,
    atol: float,
    rtol: float,
    norm_tol: float,
    out_bytes: int,
    result: ProtocolResult,
) -> bool:
    kept = gpu_memory.keep_for_mutation_check(inputs, device)
    # Sized from the probed output specs: running the reference here would leave its result behind.
    gpu_memory.poison_allocator(device, 4 * out_bytes)
    first = run_candidate(candidate, inputs)  # before the reference: nothing stale to find
    structural = check_aliasing(first, inputs) + gpu_memory.mutation_reasons(inputs, kept)
    if structural:
        result.status = Status.REJECTED
        result.reasons += structural
        return False
    try:
        native, peak = native_reference(reference, inputs)
    except torch.OutOfMemoryError:
        # Eager must fit beside what the protocol holds: move the candidate's outputs to the host and retry.
        first = [o.cpu() if isinstance(o, torch.Tensor) else o for o in first]
        _release(device)
        native, peak = native_reference(reference, inputs)
    second = run_candidate(candidate, inputs)  # after it: the classic harness order
    structural = check_aliasing(second, inputs) + gpu_memory.mutation_reasons(inputs, kept)
    del kept
    if structural:
        result.status = Status.REJECTED
        result.reasons += structural
        return False
    shapes = tolerance.structure_reasons(first, native) + tolerance.structure_reasons(second, native)
    if shapes:
        result.status = Status.MISMATCH
        result.reasons += [f"{r} (trial {t})" for r in _dedupe(shapes)]
        return False
    runs = {"first run": first}
    if not _same_bits(first, second):  # a deterministic candidate's second run needs no second comparison
        runs["run after the reference"] = second
    else:
        del second
    ref = plan_reference(reference, inputs, native, peak, device, atol, rtol)
    if ref.note:
        result.reasons.append(f"{reasons.NOTE}: {ref.note}")
    result.reference_mode = ref.mode
    anchors = [tolerance.OutputStats() for _ in native]
    stats = {label: [tolerance.OutputStats() for _ in native] for label in runs}
    if ref.mode == "native":
        pieces: Iterator[tuple[slice, list[torch.Tensor]]] = iter([(slice(None), native)])
    else:
        pieces = ref.pieces(len(native))
    for rows, ref_outs in pieces:
        for j, r in enumerate(ref_outs):
            nat = _take(native[j], rows)
            if ref.mode != "native":
                _accumulate(anchors[j], nat, r, 0.0, 0.0)
            for label, outs in runs.items():
                _accumulate(stats[label][j], _take(outs[j], rows), r, atol, rtol, nat)
    del ref
    ok = True
    _grow(result, len(native))
    for j, a in enumerate(anchors):
        anchor = tolerance.RefError(abs_max=a.max_abs, rel_norm=a.rel_error)
        result.ref_abs[j] = max(result.ref_abs[j], anchor.abs_max)
        result.ref_rel[j] = max(result.ref_rel[j], anchor.rel_norm)
        for label, per_output in stats.items():
            s = per_output[j]
            if not s.integer:
                result.worst_rel_error = max(result.worst_rel_error or 0.0, s.rel_error)
                result.worst_abs_error = max(result.worst_abs_error or 0.0, s.max_abs)
            why = s.reasons(j, atol, rtol, norm_tol, anchor, tolerance.REF_ERROR_MULTIPLE)
            if why:
                ok = False
                result.status = Status.MISMATCH
                result.reasons += [f"{r} (trial {t}, {label})" for r in why]
    return ok


def _take(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t if rows == slice(None) else t[rows]


def _grow(result: ProtocolResult, n: int) -> None:
    while len(result.ref_abs) < n:
        result.ref_abs.append(0.0)
    while len(result.ref_rel) < n:
        result.ref_rel.append(0.0)


def _accumulate(
    stats: tolerance.OutputStats,
    o: torch.Tensor,
    r: torch.Tensor,
    atol: float,
    rtol: float,
    alt: torch.Tensor | None = None,
) -> None:
    of, rf = tolerance.flat(o), tolerance.flat(r)
    af = tolerance.flat(alt) if alt is not None else None
    for a, b in tolerance.chunks(rf):
        stats.add(of[a:b].to(rf.device), rf[a:b], atol, rtol, af[a:b] if af is not None else None)


def _same_bits(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        isinstance(x, torch.Tensor)
        and isinstance(y, torch.Tensor)
        and x.shape == y.shape
        and x.dtype == y.dtype
        and x.device == y.device
        and torch.equal(gpu_memory.bits(x), gpu_memory.bits(y))
        for x, y in zip(a, b, strict=True)
    )


def check_outputs(
    outputs: list,
    expected: list[torch.Tensor],
    atol: float,
    rtol: float,
    norm_tol: float,
    proto: ProtocolResult,
) -> list[str]:
    """A timed call's outputs against eager's on the same inputs. Eager is itself up to E from float64, so
    the allowance is one E more than verification's (see tolerance.py)."""
    why = tolerance.structure_reasons(as_list(outputs), expected)
    if why:
        return why
    multiple = tolerance.REF_ERROR_MULTIPLE + 1
    for j, (o, e) in enumerate(zip(as_list(outputs), expected, strict=True)):
        stats = tolerance.OutputStats()
        _accumulate(stats, o, e, atol, rtol)
        anchor = tolerance.RefError(
            abs_max=proto.ref_abs[j] if j < len(proto.ref_abs) else 0.0,
            rel_norm=proto.ref_rel[j] if j < len(proto.ref_rel) else 0.0,
        )
        why += stats.reasons(j, atol, rtol, norm_tol + anchor.rel_norm, anchor, multiple)
    return why


def _dedupe(items: list[str]) -> list[str]:
    seen: set[str] = set()
    return [x for x in items if not (x in seen or seen.add(x))]


def _describe(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"
