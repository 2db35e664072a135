"""Energy at matched speed: who counts as "at speed", when two energies are told apart, which candidate a
run under `energy` or `edp` chooses, and the time-energy Pareto front. Pure: no I/O, no clock.

Matched speed. Energy alone rewards slowness (lower clocks, idle SMs draw less), so under `energy` and
`edp` a candidate earns energy credit only at speed: its median time is at most (1 + tolerance) times the
fastest verified time so far, the reference's (eager) included. The reward outside the bound is in
pipeline/search/reward.py (`reward_at_speed`); the choice at the end of a run is `choose` below.

Noise. An energy per call comes with its spread: the relative standard error over the NVML windows it was
measured in (pipeline/energy.py). A measurement repeated later drifts more than its own windows show
(temperature, clocks, the power cap), so every spread counts at least NOISE_FLOOR. Two energies a and b
are told apart only when |a - b| > Z * sqrt((a*sa)^2 + (b*sb)^2); otherwise neither is lower and the
faster one wins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.search.reward import Objective, objective_value

DEFAULT_TOLERANCE = 0.02  # 2% slower than the fastest still counts as the same speed
NOISE_FLOOR = 0.01  # relative: drift between measurements that one measurement's windows do not see
Z = 2.0  # standard errors apart before one energy is called lower (about 95% for a normal error)


@dataclass(frozen=True)
class Candidate:
    """One verified, timed candidate as the rule sees it (node id, median ms, joules per call and spread)."""

    node: int
    time_ms: float
    joules: float | None = None
    spread: float | None = None  # relative standard error of `joules`; None: unknown (one window, old logs)


def noise(spread: float | None) -> float:
    """The relative error an energy is compared with: its spread, never less than NOISE_FLOOR."""
    return max(spread if spread is not None and math.isfinite(spread) else 0.0, NOISE_FLOOR)


def within_noise(a: float, sa: float | None, b: float, sb: float | None) -> bool:
    """True when a and b (same unit, with relative spreads) are too close for the noise to rank them."""
    return abs(a - b) <= Z * math.hypot(a * noise(sa), b * noise(sb))


def compare(x: Candidate, y: Candidate, objective: Objective | str = Objective.ENERGY) -> int:
    """-1 when x is better, 1 when y is, 0 only for equal times and nodes: the objective's figure (J or
    J*ms) decides when it differs beyond the noise, the time otherwise, then the node id. A candidate
    without an energy reading loses to one with it. Under `time`, the time alone."""
    vx, vy = _value(x, objective), _value(y, objective)
    if vx is None or vy is None:
        if (vx is None) != (vy is None):
            return 1 if vx is None else -1
    elif not within_noise(vx, x.spread, vy, y.spread):
        return -1 if vx < vy else 1
    kx, ky = (x.time_ms, x.node), (y.time_ms, y.node)
    return (kx > ky) - (kx < ky)


def _value(c: Candidate, objective: Objective | str) -> float | None:
    """The figure compared beyond noise: J or J*ms (the energy's spread stands for the EDP's too: time's is
    far smaller); None under `time`, where the time alone decides."""
    if Objective(objective) is Objective.TIME:
        return None
    v = objective_value(objective, c.time_ms, c.joules)
    return v if v is not None and math.isfinite(v) and v > 0 else None


def fastest(candidates: Sequence[Candidate], reference_ms: float | None = None) -> float | None:
    """The fastest median time among the candidates and the reference; None when there is none."""
    times = [t for t in (*(c.time_ms for c in candidates), reference_ms) if t is not None and t > 0]
    return min(times, default=None)


def at_speed(time_ms: float, fastest_ms: float | None, tolerance: float = DEFAULT_TOLERANCE) -> bool:
    """Within (1 + tolerance) of the fastest: the candidate may be credited for energy."""
    return fastest_ms is None or time_ms <= (1.0 + tolerance) * fastest_ms


def choose(
    candidates: Sequence[Candidate],
    objective: Objective | str,
    reference_ms: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Candidate | None:
    """The run's choice under `energy` or `edp`: among the candidates at speed (against the fastest of all,
    the reference included) and with an energy reading, the lowest figure; the candidates whose figure the
    noise cannot tell from that lowest one are a tie, and the fastest of them wins. None when no candidate
    is at speed with a reading (the caller falls back on the search's highest reward). Under `time`: the
    fastest candidate."""
    if not candidates:
        return None
    if Objective(objective) is Objective.TIME:
        return min(candidates, key=lambda c: (c.time_ms, c.node))
    top = fastest(candidates, reference_ms)
    fair = [c for c in candidates if at_speed(c.time_ms, top, tolerance) and _value(c, objective) is not None]
    if not fair:
        return None
    low = min(fair, key=lambda c: (_value(c, objective), c.time_ms, c.node))
    lv = _value(low, objective)
    assert lv is not None
    ties = [c for c in fair if within_noise(_value(c, objective) or 0.0, c.spread, lv, low.spread)]
    return min(ties, key=lambda c: (c.time_ms, c.node))


def pareto_front(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates no other one beats on both time and energy (lower or equal on both, lower on one),
    fastest first. Candidates without an energy reading are not on it."""
    timed = sorted(
        ((c.time_ms, c.joules, c.node, c) for c in candidates if c.joules is not None), key=lambda x: x[:3]
    )
    front: list[Candidate] = []
    low: tuple[float, float] | None = None  # (joules, ms) of the last one kept
    for ms, j, _, c in timed:  # by time: on the front iff it uses less energy than every faster one kept
        if low is None or j < low[0] or (j, ms) == low:
            front.append(c)
            low = (j, ms)
    return front


@dataclass(frozen=True)
class Saving:
    """How many times less energy per call than a baseline, with the ratio's relative spread."""

    ratio: float
    spread: float | None  # None when either spread is unknown
    beyond_noise: bool  # the two energies are told apart by the noise rule


def saving(
    baseline_j: float, baseline_spread: float | None, ours_j: float, ours_spread: float | None
) -> Saving:
    """baseline / ours; a ratio's relative standard error is the root sum of squares of the two."""
    spread = (
        None if baseline_spread is None or ours_spread is None else math.hypot(baseline_spread, ours_spread)
    )
    return Saving(
        baseline_j / ours_j, spread, not within_noise(baseline_j, baseline_spread, ours_j, ours_spread)
    )
