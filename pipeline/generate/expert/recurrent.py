"""PyTorch's recurrent ops (GRU, LSTM, plain RNN) during capture: outputs from their shape rule.

Exported on fake tensors, `aten.gru.input` and its kin keep one node in the graph, but to learn that node's
output shapes PyTorch runs their Python decomposition, one cell per time step: 40-60 s on two cores for
KernelBench's six-layer, 512-step GRU. Capture leaves these ops to PyTorch (cuDNN runs them), so it needs
their shapes only; while it exports, the ops' Python kernels are swapped for the shape rule below.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

# Their schemas share one order: input, hx (a tensor; [h, c] for LSTM), params, has_biases, num_layers,
# dropout, train, bidirectional, batch_first.
_OPS = ("gru", "lstm", "rnn_tanh", "rnn_relu")
# The swap changes PyTorch's global operator tables: one capture at a time holds it, so two threads never
# save each other's rule as the original.
_LOCK = threading.RLock()


def unrolls(target: str) -> bool:
    """Whether the op (\"aten.lstm.input\") is one of these: PyTorch's decomposition of it unrolls every
    layer over every time step (tens of GB for KernelBench's 512-step LSTM)."""
    parts = target.split(".")
    return len(parts) > 1 and parts[1] in _OPS


def outputs(name: str, args: tuple) -> tuple:
    """(output, h_n[, c_n]) of `aten.<name>.input` as empty tensors of the right shapes, dtype and device.

    output: the input's leading dims (time and batch in either order, or time alone when unbatched), then
    directions x the hidden size the state carries (LSTM's projection size where it has one). The final
    states have the initial states' shapes."""
    x, hx, bidirectional = args[0], args[1], args[7]
    states = list(hx) if name == "lstm" else [hx]
    width = (2 if bidirectional else 1) * states[0].shape[-1]
    out = x.new_empty((*x.shape[:-1], width))
    return (out, *(h.new_empty(h.shape) for h in states))


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Within: the recurrent ops compute only their outputs' shapes (under capture's fake tensors)."""
    import torch
    from torch._C import DispatchKey

    keys = (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd)
    saved: list[tuple[Any, Any, Any]] = []  # (op, key, its kernel before the swap)
    with _LOCK:
        try:
            for name in _OPS:
                op = getattr(torch.ops.aten, name).input
                tables = getattr(op, "py_kernels", None)
                if not isinstance(tables, dict) or not hasattr(op, "_dispatch_cache"):
                    continue  # a PyTorch without these tables: capture decomposes as before, only slower

                def rule(*args: Any, _name: str = name, **kwargs: Any) -> tuple:
                    return outputs(_name, args)

                for key in keys:
                    saved.append((op, key, tables.get(key)))
                    tables[key] = rule
                op._dispatch_cache.clear()
            yield
        finally:  # however it is left, each (op, key) gets back its kernel
            for op, key, kernel in reversed(saved):
                if kernel is None:
                    op.py_kernels.pop(key, None)
                else:
                    op.py_kernels[key] = kernel
                op._dispatch_cache.clear()
