"""The isolated worker, with Python stand-ins that crash, hang, eat memory or spin the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import jobs
from pipeline.config import load
from pipeline.types import Status
from pipeline.worker import Worker, WorkerPool

pytestmark = pytest.mark.slow

# A job that runs arbitrary code through the worker's real task probe: the "task" is the stand-in.
STANDINS = {
    "segfault": "import ctypes\nctypes.string_at(0)\n",
    "abort": "import os\nos.abort()\n",
    "hang": "while True:\n    pass\n",
    "sleep": "import time\ntime.sleep(600)\n",
    "memory": "import time\nblob = bytearray(1500 * 2**20)\nblob[::4096] = b'x' * len(blob[::4096])\ntime.sleep(60)\n",
    "threads": (
        "import threading\n"
        "def spin():\n    while True:\n        pass\n"
        "for _ in range(2):\n    threading.Thread(target=spin, daemon=True).start()\n"
        "import time\ntime.sleep(600)\n"
    ),
    # Breaks the worker's own state, so that its handler raises (a broken CUDA context does the same on a GPU)
    "corrupts": (
        "import torch\nimport pipeline.tasks\npipeline.tasks.MAX_TASK_BYTES = 'corrupted'\n"
        "class Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
        "def get_inputs():\n    return [torch.randn(4)]\ndef get_init_inputs():\n    return []\n"
    ),
    "secrets": (
        "import os, json\n"
        "open('env.json', 'w').write(json.dumps({k: v for k, v in os.environ.items()}))\n"
        "raise SystemExit('stop here')\n"
    ),
}


def probe_job(tmp_path, name: str) -> jobs.Probe:
    path = tmp_path / f"{name}.py"
    path.write_text(STANDINS[name])
    return jobs.Probe(str(path))


@pytest.fixture
def worker(tmp_path):
    w = Worker(
        load(home=tmp_path / "home", device="cpu", job_timeout_s=20, job_cpu_s=8, worker_memory_mb=800)
    )
    yield w
    w.close()


@pytest.mark.parametrize("name", ["segfault", "abort"])
def test_crash_kills_only_the_worker_and_it_restarts(worker, tmp_path, name):
    assert worker.request(jobs.Ping()).ok
    first_pid = worker.proc.pid
    r = worker.request(probe_job(tmp_path, name))
    assert not r.ok and r.status == Status.CRASH
    assert "SIGSEGV" in r.reason or "SIGABRT" in r.reason
    assert not worker.alive()
    again = worker.request(jobs.Ping())
    assert again.ok and isinstance(again.answer, jobs.Pong)
    assert worker.proc.pid != first_pid and worker.restarts == 1


def test_a_handler_that_raised_leaves_the_worker_spent_and_the_next_job_gets_a_fresh_one(worker, tmp_path):
    assert worker.request(jobs.Ping()).ok
    first_pid = worker.proc.pid
    r = worker.request(probe_job(tmp_path, "corrupts"))
    assert not r.ok and isinstance(r.answer, jobs.Failed) and r.answer.exit
    assert "TypeError" in r.reason
    assert not worker.alive()
    task = tmp_path / "ok.py"
    task.write_text(STANDINS["corrupts"].replace("pipeline.tasks.MAX_TASK_BYTES = 'corrupted'\n", ""))
    again = worker.request(jobs.Probe(str(task)))  # the fresh worker's state is whole again
    assert again.ok and isinstance(again.answer, jobs.Probed), again.reason
    assert worker.proc.pid != first_pid and worker.restarts == 1


def test_hang_times_out_and_the_process_is_gone(worker, tmp_path):
    worker.request(jobs.Ping())
    r = worker.request(probe_job(tmp_path, "sleep"), timeout_s=3)
    assert r.status == Status.TIMEOUT and "no answer within 3 s" in r.reason
    assert r.seconds < 10
    assert worker.request(jobs.Ping()).ok


def test_cpu_time_limit(worker, tmp_path):
    # two spinning threads burn CPU faster than wall time passes: the CPU budget (8 s) trips first
    r = worker.request(probe_job(tmp_path, "threads"), timeout_s=30)
    assert r.status == Status.TIMEOUT and "CPU time" in r.reason


def test_memory_limit(worker, tmp_path):
    r = worker.request(probe_job(tmp_path, "memory"), timeout_s=30)
    assert r.status == Status.CRASH and "resident memory" in r.reason
    assert worker.request(jobs.Ping()).ok


def test_environment_is_scrubbed_and_cwd_is_scratch(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-do-not-leak")
    monkeypatch.setenv("HF_TOKEN", "hf-do-not-leak")
    monkeypatch.setenv("DB_PASSWORD", "hunter2")
    monkeypatch.setenv("HARMLESS_SETTING", "kept")
    w = Worker(load(home=tmp_path / "home", device="cpu", job_timeout_s=60))
    try:
        r = w.request(probe_job(tmp_path, "secrets"))
        assert not r.ok  # the stand-in stops itself with SystemExit
        env = __import__("json").loads((w.scratch / "env.json").read_text())
    finally:
        w.close()
    assert env.get("HARMLESS_SETTING") == "kept"
    assert not [k for k in env if "KEY" in k or "TOKEN" in k or "PASSWORD" in k]
    assert str(tmp_path / "home" / "scratch") in str(w.scratch)


def test_pool_keeps_order_and_survives_a_crash(tmp_path):
    cfg = load(home=tmp_path / "home", device="cpu", job_timeout_s=30)
    batch = [jobs.Ping(), probe_job(tmp_path, "abort"), jobs.Ping(), jobs.Probe(str(tmp_path / "none.py"))]
    with WorkerPool(cfg, [None, None]) as pool:
        t0 = time.monotonic()
        results = pool.map(batch)
        assert time.monotonic() - t0 < 60
    assert [r.ok for r in results] == [True, False, True, False]
    assert results[1].status == Status.CRASH and isinstance(results[0].answer, jobs.Pong)
    failed = results[3].answer  # the handler's own refusal comes back typed, the worker alive
    assert isinstance(failed, jobs.Failed) and failed.task_error and "not found" in results[3].reason


def test_closing_leaves_no_process(tmp_path):
    w = Worker(load(home=tmp_path / "home", device="cpu"))
    w.request(jobs.Ping())
    pid = w.proc.pid
    w.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


ORCHESTRATOR = """
import sys
from pathlib import Path
from pipeline import jobs
from pipeline.config import load
from pipeline.worker import Worker
w = Worker(load(home=Path(sys.argv[1]), device="cpu", job_timeout_s=600))
w.request(jobs.Ping())
print(w.proc.pid, flush=True)
w.request(jobs.Probe(sys.argv[2]))  # sleeps for 10 minutes
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie is gone
    except OSError:
        return True


def test_a_worker_outlives_no_orchestrator_killed_mid_job(tmp_path):
    """An orchestrator killed while its worker runs a job (a timeout's SIGKILL) takes the worker with it:
    the worker is in its own session, and a job stuck in a kernel would otherwise keep the GPU busy."""
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text(STANDINS["sleep"])
    orch = subprocess.Popen(
        [sys.executable, "-c", ORCHESTRATOR, str(tmp_path / "home"), str(sleeper)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    pid = int(orch.stdout.readline())
    time.sleep(2)  # the probe is running
    assert not _gone(pid)
    orch.kill()
    orch.wait()
    deadline = time.monotonic() + 15
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = not _gone(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive, "the worker outlived its orchestrator"


# A stand-in "task" that, once probed, makes the worker's answers unreadable: every answer the worker sends
# from then on (this probe's own included) is a message of a kind no one knows.
STANDIN_GARBLES_ANSWERS = """
from pipeline import jobs
jobs.encode = lambda message: b'{"kind": "nonsense"}'
raise RuntimeError('garbled')
"""


def test_an_answer_that_does_not_decode_is_a_crash_and_the_worker_restarts(worker, tmp_path):
    path = tmp_path / "garbles.py"
    path.write_text(STANDIN_GARBLES_ANSWERS)
    r = worker.request(jobs.Probe(str(path)))
    assert not r.ok and r.answer is None
    assert r.status == Status.CRASH and r.reason == "worker sent a malformed answer"
    assert not worker.alive()
    assert isinstance(worker.request(jobs.Ping()).answer, jobs.Pong)  # a fresh, unpatched worker
