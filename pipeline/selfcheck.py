"""The harness's self-consistency check: each task's own reference, submitted as a candidate, must pass.

`reference_candidate(task)` turns a task file into a hybrid candidate: the reference class renamed
`ModelNew`, its forward kept as `reference_forward`, and a new forward that passes every output tensor
through our byte-copy kernel (`kp_selfcheck_copy`, the same kernel.cu for every task). `run_suite` runs
those candidates through the real pipeline (`stages.evaluate_candidates`, one shared worker pool), one task
at a time, appending one JSON line per task to a store, so a sweep resumes where it stopped. A task whose
candidate fails is checked again with only the eager reference (`stages.run_baselines`): the pass rate counts
the tasks where eager itself runs on this machine.

The launcher is rewritten on the syntax tree and printed with `ast.unparse`: renaming `Model` there cannot
touch strings, comments or longer names (`ModelNew`, `BaseModel`), which a text rewrite could; the price is
that the task's comments are lost, which nobody reads in a generated candidate.
"""

from __future__ import annotations

import ast
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import jobs, reasons, stages
from pipeline.candidates import make_candidate
from pipeline.config import Config
from pipeline.jobs import Job
from pipeline.types import Candidate, Status, to_dict

KERNEL_NAME = "kp_selfcheck_copy"
REFERENCE_FORWARD = "reference_forward"
DROPPED_FUNCTIONS = frozenset({"get_inputs", "get_init_inputs", "get_alt_inputs"})
HELPER_NAMES = frozenset(
    {KERNEL_NAME, "kp_selfcheck_outputs", "KP_SELFCHECK_THREADS", "KP_SELFCHECK_MAX_BLOCKS"}
)

KERNEL_SOURCE = r"""// kernelpro self-check: a byte copy, the same for every task (pipeline/selfcheck.py).
// 16-byte vectors for the bulk when both pointers allow it, then single bytes for the tail; grid-stride,
// so any grid covers any size. Works for every dtype since it never looks at the values.
#include <cstdint>

extern "C" __global__ void kp_selfcheck_copy(const unsigned char* __restrict__ src,
                                             unsigned char* __restrict__ dst, long long nbytes) {
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long head = 0;  // bytes copied by the vector loop
    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
        const long long vectors = nbytes / 16;
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (long long i = start; i < vectors; i += stride) d[i] = s[i];
        head = vectors * 16;
    }
    for (long long i = head + start; i < nbytes; i += stride) dst[i] = src[i];
}
"""

# Appended to every launcher as text (ast.unparse would drop these comments). The grid is sized for the
# vector loop; a misaligned source (a view at an odd offset) falls back to the byte loop on the same grid.
LAUNCHER_HELPERS = '''

# ---- kernelpro self-check: every output tensor is copied by our kernel ----
KP_SELFCHECK_THREADS = 256
KP_SELFCHECK_MAX_BLOCKS = 4096


def kp_selfcheck_copy(out):
    """A fresh contiguous copy of one output tensor, written by kp_selfcheck_copy (any dtype, 0-d too)."""
    src = out.contiguous()
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    if nbytes == 0:
        return dst  # nothing to copy, and a launch of zero work would be a fake launch
    vectors = max(1, nbytes // 16)
    blocks = min((vectors + KP_SELFCHECK_THREADS - 1) // KP_SELFCHECK_THREADS, KP_SELFCHECK_MAX_BLOCKS)
    kernels.kp_selfcheck_copy(blocks, KP_SELFCHECK_THREADS, (src, dst, numpy.int64(nbytes)), shared_mem=0)
    return dst


def kp_selfcheck_outputs(value):
    """Every tensor of a forward's result copied, through tuples and lists; other values unchanged."""
    if isinstance(value, torch.Tensor):
        return kp_selfcheck_copy(value)
    if isinstance(value, tuple):
        return tuple(kp_selfcheck_outputs(v) for v in value)
    if isinstance(value, list):
        return [kp_selfcheck_outputs(v) for v in value]
    return value
'''

_NEW_FORWARD = f"""
def forward(self, *args, **kwargs):
    return kp_selfcheck_outputs(self.{REFERENCE_FORWARD}(*args, **kwargs))
"""


class SelfcheckError(Exception):
    """A task whose reference cannot be turned into a candidate; one line naming the task and the reason."""


# --------------------------------------------------------------------------------- the reference candidate


def reference_launcher(source: str, task_name: str = "task") -> str:
    """The launcher of the reference candidate of a task's source; SelfcheckError when it cannot be built."""

    def fail(why: str) -> SelfcheckError:
        return SelfcheckError(f"{task_name}: cannot build the reference candidate: {why}")

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as e:
        raise fail(f"the task does not parse ({getattr(e, 'msg', e)})") from None
    models = [s for s in tree.body if isinstance(s, ast.ClassDef) and s.name == "Model"]
    if len(models) != 1:
        raise fail(f"{len(models)} top-level classes named Model, want one")
    model = models[0]
    forwards = [s for s in model.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)]
    forwards = [s for s in forwards if s.name == "forward"]
    if len(forwards) != 1 or not isinstance(forwards[0], ast.FunctionDef):
        raise fail("Model has no (single, plain) `def forward` of its own")
    taken = _bound_names(tree) & (HELPER_NAMES | {"ModelNew", REFERENCE_FORWARD})
    if taken:
        raise fail(f"the task already uses the name(s) {sorted(taken)}")

    body = _kept_statements(tree.body, fail)
    forward = forwards[0]
    forward.name = REFERENCE_FORWARD
    new_forward = ast.parse(_NEW_FORWARD).body[0]
    model.body.insert(model.body.index(forward) + 1, new_forward)
    tree.body = _with_imports(body)
    tree = _RenameModel().visit(tree)
    ast.fix_missing_locations(tree)
    text = ast.unparse(tree) + "\n" + LAUNCHER_HELPERS
    header = (
        f"# kernelpro self-check candidate: the reference of {task_name}, its outputs copied by our kernel\n"
    )
    launcher = header + text
    try:
        ast.parse(launcher)
    except SyntaxError as e:  # ast.unparse of a tree it parsed itself: a bug here, not in the task
        raise fail(f"the rewritten launcher does not parse ({e.msg}, line {e.lineno})") from None
    return launcher


def reference_candidate(task_path: str | Path) -> Candidate:
    """The task's own reference as a hybrid candidate (see the module docstring)."""
    path = Path(task_path)
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SelfcheckError(f"{path.name}: cannot build the reference candidate: {e}") from None
    launcher = reference_launcher(source, path.name)
    return make_candidate(path.stem, KERNEL_SOURCE, launcher, edit="selfcheck: the reference as a candidate")


class _RenameModel(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id == "Model":
            node.id = "ModelNew"
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        if node.name == "Model":
            node.name = "ModelNew"
        self.generic_visit(node)
        return node


def _bound_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def _is_main_guard(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.If)
        and isinstance(stmt.test, ast.Compare)
        and isinstance(stmt.test.left, ast.Name)
        and stmt.test.left.id == "__name__"
    )


def _kept_statements(body: list[ast.stmt], fail: Callable[[str], SelfcheckError]) -> list[ast.stmt]:
    """Module-level statements minus the input factories, the functions only they use, `__main__` blocks.

    Every statement that is not a function definition is kept (constants, imports, classes); a function is
    kept when kept code names it, followed transitively, so helpers of the model stay and helpers of
    get_inputs go."""
    candidates = [s for s in body if not _is_main_guard(s)]
    functions = {s.name: s for s in candidates if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)}
    roots = [s for s in candidates if not isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)]
    kept: set[str] = set()
    todo = [_names_in(s) for s in roots]
    while todo:
        for name in todo.pop():
            if name in DROPPED_FUNCTIONS:
                raise fail(f"the model's code uses {name}(), which a launcher may not name")
            if name in functions and name not in kept:
                kept.add(name)
                todo.append(_names_in(functions[name]))
    return [
        s for s in candidates if not isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef) or s.name in kept
    ]


def _names_in(stmt: ast.stmt) -> set[str]:
    return {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}


def _with_imports(body: list[ast.stmt]) -> list[ast.stmt]:
    """`import numpy` and `import torch` after the docstring and __future__ imports: the helpers use them."""
    at = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        at = 1
    while at < len(body) and isinstance(body[at], ast.ImportFrom) and body[at].module == "__future__":
        at += 1
    have = {a.name for s in body if isinstance(s, ast.Import) for a in s.names if a.asname in (None, a.name)}
    imports = [ast.Import(names=[ast.alias(name=m)]) for m in ("numpy", "torch") if m not in have]
    return body[:at] + imports + body[at:]


# -------------------------------------------------------------------------------------------- the sweep

Progress = Callable[[int, int, str], None]  # (done, total, task id)
CAUSES = (
    "transform",  # the reference candidate could not be built
    "task_error",  # the task cannot be probed or the harness raised around it
    "eager_fails",  # the eager reference itself does not run here: excluded from the pass rate
    "static_check",  # the static check rejected the reference
    "compile",  # our copy kernel did not compile
    "out_of_memory",
    "timeout",
    "crash",
    "launch_error",
    "tolerance",  # the reference disagrees with its float64 run beyond the task's tolerances
    "output_format",  # shape, dtype or device of the outputs differ: a bug of the transform
    "runtime_check",  # a runtime anti-cheat check (kernels_no_work, hidden_work, ...) rejected it
    "too_fast",  # SUSPICIOUS
)
_FORMAT_CODES = frozenset({"shape_mismatch", "dtype_mismatch", "device_mismatch"})


def sweep_config(cfg: Config) -> Config:
    """Fast settings for a sweep whose point is correctness: verification keeps the full protocol (three
    trials), timing is short, eager is the only baseline and energy is off."""
    return cfg.replace(
        trials=3, timing_budget_s=0.2, timing_trials=10, warmup=2, baselines=("eager",), energy=False
    )


def task_files(paths: Iterable[str | Path], levels: Sequence[str] | None = None) -> list[Path]:
    """Task files under folders (recursively) or given directly, sorted by level then problem number."""
    found: list[Path] = []
    for p in map(Path, paths):
        found += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    if levels:
        found = [f for f in found if f.parent.name in levels]
    return sorted(dict.fromkeys(found), key=_order)


def _order(path: Path) -> tuple[str, int, str]:
    number = path.stem.split("_", 1)[0]
    return (path.parent.name, int(number) if number.isdigit() else 1 << 30, path.stem)


def task_key(path: str | Path) -> str:
    """The store's key of a task: its folder (the level) and its file name, e.g. "level1/19_ReLU"."""
    path = Path(path)
    return f"{path.parent.name}/{path.stem}"


def read_store(store_path: str | Path) -> list[dict[str, Any]]:
    """The rows of a store; a line that does not parse (cut short by a kill) is ignored."""
    rows = []
    path = Path(store_path)
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "key" in row:
            rows.append(row)
    return rows


class _Store:
    """Append-only JSON lines; each row on disk (flush + fsync) before the next task starts."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_partial_tail()
        self._file = path.open("a")

    def _drop_partial_tail(self) -> None:
        # A kill mid-write leaves a line without its newline; the next row must not be glued onto it.
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with self.path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row, default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class SuiteResult:
    store: Path
    rows: tuple[dict[str, Any], ...]  # the store's rows for the tasks asked for, done now or before
    ran: tuple[str, ...]  # task keys evaluated in this call
    skipped: tuple[str, ...]  # already in the store
    remaining: tuple[str, ...]  # left for a later call (budget)
    stopped: str | None = None  # why the sweep stopped early

    def summary(self) -> dict[str, Any]:
        return summarize(self.rows)


class _Deadline:
    """The shared pool as the loop sees it, with each job's wall time capped by the sweep's deadline.

    A job cut short by the cap (rather than by its own limit) is remembered, so its row is not written:
    the task was in flight, not timed out, and a resumed sweep runs it again."""

    def __init__(self, pool: Any, deadline: float | None, cfg: Config):
        self.pool, self.deadline, self.cfg = pool, deadline, cfg
        self.cut = False

    def cap(self, timeout_s: float | None) -> tuple[float, bool]:
        wanted = timeout_s or self.cfg.job_timeout_s
        if self.deadline is None:
            return wanted, False
        left = max(1.0, self.deadline - time.monotonic())
        return (left, True) if left < wanted else (wanted, False)

    def note(self, result: Any, capped: bool) -> Any:
        if capped and result.status == Status.TIMEOUT:
            self.cut = True
        return result

    def __getattr__(self, name: str) -> Any:
        # Whichever worker the loop asks the pool for (`first`, `reference`, ...) comes back capped.
        value = getattr(self.pool, name)
        return _CappedWorker(value, self) if callable(getattr(value, "request", None)) else value

    def map(self, batch: list[Job], timeout_s: float | None = None, on_result: Any = None) -> list:
        limit, capped = self.cap(timeout_s)
        return [self.note(r, capped) for r in self.pool.map(batch, limit, on_result)]

    def close(self) -> None:  # the sweep owns the real pool
        pass


class _CappedWorker:
    def __init__(self, worker: Any, owner: _Deadline):
        self.worker, self.owner = worker, owner

    def request(self, job: Job, timeout_s: float | None = None, cpu_s: float | None = None) -> Any:
        limit, capped = self.owner.cap(timeout_s)
        return self.owner.note(self.worker.request(job, limit, cpu_s), capped)


def run_suite(
    task_paths: Sequence[str | Path],
    cfg: Config,
    store_path: str | Path,
    *,
    progress: Progress | None = None,
    budget_s: float | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    reserve_s: float = 15.0,
) -> SuiteResult:
    """Each task's reference candidate through the pipeline, one task at a time, one row each in the store.

    Tasks already in the store are skipped. With `budget_s`, no task starts with less than `reserve_s`
    left, and a task still running when the budget ends is stopped and left out of the store."""
    started = time.monotonic()
    deadline = started + budget_s if budget_s is not None else None
    store_path = Path(store_path)
    paths = [Path(p) for p in task_paths]
    done_before = {r["key"] for r in read_store(store_path)}
    todo = [p for p in paths if task_key(p) not in done_before]
    skipped = tuple(task_key(p) for p in paths if task_key(p) in done_before)
    ran: list[str] = []
    stopped = None
    if todo and deadline is not None and budget_s is not None and budget_s < reserve_s:
        stopped = f"budget of {budget_s:g} s is under the {reserve_s:g} s a task is given at least"
    elif todo:
        pool = stages.open_pool(cfg)
        store = _Store(store_path)
        try:
            env = _environment(pool, cfg)
            for path in todo:
                if deadline is not None and deadline - time.monotonic() < reserve_s:
                    stopped = f"budget of {budget_s:g} s spent"
                    break
                capped = _Deadline(pool, deadline, cfg)
                row = _run_one(path, cfg, capped, env)
                if capped.cut:
                    stopped = (
                        f"budget of {budget_s:g} s ran out during {task_key(path)}; it is left for later"
                    )
                    break
                store.append(row)
                ran.append(row["key"])
                if on_row:
                    on_row(row)
                if progress:
                    progress(len(ran), len(todo), row["task"])
        finally:
            pool.close()
            store.close()
    remaining = tuple(task_key(p) for p in todo[len(ran) :])
    wanted = {task_key(p) for p in paths}
    rows = {r["key"]: r for r in read_store(store_path) if r["key"] in wanted}
    ordered = tuple(rows[task_key(p)] for p in paths if task_key(p) in rows)
    return SuiteResult(store_path, ordered, tuple(ran), skipped, remaining, stopped)


def _environment(pool: Any, cfg: Config) -> dict[str, str]:
    """The worker's environment, for rows whose candidate never reached timing (which records its own)."""
    r = pool.reference.request(jobs.Environment(cfg.device), timeout_s=120)
    return dict(r.answer.environment) if isinstance(r.answer, jobs.EnvironmentAnswer) else {}


def _run_one(path: Path, cfg: Config, pool: _Deadline, env: dict[str, str]) -> dict[str, Any]:
    t0 = time.monotonic()
    row: dict[str, Any] = {
        "key": task_key(path),
        "task": path.stem,
        "level": path.parent.name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    status, kind, why, result = "error", None, [], None
    try:
        cand = reference_candidate(path)
    except SelfcheckError as e:
        status, why = "unbuildable", [f"transform: {e}"]
    else:
        row["candidate_key"] = cand.key
        try:
            [result] = stages.evaluate_candidates(path, [cand], cfg, pool=pool)  # type: ignore[arg-type]
        except Exception as e:  # a task the harness cannot take is a row, not the end of the sweep
            why = [f"task_error: {type(e).__name__}: {reasons.first_line(e)}"]
        else:
            v = result.verdict
            status, why = v.status.value, list(v.reasons)
            kind = v.kind.value if v.kind else None
            # Every figure the verdict carries (errors, trials, ...), whatever fields it grows.
            row.update({k: x for k, x in to_dict(v).items() if isinstance(x, int | float) or x is None})
            row.pop("kind", None)
            row["library_ops"] = list(v.library_ops[:8])
    m = result.measurement if result else None
    eager = m.baselines.get("eager") if m else None
    row.update(
        status=status,
        kind=kind,
        reasons=why[:12],
        median_ms=m.timing.median_ms if m and m.timing else None,
        timing_trials=m.timing.trials if m and m.timing else None,
        eager_ms=eager.median_ms if eager else None,
        floor_ms=m.floor_ms if m else None,
    )
    environment = dict(m.environment) if m and m.environment else env
    row["gpu"] = environment.get("gpu")
    row["environment"] = {k: environment[k] for k in _ENV_KEYS if k in environment}
    if status == Status.OK.value:
        row["eager_runs"], row["eager_error"] = True, None
    else:
        row["eager_runs"], row["eager_error"] = _eager_runs(path, cfg, pool)
    row["code"] = _code(why)
    row["cause"] = cause_of(status, why, row["eager_runs"])
    row["seconds"] = round(time.monotonic() - t0, 3)
    return row


_ENV_KEYS = ("gpu", "capability", "sm_count", "driver", "cuda_runtime", "torch", "cupy", "python")


def _eager_runs(path: Path, cfg: Config, pool: _Deadline) -> tuple[bool | None, str | None]:
    """Whether the task's eager reference runs here at all (a baseline job with eager only).

    The baseline job starts with the harness's probe (on the meta device). A task that does not even import
    is broken here, so eager does not run; any other probe failure is the harness's, and eager is unknown:
    such a task stays in the pass rate's denominator."""
    from pipeline.tasks import TaskError

    if cfg.device != "cuda":
        return None, "not checked: the baseline job needs a CUDA device"
    try:
        stages.run_baselines(path, cfg.replace(baselines=("eager",), energy=False), pool=pool)  # type: ignore[arg-type]
    except TaskError as e:
        text = reasons.first_line(e)
        if any(m in text for m in _BROKEN_TASK):
            return False, f"TaskError: {text}"
        return None, f"not checked: the harness cannot probe the task: {text}"
    except Exception as e:
        return False, f"{type(e).__name__}: {reasons.first_line(e)}"
    return True, None


# pipeline/tasks.py's messages for a task file that cannot be loaded at all (as opposed to probed)
_BROKEN_TASK = ("importing the task raised", "syntax error at line", "task file not found", "missing `")


def _code(why: Sequence[str]) -> str | None:
    """The code of the first reason that is not a note: "mismatch", "static:try_except", ..."""
    return next((reasons.code_of(r) for r in why if not reasons.is_note(r)), None)


def cause_of(status: str, why: Sequence[str], eager_runs: bool | None) -> str | None:
    """The category of a failure (one of CAUSES); None for OK."""
    if status == Status.OK.value:
        return None
    if status == "unbuildable":
        return "transform"
    if eager_runs is False:
        return "eager_fails"
    code = _code(why) or ""
    if status == "error":
        return "task_error"
    if code.startswith("static:"):
        return "static_check"
    if any(reasons.code_of(r) == reasons.OUT_OF_MEMORY for r in why):
        return "out_of_memory"
    by_status = {
        Status.COMPILE_ERROR.value: "compile",
        Status.COMPILE_TIMEOUT.value: "compile",
        Status.TIMEOUT.value: "timeout",
        Status.CRASH.value: "crash",
        Status.LAUNCH_ERROR.value: "launch_error",
        Status.SUSPICIOUS.value: "too_fast",
        Status.REJECTED.value: "runtime_check",
    }
    if status == Status.MISMATCH.value:
        return "output_format" if code in _FORMAT_CODES else "tolerance"
    return by_status.get(status, "task_error")


# ------------------------------------------------------------------------------------------ the summary


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pass rate over the tasks where eager runs, by level; failures; seconds per task; the machine."""
    levels = sorted({r["level"] for r in rows})
    by_level = {level: _rate([r for r in rows if r["level"] == level]) for level in levels}
    failures = [
        {
            "key": r["key"],
            "status": r["status"],
            "cause": r.get("cause"),
            "code": r.get("code"),
            "eager_runs": r.get("eager_runs"),
            "reasons": [x for x in r.get("reasons", []) if not reasons.is_note(x)][:2],
        }
        for r in rows
        if r["status"] != Status.OK.value
    ]
    causes: dict[str, int] = {}
    for f in failures:
        causes[f["cause"] or "unknown"] = causes.get(f["cause"] or "unknown", 0) + 1
    seconds = [float(r.get("seconds") or 0.0) for r in rows]
    envs = [r["environment"] for r in rows if r.get("environment")]
    return {
        **_rate(list(rows)),
        "by_level": by_level,
        "causes": dict(sorted(causes.items(), key=lambda kv: -kv[1])),
        "failures": failures,
        "seconds": {
            "median": statistics.median(seconds) if seconds else 0.0,
            "max": max(seconds, default=0.0),
            "total": sum(seconds),
        },
        "environment": envs[-1] if envs else {},
        "dates": [min(r["date"] for r in rows), max(r["date"] for r in rows)] if rows else [],
    }


def _rate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    eager = [r for r in rows if r.get("eager_runs") is not False]
    ok = sum(r["status"] == Status.OK.value for r in rows)
    return {
        "tasks": len(rows),
        "ok": ok,
        "eager_runs": len(eager),
        "eager_fails": len(rows) - len(eager),
        "pass_rate": ok / len(eager) if eager else None,
    }


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    s = summarize(rows)
    env = s["environment"]
    lines = [
        "# Self-consistency sweep: each task's reference submitted as a candidate",
        "",
        f"Tasks: {s['tasks']}; dates {' to '.join(dict.fromkeys(s['dates'])) or '-'}.",
        "Machine: " + (", ".join(f"{k} {v}" for k, v in env.items()) or "unknown") + ".",
        "",
        "Pass rate = OK over the tasks where the eager reference runs on this machine.",
        "",
        "| level | tasks | eager runs | OK | pass rate |",
        "|---|---|---|---|---|",
    ]
    for level, r in [*s["by_level"].items(), ("all", s)]:
        lines.append(f"| {level} | {r['tasks']} | {r['eager_runs']} | {r['ok']} | {_pct(r['pass_rate'])} |")
    sec = s["seconds"]
    lines += [
        "",
        f"Seconds per task: median {sec['median']:.1f}, max {sec['max']:.1f}, total {sec['total']:.0f}.",
        "",
    ]
    if s["causes"]:
        lines += ["Failures by cause: " + ", ".join(f"{k} {v}" for k, v in s["causes"].items()) + ".", ""]
    if s["failures"]:
        lines += ["| task | status | cause | eager runs | first reasons |", "|---|---|---|---|---|"]
        for f in s["failures"]:
            why = "; ".join(f["reasons"]) or "-"
            eager = {True: "yes", False: "no", None: "?"}[f["eager_runs"]]
            lines.append(f"| {f['key']} | {f['status']} | {f['cause']} | {eager} | {_cell(why)} |")
    else:
        lines.append("No failures.")
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _cell(text: str, limit: int = 220) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"
