"""Energy at matched speed (pipeline/search/matched.py, reward_at_speed): the speed bound, the noise rule,
the run's choice under energy and edp, the Pareto front; on hand-made measurements, then on the H200
recordings (tests/fixtures/runs/) replayed through the real loop with energies put into their results."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipeline import config
from pipeline.loop import optimize
from pipeline.runlog import read_events
from pipeline.runstate import fold
from pipeline.search import matched
from pipeline.search.matched import Candidate, choose, compare, pareto_front, saving, within_noise
from pipeline.search.reward import Objective, reward, reward_at_speed
from pipeline.types import Status

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "tests" / "fixtures" / "runs" / "softmax"


# -- the reward at speed ----------------------------------------------------------------------------------


def test_energy_credit_only_within_the_speed_bound():
    # Eager 1 ms and 1 J; the fastest so far 0.5 ms. A frugal candidate (0.2 J) at 0.51 ms is at speed;
    # the same energy at 0.6 ms (20% slower than the fastest) earns what its speed earns, no more.
    at = reward_at_speed(Status.OK, 0.51, 0.2, 1.0, 1.0, "energy", 0.5, 0.02)
    slow = reward_at_speed(Status.OK, 0.6, 0.2, 1.0, 1.0, "energy", 0.5, 0.02)
    assert at == reward(Status.OK, 0.2, 1.0, "energy")
    assert slow == reward(Status.OK, 0.6, 1.0, "time") < at
    # A wider tolerance takes it back in; the bound is inclusive.
    assert reward_at_speed(Status.OK, 0.6, 0.2, 1.0, 1.0, "energy", 0.5, 0.25) == at
    assert reward_at_speed(Status.OK, 0.51, 0.2, 1.0, 1.0, "energy", 0.5, 0.02) == at
    # Slow and energy-hungry: capped by the objective's own reward, never raised to the time reward.
    hungry = reward_at_speed(Status.OK, 0.6, 3.0, 1.0, 1.0, "energy", 0.5, 0.02)
    assert hungry == reward(Status.OK, 3.0, 1.0, "energy") < reward(Status.OK, 0.6, 1.0, "time")
    # Slower than eager (the reference counts as the fastest): going slow to save power earns < 0.5.
    assert reward_at_speed(Status.OK, 2.0, 0.3, 1.0, 1.0, "energy", 1.0, 0.02) < 0.5
    # EDP follows the same rule; time is untouched by it; a failure stays 0.
    edp_slow = reward_at_speed(Status.OK, 0.6, 0.2, 1.0, 1.0, "edp", 0.5, 0.02)
    assert edp_slow == min(reward(Status.OK, 0.12, 1.0, "edp"), reward(Status.OK, 0.6, 1.0, "time"))
    assert reward_at_speed(Status.OK, 0.6, 0.2, 1.0, 1.0, "time", 0.5, 0.02) == reward(Status.OK, 0.6, 1.0)
    assert reward_at_speed(Status.MISMATCH, 0.5, 0.2, 1.0, 1.0, "energy", 0.5, 0.02) == 0.0
    assert reward_at_speed(Status.OK, 0.5, None, 1.0, 1.0, "energy", 0.5, 0.02) == 0.0  # no reading


# -- noise ------------------------------------------------------------------------------------------------


def test_noise_rule():
    # 1% spreads (the floor): 2 * sqrt(2) * 1% ~ 2.8% apart is needed to rank two energies.
    assert within_noise(1.0, 0.01, 1.02, 0.01)
    assert not within_noise(1.0, 0.01, 1.04, 0.01)
    # A spread below the floor counts as the floor; unknown counts as the floor; a wider one widens.
    assert within_noise(1.0, 0.0, 1.02, None)
    assert not within_noise(1.0, 0.001, 1.04, 0.001)
    assert within_noise(1.0, 0.05, 1.10, 0.01)
    assert within_noise(1.0, float("nan"), 1.02, 0.01)  # a broken spread is not zero noise


def test_compare_ranks_beyond_noise_and_breaks_ties_by_time():
    fast = Candidate(1, 1.00, 0.50, 0.005)
    frugal = Candidate(2, 1.01, 0.40, 0.005)  # 20% less: beyond noise
    close = Candidate(3, 0.99, 0.505, 0.005)  # 1% more than fast: within noise, and faster
    unread = Candidate(4, 0.50, None, None)
    assert compare(frugal, fast) == -1 and compare(fast, frugal) == 1
    assert compare(close, fast) == -1 and compare(fast, close) == 1  # a tie on energy: the faster wins
    assert compare(fast, unread) == -1 and compare(unread, fast) == 1  # no reading loses, however fast
    assert compare(fast, fast) == 0
    assert compare(frugal, fast, "time") == 1  # under time only the time counts
    # EDP: 0.40 J * 1.01 ms against 0.50 J * 1.00 ms.
    assert compare(frugal, fast, Objective.EDP) == -1


# -- the choice -----------------------------------------------------------------------------------------


def test_choose_lowest_energy_at_matched_speed():
    cands = [
        Candidate(1, 1.000, 0.50, 0.005),  # the fastest
        Candidate(2, 1.015, 0.42, 0.005),  # 1.5% slower, 16% less energy: the choice
        Candidate(3, 1.030, 0.30, 0.005),  # 3% slower: out of bound, however frugal
        Candidate(4, 1.010, 0.43, 0.005),  # within noise of #2 and faster: wins the tie
    ]
    assert choose(cands, "energy").node == 4  # type: ignore[union-attr]
    assert choose(cands[:3], "energy").node == 2  # type: ignore[union-attr]
    assert choose(cands[:3], "energy", tolerance=0.05).node == 3  # type: ignore[union-attr]
    assert choose(cands, "time").node == 1  # type: ignore[union-attr]
    # The reference is faster than every candidate beyond the bound: nothing at speed, the caller decides.
    assert choose(cands, "energy", reference_ms=0.5) is None
    # A reference at 0.995 ms narrows the bound to 1.0149 ms: #2 (1.015) drops out, #4 is the lowest left.
    assert choose(cands, "energy", reference_ms=0.995).node == 4  # type: ignore[union-attr]
    assert choose(cands[:3], "energy", reference_ms=0.995).node == 1  # type: ignore[union-attr]
    # Readings missing: only those with one are chosen; none at all gives None.
    assert choose([Candidate(1, 1.0), Candidate(2, 1.01, 0.4, None)], "energy").node == 2  # type: ignore[union-attr]
    assert choose([Candidate(1, 1.0)], "energy") is None
    assert choose([], "energy") is None


def test_choose_edp_and_chains_of_ties_are_settled_against_the_lowest():
    # A chain: a ~ b and b ~ c within noise, but a and c apart: the tie set is the lowest's, so c is out.
    a, b, c = (
        Candidate(1, 1.01, 1.000, 0.005),
        Candidate(2, 1.00, 1.025, 0.005),
        Candidate(3, 0.999, 1.05, 0.005),
    )
    assert within_noise(a.joules, a.spread, b.joules, b.spread) and within_noise(
        b.joules, b.spread, 1.05, 0.005
    )  # type: ignore[arg-type]
    assert not within_noise(1.0, 0.005, 1.05, 0.005)
    assert choose([a, b, c], "energy").node == 2  # type: ignore[union-attr]
    # 3.75% less energy is beyond the noise, but at 1.9% slower the EDP is only 1.9% lower: within it.
    x, y = Candidate(1, 1.0, 0.40, 0.004), Candidate(2, 1.019, 0.385, 0.004)
    assert choose([x, y], "energy").node == 2  # type: ignore[union-attr]
    assert choose([x, y], "edp").node == 1  # type: ignore[union-attr]


def test_pareto_front():
    pts = [
        Candidate(1, 1.0, 0.50),
        Candidate(2, 1.2, 0.40),
        Candidate(3, 1.1, 0.55),  # dominated by #1 (slower and hungrier)
        Candidate(4, 1.5, 0.40),  # dominated by #2 (same energy, slower)
        Candidate(5, 2.0, 0.10),
        Candidate(6, 0.9, None),  # no reading: not on the front
        Candidate(7, 1.0, 0.50),  # the same point as #1: neither beats the other
    ]
    assert [c.node for c in pareto_front(pts)] == [1, 7, 2, 5]
    assert pareto_front([]) == [] and pareto_front([Candidate(1, 1.0)]) == []
    # Every point off the front is dominated by one on it; none on it is dominated by any.
    front = pareto_front(pts)

    def dominates(p: Candidate, q: Candidate) -> bool:
        assert p.joules is not None and q.joules is not None
        return (
            p.time_ms <= q.time_ms and p.joules <= q.joules and (p.time_ms, p.joules) != (q.time_ms, q.joules)
        )

    read = [p for p in pts if p.joules is not None]
    assert all(any(dominates(f, p) for f in front) for p in read if p not in front)
    assert not any(dominates(p, f) for f in front for p in read)


def test_saving_with_spread():
    s = saving(1.5, 0.003, 1.0, 0.004)
    assert s.ratio == 1.5 and s.spread == pytest.approx(0.005) and s.beyond_noise
    assert saving(1.0, 0.01, 0.99, 0.01).beyond_noise is False
    assert saving(1.0, None, 0.5, 0.01).spread is None


# -- replayed: the H200 recordings, with energies put into their results ----------------------------------


def _with_energy(tmp: Path, joules: dict[str, float], spread: float = 0.004) -> list[Path]:
    """Copies of the recordings whose verified results carry an energy per call (by candidate key; the
    others draw 700 W, the H200's power cap, for their measured time)."""
    out = []
    for rec in sorted(RUNS.glob("*/log.jsonl")):
        lines = []
        for line in rec.read_text().splitlines():
            e = json.loads(line)
            m = e["data"].get("measurement") if e["type"] == "result" else None
            if m and m.get("timing"):
                ms = m["timing"]["median_ms"]
                j = joules.get(e["data"]["key"], 700.0 * ms * 1e-3)
                m["energy"] = {"joules_per_call": j, "avg_power_w": j / (ms * 1e-3), "window_s": 1.5,
                               "repeats": 3, "spread": spread, "windows": [j, j, j]}  # fmt: skip
            lines.append(json.dumps(e))
        folder = tmp / "rec" / rec.parent.name
        folder.mkdir(parents=True)
        (folder / "log.jsonl").write_text("\n".join(lines) + "\n")
        out.append(folder / "log.jsonl")
    return out


FASTEST = "6b85b583e1494304"  # 0.1342 ms (threads=128)
NEAR = "a0e8a8ce7702e051"  # 0.1350-0.1356 ms (the tuned plan): 0.6-1.0% slower than the fastest
SLOW = "d659af63d6dec002"  # 0.2750 ms (the plain plan), slower than eager


def _run(tmp: Path, recordings: list[Path], **kw):
    kw.setdefault("max_evals", 10)
    cfg = config.load(runs_dir=tmp / "runs", home=tmp / "home", memory=False, policy="expert", **kw)
    r = optimize(ROOT / "tasks" / "softmax.py", cfg, replay=recordings)
    return r, fold(read_events(r.folder / "log.jsonl"))


def test_replayed_run_under_energy_chooses_at_matched_speed(tmp_path):
    # The slowest candidate reads as frugal (a third of the fastest's energy), the near one 10% below it.
    recs = _with_energy(tmp_path, {SLOW: 0.03, NEAR: 0.084})
    r, state = _run(tmp_path / "a", recs, objective="energy")
    nodes = {n.key: n for n in state.nodes.values() if n.evaluation and n.time_ms}
    assert {FASTEST, NEAR, SLOW} <= set(nodes), sorted(nodes)
    # Default 2%: the near candidate is at speed and 10% lower: chosen; the slow one is far out of bound.
    assert r.best_key == NEAR and state.end is not None and state.end.best_node == nodes[NEAR].id
    # The slow one got no energy credit: its reward is what its speed earns (it is slower than eager).
    slow = nodes[SLOW]
    m = slow.evaluation.measurement if slow.evaluation else None
    assert m is not None and slow.reward is not None and slow.reward < 0.5
    assert slow.reward == reward(Status.OK, slow.time_ms, m.baselines["eager"].median_ms, "time")
    assert slow.reward < reward(Status.OK, 0.03, state.baselines.energy_eager_j, "energy")  # type: ignore[union-attr]
    # 0.2%: the near candidate is just out of bound: the fastest is chosen.
    r3, _ = _run(tmp_path / "b", recs, objective="energy", speed_tolerance=0.002)
    assert r3.best_key == FASTEST
    # Only 1% lower: within noise, and the fastest wins the tie.
    r4, _ = _run(tmp_path / "c", _with_energy(tmp_path / "x", {NEAR: 0.0928}), objective="energy")
    assert r4.best_key == FASTEST
    # Under time the rule changes nothing: the recorded winner.
    rt, _ = _run(tmp_path / "d", recs, objective="time")
    assert rt.best_key == FASTEST


def test_the_loop_and_the_report_agree_with_choose(tmp_path):
    recs = _with_energy(tmp_path, {NEAR: 0.084})
    r, state = _run(tmp_path / "a", recs, objective="edp", speed_tolerance=0.03)
    eager = state.baselines.timings["eager"].median_ms  # type: ignore[union-attr]
    pick = matched.choose(state.at_speed(), "edp", eager, 0.03)
    assert pick is not None and state.end is not None and state.end.best_node == pick.node
    assert math.isclose(pick.time_ms, state.nodes[pick.node].time_ms or 0.0)
    assert pick.node == next(n.id for n in state.nodes.values() if n.key == NEAR)  # 10% less energy, at speed
    assert f"- chosen: node #{pick.node} `{NEAR}`" in (r.folder / "report.md").read_text()


def test_a_resumed_run_keeps_its_speed_tolerance(tmp_path):
    recs = _with_energy(tmp_path, {SLOW: 0.03, NEAR: 0.084})
    first, _ = _run(tmp_path, recs, objective="energy", speed_tolerance=0.03, max_evals=4)
    # Resumed with a tolerance under which the slow, frugal candidate would be at speed: the run's own wins.
    cfg = config.load(runs_dir=tmp_path / "runs", home=tmp_path / "home", memory=False, policy="expert",
                      objective="energy", speed_tolerance=2.0)  # fmt: skip
    r = optimize(Path(""), cfg, resume=first.run_id, more=6)
    state = fold(read_events(r.folder / "log.jsonl"))
    assert {SLOW, NEAR} <= {n.key for n in state.nodes.values() if n.time_ms}
    assert r.best_key == NEAR


# -- replayed: an energy run recorded on the H200 as it was (no energies put in) ---------------------------

ENERGY_RUN = (
    ROOT / "tests" / "fixtures" / "energy" / "elementwise_chain" / "log.jsonl"
)  # 2026-12-03b, 8 evals


def test_a_real_energy_run_replays_to_its_recorded_choice_and_front(tmp_path):
    """The recording: `bench_optimize.py --tasks elementwise_chain --evals 8` under objective energy (its
    float-only build, 2026-12-03 afternoon). The power edits (a persistent grid on 75% or 50% of the SMs)
    were made first: they ran 4% and 16% slower than the fastest plan and used 1.5% and 11% more energy, so
    they are off the time-energy front; the choice is the fastest plan (two vectors in flight a thread,
    0.133 ms, 98.6 mJ a call), as recorded."""
    recorded = fold(read_events(ENERGY_RUN))
    assert recorded.end is not None and recorded.end.best_key
    cfg = config.load(runs_dir=tmp_path / "runs", home=tmp_path / "home", memory=False, policy="expert",
                      objective="energy", max_evals=8, corpus="none")  # fmt: skip
    r = optimize(ROOT / "tasks" / "elementwise_chain.py", cfg, replay=[ENERGY_RUN])
    state = fold(read_events(r.folder / "log.jsonl"))
    assert [n.key for n in state.nodes.values()] == [n.key for n in recorded.nodes.values()]
    assert r.best_key == recorded.end.best_key
    front = pareto_front(_all(state))
    on_front = {state.nodes[c.node].key for c in front}
    assert recorded.end.best_key in on_front and len(on_front) < len(_all(state))
    fastest = min(c.time_ms for c in _all(state))
    best = next(n for n in state.nodes.values() if n.key == r.best_key)
    assert best.time_ms is not None and best.time_ms <= 1.02 * fastest  # matched speed
    power = [n for n in state.nodes.values() if n.edit and "lower_power" in n.edit]
    assert len(power) == 2 and all(n.time_ms > 1.02 * fastest for n in power)  # too slow to be chosen
    assert not any(n.key in on_front for n in power)  # and, in this recording, not frugal either


def _all(state) -> list[Candidate]:
    out = []
    for n in state.nodes.values():
        m = n.evaluation.measurement if n.evaluation else None
        e = m.energy if m else None
        if n.time_ms is not None and e is not None:
            out.append(Candidate(n.id, n.time_ms, e.joules_per_call, e.spread))
    return out
