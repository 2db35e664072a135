"""The run log's typed events and their one fold: round trips through a real log, the formats older writers
left, what the fold says about the H200 recordings, and logs that do not fold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import events as ev
from pipeline.calibrate import Ceilings
from pipeline.generate.base import ProposalStatus, Usage
from pipeline.runlog import RunLog, RunLogError, read_events
from pipeline.runstate import ROOT, MalformedEvent, NotOneTree, fold, list_runs
from pipeline.types import (
    Baselines,
    Build,
    Candidate,
    Energy,
    Evaluation,
    Finding,
    Kind,
    Measurement,
    Profile,
    Status,
    Timing,
    Verdict,
)

ROOT_DIR = Path(__file__).resolve().parent.parent
RUNS = ROOT_DIR / "tests" / "fixtures" / "runs" / "softmax"
T = Timing(0.5, 0.49, 0.52, 0.48, 0.7, 100)
EAGER = Timing(1.0, 0.99, 1.02, 0.98, 1.2, 100)
COMPILE = Timing(0.8, 0.79, 0.82, 0.78, 0.9, 100)


def cand(key: str) -> Candidate:
    return Candidate(key=key, task_id="softmax", source="__global__ void k(){}", launcher="...")


def evaluation(
    key: str, status: Status = Status.OK, ms: float = 0.5, joules: float | None = None
) -> Evaluation:
    build = Build(key, Status.OK, f"/c/{key}.cubin", arch="sm_90a")
    if status != Status.OK:
        return Evaluation(key, build, Verdict(key, status, reasons=(f"{status.value}: x",)), None)
    energy = Energy(joules, 300.0, 1.5, 3) if joules else None
    timing = Timing(ms, ms, ms, ms, ms, 100)
    m = Measurement(key, status, timing, {"eager": EAGER}, energy, floor_ms=0.25, environment={"gpu": "H200"})
    return Evaluation(key, build, Verdict(key, status, 3, 3, kind=Kind.CUSTOM), m)


def a_run() -> list[ev.TypedEvent]:
    """A small run as the loop writes it: two first kernels, one child, a failure, a profile, a resume."""
    base = Baselines({"eager": EAGER, "compile": COMPILE}, 0.3, 0.25, {"compile": 30.0}, {"gpu": "H200"}, ())
    finding = Finding("coalescing", 0.8, {"sectors_per_req": 16.0}, "strided loads", "use float4", ("vec4",))
    usage = Usage(100, 50, 0.01, 1, ("hunt(query=softmax)",), 2.0)
    return [
        ev.BaselinesEvent(base),
        ev.CeilingsEvent(Ceilings("H200", 4.3e12, 5.1e13, 3.7e14, 7.2e14, {})),
        ev.Iteration(1, ROOT),
        ev.Llm(usage, ProposalStatus.OK.value),
        ev.Proposal(1, ROOT, "plain", None, cand("a"), "first kernel"),
        ev.Proposal(2, ROOT, "tuned", None, cand("b")),
        ev.Result(evaluation("a", ms=0.5), 1, 0.7, 0.5, 1.0),
        ev.Result(evaluation("b", Status.MISMATCH), 2, 0.0, None, 2.0),
        ev.LessonEvent(2, "tuned", None),
        ev.RepairFailed(2, ProposalStatus.NO_MOVE, "nothing to repair"),
        ev.Iteration(2, 1),
        ev.ProfileEvent(
            Profile(
                "a", True, "memory-bound", "memory", (finding,), "advice", seconds={"ncu": 8.9, "sass": 0.1}
            ),
            1,
        ),
        ev.ProposalFailed(ProposalStatus.UNPARSEABLE, "no code"),
        ev.Proposal(3, 1, "vec4", None, cand("c")),
        ev.Llm(Usage(10, 5, 0.001, 1), ProposalStatus.OK.value),
        ev.Interrupted(2),
        ev.Resume(9, 2.0, None, {"max_evals": 5}),
        ev.Result(evaluation("c", ms=0.25, joules=0.01), 3, 0.8, 0.25, 3.5),
        ev.Closed(1, "no room"),
        ev.Final(evaluation("c", ms=0.26, joules=0.011), 3),
        ev.End("evaluation budget spent (3)", 3, "c", 4.0, 3.2, 3, ("a note",)),
    ]


def write(tmp_path: Path, run_id: str, items: list[ev.TypedEvent]) -> list:
    start = ev.Start(run_id, {"id": "softmax", "path": "tasks/softmax.py"}, "tasks/softmax.py", {"seed": 0},
                     "expert", "mcts", "replay", ["x/log.jsonl"])  # fmt: skip
    with RunLog.create(tmp_path, run_id, ev.encode(start)[1]) as log:
        for item in items:
            log.append(*ev.encode(item))
    return read_events(tmp_path / run_id)


def test_every_event_type_round_trips_through_a_real_log(tmp_path):
    items = a_run()
    assert {type(x) for x in items} | {ev.Start} == set(ev._BY_TYPE.values())  # every type is tried
    stored = write(tmp_path, "r1", items)
    assert [ev.decode(e) for e in stored[1:]] == items
    assert ev.decode(stored[0]).run_id == "r1" and ev.decode(stored[0]).replay == ["x/log.jsonl"]


def test_the_data_on_disk_is_the_untyped_format(tmp_path):
    """New logs read in old code: records stored flat beside the event's own fields, in the same order."""
    by_type = {e.type: e.data for e in write(tmp_path, "r1", a_run())}
    assert list(by_type["result"]) == ["key", "build", "verdict", "measurement", "node", "reward", "value",
                                       "elapsed_s"]  # fmt: skip
    assert list(by_type["final"]) == ["key", "build", "verdict", "measurement", "node"]
    assert list(by_type["profile"])[-1] == "node" and by_type["profile"]["bound"] == "memory-bound"
    assert by_type["llm"]["prompt_tokens"] == 10 and by_type["llm"]["status"] == "ok"  # usage flat
    assert list(by_type["baselines"]) == ["timings", "energy_eager_j", "floor_ms", "compile_s", "environment",
                                          "notes", "energy_eager"]  # fmt: skip
    assert by_type["proposal"]["candidate"]["key"] == "c" and by_type["repair_failed"]["status"] == "no_move"


def test_formats_older_writers_left_still_decode(tmp_path):
    older = [
        ("llm", {"usage": {"prompt_tokens": 7, "completion_tokens": 3, "calls": 2}, "purpose": "propose"}),
        ("end", {"reason": "budget", "summary": {"best_speedup": 2.5}}),
        ("ceilings", {"gpu": "H100", "copy_bytes_per_s": 3e12}),  # another shape: plotted without
        ("lesson", {"task_features": "softmax", "edit": "vec4", "outcome": "2x"}),
        ("build", {"candidate_key": "a"}),  # a type this code never writes: skipped
    ]
    with RunLog.create(tmp_path, "old", {"task": {"id": "softmax"}}) as log:
        for t, d in older:
            log.append(t, d)
    llm, end, ceilings, lesson, build = [ev.decode(e) for e in read_events(tmp_path / "old")[1:]]
    assert llm == ev.Llm(Usage(7, 3, calls=2)) and end.best_speedup_eager == 2.5
    assert ceilings == ev.CeilingsEvent(None) and lesson.edit == "vec4" and build is None
    state = fold(read_events(tmp_path / "old"))
    assert state.usage.tokens == 10 and state.best_speedup == 2.5 and state.events == 6


def test_the_fold_of_a_run(tmp_path):
    state = fold(write(tmp_path, "r1", a_run()))
    assert state.header.task_id == "softmax" and state.baselines and state.baselines.floor_ms == 0.25
    assert state.ceilings and state.ceilings.gpu == "H200"
    assert state.evaluations == 3 and state.statuses == {Status.OK: 2, Status.MISMATCH: 1}
    assert [(p.n, p.node, p.status, p.speedup) for p in state.points] == [
        (1, 1, Status.OK, 2.0), (2, 2, Status.MISMATCH, None), (3, 3, Status.OK, 4.0)
    ]  # fmt: skip
    assert state.curve == [(1, 2.0), (2, 2.0), (3, 4.0)]
    assert state.points[2].energy_j == 0.01 and state.pending == []
    assert state.nodes[ROOT].children == [1, 2] and state.nodes[1].children == [3]
    assert state.nodes[1].top_finding == "[coalescing] strided loads" and state.nodes[2].repair_done
    assert (
        state.nodes[ROOT].speedup == 1.0 and state.nodes[2].speedup is None and state.nodes[2].time_ms is None
    )
    assert state.usage == Usage(110, 55, 0.011, 2, ("hunt(query=softmax)",), 2.0)
    assert state.iteration == 2 and state.elapsed_s == 3.5 and state.interrupted == 1
    assert state.budgets == {"max_evals": 5} and state.finished and state.best_speedup == 4.0
    assert state.final and state.final.node == 3 and state.end and state.end.best_key == "c"
    # The search's calls, in log order: what a resume replays.
    ops = [(c["op"], c["node"]) for c in state.calls]
    assert ops == [
        ("add", 1),
        ("add", 2),
        ("record", 1),
        ("record", 2),
        ("add", 3),
        ("record", 3),
        ("close", 1),
    ]


def test_a_run_resumed_after_its_end_is_not_finished(tmp_path):
    items = [*a_run(), ev.Resume(22, 3.5, 2, {})]
    state = fold(write(tmp_path, "r1", items))
    assert not state.finished and state.end is None and state.last_end is not None
    assert state.best_speedup == 4.0  # the last end's word stands until the run ends again


@pytest.mark.parametrize("name", sorted(p.parent.name for p in RUNS.glob("*/log.jsonl")))
def test_the_fold_of_the_h200_recordings(name):
    events = read_events(RUNS / name)
    state = fold(events)
    end = next(e.data for e in reversed(events) if e.type == "end")
    results = [e for e in events if e.type == "result"]
    assert state.finished and state.evaluations == len(results) == end["evaluations"]
    assert state.best_speedup == end["best_speedup_eager"]
    assert state.nodes[end["best_node"]].key == end["best_key"]
    assert max(p.speedup or 0 for p in state.points) == pytest.approx(end["best_speedup_eager"])
    assert sum(state.statuses.values()) == len(results) and state.events == len(events)


def with_event(tmp_path: Path, t: str, data: dict) -> list:
    with RunLog.create(tmp_path, "bad", {"task": {"id": "softmax"}}) as log:
        log.append(
            "proposal", {"node": 1, "parent": 0, "candidate": json.loads(json.dumps(cand("a").__dict__))}
        )
        log.append(t, data)
    return read_events(tmp_path / "bad")


@pytest.mark.parametrize(
    ("t", "data", "error", "why"),
    [
        (
            "proposal",
            {"node": 2, "parent": 7},
            NotOneTree,
            "proposes node 2 under node 7, which does not exist",
        ),
        ("proposal", {"node": 1, "parent": 0}, NotOneTree, "proposes node 1 a second time"),
        ("profile", {"node": 42, "key": "a"}, NotOneTree, "names node 42, which no proposal made"),
        ("end", {"reason": "x", "best_node": 9}, NotOneTree, "names node 9 as the best"),
        ("result", {"node": 1, "key": "a"}, MalformedEvent, r"event 2 \(result\): TypeError"),  # no verdict
        (
            "repair_failed",
            {"node": 1, "status": "great"},
            MalformedEvent,
            r"event 2 \(repair_failed\): ValueError",
        ),
    ],
)
def test_what_does_not_fold_says_why_in_one_line(tmp_path, t, data, error, why):
    with pytest.raises(error, match=why) as caught:
        fold(with_event(tmp_path, t, data))
    assert isinstance(caught.value, RunLogError) and "\n" not in str(caught.value)


def test_the_run_list_folds_each_run(tmp_path):
    write(tmp_path, "20260101-000000-softmax-aaaa", a_run())
    write(tmp_path, "20260102-000000-softmax-bbbb", a_run()[:7])  # killed after its first result
    (tmp_path / "20260103-000000-broken-cccc").mkdir()
    lines = [json.dumps({"seq": e.seq, "type": e.type, "t": e.t, "data": e.data}) for e in
             with_event(tmp_path / "x", "profile", {"node": 42, "key": "a"})]  # fmt: skip
    (tmp_path / "20260103-000000-broken-cccc" / "log.jsonl").write_text("\n".join(lines) + "\n")
    runs = [(r.task_id, r.events, r.evaluations, r.status, r.best_speedup) for r in list_runs(tmp_path)]
    assert runs == [
        ("softmax", 22, 3, "finished", 4.0),
        ("softmax", 8, 1, "interrupted", 2.0),
        ("softmax", 3, 0, "corrupt", None),
    ]
