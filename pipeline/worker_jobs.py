"""The jobs a worker runs (child side of worker.py): probe a task, evaluate a candidate, time baselines,
calibrate. Each takes its job record and returns an answer record (pipeline/jobs.py); candidate failures
come back as statuses, and a job that leaves the CUDA context unusable asks to be restarted (`exit`).
"""

from __future__ import annotations

import platform
import time
import types
from typing import Any

import torch

from pipeline import gpu_memory, jobs, reasons, tasks, verify
from pipeline.jobs import Answer, CandidateCode, Job
from pipeline.phases import phase
from pipeline.types import Baselines, Measurement, Status, Task, Timing, Verdict

_compiled: dict[tuple[str, str], tuple[Any, float]] = {}  # (task hash, mode) -> (compiled model, compile s)


def handle(job: Job) -> Answer:
    match job:
        case jobs.Ping():
            return jobs.Pong()
        case jobs.Probe():
            return _probe(job)
        case jobs.Environment():
            return jobs.EnvironmentAnswer(environment=environment(job.device))
        case jobs.Calibrate():
            from pipeline.calibrate import measure_ceilings

            reference_precision()
            try:
                return jobs.Calibrated(ceilings=measure_ceilings(environment("cuda")))
            finally:
                _release_memory()
        case jobs.Evaluate():
            try:
                return _evaluate(job)
            finally:
                # A bench's workers outlive its tasks: cached blocks kept here (inputs, outputs, the poison)
                # are memory the reference worker and the profiler's process cannot have for the next task.
                if torch.cuda.is_initialized():
                    torch.cuda.empty_cache()
        case jobs.Baseline():
            return _baseline(job)
        case jobs.SystemProfile():
            return _system_profile(job)
    return jobs.Failed(error=f"a worker runs no {job.KIND!r} job")


def _probe(job: jobs.Probe) -> Answer:
    try:
        return jobs.Probed(task=tasks.probe(job.path))
    except tasks.TaskError as e:
        return jobs.Failed(error=str(e), task_error=True)


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
            Status.REJECTED, f"{reasons.STATIC}:no_model_new: the launcher defines no class ModelNew"
        )
    return model_new


def candidate_factory(cand: CandidateCode) -> type:
    """ModelNew of a candidate: its cubin loaded, its launcher run."""
    kernels = None
    if cand.cubin_path:
        from pipeline.runtime import Kernels

        kernels = Kernels.from_file(cand.cubin_path, cand.kernel_names)
        # Modules stay loaded for the worker's life: an unloaded module's code address is reused by the
        # next one, and the profiler then reports the new kernels under the old kernels' names (seen on
        # the H200: a candidate's kernel listed as its parent's, failing the kernels-ran check). Answers
        # carry the count, and the orchestrator recycles a worker that reaches MAX_LOADED_MODULES.
        _LOADED.append(kernels)
    return load_launcher(cand.launcher, kernels, cand.key)


MAX_LOADED_MODULES = 4096  # cubins of generated kernels are tens of KB; a worker restart frees them all
_LOADED: list[Any] = []
verify.install_thread_origins()  # this module is imported only where candidates run


def _evaluate(job: jobs.Evaluate) -> Answer:
    """Verify (pipeline/verify.py), then measure (pipeline/measure.py: timed calls checked, hidden work, eager,
    profiler confirmation, speed sanity, energy), then re-verify a suspiciously fast result on other shapes."""
    s, task, cand = job.settings, job.task, job.candidate
    key = cand.key
    device = torch.device(s.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return jobs.Failed(error="no CUDA device visible to the worker")
    reference_precision()
    module = tasks.module_from_task(task)
    init_args = list(module.get_init_inputs())
    kind = cand.kind
    library_ops = list(cand.library_ops)

    def verdict(status: Status, why: list[str], proto: verify.ProtocolResult | None = None) -> Verdict:
        return Verdict(
            candidate_key=key,
            status=status,
            trials=proto.trials if proto else 0,
            trials_passed=proto.trials_passed if proto else 0,
            worst_rel_error=proto.worst_rel_error if proto else None,
            worst_abs_error=proto.worst_abs_error if proto else None,
            ref_rel_error=max(proto.ref_rel) if proto and proto.ref_rel else None,
            kind=kind,
            library_ops=tuple(library_ops),
            reasons=tuple(why),
        )

    def answer(v: Verdict, m: Measurement | None = None) -> Answer:
        oom = any(reasons.code_of(r) == reasons.OUT_OF_MEMORY for r in v.reasons)
        return jobs.Evaluated(
            verdict=v, measurement=m, exit=v.status == Status.CRASH or oom, loaded_modules=len(_LOADED)
        )

    try:
        factory = candidate_factory(cand)
    except verify.CandidateFailure as f:
        return answer(verdict(f.status, [f.reason]))
    except Exception as e:
        f = verify.raised(e, "loading the candidate")
        return answer(verdict(f.status, [f.reason]))

    out_bytes = sum(o.numel * _itemsize(o.dtype) for o in task.outputs)
    seconds: dict[str, float] = {}
    with phase(seconds, "verify"):
        try:
            proto = verify.run_protocol(
                module,
                init_args,
                factory,
                device,
                trials=s.trials,
                seed=s.seed,
                atol=task.atol,
                rtol=task.rtol,
                norm_tol=task.norm_tol,
                out_bytes=out_bytes,
            )
        except verify.CandidateFailure as f:
            return answer(verdict(f.status, [f.reason]))
        except Exception as e:
            return answer(verdict(*_crashed(e, "verifying the candidate")))
    why = list(proto.reasons)
    if proto.status != Status.OK or device.type != "cuda" or not s.time:
        return answer(verdict(proto.status, why, proto))

    from pipeline import measure

    try:
        session = measure.Session(module, init_args, factory, device, task, s, proto)
        outcome = measure.measure(session, kind, cand.kernel_names, job.ceilings)
    except verify.CandidateFailure as f:
        return answer(verdict(f.status, [*why, f.reason], proto))
    except Exception as e:
        status, crash = _crashed(e, "measuring the candidate")
        return answer(verdict(status, [*why, *crash], proto))
    why += outcome.reasons
    library_ops += [k for k in outcome.library if k not in library_ops]
    status = outcome.status
    if status == Status.SUSPICIOUS and _alt_verifies(
        module, init_args, factory, device, s, task, why, outcome.below_floor
    ):
        status = Status.OK
    m = Measurement(
        candidate_key=key,
        status=status,
        timing=outcome.timing,
        baselines=outcome.baselines,
        energy=outcome.energy,
        floor_ms=outcome.floor_ms,
        environment=environment("cuda"),
        reasons=tuple(why),
        seconds={**seconds, **outcome.seconds},
        kernels=outcome.kernels,
    )
    return answer(verdict(status, why, proto), m)


def _crashed(e: Exception, what: str) -> tuple[Status, list[str]]:
    """A CUDA error from the candidate's kernels can surface at any later call (launches are asynchronous),
    outside the calls that are checked one by one: with the context broken it is the candidate's crash (and
    the worker restarts); with the context alive the harness itself failed, and that is raised."""
    if verify.cuda_alive():
        raise e
    f = verify.raised(e, what, Status.CRASH)
    return f.status, [f.reason]


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _compile(task: Task, reference, mode: str, notes: list[str]):
    """torch.compile'd reference, compiled once per worker; compile time kept out of the timing."""
    key = (task.source_hash, mode)
    if key not in _compiled:
        t0 = time.perf_counter()
        try:
            compiled = torch.compile(reference, mode=None if mode == "compile" else mode)
            module = tasks.module_from_task(task)
            warm = verify.make_inputs(module, 12345, torch.device("cuda"))
            with torch.no_grad():
                compiled(*warm)
            torch.cuda.synchronize()
        except Exception as e:
            notes.append(f"{reasons.NOTE}: baseline {mode} failed: {verify._describe(e)}")
            return None
        _compiled[key] = (compiled, time.perf_counter() - t0)
    return _compiled[key][0]


def _alt_verifies(
    module, init_args, factory, device, s: jobs.Settings, task: Task, why: list[str], below_floor: bool
) -> bool:
    """Re-verify a too-fast candidate on the task's other shapes; only a pass on all of them clears it."""
    if not hasattr(module, "get_alt_inputs"):
        why.append(f"{reasons.NOTE}: the task has no get_alt_inputs() to re-verify on other shapes")
        return False
    if below_floor:
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
            seed=s.seed + 500 + i,
            atol=task.atol,
            rtol=task.rtol,
            norm_tol=task.norm_tol,
            out_bytes=1 << 28,
        )
        if proto.status != Status.OK:
            why.append(
                f"{reasons.TOO_FAST}: re-verification on alt shape {i} failed: {'; '.join(proto.reasons[:2])}"
            )
            return False
    why.append(
        f"{reasons.NOTE}: faster than {s.suspicious_speedup:g}x over eager; re-verified on {count} other shapes"
    )
    return True


def _baseline(job: jobs.Baseline) -> Answer:
    """Eager and torch.compile timings of the reference (the reference worker: torch.compile execs ptxas)."""
    from pipeline import timing

    s, task = job.settings, job.task
    if not torch.cuda.is_available():
        return jobs.Failed(error="no CUDA device visible to the worker")
    reference_precision()
    module = tasks.module_from_task(task)
    init_args = list(module.get_init_inputs())
    device = torch.device("cuda")
    reference = verify.build_reference(module, init_args, s.seed, device, redraw_constant=False)
    seed = s.seed + 101

    def inputs_for(call: int) -> list:
        return verify.make_inputs(module, seed + 7919 * call, device)

    stale = [k for k in _compiled if k[0] != task.source_hash]
    for k in stale:
        del _compiled[k]  # another task's compiled model keeps its weights on the GPU: gone before eager runs
    if stale:
        _release_memory()
    flusher = timing.L2Flusher(device, s.l2_flush)
    timings: dict[str, Timing] = {}
    compile_s: dict[str, float] = {}
    notes: list[str] = []
    eager_energy = None
    try:
        for mode in s.baselines:
            model = reference if mode == "eager" else _compile(task, reference, mode, notes)
            if model is None:
                continue
            timings[mode] = timing.time_cuda(
                model,
                inputs_for,
                trials=s.timing_trials,
                budget_s=s.timing_budget_s,
                warmup=s.warmup,
                flusher=flusher,
            )
            if mode != "eager":
                compile_s[mode] = _compiled[(task.source_hash, mode)][1]
        if s.energy:
            from pipeline.energy import EnergyUnavailable, LoopMismatch, measure_energy

            try:
                eager_energy = measure_energy(
                    reference,
                    inputs_for,
                    call_ms=timings["eager"].median_ms,
                    window_s=s.energy_window_s,
                    repeats=s.energy_repeats,
                    max_repeats=s.energy_max_repeats,
                    target_spread=s.energy_spread,
                    set_bytes=sum(spec.numel * _itemsize(spec.dtype) for spec in task.inputs),
                    out_bytes=sum(spec.numel * _itemsize(spec.dtype) for spec in task.outputs),
                    free_bytes=gpu_memory.free_bytes(device),
                )
            except (EnergyUnavailable, LoopMismatch, KeyError) as e:
                notes.append(f"energy not measured: {e}")
        env = environment("cuda")
    finally:
        del reference, flusher
        _release_memory()
    energy_j = eager_energy.joules_per_call if eager_energy else None
    base = Baselines(timings, energy_j, None, compile_s, env, tuple(notes), energy_eager=eager_energy)
    return jobs.BaselinesAnswer(baselines=base)


def _release_memory() -> None:
    """The reference worker shares the GPU with the candidate workers: it holds no cached memory between
    jobs (a task with 7.5 GB inputs needs all the memory the protocol can get)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def _system_profile(job: jobs.SystemProfile) -> Answer:
    """Kernels per call, GPU busy time and launch gaps of a (verified) candidate, or of the reference."""
    from pipeline.profile.system import system_profile

    reference_precision()
    module = tasks.module_from_task(job.task)
    init_args = list(module.get_init_inputs())
    device = torch.device("cuda")
    seed = job.settings.seed
    model = verify.build_reference(module, init_args, seed, device, redraw_constant=False)
    if job.candidate is not None:
        model, _ = verify.build_candidate(candidate_factory(job.candidate), init_args, seed, device, model)
    inputs = verify.make_inputs(module, seed + 101, device)
    return jobs.SystemProfiled(system=system_profile(model, inputs), loaded_modules=len(_LOADED))
