"""Turn a lowered graph and a plan into a candidate: the CUDA source and the Python launcher (ModelNew)."""

from __future__ import annotations

import dataclasses
import keyword
import math
from typing import Any

from pipeline.generate.expert import ops, scans
from pipeline.generate.expert.families import FAMILIES, family_of, owner
from pipeline.generate.expert.families.base import RenderError
from pipeline.generate.expert.graph import Graph, Node, Ref
from pipeline.generate.expert.plan import Plan, header
from pipeline.generate.expert.regions import FALLBACK, Lowered, RegionKind, lower
from pipeline.generate.expert.shared_kernels import share_kernels
from pipeline.generate.expert.templates import gather
from pipeline.generate.expert.templates.code import (
    CUTE_FLAGS,
    GATHER,
    GATHER_HALF,
    LAUNCHER_HELPERS,
    RESHAPE_HELPERS,
    ROWS_HELPERS,
    SINK_HELPERS,
    STRIDED_HELPERS,
    Code,
    gathered,
)
from pipeline.generate.expert.templates.common import HALF_DEFINE, HALF_TYPES, ON_USE, PRELUDE

__all__ = ["RenderError", "nvcc_flags", "prepare", "render", "uses_cute"]


def prepare(graph: Graph) -> Lowered:
    """Lower the graph and let the families claim its regions: a region of a kind our kernels compute
    that no family takes (a row-wise op whose static shape no template fits) is left to PyTorch."""
    low = lower(graph)
    regions = []
    torch_notes: list[str] = []
    unfit: list[str] = []
    for r in low.regions:
        claimed = family_of(r, low) is not None
        if not claimed and r.kind not in FALLBACK:
            note = f"{r.node.target} left to PyTorch (its dimensions do not fit a row-wise template)"
            r = dataclasses.replace(r, kind=RegionKind.TORCH, note=note)
            unfit.append(note)
        elif not claimed and r.kind is RegionKind.TORCH:
            why = next(((f.tag, w) for f in FAMILIES if (w := f.declines(r, low))), None)
            if why is not None:  # one of our families' ops, declined: its reason, not "no template"
                r = dataclasses.replace(r, note=f"{r.node.target} left to PyTorch ({why[0]}: {why[1]})")
            torch_notes.append(r.note)
        regions.append(r)
    return dataclasses.replace(low, regions=tuple(regions), notes=(*low.notes, *torch_notes, *unfit))


def render(low: Lowered, plan: Plan, hunter: Any = None) -> tuple[str, str]:
    """(CUDA source, launcher source). The CUDA source's first line holds the plan."""
    fused = plan.fused()
    codes: dict[str, Code] = {}
    for r in low.regions:
        if r.rid in fused:
            continue
        family, rp = family_of(r, low), plan.get(r.rid)
        if rp is None:
            if family is not None and not family.optional:
                raise RenderError(f"the plan has no entry for region {r.rid}")
            continue  # the launcher runs it with torch: a library call, a view, an op we do not cover
        if family is None or not isinstance(rp, family.knobs):
            raise RenderError(f"region {r.rid} is not one the plan's {rp.TAG} entry can compute")
        codes[r.rid] = family.render(r, rp, low, hunter)
    if not codes:
        raise RenderError("no region is computed by our kernels")
    # repeated blocks (a ResNet's, a transformer's layers, an unrolled RNN's steps): one copy of each text
    codes = share_kernels(
        codes, (PRELUDE, HALF_DEFINE, GATHER, GATHER_HALF, gather.FAST_GATHER, *ON_USE.values())
    )
    # fp16/bf16 headers, helpers and gathers only where a kernel or launcher uses them: the headers are
    # most of a float-only build's nvcc time
    half = any(HALF_TYPES.search(c.cuda) or HALF_TYPES.search(c.launcher) for c in codes.values())
    head = [header(plan), HALF_DEFINE, PRELUDE] if half else [header(plan), PRELUDE]
    head += on_use([c.cuda for c in codes.values()])
    tail = [GATHER, GATHER_HALF] if half else [GATHER]
    fast = gather.wanted(low)  # views the launcher may gather: the fast fp32 gather beside the generic one
    if fast:
        tail.append(gather.FAST_GATHER)
    cuda = "\n".join([*head, *(c.cuda for c in codes.values()), *tail]) + "\n"
    return cuda, _launcher(low, plan, codes, half, fast)


def on_use(texts: list[str]) -> list[str]:
    """The ON_USE helpers the kernels call, and those these call in turn (ON_USE lists a callee before its
    callers, so each is defined before its first use)."""
    used: set[str] = set()
    while True:
        grown = {n for n in ON_USE if any(f"{n}(" in t for t in (*texts, *(ON_USE[u] for u in used)))}
        if grown == used:
            return [text for name, text in ON_USE.items() if name in used]
        used = grown


def uses_cute(plan: Plan) -> bool:
    """Whether the plan's source includes CuTe (it then needs nvcc's --expt-relaxed-constexpr)."""
    return any(owner(rp).cute for rp in plan.regions)


def nvcc_flags(plan: Plan) -> tuple[str, ...]:
    """The extra nvcc flags the plan's source needs."""
    return CUTE_FLAGS if uses_cute(plan) else ()


# ---------------------------------------------------------------------------------------------------------
# The launcher


def _launcher(low: Lowered, plan: Plan, codes: dict[str, Code], half: bool, fast_gather: bool) -> str:
    g = low.graph
    fused = plan.fused()
    summary = "; ".join(f"{r.rid}: {r.kind}" for r in low.regions if r.rid not in fused)
    lines = [
        f'"""kernelpro expert launcher for {g.task_id} ({summary})."""',
        "",
        "import math",
        "",
        "import numpy",
        "import torch",
        "import torch.nn as nn",
        "import torch.nn.functional as F",
        gathered(half),
        LAUNCHER_HELPERS,
        *([gather.FAST_CONTIG] if fast_gather else []),
    ]
    model = _model(low, plan, codes)
    if any("_reshape(" in ln for ln in model):
        lines.append(RESHAPE_HELPERS)
    if any("_strided(" in ln for ln in model):
        lines.append(STRIDED_HELPERS)
    sinking = any(c.into or c.sinks for c in codes.values())
    if sinking or any("_rows_in_place(" in c.launcher or "_rows_grid(" in c.launcher for c in codes.values()):
        lines.append(ROWS_HELPERS)
    if sinking:
        lines.append(SINK_HELPERS)
    for c in codes.values():
        lines += ["", c.launcher, ""]
    lines += ["", *model]
    return "\n".join(lines).rstrip() + "\n"


def py(value: str, low: Lowered) -> str:
    """The Python name of a graph value inside forward."""
    return value if low.by_name[value].op == "input" else f"v_{value}"


def _model(low: Lowered, plan: Plan, codes: dict[str, Code]) -> list[str]:
    g = low.graph
    fused = plan.fused()
    lines = [
        "class ModelNew(nn.Module):",
        f"    def __init__(self{', ' if g.init_params else ''}{g.init_params}):",
    ]
    lines += ["        super().__init__()", "        self.sms = 0  # SM count, read on the first call"]
    holders = _holders(g)
    lines += _state(g, holders)
    used = {i for r in low.regions for i in r.inputs} | set(g.output_names())
    reads = [p for p in g.params if p.name in used]
    if len(reads) >= HELD_STATE and len(holders) > 1:
        held = [h for h in holders.values() if h != "self"]
        lines.append(f"        self._kp_holders = ({', '.join(held)},)  # the forward reads their tensors")
    args = ", ".join(g.forward_args)
    if plan.graph:  # forward replays the body below from a CUDA graph (runtime.Graphs)
        lines += [
            "",
            f"    def forward(self{', ' if args else ''}{args}):",
            f"        return kernels.graphed(self, self._kp_forward, ({args}{',' if len(g.forward_args) == 1 else ''}))"
            "  # noqa: F821",
            "",
            f"    def _kp_forward(self{', ' if args else ''}{args}):",
        ]
    else:
        lines += ["", f"    def forward(self{', ' if args else ''}{args}):"]
    first = g.inputs[0].name if g.inputs else None
    for name, value in g.scalars:  # specialized at capture, as torch.export does
        # Compared inside a tuple: a bare `s != 3.14` reads as a tensor op to the static check (an argument
        # may be a tensor), which would call every candidate of such a task hybrid.
        lines += [
            f"        if ({name},) != ({value!r},):",
            f"            raise ValueError(f'kernelpro expert: compiled for {name} = {value!r} (the value the "
            f"reference was captured with), got {{{name}!r}}')",
        ]
    if first:
        lines += [
            "        if not self.sms:",
            f"            self.sms = torch.cuda.get_device_properties({first}.device).multi_processor_count",
        ]
    lines += _state_reads(g, reads, holders)
    calls = {c.at or rid: c for rid, c in codes.items()}
    needed = _needed(low, fused, codes)
    sunk = _sunk(low, codes)
    for r in low.regions:
        if r.rid in calls:
            c = calls[r.rid]
            outs = ", ".join(py(o, low) for o in c.outputs)
            names = [py(a, low) for a in c.args]
            args = ", ".join(names)
            if c.outputs[0] in sunk:  # computed later, into its slice of the cat's output
                lines.append(
                    f"        {outs} = _Slot(torch.{c.into}, {c.slot.format(*names)}, {names[0]}.device)"
                )
            elif c.sinks:
                lines.append(f"        {outs}, s_{r.rid} = {c.fn}(self.sms, {args})")
                for k, v in enumerate(a for a in c.sinks if a in sunk):
                    p = sunk[v]
                    lines.append(
                        f"        {p.fn}(self.sms, {', '.join(py(a, low) for a in p.args)}, out=s_{r.rid}[{k}])"
                    )
            else:
                lines.append(f"        {outs} = {c.fn}(self.sms, {args})")
        if r.rid in fused or r.rid in codes:
            continue
        for n in r.nodes:
            if n.name in needed:
                lines.append(f"        {py(n.name, low)} = {_torch_call(n, low, first)}")
    outs = [py(o.name, low) if isinstance(o, Ref) else _lit(o, low, first) for o in g.outputs]
    if len(outs) == 1 and not g.returns_tuple:
        lines.append(f"        return {outs[0]}")
    else:
        lines.append(f"        return ({', '.join(outs)},)")
    return lines


def _sunk(low: Lowered, codes: dict[str, Code]) -> dict[str, Code]:
    """The outputs a cat or stack launcher takes as _Slot stand-ins, each with the elementwise code that
    computes it: that code runs after the consumer has allocated its output and writes into its slice (the
    copy of a concatenated activation disappears). Its call moves from its own place to the consumer's,
    so none of its operands may be overwritten in place in between (none is, anywhere)."""
    by_out = {c.outputs[0]: c for c in codes.values() if c.into and len(c.outputs) == 1}
    overwritten = {i for r in low.regions for _, i in r.inplace}
    sunk: dict[str, Code] = {}
    for c in codes.values():
        for v in c.sinks:
            p = by_out.get(v)
            if p is not None and c.sinks.count(v) == 1 and not set(p.args) & overwritten:
                sunk[v] = p
    return sunk


def _needed(low: Lowered, fused: set[str], codes: dict[str, Code]) -> set[str]:
    """The values the launcher computes with torch: those forward returns or a kernel reads, and what they
    need. A view only a fused kernel read (the halves of a product its gated epilogue took) is left out."""
    needed = set(low.graph.output_names()) | {a for c in codes.values() for a in c.args}
    for r in reversed(low.regions):
        if r.rid in fused or r.rid in codes:
            continue
        for n in reversed(r.nodes):
            if n.name in needed:
                needed.update(n.refs())
    return needed


HELD_STATE = 16  # parameters and buffers from which the forward reads them through their holders


def _holders(g: Graph) -> dict[str, str]:
    """The module holding each dotted prefix of the state's keys, as _state names it (self, m0, m1, ...)."""
    holders: dict[str, str] = {"": "self"}
    for s in g.state:
        parts = s.key.split(".")
        for i in range(1, len(parts)):
            holders.setdefault(".".join(parts[:i]), f"m{len(holders) - 1}")
    return holders


def _state_reads(g: Graph, params: list, holders: dict[str, str]) -> list[str]:
    """The forward's reads of the reference's parameters and buffers. get_parameter / get_buffer resolve a
    dotted name anew, ~10 us each on the host (a SwinV2's 221 took 2 ms of every call, its GPU idle
    meanwhile); with many, each is read from its holder module, kept in `_kp_holders` (a plain tuple: not
    registered, not in the state dict), as an attribute: ~0.5 us, and always the holder's current tensor."""
    index = {h: i for i, h in enumerate(v for v in holders.values() if v != "self")}
    lines = []
    for p in params:
        key = p.args[0]
        owner, _, leaf = key.rpartition(".")
        if len(params) >= HELD_STATE and leaf.isidentifier() and not keyword.iskeyword(leaf):
            h = holders[owner]
            lines.append(
                f"        v_{p.name} = {'self' if h == 'self' else f'self._kp_holders[{index[h]}]'}.{leaf}"
            )
        else:
            getter = "get_parameter" if any(s.key == key and s.parameter for s in g.state) else "get_buffer"
            lines.append(f"        v_{p.name} = self.{getter}({key!r})")
    return lines


def _state(g: Graph, holders: dict[str, str]) -> list[str]:
    """The reference's parameters and buffers under the same names, so the harness copies its weights in."""
    if not g.state:
        return []
    lines = [
        "        # the reference's parameters and buffers, same names and shapes (its weights are copied in)"
    ]
    order = [path for path in holders if path]
    lines += [f"        {holders[path]} = nn.Module()" for path in order]
    for s in g.state:
        owner, _, leaf = s.key.rpartition(".")
        t = f"torch.zeros({s.shape!r}, dtype=torch.{s.dtype})"
        if s.parameter:
            req = "" if s.dtype in ("float32", "float16", "bfloat16", "float64") else ", requires_grad=False"
            lines.append(f"        {holders[owner]}.register_parameter({leaf!r}, nn.Parameter({t}{req}))")
        else:
            lines.append(f"        {holders[owner]}.register_buffer({leaf!r}, {t})")
    for path in reversed(order):  # children attached before their parents
        owner, _, leaf = path.rpartition(".")
        lines.append(f"        {holders[owner]}.add_module({leaf!r}, {holders[path]})")
    return lines


_OPERATORS = {"__and__": "bitwise_and", "__or__": "bitwise_or", "__xor__": "bitwise_xor",
              "__lshift__": "bitwise_left_shift", "__rshift__": "bitwise_right_shift"}  # fmt: skip
_LIBRARY = {"gemm_mm": "torch.mm", "gemm_bmm": "torch.bmm", "gemm_matmul": "torch.matmul"}


def _torch_call(n: Node, low: Lowered, first: str | None) -> str:
    """A library, view or fallback node as one torch expression."""
    a = [_lit(x, low, first) for x in n.args]
    if n.op == "gemm_linear":  # the GEMM without its bias: our epilogue adds it
        return f"torch.matmul({a[0]}, {a[1]}.t())"
    if n.op in _LIBRARY:
        return f"{_LIBRARY[n.op]}({a[0]}, {a[1]})"
    if n.op == "gemm_grouped":
        return f"torch._grouped_mm({a[0]}, {a[1]}, offs={a[2]})"
    if n.op == "_to_copy" and set(dict(n.kwargs)) <= {"dtype"}:
        return f"{a[0]}.to({_lit(n.kw('dtype'), low, first)})"
    if n.op.startswith("conv"):
        return f"F.{n.op}({', '.join(a)})"
    view = _view(n, a, low)
    if view is not None:
        return view
    if n.op in ops.KEYED_SCANS:  # one of cummax / cummin's pair (regions.py): no ATen op of its own
        op, item = ops.KEYED_SCANS[n.op]
        return f"torch.{op}({a[0]}, {a[1]})[{item}]"
    if n.op in ops.SCANS and (n.kw("reverse") or n.kw("exclusive")):  # folded (scans.py): no ATen op
        return scans.torch_expr(n, a[0], scans.grow(n, low.by_name[n.args[0].name]))
    kw = "".join(f", {k}={_lit(v, low, first)}" for k, v in n.kwargs)
    if n.op in _OPERATORS:  # x & y on integers: aten.__and__ by its public name (the check bars dunders)
        return f"torch.{_OPERATORS[n.op]}({', '.join(a)})"
    if (public := _public_resample(n, a)) is not None:
        return public
    if n.op.startswith("_") or not n.target.startswith("aten."):
        raise RenderError(f"{n.target} cannot be left to PyTorch from a launcher (no public torch call)")
    return f"torch.ops.aten.{n.op}.{n.overload}({', '.join(a)}{kw})"


# Private resampling ops (the launcher's check bars aten._ names) by the public call that reaches them:
# op -> (F.interpolate's mode, antialias, whether align_corners follows the output size)
_RESAMPLE = {
    **{f"_upsample_nearest_exact{d}d": ("nearest-exact", False, False) for d in (1, 2, 3)},
    "_upsample_bilinear2d_aa": ("bilinear", True, True),
    "_upsample_bicubic2d_aa": ("bicubic", True, True),
}


def _public_resample(n: Node, a: list[str]) -> str | None:
    """F.interpolate or F.adaptive_avg_poolNd for a private ATen resampling op (.vec overloads)."""
    if n.op.startswith("_adaptive_avg_pool") and len(a) == 2:
        return f"F.{n.op[1:]}({a[0]}, {a[1]})"
    if n.op not in _RESAMPLE or n.overload != "vec":
        return None
    mode, aa, aligned = _RESAMPLE[n.op]
    size, scales = a[1], a[3 if aligned else 2]
    align = f", align_corners={a[2]}" if aligned else ""
    return (f"F.interpolate({a[0]}, size={size}, scale_factor={scales}, mode={mode!r}{align}"
            f"{', antialias=True' if aa else ''})")  # fmt: skip


def _view(n: Node, a: list[str], low: Lowered) -> str | None:
    x = a[0] if a else ""
    src = low.by_name.get(n.args[0].name) if n.args and isinstance(n.args[0], Ref) else None
    if n.op in ("view", "reshape", "_unsafe_view", "expand"):
        shape = tuple(n.args[1])
        if src and src.shape and len(shape) >= 2 and shape[0] == src.shape[0] and shape[0] != -1:
            dims = ", ".join([f"{x}.shape[0]", *(str(s) for s in shape[1:])])  # keep the batch size dynamic
        else:
            dims = ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "")
        if n.op == "expand":
            return f"{x}.expand({dims})"
        return f"_reshape({x}, ({dims}))"
    if n.op in ("flatten", "unflatten", "permute", "transpose", "unsqueeze", "select", "narrow", "split",
                "split_with_sizes", "chunk", "unbind", "diagonal"):  # fmt: skip
        method = "split" if n.op == "split_with_sizes" else n.op
        return f"{x}.{method}({', '.join(a[1:])})"
    if n.op == "as_strided":  # a chain's elements at its strides from its offset (chains.py)
        return f"_strided({x}, {n.args[1]!r}, {n.args[2]!r}, {n.args[3]!r})"
    if n.op == "t":
        return f"{x}.t()"
    if n.op == "numpy_T":  # x.T: every dim reversed
        return f"{x}.permute({', '.join(str(d) for d in reversed(range(len(n.shape or ()))))})"
    if n.op == "squeeze":
        return f"{x}.squeeze({', '.join(a[1:])})"
    if n.op == "slice":
        d, start, end, step = (list(n.args[1:]) + [0, None, None, 1][len(n.args) - 1 :])[:4]
        s = f"{'' if start is None else start}:{'' if end is None else end}:{step or 1}"
        return f"{x}[{':, ' * int(d or 0)}{s}]"
    if n.op == "getitem":
        return f"{x}[{a[1]}]"
    return None


def _lit(v: Any, low: Lowered, first: str | None) -> str:
    if isinstance(v, Ref):
        return py(v.name, low)
    if isinstance(v, tuple):
        if len(v) == 2 and v[0] == "dtype":
            return f"torch.{v[1]}"
        if len(v) == 2 and v[0] == "device":
            if first is None:
                raise RenderError("a device argument with no tensor input to take it from")
            return f"{first}.device"
        if len(v) == 2 and v[0] == "torch":
            return f"torch.{v[1]}"
        if len(v) == 2 and v[0] == "opaque":
            raise RenderError(f"an argument of type {v[1]} cannot be written into a launcher")
        return "(" + "".join(f"{_lit(x, low, first)}, " for x in v).rstrip() + ")"
    if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
        return f"float({str(v)!r})"
    return repr(v)
