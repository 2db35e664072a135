"""Harness benchmark (issue: evaluation harness). Run on the GPU machine; prints a Markdown table and writes
JSON. Figures go to docs/benchmarks.md with the date, GPU and versions printed here.

    python benchmarks/bench_harness.py --out results.json [--modes eager,compile] [--energy]

Measures: nvcc compile time of a plain kernel and of a CuTe kernel (uncached); wall time of evaluating a
cached elementwise candidate (verification plus timing) with a cold and with a warm worker; the same
candidate timed twice; and every built-in task's example candidate against eager and torch.compile.
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

from pipeline import stages  # noqa: E402
from pipeline.candidates import load_candidate, make_candidate  # noqa: E402
from pipeline.compile import compile_candidates, find_nvcc, toolkit_version  # noqa: E402
from pipeline.config import load  # noqa: E402
from pipeline.types import speedup  # noqa: E402

EXAMPLES = ROOT / "examples" / "candidates"


def compile_times(home: Path) -> dict:
    cfg = load(home=home / "compile-bench")
    plain = load_candidate(EXAMPLES / "elementwise_chain", "elementwise_chain")
    cute_src = (ROOT / "tests" / "fixtures" / "kernels" / "cute_copy.cu").read_text()
    cute = make_candidate("cute", cute_src, "", ())
    out = {}
    for name, cand in (("plain", plain), ("cute", cute)):
        t0 = time.perf_counter()
        (b,) = compile_candidates([cand], cfg)
        out[name] = {"seconds": time.perf_counter() - t0, "status": b.status.value}
        t0 = time.perf_counter()
        (b2,) = compile_candidates([cand], cfg)
        out[name]["cached_seconds"] = time.perf_counter() - t0
        out[name]["cached"] = b2.cached
    return out


def eval_wall(home: Path) -> dict:
    cfg = load(home=home, baselines=("eager",), energy=False)
    task = ROOT / "tasks" / "elementwise_chain.py"
    cand = EXAMPLES / "elementwise_chain"
    out = {}
    t0 = time.perf_counter()
    with stages.open_pool(cfg) as pool:
        (r,) = stages.evaluate_candidates(task, [cand], cfg, pool=pool)
        out["cold_worker_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        (r2,) = stages.evaluate_candidates(task, [cand], cfg, pool=pool)
        out["warm_worker_s"] = time.perf_counter() - t0
    a, b = r.measurement.timing.median_ms, r2.measurement.timing.median_ms
    out.update(
        status=[r.verdict.status.value, r2.verdict.status.value],
        first_ms=a,
        second_ms=b,
        difference_pct=100 * abs(a - b) / min(a, b),
    )
    return out


def tasks_table(home: Path, modes: tuple[str, ...], energy: bool) -> list[dict]:
    cfg = load(home=home, baselines=modes, energy=energy)
    rows = []
    with stages.open_pool(cfg) as pool:
        for folder in sorted(p for p in EXAMPLES.iterdir() if p.is_dir()):
            (r,) = stages.evaluate_candidates(ROOT / "tasks" / f"{folder.name}.py", [folder], cfg, pool=pool)
            m = r.measurement
            row = {
                "task": folder.name,
                "status": r.verdict.status.value,
                "kind": r.verdict.kind.value if r.verdict.kind else None,
                "library_ops": list(r.verdict.library_ops),
                "reasons": list(r.verdict.reasons),
            }
            if m and m.timing:
                row.update(
                    ours_ms=m.timing.median_ms,
                    spread_pct=100 * m.timing.spread,
                    floor_ms=m.floor_ms,
                    of_floor=m.fraction_of_floor,
                    baselines={k: v.median_ms for k, v in m.baselines.items()},
                    joules=m.energy.joules_per_call if m.energy else None,
                    watts=m.energy.avg_power_w if m.energy else None,
                    environment=m.environment,
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--energy", action="store_true")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: compile,eval,tasks")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    home = Path(tempfile.mkdtemp(prefix="kp-bench-"))
    result: dict = {"date": time.strftime("%Y-%m-%d"), "nvcc": toolkit_version(find_nvcc(load()))}
    if "compile" not in skip:
        result["compile"] = compile_times(home)
        print("compile", json.dumps(result["compile"]), flush=True)
    if "eval" not in skip:
        result["eval"] = eval_wall(home)
        print("eval", json.dumps(result["eval"]), flush=True)
    if "tasks" not in skip:
        result["tasks"] = tasks_table(home, tuple(args.modes.split(",")), args.energy)
    args.out.write_text(json.dumps(result, indent=2))
    rows = result.get("tasks", [])
    if rows:
        modes = list(rows[0].get("baselines", {}))
        print(
            "\n| task | kind | status | ours ms | "
            + " | ".join(f"{m} ms" for m in modes)
            + " | vs eager | vs compile | of floor | J/call |"
        )
        print("|---" * (8 + len(modes)) + "|")
        for r in rows:
            if "ours_ms" not in r:
                print(f"| {r['task']} | {r['kind']} | {r['status']} | - |" + " - |" * (len(modes) + 4))
                continue
            b = r["baselines"]
            cells = [f"{b[m]:.4f}" for m in modes]
            ve = speedup(b.get("eager"), r["ours_ms"]) or 0.0
            vc = speedup(b.get("compile"), r["ours_ms"])
            print(
                f"| {r['task']} | {r['kind']} | {r['status']} | {r['ours_ms']:.4f} | "
                + " | ".join(cells)
                + f" | {ve:.2f}x | {f'{vc:.2f}x' if vc else '-'} | {100 * (r['of_floor'] or 0):.0f}% | "
                + (f"{r['joules']:.4g}" if r.get("joules") else "-")
                + " |"
            )


if __name__ == "__main__":
    main()
