"""Distributed evaluation on Ray, only when asked (`--ray local|auto|ADDRESS`): nothing imports this module,
or Ray, without it.

- GPU actors. One actor per GPU (Ray's `num_gpus=1`, so two actors never share one), each wrapping today's
  isolated worker: the actor starts the confined worker process on its GPU and passes it jobs; candidate
  code never runs in the actor's own process. Jobs and answers cross Ray as the same JSON the worker pipe
  carries, and files a job names (the task, a cubin) travel as bytes, content-addressed, to actors on other
  nodes.
- RayPool has WorkerPool's face (`map`, `reference`, `first`, `close`), so the stages run unchanged. It
  uses the GPUs of one model only (the most numerous, or the one asked for): a run never times candidates
  on two kinds of GPU as if they were one. One job per actor at a time.
- Faults. An actor that dies (its node lost, or killed) loses only the job it had in flight: that job comes
  back as a CRASH with the reason, the others go on to the actors left. An actor whose GPU crashes
  DRAIN_AFTER jobs running is drained (killed and not used again).
- Compile jobs run as Ray tasks on CPU nodes (`compile_remote`): each node compiles with its own nvcc and
  sends back the build record and the cubin, which the head stores in its content-addressed cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from pipeline import jobs
from pipeline.config import Config
from pipeline.reasons import first_line
from pipeline.stages import NoGPUError
from pipeline.types import Build, Status
from pipeline.worker import JobResult, Worker

DRAIN_AFTER = 3  # crashes in a row on one GPU before its actor is drained
WAIT_S = 5.0  # how often a waiting bench looks whether the cluster still has a GPU
LOCAL = "local"  # start a Ray instance on this machine (its GPUs), rather than join a cluster


class RayUnavailable(NoGPUError):
    """No cluster to join, or no GPU actor on it: the run cannot start, said in one line."""


def connect(address: str) -> None:
    """Join the cluster at `address` ("auto": the one this machine belongs to), or start one here for
    "local"; nothing when this process is connected already (tests start their own)."""
    if ray.is_initialized():
        return
    try:
        if address == LOCAL:
            ray.init(include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RayUnavailable(f"could not join the Ray cluster at {address!r}: {e}") from None


def _node() -> str:
    return ray.get_runtime_context().get_node_id()


def _gpu_model(gpu: str | None) -> str:
    """The GPU's name as nvidia-smi gives it; "cpu" for the CPU stand-in."""
    if gpu is None:
        return "cpu"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", gpu],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        name = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        name = ""
    return name or "unknown GPU"


# -- files a job names, carried to other nodes ----------------------------------------------------------------
def _job_files(job: jobs.Job) -> list[str]:
    """Files the worker will open: the task (Probe, Ncu) and a candidate's cubin."""
    paths = [getattr(job, "path", None), getattr(job, "task_path", None)]
    code = getattr(job, "candidate", None)
    if isinstance(code, jobs.CandidateCode):
        paths.append(code.cubin_path)
    return [p for p in paths if isinstance(p, str) and p]


def _localize(job: jobs.Job, where: dict[str, str]) -> jobs.Job:
    """The job with each carried file's path replaced by its copy on this node."""
    changes: dict[str, Any] = {
        f: where[v] for f in ("path", "task_path") if (v := getattr(job, f, None)) in where
    }
    code = getattr(job, "candidate", None)
    if isinstance(code, jobs.CandidateCode) and code.cubin_path in where:
        changes["candidate"] = dataclasses.replace(code, cubin_path=where[code.cubin_path])
    return dataclasses.replace(job, **changes) if changes else job


class GpuActor:
    """One GPU of the cluster: a confined worker for candidates and a trusted one for the reference's jobs
    (started on first use), both processes of their own on this actor's GPU."""

    def __init__(self, cfg: Config) -> None:
        ids = ray.get_gpu_ids()
        gpu = str(ids[0]) if ids else None  # Ray set CUDA_VISIBLE_DEVICES for this actor; the worker keeps it
        home = cfg.home if cfg.home.is_dir() else Path(tempfile.mkdtemp(prefix="kernelpro-ray-"))
        self.cfg = cfg.replace(home=home)
        self.files = Path(tempfile.mkdtemp(prefix="kernelpro-files-"))
        model = _gpu_model(gpu) if cfg.device == "cuda" else "cpu"
        self.info = {"node": _node(), "gpu": gpu, "model": model, "pid": os.getpid()}
        self.worker = Worker(self.cfg, gpu, name=f"ray-gpu{gpu}")
        self._reference: Worker | None = None
        self._lock = threading.Lock()

    def where(self) -> dict[str, Any]:
        return self.info

    def request(self, raw: bytes, files: dict[str, bytes], timeout_s: float | None, trusted: bool) -> tuple:
        job = jobs.decode(raw)
        assert isinstance(job, jobs.Job)
        job = _localize(job, {p: self._keep(p, data) for p, data in files.items()})
        if trusted:
            with self._lock:
                if self._reference is None:
                    self._reference = Worker(self.cfg, self.worker.gpu, name="ray-reference", trusted=True)
            r = self._reference.request(job, timeout_s)
        else:
            r = self.worker.request(job, timeout_s)
        answer = jobs.encode(r.answer) if r.answer is not None else None
        return r.ok, answer, r.status.value if r.status else None, r.reason, r.seconds

    def _keep(self, original: str, data: bytes) -> str:
        """The file's copy here, named by its content (a cubin sent twice is written once); a task keeps its
        file name, which its module name and key come from."""
        digest = hashlib.sha256(data).hexdigest()[:32]
        folder = self.files / digest
        target = folder / Path(original).name
        if not target.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{target.name}.{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, target)
        return str(target)

    def close(self) -> None:
        for w in (self.worker, self._reference):
            if w is not None:
                w.close()


def _result(reply: tuple) -> JobResult:
    ok, answer, status, reason, seconds = reply
    decoded = jobs.decode(answer) if answer is not None else None
    return JobResult(ok, decoded, Status(status) if status else None, reason, seconds)  # type: ignore[arg-type]


class _Proxy:
    """pool.reference (trusted jobs: the first live actor's trusted worker) and pool.first (its confined
    one), with Worker.request's signature, for the stages."""

    def __init__(self, pool: RayPool, trusted: bool) -> None:
        self.pool, self.trusted = pool, trusted

    def request(self, job: jobs.Job, timeout_s: float | None = None, cpu_s: float | None = None) -> JobResult:
        return self.pool.request(job, timeout_s, trusted=self.trusted)


class RayPool:
    """GPU actors across the cluster, with WorkerPool's interface. `gpus`: at most this many; `model`: the
    GPU model to use (default: the one the cluster has most of)."""

    def __init__(self, cfg: Config, gpus: int | None = None, model: str | None = None) -> None:
        self.cfg = cfg
        self.notes: list[str] = []  # actors left out or drained, said in the run's notes
        total = int(ray.cluster_resources().get("GPU", 0))
        if total < 1:
            raise RayUnavailable("the Ray cluster has no GPU (no node offers the GPU resource)")
        n = min(total, gpus) if gpus else total
        remote = ray.remote(num_gpus=1, num_cpus=0, max_restarts=0)(GpuActor)
        actors = [remote.remote(cfg) for _ in range(n)]
        placed = []
        for a in actors:  # an actor that cannot start is left out, with the reason kept
            try:
                placed.append((a, ray.get(a.where.remote(), timeout=300)))
            except (RayError, TimeoutError) as e:
                self.notes.append(f"a GPU actor did not start: {type(e).__name__}: {e}")
                ray.kill(a)
        models: dict[str, int] = {}
        for _, info in placed:
            models[info["model"]] = models.get(info["model"], 0) + 1
        if not models:
            raise RayUnavailable("no GPU actor started on the Ray cluster: " + "; ".join(self.notes))
        if model is not None and model not in models:
            for a, _ in placed:
                ray.kill(a)
            raise RayUnavailable(
                f"no GPU actor has a {model}; the cluster's GPUs: {', '.join(sorted(models))}"
            )
        self.model = model or max(models, key=lambda m: (models[m], m))
        keep = [(a, i) for a, i in placed if i["model"] == self.model]
        for a, i in placed:
            if i["model"] != self.model:
                ray.kill(a)
        self.actors = [a for a, _ in keep]
        self.info = [i for _, i in keep]
        self.live = [True] * len(self.actors)
        self.crashes = [0] * len(self.actors)
        self.jobs_run = [0] * len(self.actors)
        self.head = _node()
        self.trace: list[tuple[int, int, float, float]] = []  # (actor, job of its map, start, end) in seconds
        self._lock = threading.Lock()
        self.reference = _Proxy(self, trusted=True)
        self.first = _Proxy(self, trusted=False)

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def workers(self) -> list[int]:
        """The live GPUs (indices), for code that counts the pool's workers."""
        return [i for i, up in enumerate(self.live) if up]

    def close(self) -> None:
        for i, a in enumerate(self.actors):
            if self.live[i]:
                with contextlib.suppress(RayError, TimeoutError):
                    ray.get(a.close.remote(), timeout=60)
                ray.kill(a)
                self.live[i] = False

    # -- sending one job ----------------------------------------------------------------------------------
    def _send(self, i: int, job: jobs.Job, timeout_s: float | None, trusted: bool) -> ray.ObjectRef:
        files = {}
        if self.info[i]["node"] != self.head:  # another machine: the files it names travel with it
            files = {p: Path(p).read_bytes() for p in _job_files(job) if Path(p).is_file()}
        return self.actors[i].request.remote(jobs.encode(job), files, timeout_s, trusted)

    def _outcome(self, i: int, ref: ray.ObjectRef) -> JobResult:
        """The job's result; a lost actor is marked dead and its job comes back as a CRASH."""
        try:
            r = _result(ray.get(ref))
        except RayActorError as e:
            where = f"GPU actor {i} (node {self.info[i]['node'][:12]}, GPU {self.info[i]['gpu']})"
            with self._lock:
                if self.live[i]:
                    self.notes.append(f"{where} lost: {first_line(e, type(e).__name__)}")
                self.live[i] = False
            return JobResult(
                False,
                status=Status.CRASH,
                reason=f"{where} was lost mid-job: {first_line(e, type(e).__name__)}",
            )
        with self._lock:
            self.jobs_run[i] += 1
            self.crashes[i] = self.crashes[i] + 1 if r.status is Status.CRASH else 0
            if self.crashes[i] >= DRAIN_AFTER and self.live[i]:
                self.live[i] = False
                self.notes.append(f"GPU actor {i} drained: {DRAIN_AFTER} crashes in a row ({r.reason[:200]})")
                ray.kill(self.actors[i])
        return r

    def request(self, job: jobs.Job, timeout_s: float | None = None, trusted: bool = False) -> JobResult:
        """One job on the first live actor (the reference's jobs, profiles): tried on the next if it is lost."""
        for i in range(len(self.actors)):
            if self.live[i]:
                r = self._outcome(i, self._send(i, job, timeout_s, trusted))
                if self.live[i] or r.status is not Status.CRASH or "was lost" not in r.reason:
                    return r
        return JobResult(False, status=Status.CRASH, reason="no GPU actor left on the Ray cluster")

    def map(
        self,
        batch: list[jobs.Job],
        timeout_s: float | None = None,
        on_result: Callable[[int, JobResult], None] | None = None,
    ) -> list[JobResult]:
        """Every job, in order, one at a time per live actor; a job whose actor is lost is not retried."""
        results: list[JobResult | None] = [None] * len(batch)
        todo = list(range(len(batch)))
        running: dict[ray.ObjectRef, tuple[int, int]] = {}  # ref -> (actor, job)

        def fill() -> None:
            busy = {a for a, _ in running.values()}
            for i in range(len(self.actors)):
                if todo and self.live[i] and i not in busy:
                    j = todo.pop(0)
                    started[j] = time.monotonic()
                    running[self._send(i, batch[j], timeout_s, False)] = (i, j)

        started: dict[int, float] = {}

        fill()
        while running:
            ready, _ = ray.wait(list(running), num_returns=1)
            i, j = running.pop(ready[0])
            results[j] = self._outcome(i, ready[0])
            self.trace.append((i, j, started.pop(j), time.monotonic()))
            if on_result is not None:
                on_result(j, results[j])  # type: ignore[arg-type]
            fill()
        for j in todo:  # every actor lost or drained
            results[j] = JobResult(False, status=Status.CRASH, reason="no GPU actor left on the Ray cluster")
            if on_result is not None:
                on_result(j, results[j])  # type: ignore[arg-type]
        return [r for r in results if r is not None]


# -- compile jobs as Ray tasks --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Compiled:
    """A compile done on some node: the build (no cubin path), the cubin, and whether the cache may keep it
    (not a timeout on a loaded node, a lost task or a toolkit that differs from the head's)."""

    key: str
    build: Build
    cubin: bytes | None
    cacheable: bool
    node: str = ""


def _compile_task(candidate: Any, key: str, cfg: Config, toolkit: str) -> Compiled:
    """On a CPU node: compile with this node's nvcc into a scratch cache (_compile_one, as on the head)."""
    from pipeline import compile as comp

    nvcc = comp.find_nvcc(cfg)
    arch = comp.resolve_arch(cfg)
    here = comp.toolkit_version(nvcc)
    if here != toolkit:  # the cache key names the head's toolkit: another one would store a lie
        why = f"this node's nvcc is {here}, the head's {toolkit}: not compiled here"
        return Compiled(
            key, Build(candidate.key, Status.COMPILE_ERROR, None, log=why, arch=arch), None, False
        )
    includes, _ = comp._cutlass()
    with tempfile.TemporaryDirectory(prefix="kernelpro-nvcc-") as scratch:
        build = comp._compile_one(candidate, key, cfg, nvcc, arch, includes, Path(scratch))
        cubin = Path(build.cubin_path).read_bytes() if build.cubin_path else None
        stored = (Path(scratch) / f"{key}.json").is_file()  # what _compile_one would have cached
    return Compiled(key, dataclasses.replace(build, cubin_path=None), cubin, stored, _node())


def compile_remote(todo: Sequence[tuple[str, Any]], cfg: Config, toolkit: str) -> Iterator[Compiled]:
    """Each (key, candidate) compiled by a Ray task of its own (one CPU apiece, so the cluster's CPU nodes
    share the nvcc work), yielded as they finish; a task lost past its retries is a compile error."""
    connect(cfg.ray)
    remote = ray.remote(num_cpus=1, max_retries=2)(_compile_task)
    refs = {remote.remote(c, key, cfg, toolkit): key for key, c in todo}
    while refs:
        ready, _ = ray.wait(list(refs), num_returns=1)
        key = refs.pop(ready[0])
        try:
            yield ray.get(ready[0])
        except RayError as e:
            why = f"the compile task was lost: {first_line(e, type(e).__name__)}"
            yield Compiled(key, Build("", Status.COMPILE_ERROR, None, log=why), None, False)


# -- bench tasks across the cluster -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TaskShipment:
    """What a node needs to run one bench task: the task file's text, its folder's name (the task's key is
    folder/name), and the recorded runs that answer it in replay mode."""

    key: str
    name: str
    folder: str
    source: str
    head_path: str
    recordings: dict[str, bytes]  # file name -> a recorded log.jsonl (replay), else empty


def _run_bench_task(ship: TaskShipment, cfg: Config, replay: bool) -> tuple[dict[str, Any], dict[str, bytes]]:
    """On a GPU node: the task's run through bench.run_task in scratch folders, then its row and its run
    folder's files (relative path -> bytes) for the head to keep."""
    from pipeline import bench

    with tempfile.TemporaryDirectory(prefix="kernelpro-task-") as scratch:
        root = Path(scratch)
        path = root / "suite" / ship.folder / f"{ship.name}.py"
        path.parent.mkdir(parents=True)
        path.write_text(ship.source)
        index = None
        if replay:
            logs = []
            for i, (name, data) in enumerate(sorted(ship.recordings.items())):
                log = root / "recorded" / f"{i}-{name}" / "log.jsonl"
                log.parent.mkdir(parents=True)
                log.write_bytes(data)
                logs.append(log)
            index = bench.ReplayIndex(
                root / "recorded", {bench.source_hash(path): tuple(logs)} if logs else {}
            )
        home = cfg.home if cfg.home.is_dir() else root / "home"
        node_cfg = cfg.replace(ray="", runs_dir=root / "runs", home=home)  # the node's run is local
        row = bench.run_task(ship.key, path, node_cfg, replay=index)
        row.update(path=ship.head_path, node=_node())
        files = {}
        if row.get("run_id"):
            folder = root / "runs" / row["run_id"]
            files = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    return row, files


def run_bench_tasks(
    items: Sequence[tuple[str, Path]],
    cfg: Config,
    recordings: Callable[[Path], Sequence[Path]] | None,
    may_start: Callable[[], bool],
) -> Iterator[tuple[str, dict[str, Any] | None, dict[str, bytes], str]]:
    """Bench tasks as Ray tasks of one GPU each, as many at once as the cluster has GPUs, yielded as they
    end: (key, row, run files, why it was lost). A task whose node is lost is retried once elsewhere, then
    given up (row None): its key has no row, so `--resume` runs it again. `may_start` is asked before each
    task starts (the bench's time budget)."""
    slots = max(1, int(ray.cluster_resources().get("GPU", 0)))
    remote = ray.remote(num_gpus=1, max_retries=1)(_run_bench_task)
    todo = list(items)
    running: dict[ray.ObjectRef, str] = {}

    def submit() -> None:
        while todo and len(running) < slots and may_start():
            key, path = todo.pop(0)
            recorded = list(recordings(path)) if recordings is not None else []
            ship = TaskShipment(
                key, path.stem, path.parent.name, path.read_text(), str(path),
                {f"{i}.{Path(p).parent.name}": Path(p).read_bytes() for i, p in enumerate(recorded)},
            )  # fmt: skip
            running[remote.remote(ship, cfg, recordings is not None)] = key

    submit()
    while running:
        ready, _ = ray.wait(list(running), num_returns=1, timeout=WAIT_S)
        if not ready:
            if ray.cluster_resources().get("GPU", 0) < 1:  # no node left to run them: they would wait forever
                for ref, key in running.items():
                    ray.cancel(ref, force=True)
                    yield key, None, {}, "no GPU left on the Ray cluster"
                running.clear()
                todo.clear()
            continue
        key = running.pop(ready[0])
        try:
            row, files = ray.get(ready[0])
            yield key, row, files, ""
        except RayError as e:
            yield key, None, {}, first_line(e, type(e).__name__)
        submit()
