"""Experiments: a matrix of settings (cells) run over one suite with one budget and several seeds, compared
pairwise against a baseline cell.

An experiment is a TOML file:

    name = "mcts-vs-greedy"
    suite = "small_suite.txt"      # a folder or a list file, as `kernelpro bench` takes; relative to this file
    evals = 8                      # evaluations per task
    seeds = [0, 1]                 # every cell runs once per seed
    baseline = "search=mcts"       # the cell the others are compared against (or a table of its factors)
    [fixed]                        # factors every cell shares
    policy = "expert"
    [matrix]                       # the cells: every combination of these values
    search = ["mcts", "greedy"]

The factors: policy, search, feedback, memory, objective, and corpus: where the building blocks come from,
"none", one corpus of corpora/*.toml or several joined by "+" ("cutlass+cccl"), each indexed beforehand
with `kernelpro index build --corpus NAME`. A corpus cell whose index is missing still runs, without that
corpus's building blocks, and its runs' notes and the report say so.

Each cell x seed is a bench folder (pipeline/bench.py) under DIR/cells/<cell>/seed-<n>/, so an experiment
resumes cell by cell and, inside a cell, task by task. The experiment folder holds its manifest
(experiment.json), a copy of the TOML that reruns it from there (experiment.toml), and the reports
(summary.json, report.md, report.html).

The comparison of a cell with the baseline is paired by task: per task, the ratio of the best verified times
(cell over baseline, the geometric mean over the seeds both verified), then over tasks the geomean ratio
with a bootstrap confidence interval, a Wilcoxon signed-rank test on the log ratios, and wins, losses and
ties. Tasks are the unit (seeds are repeated measures of one task), so n is the number of paired tasks.

The corpora of the cells are measured two more ways. Retrieval: with `queries = "file.toml"` (a query set
of `[[case]]` tables, query and expect, as index.hunt.load_cases reads; relative to the experiment file),
recall@5 and MRR of each cell's corpora on it, whenever their indexes are built (retrieval.json in the
experiment folder, measured again at every run). Use: which building blocks the runs' candidates took from
each corpus, read from the run logs.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import bench
from pipeline.config import CHOICES, NO_CORPUS, Config, corpus_names

MANIFEST, COPY, CELLS, RETRIEVAL = "experiment.json", "experiment.toml", "cells", "retrieval.json"
REPORTS = {"json": "summary.json", "markdown": "report.md", "html": "report.html"}
RESAMPLES = 10_000  # bootstrap resamples of the paired tasks
LEVEL = 0.95  # of the bootstrap interval
TIE = 0.01  # a ratio within 1% of 1 is a tie: closer than timing noise on one GPU
MIN_PAIRS = 2  # paired tasks with a non-zero difference the signed-rank test needs to say anything
RECALL_K = 5  # retrieval: recall@k of the query set (MRR over the top 10, as index.hunt.evaluate)


def _corpora() -> tuple[str, ...]:
    from corpora import list_corpora

    return (NO_CORPUS, *list_corpora())


# The factors a cell may set, their allowed values and the value a cell gets when the TOML does not say.
FACTORS: dict[str, tuple[Any, ...]] = {
    "policy": tuple(p for p in CHOICES["policy"] if p != "auto"),  # a cell says which policy it measures
    "search": CHOICES["search"],
    "feedback": CHOICES["feedback"],
    "corpus": (),  # none, a corpus of corpora/*.toml, or corpora joined by "+": config.corpus_names checks it
    "memory": (False, True),
    "objective": CHOICES["objective"],
}
DEFAULT_FACTORS: dict[str, Any] = {
    "policy": "expert",
    "search": "mcts",
    "feedback": "advice",
    "corpus": "cutlass",
    "memory": False,
    "objective": "time",
}
KEYS = ("name", "description", "suite", "evals", "seeds", "baseline", "fixed", "matrix", "resamples",
        "queries")  # fmt: skip


class ExperimentError(ValueError):
    """An experiment that cannot start (a bad TOML, an unknown factor or value, a folder of another one)."""


@dataclass(frozen=True)
class Cell:
    name: str
    factors: dict[str, Any]  # every factor, defaults filled in

    def settings(self, evals: int, seed: int, experiment: str = "") -> dict[str, Any]:
        """The bench settings of this cell for one seed. A memory cell learns in a lesson store of its own for
        each seed, empty when it starts: lessons of another cell, seed or experiment would make the cells'
        outcomes depend on the order they ran in."""
        f = self.factors
        out = {"evals": evals, "policy": f["policy"], "search": f["search"], "seed": seed,
               "feedback": f["feedback"], "objective": f["objective"], "memory": f["memory"],
               "corpus": f["corpus"]}  # fmt: skip
        if f["memory"]:
            digest = hashlib.sha1(f"{experiment}/{self.name}/{seed}".encode()).hexdigest()[:16]
            out["memory_collection"] = f"kernelpro-memory-{digest}"
        return out


@dataclass(frozen=True)
class Experiment:
    name: str
    path: Path  # the TOML file
    suite: Path  # resolved against the TOML's folder
    evals: int
    seeds: tuple[int, ...]
    fixed: dict[str, Any]
    matrix: dict[str, tuple[Any, ...]]
    cells: tuple[Cell, ...]
    baseline: str  # a cell's name
    resamples: int = RESAMPLES
    description: str = ""
    queries: Path | None = None  # the retrieval query set, resolved against the TOML's folder

    def definition(self) -> dict[str, Any]:
        """What makes two runs the same experiment (the suite is checked by its fingerprint; the query set
        only changes the report, so it is not part of it)."""
        return {"evals": self.evals, "seeds": list(self.seeds), "baseline": self.baseline,
                "cells": {c.name: c.factors for c in self.cells}, "resamples": self.resamples}  # fmt: skip


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def _allowed(factor: str) -> tuple[Any, ...]:
    return _corpora() if factor == "corpus" else FACTORS[factor]


def _check_value(where: str, factor: str, value: Any) -> Any:
    if factor == "corpus":  # "none", a corpus, or corpora joined by "+"
        try:
            corpus_names(value)
        except ValueError as e:
            raise ExperimentError(f"{where}: {e}") from None
        return value
    allowed = _allowed(factor)
    # bool is an int in Python: `memory = 1` or `policy = true` must not slip through as a match.
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        shown = ", ".join("true" if a is True else "false" if a is False else str(a) for a in allowed)
        raise ExperimentError(f"{where}: {factor} = {value!r} is not one of {shown}")
    return value


def _check_queries(path: Path, value: Any) -> Path:
    """The query set's path (relative to the experiment file) once it reads as `[[case]]` tables, each with a
    query and what it expects (a path or a list of paths)."""
    if not isinstance(value, str) or not value:
        raise ExperimentError(f"{path}: queries = the path of a query set (a TOML of [[case]] tables)")
    queries = Path(value).expanduser()
    queries = Path(os.path.normpath(queries if queries.is_absolute() else path.parent / queries))
    try:
        cases = tomllib.loads(queries.read_text()).get("case")
    except OSError as e:
        raise ExperimentError(f"{path}: queries = {value!r}: cannot read {queries} ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ExperimentError(f"{path}: queries = {value!r}: {queries} is not TOML ({e})") from None
    if not isinstance(cases, list) or not cases:
        raise ExperimentError(f"{path}: queries = {value!r}: {queries} has no [[case]] tables")
    for i, c in enumerate(cases, 1):
        query, expect = (c.get("query"), c.get("expect")) if isinstance(c, dict) else (None, None)
        paths = [expect] if isinstance(expect, str) else expect if isinstance(expect, list) else []
        good = bool(paths) and all(isinstance(e, str) and e for e in paths)
        if not good or not isinstance(query, str) or not query.strip():
            raise ExperimentError(
                f"{path}: queries = {value!r}: case {i} of {queries} needs query = words and expect = a path "
                "or a list of paths, relative to the corpus root (`corpus:path` names the corpus)"
            )
    return queries


def _check_factor(where: str, factor: str) -> None:
    if factor not in FACTORS:
        raise ExperimentError(f"{where}: unknown factor {factor!r}; the factors are {', '.join(FACTORS)}")


def load_experiment(path: str | Path) -> Experiment:
    """The experiment a TOML file defines, or one ExperimentError line saying what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ExperimentError(f"experiment file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ExperimentError(f"{path}: not TOML ({e})") from None
    unknown = [k for k in data if k not in KEYS]
    if unknown:
        raise ExperimentError(f"{path}: unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}")
    if not isinstance(data.get("suite"), str) or not data["suite"]:
        raise ExperimentError(
            f"{path}: suite = a folder or list file of tasks (relative to this file) is missing"
        )
    suite = Path(data["suite"]).expanduser()
    suite = Path(os.path.normpath(suite if suite.is_absolute() else path.parent / suite))
    evals = data.get("evals", bench.DEFAULTS["evals"])
    if isinstance(evals, bool) or not isinstance(evals, int) or evals < 1:
        raise ExperimentError(
            f"{path}: evals = {evals!r}: evaluations per task must be an integer, at least 1"
        )
    seeds = data.get("seeds", [0])
    if (
        not isinstance(seeds, list)
        or not seeds
        or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**32 for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise ExperimentError(
            f"{path}: seeds = {seeds!r}: give a list of distinct integers from 0 to 2**32-1"
        )
    resamples = data.get("resamples", RESAMPLES)
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 100:
        raise ExperimentError(f"{path}: resamples = {resamples!r}: bootstrap resamples must be at least 100")
    fixed = data.get("fixed", {})
    matrix = data.get("matrix", {})
    if not isinstance(fixed, dict) or not isinstance(matrix, dict):
        raise ExperimentError(f"{path}: [fixed] and [matrix] are tables of factors")
    for factor, value in fixed.items():
        _check_factor(f"{path} [fixed]", factor)
        _check_value(f"{path} [fixed]", factor, value)
    levels: dict[str, tuple[Any, ...]] = {}
    for factor, values in matrix.items():
        _check_factor(f"{path} [matrix]", factor)
        if factor in fixed:
            raise ExperimentError(f"{path}: {factor} is both fixed and in the matrix; say it in one of them")
        if not isinstance(values, list) or not values:
            raise ExperimentError(
                f"{path} [matrix]: {factor} = a list of values, e.g. {factor} = {list(_allowed(factor))[:2]!r}"
            )
        if len(set(map(repr, values))) != len(values):
            raise ExperimentError(f"{path} [matrix]: {factor} = {values!r} names a value twice")
        levels[factor] = tuple(_check_value(f"{path} [matrix]", factor, v) for v in values)
    if math.prod(len(v) for v in levels.values()) < 2:
        raise ExperimentError(
            f"{path}: an experiment compares cells: give [matrix] a factor with two values or more"
        )
    cells = tuple(
        Cell("+".join(f"{k}={_show(v)}" for k, v in zip(levels, combo, strict=True)),
             {**DEFAULT_FACTORS, **fixed, **dict(zip(levels, combo, strict=True))})
        for combo in itertools.product(*levels.values())
    )  # fmt: skip
    names = [c.name for c in cells]
    baseline = data.get("baseline", names[0])
    if isinstance(baseline, dict):
        for factor in baseline:
            _check_factor(f"{path} [baseline]", factor)
        match = [c.name for c in cells if all(c.factors.get(k) == v for k, v in baseline.items())]
        if len(match) != 1:
            raise ExperimentError(
                f"{path}: [baseline] matches {len(match)} cells, not one; the cells are {', '.join(names)}"
            )
        baseline = match[0]
    if baseline not in names:
        raise ExperimentError(
            f"{path}: baseline = {baseline!r} is not a cell; the cells are {', '.join(names)}"
        )
    name = data.get("name", path.stem)
    description = data.get("description", "")
    if not isinstance(name, str) or not isinstance(description, str):
        raise ExperimentError(f"{path}: name and description are text")
    queries = _check_queries(path, data["queries"]) if "queries" in data else None
    return Experiment(name, path, suite, evals, tuple(seeds), fixed, levels, cells, baseline, resamples,
                      description, queries)  # fmt: skip


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(map(_toml_value, v)) + "]"
    raise TypeError(f"no TOML for {v!r}")


def _relative(target: Path, where: Path) -> str:
    """A path as seen from the folder `where`: relative while both share a folder below the root (a checkout
    moved whole still works), else absolute."""
    target, here = Path(target).resolve(), Path(where).resolve()
    shared = os.path.commonpath([target, here]) != target.anchor
    return os.path.relpath(target, here) if shared else str(target)


def to_toml(exp: Experiment, where: Path) -> str:
    """The experiment as TOML for a file in the folder `where`: its suite (and query set) paths relative to
    that folder, so the copy kept beside the results reruns the same experiment from there."""
    suite = _relative(exp.suite, where)
    lines = [
        f"# kernelpro experiment (a copy of {exp.path}; rerun: kernelpro experiment THIS_FILE --out DIR)"
    ]
    lines += [f"name = {_toml_value(exp.name)}"]
    if exp.description:
        lines.append(f"description = {_toml_value(exp.description)}")
    lines += [f"suite = {_toml_value(suite)}", f"evals = {exp.evals}", f"seeds = {_toml_value(list(exp.seeds))}",
              f"baseline = {_toml_value(exp.baseline)}", f"resamples = {exp.resamples}"]  # fmt: skip
    if exp.queries is not None:
        lines.append(f"queries = {_toml_value(_relative(exp.queries, where))}")
    if exp.fixed:
        lines += ["", "[fixed]", *(f"{k} = {_toml_value(v)}" for k, v in exp.fixed.items())]
    lines += ["", "[matrix]", *(f"{k} = {_toml_value(list(v))}" for k, v in exp.matrix.items())]
    return "\n".join(lines) + "\n"


# -- the experiment folder ---------------------------------------------------------------------------------


def cell_folder(out: Path, cell: str, seed: int) -> Path:
    return Path(out) / CELLS / cell / f"seed-{seed}"


def open_experiment(out: Path, exp: Experiment, suite: bench.Suite, resume: bool) -> dict[str, Any]:
    """The experiment folder's manifest, written (with the TOML copy) for a new experiment or checked
    against the suite and definition of the one there."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExperimentError(f"--out {out} is a file, not a folder")
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)
        if not resume:
            raise ExperimentError(
                f"{out} holds an experiment already; add --resume to continue it, or give another --out"
            )
        if manifest["fingerprint"] != suite.fingerprint:
            raise ExperimentError(
                f"{out} was run on another suite ({manifest['suite']}), not {suite.source}; give another --out"
            )
        if manifest["definition"] != json.loads(json.dumps(exp.definition())):
            raise ExperimentError(
                f"{out} holds another experiment (its cells, seeds, evals or baseline differ); give another --out"
            )
        return manifest
    if out.is_dir() and any(out.iterdir()):
        raise ExperimentError(
            f"--out {out} is not empty and holds no experiment ({MANIFEST}); give a new folder"
        )
    manifest = {
        "name": exp.name,
        "description": exp.description,
        "suite": str(exp.suite),
        "fingerprint": suite.fingerprint,
        "tasks": suite.size,
        "definition": exp.definition(),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    out.mkdir(parents=True, exist_ok=True)
    bench._write_atomic(out / COPY, to_toml(exp, out))
    bench._write_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(out: Path) -> dict[str, Any]:
    path = Path(out) / MANIFEST
    if not path.is_file():
        raise ExperimentError(f"{out} is not an experiment folder (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise ExperimentError(f"{path}: not JSON ({e})") from None
    if not isinstance(manifest, dict) or not {"suite", "fingerprint", "definition"} <= manifest.keys():
        raise ExperimentError(f"{path}: not an experiment manifest")
    return manifest


@dataclass(frozen=True)
class CellRun:
    """One cell x seed in this call: the tasks it ran and skipped, or why it could not start."""

    cell: str
    seed: int
    folder: Path
    ran: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class ExperimentResult:
    out: Path
    runs: tuple[CellRun, ...]
    reports: dict[str, Path] = field(default_factory=dict)


def run_experiment(out: Path, exp: Experiment, suite: bench.Suite, cfg: Config, *,
                   replay: bench.ReplayIndex | None = None,
                   progress: Callable[[int, int, str], None] | None = None,
                   task_progress: Callable[[int, int, str], None] | None = None,
                   on_row: Callable[[str, int, dict[str, Any]], None] | None = None) -> ExperimentResult:  # fmt: skip
    """Every cell x seed as a bench, in order; a bench that has rows already is resumed (its tasks with a
    row are skipped). A cell that cannot start is a CellRun with an error, and the next cell runs. Then the
    reports."""
    runs: list[CellRun] = []
    pairs = [(c, s) for c in exp.cells for s in exp.seeds]
    for i, (cell, seed) in enumerate(pairs):
        folder = cell_folder(out, cell.name, seed)
        if progress:
            progress(i, len(pairs), f"{cell.name} seed {seed}")
        try:
            manifest = bench.open_bench(folder, suite, cell.settings(exp.evals, seed, exp.name), resume=True)
            result = bench.run_bench(
                folder, suite, cfg, manifest, replay=replay, progress=task_progress,
                on_row=(lambda row, c=cell.name, s=seed: on_row(c, s, row)) if on_row else None,
            )  # fmt: skip
            runs.append(CellRun(cell.name, seed, folder, result.ran, result.skipped))
        except bench.BenchError as e:
            runs.append(CellRun(cell.name, seed, folder, error=str(e)))
    if progress:
        progress(len(pairs), len(pairs), "")
    write_retrieval(out, exp, cfg)
    return ExperimentResult(Path(out), tuple(runs), write_reports(out))


# -- the corpora: retrieval and use ------------------------------------------------------------------------


def measure_retrieval(exp: Experiment, cfg: Config) -> dict[str, Any] | None:
    """recall@k and MRR of each cell's corpora on the experiment's query set (index.hunt.evaluate), or why
    not (no corpus, an index not built); None without a query set."""
    if exp.queries is None:
        return None
    out: dict[str, Any] = {"queries": str(exp.queries), "k": RECALL_K, "cases": None, "corpora": {}}
    try:
        from index.hunt import evaluate, load_cases, open_corpora

        cases = load_cases(exp.queries)
    except Exception as e:  # the index stack is not installed, or the file changed since it was checked
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return out
    out["cases"] = len(cases)
    for corpus in dict.fromkeys(c.factors["corpus"] for c in exp.cells):
        entry: dict[str, Any] = {"cells": [c.name for c in exp.cells if c.factors["corpus"] == corpus]}
        names = corpus_names(corpus)
        hunter, missing = open_corpora(cfg, names) if names else (None, {})
        if not names:
            entry["error"] = "no corpus: the runs retrieve nothing"
        elif missing:
            entry["error"] = "not measured: " + "; ".join(f"{n}: {why}" for n, why in missing.items())
        else:
            try:
                report = evaluate(hunter, cases, k=RECALL_K)  # type: ignore[arg-type]
            except Exception as e:  # a case's bad arch filter, a store that failed under the queries
                entry["error"] = f"not measured: {type(e).__name__}: {str(e)[:200]}"
            else:
                cases_out = [{"query": r.case.query, "rank": r.rank} for r in report.per_case]
                entry.update(
                    recall=report.recall_at_5, mrr=report.mrr, p50_ms=report.p50_ms, per_case=cases_out
                )
        out["corpora"][corpus] = entry
    return out


def write_retrieval(out: Path, exp: Experiment, cfg: Config) -> dict[str, Any] | None:
    """The retrieval measured now (the indexes may have been built since the last run), kept beside the
    results so the reports re-render without the indexes."""
    path = Path(out) / RETRIEVAL
    data = measure_retrieval(exp, cfg)
    if data is None:
        path.unlink(missing_ok=True)
    else:
        bench._write_atomic(path, json.dumps(data, indent=1) + "\n")
    return data


def read_retrieval(out: Path) -> dict[str, Any] | None:
    path = Path(out) / RETRIEVAL
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


_PREFIXED = re.compile(r"([A-Za-z0-9_.-]+):([^:].*)")  # corpus:path, not a C++ name (cutlass::arch::...)
_MISSING = re.compile(r"no building blocks from the source index(?: of corpus (\S+))?")


def block_corpus(
    block: str, source: str, run_corpora: Sequence[str], known: Sequence[str]
) -> tuple[str, str]:
    """(corpus, block) of one entry of a candidate's `blocks`: `corpus:path` as the LLM records a block
    since runs draw on several corpora; an atom of the expert's GEMM templates (its `// building block:`
    line) is a CUTLASS symbol, checked against the installed CUTLASS headers whatever the corpus setting;
    a bare path of a run over one corpus is that corpus's; else "unattributed"."""
    m = _PREFIXED.fullmatch(block)
    if m and m.group(1) in known:
        return m.group(1), m.group(2)
    if re.search(rf"^// building block: {re.escape(block)} \(", source, re.M):
        return "cutlass", block
    if len(run_corpora) == 1:
        return run_corpora[0], block
    return "unattributed", block


def _run_states(out: Path, cell: str, rows_by_seed: Mapping[int, Sequence[Mapping[str, Any]]]) -> Any:
    """(row, the folded run log) of each row of the cell whose run log reads."""
    from pipeline.runlog import RunLogError, read_events
    from pipeline.runstate import fold

    for seed, rows in rows_by_seed.items():
        for r in rows:
            log = cell_folder(out, cell, seed) / bench.RUNS / str(r.get("run_id")) / "log.jsonl"
            if not r.get("run_id") or not log.is_file():
                continue  # a task that never ran (unsupported, no recording): no search
            try:
                yield r, fold(read_events(log))
            except (RunLogError, OSError):
                continue


def corpus_use(
    out: Path, cell: str, rows_by_seed: Mapping[int, Sequence[Mapping[str, Any]]]
) -> dict[str, Any]:
    """Which building blocks the cell's runs took from each corpus, from their logs: per corpus the
    candidates that record one of its blocks, the runs whose best candidate does, and each block's count;
    and the runs that had no index of a corpus (their notes)."""
    from corpora import list_corpora

    known = list_corpora()
    runs = candidates = with_blocks = 0
    by_corpus: dict[str, dict[str, Any]] = {}
    missing: dict[str, int] = {}
    for row, state in _run_states(out, cell, rows_by_seed):
        runs += 1
        try:
            run_corpora = corpus_names(state.header.config.get("corpus", "cutlass"))  # older logs: cutlass
        except ValueError:
            run_corpora = ()
        for note in row.get("notes") or ():
            m = _MISSING.match(str(note))
            for name in (m.group(1),) if m and m.group(1) else run_corpora if m else ():
                missing[name] = missing.get(name, 0) + 1
        best = state.final.node if state.final else state.end.best_node if state.end else None
        for node in state.nodes.values():
            cand = node.candidate
            if cand is None:
                continue
            candidates += 1
            used: dict[str, list[str]] = {}
            for b in cand.blocks:
                corpus, name = block_corpus(b, cand.source, run_corpora, known)
                used.setdefault(corpus, []).append(name)
            with_blocks += bool(used)
            for corpus, names in used.items():
                e = by_corpus.setdefault(corpus, {"candidates": 0, "best": 0, "blocks": {}})
                e["candidates"] += 1
                e["best"] += node.id == best
                for name in dict.fromkeys(names):
                    e["blocks"][name] = e["blocks"].get(name, 0) + 1
    for e in by_corpus.values():
        e["blocks"] = dict(sorted(e["blocks"].items(), key=lambda kv: (-kv[1], kv[0])))
    return {"runs": runs, "candidates": candidates, "with_blocks": with_blocks,
            "by_corpus": dict(sorted(by_corpus.items())), "missing_index": missing}  # fmt: skip


# -- statistics (pure) -------------------------------------------------------------------------------------


def _best_times(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Task key -> best verified time, of the rows whose run verified and timed a candidate."""
    return {
        r["key"]: float(r["ours_ms"]) for r in rows if bench.row_status(dict(r)) == "ok" and r.get("ours_ms")
    }


def paired_ratios(cell: Mapping[int, Sequence[Mapping[str, Any]]],
                  base: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:  # fmt: skip
    """Per task both verified under a common seed: the cell's best time over the baseline's, the geometric
    mean over those seeds. In the baseline's task order."""
    logs: dict[str, list[float]] = {}
    for seed in sorted(set(cell) & set(base)):
        mine, theirs = _best_times(cell[seed]), _best_times(base[seed])
        for key in theirs:
            if key in mine:
                logs.setdefault(key, []).append(math.log(mine[key] / theirs[key]))
    order = {r["key"]: i for rows in base.values() for i, r in enumerate(rows)}
    return [{"key": k, "ratio": math.exp(sum(v) / len(v)), "seeds": len(v)}
            for k, v in sorted(logs.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))]  # fmt: skip


def bootstrap_ci(ratios: Sequence[float], *, resamples: int = RESAMPLES, seed: int = 0,
                 level: float = LEVEL) -> tuple[float, float] | None:  # fmt: skip
    """A percentile bootstrap interval of the geomean ratio: tasks resampled with replacement, seeded (the
    same rows, the same interval). None under two tasks: one task's ratio says nothing of the spread."""
    import numpy as np

    logs = np.log(np.asarray(ratios, dtype=float))
    if len(logs) < 2:
        return None
    rng = np.random.default_rng(seed)
    means = logs[rng.integers(0, len(logs), size=(resamples, len(logs)))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(math.exp(lo)), float(math.exp(hi))


def signed_rank(ratios: Sequence[float]) -> tuple[float | None, str]:
    """Wilcoxon's signed-rank test (two-sided) of the log ratios against 0 (as fast as the baseline): its
    p-value and the test's name, or None and why not. Ties with the baseline (a zero log ratio) carry no
    sign and are dropped, as scipy's default does; under MIN_PAIRS left, there is nothing to test."""
    from scipy.stats import wilcoxon

    logs = [math.log(r) for r in ratios]
    nonzero = sum(1 for x in logs if x != 0)
    if nonzero < MIN_PAIRS:
        return None, f"too few paired tasks ({nonzero} with a difference, {MIN_PAIRS} needed)"
    return float(wilcoxon(logs).pvalue), "wilcoxon signed-rank, two-sided"


def compare(
    pairs: Sequence[Mapping[str, Any]], *, resamples: int = RESAMPLES, seed: int = 0
) -> dict[str, Any]:
    """The paired comparison of a cell with the baseline over its paired tasks (paired_ratios)."""
    ratios = [float(p["ratio"]) for p in pairs]
    tie = math.log1p(TIE)
    ci = bootstrap_ci(ratios, resamples=resamples, seed=seed)
    p, test = signed_rank(ratios)
    return {
        "paired": len(ratios),
        "geomean_ratio": bench.geomean(ratios),
        "ci": list(ci) if ci else None,
        "level": LEVEL,
        "p_value": p,
        "test": test,
        # ratio = cell time / baseline time: below 1 the cell is faster, a win.
        "wins": sum(1 for r in ratios if math.log(r) < -tie),
        "losses": sum(1 for r in ratios if math.log(r) > tie),
        "ties": sum(1 for r in ratios if abs(math.log(r)) <= tie),
        "tasks": [dict(p) for p in pairs],
    }


def best_so_far(points: Sequence[Any], evals: int) -> list[float]:
    """The best speedup over eager after each of `evals` evaluations of one run (its points, in order).

    Before anything is verified the run has the reference to fall back on: 1x. A run that stopped before
    its budget keeps its last best to the end, so runs of one cell average over the same x."""
    out, best = [], 1.0
    for i in range(evals):
        if i < len(points) and points[i].speedup:
            best = max(best, float(points[i].speedup))
        out.append(best)
    return out


def mean_curve(curves: Sequence[Sequence[float]]) -> list[float]:
    """The geometric mean across runs at each evaluation (speedups are ratios)."""
    if not curves:
        return []
    return [bench.geomean(col) or 0.0 for col in zip(*curves, strict=True)]


# -- reports -----------------------------------------------------------------------------------------------


def load_cells(out: Path, manifest: dict[str, Any]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Cell -> seed -> the bench's rows (empty for a cell x seed not run yet)."""
    out = Path(out)
    seeds = manifest["definition"]["seeds"]
    cells: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for name in manifest["definition"]["cells"]:
        cells[name] = {}
        for seed in seeds:
            folder = cell_folder(out, name, seed)
            cells[name][seed] = bench.load_rows(folder)[1] if (folder / bench.MANIFEST).is_file() else []
    return cells


def cell_curve(out: Path, cell: str, rows_by_seed: Mapping[int, Sequence[Mapping[str, Any]]],
               evals: int) -> tuple[list[float], int]:  # fmt: skip
    """A cell's evaluations-to-best curve over its runs' logs, and how many runs it averages."""
    curves = [best_so_far(state.points, evals) for _, state in _run_states(out, cell, rows_by_seed)]
    return mean_curve(curves), len(curves)


def analyse(out: Path) -> dict[str, Any]:
    """Everything the reports say, from the experiment folder alone."""
    out = Path(out)
    manifest = read_manifest(out)
    d = manifest["definition"]
    cells = load_cells(out, manifest)
    summary: dict[str, Any] = {}
    for name, by_seed in cells.items():
        rows = [r for rows in by_seed.values() for r in rows]
        s = bench.summary(rows)
        curve, n = cell_curve(out, name, by_seed, int(d["evals"]))
        summary[name] = {
            "factors": d["cells"][name],
            "runs": {str(seed): len(rows) for seed, rows in by_seed.items()},
            "written": s["tasks"],
            "verified": s["verified"],
            "statuses": s["statuses"],
            "ours_over_eager": s["ours_over_eager"],
            "curve": curve,
            "curve_runs": n,
            "use": corpus_use(out, name, by_seed),
        }
    base = d["baseline"]
    comparisons = [
        {"cell": name, "baseline": base,
         **compare(paired_ratios(cells[name], cells[base]), resamples=int(d["resamples"]))}
        for name in cells if name != base
    ]  # fmt: skip
    return {
        "name": manifest["name"],
        "description": manifest.get("description", ""),
        "suite": manifest["suite"],
        "tasks": manifest.get("tasks"),
        "definition": d,
        "tie": TIE,
        "cells": summary,
        "comparisons": comparisons,
        "retrieval": read_retrieval(out),
    }


def write_reports(out: Path) -> dict[str, Path]:
    """summary.json, report.md and report.html of an experiment folder, from its benches alone."""
    from pipeline import suite_report

    out = Path(out)
    data = analyse(out)
    texts = {
        "json": json.dumps(data, indent=1, default=str) + "\n",
        "markdown": suite_report.experiment_markdown(data),
        "html": suite_report.experiment_html(data),
    }
    paths = {}
    for kind, text in texts.items():
        bench._write_atomic(out / REPORTS[kind], text)
        paths[kind] = out / REPORTS[kind]
    return paths
