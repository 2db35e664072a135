"""pipeline/search: reward calibration, MCTS and the greedy baseline, driven by synthetic landscapes (no GPU).

A synthetic landscape stands in for the GPU: a deterministic function from a candidate key (the path of
edits from the reference, "a/p2/p1") to (status, reward), and a move list per key standing in for the
policy. `drive` plays the loop's part: select, propose up to room() untried edits, add them all, then record
each in id order, until the evaluation budget is spent.
"""

from __future__ import annotations

import itertools
import json
import math
import zlib
from collections.abc import Callable

import pytest

from pipeline.config import Config
from pipeline.search import MCTS, Greedy, Objective, make_search, objective_value, reward
from pipeline.search.reward import FLOOR, SCALE
from pipeline.search.tree import SearchTree
from pipeline.types import Status, speedup

Outcome = tuple[Status, float]  # (status, reward)

# ---------------------------------------------------------------------------------------------------------
# reward


def test_reward_orders_failure_below_slower_below_equal_below_faster():
    fail = [reward(s, 1.0, 1.0) for s in Status if s is not Status.OK]
    assert fail == [0.0] * (len(Status) - 1)
    slower10, slower2 = reward(Status.OK, 10.0, 1.0), reward(Status.OK, 2.0, 1.0)
    equal = reward(Status.OK, 1.0, 1.0)
    faster2, faster8 = reward(Status.OK, 0.5, 1.0), reward(Status.OK, 0.125, 1.0)
    assert 0.0 < FLOOR < slower10 < slower2 < equal == 0.5 < faster2 < faster8 < 1.0
    assert slower10 > 0.05  # a correct 10x-slower kernel is still well clear of a failure
    assert faster8 == pytest.approx(0.5 + 0.5 * math.tanh(1.0))  # S = 8: 8x maps to 0.88
    assert reward(Status("ok"), 1.0, 1.0) == 0.5  # a status read back from a log


def test_reward_is_monotone_and_bounded_over_extreme_ratios():
    speedups = [10.0**k for k in range(-12, 13)] + [1.01, 1.5, 3.0, 0.99, 0.7]
    speedups.sort()
    for obj in Objective:
        rs = [reward(Status.OK, 1.0 / s, 1.0, obj) for s in speedups]
        assert all(a <= b for a, b in itertools.pairwise(rs)), obj
        # strictly increasing while the ratio is inside the clip (1e-6 .. 1e6)
        inside = [r for s, r in zip(speedups, rs, strict=True) if 1e-6 <= s <= 1e6]
        assert all(a < b for a, b in itertools.pairwise(inside)), obj
        assert all(FLOOR < r < 1.0 for r in rs), obj
        assert all(r < 0.5 for s, r in zip(speedups, rs, strict=True) if s < 1)
        assert all(r > 0.5 for s, r in zip(speedups, rs, strict=True) if s > 1)


def test_reward_without_a_usable_figure():
    assert reward(Status.OK, None, 1.0) == 0.0  # ok but nothing measured
    assert reward(Status.OK, 0.0, 1.0) == 0.0  # a zero time is a broken measurement, not an infinite speedup
    assert reward(Status.OK, float("nan"), 1.0) == 0.0
    assert reward(Status.OK, 1.0, None) == 0.5  # correct, baseline unknown: no evidence either way
    assert reward(Status.MISMATCH, 0.1, None) == 0.0


def test_objectives():
    assert objective_value("time", 2.0, 3.0) == 2.0
    assert objective_value(Objective.ENERGY, 2.0, 3.0) == 3.0
    assert objective_value("edp", 2.0, 3.0) == 6.0
    assert objective_value("energy", 2.0, None) is None
    assert objective_value("edp", None, 3.0) is None
    with pytest.raises(ValueError):
        objective_value("power", 1.0, 1.0)
    # Twice as fast at the same power: EDP improves 4x, and S_edp = S_time^2 gives it the same reward.
    assert SCALE[Objective.EDP] == SCALE[Objective.TIME] ** 2
    base = objective_value("edp", 2.0, 2.0)
    fast = objective_value("edp", 1.0, 1.0)
    assert reward(Status.OK, fast, base, "edp") == pytest.approx(reward(Status.OK, 1.0, 2.0, "time"))
    # Same joules and ms under energy and time give the same reward (same S).
    assert reward(Status.OK, 0.5, 1.0, "energy") == reward(Status.OK, 0.5, 1.0, "time")


def test_speedup():  # pipeline.types.speedup(baseline, ours): the one definition, used by the search too
    assert speedup(2.0, 0.5) == 4.0
    assert speedup(2.0, None) is None and speedup(None, 2.0) is None
    assert speedup(0.0, 1.0) is None and speedup(1.0, 0.0) is None
    assert (
        speedup(1.0, -1.0) is None
        and speedup(float("inf"), 1.0) is None
        and speedup(1.0, float("nan")) is None
    )


# ---------------------------------------------------------------------------------------------------------
# synthetic landscapes and the driver


def child_key(parent_key: str, edit: str) -> str:
    return f"{parent_key}/{edit}" if parent_key else edit


def _plateau(start: float, cap: float, path: list[str]) -> Outcome:
    """Edits p0..p7: every fourth one fails; the others climb by 0.004-0.016 until `cap`, where the line
    stops improving."""
    r = start
    for e in path:
        i = int(e[1:])
        if i % 4 == 3:
            return Status.MISMATCH, 0.0
        r = min(cap, r + 0.004 * (i % 4 + 1))
    return Status.OK, r


DECEPTIVE_ROOT = {
    "a": (Status.OK, 0.70),  # the trap: best first kernel, tops out at 0.72 however deep one climbs
    "x": (Status.COMPILE_ERROR, 0.0),
    "d": (Status.OK, 0.55),  # a second, lower plateau (0.58)
    "b": (Status.OK, 0.40),  # slower than the reference, yet the way to the optimum
    "y": (Status.MISMATCH, 0.0),
    "z": (Status.OK, 0.45),
}
DECEPTIVE_B = {
    "q0": (Status.OK, 0.45),
    "q1": (Status.COMPILE_ERROR, 0.0),
    "q2": (Status.OK, 0.41),
    "q3": (Status.OK, 0.43),
}


def deceptive_landscape(key: str) -> Outcome:
    """Synthetic landscape with a deceptive local optimum: "a" looks best early and plateaus at 0.72; the
    optimum (0.90..0.97) lies two steps down "b" -> "b/q0", both worse than the reference (0.40, 0.45)."""
    head, *rest = key.split("/")
    if not rest:
        return DECEPTIVE_ROOT[head]
    if head == "a":
        return _plateau(0.70, 0.72, rest)
    if head == "d":
        return _plateau(0.55, 0.58, rest)
    if head == "z":
        return _plateau(0.45, 0.47, rest)
    if len(rest) == 1:
        return DECEPTIVE_B[rest[0]]
    if rest[0] == "q0":
        return _plateau(0.90, 0.97, rest[1:])
    return _plateau(0.41, 0.44, rest[1:])


def deceptive_moves(key: str) -> list[str]:
    if key == "":
        return list(DECEPTIVE_ROOT)
    if key == "b":
        return list(DECEPTIVE_B)
    return [f"p{i}" for i in range(8)]


def hashed_landscape(key: str) -> Outcome:
    """Synthetic landscape without ties: a fifth of the keys fail, the rest get a reward from their CRC."""
    h = zlib.crc32(key.encode())
    if h % 5 == 0:
        return Status.COMPILE_ERROR, 0.0
    return Status.OK, 0.3 + 0.6 * (h / 2**32)


def tied_landscape(key: str) -> Outcome:
    """Synthetic landscape where every candidate scores the same: only tie-breaks tell moves apart."""
    return Status.OK, 0.6


def many_moves(key: str) -> list[str]:
    return [f"m{i}" for i in range(40)]


class Recorder:
    """Wraps a search and logs every mutating call as a JSON line, as the run log would."""

    def __init__(self, search: SearchTree, log: list[str]):
        self.search, self.log = search, log

    def add_child(self, parent: int, key: str, edit: str) -> int:
        self.log.append(json.dumps({"op": "add", "parent": parent, "key": key, "edit": edit}))
        return self.search.add_child(parent, key, edit)

    def record(self, node: int, status: Status, r: float) -> None:
        self.log.append(json.dumps({"op": "record", "node": node, "status": status, "reward": r}))
        self.search.record(node, status, r)

    def close(self, node: int, reason: str) -> None:
        self.log.append(json.dumps({"op": "close", "node": node, "reason": reason}))
        self.search.close(node, reason)


def drive(
    search: SearchTree,
    landscape: Callable[[str], Outcome],
    moves: Callable[[str], list[str]],
    budget: int,
    per_expand: int = 4,
    log: list[str] | None = None,
    check: Callable[[SearchTree, int], None] | None = None,
) -> tuple[int, list[int]]:
    """Play the loop until `budget` evaluations; returns (evaluations, select() answers)."""
    mut = Recorder(search, log) if log is not None else search
    evals, picks = 0, []
    while evals < budget:
        node = search.select()
        if node is None:
            break
        picks.append(node)
        assert search.select() == node  # select() has no side effects
        key = search.node(node).candidate_key
        tried = search.tried_edits(node)
        room = search.room(node)
        assert room >= 1  # select only answers nodes that may take a child
        edits = [m for m in moves(key) if m not in tried][: min(room, per_expand, budget - evals)]
        if not edits:
            mut.close(node, "no move")
            continue
        if check is not None:
            check(search, node)
        ids = [mut.add_child(node, child_key(key, e), e) for e in edits]
        assert ids == list(range(ids[0], ids[0] + len(ids)))  # sequential ids
        for i in ids:
            status, r = landscape(search.node(i).candidate_key)
            mut.record(i, status, r)
        evals += len(ids)
    return evals, picks


def best_reward(search: SearchTree) -> float:
    b = search.best()
    assert b is not None
    return search.reward(b)  # type: ignore[return-value]


def mcts_cap(s: MCTS, node: int) -> int:
    """The widening cap, computed here independently of MCTS._cap."""
    boost = s.root_boost if node == 0 else 1.0
    if s.best() is not None and node in s.path(s.best()):  # type: ignore[arg-type]
        boost = max(boost, s.best_boost)
    visits = s.node(node).visits
    return math.ceil(s.widen_c * max(1, visits) ** s.widen_alpha * boost - 1e-9)


def check_mcts_widening(s: SearchTree, node: int) -> None:
    """Before an expansion: room() is exactly the cap minus the children the node already has."""
    assert isinstance(s, MCTS)
    assert s.room(node) == mcts_cap(s, node) - len(s.children(node)) > 0


# ---------------------------------------------------------------------------------------------------------
# progressive widening


def test_widening_caps_and_boosts():
    s = MCTS(seed=0)
    assert s.room(0) == 4  # ceil(2 * 1**0.5 * root_boost 2)
    kids = [s.add_child(0, f"k{i}", f"e{i}") for i in range(4)]
    assert s.room(0) == 0 and s.select() is None  # pending children count, and are never selected
    for k, r in zip(kids, (0.6, 0.7, 0.0, 0.55), strict=True):
        s.record(k, Status.OK if r else Status.COMPILE_ERROR, r)
    assert s.best() == kids[1]
    assert s.room(0) == 4  # 4 visits: ceil(2 * 2 * 2) = 8 places, 4 used
    assert s.room(kids[0]) == 2  # ceil(2 * 1): a side branch
    assert s.room(kids[1]) == 3  # ceil(2 * 1 * best_boost 1.5): the best node
    assert s.room(kids[2]) == 0  # failed: never expanded by select
    # Fill the root: descent now goes to the best child (its UCT is highest with equal visits).
    for i in range(4, 8):
        s.record(s.add_child(0, f"k{i}", f"e{i}"), Status.COMPILE_ERROR, 0.0)
    assert s.room(0) == math.ceil(2 * 8**0.5 * 2) - 8 == 4
    s2 = MCTS(seed=0, root_boost=1.0, best_boost=1.0)
    assert s2.room(0) == 2


def test_widening_bound_holds_through_a_search():
    s = MCTS(seed=3)
    drive(s, hashed_landscape, many_moves, budget=120, check=check_mcts_widening)
    top = max(s.root_boost, s.best_boost)
    for n in s.nodes():
        assert len(n.children) <= math.ceil(s.widen_c * max(1, n.visits) ** s.widen_alpha * top - 1e-9)
        if n.id != 0:
            # visits = own evaluation + every recorded descendant
            assert n.visits == 1 + sum(s.node(c).visits for c in n.children)
    # asymmetric branching: the root and the best line are wider than the typical node
    widths = [len(n.children) for n in s.nodes() if n.id not in s.path(s.best())]  # type: ignore[arg-type]
    assert len(s.children(0)) > max(widths)


# ---------------------------------------------------------------------------------------------------------
# pruning and closing


def _tree_with_two_kernels() -> tuple[MCTS, int, int]:
    s = MCTS(seed=0)
    x, y = s.add_child(0, "x", "ex"), s.add_child(0, "y", "ey")
    s.record(x, Status.OK, 0.6)
    s.record(y, Status.OK, 0.5)
    return s, x, y


def test_dead_end_is_pruned_with_its_subtree():
    s, x, _ = _tree_with_two_kernels()
    keep = s.add_child(x, "x1", "e1")
    s.record(keep, Status.OK, 0.55)  # did not improve on 0.6: count 1
    for i, st in enumerate((Status.COMPILE_ERROR, Status.MISMATCH)):
        assert not s.node(x).pruned
        s.record(s.add_child(x, f"x{i + 2}", f"e{i + 2}"), st, 0.0)
    assert s.node(x).pruned and "pruned" in s.closed(x)  # type: ignore[operator]
    assert s.room(x) == 0 and s.room(keep) == 0  # the whole subtree is closed
    sub = {x, *s.children(x)}
    _, picks = drive(s, hashed_landscape, many_moves, budget=40)
    assert picks and not sub & set(picks)
    assert s.best() is not None and s.reward(x) == 0.6  # a pruned node keeps its result


def test_improvement_resets_the_dead_end_count():
    s, x, _ = _tree_with_two_kernels()
    for st, r in (
        (Status.CRASH, 0.0),
        (Status.TIMEOUT, 0.0),
        (Status.OK, 0.7),
        (Status.OK, 0.6),
        (Status.MISMATCH, 0.0),
    ):
        s.record(s.add_child(x, f"k{r}{st}", st), st, r)
    assert not s.node(x).pruned  # 0.7 beat 0.6, so only the last two count
    s.record(s.add_child(x, "k-last", "e"), Status.LAUNCH_ERROR, 0.0)
    assert s.node(x).pruned


def test_root_is_never_pruned_and_failures_stop_the_search():
    s = MCTS(seed=0)
    evals, picks = drive(s, lambda k: (Status.COMPILE_ERROR, 0.0), many_moves, budget=100)
    assert not s.node(0).pruned
    assert set(picks) == {0}  # failed nodes are never expanded
    # the root widens as sqrt(visits) while its children fail, until the cap stops it (16 here)
    assert evals == len(s.children(0)) == 16 and s.select() is None


def test_close_stops_a_node_but_not_its_subtree():
    s, x, y = _tree_with_two_kernels()
    s.close(0, "no move")
    assert s.room(0) == 0 and s.closed(0) == "no move"
    assert s.select() == x  # descends to the better child
    s.close(x, "no move")
    c = s.add_child(y, "y1", "e")
    s.record(c, Status.OK, 0.8)
    s.close(y, "no move")
    assert s.select() == c  # below a closed node, still searchable
    s.close(c, "no move")
    assert s.select() is None


def test_repair_under_a_failed_node_is_reachable():
    s = MCTS(seed=0)
    f = s.add_child(0, "f", "e")
    s.record(f, Status.COMPILE_ERROR, 0.0)
    s.close(0, "no move")
    assert s.room(f) == 0 and s.select() is None  # a failure is never expanded
    fixed = s.add_child(f, "f-fixed", "repair")  # the loop's repair round
    s.record(fixed, Status.OK, 0.7)
    assert s.select() == fixed and s.best() == fixed
    assert s.node(f).value == 0.7 and s.path(fixed) == (0, f, fixed)


def test_memory_and_validation():
    s, x, y = _tree_with_two_kernels()
    z = s.add_child(x, "z", "tile 64")
    assert s.tried_edits(x) == {"tile 64"}  # pending edits count: the policy must not repeat them
    s.record(z, Status.MISMATCH, 0.0)
    assert s.history() == [
        (0, x, "ex", Status.OK, 0.6),
        (0, y, "ey", Status.OK, 0.5),
        (x, z, "tile 64", Status.MISMATCH, 0.0),
    ]
    assert s.status(z) is Status.MISMATCH and s.status(0) is Status.OK
    assert s.node(0).value == 0.5 and s.node(0).candidate_key == ""
    with pytest.raises(ValueError):
        s.record(z, Status.OK, 0.5)  # twice
    with pytest.raises(ValueError):
        s.record(0, Status.OK, 0.5)  # the root
    p = s.add_child(y, "p", "e")
    with pytest.raises(ValueError):
        s.add_child(p, "q", "e")  # under a pending node
    with pytest.raises(ValueError):
        s.record(p, Status.OK, 1.5)
    with pytest.raises(ValueError):
        s.record(p, "fine", 0.5)
    with pytest.raises(KeyError):
        s.node(99)


# ---------------------------------------------------------------------------------------------------------
# determinism and replay


def test_same_seed_and_calls_give_the_same_tree_and_choices():
    runs = []
    for _ in range(2):
        s = MCTS(seed=7)
        _, picks = drive(s, deceptive_landscape, deceptive_moves, budget=60)
        runs.append((s.nodes(), s.history(), picks, s.select()))
    assert runs[0] == runs[1]
    assert len(runs[0][0]) > 40


def test_seed_only_breaks_ties():
    trees = set()
    for seed in range(4):
        s = MCTS(seed=seed)
        drive(s, hashed_landscape, many_moves, budget=80)
        trees.add(s.nodes())
    assert len(trees) == 1  # no ties: the seed never matters
    picks = set()
    for seed in range(8):
        s = MCTS(seed=seed)
        _, p = drive(s, tied_landscape, many_moves, budget=60)
        picks.add(tuple(p))
        assert drive(MCTS(seed=seed), tied_landscape, many_moves, budget=60)[1] == p
    assert len(picks) > 1  # all ties: the seed decides


@pytest.mark.parametrize("cls", [MCTS, Greedy])
def test_replay_from_a_json_log_rebuilds_the_search(cls):
    log: list[str] = []
    s = cls(seed=5)
    drive(s, deceptive_landscape, deceptive_moves, budget=40, log=log)
    fresh = cls(seed=5)
    for line in log:
        call = json.loads(line)
        if call["op"] == "add":
            fresh.add_child(call["parent"], call["key"], call["edit"])
        elif call["op"] == "record":
            fresh.record(call["node"], Status(call["status"]), call["reward"])
        else:
            fresh.close(call["node"], call["reason"])
    assert fresh.nodes() == s.nodes()
    assert fresh.history() == s.history() and fresh.best() == s.best()
    assert fresh.select() == s.select() is not None
    assert [json.dumps(c) for c in s.calls()] == log  # the search's own call list is the same log
    again = cls.from_dict(json.loads(json.dumps(s.to_dict())))
    assert again.nodes() == s.nodes() and again.select() == s.select()
    with pytest.raises(ValueError):
        (Greedy if cls is MCTS else MCTS).from_dict(s.to_dict())


def test_resume_mid_run_continues_exactly_like_an_uninterrupted_run():
    whole = MCTS(seed=2)
    whole_log: list[str] = []
    drive(whole, deceptive_landscape, deceptive_moves, budget=48, log=whole_log)
    crashed = MCTS(seed=2)
    crashed_log: list[str] = []
    done, _ = drive(crashed, deceptive_landscape, deceptive_moves, budget=20, log=crashed_log)
    resumed = MCTS(seed=2)
    for line in crashed_log:
        resumed.apply(json.loads(line))
    drive(resumed, deceptive_landscape, deceptive_moves, budget=48 - done)
    assert resumed.nodes() == whole.nodes() and resumed.history() == whole.history()


# ---------------------------------------------------------------------------------------------------------
# greedy, and greedy against MCTS


def test_greedy_expands_the_best_node_with_room():
    g = Greedy(width=3)
    assert g.select() == 0 and g.room(0) == 3
    for i in range(3):
        g.record(g.add_child(0, f"f{i}", f"e{i}"), Status.COMPILE_ERROR, 0.0)
    assert g.room(0) == 3 and g.select() == 0  # nothing has worked yet: keep drawing first kernels
    a, b = g.add_child(0, "a", "ea"), g.add_child(0, "b", "eb")
    g.record(a, Status.OK, 0.6)
    g.record(b, Status.OK, 0.6)
    assert g.room(0) == 0  # width 3 from now on, and the root has 5
    assert g.select() == a  # ties: the earliest id
    for i in range(3):
        g.record(g.add_child(a, f"a{i}", f"e{i}"), Status.OK, 0.55)
    assert g.node(a).pruned  # same dead-end rule as MCTS
    assert g.select() == b


def test_mcts_escapes_a_deceptive_optimum_that_traps_greedy():
    budget = 48
    for seed in range(3):
        m = MCTS(seed=seed)
        evals, _ = drive(m, deceptive_landscape, deceptive_moves, budget, check=check_mcts_widening)
        assert evals == budget
        assert best_reward(m) >= 0.9
        assert m.node(m.best()).candidate_key.startswith("b/q0/")  # type: ignore[arg-type]

    def check_width(s: SearchTree, node: int) -> None:
        assert s.room(node) == 4 - len(s.children(node))

    g = Greedy(seed=0, width=4)
    evals, picks = drive(g, deceptive_landscape, deceptive_moves, 2 * budget, check=check_width)
    assert evals == 2 * budget  # even with twice the budget
    assert best_reward(g) == pytest.approx(0.72)  # stuck on the plateau
    assert all(len(n.children) <= 4 for n in g.nodes())
    assert all(g.node(p).candidate_key.startswith("a") for p in picks[1:])  # never left "a"


# ---------------------------------------------------------------------------------------------------------
# factory


def test_make_search():
    cfg = Config(widen_c=3.0, widen_alpha=0.25, prune_after=5, children_per_expand=6)
    m = make_search("mcts", seed=4, cfg_like=cfg)
    assert isinstance(m, MCTS)
    assert (m.seed, m.widen_c, m.widen_alpha, m.prune_after) == (4, 3.0, 0.25, 5)
    g = make_search("greedy", seed=1, cfg_like=cfg)
    assert isinstance(g, Greedy) and (g.width, g.prune_after) == (6, 5)
    assert isinstance(make_search("mcts"), MCTS)
    with pytest.raises(ValueError, match="mcts, greedy"):
        make_search("beam", seed=0, cfg_like=cfg)
