"""nvcc on Ray: how compile jobs scale with the Ray workers (CPUs) of a local cluster, against the head's own
thread pool with as many jobs (issue 18's figure where no multi-GPU machine is lent).

    python benchmarks/bench_ray_compile.py [--candidates 16] [--workers 1,2] [--json]

The candidates are the element-wise example (examples/candidates/elementwise_chain), each made distinct by
a comment, so every one is a real, uncached nvcc run of the same size. Each setting compiles them all into a
fresh cache: a Ray cluster started with that many CPUs (one compile task a CPU), and the thread pool with
that many jobs. Prints one JSON document: seconds and candidates a second per setting, and the speedup over
one worker.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.candidates import load_candidate, make_candidate  # noqa: E402
from pipeline.compile import compile_candidates  # noqa: E402
from pipeline.config import Config  # noqa: E402
from pipeline.types import Status  # noqa: E402


def candidates(n: int) -> list:
    base = load_candidate(ROOT / "examples" / "candidates" / "elementwise_chain", "elementwise_chain")
    return [
        make_candidate(base.task_id, f"{base.source}\n// variant {i}\n", base.launcher, base.flags)
        for i in range(n)
    ]


def timed(cands: list, cfg: Config) -> float:
    t0 = time.perf_counter()
    builds = compile_candidates(cands, cfg)
    seconds = time.perf_counter() - t0
    bad = [b.log[:200] for b in builds if b.status != Status.OK]
    if bad:
        raise SystemExit(f"{len(bad)} compiles failed: {bad[0]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    import ray

    ap = argparse.ArgumentParser()
    ap.add_argument("--candidates", type=int, default=16)
    ap.add_argument(
        "--workers", default="1,2", help="Ray CPUs (and thread-pool jobs) to try, comma-separated"
    )
    args = ap.parse_args(argv)
    cands = candidates(args.candidates)
    rows = []
    for w in (int(x) for x in args.workers.split(",")):
        with tempfile.TemporaryDirectory() as home:
            local = timed(cands, Config(home=Path(home) / "pool", arch="sm_90a", compile_jobs=w))
            ray.init(num_cpus=w, num_gpus=0, include_dashboard=False, log_to_driver=False)
            try:
                on_ray = timed(cands, Config(home=Path(home) / "ray", arch="sm_90a", ray="local"))
            finally:
                ray.shutdown()
        rows.append({"workers": w, "thread_pool_s": round(local, 2), "ray_s": round(on_ray, 2)})
    one = rows[0]
    for r in rows:
        r["ray_per_s"] = round(args.candidates / r["ray_s"], 2)
        r["ray_speedup"] = round(one["ray_s"] / r["ray_s"], 2)
        r["thread_pool_speedup"] = round(one["thread_pool_s"] / r["thread_pool_s"], 2)
    print(json.dumps({"candidates": args.candidates, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
