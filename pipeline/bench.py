"""Suites: `kernelpro optimize` over many tasks with one budget, one row per task, and the suite's report.

A bench folder holds a manifest (bench.json: the suite it belongs to and the settings every task gets), the
runs (runs/<run-id>/, the loop's own folders and logs), a JSON-lines store with one summary row per finished
task (results.jsonl) and the reports (summary.json, report.md, report.html). A row is on disk as soon as its
task ends, so a killed bench loses at most the task in flight, and that task's run is resumed from its log
the next time. Running the same command again with `--resume` skips the tasks that have a row: a suite runs
in parts (`--budget-s`, `--match`) and on several machines.

A task that fails is a row with a status (`TaskStatus`), never an exception that stops the suite; only what
no task could get past (no GPU, Ctrl-C) stops it, without a row.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import hashlib
import itertools
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import Config, validate
from pipeline.reasons import first_line
from pipeline.runlog import RunLogError, read_events
from pipeline.runstate import RunState, fold
from pipeline.selfcheck import read_store, task_files, task_key
from pipeline.types import speedup

if TYPE_CHECKING:
    from pipeline.worker import WorkerPool

MANIFEST, STORE, RUNS = "bench.json", "results.jsonl", "runs"
RETRIED = "results.retried.jsonl"  # rows taken out of the store by --retry, kept: nothing measured is lost
REPORTS = {"json": "summary.json", "markdown": "report.md", "html": "report.html"}
# The settings every task of a bench gets; a resumed bench keeps its own (comparable rows).
DEFAULTS: dict[str, Any] = {"evals": 12, "policy": "expert", "search": "mcts"}
# Settings a bench records only when given (an experiment's cells): benches made without them keep the
# manifest they always had, and run with the config's own values.
OPTIONAL = ("seed", "feedback", "objective", "memory", "memory_collection", "corpus", "energy")


class BenchError(ValueError):
    """A bench that cannot start (no suite, an empty one, a folder of another suite), in one line."""


class TaskStatus(enum.StrEnum):
    """How a task of a suite ended."""

    OK = "ok"  # the run found a verified candidate and timed it
    NO_KERNEL = "no_kernel"  # the run ended without a verified candidate faster than nothing
    UNSUPPORTED = "unsupported"  # the policy cannot write kernels for this task
    TASK_ERROR = "task_error"  # the task file does not load (syntax, no Model, inputs too large)
    REFERENCE_FAILED = "reference_failed"  # the reference's baselines could not be measured
    NO_RECORDING = "no_recording"  # replaying: no recorded run of this task's source
    ERROR = "error"  # the run stopped with a reason (an endpoint that refuses, a malformed log)
    CRASH = "crash"  # an unexpected exception in a stage: a bug to look at


def row_status(row: dict[str, Any]) -> str:
    """A row's status; rows written before statuses existed (benchmarks/results/*.jsonl) have none."""
    if row.get("status"):
        return str(row["status"])
    if "error" in row:
        return TaskStatus.ERROR.value
    return TaskStatus.OK.value if row.get("ours_ms") else TaskStatus.NO_KERNEL.value


# -- one run's row ---------------------------------------------------------------------------------------

# Where a run's seconds went: each gap between two events of its log counts for the later one's stage.
STAGE_OF = {"baselines": "baselines", "result": "evaluations", "profile": "profile", "final": "final"}


def seconds_by_stage(events: Sequence[Any]) -> dict[str, float]:
    """The run's wall time from its start to its last event, by stage (baselines, candidate evaluations,
    profiling, the best's final re-measure (with energy unless the bench measures none), the rest:
    proposing, compiling while nothing else is logged, bookkeeping)."""
    out = dict.fromkeys((*STAGE_OF.values(), "other"), 0.0)
    for prev, e in itertools.pairwise(events):
        out[STAGE_OF.get(e.type, "other")] += max(0.0, e.t - prev.t)
    return {k: round(v, 1) for k, v in out.items()}


def summarise(folder: Path) -> dict[str, Any]:
    """A finished run's row: baselines, the best candidate's time measured alongside eager, its speedups,
    kind, fraction of the roofline floor and energy per call, and where the seconds went.

    The best is the end-of-run re-measurement when the run made one (on a GPU, with energy and both
    baselines), else the search's best evaluation (a replayed run), timed next to eager only: its speedup
    over torch.compile is then against the run's compile baseline."""
    events = read_events(Path(folder) / "log.jsonl")
    state = fold(events)
    base, end = state.baselines, state.end
    if base is None:
        raise RunLogError(f"{folder}: the run has no baselines")
    compile_ms = base.timings["compile"].median_ms if "compile" in base.timings else None
    row: dict[str, Any] = {
        "eager_ms": base.timings["eager"].median_ms,
        "compile_ms": compile_ms,
        "floor_ms": base.floor_ms,
        "eager_energy_mj": 1e3 * base.energy_eager_j if base.energy_eager_j else None,
        "evaluations": end.evaluations if end else None,
        "statuses": {s.value: n for s, n in state.statuses.items()},
        "stop": end.reason if end else None,
        # the card every time of the row is from (a bench resumed on other machines mixes cards across rows)
        "gpu": state.ceilings.gpu if state.ceilings else None,
    }
    best, measured = _best_evaluation(state)
    m = best.measurement if best else None
    if best and m and m.timing:
        ours = m.timing.median_ms
        comp = m.baselines.get("compile")
        row.update(
            ours_ms=ours,
            kind=best.verdict.kind.value if best.verdict.kind else None,
            measured=measured,
            eager_alongside_ms=m.baselines["eager"].median_ms,
            compile_alongside_ms=comp.median_ms if comp else compile_ms,
            energy_mj=1e3 * m.energy.joules_per_call if m.energy else None,
            power_w=m.energy.avg_power_w if m.energy else None,
        )
        row["speedup_eager"] = speedup(row["eager_alongside_ms"], ours)
        if row["compile_alongside_ms"]:
            row["speedup_compile"] = speedup(row["compile_alongside_ms"], ours)
        if row["floor_ms"]:
            row["fraction_of_floor"] = row["floor_ms"] / ours
        if m.kernels:  # which of its launcher's paths ran on this card, and where its time went
            row["kernels"] = {k: round(us, 2) for k, us in sorted(m.kernels.items(), key=lambda kv: -kv[1])}
    row.update(own_gemm(state, row["floor_ms"]))
    row["seconds"] = seconds_by_stage(events)
    return row


def _best_evaluation(state: RunState) -> tuple[Any, str | None]:
    if state.final is not None:
        return state.final.evaluation, "final"
    node = state.nodes.get(state.end.best_node) if state.end and state.end.best_node else None
    if node is not None and node.time_ms is not None:
        return node.evaluation, "search"
    return None, None


def own_gemm(state: RunState, floor_ms: float | None) -> dict[str, Any]:
    """The fastest verified candidate whose GEMM is our own WGMMA kernel (it may not be the run's best: a
    cuBLAS hybrid can win), timed in the search, and its fraction of the floor (the bf16 matmul ceiling)."""
    from pipeline.generate.expert.plan import plan_of
    from pipeline.generate.expert.render import uses_cute

    best = None
    for p in state.points:
        node = state.nodes[p.node]
        plan = plan_of(node.candidate.source) if node.candidate else None
        if plan and uses_cute(plan) and p.time_ms and (best is None or p.time_ms < best[0]):
            best = (p.time_ms, node.edit)
    if best is None:
        return {}
    out: dict[str, Any] = {"own_gemm_ms": best[0], "own_gemm_candidate": best[1]}
    if floor_ms:
        out["own_gemm_fraction_of_floor"] = floor_ms / best[0]
    return out


def run_task(key: str, path: Path, cfg: Config, *, replay: ReplayIndex | None = None,
             resume: str | None = None, pool: WorkerPool | None = None) -> dict[str, Any]:  # fmt: skip
    """One task through `optimize`: its row, whatever happened. Only what stops every task (no GPU, no
    toolchain, Ctrl-C) is raised."""
    from pipeline.compile import ToolchainError
    from pipeline.loop import OptimizeError, ReferenceFailed, UnsupportedTask, optimize
    from pipeline.stages import NoGPUError
    from pipeline.tasks import TaskError

    t0 = time.monotonic()
    row: dict[str, Any] = {"key": key, "task": path.stem, "path": str(path)}
    status, error = TaskStatus.CRASH, None
    try:
        recordings = replay.find(path) if replay is not None else None
        if replay is not None and not recordings and resume is None:
            status, error = (
                TaskStatus.NO_RECORDING,
                f"no recorded run of this task's source under {replay.root}",
            )
        else:
            outcome = optimize(path, cfg, resume=resume, replay=recordings or None, pool=pool)
            row.update(summarise(outcome.folder))
            row.update(run_id=outcome.run_id, notes=list(outcome.notes))
            status = TaskStatus.OK if row.get("ours_ms") else TaskStatus.NO_KERNEL
    except (NoGPUError, ToolchainError):
        raise
    except UnsupportedTask as e:
        status, error = TaskStatus.UNSUPPORTED, str(e)
    except ReferenceFailed as e:
        status, error = TaskStatus.REFERENCE_FAILED, str(e)
    except TaskError as e:
        status, error = TaskStatus.TASK_ERROR, str(e)
    except (OptimizeError, RunLogError) as e:
        status, error = TaskStatus.ERROR, str(e)
    except Exception as e:  # a stage's bug must not end the suite: the row says what it was
        status, error = TaskStatus.CRASH, f"{type(e).__name__}: {first_line(e)}"
    row["status"] = status.value
    if error is not None:
        row["error"] = error
    row.update(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        wall_s=round(time.monotonic() - t0, 1),
    )
    return row


# -- replayed evaluations ----------------------------------------------------------------------------------


def source_hash(path: Path) -> str:
    """The hash a run log's header records for its task (pipeline/tasks.py): of the file's text."""
    return hashlib.sha256(Path(path).read_text().encode()).hexdigest()


@dataclass(frozen=True)
class ReplayIndex:
    """Run logs recorded on a GPU under a folder, by the source of the task they ran: a suite's task gets
    the recordings of its exact source, whatever the file is called (how a bench runs without a GPU)."""

    root: Path
    by_source: dict[str, tuple[Path, ...]]

    @classmethod
    def scan(cls, root: Path) -> ReplayIndex:
        root = Path(root)
        if not root.is_dir():
            raise BenchError(f"--replay {root}: not a folder of recorded runs")
        found: dict[str, list[Path]] = {}
        for log in sorted(root.rglob("log.jsonl")):
            try:
                with log.open() as f:
                    head = json.loads(f.readline())
                digest = head["data"]["task"]["source_hash"]
            except (ValueError, KeyError, TypeError, OSError):
                continue  # not a run log: not a recording
            found.setdefault(digest, []).append(log)
        if not found:
            raise BenchError(f"--replay {root}: no recorded run logs (*/log.jsonl) there")
        return cls(root, {k: tuple(v) for k, v in found.items()})

    def find(self, task: Path) -> tuple[Path, ...]:
        return self.by_source.get(source_hash(task), ())


# -- suites ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Suite:
    """The tasks of a suite (key -> file, in suite order) and a fingerprint of all of them: the keys and the
    files' contents, not their paths, so the same suite checked out elsewhere is the same suite."""

    source: str
    tasks: dict[str, Path]
    fingerprint: str
    size: int  # tasks in the whole suite, before --match


def load_suite(source: str | Path, match: str | None = None) -> Suite:
    """A folder of KernelBench-format task files (searched recursively), one task file, or a list file with
    one task path per line (`#` starts a comment; relative paths are from the list's folder); `match` keeps
    the tasks whose key (folder/name) it finds."""
    path = Path(source)
    if not path.exists():
        raise BenchError(f"suite not found: {path}")
    paths = task_files([path]) if path.is_dir() else [path] if path.suffix == ".py" else _list_file(path)
    paths = [p for p in paths if p.name != "__init__.py"]
    if not paths:
        raise BenchError(f"the suite {path} is empty: no task files (*.py)")
    tasks: dict[str, Path] = {}
    for p in paths:
        key = task_key(p)
        if key in tasks and tasks[key].resolve() != p.resolve():
            raise BenchError(f"the suite {path} names two tasks {key}: {tasks[key]} and {p}")
        tasks[key] = p
    digest = hashlib.sha256()
    for key in sorted(tasks):
        digest.update(f"{key}\0{source_hash(tasks[key])}\n".encode())
    size = len(tasks)
    if match:
        try:
            pattern = re.compile(match)
        except re.error as e:
            raise BenchError(f"--match {match!r} is not a regular expression: {e}") from None
        tasks = {k: p for k, p in tasks.items() if pattern.search(k)}
        if not tasks:
            raise BenchError(f"no task of the suite {path} ({size} tasks) matches --match {match!r}")
    return Suite(str(source), tasks, digest.hexdigest()[:16], size)


def _list_file(path: Path) -> list[Path]:
    out = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        task = Path(line) if Path(line).is_absolute() else path.parent / line
        if not task.is_file():
            raise BenchError(f"{path}:{n}: task file not found: {line}")
        out.append(task)
    return out


# -- the bench folder ------------------------------------------------------------------------------------


def open_bench(out: Path, suite: Suite, settings: dict[str, Any], resume: bool) -> dict[str, Any]:
    """The bench folder's manifest, written for a new bench or checked against the suite and settings of
    the one there. `settings` values left None take the bench's own (or the defaults for a new one)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out} is a file, not a folder")
    manifest = read_manifest(out) if (out / MANIFEST).is_file() else None
    if manifest is None:
        if out.is_dir() and any(out.iterdir()):
            raise BenchError(f"--out {out} is not empty and holds no bench ({MANIFEST}); give a new folder")
        manifest = {
            "suite": suite.source,
            "fingerprint": suite.fingerprint,
            "tasks": suite.size,
            "settings": {
                **{k: settings.get(k) if settings.get(k) is not None else v for k, v in DEFAULTS.items()},
                **{k: settings[k] for k in OPTIONAL if settings.get(k) is not None},
            },
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        out.mkdir(parents=True, exist_ok=True)
        _write_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        return manifest
    if not resume:
        raise BenchError(f"{out} holds a bench already; add --resume to continue it, or give another --out")
    if manifest["fingerprint"] != suite.fingerprint:
        raise BenchError(
            f"{out} was written by another suite ({manifest['suite']}, {manifest['tasks']} tasks), not "
            f"{suite.source} ({suite.size} tasks); give another --out"
        )
    own = manifest["settings"]
    for k, v in settings.items():
        if v is not None and k in own and own[k] != v:
            raise BenchError(f"{out} runs every task with --{k} {own[k]}, not {v}: one budget per bench")
        # A setting the bench was made without would be ignored: say so rather than run without it.
        if v is not None and k not in own and k in OPTIONAL:
            raise BenchError(
                f"{out} was made without --{k} (its tasks run with the config's {k}); give another --out for "
                f"--{k} {v}: one budget per bench"
            )
    return manifest


def read_manifest(out: Path) -> dict[str, Any]:
    path = Path(out) / MANIFEST
    if not path.is_file():
        raise BenchError(f"{out} is not a bench folder (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise BenchError(f"{path}: not JSON ({e})") from None
    if not isinstance(manifest, dict) or not {"suite", "fingerprint", "settings"} <= manifest.keys():
        raise BenchError(f"{path}: not a bench manifest")
    return manifest


def bench_config(cfg: Config, out: Path, manifest: dict[str, Any]) -> Config:
    """The config every task of the bench runs with: its settings, its runs folder, and no memory across
    tasks unless the bench asks for it (an experiment's memory cell): a task's result must not depend on
    which tasks ran before it on this machine. A bench without a corpus setting draws building blocks from
    the config's corpora (cutlass unless KERNELPRO_CORPUS says otherwise)."""
    s = manifest["settings"]
    bench_cfg = cfg.replace(
        runs_dir=Path(out) / RUNS,
        max_evals=int(s["evals"]),
        policy=s["policy"],
        search=s["search"],
        memory=bool(s.get("memory", False)),
        **{k: s[k] for k in OPTIONAL if k != "memory" and s.get(k) is not None},
    )
    try:
        return validate(bench_cfg)
    except ValueError as e:  # a manifest edited by hand: say which bench, not a crash in every task
        raise BenchError(f"{Path(out) / MANIFEST}: {e}") from None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def append_row(store: Path, row: dict[str, Any]) -> None:
    """One row, on disk (flush + fsync) before the next task starts. A line cut short by a kill is dropped
    first, so the row is not glued onto it."""
    if store.is_file():
        data = store.read_bytes()
        if data and not data.endswith(b"\n"):
            with store.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
    with store.open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _unfinished_runs(runs_dir: Path, done_ids: set[str]) -> dict[str, str]:
    """Task key -> the id of its newest run that has no row: a bench killed in that task's run. Read from
    each log's first line only; whether the run really is unfinished is checked when its task comes up."""
    out: dict[str, str] = {}
    if not runs_dir.is_dir():
        return out
    for log in sorted(runs_dir.glob("*/log.jsonl")):
        if log.parent.name in done_ids:
            continue
        try:
            with log.open() as f:
                head = json.loads(f.readline())
            out[task_key(Path(head["data"]["task_path"]))] = log.parent.name
        except (ValueError, KeyError, TypeError, OSError):
            continue
    return out


def _resumable(runs_dir: Path, run_id: str) -> bool:
    from pipeline.runlog import is_locked

    folder = runs_dir / run_id
    if is_locked(folder):
        return False  # another process is running it
    try:
        state = fold(read_events(folder / "log.jsonl"))
    except (RunLogError, OSError):
        return False
    return state.baselines is not None and not state.finished


@dataclass(frozen=True)
class BenchResult:
    out: Path
    rows: tuple[dict[str, Any], ...]  # every row of the bench, in suite order
    ran: tuple[str, ...]  # task keys run in this call
    skipped: tuple[str, ...]  # had a row already
    remaining: tuple[str, ...]  # left for a later call (budget)
    stopped: str | None = None
    reports: dict[str, Path] = field(default_factory=dict)


def run_bench(out: Path, suite: Suite, cfg: Config, manifest: dict[str, Any], *,
              budget_s: float | None = None, replay: ReplayIndex | None = None,
              progress: Callable[[int, int, str], None] | None = None,
              on_row: Callable[[dict[str, Any]], None] | None = None,
              retry: Collection[str] = ()) -> BenchResult:  # fmt: skip
    """Each task of the suite without a row through `optimize`, one row each as it ends; then the reports.
    With `budget_s`, no task starts when the slowest task so far would not fit in what is left. `retry`:
    statuses whose rows are run again (a task that failed for want of something since installed)."""
    out = Path(out)
    store = out / STORE
    cfg = bench_config(cfg, out, manifest)
    check_statuses(retry)
    rows = read_store(store)
    # a row to retry stays the task's row until its re-run's row lands: a budget or a kill in between
    # loses nothing
    redo = {r["key"] for r in rows if row_status(r) in retry and r["key"] in suite.tasks}
    done = {r["key"] for r in rows} - redo
    todo = [k for k in suite.tasks if k not in done]
    skipped = tuple(k for k in suite.tasks if k in done)
    unfinished = _unfinished_runs(cfg.runs_dir, {r.get("run_id") for r in rows if r.get("run_id")})
    if cfg.ray:
        ran, stopped, remaining = _run_on_ray(
            out, suite, todo, cfg, budget_s, replay, progress, on_row, retry
        )
    else:
        with _shared_pool(cfg, bool(todo) and replay is None) as pool:
            ran, stopped, remaining = _run_here(
                store, suite, todo, cfg, budget_s, replay, progress, on_row, unfinished, pool, retry
            )
    reports = write_reports(out)
    return BenchResult(out, tuple(_in_order(read_store(store), suite)), tuple(ran), skipped, remaining,
                       stopped, reports)  # fmt: skip


@contextlib.contextmanager
def _shared_pool(cfg: Config, wanted: bool) -> Iterator[WorkerPool | None]:
    """One set of GPU workers for all of a bench's tasks run here: a confined worker takes ~11 s to start,
    which every task paid again. (A worker drops the previous task's compiled baselines when the next task
    comes.) Without a GPU, NoGPUError: it stops every task, as it would have in the first one."""
    if not wanted:
        yield None
        return
    from pipeline.stages import open_pool

    pool = open_pool(cfg)
    try:
        yield pool
    finally:
        pool.close()


def _run_here(store: Path, suite: Suite, todo: list[str], cfg: Config, budget_s: float | None,
              replay: ReplayIndex | None, progress: Callable[[int, int, str], None] | None,
              on_row: Callable[[dict[str, Any]], None] | None, unfinished: dict[str, str],
              pool: WorkerPool | None, retry: Collection[str]) -> tuple[list[str], str | None, tuple[str, ...]]:  # fmt: skip
    """The tasks of `todo` one after the other on this machine, a row each as it ends: (ran, why it
    stopped early, the tasks left)."""
    from pipeline.loop import resolve_policy
    from pipeline.prebuild import NextTask

    ran: list[str] = []
    stopped = None
    remaining: tuple[str, ...] = ()
    started = time.monotonic()
    slowest = 0.0
    ahead = NextTask(cfg) if replay is None and NextTask.wanted(cfg, resolve_policy(cfg)) else None
    try:
        for i, key in enumerate(todo):
            elapsed = time.monotonic() - started
            if budget_s is not None and ran and elapsed + slowest > budget_s:
                stopped = _budget_spent(budget_s, elapsed, slowest)
                remaining = tuple(todo[i:])
                break
            if progress:
                progress(i, len(todo), key)
            if any(r["key"] == key and row_status(r) not in retry for r in read_store(store)):
                continue  # written meanwhile by another process sharing the folder
            resume = unfinished.get(key)
            if resume and not _resumable(cfg.runs_dir, resume):
                resume = None
            if ahead is not None and i + 1 < len(todo):  # the next task's first batch, built meanwhile
                ahead.start(suite.tasks[todo[i + 1]])
            row = run_task(key, suite.tasks[key], cfg, replay=replay, resume=resume, pool=pool)
            if resume:
                row["resumed"] = resume
            land_row(store, row, retry)
            ran.append(key)
            slowest = max(slowest, row["wall_s"])
            if on_row:
                on_row(row)
        else:
            if progress and todo:
                progress(len(todo), len(todo), "")
    finally:
        if ahead is not None:
            ahead.close()
    return ran, stopped, remaining


def check_statuses(statuses: Collection[str]) -> None:
    unknown = set(statuses) - {s.value for s in TaskStatus}
    if unknown:
        raise BenchError(
            f"--retry {', '.join(sorted(unknown))}: not a task status "
            f"({', '.join(s.value for s in TaskStatus)})"
        )


def land_row(store: Path, row: dict[str, Any], retry: Collection[str] = ()) -> None:
    """A task's new row. The task's rows of the retried statuses move to RETRIED beside the store first
    (appended there before the store is rewritten, so a kill in between leaves a row in both places, never in
    neither)."""
    if retry:
        rows = read_store(store)
        out = [r for r in rows if r["key"] == row["key"] and row_status(r) in retry]
        if out:
            for r in out:
                append_row(store.with_name(RETRIED), r)
            gone = {id(r) for r in out}
            _write_atomic(
                store, "".join(json.dumps(r, default=str) + "\n" for r in rows if id(r) not in gone)
            )
    append_row(store, row)


def _run_on_ray(out: Path, suite: Suite, todo: list[str], cfg: Config, budget_s: float | None,
                replay: ReplayIndex | None, progress: Callable[[int, int, str], None] | None,
                on_row: Callable[[dict[str, Any]], None] | None,
                retry: Collection[str]) -> tuple[list[str], str | None, tuple[str, ...]]:  # fmt: skip
    """The tasks as Ray tasks across the cluster (pipeline/cluster.py), one GPU each; every row and run
    folder lands here, on the head. A task lost with its node gets no row: `--resume` runs it again."""
    from pipeline import cluster

    cluster.connect(cfg.ray)
    started, slowest = time.monotonic(), 0.0
    ran: list[str] = []
    lost: list[str] = []

    def may_start() -> bool:
        return budget_s is None or not ran or time.monotonic() - started + slowest <= budget_s

    items = [(k, suite.tasks[k]) for k in todo]
    for key, row, files, why in cluster.run_bench_tasks(
        items, cfg, replay.find if replay else None, may_start
    ):
        if row is None:
            lost.append(key)
            if on_row:
                on_row({"key": key, "status": "lost", "wall_s": 0.0, "error": f"lost with its node: {why}"})
            continue
        if row.get("run_id"):
            folder = cfg.runs_dir / row["run_id"]
            for rel, data in files.items():
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                (folder / rel).write_bytes(data)
        land_row(out / STORE, row, retry)
        ran.append(key)
        slowest = max(slowest, row["wall_s"])
        if progress:
            progress(len(ran) + len(lost), len(todo), key)
        if on_row:
            on_row(row)
    done = set(ran)
    remaining = tuple(k for k in todo if k not in done)
    stopped = None
    if lost:
        stopped = f"{len(lost)} task(s) lost with their node ({', '.join(lost)})"
    elif remaining:
        stopped = _budget_spent(budget_s, time.monotonic() - started, slowest)
    return ran, stopped, remaining


def _budget_spent(budget_s: float | None, elapsed: float, slowest: float) -> str:
    return f"budget of {budget_s:g} s: {elapsed:.0f} s used, the slowest task took {slowest:.0f} s"


def _in_order(rows: list[dict[str, Any]], suite: Suite | None = None) -> list[dict[str, Any]]:
    """The last row per task (a row written twice, by two machines, counts once), in suite order."""
    last = {r["key"]: r for r in rows}
    if suite is None:
        return list(last.values())
    order = {k: i for i, k in enumerate(suite.tasks)}
    return sorted(last.values(), key=lambda r: order.get(r["key"], len(order)))


# -- the summary -------------------------------------------------------------------------------------------


def geomean(values: Iterable[float]) -> float | None:
    vals = list(values)
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def _speedups(rows: list[dict[str, Any]]) -> dict[str, Any]:
    timed = [r for r in rows if r.get("speedup_eager")]
    both = [r for r in timed if r.get("speedup_compile")]
    return {
        "timed": len(timed),
        "ours_over_eager": geomean(r["speedup_eager"] for r in timed),
        "compile_over_eager": geomean(r["eager_alongside_ms"] / r["compile_alongside_ms"] for r in both),
        "ours_over_compile": geomean(r["speedup_compile"] for r in both),
    }


def summary(rows: list[dict[str, Any]], suite_tasks: int | None = None) -> dict[str, Any]:
    """Coverage and geomeans over a bench's rows.

    Geomean speedups over eager (ours, torch.compile) and over torch.compile (ours), measured alongside, over
    the tasks where ours has a time: all of them, and custom (all work in our kernels) and hybrid (some left
    to libraries) apart. The fraction of the roofline floor (geomean), and energy per call where measured."""
    timed = [r for r in rows if r.get("speedup_eager")]
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[row_status(r)] = statuses.get(row_status(r), 0) + 1
    floors = [r["fraction_of_floor"] for r in timed if r.get("fraction_of_floor")]
    energy = [r for r in timed if r.get("energy_mj")]
    saved = [r["eager_energy_mj"] / r["energy_mj"] for r in energy if r.get("eager_energy_mj")]
    out: dict[str, Any] = {
        "tasks": len(rows),
        "suite_tasks": suite_tasks,
        "verified": statuses.get(TaskStatus.OK.value, 0),
        "statuses": dict(sorted(statuses.items())),
        "errors": sum(1 for r in rows if "error" in r),
        **_speedups(rows),
        "by_kind": {k: _speedups([r for r in timed if r.get("kind") == k]) for k in ("custom", "hybrid")},
        "fraction_of_floor": geomean(floors),
        "floor_tasks": len(floors),
        "energy_tasks": len(energy),
        "energy_mj": {r["key"]: r["energy_mj"] for r in energy if "key" in r},
        "energy_saving_over_eager": geomean(saved),
        "slower_than_eager": sorted(r.get("key", "?") for r in timed if r["speedup_eager"] < 1),
        # timed rows by the card they ran on (rows written before rows named it: "not recorded")
        "gpus": dict(sorted(Counter(r.get("gpu") or "not recorded" for r in timed).items())),
    }
    return out


# -- reports -----------------------------------------------------------------------------------------------


def load_rows(out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    manifest = read_manifest(out)
    return manifest, _in_order(read_store(Path(out) / STORE))


def write_reports(out: Path) -> dict[str, Path]:
    """summary.json, report.md and report.html of a bench folder, from its manifest and rows alone."""
    from pipeline import suite_report

    out = Path(out)
    manifest, rows = load_rows(out)
    s = summary(rows, manifest.get("tasks"))
    data = {"suite": manifest["suite"], "settings": manifest["settings"], "summary": s, "rows": rows}
    texts = {
        "json": json.dumps(data, indent=1, default=str) + "\n",
        "markdown": suite_report.bench_markdown(manifest, rows, s),
        "html": suite_report.bench_html(manifest, rows, s),
    }
    paths = {}
    for kind, text in texts.items():
        _write_atomic(out / REPORTS[kind], text)
        paths[kind] = out / REPORTS[kind]
    return paths
