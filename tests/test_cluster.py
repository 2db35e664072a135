"""Distributed evaluation on Ray (pipeline/cluster.py), on a real local Ray cluster whose GPUs are declared
(`num_gpus`) and whose workers are the CPU stand-in: Python candidates verified in confined CPU workers."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from pipeline import cluster, jobs  # noqa: E402
from pipeline.config import load  # noqa: E402
from pipeline.types import Candidate, Status  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "tests" / "fixtures" / "tasks" / "small_chain.py"
GPUS = 3

HONEST = """import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        import time
        time.sleep(SLEEP)
        out = torch.empty_like(x)
        torch.tanh(x * self.scale, out=out)
        return out.add_(x, alpha=0.5)
"""
ABORT = HONEST.replace("import time", "import os\n        os.abort()")


@pytest.fixture(scope="module")
def local_cluster():
    """A Ray instance on this machine that declares three GPUs (there are none: the workers run on CPU)."""
    ray.init(num_cpus=2, num_gpus=GPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    home = tmp_path_factory.mktemp("ray-home")
    return load(home=home, device="cpu", ray="auto", job_timeout_s=60, worker_memory_mb=4096)


@pytest.fixture(scope="module")
def task(local_cluster, cfg):
    with cluster.RayPool(cfg, gpus=1) as pool:
        r = pool.reference.request(jobs.Probe(str(TASK)))
    assert isinstance(r.answer, jobs.Probed), r.reason
    return r.answer.task


def evaluate(task, launcher: str, sleep: float = 0.0) -> jobs.Evaluate:
    code = jobs.CandidateCode(f"standin-{sleep}-{hash(launcher)}", launcher.replace("SLEEP", repr(sleep)))
    return jobs.Evaluate(task, code, jobs.Settings(device="cpu", trials=2, seed=0))


def test_a_batch_is_spread_over_every_gpu_one_job_at_a_time_each(local_cluster, cfg, task):
    with cluster.RayPool(cfg) as pool:
        assert len(pool.workers) == GPUS and pool.model == "cpu"
        assert sorted(i["gpu"] for i in pool.info) == [str(g) for g in range(GPUS)]  # one GPU per actor
        batch = [evaluate(task, HONEST, 0.3) for _ in range(2 * GPUS)]
        seen = []
        results = pool.map(batch, on_result=lambda j, r: seen.append(j))
    assert [r.answer.verdict.status for r in results] == [Status.OK] * len(batch), [r.reason for r in results]
    assert sorted(seen) == list(range(len(batch)))
    assert {a for a, *_ in pool.trace} == set(range(GPUS))  # every GPU had work
    for gpu in range(GPUS):  # never two jobs at once on one GPU
        spans = sorted((s, e) for a, _, s, e in pool.trace if a == gpu)
        assert all(e1 <= s2 for (_, e1), (s2, _) in itertools.pairwise(spans)), spans


def test_a_lost_actor_loses_only_its_job_and_the_batch_goes_on(local_cluster, cfg, task):
    with cluster.RayPool(cfg) as pool:
        batch = [evaluate(task, HONEST, 20.0)] + [evaluate(task, HONEST, 0.2) for _ in range(4)]
        out: list = []
        runner = threading.Thread(target=lambda: out.extend(pool.map(batch)))
        runner.start()
        time.sleep(3)  # job 0 runs on actor 0 (jobs go to the actors in order): kill it mid-job
        ray.kill(pool.actors[0])
        runner.join(timeout=120)
        assert not runner.is_alive()
        assert out[0].status is Status.CRASH and "was lost mid-job" in out[0].reason
        assert [r.answer.verdict.status for r in out[1:]] == [Status.OK] * 4
        assert pool.workers == [1, 2]
        assert {a for a, j, *_ in pool.trace if j > 0} <= {1, 2}


def test_a_gpu_that_keeps_crashing_is_drained(local_cluster, cfg, task):
    with cluster.RayPool(cfg, gpus=1) as pool:
        results = pool.map([evaluate(task, ABORT) for _ in range(cluster.DRAIN_AFTER + 1)])
    assert [r.status for r in results[: cluster.DRAIN_AFTER]] == [Status.CRASH] * cluster.DRAIN_AFTER
    assert "SIGABRT" in results[0].reason
    assert results[-1].status is Status.CRASH and "no GPU actor left" in results[-1].reason
    assert pool.workers == [] and any("drained" in n for n in pool.notes)


def test_a_pool_uses_one_gpu_model(local_cluster, cfg):
    with pytest.raises(cluster.RayUnavailable, match=r"no GPU actor has a H200-that-is-not-here; .* cpu"):
        cluster.RayPool(cfg, model="H200-that-is-not-here")


def test_files_a_job_names_travel_by_content(tmp_path):
    """An actor on another node gets the task and the cubin as bytes; the job is rewritten to its copies."""
    cubin = tmp_path / "a.cubin"
    cubin.write_bytes(b"\x7fELF-ish")
    job = jobs.Ncu(str(TASK), 0, jobs.CandidateCode("k", "launcher", str(cubin)))
    assert cluster._job_files(job) == [str(TASK), str(cubin)]
    moved = cluster._localize(job, {str(TASK): "/there/small_chain.py", str(cubin): "/there/x.cubin"})
    assert moved.task_path == "/there/small_chain.py" and moved.candidate.cubin_path == "/there/x.cubin"
    assert cluster._localize(jobs.Ping(), {}) == jobs.Ping()


def test_compile_jobs_run_as_ray_tasks_and_fill_the_heads_cache(local_cluster, cfg):
    from pipeline.compile import compile_candidates

    src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }\n'
    bad = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = undefined_name; }\n'
    cands = [Candidate("good", "t", src, "launcher"), Candidate("bad", "t", bad, "launcher")]
    cfg = cfg.replace(arch="sm_90a")
    good, failed = compile_candidates(cands, cfg)
    assert good.status is Status.OK and good.resources and Path(good.cubin_path).is_file()
    assert Path(good.cubin_path).parent == (cfg.cache_dir / "cubin").resolve()
    assert failed.status is Status.COMPILE_ERROR and "undefined_name" in failed.log
    again, _ = compile_candidates(cands, cfg)
    assert again.cached and again.cubin_path == good.cubin_path


def test_nothing_imports_ray_without_the_option():
    code = (
        "import sys, pipeline.cli, pipeline.loop, pipeline.bench, pipeline.stages, pipeline.compile\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_a_bench_runs_its_tasks_across_the_cluster_and_keeps_everything_on_the_head(local_cluster, tmp_path):
    """The same bench, replayed from the H200 recordings, on this machine and as Ray tasks of one GPU each:
    the same rows (status, times), and every run folder written back here."""
    from pipeline import bench
    from tests.test_bench import RECORDED, make_suite

    suite = bench.load_suite(make_suite(tmp_path))
    rows = {}
    for where in ("", "auto"):
        out = tmp_path / f"out-{where or 'here'}"
        manifest = bench.open_bench(out, suite, {"evals": 3, "policy": None, "search": None}, False)
        cfg = load(home=tmp_path / "home", ray=where)
        result = bench.run_bench(out, suite, cfg, manifest, replay=bench.ReplayIndex.scan(RECORDED))
        assert not result.stopped and len(result.rows) == 3
        rows[where] = {r["key"]: r for r in result.rows}
        for r in result.rows:
            if r.get("run_id"):
                assert (out / bench.RUNS / r["run_id"] / "log.jsonl").is_file()
    here, there = rows[""], rows["auto"]
    assert list(here) == list(there)
    for key in here:
        assert here[key]["status"] == there[key]["status"]
        assert here[key].get("ours_ms") == there[key].get("ours_ms")
        assert there[key]["path"] == here[key]["path"]
    assert all(r.get("node") for r in there.values()) and not any(r.get("node") for r in here.values())
