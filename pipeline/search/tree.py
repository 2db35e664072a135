"""The tree both searches share: nodes, backpropagation, dead-end pruning, search memory, replay. Pure.

Node 0 is the task's PyTorch reference: key "", status OK, reward NEUTRAL (0.5) fixed. Every other node is
a candidate: `add_child` registers it pending (status None), `record` gives it its evaluation. Ids are
assigned in call order, and nothing here reads a clock, a hash or set order, so replaying the same calls
(`apply`, driven by the run log) rebuilds the same tree; subclasses keep `select` a pure function of the
tree and the seed, so a replay needs only the mutating calls (add, record, close).

Values: a node's value is the best reward in its subtree, its own included (max backup). The search
optimises for the single best kernel, not the average child: a node whose children mostly fail but once
gave 0.9 is worth descending into, while mean backup would bury it under its failures. Subtrees that keep
failing are handled by pruning instead, and UCT's exploration term keeps the max from over-exploiting.

Closing: `close` (the policy has no move left from a node) stops that node taking children but leaves its
subtree searchable, since its children have moves of their own. Dead-end pruning (the last `prune_after`
children of a node all failed or did not beat the node's own reward) closes the node and its whole
subtree. The root is never pruned: early first kernels often lose to the eager reference, which is no
reason to stop searching below the ones that work; progressive widening bounds its width instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from pipeline.search.reward import NEUTRAL
from pipeline.types import Node, Status, to_dict

ROOT = 0
History = tuple[int, int, str, Status, float | None]  # (parent id, child id, edit, status, reward as given)


@dataclass
class _Rec:
    """Mutable internal record; callers see frozen pipeline.types.Node values."""

    id: int
    parent: int | None
    key: str
    edit: str
    children: list[int] = field(default_factory=list)
    visits: int = 0
    value: float = 0.0  # max reward over the subtree (failures count 0)
    reward: float | None = None  # own reward; None while pending, 0.0 for a failure
    status: Status | None = None
    pruned: bool = False
    closed: str | None = None  # why the node takes no more children (policy's reason or the prune rule)
    streak: int = 0  # consecutive recorded children that failed or did not improve on this node


class SearchTree:
    kind: ClassVar[str] = ""

    def __init__(self, seed: int = 0, prune_after: int = 3) -> None:
        if prune_after < 1:
            raise ValueError(f"prune_after must be >= 1, got {prune_after}")
        self.seed = seed
        self.prune_after = prune_after
        self._recs = [_Rec(ROOT, None, "", "", visits=0, value=NEUTRAL, reward=NEUTRAL, status=Status.OK)]
        self._history: list[History] = []
        self._calls: list[dict[str, Any]] = []
        self._best: int | None = None

    # -- policy-specific ------------------------------------------------------------------------------

    def select(self) -> int | None:
        raise NotImplementedError

    def _cap(self, rec: _Rec) -> int:
        """How many children the node may have now, pending ones included."""
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        return {"seed": self.seed, "prune_after": self.prune_after}

    # -- queries --------------------------------------------------------------------------------------

    def room(self, node_id: int) -> int:
        """How many more children the node may get now: 0 unless it is a recorded OK node, open, outside
        any pruned subtree."""
        rec = self._get(node_id)
        return 0 if self._dead(rec) else self._own_room(rec)

    def _own_room(self, rec: _Rec) -> int:
        # Ignores ancestors: select's descent never enters a pruned subtree, so it need not walk up.
        if rec.status is not Status.OK or rec.closed is not None:
            return 0
        return max(0, self._cap(rec) - len(rec.children))

    def _dead(self, rec: _Rec) -> bool:
        r: _Rec | None = rec
        while r is not None:
            if r.pruned:
                return True
            r = None if r.parent is None else self._recs[r.parent]
        return False

    def best(self) -> int | None:
        """The OK candidate with the highest reward (ties: earliest id); None before any succeeds. The
        root is not a candidate; a pruned node still counts (pruning stops search, not results)."""
        return self._best

    def node(self, node_id: int) -> Node:
        r = self._get(node_id)
        return Node(r.id, r.parent, r.key, tuple(r.children), r.visits, r.value, r.status, r.pruned)

    def nodes(self) -> tuple[Node, ...]:
        return tuple(self.node(r.id) for r in self._recs)

    def children(self, node_id: int) -> tuple[int, ...]:
        return tuple(self._get(node_id).children)

    def path(self, node_id: int) -> tuple[int, ...]:
        """Ids from the root down to node_id."""
        out = []
        r: _Rec | None = self._get(node_id)
        while r is not None:
            out.append(r.id)
            r = None if r.parent is None else self._recs[r.parent]
        return tuple(reversed(out))

    def status(self, node_id: int) -> Status | None:
        return self._get(node_id).status

    def reward(self, node_id: int) -> float | None:
        """The node's own reward (0.0 for a failure, None while pending); node().value is its subtree's."""
        return self._get(node_id).reward

    def edit(self, node_id: int) -> str:
        return self._get(node_id).edit

    def closed(self, node_id: int) -> str | None:
        """Why the node takes no more children (close() reason or the prune rule), or None."""
        return self._get(node_id).closed

    def history(self) -> list[History]:
        """(parent, child, edit, status, reward) for every recorded child, in record order."""
        return list(self._history)

    def tried_edits(self, node_id: int) -> set[str]:
        """Edits already proposed from the node, pending ones included."""
        return {self._recs[c].edit for c in self._get(node_id).children}

    def calls(self) -> list[dict[str, Any]]:
        """The mutating calls so far, JSON-ready; `apply` each in order to a fresh search to rebuild it."""
        return [dict(c) for c in self._calls]

    def __len__(self) -> int:
        return len(self._recs)

    # -- mutations ------------------------------------------------------------------------------------

    def add_child(self, parent: int, candidate_key: str, edit: str) -> int:
        """Register a proposed child, pending until record(); returns its id (the next integer).

        Room is not enforced here: the loop also hangs repairs under failed nodes, outside room()."""
        p = self._get(parent)
        if p.status is None:
            raise ValueError(f"node {parent} is pending: record it before adding children to it")
        cid = len(self._recs)
        self._recs.append(_Rec(cid, parent, candidate_key, edit))
        p.children.append(cid)
        self._calls.append({"op": "add", "parent": parent, "key": candidate_key, "edit": edit})
        return cid

    def record(self, node_id: int, status: Status, reward: float | None) -> None:
        """The evaluation of a pending child: backpropagate and update the parent's dead-end count."""
        rec = self._get(node_id)
        if node_id == ROOT:
            raise ValueError("the root is the reference; it is not evaluated")
        if rec.status is not None:
            raise ValueError(f"node {node_id} is already recorded ({rec.status})")
        st = Status(status)
        if reward is not None and not 0.0 <= reward <= 1.0:  # also rejects NaN
            raise ValueError(f"reward must lie in [0, 1], got {reward}")
        own = (reward or 0.0) if st is Status.OK else 0.0
        rec.status, rec.reward, rec.value, rec.visits = st, own, own, 1
        r = self._recs[rec.parent]  # type: ignore[index]
        while True:
            r.visits += 1
            if r.id != ROOT:  # the root's value is the reference's, fixed
                r.value = max(r.value, own)
            if r.parent is None:
                break
            r = self._recs[r.parent]

        parent = self._recs[rec.parent]  # type: ignore[index]
        if st is Status.OK and own > (parent.reward or 0.0):
            parent.streak = 0
        else:
            parent.streak += 1
            if parent.streak >= self.prune_after and parent.id != ROOT and not parent.pruned:
                parent.pruned = True
                parent.closed = parent.closed or f"pruned: last {self.prune_after} children did not improve"

        if st is Status.OK:
            b = self._best
            if b is None or own > self._recs[b].reward or (own == self._recs[b].reward and node_id < b):  # type: ignore[operator]
                self._best = node_id
        self._history.append((rec.parent, node_id, rec.edit, st, reward))  # type: ignore[arg-type]
        self._calls.append({"op": "record", "node": node_id, "status": st.value, "reward": reward})

    def close(self, node_id: int, reason: str) -> None:
        """The policy has no move left from this node: it takes no more children (its subtree stays)."""
        rec = self._get(node_id)
        if rec.status is None:
            raise ValueError(f"node {node_id} is pending")
        if rec.closed is None:
            rec.closed = reason or "closed"
        self._calls.append({"op": "close", "node": node_id, "reason": reason})

    def apply(self, call: dict[str, Any]) -> int | None:
        """Replay one entry of calls() (or of the run log); returns the new id for an "add"."""
        op = call.get("op")
        if op == "add":
            return self.add_child(int(call["parent"]), str(call["key"]), str(call["edit"]))
        if op == "record":
            self.record(int(call["node"]), Status(call["status"]), call["reward"])
        elif op == "close":
            self.close(int(call["node"]), str(call["reason"]))
        else:
            raise ValueError(f"unknown search call {call!r}")
        return None

    # -- report ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        nodes = []
        for n in self.nodes():
            d = to_dict(n)
            d.update(edit=self.edit(n.id), reward=self.reward(n.id), closed=self.closed(n.id))
            nodes.append(d)
        return {
            "kind": self.kind,
            "params": self.params(),
            "best": self._best,
            "nodes": nodes,
            "calls": self.calls(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Rebuild by replaying data["calls"]; "nodes" is for readers of the report, not the source."""
        if data.get("kind") != cls.kind:
            raise ValueError(f"{cls.__name__}.from_dict: a {data.get('kind')!r} search, not {cls.kind!r}")
        search = cls(**data["params"])
        for call in data["calls"]:
            search.apply(call)
        return search

    def _get(self, node_id: int) -> _Rec:
        if not isinstance(node_id, int) or not 0 <= node_id < len(self._recs):
            raise KeyError(f"no node {node_id!r} (the tree has {len(self._recs)})")
        return self._recs[node_id]
