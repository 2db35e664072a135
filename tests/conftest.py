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
    """The whole CUTLASS corpus indexed once per session (minutes on two cores), shared by the slow tests (all
    in tests/test_full_cutlass.py: `make test` gives each file a worker, and each worker its own session)."""
    from index.build import build_index

    home = tmp_path_factory.mktemp("cutlass-index")
    cfg = load(home=home)
    t0 = time.monotonic()
    report = build_index("cutlass", cfg)
    return cfg, report, time.monotonic() - t0


# Two corpora of corpora/*.toml, small and real: `cutlass` from a few of the pinned wheel's own headers (indexed
# under the collection of the whole corpus, so the config opens it by name), and `local` from two kernels of
# ours. What the multi-corpus hunter and the experiments' retrieval are tested on.
SMALL_CUTLASS = (
    "include/cute/swizzle.hpp",
    "include/cute/arch/util.hpp",
    "include/cute/arch/copy.hpp",
    "include/cute/arch/copy_sm90_tma.hpp",
)
SMALL_LOCAL = {
    "kp/block_reduce.cuh": """\
#pragma once
namespace kp {

// Sum over a warp with shuffles.
template <class T>
__device__ T warp_reduce_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

// Sum over a thread block: each warp reduces, then the first warp reduces the warps' partial sums.
template <class T, int Threads>
__device__ T block_reduce_sum(T v) {
  __shared__ T partial[Threads / 32];
  v = warp_reduce_sum(v);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x < Threads / 32 ? partial[threadIdx.x] : T(0);
  return threadIdx.x < 32 ? warp_reduce_sum(v) : v;
}

}  // namespace kp
""",
    "kp/block_scan.cuh": """\
#pragma once
#include "kp/block_reduce.cuh"
namespace kp {

// Inclusive prefix sum over a warp with shuffles (Kogge-Stone), and the warp's total.
template <class T>
__device__ T warp_inclusive_scan(T v, T* total) {
  int lane = threadIdx.x % 32;
  for (int o = 1; o < 32; o <<= 1) {
    T up = __shfl_up_sync(0xffffffff, v, o);
    if (lane >= o) v += up;
  }
  *total = warp_reduce_sum(lane == 31 ? v : T(0));
  return v;
}

}  // namespace kp
""",
}


@pytest.fixture(scope="session")
def small_corpora(tmp_path_factory):
    """(config, cutlass folder, local folder): both corpora indexed in the config's home."""
    import dataclasses
    import shutil

    import cutlass_library

    from corpora import load_corpus
    from index.build import build_index

    base = tmp_path_factory.mktemp("small-corpora")
    wheel = Path(cutlass_library.__file__).parent / "source"
    cutlass = base / "cutlass"
    for rel in SMALL_CUTLASS:
        (cutlass / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel / rel, cutlass / rel)
    kernels = base / "kernels"
    for rel, text in SMALL_LOCAL.items():
        (kernels / rel).parent.mkdir(parents=True, exist_ok=True)
        (kernels / rel).write_text(text)
    cfg = load(home=base / "home")
    some = dataclasses.replace(load_corpus("cutlass"), source="folder", distribution=None, root=str(cutlass))
    build_index(some, cfg)
    build_index("local", cfg, folder=kernels)
    return cfg, cutlass, kernels


# make test-gpu with GPU_WORKERS (pytest-xdist, `--dist loadscope`): the cases of these files go to whichever
# worker is free (mostly nvcc, per-worker fixtures only); every other file's stay on one worker, so its module
# fixtures (a GPU pool and its calibration, loopback servers, test_sandbox's fixed escape folder) are built
# once and never raced by a twin. (`--dist loadgroup` would say this with marks, but does not group under
# pytest 9.2 with xdist 3.8.)
SPREAD_FILES = {"tests/test_gpu_expert.py"}


def xdist_scope(nodeid: str) -> str:
    """The unit that one worker runs whole: the case itself in SPREAD_FILES, else its file."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path in SPREAD_FILES else path


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: no error where xdist is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileOrCase(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return FileOrCase(config, log)
