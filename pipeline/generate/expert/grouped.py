"""Recognise a Mixture-of-Experts projection written as a loop over experts, and rewrite it as one grouped GEMM.

MoE code without a grouped kernel loops over the experts: tokens sorted by expert, `counts[e]` rows of x
(a tensor input) multiplied by expert e's weight, each product through the same few row-wise ops and
written into its rows of the output. torch.export cannot capture that (the slice bounds are values), so:

1. trace the forward with make_fx on the meta device, its integer inputs real (a routing the task draws):
   the loop unrolls into one `mm` per expert on `x[start:end]` and `w[e]`. A routing computed from float
   data (a whole MoE block: router, top-k, tokens per expert) is traced with real inputs on the CPU and the
   expert stacks on meta (cheap_values.py), and found among the traced values;
2. check that the slices are exactly the groups that routing defines (counts, or their running sum),
   that every product runs the same row-wise chain (which may multiply by the same expert's slice of
   another stack: fc1, SwiGLU, fc2) and lands in its own rows of one output, and that nothing else reads
   the loop's values;
3. trace again with another routing: the same structure must come out (no branch on the values);
4. rewrite: `torch._grouped_mm(x, w, offs=cumsum(counts))`, the chain once on its result (a product in it
   a second grouped GEMM on the same groups).

The rewritten module is then exported like any other reference. What is not recognised is said in one line.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from pipeline.tasks import valued_inputs


class NotGrouped(Exception):
    """The forward is not a loop over experts we can rewrite; the message says why in one line."""


class _NeedsValues(NotGrouped):
    """Tracing with meta float inputs failed: the forward reads values computed from float data."""


@dataclass(frozen=True)
class Group:
    mm: Any  # the fx node of this expert's product
    expert: int
    start: int
    end: int


@dataclass(frozen=True)
class Loop:
    x: Any  # the fx node the rows come from (an input, or tokens gathered in the forward)
    w: Any  # the fx placeholder of the stacked weights (E, K, N) or (E, N, K)
    k_major: bool  # w[e] is (N, K), used transposed
    counts: Any  # the position of the integer input that defines the groups, or the traced node computing it
    cumulative: bool  # counts holds running ends (offsets), not sizes
    leading_zero: bool  # offsets with a leading 0 (E + 1 entries)
    out: Any  # the output buffer the groups are written into
    mm: Any  # the first group's product
    chain: list[Any]  # the first group's row-wise ops after its product
    written: Any  # the value the first group writes into its rows (its product, or the chain's last op)
    loop_nodes: set[Any]  # every node of the unrolled loop, dropped by the rewrite
    ragged_k: bool = False  # a weight gradient: out[e] = x[rows of e]^T @ w[rows of e], the groups along K
    products: dict[Any, tuple[Any, bool]] = field(default_factory=dict)  # chain mm -> (its stack, K-major)


def rewrite(module: ModuleType, model: Any) -> Any:
    """A module computing the same as `model` (on meta) with its expert loop as grouped GEMMs (one per
    product in an expert's chain); raises NotGrouped."""
    inputs = valued_inputs(module)
    try:
        loop, names = _recognise(model, inputs)
    except _NeedsValues as e:
        if not any(p.dim() == 3 for p in model.parameters()):  # no expert stack: not worth a CPU run
            raise NotGrouped(str(e)) from None
        return _rewrite_computed_routing(module, model, len(inputs))
    # the same structure under another routing: the loop does not branch on the values
    other = _other_routing(inputs[loop.counts], loop.cumulative, loop.leading_zero)
    _recognise(model, [other if i == loop.counts else x for i, x in enumerate(inputs)])
    return _rebuild(model, loop, names, len(inputs))


def _rewrite_computed_routing(module: ModuleType, model: Any, n_inputs: int) -> Any:
    """rewrite() for a routing computed in the forward (an MoE block): traced with real inputs on the CPU,
    the expert stacks on meta; the same structure must come out of a second draw of the inputs."""
    import torch

    from pipeline import cheap_values

    traces = []
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("cpu"):
                init_args = list(module.get_init_inputs())
            cheap = cheap_values.model(module, init_args)
            for seed in (0, 1):
                torch.manual_seed(seed)
                traces.append(_recognise(cheap, cheap_values.inputs(module), computed=True))
        except (ValueError, RuntimeError, NotImplementedError) as e:
            raise NotGrouped(f"running it with real inputs on the CPU raised {_line(e)}") from None
    loop, names = traces[0]
    return _rebuild(model, loop, names, n_inputs)


def _other_routing(v: Any, cumulative: bool, lead: bool) -> Any:
    """The same tokens with the group sizes rotated by one expert (idle experts move too)."""
    import torch

    if not cumulative:
        return v.roll(1)
    first = v[:1] if lead else torch.zeros(1, dtype=v.dtype)
    ends = v[1:] if lead else v
    moved = torch.diff(ends, prepend=first).roll(1).cumsum(0) + first
    return torch.cat([first, moved]) if lead else moved


def _trace(model: Any, inputs: list, computed: bool = False) -> tuple[Any, dict[Any, tuple[str, Any]]]:
    """The forward unrolled by make_fx, its integer inputs held as constants (their values drive the loop:
    `int(counts[e])`, `.tolist()`). Each placeholder -> ("param", state key) or ("input", position).
    computed: the inputs are real and the model's expert stacks on meta (cheap_values.py)."""
    import contextlib

    import torch
    import torch.utils._pytree as pytree
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    from pipeline import cheap_values

    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    traced = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.is_floating_point()]

    def forward(st: dict, *xs: Any) -> Any:
        args = list(inputs)
        for i, x in zip(traced, xs, strict=True):
            args[i] = x
        return functional_call(model, st, tuple(args))

    try:
        with torch.no_grad(), cheap_values.mode() if computed else contextlib.nullcontext():
            gm = make_fx(forward, tracing_mode="real", _error_on_data_dependent_ops=False)(
                state, *(inputs[i] for i in traced)
            )
    except Exception as e:
        # values read from meta data (`.tolist()` of a routing computed from a float input): worth a trace
        # with real inputs; any other failure is not
        kind = _NeedsValues if not computed and "meta tensor" in str(e).lower() else NotGrouped
        raise kind(f"tracing the forward with real routing raised {type(e).__name__}: {_line(e)}") from None
    if computed:  # the routing is among the traced values: keep them for _routing
        cheap_values.strip_meta_moves(gm)
        gm.meta["values"] = cheap_values.values(gm, [*state.values(), *(inputs[i] for i in traced)])
    leaves, _ = pytree.tree_flatten((state, *(inputs[i] for i in traced)))
    keys = [("param", k) for k in state] + [("input", i) for i in traced]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(leaves) or len(keys) != len(leaves):
        raise NotGrouped("the traced forward's arguments do not match its parameters and inputs")
    return gm, dict(zip(placeholders, keys, strict=True))


def _line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(e).__name__


def _recognise(model: Any, inputs: list, computed: bool = False) -> tuple[Loop, dict[Any, tuple[str, Any]]]:
    import torch

    aten = torch.ops.aten
    gm, names = _trace(model, inputs, computed)
    mms = [n for n in gm.graph.nodes if _is(n, aten.mm.default)]
    if len(mms) < 2:
        raise NotGrouped("the traced forward has no loop of matrix products over experts")
    if _is(mms[0].args[1], aten.slice.Tensor):  # both operands rows of a group: a weight gradient
        return _recognise_wgrad(mms, inputs, names), names
    # the experts' products: a 3-D stack's slice w[e] on the right (a router's product is outside the loop)
    products = [mm for mm in mms if _expert_weight(mm.args[1])]
    if not products:
        raise NotGrouped("no product takes one expert's slice w[e] of stacked weights")
    groups: list[Group] = []
    loop_nodes: set[Any] = set()
    operands = set()
    chained: set[Any] = set()  # products inside an expert's chain (fc2 after fc1)
    for mm in products:
        if mm in chained:
            continue
        a, b = mm.args
        rows = _rows(a)
        if rows is None:
            raise NotGrouped("a product's rows are not a slice of the tokens")
        stack, expert, k_major = _expert_weight(b)  # type: ignore[misc]
        groups.append(Group(mm, expert, rows[1], rows[2]))
        operands.add((rows[0], stack, k_major))
        loop_nodes.update((mm, a, b, b.args[0] if k_major else b))
        chained.update(n for n in _chain(mm)[0] if _is(n, aten.mm.default))
    if len(operands) != 1:
        raise NotGrouped("the products do not all take rows of one tensor and one stack of weights")
    ((x, w, k_major),) = operands
    if names.get(w, ("",))[0] != "param" or names.get(x, ("",))[0] == "param":
        raise NotGrouped("the rows are a parameter, or the weights not one")
    dtypes = {x.meta["val"].dtype, w.meta["val"].dtype}
    if dtypes != {torch.bfloat16}:
        raise NotGrouped(f"grouped GEMMs are written for bf16 operands (as torch._grouped_mm), not {dtypes}")
    if len({g.expert for g in groups}) != len(groups):
        raise NotGrouped("an expert's weight is used by two products")
    counts, cumulative, lead = _routing(groups, inputs, w, gm.meta.get("values", {}))
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
        for n in ops:  # a product in the chain takes the same expert's slice of its stack
            if _is(n, aten.mm.default):
                stack, expert, km = _expert_weight(n.args[1])  # type: ignore[misc]
                if expert != g.expert or stack.meta["val"].dtype != torch.bfloat16:
                    raise NotGrouped("a product in an expert's chain takes another expert's bf16 weights")
                loop_nodes.update((n.args[1], n.args[1].args[0] if km else n.args[1]))
        loop_nodes.update((*ops, dst, copy))
    if max(g.end for g in groups) != out.meta["val"].shape[0]:
        raise NotGrouped("the groups do not cover the output's rows")
    ops, _, copy = chains[0]
    second = {n: _expert_weight(n.args[1])[::2] for n in ops if _is(n, aten.mm.default)}  # type: ignore[index]
    return Loop(
        x, w, k_major, counts, cumulative, lead, out, groups[0].mm, ops, copy.args[1], loop_nodes,
        products=second,
    ), names  # fmt: skip


def _expert_weight(b: Any) -> tuple[Any, int, bool] | None:
    """(stack, e, K-major) when b is w[e] of a 3-D stack w, or its transpose; else None."""
    import torch

    k_major = _transposed(b)
    sel = b.args[0] if k_major else b
    if not (_is(sel, torch.ops.aten.select.int) and sel.args[1] == 0):
        return None
    stack = sel.args[0]
    if getattr(stack.meta.get("val"), "ndim", 0) != 3:
        return None
    return stack, int(sel.args[2]), k_major


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


def _routing(
    groups: list[Group], inputs: list, w: Any, computed: dict[Any, Any] | None = None
) -> tuple[Any, bool, bool]:
    """The integer input whose values are the groups: sizes (counts) or running ends (offsets); else the
    traced node (of `computed`, node -> value) that computes them."""
    import torch

    experts = w.meta["val"].shape[0]
    seen = {g.expert: (g.start, g.end) for g in groups}
    for pos, v in [*enumerate(inputs), *(computed or {}).items()]:
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
    where = "integer input or value computed in the forward" if computed else "integer input"
    raise NotGrouped(f"no {where} gives the products' row ranges as counts or offsets per expert")


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
    # a product with an expert's slice of a stack (fc2 after fc1's SwiGLU): row by row too
    return u.target == aten.mm.default and u.args[0] is src and _expert_weight(u.args[1]) is not None


def _name(n: Any) -> str:
    return str(getattr(n.target, "__name__", n.target))


def _signature(ops: list[Any], mm: Any) -> list[tuple]:
    """The ops and their arguments: the chain's own values by place (mm is 0), outside values as themselves
    (a per-expert slice of another tensor differs between experts, and is refused)."""
    place = {mm: 0, **{n: i + 1 for i, n in enumerate(ops)}}

    def arg(a: Any) -> Any:
        if hasattr(a, "op"):
            weight = _expert_weight(a)
            if (
                weight
            ):  # an expert's slice of a stack: the stack and its orientation (the expert is checked apart)
                return ("expert", id(weight[0]), weight[2])
            return ("chain", place[a]) if a in place else ("outside", id(a))
        if isinstance(a, list | tuple):
            return tuple(arg(x) for x in a)
        return a

    return [
        (str(n.target), arg(n.args), tuple(sorted((k, arg(v)) for k, v in n.kwargs.items()))) for n in ops
    ]


def _rebuild(model: Any, loop: Loop, names: dict[Any, tuple[str, Any]], n_inputs: int) -> Any:
    """A GraphModule over the model's own parameters, in the traced order: the loop replaced by
    torch._grouped_mm and its chain where its first product was, then whatever else the output needs (a
    value only the loop's bookkeeping read is left out)."""
    import torch
    import torch.fx as fx

    aten = torch.ops.aten
    gm = loop.out.graph.owning_module
    g = fx.Graph()
    args = [g.placeholder(f"input_{i}") for i in range(n_inputs)]
    env: dict[Any, Any] = {}

    def grouped(a: Any, w: Any, k_major: bool) -> Any:
        w = g.call_function(aten.transpose.int, (env[w], -2, -1)) if k_major else env[w]
        return g.call_function(aten._grouped_mm.default, (a, w, offs))

    def value(a: Any) -> Any:
        if a not in env:
            raise NotGrouped(f"the output reads {_name(a)}, a value of one expert or of the routing")
        return env[a]

    offs = None
    hoisted = _independent_after(gm, loop)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            kind, key = names[node]
            env[node] = g.get_attr(key) if kind == "param" else args[key]
        elif node is loop.mm:
            for n in hoisted:  # values the loop does not feed, needed after it: ready for its epilogue
                env[n] = g.node_copy(n, lambda a: env[a])
            c = args[loop.counts] if isinstance(loop.counts, int) else env[loop.counts]
            if loop.cumulative:
                offs = g.call_function(aten.slice.Tensor, (c, 0, 1)) if loop.leading_zero else c
            else:
                offs = g.call_function(aten.cumsum.default, (c, 0))
            offs = g.call_function(aten._to_copy.default, (offs,), {"dtype": torch.int32})
            # a weight gradient: x^T (H, tokens) times dy (tokens, I), the groups along the tokens (K)
            x = g.call_function(aten.t.default, (env[loop.x],)) if loop.ragged_k else env[loop.x]
            env[loop.mm] = grouped(x, loop.w, loop.k_major)
            for n in loop.chain:
                if n in loop.products:  # fc2 after fc1: the same groups
                    env[n] = grouped(env[n.args[0]], *loop.products[n])
                else:
                    env[n] = g.node_copy(n, lambda a: env[a])
            env[loop.out] = env[loop.written]
        elif node in env or node in loop.loop_nodes or node.op == "get_attr":
            continue
        elif node.op == "output":
            g.output(fx.node.map_arg(node.args[0], value))
        elif all(a in env for a in node.all_input_nodes):
            env[node] = _static_bincount(g, node, env) or g.node_copy(node, lambda a: env[a])
    g.eliminate_dead_code()
    return fx.GraphModule(model, g)


def _independent_after(gm: Any, loop: Loop) -> list[Any]:
    """The pure nodes after the loop that do not read its results, up to the first op that writes in place:
    computed before the grouped GEMM instead, so an elementwise op that combines the two (the top-k weights
    times fc2's rows) finds its other operand ready and can run on the GEMM's stores."""
    after, out, ready = False, [], set()  # ready: what the rebuilt graph has before the loop (as _rebuild)
    written = {loop.out}  # the loop's output buffer and any view of it: read only after the loop
    for node in gm.graph.nodes:
        if node is loop.mm:
            after = True
        if node.op == "placeholder":
            ready.add(node)
        if any(a in written for a in node.all_input_nodes):
            written.add(node)
        if node in loop.loop_nodes or node in written or node.op != "call_function":
            continue
        if after and getattr(getattr(node.target, "_schema", None), "is_mutable", False):
            break
        if all(a in ready for a in node.all_input_nodes):
            ready.add(node)
            if after:
                out.append(node)
    return out


def _static_bincount(g: Any, node: Any, env: dict[Any, Any]) -> Any:
    """bincount(v, minlength=E) as a scatter-add into E zeros, when the trace gave it E entries: export cannot
    size a bincount (its length is the data's maximum), and tokens per expert of a top-k routing never need
    more than E. None for any other node."""
    import torch

    aten = torch.ops.aten
    if not _is(node, aten.bincount.default):
        return None
    weights = node.args[1] if len(node.args) > 1 else node.kwargs.get("weights")
    minlength = node.args[2] if len(node.args) > 2 else node.kwargs.get("minlength", 0)
    if weights is not None or int(node.meta["val"].shape[0]) != minlength:
        return None
    v = env[node.args[0]]
    zeros = g.call_function(aten.new_zeros.default, (v, [minlength]), {"dtype": torch.int64})
    ones = g.call_function(aten.ones_like.default, (v,), {"dtype": torch.int64})
    return g.call_function(aten.scatter_add.default, (zeros, 0, v, ones))


__all__ = ["NotGrouped", "rewrite"]
