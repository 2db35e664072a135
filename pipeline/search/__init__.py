"""Search over candidates (pure: no I/O, no clock, deterministic under a seed): MCTS and a greedy baseline."""

from __future__ import annotations

from typing import Any

from pipeline.search.greedy import Greedy
from pipeline.search.mcts import MCTS
from pipeline.search.reward import Objective, objective_value, reward
from pipeline.search.tree import SearchTree

KINDS = ("mcts", "greedy")

__all__ = [
    "KINDS",
    "MCTS",
    "Greedy",
    "Objective",
    "SearchTree",
    "make_search",
    "objective_value",
    "reward",
]


def make_search(kind: str, seed: int = 0, cfg_like: Any = None) -> MCTS | Greedy:
    """The search named by cfg.search, its knobs read from a Config (or anything with those attributes);
    the constructors' defaults where cfg_like lacks one. Greedy's width is cfg.children_per_expand."""

    def knob(name: str, default: Any) -> Any:
        return default if cfg_like is None else getattr(cfg_like, name, default)

    if kind == "mcts":
        return MCTS(
            seed=seed,
            widen_c=knob("widen_c", 2.0),
            widen_alpha=knob("widen_alpha", 0.5),
            prune_after=knob("prune_after", 3),
        )
    if kind == "greedy":
        return Greedy(seed=seed, width=knob("children_per_expand", 4), prune_after=knob("prune_after", 3))
    raise ValueError(f"unknown search {kind!r}: expected one of {', '.join(KINDS)}")
