"""The optimize sweep's bookkeeping (benchmarks/bench_optimize.py) on the CPU: which suite tasks it takes, and
the summary of a store and where a run's seconds went, over rows made from run logs recorded on the H200
(tests/fixtures/runs/)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_optimize  # noqa: E402
from recordings import stamped  # noqa: E402

from pipeline.runlog import read_events  # noqa: E402

RUNS = ROOT / "tests" / "fixtures" / "runs"


def test_a_suite_sweep_takes_the_matching_tasks_of_its_levels_in_order(tmp_path):
    source = (ROOT / "tasks" / "softmax.py").read_text()
    for level, name in [("level2", "12_Gemm_ReLU"), ("level2", "3_Conv2d_Tanh"), ("level2", "7_Softmax"),
                        ("level3", "1_Conv2d_MLP")]:  # fmt: skip
        (tmp_path / level).mkdir(exist_ok=True)
        (tmp_path / level / f"{name}.py").write_text(source)
    args = argparse.Namespace(suite=[tmp_path], levels=["level2"], match="Conv|Gemm", limit=None, tasks="")
    got = bench_optimize.task_paths(args)
    assert list(got) == ["level2/3_Conv2d_Tanh", "level2/12_Gemm_ReLU"]  # problem number order
    assert all(p.is_file() for p in got.values())
    args.limit = 1
    assert list(bench_optimize.task_paths(args)) == ["level2/3_Conv2d_Tanh"]


def test_the_summary_of_a_store_made_from_recorded_runs(tmp_path, capsys):
    rows = []
    for i, log in enumerate(sorted(RUNS.glob("*/*/log.jsonl"))):
        row = bench_optimize.summarise(log.parent)
        rows.append({**row, "key": f"fixture/{log.parent.parent.name}-{i}"})
    rows.append({"key": "fixture/eager-fails", "error": "the reference ran out of memory"})
    timed = [r for r in rows if r.get("speedup_eager")]
    assert len(timed) >= 2, "the recordings hold timed runs"
    store = tmp_path / "store.jsonl"
    store.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"key": "cut short by a ki')
    assert bench_optimize.main(["--summary", str(store)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tasks"] == len(rows) and got["timed"] == len(timed) and got["errors"] == 1
    want = math.exp(sum(math.log(r["speedup_eager"]) for r in timed) / len(timed))
    assert math.isclose(got["ours_over_eager"], want, rel_tol=1e-12)
    assert got["slower_than_eager"] == sorted(r["key"] for r in timed if r["speedup_eager"] < 1)


def test_a_rows_seconds_by_stage_add_up_to_its_logged_time():
    for log in sorted(RUNS.glob("*/*/log.jsonl")):
        events = read_events(log)
        got = bench_optimize.summarise(log.parent)["seconds"]
        assert set(got) == {"baselines", "evaluations", "profile", "final", "other"}
        assert math.isclose(sum(got.values()), events[-1].t - events[0].t, abs_tol=0.3), (log, got)
        first_baselines = next(e for e in events if e.type == "baselines")
        assert got["baselines"] >= round(first_baselines.t - events[0].t, 1) - 0.05
        assert got["evaluations"] > 0  # the recordings evaluated candidates
        final = [(a, b) for a, b in itertools.pairwise(events) if b.type == "final"]
        assert math.isclose(got["final"], sum(b.t - a.t for a, b in final), abs_tol=0.05)


def test_throughput_counts_the_timed_candidates_over_the_runs_minutes(tmp_path):
    """benchmarks/bench_throughput.py's figure over a bench whose evaluations replay H200 recordings."""
    import bench_throughput

    from pipeline import bench, config

    suite_file = tmp_path / "suite.txt"
    suite_file.write_text(f"{ROOT / 'tasks' / 'softmax.py'}\n")
    suite = bench.load_suite(suite_file)
    manifest = bench.open_bench(
        tmp_path / "b", suite, {"evals": 3, "policy": "expert", "search": None}, False
    )
    result = bench.run_bench(tmp_path / "b", suite, config.load(home=tmp_path / "h"), manifest,
                             replay=bench.ReplayIndex.scan(RUNS))  # fmt: skip
    got = bench_throughput.throughput(result)
    (row,) = result.rows
    events = read_events(tmp_path / "b" / "runs" / row["run_id"] / "log.jsonl")
    timed = [
        e for e in events if e.type == "result" and e.data["measurement"] and e.data["measurement"]["timing"]
    ]
    assert got["candidates_timed"] == len(timed) > 0
    assert math.isclose(got["gpu_minutes"], (events[-1].t - events[0].t) / 60, abs_tol=1e-3)
    assert math.isclose(sum(got["seconds_by_stage"].values()), events[-1].t - events[0].t, abs_tol=0.3)
    assert got["per_task"][row["key"]]["timed"] == len(timed)
    # the worker's phases and the timing loop's parts are in these recordings
    assert got["worker_seconds"]["timing"] > 0 and {"calls", "checks", "inputs"} <= set(got["timing_seconds"])


def test_the_peer_benchmark_writes_tasks_the_expert_takes_and_the_reference_runs(tmp_path):
    """benchmarks/bench_peers.py's cases (our kernels against liger-kernel's, on the GPU): each task file is
    valid, its reference runs here, and the expert writes kernels for it (cross-entropy as a hybrid)."""
    import bench_peers
    import torch

    from pipeline.generate.expert import supports
    from pipeline.tasks import load_module

    for name in bench_peers.CASES:
        path = bench_peers.write_task(tmp_path, name, rows=8, cols=64)
        module = load_module(path)
        out = module.Model(*module.get_init_inputs())(*module.get_inputs())
        assert torch.isfinite(out).all() and out.numel() in (1, 8 * 64), name
        ok, why = supports(path)
        assert ok, (name, why)
        assert "left to PyTorch" not in why, (
            name,
            why,
        )  # cross-entropy too: one pass of ours (families/xent.py)
        assert ("xent" in why) == (name == "cross_entropy"), (name, why)


def test_throughput_counts_the_nodes_expanded_without_a_profile(tmp_path):
    """The figure's record of profiles spared at the floor (pipeline/loop.py, profile_headroom): read from
    the runs' end notes, over the softmax recordings replayed as if they had run with a 10% headroom."""
    import bench_throughput

    from pipeline import bench, config

    stamped(sorted((RUNS / "softmax").glob("*/log.jsonl")), tmp_path / "recorded", profile_headroom="0.1")
    suite_file = tmp_path / "suite.txt"
    suite_file.write_text(f"{ROOT / 'tasks' / 'softmax.py'}\n")
    suite = bench.load_suite(suite_file)
    manifest = bench.open_bench(
        tmp_path / "b", suite, {"evals": 30, "policy": "expert", "search": None}, False
    )
    cfg = config.load(home=tmp_path / "h", memory=False)
    result = bench.run_bench(tmp_path / "b", suite, cfg, manifest,
                             replay=bench.ReplayIndex.scan(tmp_path / "recorded"))  # fmt: skip
    got = bench_throughput.throughput(result)
    (row,) = result.rows
    end = read_events(tmp_path / "b" / "runs" / row["run_id"] / "log.jsonl")[-1]
    (note,) = [n for n in end.data["notes"] if "without a profile" in n]
    assert got["expanded_unprofiled_at_floor"] == int(note.split()[0]) > 0
