"""A profiling target started ahead of its job: ncu, and under it a Python that has imported torch and the
harness, waiting for a job file (pipeline/profile/target.py --wait). On the H200 a cold profile was 7-10 s,
of which ~5.5 s were a new Python bringing torch up and ~2.4 s ncu's injection
(benchmarks/ncu_overhead.sh); a target started while the search proposes and builds leaves its profile the
job itself. It initialises CUDA only once its job comes, so while it waits it holds nothing on the GPU and
cannot disturb the timings made meanwhile; with `ncu_cuda_ahead` it brings CUDA up before, holding the
profiles' lock (never while another ncu replays), which takes 1.0-1.4 s off the profile (H100).

One waits at a time, for one set of ncu settings; it is used by the next profile with those settings, which
starts its replacement as it hands its job over. Its scratch folder is made at its start, and the job's sandbox plan is made
for that folder when the job is handed over: the namespaces and rlimits the trampoline applied at the start
depend on the configuration only, the Landlock grants (the job's task and cubin) are applied by the target
once the job is known.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from pipeline import jobs, sandbox
from pipeline.config import Config
from pipeline.profile.target import JOB_FILE


@dataclass
class Waiting:
    proc: subprocess.Popen
    scratch: Path
    log_path: Path
    key: tuple


_lock = threading.Lock()
_waiting: Waiting | None = None


def settings_key(cfg: Config, ncu: str, metrics: tuple[str, ...], launch_count: int) -> tuple:
    """What a waiting target was started with: a profile may use it only when all of it matches."""
    return (ncu, metrics, launch_count, str(cfg.home), cfg.sandbox, tuple(cfg.sandbox_ncu_layers),
            tuple(cfg.sandbox_read), cfg.sandbox_file_mb)  # fmt: skip


def start(cfg: Config, ncu: str, metrics: tuple[str, ...], launch_count: int, command) -> None:
    """Start a target for these settings unless one is waiting already (or is left over for others: it is
    stopped and replaced). `command(scratch, log_path, plan)` is ncu's argv for a target started with --wait."""
    global _waiting
    key = settings_key(cfg, ncu, metrics, launch_count)
    with _lock:
        if _waiting is not None and _waiting.key == key and _waiting.proc.poll() is None:
            return
        _stop_locked()
        # No job yet: the plan's grants (task, cubin) are the job's, applied by the target once it comes.
        proc, scratch, log_path = spawn_tree(cfg, jobs.Ncu("", cfg.seed), command)
        _waiting = Waiting(proc, scratch, log_path, key)


def spawn_tree(
    cfg: Config, job: jobs.Ncu, command, stderr: int = subprocess.STDOUT
) -> tuple[subprocess.Popen, Path, Path]:
    """ncu's process tree in a new scratch folder under the home, `job`'s sandbox plan's namespaces and
    rlimits applied by the trampoline. `command(scratch, log_path, plan)` gives ncu's argv (and may write
    the job file there first). Returns the process, the scratch folder and where ncu writes its CSV.
    `stderr`: merged into stdout (the default), or `subprocess.PIPE` to read it apart."""
    root = cfg.home / "scratch"
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="ncu-", dir=root)).resolve()
    plan = sandbox.ncu_plan(cfg, scratch, job)
    log_path = scratch / "ncu.csv"
    proc = sandbox.spawn(
        command(scratch, log_path, plan),
        cwd=scratch,
        scratch=scratch,
        plan=plan,
        trampoline=True,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    return proc, scratch, log_path


def take(cfg: Config, ncu: str, metrics: tuple[str, ...], launch_count: int) -> Waiting | None:
    """The target waiting with these settings, now the caller's (alive when handed over), or None."""
    global _waiting
    with _lock:
        w = _waiting
        if w is None or w.key != settings_key(cfg, ncu, metrics, launch_count):
            return None
        _waiting = None
    if w.proc.poll() is not None:  # it died while waiting (an idle timeout, a kill): a cold start instead
        w.proc.communicate()
        return None
    return w


def hand_over(w: Waiting, job: jobs.Ncu) -> None:
    """Write the job where the target looks for it, whole: a rename, so it never reads half a file."""
    tmp = w.scratch / (JOB_FILE + ".part")
    tmp.write_bytes(jobs.encode(job))
    os.replace(tmp, w.scratch / JOB_FILE)


def stop() -> None:
    with _lock:
        _stop_locked()


def _stop_locked() -> None:
    global _waiting
    if _waiting is None:
        return
    w, _waiting = _waiting, None
    if w.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(w.proc.pid, signal.SIGKILL)
    w.proc.communicate()


atexit.register(stop)
