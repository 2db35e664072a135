"""Nodes lost mid-run, on a real Ray cluster of several nodes on this machine (ray.cluster_utils): a head
without GPUs and GPU nodes whose workers run the CPU stand-in."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from pipeline import bench, cluster, jobs  # noqa: E402
from pipeline.config import load  # noqa: E402
from pipeline.types import Status  # noqa: E402
from tests.test_bench import RECORDED, make_suite  # noqa: E402
from tests.test_cluster import HONEST, TASK, evaluate  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def nodes():
    """A head with no GPU and two nodes of one GPU each; the test removes and adds nodes."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    gpu_nodes = [c.add_node(num_cpus=1, num_gpus=1) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False)
    yield c, gpu_nodes
    ray.shutdown()
    c.shutdown()


def test_a_lost_node_loses_its_job_and_the_other_node_finishes_the_batch(nodes, tmp_path):
    c, gpu_nodes = nodes
    cfg = load(home=tmp_path / "home", device="cpu", ray="auto", job_timeout_s=60, worker_memory_mb=4096)
    with cluster.RayPool(cfg) as pool:
        assert len(pool.workers) == 2 and all(i["node"] != pool.head for i in pool.info)
        probed = pool.reference.request(jobs.Probe(str(TASK)))  # the task file travels to the GPU node
        assert isinstance(probed.answer, jobs.Probed), probed.reason
        task = probed.answer.task
        batch = [evaluate(task, HONEST, 30.0)] + [evaluate(task, HONEST, 0.1) for _ in range(3)]
        out: list = []
        runner = threading.Thread(target=lambda: out.extend(pool.map(batch)))
        runner.start()
        time.sleep(4)  # job 0 is on actor 0: take its node away
        c.remove_node(next(n for n in gpu_nodes if n.node_id == pool.info[0]["node"]))
        runner.join(timeout=180)
        assert not runner.is_alive()
        assert pool.workers == [1] and any("lost" in n for n in pool.notes)
    assert out[0].status is Status.CRASH and "was lost mid-job" in out[0].reason
    assert [r.answer.verdict.status for r in out[1:]] == [Status.OK] * 3


def test_a_bench_whose_last_node_is_lost_says_so_and_resume_finishes_it(nodes, tmp_path):
    c, gpu_nodes = nodes
    c.remove_node(gpu_nodes[1])  # one GPU: the tasks run one after the other
    suite = bench.load_suite(make_suite(tmp_path), match="Softmax")
    out = tmp_path / "out"
    manifest = bench.open_bench(out, suite, {"evals": 3, "policy": None, "search": None}, False)
    cfg = load(home=tmp_path / "home", ray="auto")
    replay = bench.ReplayIndex.scan(RECORDED)

    def lose_the_node(row: dict) -> None:  # after the first task's row: the second has no GPU to run on
        if row.get("status") == "ok" and gpu_nodes[0] in c.list_all_nodes():
            c.remove_node(gpu_nodes[0])

    first = bench.run_bench(out, suite, cfg, manifest, replay=replay, on_row=lose_the_node)
    assert [r["key"] for r in first.rows] == ["level1/1_Softmax"]
    assert first.remaining == ("level1/2_SoftmaxAgain",) and "lost with their node" in first.stopped
    c.add_node(num_cpus=1, num_gpus=1)
    manifest = bench.open_bench(out, suite, {"evals": None, "policy": None, "search": None}, True)
    second = bench.run_bench(out, suite, cfg, manifest, replay=replay)
    assert [r["key"] for r in second.rows] == ["level1/1_Softmax", "level1/2_SoftmaxAgain"]
    assert second.skipped == ("level1/1_Softmax",) and not second.stopped
    assert all((out / bench.RUNS / r["run_id"] / "log.jsonl").is_file() for r in second.rows)
    assert Path(second.rows[1]["path"]).name == "2_SoftmaxAgain.py"
