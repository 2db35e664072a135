"""What each part of an Nsight Compute profile costs, and what the cuts proposed for it save (issue 17's
throughput), on the GPU machine.

    python benchmarks/ncu_parts.py --out DIR [--repeat 3]

A small target (a mean over 64 x 4096 x 512 fp32, one launch, as tasks/reduce_mean.py) runs under ncu with
the flags `pipeline.profile.collect.ncu_command` gives it, started ahead and waiting for a file, as
`pipeline/profile/target.py --wait` does. Its wall-clock marks split each profile into setup (CUDA under
ncu's injection and the inputs), warm-up, replay (the profiled call, once per metric pass) and exit (the
target's exit and ncu's CSV). Variants:

- `full`: the curated metric list (pipeline/profile/metrics.txt), as the search profiles today;
- `one`: a single metric (what the replay costs without the passes);
- `ctx`: CUDA brought up while the target waits, before its job;
- `fastexit`: the target leaves through os._exit once its marks are written (no interpreter teardown).

Then the harness's timing of the same kernel (CUDA events, L2 flushed, 4000 calls: median, upper quartile,
max) alone, while an ncu target brings its CUDA context up, beside it once that context is idle (the `ctx`
variant's state while it waits), and alone again: neither may move the timings made beside it. Writes DIR/ncu_parts.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.profile import collect  # noqa: E402

TARGET = r"""
import json, os, sys, time
mode, scratch = sys.argv[1], sys.argv[2]
import torch
open(os.path.join(scratch, "imported"), "w").close()
if "ctx" in mode:
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
open(os.path.join(scratch, "ready"), "w").close()
go = os.path.join(scratch, "go")
while not os.path.exists(go):
    time.sleep(0.005)
marks = {"job": time.time()}
x = torch.randn(64, 4096, 512, device="cuda")
torch.cuda.synchronize()
marks["setup"] = time.time()
with torch.no_grad():
    for _ in range(2):
        x.mean(1)
    torch.cuda.synchronize()
    marks["warmup"] = time.time()
    torch.cuda.profiler.start()
    x.mean(1)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
marks["replayed"] = time.time()
with open(os.path.join(scratch, "marks.json"), "w") as f:
    f.write(json.dumps(marks))
if "fastexit" in mode:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
"""


def start(ncu: str, metrics: tuple[str, ...], mode: str, work: Path) -> tuple[subprocess.Popen, Path]:
    scratch = Path(tempfile.mkdtemp(dir=work))
    target = scratch / "target.py"
    target.write_text(TARGET)
    argv = collect.ncu_command(ncu, None, metrics, scratch / "ncu.log")
    # ncu_command ends with the pipeline's own target; this probe swaps in its own
    cut = argv.index(sys.executable)
    argv = [*argv[:cut], sys.executable, str(target), mode, str(scratch)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, scratch


def wait_ready(scratch: Path, timeout_s: float = 120.0, name: str = "ready") -> None:
    deadline = time.monotonic() + timeout_s
    while not (scratch / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"target in {scratch} never got ready")
        time.sleep(0.01)


def profile_once(ncu: str, metrics: tuple[str, ...], mode: str, work: Path) -> dict[str, float | int]:
    proc, scratch = start(ncu, metrics, mode, work)
    wait_ready(scratch)
    time.sleep(0.5)  # as a target started ahead: ready well before its job
    go = time.time()
    (scratch / "go").touch()
    proc.communicate(timeout=300)
    end = time.time()
    marks = json.loads((scratch / "marks.json").read_text())
    log = (scratch / "ncu.log").read_text(errors="replace")
    rows = collect.parse_ncu_csv(log)
    return {
        "start": round(marks["job"] - go, 4),
        "setup": round(marks["setup"] - marks["job"], 4),
        "warmup": round(marks["warmup"] - marks["setup"], 4),
        "replay": round(marks["replayed"] - marks["warmup"], 4),
        "exit": round(end - marks["replayed"], 4),
        "total": round(end - go, 4),
        "kernels": len(rows),
        "rc": proc.returncode,
    }


LONG_TRIALS = 4000  # about 1.5 s of calls: longer than a context's creation under ncu


def time_kernel(trials: int = 200) -> dict[str, float]:
    """Device ms of the target's mean (median, upper quartile, max), L2 flushed before each call (as
    pipeline/timing.py does)."""
    import torch

    x = torch.randn(64, 4096, 512, device="cuda")
    flush = torch.empty(256 * 1024 * 1024 // 4, device="cuda")
    for _ in range(5):
        x.mean(1)
    times = []
    for _ in range(trials):
        flush.normal_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        x.mean(1)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    q = statistics.quantiles(times, n=4)
    return {"median": round(statistics.median(times), 5), "q3": round(q[2], 5), "max": round(max(times), 5)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ncu = collect.find_ncu()
    if ncu is None:
        print("ncu not found", file=sys.stderr)
        return 1
    full = collect.curated_metrics()
    variants = {
        "full": (full, "plain"),
        "one": (full[:1], "plain"),
        "ctx": (full, "ctx"),
        "fastexit": (full, "fastexit"),
        "ctx+fastexit": (full, "ctx+fastexit"),
    }
    work = Path(tempfile.mkdtemp(prefix="ncu-parts-"))
    out: dict[str, object] = {"metrics": len(full), "profiles": {}}
    for r in range(args.repeat):
        for name, (metrics, mode) in variants.items():
            res = profile_once(ncu, metrics, mode, work)
            out["profiles"].setdefault(name, []).append(res)  # type: ignore[union-attr]
            print(r, name, res, flush=True)
    timings: dict[str, list[dict[str, float]]] = {
        "alone": [],
        "during_ctx_creation": [],
        "beside_idle_ctx": [],
    }
    for _ in range(args.repeat):
        timings["alone"].append(time_kernel(LONG_TRIALS))
        proc, scratch = start(ncu, full, "ctx", work)
        wait_ready(scratch, name="imported")
        # the target brings CUDA up under ncu's injection (1.0-1.4 s) while these calls are timed
        timings["during_ctx_creation"].append(time_kernel(LONG_TRIALS))
        wait_ready(scratch)
        timings["beside_idle_ctx"].append(time_kernel(LONG_TRIALS))
        (scratch / "go").touch()
        proc.communicate(timeout=300)
    timings["alone"].append(time_kernel(LONG_TRIALS))
    out["timing_ms"] = timings
    out["medians"] = {
        name: {k: round(statistics.median(p[k] for p in runs), 4) for k in runs[0] if k not in ("rc",)}
        for name, runs in out["profiles"].items()  # type: ignore[union-attr]
    }
    text = json.dumps(out, indent=1)
    (args.out / "ncu_parts.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
