"""Candidates of one task timed through the harness side by side, for the scripts that compare forms of a
kernel (benchmarks/cluster_regs.py, long_rows.py, edit_forms.py, conv_variants.py, conv_routes.py): each candidate verified and timed
against eager `repeat` times, in separate passes over all of them, so a difference is believed only when the
passes agree. `compare` runs such a script's tasks and writes OUT/results.json as it goes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline import stages
from pipeline.candidates import make_candidate
from pipeline.config import load
from pipeline.generate.expert.plan import Plan
from pipeline.generate.expert.policy import analyse
from pipeline.generate.expert.regions import Lowered
from pipeline.generate.expert.render import nvcc_flags, render
from pipeline.types import Status


def parser(doc: str | None = None) -> argparse.ArgumentParser:
    """The arguments every forms script takes: --out DIR, the task files, --repeat (passes)."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("tasks", type=Path, nargs="+")
    ap.add_argument("--repeat", type=int, default=2)
    return ap


def lowered(path: Path) -> Lowered:
    """The task as the expert lowers it; the script stops, saying why, where it does not."""
    low, why = analyse(path)
    if low is None:
        raise SystemExit(f"{path}: {why}")
    return low


def plan_form(task_id: str, low: Lowered, plan: Plan, label: str) -> tuple[str, Any]:
    """(label, the candidate the expert renders for `plan`)."""
    source, launcher = render(low, plan)
    return label, make_candidate(task_id, source, launcher, nvcc_flags(plan), parent=None, edit=label)


def plan_line(row: dict, c: Any) -> None:
    """`describe` keeping each candidate's plan (its source's first line)."""
    row["plan"] = c.source.splitlines()[0]


def kernel_note(*marks: str) -> Callable[[dict, Any], None]:
    """`note` keeping (name, registers, spill stores) of the kernels whose names hold one of `marks`."""

    def note(row: dict, r: Any) -> None:
        res = r.build.resources if r.build else ()
        row["kernels"] = [
            (x.name, x.registers, x.spill_stores) for x in res if any(m in x.name for m in marks)
        ]

    return note


def time_forms(path: Path, forms: list[tuple[str, Any]], cfg: Any, pool: Any, repeat: int,
               note: Callable[[dict, Any], None] | None = None) -> list[dict]:  # fmt: skip
    """A row a (label, candidate): status, each pass's ms and eager's, the floor, and the best pass over eager
    and of the floor; `note(row, result)` may add what else a script keeps of each evaluation."""
    rows = [
        {"form": form, "key": c.key, "ours_ms": [], "eager_ms": [], "floor_ms": None} for form, c in forms
    ]
    for _ in range(repeat):
        evals = stages.evaluate_candidates(path, [c for _, c in forms], cfg, pool=pool)
        for row, r in zip(rows, evals, strict=True):
            row["status"] = r.verdict.status.value
            if note is not None:
                note(row, r)
            m = r.measurement
            if r.status != Status.OK or m is None or m.timing is None:
                row["reasons"] = list(r.verdict.reasons)
                continue
            row["ours_ms"].append(m.timing.median_ms)
            for mode, t in m.baselines.items():  # eager, and the torch.compile modes asked for
                row.setdefault(f"{mode}_ms", []).append(t.median_ms)
            row["floor_ms"] = m.floor_ms
            # the kernels the profiler check saw, us by name: which form a launcher's fallback really ran
            row.setdefault("ran", []).append(m.kernels)
    for row in rows:
        if row["ours_ms"]:
            row["vs_eager"] = min(row["eager_ms"]) / min(row["ours_ms"])
            if row["floor_ms"]:
                row["of_floor"] = row["floor_ms"] / min(row["ours_ms"])
    return rows


def compare(out: Path, tasks: list[Path], repeat: int, forms_of: Callable[[Path], list[tuple[str, Any]]],
            timing_trials: int, timing_budget_s: float, note: Callable[[dict, Any], None] | None = None,
            describe: Callable[[dict, Any], None] | None = None,
            baselines: tuple[str, ...] = ("eager",)) -> dict[str, list[dict]]:  # fmt: skip
    """Each task's forms (`forms_of(path)`: (label, candidate) pairs) timed by time_forms in one worker pool;
    `describe(row, candidate)` adds what a script keeps of each candidate; `baselines`: eager and any
    torch.compile modes to time beside them (each kept as MODE_ms). Prints a line a task and rewrites
    OUT/results.json after each."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = load(home=out / "home", baselines=baselines, energy=False, timing_trials=timing_trials,
               timing_budget_s=timing_budget_s)  # fmt: skip
    results: dict[str, list[dict]] = {}
    with stages.open_pool(cfg) as pool:
        for path in tasks:
            forms = forms_of(path)
            rows = time_forms(path, forms, cfg, pool, repeat, note)
            for row, (_, c) in zip(rows, forms, strict=True):
                if describe is not None:
                    describe(row, c)
            results[path.stem] = rows
            print(path.stem, [(r["form"], r["ours_ms"], r.get("vs_eager"), r.get("of_floor")) for r in rows],
                  flush=True)  # fmt: skip
            (out / "results.json").write_text(json.dumps(results, indent=1))
    return results
