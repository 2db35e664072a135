"""Log-reward calibration: a measured figure against the eager baseline, mapped into [0, 1]. Pure.

Every objective is "lower is better" (ms, J/call, J*ms), so improvement is the ratio baseline / value and
the reward works on its logarithm: a 2x gain counts the same from any starting point, and one lucky
outlier cannot dominate the tree's values the way a linear speedup would.

    x = log(clip(baseline / value, 1/MAX_RATIO, MAX_RATIO)) / log(S)
    faster or equal (x >= 0):  r = 0.5 + 0.5 * tanh(x)                       in [0.5, 1)
    slower          (x <  0):  r = FLOOR + (0.5 - FLOOR) * (1 + tanh(x))     in (FLOOR, 0.5)
    failure (any status but ok, or ok without a usable figure):  r = 0

S is the ratio that maps to 0.5 + 0.5*tanh(1) = 0.88, "near the top": 8x for time and energy; 64x for
the energy-delay product, which moves with the square of a speedup at constant power (2x faster, same
watts = 4x EDP), so S = 8^2 keeps one kernel's reward on the same footing under either objective.
FLOOR keeps every correct candidate well clear of every failed one (10x slower: 0.14; 1000x: 0.051):
a slow but correct kernel is a foothold to optimise from, a failure is not.
MAX_RATIO bounds x so that tanh never rounds to +-1: rewards stay strictly inside their bands.

Matched speed (`reward_at_speed`, used by the search loop). Under `energy` and `edp` a candidate whose
median time is more than (1 + tolerance) times the fastest verified time so far (the reference's and its
own included; tolerance 2% unless --speed-tolerance says otherwise) gets no energy credit: its reward is
min(reward under the objective, reward under `time`). Going slower to draw less power then never pays,
and a slow candidate keeps what its speed earns as a foothold, never more. Under `time` nothing changes.
A reward is given once, against the fastest known when the candidate is scored; the run's final choice
is made again over every measurement at the end (pipeline/search/matched.py, `choose`).
"""

from __future__ import annotations

import enum
import math

from pipeline.types import Status

NEUTRAL = 0.5  # the reference itself (the root of the tree)
FLOOR = 0.05  # infimum of a correct candidate's reward
MAX_RATIO = 1e6


class Objective(enum.StrEnum):
    TIME = "time"  # ms per call
    ENERGY = "energy"  # joules per call
    EDP = "edp"  # energy-delay product, J * ms


# The improvement ratio that maps to 0.88 (see the module docstring).
SCALE: dict[Objective, float] = {Objective.TIME: 8.0, Objective.ENERGY: 8.0, Objective.EDP: 64.0}


def objective_value(
    objective: Objective | str, time_ms: float | None, joules_per_call: float | None
) -> float | None:
    """The figure the objective minimises; None when a figure it needs is missing."""
    objective = Objective(objective)
    if objective is Objective.TIME:
        return time_ms
    if objective is Objective.ENERGY:
        return joules_per_call
    if time_ms is None or joules_per_call is None:
        return None
    return joules_per_call * time_ms


def _usable(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def reward(
    status: Status,
    value: float | None,
    baseline: float | None,
    objective: Objective | str = Objective.TIME,
) -> float:
    """Calibrated reward in [0, 1] of one evaluated candidate (formula in the module docstring).

    A correct candidate with no usable baseline scores NEUTRAL: there is no evidence that it is better or
    worse than the reference, and it must still rank above every failure.
    """
    if Status(status) is not Status.OK or not _usable(value):
        return 0.0
    if not _usable(baseline):
        return NEUTRAL
    ratio = min(max(baseline / value, 1.0 / MAX_RATIO), MAX_RATIO)  # type: ignore[operator]
    x = math.log(ratio) / math.log(SCALE[Objective(objective)])
    if x >= 0:
        return NEUTRAL + NEUTRAL * math.tanh(x)
    return FLOOR + (NEUTRAL - FLOOR) * (1.0 + math.tanh(x))


def reward_at_speed(
    status: Status,
    time_ms: float | None,
    joules_per_call: float | None,
    baseline_ms: float | None,
    baseline_joules: float | None,
    objective: Objective | str,
    fastest_ms: float | None,
    tolerance: float,
) -> float:
    """The reward under the matched-speed rule (module docstring): the objective's reward at speed, capped
    by the time reward when the candidate is more than `tolerance` slower than `fastest_ms`."""
    objective = Objective(objective)
    value = objective_value(objective, time_ms, joules_per_call)
    base = objective_value(objective, baseline_ms, baseline_joules)
    r = reward(status, value, base, objective)
    if objective is Objective.TIME or time_ms is None or fastest_ms is None:
        return r
    if time_ms <= (1.0 + tolerance) * fastest_ms:
        return r
    return min(r, reward(status, time_ms, baseline_ms, Objective.TIME))
