"""pipeline/prebuild.py with the real nvcc: a bench's next task, its first kernels rendered in a child
process and built ahead into the compile cache, where the search's first batch finds them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline import compile as compile_module
from pipeline.compile import ToolchainError, compile_candidates, find_nvcc
from pipeline.config import Config
from pipeline.prebuild import NextTask, first_kernels
from pipeline.types import Status

ROOT = Path(__file__).resolve().parent.parent

try:
    find_nvcc(Config())
    HAVE_NVCC = True
except ToolchainError:
    HAVE_NVCC = False


def builds_done(timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while compile_module._flying and time.monotonic() < deadline:
        time.sleep(0.05)
    return not compile_module._flying


@pytest.mark.skipif(not HAVE_NVCC, reason="no nvcc (CUDA toolkit) on this machine")
def test_the_next_tasks_first_batch_is_in_the_cache_before_its_search_starts(tmp_path):
    cfg = Config(home=tmp_path / "home", arch="sm_90a", compile_jobs=4)
    path = ROOT / "tasks" / "layernorm.py"
    ahead = NextTask(cfg)
    try:
        ahead.start(path)
        assert ahead.wait(180)
        assert ahead.prefetched == cfg.children_per_expand
        assert builds_done()
    finally:
        ahead.close()
    cands = first_kernels(path, cfg.children_per_expand)
    assert isinstance(cands, list) and len(cands) == cfg.children_per_expand
    builds = compile_candidates(cands, cfg)  # what the search's first batch asks for
    assert [b.status for b in builds] == [Status.OK] * len(cands)
    assert all(b.cached for b in builds)


def test_only_a_gpu_machine_s_expert_bench_builds_ahead_and_a_task_it_cannot_read_is_left_alone(tmp_path):
    gpu = Config(home=tmp_path / "home", device="cuda")
    assert NextTask.wanted(gpu, "expert")
    assert not NextTask.wanted(gpu, "llm")
    assert not NextTask.wanted(gpu.replace(prefetch=False), "expert")
    assert not NextTask.wanted(Config(home=tmp_path / "home", device="cpu"), "expert")
    bad = tmp_path / "bad.py"
    bad.write_text("this is not a task\n")
    assert isinstance(first_kernels(bad, 4), str)
    ahead = NextTask(gpu)
    try:
        ahead.start(bad)
        assert ahead.wait(120)
    finally:
        ahead.close()
    assert ahead.prefetched == 0
