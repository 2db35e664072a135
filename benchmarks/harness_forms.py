"""Candidates of one task timed through the harness side by side, for the scripts that compare forms of a
kernel (benchmarks/cluster_regs.py, conv_variants.py): each candidate verified and timed against eager
`repeat` times, in separate passes over all of them, so a difference is believed only when the passes agree."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline import stages
from pipeline.types import Status


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
            row["eager_ms"].append(m.baselines["eager"].median_ms)
            row["floor_ms"] = m.floor_ms
    for row in rows:
        if row["ours_ms"]:
            row["vs_eager"] = min(row["eager_ms"]) / min(row["ours_ms"])
            if row["floor_ms"]:
                row["of_floor"] = row["floor_ms"] / min(row["ours_ms"])
    return rows
