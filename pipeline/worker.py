"""The isolated worker: the only place candidate code runs.

The orchestrator starts one worker process per GPU (a fresh interpreter, never a fork of itself), with an
environment stripped of secrets, in a scratch directory, and watches it: a job that outlives its wall-time
or CPU-time budget, or a worker whose resident memory passes the limit, is killed with its whole process
group and restarted for the next job. Jobs and answers travel as length-prefixed JSON over a private pipe
pair (never pickle: the worker is untrusted, and its stdout is the candidate's to scribble on).
"""

from __future__ import annotations

import contextlib
import json
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import Config, candidate_environ
from pipeline.types import Status

_HEADER = struct.Struct("<Q")
_MAX_FRAME = 256 * 2**20
_POLL_S = 0.05


@dataclass(frozen=True)
class JobResult:
    """What came back for one job: the handler's answer, or why the worker failed to give one."""

    ok: bool
    data: dict[str, Any] = field(default_factory=dict)
    status: Status | None = None  # CRASH or TIMEOUT when the worker died or was killed
    reason: str = ""
    seconds: float = 0.0


class Worker:
    """One worker process, restarted on demand after a crash or a kill."""

    def __init__(self, cfg: Config, gpu: str | None = None, name: str = "worker0"):
        self.cfg = cfg
        self.gpu = gpu  # an entry for CUDA_VISIBLE_DEVICES, or None to inherit
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.restarts = -1
        self._to_child: int | None = None
        self._from_child: int | None = None
        self.scratch: Path | None = None
        self._lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------------------
    def _start(self) -> None:
        scratch_root = self.cfg.home / "scratch"
        scratch_root.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=scratch_root)).resolve()
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        env = candidate_environ()
        env["PYTHONUNBUFFERED"] = "1"
        env["TORCHINDUCTOR_CACHE_DIR"] = str((self.cfg.cache_dir / "inductor").resolve())
        env["TRITON_CACHE_DIR"] = str((self.cfg.cache_dir / "triton").resolve())
        env["KERNELPRO_WORKER_MEMORY_MB"] = str(self.cfg.worker_memory_mb)
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        log = open(self.scratch / "worker.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.worker", str(req_r), str(resp_w)],
                pass_fds=(req_r, resp_w),
                env=env,
                cwd=self.scratch,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so a kill takes its children too
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
    def request(
        self, job: dict[str, Any], timeout_s: float | None = None, cpu_s: float | None = None
    ) -> JobResult:
        with self._lock:
            return self._request(job, timeout_s or self.cfg.job_timeout_s, cpu_s or self.cfg.job_cpu_s)

    def _request(self, job: dict[str, Any], timeout_s: float, cpu_s: float) -> JobResult:
        if not self.alive():
            self.kill()
            self._start()
        assert self.proc is not None and self._to_child is not None and self._from_child is not None
        t0 = time.monotonic()
        cpu0 = _cpu_seconds(self.proc.pid)
        try:
            _write_frame(self._to_child, json.dumps(job).encode())
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
            data = json.loads(raw)
        except ValueError:
            self.kill()
            return JobResult(
                False, status=Status.CRASH, reason="worker sent a malformed answer", seconds=seconds
            )
        if data.get("exit"):
            # The handler saw a sticky CUDA error or an out-of-memory: this process is spent, start afresh.
            self.kill()
        if "error" in data:
            return JobResult(False, data=data, reason=str(data["error"]), seconds=seconds)
        return JobResult(True, data=data, seconds=seconds)

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
    """One worker per GPU; `map` runs jobs in parallel, one at a time per worker, results in order."""

    def __init__(self, cfg: Config, gpus: list[str | None]):
        self.workers = [Worker(cfg, gpu, name=f"worker{i}") for i, gpu in enumerate(gpus or [None])]

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in self.workers:
            w.close()

    @property
    def first(self) -> Worker:
        return self.workers[0]

    def map(
        self,
        jobs: list[dict[str, Any]],
        timeout_s: float | None = None,
        on_result: Callable[[int, JobResult], None] | None = None,
    ) -> list[JobResult]:
        results: list[JobResult | None] = [None] * len(jobs)
        next_index = iter(range(len(jobs)))
        lock = threading.Lock()

        def drain(worker: Worker) -> None:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                results[i] = worker.request(jobs[i], timeout_s)
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
def serve(fd_in: int, fd_out: int) -> None:
    import resource
    import traceback

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    from pipeline import worker_jobs  # imported here: the parent never loads torch for the worker's sake

    while True:
        header = _read_exact(fd_in, _HEADER.size)
        if header is None:
            return
        (n,) = _HEADER.unpack(header)
        raw = _read_exact(fd_in, n)
        if raw is None:
            return
        try:
            answer = worker_jobs.handle(json.loads(raw))
        except Exception as e:
            answer = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
        _write_frame(fd_out, json.dumps(answer, default=str).encode())
        if answer.get("exit"):
            os._exit(3)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
