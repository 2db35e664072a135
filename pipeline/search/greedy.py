"""Greedy hill climbing, the ablation baseline for MCTS: always expand the best node that has room. Pure.

Same tree, pruning, memory and replay as MCTS (pipeline/search/tree.py); only the choice differs. Every
node may have `width` children. Until a first candidate succeeds the root keeps `width` free places
(only its pending children use them up): with nothing better to climb from, greedy keeps drawing first
kernels, as MCTS's widening root does; the budget, close() or the loop's limits stop it.
"""

from __future__ import annotations

from typing import Any

from pipeline.search.tree import ROOT, SearchTree, _Rec
from pipeline.types import Status


class Greedy(SearchTree):
    kind = "greedy"

    def __init__(self, seed: int = 0, width: int = 4, prune_after: int = 3) -> None:
        super().__init__(seed=seed, prune_after=prune_after)
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.width = width

    def params(self) -> dict[str, Any]:
        return {**super().params(), "width": self.width}

    def _cap(self, rec: _Rec) -> int:
        if rec.id == ROOT and self._best is None:
            return self.width + sum(self._recs[c].status is not None for c in rec.children)
        return self.width

    def select(self) -> int | None:
        """The highest-reward OK node with room (the root counts at 0.5); ties: earliest id."""
        pick: _Rec | None = None
        for rec in self._recs:
            if rec.status is not Status.OK or (pick is not None and rec.reward <= pick.reward):  # type: ignore[operator]
                continue
            if self.room(rec.id) > 0:
                pick = rec
        return None if pick is None else pick.id
