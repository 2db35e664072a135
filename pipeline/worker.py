"""The isolated worker: the only place candidate code runs.

The orchestrator starts one worker process per GPU (a fresh interpreter, never a fork of itself), through
pipeline/sandbox.py: an environment stripped of secrets, a scratch directory, and OS confinement (namespaces
and rlimits first thing, Landlock and seccomp once torch and CUDA are up, before any candidate code). It
watches each job: a job that outlives its wall-time or CPU-time budget, or a worker whose resident memory
passes the limit, is killed with its whole process group and restarted for the next job. Jobs and answers
travel as length-prefixed JSON over a private pipe pair (never pickle: the worker is untrusted, and its
stdout is the candidate's to scribble on).

Trusted work that must start programs (torch.compile's baselines run ptxas and process pools) goes to the
pool's reference worker: same secret-free environment, not confined, never handed candidate code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline import jobs, sandbox
from pipeline.config import Config
from pipeline.jobs import Answer, Job
from pipeline.types import Status

_HEADER = struct.Struct("<Q")
_MAX_FRAME = 256 * 2**20
_POLL_S = 0.05


@dataclass(frozen=True)
class JobResult:
    """What came back for one job: the handler's answer, or why the worker failed to give one."""

    ok: bool
    answer: Answer | None = None  # jobs.Failed when the handler could not do the job
    status: Status | None = None  # CRASH or TIMEOUT when the worker died or was killed
    reason: str = ""
    seconds: float = 0.0


class Worker:
    """One worker process, restarted on demand after a crash or a kill. Confined (cfg.sandbox) unless
    `trusted`: a trusted worker never receives candidate code."""

    def __init__(self, cfg: Config, gpu: str | None = None, name: str = "worker0", trusted: bool = False):
        self.cfg = cfg
        self.gpu = gpu  # an entry for CUDA_VISIBLE_DEVICES, or None to inherit
        self.name = name
        self.trusted = trusted
        self.proc: subprocess.Popen | None = None
        self.restarts = -1
        self.recycles = 0  # restarts because the module cap was reached
        self.sandbox: sandbox.Report | None = None  # what the child applied, from its first answer
        self._to_child: int | None = None
        self._from_child: int | None = None
        self.scratch: Path | None = None
        self._extra_read: list[str] = []  # files jobs named outside the default grants (a cubin elsewhere)
        self._lock = threading.Lock()

    @property
    def confined(self) -> bool:
        return self.cfg.sandbox and not self.trusted

    # -- lifecycle ---------------------------------------------------------------------------------------
    def _start(self) -> None:
        scratch_root = self.cfg.home / "scratch"
        scratch_root.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=scratch_root)).resolve()
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        plan = sandbox.worker_plan(self.cfg, self.scratch, self._extra_read) if self.confined else None
        env = {"PYTHONUNBUFFERED": "1"}
        if plan is None:  # a confined worker keeps every cache in its scratch folder (sandbox.child_environ)
            env["TORCHINDUCTOR_CACHE_DIR"] = str((self.cfg.cache_dir / "inductor").resolve())
            env["TRITON_CACHE_DIR"] = str((self.cfg.cache_dir / "triton").resolve())
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        argv = [sys.executable, "-m", "pipeline.worker", str(req_r), str(resp_w), self.cfg.device]
        log = open(self.scratch / "worker.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = sandbox.spawn(
                [*argv, plan.to_json()] if plan else argv,
                cwd=self.scratch,
                scratch=self.scratch if plan else None,
                env=env,
                stdout=log,
                pass_fds=(req_r, resp_w),
            )
        finally:
            log.close()
            os.close(req_r)
            os.close(resp_w)
        self._to_child, self._from_child = req_w, resp_r
        self.restarts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._to_child = self._from_child = None
        self.proc = None

    def close(self) -> None:
        """Ask the worker to exit (EOF on its pipe), then make sure it did."""
        if self.proc is not None and self._to_child is not None:
            with contextlib.suppress(OSError):
                os.close(self._to_child)
            self._to_child = None
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        self.kill()

    def log_tail(self, lines: int = 20) -> str:
        if self.scratch is None or not (self.scratch / "worker.log").exists():
            return ""
        text = (self.scratch / "worker.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    # -- one job -----------------------------------------------------------------------------------------
    def request(self, job: Job, timeout_s: float | None = None, cpu_s: float | None = None) -> JobResult:
        if self.trusted and type(job) not in jobs.TRUSTED:
            return JobResult(
                False, reason=f"refused: the unconfined {self.name} worker runs no {job.KIND!r} job"
            )
        with self._lock:
            return self._request(job, timeout_s or self.cfg.job_timeout_s, cpu_s or self.cfg.job_cpu_s)

    def _grant(self, job: Job) -> None:
        """A confined worker reads only what it was started with: a job naming a file outside that (a cubin
        outside the kernelpro home, in a user's home) restarts it with a read grant for that one file."""
        if not self.confined:
            return
        plan = sandbox.worker_plan(self.cfg, self.scratch or self.cfg.home / "scratch", self._extra_read)
        missing = [p for p in sandbox.job_paths(job) if plan is not None and not plan.readable(p)]
        if missing:
            self._extra_read += missing
            self.kill()

    def _request(self, job: Job, timeout_s: float, cpu_s: float) -> JobResult:
        self._grant(job)
        if not self.alive():
            self.kill()
            self._start()
        assert self.proc is not None and self._to_child is not None and self._from_child is not None
        t0 = time.monotonic()
        cpu0 = _cpu_seconds(self.proc.pid)
        try:
            _write_frame(self._to_child, jobs.encode(job))
        except (BrokenPipeError, OSError):
            return self._died(t0, "before it took the job")
        buf = bytearray()
        need: int | None = None
        while True:
            ready, _, _ = select.select([self._from_child], [], [], _POLL_S)
            if ready:
                chunk = os.read(self._from_child, 1 << 20)
                if not chunk:
                    return self._died(t0, "while running the job")
                buf += chunk
                if need is None and len(buf) >= _HEADER.size:
                    (need,) = _HEADER.unpack_from(buf)
                    if need > _MAX_FRAME:
                        self.kill()
                        return JobResult(False, status=Status.CRASH, reason="worker sent an oversized answer")
                if need is not None and len(buf) >= _HEADER.size + need:
                    return self._answer(bytes(buf[_HEADER.size : _HEADER.size + need]), t0)
                continue
            elapsed = time.monotonic() - t0
            if self.proc.poll() is not None:
                return self._died(t0, "while running the job")
            if elapsed > timeout_s:
                self.kill()
                return JobResult(
                    False,
                    status=Status.TIMEOUT,
                    reason=f"no answer within {timeout_s:.0f} s; worker killed",
                    seconds=elapsed,
                )
            cpu = _cpu_seconds(self.proc.pid) - cpu0
            if cpu > cpu_s:
                self.kill()
                return JobResult(
                    False,
                    status=Status.TIMEOUT,
                    reason=f"used {cpu:.0f} s of CPU time (limit {cpu_s:.0f} s); worker killed",
                    seconds=elapsed,
                )
            rss = _rss_mb(self.proc.pid)
            if rss > self.cfg.worker_memory_mb:
                self.kill()
                return JobResult(
                    False,
                    status=Status.CRASH,
                    reason=f"resident memory {rss:.0f} MB over the limit of "
                    f"{self.cfg.worker_memory_mb} MB; worker killed",
                    seconds=elapsed,
                )

    def _answer(self, raw: bytes, t0: float) -> JobResult:
        seconds = time.monotonic() - t0
        try:
            answer = jobs.decode(raw)
        except jobs.JobFormatError:
            answer = None
        if not isinstance(answer, Answer):
            self.kill()
            return JobResult(
                False, status=Status.CRASH, reason="worker sent a malformed answer", seconds=seconds
            )
        if answer.sandbox is not None:
            self.sandbox = {str(k): str(v) for k, v in answer.sandbox.items()}
            sandbox.note(self.sandbox)
        modules = answer.loaded_modules
        if answer.exit:
            # The handler saw a sticky CUDA error or an out-of-memory: this process is spent, start afresh.
            self.kill()
        elif isinstance(modules, int) and modules >= self.cfg.worker_max_modules:
            # Loaded modules are never unloaded (the profiler then names kernels wrongly): start afresh.
            self.kill()
            self.recycles += 1
        if isinstance(answer, jobs.Failed):
            return JobResult(False, answer, reason=answer.error, seconds=seconds)
        return JobResult(True, answer, seconds=seconds)

    def _died(self, t0: float, when: str) -> JobResult:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        tail = _crash_lines(self.log_tail(40))
        self.kill()
        if code is not None and code < 0:
            what = f"killed by {signal.Signals(-code).name}"
        else:
            what = f"exited with code {code}"
        reason = f"worker {what} {when}" + (f": {tail}" if tail else "")
        return JobResult(False, status=Status.CRASH, reason=reason, seconds=time.monotonic() - t0)


class WorkerPool:
    """One worker per GPU; `map` runs jobs in parallel, one at a time per worker, results in order.
    `reference` is the trusted worker (started on first use, on the first GPU) for jobs.TRUSTED."""

    def __init__(self, cfg: Config, gpus: list[str | None]):
        self.workers = [Worker(cfg, gpu, name=f"worker{i}") for i, gpu in enumerate(gpus or [None])]
        self._reference = Worker(cfg, self.workers[0].gpu, name="reference", trusted=True)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in [*self.workers, self._reference]:
            w.close()

    @property
    def first(self) -> Worker:
        return self.workers[0]

    @property
    def reference(self) -> Worker:
        """Not confined: only for jobs that run no candidate code (jobs.TRUSTED). It shares the first GPU
        with a confined worker, so its jobs must leave no cached allocator memory behind."""
        return self._reference

    def map(
        self,
        batch: list[Job],
        timeout_s: float | None = None,
        on_result: Callable[[int, JobResult], None] | None = None,
    ) -> list[JobResult]:
        results: list[JobResult | None] = [None] * len(batch)
        next_index = iter(range(len(batch)))
        lock = threading.Lock()

        def drain(worker: Worker) -> None:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                results[i] = worker.request(batch[i], timeout_s)
                if on_result is not None:
                    on_result(i, results[i])

        threads = [threading.Thread(target=drain, args=(w,), daemon=True) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [r for r in results if r is not None]


def visible_gpus() -> list[str]:
    """CUDA_VISIBLE_DEVICES entries to give one worker each, without importing torch or CUDA here."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None:
        entries = [e.strip() for e in inherited.split(",") if e.strip()]
        return entries[:count] if count else entries
    return [str(i) for i in range(count)]


# -- plumbing shared by both ends --------------------------------------------------------------------------
def _write_frame(fd: int, payload: bytes) -> None:
    data = _HEADER.pack(len(payload)) + payload
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _crash_lines(tail: str) -> str:
    keep = [
        line.strip()
        for line in tail.splitlines()
        if any(w in line.lower() for w in ("error", "illegal", "fault", "abort", "killed", "exception"))
    ]
    return " | ".join(keep[-3:])[:500]


# -- the child -------------------------------------------------------------------------------------------
def serve(
    fd_in: int,
    fd_out: int,
    device: str = "cuda",
    plan: sandbox.Plan | None = None,
    early: sandbox.Report | None = None,
) -> None:
    """Answer jobs until EOF. With a plan: `early` is what sandbox.apply_early gave (first thing in the
    process); the late layers go on once torch and CUDA are up, and the first answer carries the report."""
    import resource
    import traceback

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _exit_with_parent(fd_out)
    from pipeline import worker_jobs  # imported here: the parent never loads torch for the worker's sake

    report = None
    if plan is not None:
        _warm_up(device)
        report = sandbox.apply_late(plan, early)
    while True:
        header = _read_exact(fd_in, _HEADER.size)
        if header is None:
            return
        (n,) = _HEADER.unpack(header)
        raw = _read_exact(fd_in, n)
        if raw is None:
            return
        try:
            job = jobs.decode(raw)
            if not isinstance(job, Job):
                raise jobs.JobFormatError(f"a {job.KIND!r} answer sent as a job")
            answer = worker_jobs.handle(job)
        except Exception as e:
            # A handler that raised left this process in a state nobody checked (a CUDA error that surfaced
            # outside the candidate's own calls leaves a broken context behind it): start a fresh one.
            answer = jobs.Failed(
                error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8), exit=True
            )
        if report is not None:
            answer, report = dataclasses.replace(answer, sandbox=report), None
        _write_frame(fd_out, jobs.encode(answer))
        if answer.exit:
            os._exit(3)


def _exit_with_parent(fd_out: int) -> None:
    """Exit once the orchestrator is gone, whatever job runs. The worker lives in its own session (a kill of
    its group must not reach the orchestrator), so nothing else ends it when the orchestrator dies without
    closing it (killed by a timeout, say): a job in a kernel that never returns kept the process, and the
    GPU, busy for good. The orchestrator's death closes the read end of our answers' pipe, which poll
    reports on ours as POLLERR; a daemon thread waits for that, asking for no event, so it never spins."""

    def watch() -> None:
        p = select.poll()
        p.register(fd_out, 0)
        while True:
            for _, events in p.poll():
                if events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    os._exit(4)

    threading.Thread(target=watch, daemon=True, name="kp-parent-watch").start()


def _warm_up(device: str) -> None:
    """Load now what the jobs load later, and bring CUDA, CuPy, NVML and CUPTI up: once the late layers are
    on, nothing can be executed, and anything that starts helpers must have started them already."""
    import torch
    import torch.profiler

    from pipeline import energy, runtime, timing, verify  # noqa: F401
    from pipeline.profile import system  # noqa: F401

    if device != "cuda" or not torch.cuda.is_available():
        return
    torch.cuda.init()
    torch.empty(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    with contextlib.suppress(Exception):
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(torch.cuda.current_device()).use()
        from pipeline import fused_stats

        fused_stats.warm()
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
    with (
        contextlib.suppress(Exception),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]),
    ):
        torch.empty(1, device="cuda").add_(1)
        torch.cuda.synchronize()


if __name__ == "__main__":
    # python -m pipeline.worker FD_IN FD_OUT [DEVICE [PLAN]]
    _plan = sandbox.Plan.from_json(sys.argv[4]) if len(sys.argv) > 4 else None
    # First, while this interpreter is single-threaded (namespaces need that): nothing imported torch yet.
    _early = sandbox.apply_early(_plan) if _plan is not None else None
    serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "cuda", _plan, _early)
