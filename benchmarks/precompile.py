"""Compile the expert's first kernels of a suite's tasks here, so a GPU machine finds them in its compile cache.

The cubin cache is keyed by the source, the flags, the arch, the nvcc version and the CUTLASS version, not by
paths or machines (pipeline/compile.py). The expert policy's first proposals are deterministic, so the
first expansion of a bench's search (plain, tuned and the tuned plan's first edits: `--evals` of them) can be
built on a CPU machine with the same toolkit, carried as one tar, and unpacked into the GPU machine's cache
before the bench: its nvcc time (about 10 s a task on level 2's convolutions) drops out of the device's.

    python3 benchmarks/precompile.py SUITE [--match REGEX] [--evals 4] [--arch sm_90a] --out CUBINS.tgz
    # on the GPU machine, from the repository root, before `kernelpro bench`:
    mkdir -p .kernelpro/cache && tar xzf CUBINS.tgz -C .kernelpro/cache

Prints each task's builds; a task the expert cannot write, or a candidate that does not compile, is listed
and skipped (the bench meets it again on the GPU machine). Builds already in `--home`'s cache are reused.
"""

from __future__ import annotations

import argparse
import re
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import selfcheck  # noqa: E402
from pipeline.compile import compile_candidates  # noqa: E402
from pipeline.config import Config  # noqa: E402
from pipeline.prebuild import first_kernels  # noqa: E402
from pipeline.types import Status  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("suite", type=Path, help="a folder of task files (searched recursively)")
    ap.add_argument("--match", default=None, help="only tasks whose key (folder/name) this regex finds")
    ap.add_argument("--evals", type=int, default=4, help="first candidates a task (the bench's --evals)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--home", type=Path, default=Path("/tmp/kernelpro-precompile"))
    ap.add_argument("--out", type=Path, required=True, help="the tar of the cache's entries (.tgz)")
    args = ap.parse_args()

    cfg = Config(home=args.home, arch=args.arch)
    keys: set[str] = set()
    t0 = time.perf_counter()
    for path in selfcheck.task_files([args.suite]):
        key = selfcheck.task_key(path)
        if args.match and not re.search(args.match, key):
            continue
        cands = first_kernels(path, args.evals, args.arch)
        if isinstance(cands, str):
            print(f"{key}: skipped ({cands})", flush=True)
            continue
        builds = compile_candidates(cands, cfg)
        ok = [b for b in builds if b.status is Status.OK and b.cubin_path]
        keys |= {Path(b.cubin_path).stem for b in ok}
        bad = [f"{c.edit}: {b.status.value}" for c, b in zip(cands, builds, strict=True) if b not in ok]
        print(f"{key}: {len(ok)} of {len(cands)} built ({time.perf_counter() - t0:.0f} s)"
              + (f"; not built: {', '.join(bad)}" if bad else ""), flush=True)  # fmt: skip
    cache = cfg.cache_dir / "cubin"
    with tarfile.open(args.out, "w:gz") as tar:
        for k in sorted(keys):
            for suffix in (".json", ".cubin"):
                tar.add(cache / f"{k}{suffix}", arcname=f"cubin/{k}{suffix}")
    print(f"{len(keys)} builds in {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
