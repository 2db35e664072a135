"""MoE grouped GEMMs, kernel timings only: our grouped kernel's candidates (bench_moe.candidates: the tuned plan
and its tile and ring children) built from our own templates, loaded in this process, checked against the
reference loop on the task's inputs and its alternate routings, and timed with pipeline.timing (fresh inputs
drawn on the GPU each call, L2 flushed, CUDA events, median of many), next to the loop, torch._grouped_mm and
VeOmni's Triton group GEMM on the same routings. For kernel work: a minute a task, where the harness
(bench_moe.py: isolated worker, float64 verification, eager baseline) takes a few.

    python benchmarks/moe_kernels.py --out DIR [--tasks qwen3_fc1,deepseek_fc1] [--trials 15] [--build-only]

Writes DIR/results.json ({task: {name: [ms, TFLOP/s, relative error]}}, rewritten after each task).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_moe  # noqa: E402

from pipeline.compile import compile_candidates  # noqa: E402
from pipeline.config import load  # noqa: E402
from pipeline.tasks import load_module, probe  # noqa: E402


def run_task(name: str, cfg, trials: int) -> dict[str, list[float]]:
    import torch

    from pipeline.runtime import Kernels
    from pipeline.timing import time_cuda
    from pipeline.verify import make_inputs
    from pipeline.worker_jobs import load_launcher

    path = ROOT / "tasks" / "moe" / f"{name}.py"
    flops = probe(path).flops
    cands = bench_moe.candidates(path)
    builds = compile_candidates(cands, cfg)
    module = load_module(path)
    gpu = torch.device("cuda")
    torch.manual_seed(0)
    with gpu:
        model = module.Model(*module.get_init_inputs())

    def inputs_for(call: int) -> list:
        return make_inputs(module, call, gpu)

    args = inputs_for(0)
    alts = make_inputs(module, 1, gpu, "get_alt_inputs")
    with torch.no_grad():
        want = model(*args)
        want_alt = [model(*a) for a in alts]
    row: dict[str, list[float]] = {}

    def show(label: str, ms: float, err: float) -> None:
        row[label] = [ms, flops / ms / 1e9, err]
        print(f"{name}: {label}: {ms:.3f} ms, {row[label][1]:.0f} TFLOP/s, error {err:.2g}", flush=True)

    def timed(label: str, fn, err: float) -> None:
        with torch.no_grad():
            show(label, time_cuda(fn, inputs_for, trials=trials, budget_s=3.0, warmup=2).median_ms, err)

    for c, b in zip(cands, builds, strict=True):
        if b.cubin_path is None:
            print(f"{name}: {c.edit}: build {b.status.value}: {b.log[-300:]}", flush=True)
            continue
        ours = load_launcher(c.launcher, Kernels.from_file(b.cubin_path), c.key)(*module.get_init_inputs())
        ours = ours.to(gpu)
        ours.load_state_dict(model.state_dict())
        with torch.no_grad():
            errs = [bench_moe.rel_err(ours(*args), want)]
            errs += [bench_moe.rel_err(ours(*a), w) for a, w in zip(alts, want_alt, strict=True)]
        timed(c.edit, ours, max(errs))
    timed("reference loop", model, 0.0)
    for label, v in bench_moe.time_libraries(path, flops, trials).items():
        show(label, v["ms"], v["rel_err"])
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tasks", default=",".join(bench_moe.TASKS))
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument(
        "--build-only", action="store_true", help="compile the candidates into DIR/home's cache, no GPU"
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = load(home=args.out / "home")
    results: dict[str, dict] = {}
    for name in args.tasks.split(","):
        if args.build_only:  # a GPU machine's time is dearer than this one's: bring the cubins along
            builds = compile_candidates(bench_moe.candidates(ROOT / "tasks" / "moe" / f"{name}.py"), cfg)
            print(name, *(f"{b.status.value}" for b in builds), flush=True)
            continue
        t0 = time.monotonic()
        results[name] = run_task(name, cfg, args.trials)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"{name}: done in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
