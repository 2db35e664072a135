"""A profiling target started ahead of its job (pipeline/profile/warm.py, target.py --wait): the target
really waits, takes its job when it appears and leaves when none comes; run_ncu hands a job to the target
that waits with the same settings and starts a new one otherwise. ncu needs a GPU, so a stand-in on PATH
plays its part here: it runs the target it is given, as ncu does, and writes a raw-page CSV naming how the
target exited. The target itself is real (it imports torch and decodes the job; without CUDA it then
fails, which the stand-in reports)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline import jobs
from pipeline.config import load
from pipeline.profile import collect, target, warm

ROOT = Path(__file__).resolve().parent.parent

STAND_IN = r"""#!PYTHON
import subprocess, sys
args = sys.argv[1:]
log = args[args.index("--log-file") + 1]
cmd = args[args.index("--metrics") + 2:]
r = subprocess.run(cmd, capture_output=True, text=True)
with open(log, "w") as f:
    f.write('"ID","Kernel Name","Grid Size","Block Size","gpu__time_duration.sum"\n')
    f.write('"","","","","ns"\n')
    f.write('"0","target_exit_%d","(1, 1, 1)","(32, 1, 1)","1000"\n' % r.returncode)
with open(log + ".stderr", "w") as f:
    f.write(r.stderr)
"""


def test_wait_for_job_returns_the_file_once_it_is_whole(tmp_path):
    def write() -> None:
        time.sleep(0.05)
        (tmp_path / "job.json.part").write_text("{}")
        os.replace(tmp_path / "job.json.part", tmp_path / target.JOB_FILE)

    t = threading.Thread(target=write)
    t.start()
    assert target.wait_for_job(tmp_path, idle_s=10) == tmp_path / target.JOB_FILE
    t.join()
    assert target.wait_for_job(tmp_path / "none", idle_s=0.02) is None  # no job: it gives up


@pytest.mark.slow
def test_a_waiting_target_takes_its_job_or_leaves_when_none_comes(tmp_path):
    env = {**os.environ, "KERNELPRO_NCU_IDLE_S": "0.3", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pipeline.profile.target", "--wait", str(tmp_path)]
    idle = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert idle.returncode == 0, idle.stderr  # its job never came
    env["KERNELPRO_NCU_IDLE_S"] = "120"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    w = warm.Waiting(proc, tmp_path, tmp_path / "ncu.csv", ())
    warm.hand_over(w, jobs.Ping())  # a job of the wrong kind: the target read it and said so
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "not an ncu job" in err
    assert not (tmp_path / (target.JOB_FILE + ".part")).exists()


@pytest.mark.slow
def test_run_ncu_uses_the_target_started_ahead_with_its_settings(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ncu = bin_dir / "ncu"
    ncu.write_text(STAND_IN.replace("PYTHON", sys.executable))
    ncu.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert collect.find_ncu() == str(ncu)
    cfg = load(home=tmp_path / "home", sandbox=False)
    job = jobs.Ncu(str(ROOT / "tasks" / "softmax.py"), cfg.seed)
    metrics = ("gpu__time_duration.sum",)
    try:
        cold = collect.run_ncu(job, cfg, metrics=metrics, timeout_s=120, warm_next=True)
        assert cold.status.value == "ok" and not cold.warm
        # The target ran and failed where a GPU was needed, after decoding its job.
        assert cold.kernels[0].name == "target_exit_1"
        waiting = warm._waiting
        assert waiting is not None and waiting.proc.poll() is None  # started ahead, and waiting
        hot = collect.run_ncu(job, cfg, metrics=metrics, timeout_s=120, warm_next=False)
        assert hot.status.value == "ok" and hot.warm and hot.kernels[0].name == "target_exit_1"
        assert (waiting.scratch / target.JOB_FILE).exists() and warm._waiting is None
        err = Path(str(waiting.log_path) + ".stderr").read_text()
        assert "not an ncu job" not in err and "CUDA" in err  # it got the job, then needed the GPU
        # Other settings (more metrics) do not take a target started for these: it is replaced.
        collect.prewarm(cfg, metrics)
        first = warm._waiting
        assert (
            warm.take(cfg, str(ncu), (*metrics, "sm__throughput.avg.pct_of_peak_sustained_elapsed"), 1)
            is None
        )
        collect.prewarm(cfg, (*metrics, "dram__bytes.sum"))
        assert first is not None and first.proc.wait(timeout=30) is not None and warm._waiting is not first
    finally:
        warm.stop()
    assert warm._waiting is None


def test_target_parts_split_a_profile_by_the_targets_marks(tmp_path):
    marks = tmp_path / target.TIMES_FILE
    assert collect.target_parts(marks, 100.0, 110.0) == {}  # the target died before its profiled call
    marks.write_text(
        '{"job": 100.5, "reference": 102.0, "candidate": 102.25, "warmup": 102.5, "replayed": 109.0}'
    )
    parts = collect.target_parts(marks, 100.0, 110.0)
    assert parts == {
        "start": 0.5,
        "setup": 1.5,
        "candidate": 0.25,
        "warmup": 0.25,
        "replay": 6.5,
        "exit": 1.0,
    }
    marks.write_text('{"job": 100.5, "reference": 102.0}')  # no mark past the reference: no parts
    assert collect.target_parts(marks, 100.0, 110.0) == {}


def test_a_waiting_target_is_given_the_profiles_lock_only_when_it_may_bring_cuda_up_ahead(tmp_path):
    plain = collect.ncu_command("ncu", None, ("m",), tmp_path / "log", wait_in=tmp_path)
    assert plain[-2:] == ["--wait", str(tmp_path)]
    ahead = collect.ncu_command(
        "ncu", None, ("m",), tmp_path / "log", wait_in=tmp_path, lock=collect.NCU_LOCK
    )
    assert ahead[-3:] == ["--wait", str(tmp_path), str(collect.NCU_LOCK)]
    job = collect.ncu_command("ncu", tmp_path / "job.json", ("m",), tmp_path / "log", lock=collect.NCU_LOCK)
    assert job[-1] == str(tmp_path / "job.json")  # a cold target gets its job, and no lock
    # Without CUDA (this machine) nothing is brought up, and the lock is never taken.
    lock = tmp_path / "ncu.lock"
    assert target.cuda_up_between_profiles(tmp_path, lock, idle_s=1) is False
    assert not lock.exists() and not (tmp_path / target.CUDA_UP_FILE).exists()
    times = tmp_path / target.TIMES_FILE
    assert collect._cuda_ahead(times) is False  # no marks
    times.write_text('{"job": 1.0, "cuda_ahead": true}')
    assert collect._cuda_ahead(times) is True
    times.write_text('{"job": 1.0, "cuda_ahead": false}')
    assert collect._cuda_ahead(times) is False
