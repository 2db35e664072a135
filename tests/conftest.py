from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline.config import Config, load
from pipeline.worker import Worker

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tasks"
EXAMPLES = ROOT / "examples" / "candidates"


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    return load(home=tmp_path / "home")


@pytest.fixture(scope="module")
def cpu_worker(tmp_path_factory):
    """One CPU worker per test module: starting an interpreter with torch costs seconds here."""
    home = tmp_path_factory.mktemp("worker-home")
    w = Worker(load(home=home, device="cpu", job_timeout_s=60, worker_memory_mb=4096), name="cpu")
    yield w
    w.close()


@pytest.fixture(scope="session")
def full_cutlass(tmp_path_factory):
    """The whole CUTLASS corpus indexed once per session (minutes on two cores), shared by the slow tests."""
    from index.build import build_index

    home = tmp_path_factory.mktemp("cutlass-index")
    cfg = load(home=home)
    t0 = time.monotonic()
    report = build_index("cutlass", cfg)
    return cfg, report, time.monotonic() - t0
