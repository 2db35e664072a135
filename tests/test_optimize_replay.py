"""The real loop without a GPU: `kernelpro optimize` with the expert policy, the real search and run log,
evaluations answered from run logs recorded on the H200 (tests/fixtures/runs/, written by
benchmarks/bench_optimize.py). Determinism, kill -9 and resume, greedy against MCTS, the report."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from recordings import stamped
from typer.testing import CliRunner

from pipeline import config
from pipeline.cli import app
from pipeline.loop import optimize
from pipeline.runlog import read_events
from pipeline.runstate import fold

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "tests" / "fixtures" / "runs"
TASK = "softmax"


def recordings(task: str) -> list[Path]:
    found = sorted((RUNS / task).glob("*/log.jsonl"))
    assert found, f"no recordings for {task} under {RUNS}"
    return found


def tree(folder: Path) -> list[tuple]:
    """The search tree as the log holds it: (node, parent, candidate key, edit, status) in node order."""
    events = read_events(folder / "log.jsonl")
    status = {e.data["node"]: e.data["verdict"]["status"] for e in events if e.type == "result"}
    props = sorted((e.data["node"], e.data["parent"], e.data["candidate"]["key"], e.data["edit"])
                   for e in events if e.type == "proposal")  # fmt: skip
    return [(*p, status.get(p[0])) for p in props]


def cfg_for(tmp: Path, **kw):
    return config.load(runs_dir=tmp / "runs", home=tmp / "home", memory=False, policy="expert", **kw)


def run(tmp: Path, search: str = "mcts", evals: int = 10, seed: int = 0):
    cfg = cfg_for(tmp, search=search, max_evals=evals, seed=seed)
    return optimize(ROOT / "tasks" / f"{TASK}.py", cfg, replay=recordings(TASK))


def test_replay_is_deterministic_and_reproduces_the_recorded_results(tmp_path):
    a = run(tmp_path / "a")
    b = run(tmp_path / "b")
    assert tree(a.folder) == tree(b.folder)
    assert a.best_key == b.best_key and a.best_speedup_eager == b.best_speedup_eager
    # Every evaluation of the replay is a real H200 result: none falls outside the recording.
    statuses = [s for *_, s in tree(a.folder)]
    assert statuses and "rejected" not in statuses, statuses
    assert a.best_speedup_eager and a.best_speedup_eager > 1.0
    md = (a.folder / "report.md").read_text()
    assert "## Search tree" in md and a.best_key in md
    assert "<svg" in (a.folder / "report.html").read_text()


def test_kill_minus_nine_and_resume_reach_the_same_tree(tmp_path):
    reference = run(tmp_path / "ref")
    want = tree(reference.folder)
    rng = random.Random(7)
    runs_dir = tmp_path / "k" / "runs"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "pipeline.cli", "optimize", "--policy", "expert", "--no-memory", "--json",
            "--runs-dir", str(runs_dir), "--home", str(tmp_path / "k" / "home"), "--max-evals", "10"]  # fmt: skip
    replay = [a for p in recordings(TASK) for a in ("--replay", str(p))]
    proc = subprocess.Popen([*base, "--task", str(ROOT / "tasks" / f"{TASK}.py"), *replay], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)  # fmt: skip
    kills = 0
    run_id = None
    for _ in range(3):  # kill it at random points, resuming in between, until it finishes on its own
        logs = list(runs_dir.glob("*/log.jsonl"))
        written = len(logs[0].read_text().splitlines()) if logs else 0
        target = written + rng.randint(2, 10)  # a random number of further events
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            logs = list(runs_dir.glob("*/log.jsonl"))
            if logs and len(logs[0].read_text().splitlines()) >= target:
                break
            time.sleep(0.002)
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        run_id = next(runs_dir.glob("*/log.jsonl")).parent.name
        proc = subprocess.Popen([*base, "--resume", run_id], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=tmp_path)  # fmt: skip
    out, errs = proc.communicate(timeout=300)
    assert proc.returncode == 0, errs.decode()[-2000:]
    assert kills >= 1
    summary = json.loads(out)
    assert summary["run_id"] == run_id
    assert tree(runs_dir / run_id) == want
    events = read_events(runs_dir / run_id / "log.jsonl")
    assert sum(e.type == "resume" for e in events) == kills
    # Nothing evaluated twice: each candidate has one result, however often the run died.
    keys = [e.data["key"] for e in events if e.type == "result"]
    assert len(keys) == len(set(keys))


def test_greedy_against_mcts_on_the_recorded_landscape(tmp_path):
    mcts = run(tmp_path / "m", search="mcts", evals=10)
    greedy = run(tmp_path / "g", search="greedy", evals=10)
    for r in (mcts, greedy):
        assert r.evaluations <= 10
    # Both are real searches over the same recorded landscape; MCTS is not worse than greedy there.
    assert (mcts.best_speedup_eager or 0) >= (greedy.best_speedup_eager or 0) * 0.98


def test_resume_unknown_run_and_bad_inputs_are_one_line_errors(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["optimize", "--resume", "nope", "--runs-dir", str(tmp_path)])
    assert res.exit_code == 2 and "no run nope" in res.output
    res = runner.invoke(
        app, ["optimize", "--task", str(tmp_path / "missing.py"), "--runs-dir", str(tmp_path)]
    )
    assert res.exit_code == 2 and "not found" in res.output
    res = runner.invoke(app, ["optimize", "--task", "tasks/softmax.py", "--policy", "nonsense"])
    assert res.exit_code == 2 and "--policy" in res.output


def test_show_lists_and_prints_runs(tmp_path):
    r = run(tmp_path, evals=6)
    runner = CliRunner()
    res = runner.invoke(app, ["show", "--runs-dir", str(tmp_path / "runs"), "--json"])
    assert res.exit_code == 0
    listed = json.loads(res.stdout)
    assert [x["run_id"] for x in listed] == [r.run_id] and listed[0]["status"] == "finished"
    res = runner.invoke(app, ["show", r.run_id, "--runs-dir", str(tmp_path / "runs")])
    assert res.exit_code == 0 and "Search tree" in res.output


def _llm_optimize(tmp_path: Path, server_url: str, evals: int = 3):
    runner = CliRunner()
    env = {"KERNELPRO_LLM_BASE_URL": server_url, "KERNELPRO_LLM_API_KEY": "sk-loop-secret-123",
           "KERNELPRO_LLM_BACKOFF_S": "0.01", "KERNELPRO_LLM_RETRIES": "1"}  # fmt: skip
    replay = [a for p in recordings(TASK) for a in ("--replay", str(p))]
    return runner.invoke(
        app,
        ["optimize", "--task", str(ROOT / "tasks" / f"{TASK}.py"), "--policy", "llm", "--no-memory", "--json",
         "--runs-dir", str(tmp_path / "runs"), "--home", str(tmp_path / "home"), "--max-evals", str(evals),
         *replay],
        env=env,
    )  # fmt: skip


def test_llm_policy_through_the_loop_accounts_tokens_and_keeps_the_key_out(tmp_path):
    from loopback_llm import LoopbackLLM, good

    with LoopbackLLM(default=good()) as server:
        res = _llm_optimize(tmp_path, server.url)
        assert res.exit_code == 0, res.output
        assert server.requests and all("sk-loop-secret-123" in r.headers.get("authorization", "")
                                       for r in server.requests)  # fmt: skip
    folder = Path(json.loads(res.stdout)["folder"])
    raw = (folder / "log.jsonl").read_text()
    assert "sk-loop-secret-123" not in raw
    events = read_events(folder / "log.jsonl")
    usage = [e.data for e in events if e.type == "llm"]
    assert usage and sum(u["prompt_tokens"] for u in usage) > 0
    props = [e.data for e in events if e.type == "proposal"]
    assert props and props[0]["edit"].startswith("llm")
    # The example kernel is not in the expert's recording: the replay says so instead of inventing a result.
    results = [e.data for e in events if e.type == "result"]
    assert results and results[0]["verdict"]["status"] == "rejected"


def test_an_endpoint_that_keeps_failing_ends_the_run_cleanly_with_its_log(tmp_path):
    from loopback_llm import LoopbackLLM, Status

    with LoopbackLLM(default=Status(500, "upstream down")) as server:
        res = _llm_optimize(tmp_path, server.url)
    assert res.exit_code == 2 and "keeps refusing" in res.output, res.output
    (log,) = (tmp_path / "runs").glob("*/log.jsonl")
    events = read_events(log)
    assert events[0].type == "start" and any(e.type == "baselines" for e in events)


def test_a_task_the_expert_cannot_write_is_refused_before_a_run_starts(tmp_path):
    task = tmp_path / "svd_task.py"
    task.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
        "    def forward(self, x):\n        return torch.linalg.svdvals(x)\n\n\n"
        "def get_inputs():\n    return [torch.randn(64, 64, dtype=torch.float64)]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    replay = [a for p in recordings(TASK) for a in ("--replay", str(p))]
    res = CliRunner().invoke(
        app,
        [
            "optimize",
            "--task",
            str(task),
            "--policy",
            "expert",
            "--runs-dir",
            str(tmp_path / "runs"),
            *replay,
        ],
    )
    assert res.exit_code == 2 and "expert policy cannot write kernels" in res.output, res.output
    assert not (tmp_path / "runs").exists()  # nothing half-made on disk


def test_without_feedback_the_expert_reads_no_findings_and_picks_its_edits_blind(tmp_path, monkeypatch):
    """feedback = "none" (and "raw") must change what the expert does, or the tools-against-none ablation
    measures nothing: its contexts carry no findings, and the run's seed to draw its edit order from."""
    from pipeline.generate.expert import ExpertPolicy

    seen: list = []
    propose = ExpertPolicy.propose

    def spy(self, ctx, n):
        seen.append(ctx)
        return propose(self, ctx, n)

    monkeypatch.setattr(ExpertPolicy, "propose", spy)
    for feedback in ("advice", "none"):
        seen.clear()
        cfg = cfg_for(tmp_path / feedback, max_evals=16, feedback=feedback, seed=3)
        optimize(ROOT / "tasks" / f"{TASK}.py", cfg, replay=recordings(TASK))
        kids = [c for c in seen if c.parent is not None]
        assert kids, feedback
        if feedback == "advice":
            assert any(c.findings for c in kids) and all("blind_seed" not in c.extra for c in kids)
        else:
            assert all(not c.findings and c.extra["blind_seed"] == 3 for c in kids)


def test_a_run_draws_on_the_configured_corpora_and_says_which_are_missing(
    tmp_path, small_corpora, monkeypatch
):
    """corpus = "cutlass+local+cccl" over an index of cutlass and local: the run hunts both (once the best
    softmax, the one the recording profiled, is expanded), says cccl has no index and how to build it, and
    its header records the setting. The expert's softmax edits take no building block, so its tree is the
    tree of a run with no corpus."""
    from index.hunt import Hunters

    hunted: list[set[str]] = []
    real = Hunters.hunt

    def spy(self, query, *args, **kw):  # the real hunt, watched
        blocks = real(self, query, *args, **kw)
        hunted.append({b.corpus for b in blocks})
        return blocks

    monkeypatch.setattr(Hunters, "hunt", spy)
    indexed, _, _ = small_corpora
    trees, notes = {}, {}
    for corpus in ("cutlass+local+cccl", "none"):
        cfg = cfg_for(tmp_path / corpus, max_evals=16).replace(home=indexed.home, chroma_path=indexed.chroma_path,
                                                               corpus=corpus)  # fmt: skip
        out = optimize(ROOT / "tasks" / f"{TASK}.py", cfg, replay=recordings(TASK))
        start = read_events(out.folder / "log.jsonl")[0]
        assert start.data["config"]["corpus"] == corpus
        trees[corpus], notes[corpus] = tree(out.folder), out.notes
    assert hunted and hunted[0] == {"cutlass", "local"}
    assert trees["cutlass+local+cccl"] == trees["none"]
    index_notes = {
        k: [n for n in v if "building blocks" in n or "source hunt" in n] for k, v in notes.items()
    }
    assert index_notes["none"] == ["corpus none: no building blocks from a source index"]
    assert index_notes["cutlass+local+cccl"] == [
        "no building blocks from the source index of corpus cccl (no index for corpus cccl: run "
        "`make index CORPUS=cccl` (kernelpro index build --corpus cccl))"
    ]  # and no "source hunt failed": the two corpora answered


def test_a_node_with_nothing_new_to_offer_is_closed_before_its_profile(tmp_path):
    """The advice only orders the expert's edits, so how many new candidates a node can give is known before
    its Nsight Compute run (~10 s on the H200): with none it is closed unprofiled, and when all of them fit
    the expansion the profile could change nothing and is not taken. On this recording: 8 profiles at 30
    evaluations where profiling every expanded node took 10, the tree the same (checked when written)."""
    a = run(tmp_path, evals=30)
    events = read_events(a.folder / "log.jsonl")
    spared = [e.data["node"] for e in events if e.type == "closed" and "already tried" in e.data["reason"]]
    profiled = {e.data["node"] for e in events if e.type == "profile"}
    assert spared and not set(spared) & profiled
    expanded = {parent for _, parent, *_ in tree(a.folder)} - {0}
    assert expanded - profiled  # every new move of these fitted their expansion: no profile
    assert sum(e.type == "result" for e in events) == 30 and len(profiled) == 8


def test_a_node_at_its_floor_is_expanded_without_a_profile(tmp_path):
    """Under the time objective a node within `profile_headroom` of the roofline floor by its own timing is
    expanded without its Nsight Compute run (~3.5 s of GPU on the H200, the time of 5-10 small candidates):
    the counters could find no more than that share. A replay profiles as its recording did: these
    recordings predate the setting and profiled nodes at 92-93% of the floor; stamped with a 10% headroom,
    none at 90% or more is profiled, and the run's end note names the ones spared."""

    def shares(folder: Path) -> tuple[dict[int, float], set[int], set[int], tuple[str, ...]]:
        events = read_events(folder / "log.jsonl")
        state = fold(events)
        assert state.baselines is not None and state.baselines.floor_ms
        share = {
            n.id: state.baselines.floor_ms / m.timing.median_ms
            for n in state.nodes.values()
            if n.evaluation
            and (m := n.evaluation.measurement)
            and m.timing
            and n.evaluation.status.value == "ok"
        }
        profiled = {n.id for n in state.nodes.values() if n.profile is not None}
        expanded = {n.parent for n in state.nodes.values() if n.parent not in (None, 0)}
        return share, profiled, expanded, tuple(events[-1].data["notes"])

    as_recorded = optimize(ROOT / "tasks" / f"{TASK}.py", cfg_for(tmp_path / "a", max_evals=30),
                           replay=recordings(TASK))  # fmt: skip
    share, profiled, _, notes = shares(as_recorded.folder)
    assert any(share[n] >= 0.9 for n in profiled)
    assert not any("without a profile" in n for n in notes)

    cfg = cfg_for(tmp_path / "b", max_evals=30)
    run_b = optimize(
        ROOT / "tasks" / f"{TASK}.py", cfg, replay=stamped(recordings(TASK), tmp_path, profile_headroom="0.1")
    )
    share, profiled, expanded, notes = shares(run_b.folder)
    assert profiled and all(share[n] < 0.9 for n in profiled)
    (note,) = [n for n in notes if "without a profile" in n]
    spared = {int(m) for m in re.findall(r"(\d+) \(\d+%\)", note)}
    assert spared and spared <= expanded - profiled
    assert all(share[n] >= 0.9 for n in spared)
    assert spared == {n for n in expanded - profiled if share.get(n, 0) >= 0.9}


def test_a_node_whose_first_moves_repeat_a_siblings_gets_its_later_new_ones(tmp_path):
    """The expert's moves are all rendered and the first new ones taken: a node whose top moves (in the
    advice's order) give candidates already in the tree is not closed while later moves are new. On this
    recording node 9 (regs=0) first offers node 3's plan again; it used to be closed without a child."""
    a = run(tmp_path, evals=30)
    events = read_events(a.folder / "log.jsonl")
    kids = Counter(parent for _, parent, *_ in tree(a.folder))
    closed = {e.data["node"]: e.data["reason"] for e in events if e.type == "closed"}
    assert kids[9] == 2, closed.get(9)
    # a node closed for repeats has been expanded before: its repeats never cost it a new move
    repeats = {n: why for n, why in closed.items() if "duplicate of an earlier candidate" in why}
    assert repeats and all(kids[n] for n in repeats), closed


def test_the_expert_s_next_candidates_are_handed_over_to_be_built_before_they_are_evaluated(
    tmp_path, monkeypatch
):
    """On a GPU machine the search builds the expert's moves in the background while the GPU profiles and
    times (compile.prefetch): a node's first new moves before its profile (the advice only orders them), and
    an expansion's moves past its room (the root's next batches). Never one already in the tree; the root's
    later batches and every batch of a node expanded without a profile were all handed over before."""
    from pipeline import loop as loop_module
    from pipeline.evaluators import ReplayEvaluator

    timeline: list[tuple[str, list[str]]] = []  # ("ahead" | "evaluate", keys), in call order

    class Recording(ReplayEvaluator):
        def prefetch(self, candidates):
            timeline.append(("ahead", [c.key for c in candidates]))

        def evaluate(self, candidates):
            timeline.append(("evaluate", [c.key for c in candidates]))
            return super().evaluate(candidates)

    monkeypatch.setattr(loop_module, "ReplayEvaluator", Recording)
    a = run(tmp_path, evals=30)
    events = read_events(a.folder / "log.jsonl")
    assert sum(e.type == "result" for e in events) == 30
    parent = {key: par for _, par, key, *_ in tree(a.folder)}
    profiled = {e.data["node"] for e in events if e.type == "profile"}
    ahead: set[str] = set()
    evaluated: set[str] = set()
    batches = guaranteed = 0
    for kind, keys in timeline:
        if kind == "ahead":
            assert not set(keys) & evaluated, keys  # nothing already in the tree
            ahead |= set(keys)
            continue
        if not batches:
            assert not set(keys) & ahead  # the first batch is built in the foreground
        elif parent[keys[0]] == 0 or parent[keys[0]] not in profiled:
            assert set(keys) <= ahead, (batches, keys)
            guaranteed += 1
        evaluated |= set(keys)
        batches += 1
    assert batches > 3 and guaranteed >= 2


def test_a_batch_s_own_first_moves_are_handed_over_while_it_is_timed(tmp_path, monkeypatch):
    """On a GPU machine the expert renders each fresh candidate's first moves while the GPU times its batch
    (loop._speculate, a thread of its own) and hands them over to be built, so the node the search expands
    next finds its moves built: without a profile nothing else overlaps its nvcc. The search is the same
    with and without it, and most later batches hold only moves handed over while their parent was timed."""
    import threading

    from pipeline import loop as loop_module
    from pipeline.evaluators import ReplayEvaluator

    timeline: list[tuple[str, list[str]]] = []

    class Recording(ReplayEvaluator):
        builds_ahead = True

        def prefetch(self, candidates):
            spec = threading.current_thread().name == "expert-ahead"
            timeline.append(("spec" if spec else "ahead", [c.key for c in candidates]))

        def evaluate(self, candidates):
            timeline.append(("evaluate", [c.key for c in candidates]))
            return super().evaluate(candidates)

    plain = run(tmp_path / "plain", evals=30)
    monkeypatch.setattr(loop_module, "ReplayEvaluator", Recording)
    a = run(tmp_path / "spec", evals=30)
    assert tree(a.folder) == tree(plain.folder)
    parent = {key: par for _, par, key, *_ in tree(a.folder)}
    spec: set[str] = set()
    evaluated: set[str] = set()
    early = later = 0
    for kind, keys in timeline:
        if kind == "spec":
            assert not set(keys) & evaluated
            spec |= set(keys)
        elif kind == "evaluate":
            if parent[keys[0]] != 0:
                later += 1
                early += set(keys) <= spec  # built since its parent's own batch was timed
            evaluated |= set(keys)
    # On this recording 8 of 11: the advice of the nodes profiled kept most of their first moves first.
    assert later and 2 * early >= later, (early, later)

    # Where a move takes long to render (a level-3 plan), the loop does not wait on it: nothing ahead.
    timeline.clear()
    monkeypatch.setattr(loop_module, "SPECULATE_RENDER_S", 0.0)
    b = run(tmp_path / "slow", evals=30)
    assert tree(b.folder) == tree(plain.folder)
    assert not any(kind == "spec" for kind, _ in timeline)
