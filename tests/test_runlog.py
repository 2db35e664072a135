"""The run log: round trips, real kill -9 mid-append, the writer lock across processes, secrets, helpers."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.config import PROJECT_ROOT, Config
from pipeline.generate.base import ProposalStatus, Usage
from pipeline.runlog import LOG, RunLog, RunLogError, new_run_id, read_events
from pipeline.runstate import fold, list_runs
from pipeline.types import (
    Build,
    Candidate,
    Energy,
    Finding,
    KernelResources,
    Kind,
    Measurement,
    Status,
    Timing,
    Verdict,
    from_dict,
    to_dict,
)

HEADER = {"task": {"id": "softmax", "path": "tasks/softmax.py", "source_hash": "ab12"}, "seed": 0}
T = Timing(median_ms=0.5, q1_ms=0.49, q3_ms=0.52, min_ms=0.48, max_ms=0.7, trials=100)
EAGER = Timing(median_ms=1.0, q1_ms=0.99, q3_ms=1.02, min_ms=0.98, max_ms=1.2, trials=100)


def spawn(code: str, *args: str) -> subprocess.Popen:
    """A real Python process that imports the project, started for the kill and lock tests."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    p = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def kill9(p: subprocess.Popen) -> None:
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    if p.stdout:
        p.stdout.close()


def cand(key: str, parent: str | None = None) -> Candidate:
    return Candidate(
        key=key, task_id="softmax", source="__global__ void k(){}", launcher="...", parent=parent
    )


def result(node: int, key: str, ok: bool = True, timing: Timing = T) -> dict:
    status = Status.OK if ok else Status.COMPILE_ERROR
    m = Measurement(key, Status.OK, timing=timing, baselines={"eager": EAGER}) if ok else None
    return {"node": node, "key": key, "verdict": Verdict(key, status), "measurement": m, "reward": 1.0}


def test_new_run_id():
    rid = new_run_id("level1/23 Softmax!", now=1796008500.0)
    assert re.fullmatch(r"20261130-031500-level1-23-Softmax-[0-9a-f]{4}", rid), rid
    assert new_run_id("..", now=0).startswith("19700101-000000-task-")
    assert (
        len({new_run_id("x", now=0) for _ in range(50)}) > 1
    )  # the random suffix tells same-second runs apart


def test_round_trip_every_event_type(tmp_path: Path):
    res = (KernelResources("k", registers=40, spill_stores=4, shared_mem=1024),)
    build = Build("c1", Status.OK, "/c/c1.cubin", res, log="ptxas info", seconds=1.5, arch="sm_90a")
    verdict = Verdict("c1", Status.OK, 3, 3, 1e-6, 1e-7, Kind.HYBRID, ("aten::mm",), ("fine",))
    meas = Measurement(
        "c1",
        Status.OK,
        timing=T,
        baselines={"eager": EAGER, "compile": EAGER},
        energy=Energy(0.01, 300.0, 1.5, 3),
        floor_ms=0.1,
        counters={"dram": 0.8},
        environment={"gpu": "H200"},
    )
    finding = Finding("coalescing", 0.8, {"sectors_per_req": 16.0}, "strided loads", "use float4", ("vec4",))
    usage = Usage(100, 50, 0.01, 1, ("hunt(query=softmax)",), 2.0)
    with RunLog.create(tmp_path, "r1", {**HEADER, "config": Config().public()}) as log:
        log.append("baselines", {"timings": {"eager": EAGER}, "floor_ms": 0.1})
        log.append(
            "proposal",
            {
                "node": 1,
                "parent": 0,
                "candidate": cand("c1"),
                "edit": "vec4",
                "status": ProposalStatus.OK,
                "reason": "",
                "usage": usage,
            },
        )
        log.append("build", to_dict(build))
        log.append("result", {**result(1, "c1"), "verdict": verdict, "measurement": meas, "objective": 0.5})
        log.append("profile", {"node": 1, "key": "c1", "bound": "memory-bound", "findings": [finding]})
        log.append("llm", {"node": 1, "purpose": "propose", "usage": usage})
        log.append("lesson", {"task_features": "softmax", "edit": "vec4", "outcome": "2x"})
        log.append("closed", {"node": 1, "reason": "dead end"})
        log.append("resume", {"resumed_at": 8, "dropped_bytes": 0, "pending": []})
        seq = log.append("end", {"reason": "budget", "best_node": 1, "best_key": "c1", "summary": {}})
        assert seq == 10
        in_memory = log.events()
    events = read_events(tmp_path / "r1")
    assert events == in_memory
    assert [e.seq for e in events] == list(range(11))
    assert [e.type for e in events][:3] == ["start", "baselines", "proposal"]
    by = {e.type: e.data for e in events}
    assert by["start"]["run_id"] == "r1" and by["start"]["task"]["id"] == "softmax"
    assert from_dict(Build, by["build"]) == build
    assert from_dict(Verdict, by["result"]["verdict"]) == verdict
    assert from_dict(Measurement, by["result"]["measurement"]) == meas
    assert from_dict(Finding, by["profile"]["findings"][0]) == finding
    assert from_dict(Candidate, by["proposal"]["candidate"]) == cand("c1")
    assert from_dict(Usage, by["llm"]["usage"]) == usage
    with RunLog.open(tmp_path, "r1") as log:
        assert (
            log.header.type == "start"
            and log.header.data == by["start"]
            and log.events({"build", "end"})[0].type == "build"
        )
        with pytest.raises(RunLogError, match="type 'start'"):
            log.append("start", {})
        with pytest.raises(RunLogError, match="type 'Bad type'"):
            log.append("Bad type", {})
        log.append("iteration", {"iteration": 1})  # the loop's own types are welcome
        with pytest.raises(RunLogError, match="cannot log a object"):
            log.append("llm", {"x": object()})
        assert len(log.events()) == 12  # a refused event leaves nothing behind
    assert read_events(tmp_path / "r1" / LOG)[-1].type == "iteration"  # the file itself reads too
    with pytest.raises(RunLogError, match="closed"):
        log.append("llm", {})


WRITER = """
import sys
from pathlib import Path
from pipeline.runlog import RunLog
runs, rid, fsync = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
log = RunLog.open(Path(runs), rid, fsync=fsync)
log.append("resume", {"dropped_bytes": log.dropped_bytes})
print("ready", flush=True)
i = 0
while True:
    log.append("llm", {"i": i, "pad": "x" * (i * 37 % 500)})
    i += 1
"""


def test_kill9_at_random_points_loses_at_most_the_last_line(tmp_path: Path):
    rng = random.Random(1234)
    RunLog.create(tmp_path, "k", HEADER).close()
    path = tmp_path / "k" / LOG
    rounds = 8
    for r in range(rounds):
        p = spawn(WRITER, str(tmp_path), "k", "1" if r % 2 == 0 else "0")
        time.sleep(rng.uniform(0.0, 0.15))
        kill9(p)
        raw = path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]
        events = read_events(tmp_path / "k")
        assert len(events) == complete.count(b"\n")  # every complete line is there
        with RunLog.open(tmp_path, "k") as log:  # the lock died with the process
            assert log.events() == events
            assert path.stat().st_size == len(complete)  # a torn tail, if any, cut off
            assert log.dropped_bytes == len(raw) - len(complete)
    events = read_events(tmp_path / "k")
    assert [e.seq for e in events] == list(range(len(events)))
    # Each writer's numbers run 0, 1, 2, ... with no gap: nothing before the kill point went missing.
    resumes = [i for i, e in enumerate(events) if e.type == "resume"]
    assert len(resumes) == rounds
    for a, b in zip(resumes, [*resumes[1:], len(events)], strict=True):
        assert [e.data["i"] for e in events[a + 1 : b]] == list(range(b - a - 1))
    assert len(events) > rounds * 2


def test_torn_and_corrupt_last_line(tmp_path: Path):
    with RunLog.create(tmp_path, "t", HEADER) as log:
        for i in range(3):
            log.append("llm", {"i": i})
    path = tmp_path / "t" / LOG
    good = path.read_bytes()
    line = json.dumps({"seq": 4, "type": "llm", "t": 1.0, "data": {"i": 3}}).encode()
    for tail in (line[: len(line) // 2], b"\0" * 40, b"{not json}\n", line[:-2] + b"\n"):
        path.write_bytes(good + tail)
        assert len(read_events(tmp_path / "t")) == 4
        with RunLog.open(tmp_path, "t") as log:
            assert log.dropped_bytes == len(tail)
            assert log.append("llm", {"i": "after"}) == 4
        events = read_events(tmp_path / "t")
        assert [e.seq for e in events] == [0, 1, 2, 3, 4] and events[-1].data == {"i": "after"}
        path.write_bytes(good)
    # A bad line in the middle is corruption, not a torn write: name the line.
    lines = good.split(b"\n")
    path.write_bytes(b"\n".join([*lines[:2], b"garbage", *lines[2:]]))
    with pytest.raises(RunLogError, match="line 3 is corrupt"):
        read_events(tmp_path / "t")
    with pytest.raises(RunLogError, match="line 3 is corrupt"):
        RunLog.open(tmp_path, "t")
    # A duplicated line breaks the seq chain.
    path.write_bytes(b"\n".join([*lines[:2], lines[1], *lines[2:]]))
    with pytest.raises(RunLogError, match=r"line 3 is corrupt.*seq 1 where 2"):
        read_events(tmp_path / "t")
    path.write_bytes(good)
    RunLog.open(tmp_path, "t").close()  # the failed opens released the lock


HOLDER = """
import sys, time
from pathlib import Path
from pipeline.runlog import RunLog
log = RunLog.open(Path(sys.argv[1]), sys.argv[2])
print("ready", flush=True)
time.sleep(600)
"""


def test_one_writer_at_a_time_and_kill9_releases_the_lock(tmp_path: Path):
    RunLog.create(tmp_path, "w", HEADER).close()
    p = spawn(HOLDER, str(tmp_path), "w")
    try:
        with pytest.raises(RunLogError, match=f"run w is being written by pid {p.pid}"):
            RunLog.open(tmp_path, "w")
        assert [r.status for r in list_runs(tmp_path)] == ["running"]
        assert len(read_events(tmp_path / "w")) == 1  # readers need no lock
    finally:
        kill9(p)
    assert [r.status for r in list_runs(tmp_path)] == ["interrupted"]
    with RunLog.open(tmp_path, "w") as log:
        # A second writer in the same process is refused too (flock is per open file).
        with pytest.raises(RunLogError, match=f"being written by pid {os.getpid()}"):
            RunLog.open(tmp_path, "w")
        log.append("llm", {"ok": True})
    assert len(read_events(tmp_path / "w")) == 2


def test_secrets_never_land_on_disk(tmp_path: Path):
    secret = "sk-test-9f8e7d6c5b4a"
    cfg = Config(llm_api_key=secret, llm_base_url="http://localhost:8000/v1")
    header = {**HEADER, "config": cfg.public(), "environment": {"OPENAI_API_KEY": secret}}
    with RunLog.create(tmp_path, "s", header, secrets=(secret, "")) as log:
        log.append(
            "llm",
            {
                "usage": {"prompt_tokens": 12, "completion_tokens": 3, "calls": 1},
                "max_tokens": 100,
                "token_count": 7,
                "key": "cand-hash-1",
                "candidate_key": "cand-hash-2",
                "error": [{"msg": f"401: bad key {secret} (Bearer {secret})"}],
                "headers": {"Authorization": "Bearer other-credential", "x-api-key": "other-2", "token": ""},
                "apiKey": "other-3",
                "password": 12345,  # not a string: left as is (counters must survive; see prompt_tokens)
            },
        )
    raw = (tmp_path / "s" / LOG).read_bytes()
    for leaked in (secret, "other-credential", "other-2", "other-3"):
        assert leaked.encode() not in raw
    data = read_events(tmp_path / "s")[1].data
    assert data["usage"]["prompt_tokens"] == 12 and data["max_tokens"] == 100 and data["token_count"] == 7
    assert data["key"] == "cand-hash-1" and data["candidate_key"] == "cand-hash-2"
    assert data["error"][0]["msg"] == "401: bad key *** (Bearer ***)"
    assert data["headers"] == {"Authorization": "***", "x-api-key": "***", "token": ""}
    start = read_events(tmp_path / "s")[0].data
    assert start["config"]["llm_api_key"] == "***" and start["config"]["max_evals"] == "40"
    assert start["config"]["llm_base_url"] == "http://localhost:8000/v1"
    assert start["environment"]["OPENAI_API_KEY"] == "***"


def test_threads_append_in_one_sequence(tmp_path: Path):
    with RunLog.create(tmp_path, "th", HEADER, fsync=False) as log:

        def work(n: int) -> None:
            for i in range(200):
                log.append("llm", {"thread": n, "i": i, "odd": "\udcff é"})

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    events = read_events(tmp_path / "th")
    assert [e.seq for e in events] == list(range(801)) and events[1:] == log.events()[1:]
    for n in range(4):
        assert [e.data["i"] for e in events if e.data.get("thread") == n] == list(range(200))
    assert events[-1].data["odd"] == "\udcff é"


def test_create_existing_and_open_missing(tmp_path: Path):
    with pytest.raises(RunLogError, match=r"no run nope under .*; runs there: none"):
        RunLog.open(tmp_path / "absent", "nope")
    RunLog.create(tmp_path, "a", HEADER).close()
    RunLog.create(tmp_path, "b", HEADER).close()
    with pytest.raises(RunLogError, match="run a already exists"):
        RunLog.create(tmp_path, "a", HEADER)
    with pytest.raises(RunLogError, match=r"no run c under .*; runs there: a, b$"):
        RunLog.open(tmp_path, "c")
    for bad in ("../a", "a/b", ".hidden", ""):
        with pytest.raises(RunLogError, match="bad run id"):
            RunLog.open(tmp_path, bad)
    with pytest.raises(RunLogError, match="cannot log"):
        RunLog.create(tmp_path, "d", {"x": {1, 2}})
    assert not (tmp_path / "d").exists()  # no headless run left behind


def test_helpers_on_a_constructed_log(tmp_path: Path):
    u = Usage(1000, 200, 0.05, 2, ("hunt(q)", "ncu"))
    with RunLog.create(tmp_path, "20260101-000000-softmax-aaaa", HEADER) as log:
        for node, key in ((1, "a"), (2, "b"), (3, "c"), (4, "d")):
            p = {"node": node, "parent": 0, "candidate": cand(key), "edit": key, "status": "ok", "usage": u}
            log.append("proposal", p)
        log.append("proposal", {"node": 5, "parent": 0, "candidate": None, "status": "unparseable"})
        log.append("proposal", {"node": 6, "parent": 1, "candidate": cand("a", "a"), "status": "ok"})
        log.append("llm", {"node": 0, "purpose": "propose", "usage": u})
        log.append("llm", {"node": 1, "purpose": "repair", "usage": Usage(10, 5, 0.001, 1)})
        log.append("result", result(1, "a", timing=T))
        log.append("result", result(2, "b", ok=False))
        log.append("closed", {"node": 4, "reason": "pruned"})
        events = log.events()
    state = fold(events)
    done = {n.key: n.evaluation for n in state.nodes.values() if n.evaluation}
    assert set(done) == {"a", "b"} and done["b"].status == Status.COMPILE_ERROR
    assert state.pending == [3, 4, 6]  # proposed with a candidate, never evaluated; 5 had no candidate
    assert state.statuses == {Status.OK: 1, Status.COMPILE_ERROR: 1}
    u = state.usage  # the "llm" events' ledger, nested under "usage" here, flat as the loop writes it
    assert (u.prompt_tokens, u.completion_tokens, u.tokens, u.calls, len(u.tool_calls)) == (
        1010,
        205,
        1215,
        3,
        2,
    )
    assert u.cost_usd == pytest.approx(0.051)
    assert [c["op"] for c in state.calls] == ["add"] * 6 + ["record", "record", "close"]
    with RunLog.create(tmp_path, "20260102-000000-gemm-bbbb", {"task": {"id": "gemm"}}) as log:
        log.append("proposal", {"node": 1, "parent": 0, "candidate": cand("x"), "edit": "x"})
        log.append("result", result(1, "x", timing=Timing(0.25, 0.25, 0.25, 0.25, 0.25, 10)))
        log.append("end", {"reason": "budget", "best_key": "x", "best_speedup_eager": 4.0})
        log.append("resume", {"resumed_at": 2})
        running = RunLog.create(tmp_path, "20260103-000000-relu-cccc", {"task": {"id": "relu"}})
        runs = list_runs(tmp_path)
        running.close()
    (tmp_path / "20260104-000000-bad-dddd").mkdir()
    (tmp_path / "20260104-000000-bad-dddd" / LOG).write_bytes(b"junk\n{}\n")
    runs = {r.run_id: r for r in runs + list_runs(tmp_path)[-1:]}
    summary = [(r.task_id, r.events, r.evaluations, r.status, r.best_speedup) for r in runs.values()]
    assert summary == [
        ("softmax", 12, 2, "interrupted", 2.0),
        ("gemm", 5, 1, "running", 4.0),  # resumed after its end, and still held
        ("relu", 1, 0, "running", None),
        ("?", 0, 0, "corrupt", None),
    ]
    assert all(r.started for r in runs.values() if r.status != "corrupt")
    assert list_runs(tmp_path / "absent") == []
