"""Run a reference on the CPU with real values where they are cheap and only shapes where they are not.

An MoE block computes its routing from its float input (router logits, top-k, a sort, tokens per expert)
and then loops over the experts with those counts as Python ints. The meta device cannot run it (no values
for `.tolist()`), and running it for real on the CPU costs the experts' products: hundreds of GFLOPs. Here:

- parameters and buffers of at least LARGE elements are made on the meta device (a factory call that big
  returns a meta tensor), the rest for real;
- an op that reads a meta tensor runs on meta (its other tensors moved there first), so the experts'
  products cost nothing and their results carry shapes only;
- everything else runs for real: the inputs, the router, the routing.

Values computed from a large parameter are never real, so a forward that branches on them fails here
(`.tolist()` of a meta tensor) and says so. Under make_fx the moves to meta are traced as `_to_copy`
nodes: `strip_meta_moves` takes them out again, leaving the graph the forward wrote.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

LARGE = 1 << 22  # elements: a router (experts x hidden) stays real, an expert stack (E x H x I) does not
MAX_INPUT_BYTES = 1 << 30  # real inputs beyond this are too costly to draw and read on the CPU


def mode() -> Any:
    """The TorchDispatchMode described above (a new one per use: modes are not re-entrant)."""
    import torch
    import torch.utils._pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    def to_meta(t: Any) -> Any:
        return t.to("meta") if isinstance(t, torch.Tensor) and t.device.type != "meta" else t

    class CheapValues(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
        ) -> Any:
            kwargs = kwargs or {}
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if not tensors and "device" in kwargs:  # a factory: large ones are made on meta
                shaped = func(*args, **{**kwargs, "device": torch.device("meta")})
                if isinstance(shaped, torch.Tensor) and shaped.numel() >= LARGE:
                    return shaped
            elif any(t.device.type == "meta" for t in tensors):
                args, kwargs = pytree.tree_map(to_meta, (args, kwargs))
            return func(*args, **kwargs)

    return CheapValues()


def model(module: ModuleType, init_args: list) -> Any:
    """The task's model on the CPU, its large parameters on meta; raises what the constructor raises."""
    import torch

    with torch.device("cpu"), mode():
        return module.Model(*init_args)


def inputs(module: ModuleType) -> list:
    """get_inputs() for real on the CPU; ValueError when they are too large to be worth it."""
    import torch

    with torch.device("cpu"):
        xs = list(module.get_inputs())
    size = sum(x.numel() * x.element_size() for x in xs if isinstance(x, torch.Tensor))
    if size > MAX_INPUT_BYTES:
        raise ValueError(f"its inputs ({size / 2**30:.1f} GiB) are too large to run for real on the CPU")
    return xs


def strip_meta_moves(gm: Any) -> Any:
    """Remove the moves to meta that the mode traced (each becomes its source). Dead code stays: a routing
    read only by `.tolist()` looks dead in the graph, and it is what the caller looks for."""
    import torch

    for n in list(gm.graph.nodes):
        if (
            n.op == "call_function"
            and n.target == torch.ops.aten._to_copy.default
            and str(n.kwargs.get("device")) == "meta"
            and n.kwargs.get("dtype") in (None, n.args[0].meta["val"].dtype)
        ):
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    gm.recompile()
    return gm


def values(gm: Any, args: list) -> dict[Any, Any]:
    """The real value of every small 1-D integer node of a traced graph, by running it once more."""
    import torch
    import torch.fx as fx

    found: dict[Any, Any] = {}

    class Keep(fx.Interpreter):
        def run_node(self, n: Any) -> Any:
            out = super().run_node(n)
            if (
                isinstance(out, torch.Tensor)
                and out.device.type != "meta"
                and out.dim() == 1
                and not out.is_floating_point()
                and out.numel() <= 1 << 16
            ):
                found[n] = out.clone()
            return out

    with torch.no_grad(), mode():
        Keep(gm).run(*args)
    return found


__all__ = ["LARGE", "inputs", "mode", "model", "strip_meta_moves", "values"]
