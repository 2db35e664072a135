"""One profile at a time on a machine (pipeline/profile/collect.py, NCU_LOCK): a GPU's performance monitors
serve one ncu session, so a profile waits for the lock that another process holds, and says so when its
time runs out rather than reporting an empty profile. The other process here is real; ncu is a stand-in
that must never be reached while the lock is held."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pipeline import jobs
from pipeline.config import load
from pipeline.profile import collect
from pipeline.types import Status

HOLD = """
import sys, time
from filelock import FileLock
lock = FileLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_a_profile_waits_for_another_process_s_and_says_why_it_gave_up(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    reached = tmp_path / "ncu-ran"
    ncu = bin_dir / "ncu"
    ncu.write_text(f"#!/bin/sh\ntouch {reached}\nexit 1\n")
    ncu.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    lock_path = tmp_path / "ncu.lock"
    monkeypatch.setattr(collect, "NCU_LOCK", lock_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        cfg = load(home=tmp_path / "home", sandbox=False)
        t0 = time.monotonic()
        res = collect.run_ncu(
            jobs.Ncu("task.py", cfg.seed), cfg, metrics=("gpu__time_duration.sum",), timeout_s=0.5
        )
        assert time.monotonic() - t0 >= 0.5  # it waited its whole time
        assert res.status == Status.TIMEOUT and "another process's profile" in res.reason, res
        assert not reached.exists()  # ncu never started while the other profile held the counters
    finally:
        holder.kill()
        holder.wait()
    # The holder gone (its lock released by the kernel), the next profile gets as far as ncu.
    res = collect.run_ncu(
        jobs.Ncu("task.py", cfg.seed), cfg, metrics=("gpu__time_duration.sum",), timeout_s=30
    )
    assert reached.exists() and res.status == Status.CRASH, res


def test_the_reason_is_ncu_s_own_error_line():
    log = "ncu exited with 1:\n==PROF== Connected to process 7\n==ERROR== Profiling failed: a resource was busy\n"
    assert (
        collect.NcuResult(Status.CRASH, log=log).reason == "==ERROR== Profiling failed: a resource was busy"
    )
    assert (
        collect.NcuResult(Status.LAUNCH_ERROR, log="ncu profiled no kernel:\nx").reason
        == "ncu profiled no kernel:"
    )
    assert collect.NcuResult(Status.TIMEOUT).reason == "timeout"
