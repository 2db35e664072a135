"""How long nvcc takes on each task's tuned candidate, built once into an empty cache (CPU only).

    python benchmarks/build_times.py TASK.py [TASK.py ...] [--arch sm_90a] [--out FILE.jsonl]

Prints, a task a line, the build's status, its seconds, the source's bytes and the kernels the build
holds. To compare two versions of the renderer, run it at each (e.g. from a `git worktree` of the older
commit) one after the other on an otherwise idle machine: nvcc's time is this machine's CPU's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from expert_plans import tuned  # noqa: E402  (the tests' helper: the search's tuned candidate)

from pipeline.compile import compile_candidates  # noqa: E402
from pipeline.config import Config  # noqa: E402


def build_time(path: Path, arch: str) -> dict:
    cand = tuned(path)
    with tempfile.TemporaryDirectory() as home:
        t0 = time.perf_counter()
        (build,) = compile_candidates([cand], Config(home=Path(home), arch=arch))
        seconds = time.perf_counter() - t0
    return {
        "task": path.name,
        "status": build.status.value,
        "seconds": round(seconds, 1),
        "source_bytes": len(cand.source),
        "kernels": len(build.resources or ()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("tasks", type=Path, nargs="+")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--out", type=Path, default=None, help="append each row as a JSON line")
    args = ap.parse_args()
    for path in args.tasks:
        row = build_time(path, args.arch)
        print(f"{row['task']}: {row['status']} in {row['seconds']} s, {row['source_bytes']} bytes, "
              f"{row['kernels']} kernels", flush=True)  # fmt: skip
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
