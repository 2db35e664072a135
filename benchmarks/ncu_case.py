"""ncu's view of one bench_gemm.py case, or of a task file: its candidates compiled, exported standalone and
run once each under Nsight Compute, the kernels whose names match --kernel.

    python benchmarks/ncu_case.py CASE [--kernel REGEX] [--count 2] [--out DIR] [--metrics M1,M2,...]
    python benchmarks/ncu_case.py TASK.py [--forms long_rows] ...

A case's candidates are the tuned plan and its first edits; a task file's are the expert's tuned candidate,
or the forms a forms script (benchmarks/long_rows.py, cluster_regs.py, ...) compares, `--forms MODULE`.

Prints the Speed Of Light, Occupancy, Warp State and Launch sections' key lines per candidate (run on the
GPU machine: ncu needs the device and its counters).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

KEEP = ("Throughput", "Occupancy", "Duration", "Warp Cycles", "Issue", "Registers", "Shared Memory",
        "Block Limit", "Active Warps", "Eligible", "Stall")  # fmt: skip
SECTIONS = ("SpeedOfLight", "Occupancy", "WarpStateStats", "LaunchStats")


def _run_once(module_path: str, task_path: str) -> None:
    """The child ncu profiles: the standalone candidate called twice (ncu skips the first launch)."""
    import torch

    from pipeline.candidates import load_export

    task = load_export(task_path, "task")
    init = task.get_init_inputs() if hasattr(task, "get_init_inputs") else []
    model = load_export(module_path, "candidate").ModelNew(*init).cuda()
    torch.set_default_device("cuda")  # inputs drawn on the GPU: GroupNorm's 7.5 GB took ~20 s on the host
    xs = [x.cuda() for x in task.get_inputs()]
    for _ in range(2):
        model(*xs)
    torch.cuda.synchronize()


def _task_forms(path: Path, forms: str) -> list:
    """(label, candidate) of a task file: a forms script's, or the expert's tuned candidate alone."""
    if forms:
        import importlib

        return importlib.import_module(forms).candidates(path)
    sys.path.insert(0, str(ROOT / "tests"))
    from expert_plans import tuned

    return [("tuned", tuned(path))]


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _run_once(sys.argv[2], sys.argv[3])
        return 0
    import bench_gemm

    from pipeline.candidates import export_standalone
    from pipeline.compile import compile_candidates
    from pipeline.config import Config

    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("--kernel", default=".", help="regex of the kernel names to profile")
    ap.add_argument("--count", type=int, default=2, help="candidates to profile")
    ap.add_argument("--out", type=Path, default=Path("/tmp/kernelpro-ncu"))
    ap.add_argument(
        "--metrics", default="", help="comma-separated ncu metrics, printed whole, for the sections"
    )
    ap.add_argument("--forms", default="", help="a task file's forms: the benchmarks module that lists them")
    ap.add_argument("--only", default="", help="a task file's forms whose labels match this regex")
    args = ap.parse_args()
    (args.out / "tasks").mkdir(parents=True, exist_ok=True)
    if args.case.endswith(".py"):
        path = Path(args.case)
        cands = [c for label, c in _task_forms(path, args.forms) if re.search(args.only, label)][: args.count]
    else:
        path = bench_gemm.write_task(args.out / "tasks", args.case)
        cands = bench_gemm.candidates(path)[: args.count]
    builds = compile_candidates(cands, Config(home=args.out / "home", arch="sm_90a"))
    for i, (c, b) in enumerate(zip(cands, builds, strict=True)):
        print(f"== {args.case} [{i}] {c.edit}: {[str(r) for r in b.resources]}", flush=True)
        if b.status.value != "ok":
            print(b.log[-2000:])
            continue
        module = export_standalone(c, b, args.out / f"{args.case}_{i}.py")
        cmd = ["ncu", "--kernel-name", f"regex:{args.kernel}", "--launch-skip", "1", "--launch-count", "1"]
        cmd += (
            ["--metrics", args.metrics] if args.metrics else [x for s in SECTIONS for x in ("--section", s)]
        )
        cmd += [sys.executable, __file__, "--child", str(module), str(path)]
        rep = subprocess.run(cmd, capture_output=True, text=True)
        keep = ("__",) if args.metrics else KEEP
        print("\n".join(ln for ln in rep.stdout.splitlines() if any(k in ln for k in keep)), flush=True)
        if rep.returncode:
            print(rep.stderr[-1500:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
