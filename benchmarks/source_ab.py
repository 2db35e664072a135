"""A template change tried before it is made: a bench_gemm.py case's tuned candidate against variants of its
CUDA source, each a list of literal substitutions, verified and timed through the harness on the GPU.

    python benchmarks/source_ab.py --out DIR --case linear_f32_4k [--variants VARIANTS.json] [--repeat 2]

VARIANTS.json: {"name": [["old text", "new text"], ...], ...} (benchmarks/variants/); without it, the tuned
candidate alone (e.g. timed once on each of two copies of a template). A substitution whose old text is not in the
source fails the variant before anything runs (a template that changed under the experiment). Every
candidate is evaluated `--repeat` times in separate passes (a difference is believed only when the passes
agree); each pass's worst relative error is kept beside eager's own (the tolerance's anchor). Writes
DIR/results.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import bench_gemm  # noqa: E402

from pipeline import stages  # noqa: E402
from pipeline.candidates import candidate_key  # noqa: E402
from pipeline.config import load  # noqa: E402
from pipeline.types import Candidate  # noqa: E402


def variant(base: Candidate, name: str, subs: list[list[str]]) -> Candidate:
    source = base.source
    for old, new in subs:
        if old not in source:
            raise SystemExit(f"variant {name}: {old!r} is not in the tuned candidate's source")
        source = source.replace(old, new)
    key = candidate_key(source, base.launcher, base.flags)
    return dataclasses.replace(base, source=source, key=key, edit=name, parent=base.key)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--case", required=True, help="a bench_gemm.py case")
    ap.add_argument("--variants", type=Path)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    (args.out / "tasks").mkdir(parents=True, exist_ok=True)
    path = bench_gemm.write_task(args.out / "tasks", args.case)
    tuned = next(c for c in bench_gemm.candidates(path) if c.edit == "expert: tuned kernels")
    spec = json.loads(args.variants.read_text()) if args.variants else {}
    cands = [dataclasses.replace(tuned, edit="tuned"), *(variant(tuned, n, s) for n, s in spec.items())]
    cfg = load(
        home=args.out / "home", baselines=("eager",), energy=False, timing_trials=50, timing_budget_s=2.0
    )
    with stages.open_pool(cfg) as pool:
        rows = bench_gemm.timed_rows(path, cands, cfg, pool, args.repeat, ("eager",))
    print(f"{args.case}: {json.dumps(rows)}", flush=True)
    (args.out / "results.json").write_text(json.dumps({args.case: rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
