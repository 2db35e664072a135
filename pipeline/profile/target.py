"""The process Nsight Compute wraps: load a task and a candidate, warm up, then run one call between
cudaProfilerStart and cudaProfilerStop (ncu runs with --profile-from-start off), so only that call's
kernels are replayed. Candidate code runs here, in a process of its own, never in the orchestrator.

    python -m pipeline.profile.target job.json

The job may carry a sandbox plan (pipeline/sandbox.py): its late layers (Landlock, seccomp) go on once CUDA,
CuPy and the task's reference are up, before the candidate's cubin and launcher are loaded. The namespaces
were applied to ncu's whole tree by the trampoline that started ncu.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline import jobs, sandbox

WARMUP_CALLS = 2


def main(job_path: str) -> int:
    import torch

    from pipeline import runtime, tasks, verify  # noqa: F401 - loaded before the sandbox closes
    from pipeline.worker_jobs import candidate_factory, reference_precision

    job = jobs.decode(Path(job_path).read_bytes())
    if not isinstance(job, jobs.Ncu):
        raise jobs.JobFormatError(f"{job_path}: a {job.KIND!r} message, not an ncu job")
    reference_precision()
    device = torch.device("cuda")
    module = tasks.load_module(job.task_path)
    init_args = list(module.get_init_inputs())
    reference = verify.build_reference(module, init_args, job.seed, device, redraw_constant=False)
    torch.cuda.synchronize()
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
    with torch.no_grad():
        for _ in range(WARMUP_CALLS):
            model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


def _early_report(plan: sandbox.Plan) -> dict[str, str]:
    """What the trampoline applied before ncu started (it leaves its report in the scratch folder)."""
    try:
        return json.loads(Path(plan.scratch, "sandbox-early.json").read_text())
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
