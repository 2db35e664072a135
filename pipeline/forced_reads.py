"""Bytes a task must read from DRAM twice, whatever the kernel, for the roofline floor (Task.min_bytes).

An input reduced over slices larger than the chip can hold, with each slice's result then needed beside
the slice's own elements again (x / ||x||, x - x.mean() over a whole tensor, a softmax or a norm over a
huge row), cannot be written out before its slice has been read in full: what did not stay on chip is
read a second time. A floor that counted one read would sit below what any kernel can reach (level 1's
Frobenius norm over 7.5 GB read "66% of its floor" at two reads and a write, and its profile advised
removing a read that cannot be removed).

Found on the meta device during the task's probe (tasks.probe) by a dispatch mode that follows, for each
tensor, the inputs it is computed from elementwise and the inputs whose slice-wide reductions it waits for.
Small slices (rows of a softmax, a GroupNorm's groups) are left out: a kernel keeps them on chip. The
on-chip size is taken larger than any GPU's L2 and shared memory together, so the floor stays a lower bound.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ON_CHIP_BYTES = 256 * 2**20
# Reductions whose output has an element a slice (the number of slices: the output's size).
REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "norm", "linalg_vector_norm", "var", "std",
    "var_mean", "std_mean", "logsumexp", "aminmax",
})  # fmt: skip
# Ops that reduce each slice and then read it again themselves: (op, the number of slices from its args and
# outputs). Batch norm in eval mode (running statistics) reduces nothing: its saved mean is empty.
SELF_NORMALISING = {
    "_softmax": lambda a, o: a[0].numel() // max(1, a[0].shape[a[1]]) if a[0].dim() else 1,
    "_log_softmax": lambda a, o: a[0].numel() // max(1, a[0].shape[a[1]]) if a[0].dim() else 1,
    "native_layer_norm": lambda a, o: o[1].numel(),
    "native_group_norm": lambda a, o: o[1].numel(),
    "native_batch_norm": lambda a, o: o[1].numel(),
}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class ForcedReads(TorchDispatchMode):
    """Inside it, a forward on meta tensors; `bytes` then holds what its inputs must be read twice."""

    def __init__(self, inputs: list[Any]) -> None:
        super().__init__()
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        self.lost = False
        try:
            self.size = {_key(x): x.numel() * x.element_size() for x in tensors}
        except Exception:  # an input without plain storage: each input counted once, as before
            self.size, self.lost = {}, True
        self.sources: dict[int, frozenset[int]] = {k: frozenset((k,)) for k in self.size}
        self.waits: dict[int, dict[int, int]] = {}  # tensor -> {input: bytes re-read if it meets the input}
        self.forced: dict[int, int] = {}
        self._alive: list[torch.Tensor] = list(tensors)  # storages stay alive, so keys are not reused

    @property
    def bytes(self) -> int:
        return 0 if self.lost else sum(self.forced.values())

    def _reread(self, src: frozenset[int], slices: int) -> dict[int, int]:
        """{input: bytes read twice} for inputs reduced in `slices` slices, where a slice outgrows the chip."""
        out = {}
        for s in src:
            if slices > 0 and self.size[s] / slices > ON_CHIP_BYTES:
                out[s] = self.size[s] - slices * ON_CHIP_BYTES
        return out

    def _force(self, more: dict[int, int]) -> None:
        for s, b in more.items():
            self.forced[s] = max(self.forced.get(s, 0), b)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.lost:
            try:
                self._follow(func, args, kwargs, out)
            except Exception:  # an op this does not understand: the floor counts each input once, as before
                self.lost = True
        return out

    def _follow(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> None:
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        src = frozenset().union(*(self.sources.get(_key(t), frozenset()) for t in ins))
        waits: dict[int, int] = {}
        for t in ins:
            for s, b in self.waits.get(_key(t), {}).items():
                waits[s] = max(waits.get(s, 0), b)
        self._force({s: b for s, b in waits.items() if s in src})  # an input beside its own reduction
        name = func.overloadpacket.__name__
        if name in SELF_NORMALISING and outs:
            self._force(self._reread(src, SELF_NORMALISING[name](args, outs)))
        elif name in REDUCTIONS and outs:
            for s, b in self._reread(src, outs[0].numel()).items():
                waits[s] = max(waits.get(s, 0), b)
            src = frozenset()  # one value a slice: reading it again reads no input again
        for t in outs:
            if _key(t) in self.size:  # an op writing into an input (in place) leaves it an input
                continue
            self.sources[_key(t)] = src
            if waits:
                self.waits[_key(t)] = waits
            self._alive.append(t)
