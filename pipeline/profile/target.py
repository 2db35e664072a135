"""The process Nsight Compute wraps: load a task and a candidate, warm up, then run one call between
cudaProfilerStart and cudaProfilerStop (ncu runs with --profile-from-start off), so only that call's
kernels are replayed. Candidate code runs here, in a process of its own, never in the orchestrator.

    python -m pipeline.profile.target job.json
    python -m pipeline.profile.target --wait SCRATCH [LOCK]   (started ahead: imports, CUDA up between
                                                              profiles (LOCK), then waits for SCRATCH/job.json)

The job may carry a sandbox plan (pipeline/sandbox.py): its late layers (Landlock, seccomp) go on once CUDA,
CuPy and the task's reference are up, before the candidate's cubin and launcher are loaded. The namespaces
were applied to ncu's whole tree by the trampoline that started ncu.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
from pathlib import Path

from pipeline import jobs, sandbox

WARMUP_CALLS = 2
JOB_FILE = "job.json"  # what a waiting target looks for in its scratch folder (written whole, by a rename)
CUDA_UP_FILE = "cuda-up"  # left in its scratch folder by a waiting target once CUDA is up
TIMES_FILE = "target-times.json"  # wall-clock marks of the target's steps, for the profile's seconds by part
POLL_S = 0.005
IDLE_S = 600.0  # a waiting target whose job never comes exits (its orchestrator died or moved on)


def _idle_s(given: float | None) -> float:
    """How long a waiting target waits for its job: `given`, else KERNELPRO_NCU_IDLE_S, else IDLE_S."""
    return float(os.environ.get("KERNELPRO_NCU_IDLE_S", IDLE_S)) if given is None else given


def wait_for_job(scratch: Path, idle_s: float | None = None) -> Path | None:
    """The job file once it appears in `scratch`, or None after `idle_s` (KERNELPRO_NCU_IDLE_S) without one."""
    path = scratch / JOB_FILE
    deadline = time.monotonic() + _idle_s(idle_s)
    while not path.exists():
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)
    return path


def cuda_up_between_profiles(scratch: Path, lock_path: Path, idle_s: float | None = None) -> bool:
    """Bring CUDA up before the job comes: under ncu's injection that is 1.0-1.4 s of a profile on the H100
    (benchmarks/ncu_parts.py), and an idle context beside the harness's timing moved it by nothing
    measurable (0.1942 ms with and without). It is done holding the profiles' lock (collect.NCU_LOCK), so
    never while another ncu replays, and given up once the job is there: then the job brings CUDA up, as
    without this. True when CUDA is up; a failure here is left for the job to meet and report."""
    import torch
    from filelock import FileLock, Timeout

    deadline = time.monotonic() + _idle_s(idle_s)
    if not torch.cuda.is_available():
        return False
    lock = FileLock(lock_path)
    while not (scratch / JOB_FILE).exists() and time.monotonic() < deadline:
        try:
            lock.acquire(timeout=0.05)
        except Timeout:
            continue
        except OSError:  # the lock is out of this process's reach: CUDA comes up with the job
            return False
        try:
            torch.empty(1, device="cuda")
            torch.cuda.synchronize()
            (scratch / CUDA_UP_FILE).touch()
            return True
        except Exception:
            return False
        finally:
            lock.release()
    return False


def main(argv: list[str]) -> int:
    # The imports a profile needs come first: a target started ahead (--wait) has them done before its job.
    import torch

    from pipeline import runtime, tasks, verify  # noqa: F401 - loaded before the sandbox closes
    from pipeline.worker_jobs import candidate_factory, reference_precision

    ahead = False
    if argv[:1] == ["--wait"] and len(argv) in (2, 3):
        with contextlib.suppress(ImportError):  # the launchers' runtime, imported before the job comes
            importlib.import_module("cupy")
        ahead = len(argv) == 3 and cuda_up_between_profiles(Path(argv[1]), Path(argv[2]))
        found = wait_for_job(Path(argv[1]))
        if found is None:
            return 0
        job_path = str(found)
    elif len(argv) == 1:
        job_path = argv[0]
    else:
        print(__doc__, file=sys.stderr)
        return 2
    marks: dict[str, float | bool] = {"job": time.time(), "cuda_ahead": ahead}
    job = jobs.decode(Path(job_path).read_bytes())
    if not isinstance(job, jobs.Ncu):
        raise jobs.JobFormatError(f"{job_path}: a {job.KIND!r} message, not an ncu job")
    reference_precision()
    device = torch.device("cuda")
    module = tasks.load_module(job.task_path)
    init_args = list(module.get_init_inputs())
    reference = verify.build_reference(module, init_args, job.seed, device, redraw_constant=False)
    torch.cuda.synchronize()
    marks["reference"] = time.time()  # CUDA's start under ncu's injection, the task's module and weights
    if job.sandbox:
        import cupy

        cupy.cuda.Device(torch.cuda.current_device()).use()
        plan = sandbox.Plan.from_json(job.sandbox)
        report = sandbox.apply_late(plan, _early_report(plan))
        Path(plan.scratch, "sandbox.json").write_text(json.dumps(report))
    if job.candidate is None:
        model = reference
    else:
        factory = candidate_factory(job.candidate)
        model, _ = verify.build_candidate(factory, init_args, job.seed, device, reference)
    inputs = verify.make_inputs(module, job.seed + 101, device)
    torch.cuda.synchronize()
    marks["candidate"] = time.time()
    with torch.no_grad():
        for _ in range(WARMUP_CALLS):
            model(*inputs)
        torch.cuda.synchronize()
        marks["warmup"] = time.time()
        torch.cuda.profiler.start()
        model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    marks["replayed"] = time.time()  # ncu replays each kernel of the call once per pass its metrics need
    with contextlib.suppress(OSError):
        (Path(job_path).parent / TIMES_FILE).write_text(json.dumps(marks))
    # Out without the interpreter's teardown (torch's, the candidate's modules): 0.5-0.6 s of a profile on
    # the H100, and ncu has the replayed call's counters already (benchmarks/ncu_parts.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _early_report(plan: sandbox.Plan) -> dict[str, str]:
    """What the trampoline applied before ncu started (it leaves its report in the scratch folder)."""
    try:
        return json.loads(Path(plan.scratch, "sandbox-early.json").read_text())
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
