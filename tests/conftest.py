from __future__ import annotations

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
