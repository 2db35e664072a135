"""Recognise a Mixture-of-Experts projection written as a loop over experts, and rewrite it as one grouped GEMM.

MoE code without a grouped kernel loops over the experts: tokens sorted by expert, `counts[e]` rows of x
(a tensor input) multiplied by expert e's weight, each product through the same few row-wise ops and
written into its rows of the output. torch.export cannot capture that (the slice bounds are values), so:

1. trace the forward with make_fx on the meta device, its integer inputs real (a routing the task draws):
   the loop unrolls into one `mm` per expert on `x[start:end]` and `w[e]`;
2. check that the slices are exactly the groups that routing defines (counts, or their running sum),
   that every product runs the same row-wise chain and lands in its own rows of one output, and that
   nothing else reads the loop's values;
3. trace again with another routing: the same structure must come out (no branch on the values);
4. rewrite: `torch._grouped_mm(x, w, offs=cumsum(counts))`, the chain once on its result.

The rewritten module is then exported like any other reference. What is not recognised is said in one line.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pipeline.tasks import valued_inputs


class NotGrouped(Exception):
    """The forward is not a loop over experts we can rewrite; the message says why in one line."""


@dataclass(frozen=True)
class Group:
    mm: Any  # the fx node of this expert's product
    expert: int
    start: int
    end: int


@dataclass(frozen=True)
class Loop:
    x: Any  # the fx placeholder the rows come from
    w: Any  # the fx placeholder of the stacked weights (E, K, N) or (E, N, K)
    k_major: bool  # w[e] is (N, K), used transposed
    counts: int  # the position of the integer input that defines the groups
    cumulative: bool  # counts holds running ends (offsets), not sizes
    leading_zero: bool  # offsets with a leading 0 (E + 1 entries)
    out: Any  # the output buffer the groups are written into
    mm: Any  # the first group's product
    chain: list[Any]  # the first group's row-wise ops after its product
    written: Any  # the value the first group writes into its rows (its product, or the chain's last op)
    loop_nodes: set[Any]  # every node of the unrolled loop, dropped by the rewrite
    ragged_k: bool = False  # a weight gradient: out[e] = x[rows of e]^T @ w[rows of e], the groups along K


def rewrite(module: ModuleType, model: Any) -> Any:
    """A module computing the same as `model` (on meta) with its expert loop as one grouped GEMM;
    raises NotGrouped."""
    inputs = valued_inputs(module)
    loop, names = _recognise(model, inputs)
    # the same structure under another routing: the loop does not branch on the values
    other = _other_routing(inputs[loop.counts], loop.cumulative, loop.leading_zero)
    _recognise(model, [other if i == loop.counts else x for i, x in enumerate(inputs)])
    return _rebuild(model, loop, names, len(inputs))


def _other_routing(v: Any, cumulative: bool, lead: bool) -> Any:
    """The same tokens with the group sizes rotated by one expert (idle experts move too)."""
    import torch

    if not cumulative:
        return v.roll(1)
    first = v[:1] if lead else torch.zeros(1, dtype=v.dtype)
    ends = v[1:] if lead else v
    moved = torch.diff(ends, prepend=first).roll(1).cumsum(0) + first
    return torch.cat([first, moved]) if lead else moved


def _trace(model: Any, inputs: list) -> tuple[Any, dict[Any, tuple[str, Any]]]:
    """The forward unrolled by make_fx, its integer inputs held as constants (their values drive the loop:
    `int(counts[e])`, `.tolist()`). Each placeholder -> ("param", state key) or ("input", position)."""
    import torch
    import torch.utils._pytree as pytree
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    traced = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.is_floating_point()]

    def forward(st: dict, *xs: Any) -> Any:
        args = list(inputs)
        for i, x in zip(traced, xs, strict=True):
            args[i] = x
        return functional_call(model, st, tuple(args))

    try:
        with torch.no_grad():
            gm = make_fx(forward, tracing_mode="real", _error_on_data_dependent_ops=False)(
                state, *(inputs[i] for i in traced)
            )
    except Exception as e:
        raise NotGrouped(
            f"tracing the forward with real routing raised {type(e).__name__}: {_line(e)}"
        ) from None
    leaves, _ = pytree.tree_flatten((state, *(inputs[i] for i in traced)))
    keys = [("param", k) for k in state] + [("input", i) for i in traced]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(leaves) or len(keys) != len(leaves):
        raise NotGrouped("the traced forward's arguments do not match its parameters and inputs")
    return gm, dict(zip(placeholders, keys, strict=True))


def _line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(e).__name__


def _recognise(model: Any, inputs: list) -> tuple[Loop, dict[Any, tuple[str, Any]]]:
    import torch

    aten = torch.ops.aten
    gm, names = _trace(model, inputs)
    mms = [n for n in gm.graph.nodes if _is(n, aten.mm.default)]
    if len(mms) < 2:
        raise NotGrouped("the traced forward has no loop of matrix products over experts")
    if _is(mms[0].args[1], aten.slice.Tensor):  # both operands rows of a group: a weight gradient
        return _recognise_wgrad(mms, inputs, names), names
    groups: list[Group] = []
    loop_nodes: set[Any] = set()
    operands = set()
    for mm in mms:
        a, b = mm.args
        k_major = _transposed(b)
        sel = b.args[0] if k_major else b
        rows = _rows(a)
        if rows is None:
            raise NotGrouped("a product's rows are not a slice of the tokens")
        if not (_is(sel, aten.select.int) and sel.args[1] == 0):
            raise NotGrouped("a product's weight is not one expert's slice w[e] of stacked weights")
        groups.append(Group(mm, int(sel.args[2]), rows[1], rows[2]))
        operands.add((rows[0], sel.args[0], k_major))
        loop_nodes.update((mm, a, b, sel))
    if len(operands) != 1:
        raise NotGrouped("the products do not all take rows of one tensor and one stack of weights")
    ((x, w, k_major),) = operands
    if names.get(x, ("",))[0] != "input" or names.get(w, ("",))[0] != "param":
        raise NotGrouped("the rows are not a forward input, or the weights not a parameter")
    dtypes = {x.meta["val"].dtype, w.meta["val"].dtype}
    if dtypes != {torch.bfloat16}:
        raise NotGrouped(f"grouped GEMMs are written for bf16 operands (as torch._grouped_mm), not {dtypes}")
    if len({g.expert for g in groups}) != len(groups):
        raise NotGrouped("an expert's weight is used by two products")
    counts, cumulative, lead = _routing(groups, inputs, w)
    chains = [_chain(g.mm) for g in groups]
    out = chains[0][1].args[0]
    first = _signature(chains[0][0], groups[0].mm)
    for (ops, dst, copy), g in zip(chains, groups, strict=True):
        if dst.args[0] is not out:
            raise NotGrouped("the experts' results are not written into one output")
        if (dst.args[2], _end(dst)) != (g.start, g.end):
            raise NotGrouped("an expert's result is not written into the rows it was computed from")
        if _signature(ops, g.mm) != first:
            raise NotGrouped("the experts' products are not followed by the same row-wise ops")
        loop_nodes.update((*ops, dst, copy))
    if max(g.end for g in groups) != out.meta["val"].shape[0]:
        raise NotGrouped("the groups do not cover the output's rows")
    ops, _, copy = chains[0]
    return Loop(
        x, w, k_major, counts, cumulative, lead, out, groups[0].mm, ops, copy.args[1], loop_nodes
    ), names


def _transposed(n: Any) -> bool:
    """n is a 2-D matrix's transpose (t, or transpose of its last two dims)."""
    import torch

    aten = torch.ops.aten
    return _is(n, aten.t.default) or (_is(n, aten.transpose.int) and sorted(n.args[1:]) in ([-2, -1], [0, 1]))


def _rows(n: Any) -> tuple[Any, int, int] | None:
    """(tensor, start, end) when n is a slice of rows of a tensor (step 1), else None."""
    import torch

    if not (_is(n, torch.ops.aten.slice.Tensor) and n.args[1] == 0 and (n.args[4:] or (1,))[0] == 1):
        return None
    start = int(n.args[2] or 0) if len(n.args) > 2 else 0
    return n.args[0], start, start + int(n.meta["val"].shape[0])


_ZEROS = ("zeros", "new_zeros", "zeros_like")


def _recognise_wgrad(mms: list[Any], inputs: list, names: dict[Any, tuple[str, Any]]) -> Loop:
    """out[e] = x[rows of e]^T @ dy[rows of e] for each expert, out zeros where an expert has no token:
    the weight gradient of a grouped GEMM, one grouped GEMM whose groups split K (the tokens)."""
    import torch

    aten = torch.ops.aten
    groups: list[Group] = []
    operands, outs, loop_nodes = set(), set(), set()
    for mm in mms:
        a, b = mm.args
        ra, rb = (_rows(a.args[0]) if _transposed(a) else None), _rows(b)
        if ra is None or rb is None or ra[1:] != rb[1:]:
            raise NotGrouped("a weight gradient's product is not rows^T @ the same rows of another tensor")
        users = list(mm.users)
        if len(users) != 1 or not _is(users[0], aten.copy_.default) or users[0].args[1] is not mm:
            raise NotGrouped("an expert's weight gradient is not written once into the output")
        dst = users[0].args[0]
        if not (_is(dst, aten.select.int) and dst.args[1] == 0):
            raise NotGrouped("an expert's weight gradient is not written into out[e]")
        groups.append(Group(mm, int(dst.args[2]), ra[1], ra[2]))
        operands.add((ra[0], rb[0]))
        outs.add(dst.args[0])
        loop_nodes.update((mm, a, a.args[0], b, dst, users[0]))
    if len(operands) != 1 or len(outs) != 1:
        raise NotGrouped("the weight gradients do not all take rows of the same two tensors into one output")
    ((x, dy),), (out,) = operands, outs
    if names.get(x, ("",))[0] != "input" or names.get(dy, ("",))[0] != "input":
        raise NotGrouped("a weight gradient's operands are not forward inputs")
    if {x.meta["val"].dtype, dy.meta["val"].dtype} != {torch.bfloat16}:
        raise NotGrouped("grouped GEMMs are written for bf16 operands (as torch._grouped_mm)")
    if len({g.expert for g in groups}) != len(groups):
        raise NotGrouped("an expert's weight gradient is written twice")
    if not (out.op == "call_function" and _name(out).split(".")[0] in _ZEROS):
        raise NotGrouped(
            "the weight gradients' output does not start as zeros (an idle expert's would be junk)"
        )
    counts, cumulative, lead = _routing(groups, inputs, out)
    loop_nodes.add(out)
    return Loop(x, dy, False, counts, cumulative, lead, out, groups[0].mm, [], groups[0].mm, loop_nodes, True)


def _end(sl: Any) -> int | None:
    return int(sl.args[2]) + int(sl.meta["val"].shape[0])


def _is(node: Any, target: Any) -> bool:
    return getattr(node, "op", "") == "call_function" and node.target == target


def _routing(groups: list[Group], inputs: list, w: Any) -> tuple[int, bool, bool]:
    """The integer input whose values are the groups: sizes (counts) or running ends (offsets)."""
    import torch

    experts = w.meta["val"].shape[0]
    seen = {g.expert: (g.start, g.end) for g in groups}
    for pos, v in enumerate(inputs):
        if not isinstance(v, torch.Tensor) or v.is_floating_point() or v.dim() != 1:
            continue
        vals = [int(t) for t in v.tolist()]
        for cumulative, lead in ((False, False), (True, False), (True, True)):
            if len(vals) != experts + lead:
                continue
            ends = vals[lead:] if cumulative else [sum(vals[: e + 1]) for e in range(experts)]
            spans = list(zip(([vals[0]] if lead else [0]) + ends[:-1], ends, strict=True))
            # every non-empty group has its product; an empty one may be skipped or computed on no rows
            if all(seen.get(e, (s, s)) == (s, t) and (t == s or e in seen) for e, (s, t) in enumerate(spans)):
                return pos, cumulative, lead
    raise NotGrouped("no integer input gives the products' row ranges as counts or offsets per expert")


def _chain(mm: Any) -> tuple[list[Any], Any, Any]:
    """The row-wise ops from one product to the copy into its rows of an output: (ops, row slice, copy)."""
    import torch

    aten = torch.ops.aten
    ops: list[Any] = []
    frontier, copies = [mm], []
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u in ops or u in copies:
                continue
            if _is(u, aten.copy_.default) and u.args[1] is n:
                copies.append(u)
            elif _row_wise(u, n):
                ops.append(u)
                frontier.append(u)
            else:
                raise NotGrouped(f"an expert's result goes through {_name(u)}, which is not row-wise")
    if len(copies) != 1:
        raise NotGrouped("an expert's result is not written once into rows of an output")
    dst = copies[0].args[0]
    if not (_is(dst, aten.slice.Tensor) and dst.args[1] == 0):
        raise NotGrouped("an expert's result is not written into a slice of rows")
    order = {n: i for i, n in enumerate(mm.graph.nodes)}
    return sorted(ops, key=order.__getitem__), dst, copies[0]


def _row_wise(u: Any, src: Any) -> bool:
    """Whether op u, reading src, treats each row alone (so it may run once on all the experts' rows)."""
    import torch

    aten = torch.ops.aten
    if u.op != "call_function":
        return False
    if u.target is operator.getitem or u.target == aten._to_copy.default:
        return True
    if torch.Tag.pointwise in getattr(u.target, "tags", ()):
        rows = src.meta["val"].shape[0]
        others = [a.meta["val"] for a in u.args if hasattr(a, "op") and a is not src]
        return all(v.dim() < 2 or v.shape[0] in (1, rows) for v in others)
    if u.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return len(u.args) > 2 and u.args[2] in (-1, 1) and src.meta["val"].dim() == 2
    return False


def _name(n: Any) -> str:
    return str(getattr(n.target, "__name__", n.target))


def _signature(ops: list[Any], mm: Any) -> list[tuple]:
    """The ops and their arguments: the chain's own values by place (mm is 0), outside values as themselves
    (a per-expert slice of another tensor differs between experts, and is refused)."""
    place = {mm: 0, **{n: i + 1 for i, n in enumerate(ops)}}

    def arg(a: Any) -> Any:
        if hasattr(a, "op"):
            return ("chain", place[a]) if a in place else ("outside", id(a))
        if isinstance(a, list | tuple):
            return tuple(arg(x) for x in a)
        return a

    return [
        (str(n.target), arg(n.args), tuple(sorted((k, arg(v)) for k, v in n.kwargs.items()))) for n in ops
    ]


def _rebuild(model: Any, loop: Loop, names: dict[Any, tuple[str, Any]], n_inputs: int) -> Any:
    """A GraphModule over the model's own parameters: the loop replaced by torch._grouped_mm and its chain,
    then whatever else the output needs (a value only the loop's bookkeeping read is left out)."""
    import torch
    import torch.fx as fx

    aten = torch.ops.aten
    gm = loop.out.graph.owning_module
    g = fx.Graph()
    args = [g.placeholder(f"input_{i}") for i in range(n_inputs)]
    env: dict[Any, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            kind, key = names[node]
            env[node] = g.get_attr(key) if kind == "param" else args[key]
    c = args[loop.counts]
    if loop.cumulative:
        offs = g.call_function(aten.slice.Tensor, (c, 0, 1)) if loop.leading_zero else c
    else:
        offs = g.call_function(aten.cumsum.default, (c, 0))
    offs = g.call_function(aten._to_copy.default, (offs,), {"dtype": torch.int32})
    w = g.call_function(aten.transpose.int, (env[loop.w], -2, -1)) if loop.k_major else env[loop.w]
    # a weight gradient: x^T (H, tokens) times dy (tokens, I), the groups along the tokens (K)
    x = g.call_function(aten.t.default, (env[loop.x],)) if loop.ragged_k else env[loop.x]
    env[loop.mm] = g.call_function(aten._grouped_mm.default, (x, w, offs))
    for n in loop.chain:
        env[n] = g.node_copy(n, lambda a: env[a])
    env[loop.out] = env[loop.written]

    def value(a: Any) -> Any:
        if a not in env:
            raise NotGrouped(f"the output reads {_name(a)}, a value of one expert or of the routing")
        return env[a]

    for node in gm.graph.nodes:
        if node in env or node in loop.loop_nodes or node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            g.output(fx.node.map_arg(node.args[0], value))
        elif all(a in env for a in node.all_input_nodes):
            env[node] = g.node_copy(node, lambda a: env[a])
    g.eliminate_dead_code()
    return fx.GraphModule(model, g)


__all__ = ["NotGrouped", "rewrite"]
