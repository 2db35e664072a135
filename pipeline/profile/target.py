"""The process Nsight Compute wraps: load a task and a candidate, warm up, then run one call between
cudaProfilerStart and cudaProfilerStop (ncu runs with --profile-from-start off), so only that call's
kernels are replayed. Candidate code runs here, in a process of its own, never in the orchestrator.

    python -m pipeline.profile.target job.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WARMUP_CALLS = 2


def main(job_path: str) -> int:
    import torch

    from pipeline import tasks, verify
    from pipeline.worker_jobs import candidate_factory, reference_precision

    job = json.loads(Path(job_path).read_text())
    reference_precision()
    device = torch.device("cuda")
    module = tasks.load_module(job["task_path"])
    init_args = list(module.get_init_inputs())
    if job.get("reference"):
        model = verify.build_reference(module, init_args, job["seed"], device, redraw_constant=False)
    else:
        factory = candidate_factory(job)
        reference = verify.build_reference(module, init_args, job["seed"], device, redraw_constant=False)
        model, _ = verify.build_candidate(factory, init_args, job["seed"], device, reference)
    inputs = verify.make_inputs(module, job["seed"] + 101, device)
    with torch.no_grad():
        for _ in range(WARMUP_CALLS):
            model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        model(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
