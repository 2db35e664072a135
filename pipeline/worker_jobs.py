"""The jobs a worker runs (child side of worker.py): probe a task, evaluate a candidate, time baselines,
calibrate. Each takes and returns JSON-ready dicts; candidate failures come back as statuses, and a job
that leaves the CUDA context unusable asks to be restarted (`"exit": true`).
"""

from __future__ import annotations

import platform
import types
from typing import Any

import torch

from pipeline import tasks, verify
from pipeline.types import Kind, Measurement, Status, Task, Timing, Verdict, from_dict, to_dict

SUSPICIOUS_FLOOR_MARGIN = 0.8  # faster than 80% of the roofline floor is physically doubtful
NO_WORK_FRACTION = 0.05  # our kernels' GPU time under 5% of the memory floor: they did not do the work
TIMING_INPUT_SETS = 3

_compiled: dict[tuple[str, str], tuple[Any, float]] = {}  # (task hash, mode) -> (compiled model, compile s)


def handle(job: dict[str, Any]) -> dict[str, Any]:
    kind = job.get("kind")
    if kind == "ping":
        return {"pong": True}
    if kind == "probe":
        return _probe(job)
    if kind == "environment":
        return {"environment": environment(job.get("device", "cuda"))}
    if kind == "calibrate":
        from pipeline.calibrate import measure_ceilings

        reference_precision()
        return {"ceilings": measure_ceilings(environment("cuda")).__dict__}
    if kind == "evaluate":
        return _evaluate(job)
    if kind == "baseline":
        return _baseline(job)
    if kind == "system_profile":
        return _system_profile(job)
    return {"error": f"unknown job kind {kind!r}"}


def _probe(job: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"task": to_dict(tasks.probe(job["path"]))}
    except tasks.TaskError as e:
        return {"error": str(e), "task_error": True}


def reference_precision() -> None:
    """The reference contract: no TF32 anywhere, for the reference, the baselines and hybrid candidates."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def environment(device: str) -> dict[str, str]:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": str(torch.version.cuda),
    }
    try:
        import cupy

        env["cupy"] = cupy.__version__
    except ImportError:
        pass
    if device == "cuda" and torch.cuda.is_available():
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        env.update(
            gpu=props.name,
            sm_count=str(props.multi_processor_count),
            capability=f"{props.major}.{props.minor}",
        )
        try:
            import pynvml

            from pipeline.energy import nvml_handle

            h = nvml_handle(torch.device("cuda", dev))
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
            env["sm_clock_mhz"] = str(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
            env["mem_clock_mhz"] = str(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM))
            env["max_sm_clock_mhz"] = str(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM))
            env["power_limit_w"] = str(pynvml.nvmlDeviceGetEnforcedPowerLimit(h) // 1000)
        except Exception as e:  # NVML missing or refusing: the record says so instead of failing the job
            env["nvml"] = f"unavailable: {e}"
    return env


def load_launcher(source: str, kernels: Any, key: str) -> type:
    module = types.ModuleType(f"kernelpro_candidate_{key}")
    module.__dict__["kernels"] = kernels
    exec(compile(source, f"<candidate {key} launcher.py>", "exec"), module.__dict__)
    model_new = module.__dict__.get("ModelNew")
    if not isinstance(model_new, type):
        raise verify.CandidateFailure(
            Status.REJECTED, "static:no_model_new: the launcher defines no class ModelNew"
        )
    return model_new


def candidate_factory(cand: dict[str, Any]) -> type:
    """ModelNew of a candidate record (launcher, key, cubin_path, kernel_names): cubin loaded, launcher run."""
    kernels = None
    if cand.get("cubin_path"):
        from pipeline.runtime import Kernels

        kernels = Kernels.from_file(cand["cubin_path"], tuple(cand.get("kernel_names", ())))
        # Modules stay loaded for the worker's life: an unloaded module's code address is reused by the
        # next one, and the profiler then reports the new kernels under the old kernels' names (seen on
        # the H200: a candidate's kernel listed as its parent's, failing the kernels-ran check).
        _LOADED.append(kernels)
        del _LOADED[:-MAX_LOADED_MODULES]
    return load_launcher(cand["launcher"], kernels, cand["key"])


MAX_LOADED_MODULES = 4096  # cubins of generated kernels are tens of KB; a worker restart frees them all
_LOADED: list[Any] = []


def timing_inputs(module, seed: int, device: torch.device) -> tuple[list, Any]:
    """The rotated input sets and the L2 flusher that candidate and baselines are timed with."""
    from pipeline import timing

    sets = [verify.make_inputs(module, seed + 101 + i, device) for i in range(TIMING_INPUT_SETS)]
    return sets, timing.L2Flusher(device)


def _evaluate(job: dict[str, Any]) -> dict[str, Any]:
    s = job["settings"]
    task = from_dict(Task, job["task"])
    cand = job["candidate"]
    key = cand["key"]
    device = torch.device(s["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        return {"error": "no CUDA device visible to the worker"}
    reference_precision()
    module = tasks.load_module(task.path)
    init_args = list(module.get_init_inputs())
    kind = Kind(cand.get("kind", "custom"))
    library_ops = list(cand.get("library_ops", []))

    def verdict(status: Status, reasons: list[str], proto: verify.ProtocolResult | None = None) -> Verdict:
        return Verdict(
            candidate_key=key,
            status=status,
            trials=proto.trials if proto else 0,
            trials_passed=proto.trials_passed if proto else 0,
            worst_rel_error=proto.worst_rel_error if proto else None,
            worst_abs_error=proto.worst_abs_error if proto else None,
            kind=kind,
            library_ops=tuple(library_ops),
            reasons=tuple(reasons),
        )

    def answer(v: Verdict, m: Measurement | None = None) -> dict[str, Any]:
        spent = v.status == Status.CRASH or any("out of GPU memory" in r for r in v.reasons)
        return {"verdict": to_dict(v), "measurement": to_dict(m) if m else None, "exit": spent}

    try:
        factory = candidate_factory(cand)
    except verify.CandidateFailure as f:
        return answer(verdict(f.status, [f.reason]))
    except Exception as e:
        return answer(
            verdict(
                Status.LAUNCH_ERROR, [f"launch_error: loading the candidate raised {verify._describe(e)}"]
            )
        )

    out_bytes = sum(o.numel * _itemsize(o.dtype) for o in task.outputs)
    proto = verify.run_protocol(
        module,
        init_args,
        factory,
        device,
        trials=s["trials"],
        seed=s["seed"],
        atol=task.atol,
        rtol=task.rtol,
        norm_tol=task.norm_tol,
        out_bytes=out_bytes,
    )
    reasons = list(proto.reasons)
    if proto.status != Status.OK or device.type != "cuda" or not s.get("time", True):
        return answer(verdict(proto.status, reasons, proto))

    try:
        measurement, status, more = _measure(job, task, module, init_args, factory, device, kind, library_ops)
    except verify.CandidateFailure as f:
        return answer(verdict(f.status, [*reasons, f.reason], proto))
    reasons += more
    if status == Status.SUSPICIOUS and _alt_verifies(module, init_args, factory, device, s, task, reasons):
        status = Status.OK
    return answer(verdict(status, reasons, proto), measurement)


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _measure(job, task: Task, module, init_args, factory, device, kind: Kind, library_ops: list[str]):
    """Time the candidate and the baselines in this process, check the profile and the speed, then energy."""
    from pipeline import timing

    s = job["settings"]
    reasons: list[str] = []
    status = Status.OK
    reference = verify.build_reference(module, init_args, s["seed"], device, redraw_constant=False)
    candidate, _ = verify.build_candidate(factory, init_args, s["seed"], device, reference)
    input_sets, flusher = timing_inputs(module, s["seed"], device)
    kwargs = dict(
        trials=s["timing_trials"], budget_s=s["timing_budget_s"], warmup=s["warmup"], flusher=flusher
    )
    try:
        ours = timing.time_cuda(candidate, input_sets, **kwargs)
    except Exception as e:
        st = Status.LAUNCH_ERROR if verify.cuda_alive() else Status.CRASH
        raise verify.CandidateFailure(st, f"{st.value}: timing runs raised {verify._describe(e)}") from None
    hidden = timing.hidden_work(ours)
    if hidden:
        return (
            Measurement(candidate_key=job["candidate"]["key"], status=Status.REJECTED, timing=ours),
            Status.REJECTED,
            [hidden],
        )

    baselines: dict[str, Timing] = {}
    for mode in s.get("baselines", []):
        model = reference if mode == "eager" else _compile(task, reference, mode, reasons)
        if model is not None:
            baselines[mode] = timing.time_cuda(model, input_sets, **kwargs)

    ceilings = job.get("ceilings")
    floor = None
    if ceilings:
        from pipeline.calibrate import Ceilings, floor_ms

        floor = floor_ms(task, Ceilings(**ceilings))
    bandwidth = ceilings["copy_bytes_per_s"] if ceilings else 3e12
    profile_status, profile_reasons, runtime_library = _profile_check(
        candidate, input_sets[0], tuple(job["candidate"].get("kernel_names", ())), task, bandwidth, kind
    )
    reasons += profile_reasons
    library_ops += [k for k in runtime_library if k not in library_ops]
    if profile_status != Status.OK:
        status = profile_status
    elif floor is not None and ours.median_ms < SUSPICIOUS_FLOOR_MARGIN * floor:
        status = Status.SUSPICIOUS
        reasons.append(f"too_fast: {ours.median_ms:.4f} ms is below the roofline floor of {floor:.4f} ms")
    elif "eager" in baselines and baselines["eager"].median_ms / ours.median_ms > s["suspicious_speedup"]:
        status = Status.SUSPICIOUS
        reasons.append(
            f"too_fast: {baselines['eager'].median_ms / ours.median_ms:.1f}x over eager "
            f"(above {s['suspicious_speedup']:g}x)"
        )

    energy = None
    if s.get("energy") and status in (Status.OK, Status.SUSPICIOUS):
        from pipeline.energy import EnergyUnavailable, measure_energy

        try:
            energy = measure_energy(
                candidate,
                input_sets[0],
                call_ms=ours.median_ms,
                window_s=s["energy_window_s"],
                repeats=s["energy_repeats"],
            )
        except EnergyUnavailable as e:
            reasons.append(f"note: energy not measured: {e}")
    m = Measurement(
        candidate_key=job["candidate"]["key"],
        status=status,
        timing=ours,
        baselines=baselines,
        energy=energy,
        floor_ms=floor,
        environment=environment("cuda"),
        reasons=tuple(reasons),
    )
    return m, status, reasons


def _compile(task: Task, reference, mode: str, reasons: list[str]):
    """torch.compile'd reference, compiled once per worker; compile time kept out of the timing."""
    import time

    key = (task.source_hash, mode)
    if key not in _compiled:
        t0 = time.perf_counter()
        try:
            compiled = torch.compile(reference, mode=None if mode == "compile" else mode)
            module = tasks.load_module(task.path)
            warm = verify.make_inputs(module, 12345, torch.device("cuda"))
            with torch.no_grad():
                compiled(*warm)
            torch.cuda.synchronize()
        except Exception as e:
            reasons.append(f"note: baseline {mode} failed: {verify._describe(e)}")
            return None
        _compiled[key] = (compiled, time.perf_counter() - t0)
    return _compiled[key][0]


def _profile_check(
    candidate, inputs, kernel_names: tuple[str, ...], task: Task, bandwidth: float, kind: Kind
):
    """Confirm with the profiler that our kernels ran and did a real share of the work."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        candidate(*inputs)
        torch.cuda.synchronize()
    ours_us = 0.0
    ours_count = 0
    others: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA:
            continue
        us = evt.time_range.elapsed_us()
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
                f"kernels_not_run: the profiler saw none of {list(kernel_names)} "
                f"(saw {len(others)} other kernels: {sorted(others)[:3]})"
            ],
            library,
        )
    floor_us = task.min_bytes / bandwidth * 1e6
    if ours_us < NO_WORK_FRACTION * floor_us:
        return (
            Status.REJECTED,
            [
                f"kernels_no_work: our kernels ran {ours_us:.1f} us against a memory floor of "
                f"{floor_us:.1f} us; the work was done elsewhere"
            ],
            library,
        )
    if kind == Kind.CUSTOM and others_us > ours_us:
        return (
            Status.REJECTED,
            [
                f"undeclared_library_work: library kernels ran {others_us:.1f} us against "
                f"{ours_us:.1f} us in ours: {library}"
            ],
            library,
        )
    return Status.OK, [], library if kind == Kind.HYBRID else []


def _alt_verifies(module, init_args, factory, device, s, task: Task, reasons: list[str]) -> bool:
    """Re-verify a too-fast candidate on the task's other shapes; only a pass on all of them clears it."""
    if not hasattr(module, "get_alt_inputs"):
        reasons.append("note: the task has no get_alt_inputs() to re-verify on other shapes")
        return False
    if any(r.startswith("too_fast") and "roofline floor" in r for r in reasons):
        return False  # faster than physics allows: no shape makes that right
    count = len(module.get_alt_inputs())
    for i in range(count):
        shim = types.SimpleNamespace(Model=module.Model, get_inputs=lambda i=i: module.get_alt_inputs()[i])
        proto = verify.run_protocol(
            shim,
            init_args,
            factory,
            device,
            trials=1,
            seed=s["seed"] + 500 + i,
            atol=task.atol,
            rtol=task.rtol,
            norm_tol=task.norm_tol,
            out_bytes=1 << 28,
        )
        if proto.status != Status.OK:
            reasons.append(
                f"too_fast: re-verification on alt shape {i} failed: {'; '.join(proto.reasons[:2])}"
            )
            return False
    reasons.append(
        f"note: faster than {s['suspicious_speedup']:g}x over eager; re-verified on {count} other shapes"
    )
    return True


def _baseline(job: dict[str, Any]) -> dict[str, Any]:
    from pipeline import timing

    s = job["settings"]
    if not torch.cuda.is_available():
        return {"error": "no CUDA device visible to the worker"}
    reference_precision()
    task = from_dict(Task, job["task"])
    module = tasks.load_module(task.path)
    init_args = list(module.get_init_inputs())
    device = torch.device("cuda")
    reference = verify.build_reference(module, init_args, s["seed"], device, redraw_constant=False)
    input_sets, flusher = timing_inputs(module, s["seed"], device)
    out: dict[str, Any] = {"timings": {}, "compile_s": {}, "notes": []}
    for mode in s["baselines"]:
        model = reference if mode == "eager" else _compile(task, reference, mode, out["notes"])
        if model is None:
            continue
        t = timing.time_cuda(
            model,
            input_sets,
            trials=s["timing_trials"],
            budget_s=s["timing_budget_s"],
            warmup=s["warmup"],
            flusher=flusher,
        )
        out["timings"][mode] = to_dict(t)
        if mode != "eager":
            out["compile_s"][mode] = _compiled[(task.source_hash, mode)][1]
    if s.get("energy"):
        from pipeline.energy import EnergyUnavailable, measure_energy

        try:
            e = measure_energy(
                reference,
                input_sets[0],
                call_ms=out["timings"]["eager"]["median_ms"],
                window_s=s["energy_window_s"],
                repeats=s["energy_repeats"],
            )
            out["energy_eager"] = to_dict(e)
        except (EnergyUnavailable, KeyError) as e:
            out["notes"].append(f"energy not measured: {e}")
    out["environment"] = environment("cuda")
    return out


def _system_profile(job: dict[str, Any]) -> dict[str, Any]:
    """Kernels per call, GPU busy time and launch gaps of a (verified) candidate, or of the reference."""
    from pipeline.profile.system import system_profile

    reference_precision()
    task = from_dict(Task, job["task"])
    module = tasks.load_module(task.path)
    init_args = list(module.get_init_inputs())
    device = torch.device("cuda")
    seed = job["settings"]["seed"]
    model = verify.build_reference(module, init_args, seed, device, redraw_constant=False)
    cand = job.get("candidate")
    if cand:
        model, _ = verify.build_candidate(candidate_factory(cand), init_args, seed, device, model)
    inputs = verify.make_inputs(module, seed + 101, device)
    return {"system": system_profile(model, inputs)}
