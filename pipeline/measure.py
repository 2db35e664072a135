"""The measuring half of the worker's evaluate job, after verification passed (worker_jobs._evaluate):

    time the candidate      every call on fresh inputs, every call's outputs checked against eager
    hidden work             host time of synchronised calls against their events
    eager baseline          the reference in the same process, timed the same way
    profiler confirmation   one more checked call under CUPTI: our kernels ran, and did work in proportion
                            to the bytes they were handed (custom: to the whole task's bytes)
    speed sanity            faster than the roofline floor, or than suspicious_speedup x eager
    energy                  NVML loop over fresh sets, sampled outputs checked, loop speed vs timed median

Each failure raises verify.CandidateFailure with a reason code (pipeline/reasons.py); the caller turns it into
the verdict.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from pipeline import gpu_memory, reasons, verify
from pipeline.calibrate import Ceilings, floor_ms
from pipeline.jobs import Settings
from pipeline.phases import phase
from pipeline.types import Energy, Kind, Status, Task, Timing, speedup

SUSPICIOUS_FLOOR_MARGIN = 0.8  # faster than 80% of the roofline floor is physically doubtful
NO_WORK_FRACTION = (
    0.05  # our kernels' GPU time under 5% of the floor of their bytes: they did not do the work
)
INPUT_SEED_OFFSET = 101
KERNEL_NAME_CHARS = 120  # of a kernel's name in Measurement.kernels (a library's templated names run long)


@dataclass
class Outcome:
    status: Status = Status.OK
    timing: Timing | None = None
    baselines: dict[str, Timing] = field(default_factory=dict)
    energy: Energy | None = None
    floor_ms: float | None = None
    library: list[str] = field(default_factory=list)  # library kernels that ran (hybrid candidates)
    reasons: list[str] = field(default_factory=list)
    below_floor: bool = False  # SUSPICIOUS for beating the roofline floor, not only for beating eager
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each phase below
    kernels: dict[str, float] = field(default_factory=dict)  # the checked call's kernels, us by name

    def phase(self, name: str) -> AbstractContextManager[None]:
        return phase(self.seconds, name)


class Session:
    """The reference, the candidate and the fresh-input factory that every measurement below shares."""

    def __init__(
        self,
        module: ModuleType,
        init_args: list,
        factory: Any,
        device: torch.device,
        task: Task,
        settings: Settings,
        proto: verify.ProtocolResult,
    ):
        from pipeline import timing

        self.module, self.device, self.task, self.s, self.proto = module, device, task, settings, proto
        seed = settings.seed
        self.reference = verify.build_reference(module, init_args, seed, device, redraw_constant=False)
        self.candidate, _ = verify.build_candidate(factory, init_args, seed, device, self.reference)
        self.flusher = timing.L2Flusher(device, settings.l2_flush)
        self._seed = seed + INPUT_SEED_OFFSET
        self.checked = 0

    def inputs_for(self, call: int) -> list:
        """Inputs from the task's own factory, new for every call (a seed per call)."""
        return verify.make_inputs(self.module, self._seed + 7919 * call, self.device)

    def check(self, inputs: list, outputs: Any) -> None:
        """Raise MISMATCH unless `outputs` are what eager gives on the same `inputs`."""
        with torch.no_grad():
            expected = verify.as_list(self.reference(*inputs))
        t = self.task
        why = verify.check_outputs(verify.as_list(outputs), expected, t.atol, t.rtol, t.norm_tol, self.proto)
        self.checked += 1
        if why:
            raise verify.CandidateFailure(
                Status.MISMATCH,
                f"{reasons.TIMED_OUTPUT_MISMATCH}: a measured call (one of {self.checked} checked) returned "
                f"a wrong result: {why[0]}",
            )

    def timing_kwargs(self) -> dict[str, Any]:
        s = self.s
        return dict(trials=s.timing_trials, budget_s=s.timing_budget_s, warmup=s.warmup, flusher=self.flusher)

    def checked_timing_kwargs(self) -> dict[str, Any]:
        """The candidate's timing: its timed calls checked against eager, a random share of them."""
        return dict(self.timing_kwargs(), check=self.check, check_fraction=self.s.check_fraction)


def measure(
    session: Session, kind: Kind, kernel_names: tuple[str, ...], ceilings: Ceilings | None
) -> Outcome:
    """Everything after verification, in the order of the module docstring."""
    from pipeline import timing

    out = Outcome()
    s = session.s
    try:
        with out.phase("timing"):
            out.timing = timing.time_cuda(
                session.candidate, session.inputs_for, **session.checked_timing_kwargs()
            )
    except verify.CandidateFailure:
        raise
    except Exception as e:
        st = Status.LAUNCH_ERROR if verify.cuda_alive() else Status.CRASH
        raise verify.raised(e, "timing runs", st) from None
    from pipeline import runtime

    out.reasons += [f"{reasons.NOTE}: {n}" for n in runtime.graph_notes(session.candidate)]
    hidden = timing.hidden_work(out.timing)
    if hidden:
        out.status = Status.REJECTED
        out.reasons.append(hidden)
        return out
    if "eager" in s.baselines:
        with out.phase("eager"):
            out.baselines["eager"] = timing.time_cuda(
                session.reference, session.inputs_for, **session.timing_kwargs()
            )
    bandwidth = ceilings.copy_bytes_per_s if ceilings else 3e12
    if ceilings:
        out.floor_ms = floor_ms(session.task, ceilings)
    with out.phase("profile_check"):
        status, why, out.library, out.kernels = profile_check(session, kernel_names, bandwidth, kind)
    out.reasons += why
    if status != Status.OK:
        out.status = status
        return out
    median = out.timing.median_ms
    eager = out.baselines.get("eager")
    over_eager = speedup(eager.median_ms if eager else None, median)
    if out.floor_ms is not None and median < SUSPICIOUS_FLOOR_MARGIN * out.floor_ms:
        out.status, out.below_floor = Status.SUSPICIOUS, True
        out.reasons.append(
            f"{reasons.TOO_FAST}: {median:.4f} ms is below the roofline floor of {out.floor_ms:.4f} ms"
        )
    elif over_eager is not None and over_eager > s.suspicious_speedup:
        out.status = Status.SUSPICIOUS
        out.reasons.append(
            f"{reasons.TOO_FAST}: {over_eager:.1f}x over eager (above {s.suspicious_speedup:g}x)"
        )
    if s.energy and out.status in (Status.OK, Status.SUSPICIOUS):
        with out.phase("energy"):
            out.energy = energy(session, median, out.reasons)
    return out


def profile_check(
    session: Session, kernel_names: tuple[str, ...], bandwidth: float, kind: Kind
) -> tuple[Status, list[str], list[str], dict[str, float]]:
    """One checked call under the profiler: our kernels ran, did a real share of the work, and (custom) the
    libraries did not do it instead. Returns the status, its reasons, the library kernels a hybrid ran, and
    every kernel's microseconds by name (KERNEL_NAME_CHARS of it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pipeline import runtime

    inputs = session.inputs_for(50_000)
    runtime.LAUNCHES = log = runtime.LaunchLog()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
            outputs = session.candidate(*inputs)
            torch.cuda.synchronize()
    finally:
        runtime.LAUNCHES = None
    session.check(inputs, outputs)
    del outputs
    ours_us = 0.0
    ours_count = 0
    others: dict[str, float] = {}
    ran: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA:
            continue
        us = evt.time_range.elapsed_us()
        short = evt.name[:KERNEL_NAME_CHARS]
        ran[short] = ran.get(short, 0.0) + us
        if evt.name in kernel_names:
            ours_us += us
            ours_count += 1
        else:
            others[evt.name] = others.get(evt.name, 0.0) + us
    others_us = sum(others.values())
    library = [f"kernel {n[:80]}" for n, _ in sorted(others.items(), key=lambda kv: -kv[1])[:5]]
    if ours_count == 0:
        return (
            Status.REJECTED,
            [
                f"{reasons.KERNELS_NOT_RUN}: the profiler saw none of {list(kernel_names)} "
                f"(saw {len(others)} other kernels: {sorted(others)[:3]})"
            ],
            library,
            ran,
        )
    # A custom candidate owes the whole task's bytes; a hybrid one the bytes it handed its own kernels (its
    # GEMMs in cuBLAS move the weights, its ReLU in our kernel only the activations).
    if kind == Kind.CUSTOM:
        owed, what = session.task.min_bytes, "the task's memory floor"
    else:
        owed, what = (
            log.claimed_bytes,
            f"the floor of the {log.claimed_bytes / 1e6:.1f} MB our kernels were given",
        )
    floor_us = owed / bandwidth * 1e6
    if ours_us < NO_WORK_FRACTION * floor_us:
        return (
            Status.REJECTED,
            [
                f"{reasons.KERNELS_NO_WORK}: our kernels ran {ours_us:.1f} us against {what} ({floor_us:.1f} us); "
                "the work was done elsewhere"
            ],
            library,
            ran,
        )
    if kind == Kind.CUSTOM and others_us > ours_us:
        return (
            Status.REJECTED,
            [
                f"{reasons.UNDECLARED_LIBRARY_WORK}: library kernels ran {others_us:.1f} us against "
                f"{ours_us:.1f} us in ours: {library}"
            ],
            library,
            ran,
        )
    return Status.OK, [], library if kind == Kind.HYBRID else [], ran


def energy(session: Session, call_ms: float, notes: list[str]) -> Energy | None:
    from pipeline.energy import EnergyUnavailable, LoopMismatch, measure_energy

    s = session.s
    task = session.task
    set_bytes = sum(spec.numel * _itemsize(spec.dtype) for spec in task.inputs)
    out_bytes = sum(spec.numel * _itemsize(spec.dtype) for spec in task.outputs)
    try:
        return measure_energy(
            session.candidate,
            session.inputs_for,
            call_ms=call_ms,
            window_s=s.energy_window_s,
            repeats=s.energy_repeats,
            max_repeats=s.energy_max_repeats,
            target_spread=s.energy_spread,
            check=session.check,
            set_bytes=set_bytes,
            out_bytes=out_bytes,
            free_bytes=gpu_memory.free_bytes(session.device),
        )
    except EnergyUnavailable as e:
        notes.append(f"{reasons.NOTE}: energy not measured: {e}")
    except LoopMismatch as e:
        raise verify.CandidateFailure(Status.REJECTED, str(e)) from None
    return None


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()
