"""The adversarial suite end to end on the GPU: every case of tests/adversarial/ through the real pipeline.

    python3 benchmarks/adversarial_suite.py --out benchmarks/results/adversarial-<date>.json \
        --markdown adversarial.md

Like tests/test_adversarial.py::test_harness_verdict, with one shared worker pool: each case's candidate is
evaluated on its task, and its verdict compared with the case's expect.toml. A cheat agrees when the status
matches and some reason starts with one of its codes; an honest control agrees when it is OK.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import jobs, reasons  # noqa: E402
from pipeline.config import Config, load  # noqa: E402

CASES_DIR = ROOT / "tests" / "adversarial"
TASKS_DIR = ROOT / "tasks"
FIXTURE_TASKS_DIR = ROOT / "tests" / "fixtures" / "tasks"  # tasks the suite needs beyond the built-in ones


@dataclass(frozen=True)
class Case:
    name: str
    folder: Path
    task: str
    status: str
    checks: tuple[str, ...]
    exploit: str

    @property
    def task_path(self) -> Path:
        builtin = TASKS_DIR / f"{self.task}.py"
        return builtin if builtin.is_file() else FIXTURE_TASKS_DIR / f"{self.task}.py"


def load_cases(folder: Path = CASES_DIR, names: list[str] | None = None) -> list[Case]:
    cases = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        if names and sub.name not in names:
            continue
        data = tomllib.loads((sub / "expect.toml").read_text())
        cases.append(
            Case(
                sub.name, sub, data["task"], _statuses(data["status"]), tuple(data["checks"]), data["exploit"]
            )
        )
    return cases


def _statuses(status: str | list[str]) -> str:
    """One status, or "a|b" for a case that checks of two statuses may catch first."""
    return status if isinstance(status, str) else "|".join(status)


def agrees(case: Case, status: str, why: list[str]) -> bool:
    if status not in case.status.split("|"):
        return False
    return not case.checks or any(reasons.code_of(r) in case.checks for r in why)


def run_cases(
    cases: list[Case], cfg: Config, progress: Any = None
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """One row per case, and the GPU and versions they ran with; a case the pipeline cannot take is a row
    with status "error", not an exception."""
    from pipeline.stages import evaluate_candidates, open_pool

    rows = []
    with open_pool(cfg) as pool:
        for i, case in enumerate(cases):
            t0 = time.monotonic()
            try:
                [result] = evaluate_candidates(case.task_path, [case.folder], cfg, pool=pool)
                status, why = result.verdict.status.value, list(result.verdict.reasons)
            except Exception as e:
                status, why = "error", [f"error: {type(e).__name__}: {str(e).splitlines()[0][:300]}"]
            row = {
                "case": case.name,
                "task": case.task,
                "exploit": case.exploit,
                "expected_status": case.status,
                "expected_codes": list(case.checks),
                "status": status,
                "reasons": why,
                "agree": agrees(case, status, why),
                "seconds": round(time.monotonic() - t0, 2),
            }
            rows.append(row)
            if progress:
                progress(i + 1, len(cases), row)
        r = pool.reference.request(jobs.Environment(cfg.device), timeout_s=120)
    env = r.answer.environment if isinstance(r.answer, jobs.EnvironmentAnswer) else {}
    return rows, {k: env[k] for k in ("gpu", "driver", "cuda_runtime", "torch", "cupy", "python") if k in env}


def markdown(rows: list[dict[str, Any]], environment: dict[str, str] | None = None) -> str:
    agreed = sum(r["agree"] for r in rows)
    lines = [
        "# Adversarial suite on the GPU",
        "",
        f"{agreed} of {len(rows)} cases agree with their expect.toml"
        + (f" ({', '.join(f'{k} {v}' for k, v in environment.items())})" if environment else "")
        + ".",
        "",
        "| case | exploit | expected | codes | actual | first reasons | agree |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        first = "; ".join([x for x in r["reasons"] if not reasons.is_note(x)][:2]) or "-"
        lines.append(
            f"| {r['case']} | {_cell(r['exploit'], 90)} | {r['expected_status']} | "
            f"{', '.join(r['expected_codes']) or '-'} | {r['status']} | {_cell(first, 160)} | "
            f"{'yes' if r['agree'] else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def _cell(text: str, limit: int) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    today = datetime.date.today().isoformat()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / f"adversarial-{today}.json",
        help="JSON with one row per case (default: %(default)s)",
    )
    p.add_argument("--markdown", type=Path, default=None, help="write the Markdown table here too")
    p.add_argument("--cases", nargs="+", default=None, help="only these case names")
    p.add_argument("--home", type=Path, default=None, help="kernelpro home (caches, calibration)")
    args = p.parse_args(argv)

    cases = load_cases(names=args.cases)
    if not cases:
        print("no adversarial cases found", file=sys.stderr)
        return 2
    # No baselines, as in the GPU test: the verdicts are what counts, and the speedup check needs none.
    cfg = load(
        home=args.home, baselines=(), timing_budget_s=0.5, energy_window_s=0.5, energy_repeats=2
    )  # as the GPU test

    def progress(done: int, total: int, row: dict[str, Any]) -> None:
        mark = "agree" if row["agree"] else "DISAGREE"
        print(
            f"[{done:>2}/{total}] {row['case']:<28} {row['status']:<10} {mark}  {row['seconds']:.1f} s",
            flush=True,
        )

    rows, env = run_cases(cases, cfg, progress)
    text = markdown(rows, env)
    print()
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"date": today, "environment": env, "agree": sum(r["agree"] for r in rows), "cases": rows}
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    return 0 if all(r["agree"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
