"""MCTS over candidates: UCT descent, progressive widening with asymmetric branching. Pure.

select() descends from the root and returns the first node that still has room, so a node gets new
children (new edits of the same parent) before its children are refined, at a pace set by its visits:

    cap(node) = ceil(widen_c * max(1, visits) ** widen_alpha * boost)
    boost = max(root_boost if root, best_boost if on the path from the root to best(), 1)

Asymmetric branching: the root (distinct first kernels) and the line that leads to the best kernel so far
get more children than a side branch. A full node descends to the child maximising

    UCT(c) = value(c) + exploration * sqrt(ln(visits(node)) / visits(c))

over the children whose subtree still holds a node that may be expanded (pending, pruned and exhausted
subtrees are skipped; a failed node is never returned, but descent may pass through it to a repair hung
under it). Ties go to a random.Random seeded by (seed, number of calls so far, node id): select() is a pure
function of the tree and the seed, so calling it, or not, never changes a later answer.
"""

from __future__ import annotations

import math
import random
from typing import Any

from pipeline.search.tree import ROOT, SearchTree, _Rec

_TIE = 1e-12  # UCT scores this close are a tie (float noise is not a preference)


class MCTS(SearchTree):
    kind = "mcts"

    def __init__(
        self,
        seed: int = 0,
        widen_c: float = 2.0,
        widen_alpha: float = 0.5,
        prune_after: int = 3,
        exploration: float = 0.7,
        root_boost: float = 2.0,
        best_boost: float = 1.5,
    ) -> None:
        super().__init__(seed=seed, prune_after=prune_after)
        if widen_c <= 0 or not 0 <= widen_alpha <= 1:
            raise ValueError(
                f"progressive widening needs widen_c > 0, 0 <= widen_alpha <= 1 ({widen_c}, {widen_alpha})"
            )
        if exploration < 0 or root_boost < 1 or best_boost < 1:
            raise ValueError("exploration must be >= 0 and the boosts >= 1")
        self.widen_c = widen_c
        self.widen_alpha = widen_alpha
        self.exploration = exploration
        self.root_boost = root_boost
        self.best_boost = best_boost

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "widen_c": self.widen_c,
            "widen_alpha": self.widen_alpha,
            "exploration": self.exploration,
            "root_boost": self.root_boost,
            "best_boost": self.best_boost,
        }

    def _boost(self, rec: _Rec) -> float:
        boost = self.root_boost if rec.id == ROOT else 1.0
        if self._best is not None and self._on_best_path(rec.id):
            boost = max(boost, self.best_boost)
        return boost

    def _on_best_path(self, node_id: int) -> bool:
        r: int | None = self._best
        while r is not None:
            if r == node_id:
                return True
            r = self._recs[r].parent
        return False

    def _cap(self, rec: _Rec) -> int:
        raw = self.widen_c * max(1, rec.visits) ** self.widen_alpha * self._boost(rec)
        return math.ceil(raw - 1e-9)  # 2 * 4**0.5 is 4 children, not 5 through rounding

    def select(self) -> int | None:
        recs = self._recs
        # live[i]: i's subtree holds a node that may be expanded. Children have larger ids than their
        # parent, so one pass from the last id up settles every subtree before its parent.
        room = [0] * len(recs)
        live = [False] * len(recs)
        for rec in reversed(recs):
            if rec.pruned or rec.status is None:
                continue
            room[rec.id] = self._own_room(rec)
            live[rec.id] = room[rec.id] > 0 or any(live[c] for c in rec.children)
        if not live[ROOT]:
            return None
        node = ROOT
        while room[node] == 0:
            node = self._uct(recs[node], [c for c in recs[node].children if live[c]])
        return node

    def _uct(self, rec: _Rec, options: list[int]) -> int:
        log_n = math.log(max(1, rec.visits))
        scores = [
            self._recs[c].value + self.exploration * math.sqrt(log_n / self._recs[c].visits) for c in options
        ]
        top = max(scores)
        ties = [c for c, s in zip(options, scores, strict=True) if s >= top - _TIE]
        if len(ties) == 1:
            return ties[0]
        return random.Random(f"{self.seed}:{len(self._calls)}:{rec.id}").choice(ties)
