"""Capture a task's reference computation as a small graph of canonical ATen ops with static shapes.

The reference is exported with `torch.export` on the meta device (no memory, no data), so every op comes
out canonical (`F.gelu`, `nn.GELU` and `x.gelu()` are all `gelu`), with its shape and dtype. Parameters
and buffers keep their state_dict names, so a generated `ModelNew` can hold the same ones and the harness
copies the reference's weights into it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import io
import logging
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from pipeline.generate.expert import recurrent
from pipeline.tasks import TaskError, load_module, meta_inputs, model_on_meta


class CaptureError(Exception):
    """The reference cannot be captured; the message says why in one line."""


@dataclass(frozen=True)
class Ref:
    """A reference to another value of the graph (a node's output)."""

    name: str


@dataclass(frozen=True)
class Node:
    name: str  # the value it defines (export's node name: a valid identifier)
    op: str  # canonical ATen op without namespace and overload ("add", "linear", "getitem"), or "input"/"param"
    overload: str = ""
    args: tuple[Any, ...] = ()  # Refs, constants, tuples of either
    kwargs: tuple[tuple[str, Any], ...] = ()
    shape: tuple[int, ...] | None = None  # None: a tuple of values (max.dim, linalg_svd)
    dtype: str | None = None  # torch dtype name without "torch."
    target: str = ""  # the full ATen name, for notes ("aten.linalg_svd.default")
    inplace: bool = False  # the reference wrote in place (relu_, add_): computed here as its functional form

    def kw(self, key: str, default: Any = None) -> Any:
        return dict(self.kwargs).get(key, default)

    def refs(self) -> list[str]:
        """Names of the values this node reads, in argument order, without duplicates."""
        out: list[str] = []
        for a in (*self.args, *(v for _, v in self.kwargs)):
            for r in _refs_in(a):
                if r not in out:
                    out.append(r)
        return out

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape or ():
            n *= s
        return n


def _refs_in(a: Any) -> list[str]:
    if isinstance(a, Ref):
        return [a.name]
    if isinstance(a, tuple):
        return [r for x in a for r in _refs_in(x)]
    return []


@dataclass(frozen=True)
class StateEntry:
    key: str  # state_dict key ("linear.weight")
    shape: tuple[int, ...]
    dtype: str
    parameter: bool  # nn.Parameter (else a buffer)


@dataclass(frozen=True)
class Graph:
    task_id: str
    inputs: tuple[Node, ...]  # forward's tensor arguments ("input" nodes), in order
    params: tuple[Node, ...]  # "param" nodes: args[0] is the state_dict key
    nodes: tuple[Node, ...]  # the computation, in topological order
    outputs: tuple[Any, ...]  # Refs (or constants) that forward returns
    forward_args: tuple[str, ...]  # every parameter name of Model.forward, tensors or not
    init_params: str  # ModelNew.__init__'s parameter list, e.g. "in_features, out_features, scale"
    state: tuple[StateEntry, ...]
    returns_tuple: bool = False
    notes: tuple[str, ...] = ()
    # forward's non-tensor arguments (a Python float or int), specialized to the reference's values as
    # torch.export does: ModelNew checks that it is called with the same
    scalars: tuple[tuple[str, Any], ...] = ()
    by_name: dict[str, Node] = field(default_factory=dict, compare=False, repr=False)

    def node(self, name: str) -> Node:
        return self.by_name[name]

    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs if isinstance(o, Ref)]


_DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)
_SKIP = {
    "_assert_tensor_metadata",
    "_assert_scalar",
    "sym_size",
    "sym_numel",
    "sym_stride",
    "sym_constrain_range",
}


def _torch():
    import torch

    return torch


def dtype_name(dt: Any) -> str:
    return str(dt).removeprefix("torch.")


@contextlib.contextmanager
def _quiet():
    """torch.export logs and warns a lot on failure; the caller gets one line instead."""
    loggers = [logging.getLogger(n) for n in ("torch", "torch._dynamo", "torch.fx", "torch._subclasses")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        # a failed data-dependent export also prints its whole graph to stderr
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels, strict=True):
            lg.setLevel(lv)


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0][:240] if lines else type(e).__name__


_CACHE: dict[str, Graph] = {}
# The last few tasks' exports (module, model, inputs, program) before any decomposition: trying a
# decomposition (policy._decompose) re-exports nothing, it decomposes the program again (seconds a
# level-3 model).
_EXPORTED: dict[str, tuple[ModuleType, Any, list, Any]] = {}
_EXPORTED_KEPT = 4


def capture(
    task: str | Path | ModuleType, task_id: str | None = None, decompose: frozenset[str] = frozenset()
) -> Graph:
    """The reference's computation as a Graph; raises CaptureError with a one-line reason. The ops named in
    `decompose` (\"aten.glu.default\") are replaced by PyTorch's own decomposition of them."""
    if isinstance(task, ModuleType):
        module, key = task, f"module:{id(task)}:{sorted(decompose)}"
        task_id = task_id or getattr(task, "__name__", "task")
    else:
        path = Path(task)
        try:
            source = path.read_text()
        except OSError as e:
            raise CaptureError(f"cannot read the task file: {e}") from None
        base = hashlib.sha256(f"{path.resolve()}\0{source}".encode()).hexdigest()
        key = hashlib.sha256(f"{base}\0{sorted(decompose)}".encode()).hexdigest()
        if key in _CACHE:
            return _CACHE[key]
        if base in _EXPORTED:  # the task's export, taken again with other ops decomposed
            module = _EXPORTED[base][0]
        else:
            try:
                module = load_module(path)
            except TaskError as e:
                raise CaptureError(str(e)) from None
        task_id = task_id or path.stem
    graph = _capture_module(
        module, task_id, decompose, exported_key=None if isinstance(task, ModuleType) else base
    )
    _CACHE[key] = graph
    return graph


def capture_source(source: str, task_id: str, decompose: frozenset[str] = frozenset()) -> Graph:
    """Capture from a task's source text (when its file is not at hand, e.g. a run replayed elsewhere)."""
    with tempfile.TemporaryDirectory(prefix="kernelpro-expert-") as d:
        path = Path(d) / f"{task_id}.py"
        path.write_text(source)
        key = hashlib.sha256(f"source\0{source}\0{sorted(decompose)}".encode()).hexdigest()
        if key in _CACHE:
            return _CACHE[key]
        graph = capture(path, task_id, decompose)
        _CACHE[key] = graph
        return graph


@contextlib.contextmanager
def _scalars_on_cpu() -> Iterator[None]:
    """A one-element constant the forward makes on its input's device (torch.tensor(0.0, device=x.device),
    as KernelBench's level 2 writes for a min or max against a value) is made on the CPU while the model
    is exported on the meta device: export lifts it with its value, which capture reads as a scalar (on
    the meta device it had none, and the task could not be read). A 0-dim CPU tensor mixes with tensors
    of any device in PyTorch's ops, as it does in eager."""
    torch = _torch()
    real = torch.tensor

    def tensor(data: Any, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if (
            isinstance(data, bool | int | float)
            and device is not None
            and torch.device(device).type == "meta"
        ):
            kwargs = {**kwargs, "device": "cpu"}
        return real(data, *args, **kwargs)

    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = real


@functools.cache
def _decompositions() -> dict[Any, Any]:
    """PyTorch's decompositions into other ATen ops: the core-ATen table (what torch.export lowers to), and
    those of its full table written at the ATen level (addmv, mv, upsampling); not the reference ones that
    lower to prims, which capture does not read."""
    from torch._decomp import core_aten_decompositions, decomposition_table

    aten_level = {op: fn for op, fn in decomposition_table.items()
                  if getattr(fn, "__module__", "") == "torch._decomp.decompositions"}  # fmt: skip
    return {**aten_level, **dict(core_aten_decompositions().items())}


@functools.cache
def _decomposed_names() -> frozenset[str]:
    return frozenset(str(op) for op in _decompositions())


@functools.cache
def _composite(target: str) -> Any:
    """The ATen op (\"aten.pairwise_distance.default\") when PyTorch writes it in other ATen ops (a
    CompositeImplicitAutograd kernel, which export may keep whole), else None."""
    parts = target.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    torch = _torch()
    op = getattr(getattr(torch.ops.aten, parts[1], None), parts[2], None)
    if op is None or not torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), "CompositeImplicitAutograd"
    ):
        return None
    return op


def decomposable(targets: Iterable[str]) -> frozenset[str]:
    """Those of the ops (\"aten.glu.default\") that PyTorch decomposes into other ATen ops: a table's
    decomposition, or the op's own composite kernel."""
    return frozenset(
        t
        for t in targets
        if (t in _decomposed_names() or _composite(t) is not None) and not recurrent.unrolls(t)
    )


def _decomposed(ep: Any, decompose: frozenset[str]) -> Any:
    """The exported program with the named ops replaced by their decompositions: the rest of the graph
    comes back in its functional form (dropout -> clone, batch_norm -> its no-training op), which capture
    reads as before."""
    table = {op: fn for op, fn in _decompositions().items() if str(op) in decompose}
    for t in decompose:
        op = _composite(t)
        if op is not None and op not in table:
            table[op] = op.decompose
    return ep.run_decompositions(table) if table else ep


def _capture_module(
    module: ModuleType, task_id: str, decompose: frozenset[str] = frozenset(), exported_key: str | None = None
) -> Graph:
    torch = _torch()
    if exported_key in _EXPORTED:
        module, model, inputs, ep = _EXPORTED[exported_key]
    else:
        try:
            with torch.device("meta"):
                init_args = list(module.get_init_inputs())
            model = model_on_meta(module, init_args)  # on the CPU first where its constructor reads values
            inputs = meta_inputs(module)
            model.eval()
        except Exception as e:
            raise CaptureError(
                f"building the model on the meta device raised {type(e).__name__}: {_first_line(e)}"
            ) from None
        try:
            with _quiet(), torch.no_grad(), _scalars_on_cpu(), recurrent.shapes_only():
                ep = torch.export.export(model, tuple(inputs), strict=False)
        except Exception as e:
            why = f"torch.export could not capture the reference ({type(e).__name__}: {_first_line(e)})"
            return _capture_grouped(module, model, task_id, why)
        if exported_key is not None:
            while len(_EXPORTED) >= _EXPORTED_KEPT:
                _EXPORTED.pop(next(iter(_EXPORTED)))
            _EXPORTED[exported_key] = (module, model, inputs, ep)
    if decompose:
        try:
            with _quiet(), torch.no_grad(), recurrent.shapes_only():
                ep = _decomposed(ep, decompose)
        except Exception as e:
            raise CaptureError(f"decomposing {', '.join(sorted(decompose))} raised {type(e).__name__}: "
                               f"{_first_line(e)}") from None  # fmt: skip
    try:
        return _from_export(ep, module, model, inputs, task_id)
    except CaptureError as e:
        if "data-dependent" not in str(e):  # export got through a loop over values with symbolic sizes
            raise
        return _capture_grouped(module, model, task_id, str(e))


def _capture_grouped(module: ModuleType, model: Any, task_id: str, why: str) -> Graph:
    """A reference export cannot capture, if it is a loop over experts: captured as one grouped GEMM."""
    from pipeline.generate.expert import grouped

    torch = _torch()
    try:
        with _quiet(), torch.no_grad():
            rewritten = grouped.rewrite(module, model)
            inputs = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in meta_inputs(module)]
            ep = torch.export.export(rewritten, tuple(inputs), strict=False)
    except grouped.NotGrouped as e:
        raise CaptureError(f"{why}; not a loop over experts either: {e}") from None
    except Exception as e:
        raise CaptureError(
            f"{why}; its loop over experts, rewritten, did not export: {_first_line(e)}"
        ) from None
    graph = _from_export(ep, module, rewritten, inputs, task_id)
    note = "a loop over experts (rows grouped by a routing) captured as grouped GEMMs"
    return dataclasses.replace(graph, notes=(*graph.notes, note), by_name=graph.by_name)


def _positional_names(fwd: inspect.Signature, count: int) -> tuple[str, ...]:
    """Model.forward's positional parameter names, as many as the inputs it is called with: a `*features`
    takes the rest, named features_0, features_1... (the launcher's forward then takes them one by one);
    keyword-only and `**` parameters keep their defaults and are left out."""
    names: list[str] = []
    for p in fwd.parameters.values():
        if p.name == "self" or p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD):
            continue
        if p.kind is p.VAR_POSITIONAL:
            names += [f"{p.name}_{i}" for i in range(max(0, count - len(names)))]
        else:
            names.append(p.name)
    return tuple(names)


def _from_export(ep: Any, module: ModuleType, model: Any, inputs: list, task_id: str) -> Graph:
    torch = _torch()
    sig = ep.graph_signature
    to_param = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    constants = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    state_dict = model.state_dict()
    names = dict(model.named_parameters())

    forward_args = _positional_names(inspect.signature(module.Model.forward), len(inputs))
    user_nodes: list[Node] = []
    params: list[Node] = []
    nodes: list[Node] = []
    notes: list[str] = []
    outputs: tuple[Any, ...] = ()
    renamed: dict[str, Any] = {}  # export placeholder -> forward argument name (or a constant's value)
    scalars: list[tuple[str, Any]] = []

    tensor_positions = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
    user_placeholders = list(sig.user_inputs)
    user_order = [
        m
        for m in ep.graph.nodes
        if m.op == "placeholder" and m.name not in to_param and m.name not in constants
    ]

    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder":
            if n.name in constants:
                value = getattr(ep, "constants", {}).get(constants[n.name])
                if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type != "meta":
                    renamed[n.name] = value.item()  # a one-element constant (torch.tensor(0.5)) is a scalar
                    continue
                raise CaptureError(
                    f"the model holds a tensor constant ({constants[n.name]}) that is neither a parameter nor "
                    "a buffer, so its values cannot be carried over"
                )
            if n.name not in to_param and isinstance(val, bool | int | float):
                # export lists such an input by its value, not its name: its place among the user inputs
                pos = user_order.index(n)
                arg_name = forward_args[pos] if pos < len(forward_args) else n.name
                renamed[n.name] = val
                scalars.append((arg_name, val))
                continue
            shape, dtype = _meta(val, n.name)
            if n.name in to_param:
                key = to_param[n.name]
                if key not in state_dict:
                    raise CaptureError(
                        f"buffer {key} is not persistent, so its values cannot be carried over"
                    )
                params.append(Node(n.name, "param", args=(key,), shape=shape, dtype=dtype, target=key))
            else:
                pos = user_placeholders.index(n.name)
                arg_index = tensor_positions[pos] if pos < len(tensor_positions) else pos
                arg_name = forward_args[arg_index] if arg_index < len(forward_args) else n.name
                renamed[n.name] = arg_name
                user_nodes.append(Node(arg_name, "input", shape=shape, dtype=dtype))
            continue
        if n.op == "output":
            outs = n.args[0]
            outputs = tuple(
                _convert(o, renamed) for o in (outs if isinstance(outs, list | tuple) else (outs,))
            )
            continue
        if n.op != "call_function":
            raise CaptureError(f"unexpected graph node {n.op} {n.target}")
        op, overload, target = _op_name(n.target)
        if op in _SKIP or (val is None and op not in ("getitem",)):
            continue
        if isinstance(val, list | tuple):
            shape, dtype = None, None
            for v in val:
                if v is not None:
                    _meta(v, n.name)  # refuse data-dependent shapes in any element
        else:
            shape, dtype = _meta(val, n.name, target)
        inplace = op.endswith("_") and not op.startswith("_") and op not in ("index_put_",)
        if inplace:
            op = op[:-1]
        args = tuple(_convert(a, renamed) for a in n.args)
        if op in _SCALAR_COPIES and args and isinstance(args[0], bool | int | float):
            renamed[n.name] = args[0]  # a copy of a one-element constant (torch.tensor(v)): v itself
            continue
        kwargs = tuple((k, _convert(v, renamed)) for k, v in n.kwargs.items())
        nodes.append(Node(n.name, op, overload, args, kwargs, shape, dtype, target, inplace))

    for u in user_nodes:
        if any(nd.inplace and nd.args and nd.args[0] == Ref(u.name) for nd in nodes):
            notes.append(
                f"the reference writes into its input {u.name} in place; ModelNew leaves its inputs unchanged"
            )
    state = tuple(
        StateEntry(k, tuple(int(s) for s in v.shape), dtype_name(v.dtype), k in names)
        for k, v in state_dict.items()
    )
    graph = Graph(
        task_id=task_id,
        inputs=tuple(user_nodes),
        params=tuple(params),
        nodes=tuple(nodes),
        outputs=outputs,
        forward_args=forward_args,
        init_params=_init_params(module),
        state=state,
        returns_tuple=_returns_tuple(ep),
        notes=tuple(notes),
        scalars=tuple(scalars),
    )
    graph.by_name.update({n.name: n for n in (*user_nodes, *params, *nodes)})
    return graph


# Ops that copy a tensor unchanged: applied to a one-element constant captured as a scalar, the scalar.
_SCALAR_COPIES = ("lift_fresh_copy", "detach", "clone", "alias")


def _returns_tuple(ep: Any) -> bool:
    spec = getattr(ep, "call_spec", None)
    out_spec = getattr(spec, "out_spec", None)
    if out_spec is None:
        return len(ep.graph_signature.user_outputs) > 1
    return "tuple" in str(getattr(out_spec, "type", "")) or len(ep.graph_signature.user_outputs) > 1


def _op_name(target: Any) -> tuple[str, str, str]:
    name = getattr(target, "name", None)
    if callable(name):  # OpOverload: "aten::mul.Tensor"
        full = name()
        base = full.split("::", 1)[-1]
        op, _, overload = base.partition(".")
        return op, overload or "default", f"aten.{op}.{overload or 'default'}"
    qual = getattr(target, "__name__", str(target))
    return qual, "", qual


def _meta(val: Any, name: str, target: str = "") -> tuple[tuple[int, ...], str]:
    torch = _torch()
    if not isinstance(val, torch.Tensor):
        if isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool):
            raise CaptureError(
                f"{target or name} produces a data-dependent value ({val}), not a tensor of fixed shape"
            )
        raise CaptureError(f"{target or name} produces a {type(val).__name__}, not a tensor")
    shape = []
    for s in val.shape:
        if not isinstance(s, int):
            try:
                s = int(s)
            except Exception:
                raise CaptureError(
                    f"{target or name} has a data-dependent shape ({tuple(val.shape)}): its size depends on the "
                    "values, which fixed kernels cannot know"
                ) from None
        shape.append(s)
    return tuple(shape), dtype_name(val.dtype)


def _convert(a: Any, renamed: dict[str, Any]) -> Any:
    torch = _torch()
    if isinstance(a, torch.fx.Node):
        target = renamed.get(a.name, a.name)
        return Ref(target) if isinstance(target, str) else target
    if isinstance(a, list | tuple):
        return tuple(_convert(x, renamed) for x in a)
    if isinstance(a, torch.dtype):
        return ("dtype", dtype_name(a))
    if isinstance(a, torch.device):
        return ("device", str(a))
    if isinstance(a, torch.memory_format | torch.layout):
        return ("torch", str(a).removeprefix("torch."))
    if a is None or isinstance(a, bool | int | float | str):
        return a
    if isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise CaptureError(f"a data-dependent value ({a}) reaches an op's arguments")
    return ("opaque", type(a).__name__)


def _init_params(module: ModuleType) -> str:
    """Model.__init__'s parameters as text for ModelNew: names, literal defaults, *args/**kwargs."""
    try:
        sig = inspect.signature(module.Model.__init__)
    except (TypeError, ValueError):
        return "*args, **kwargs"
    parts = []
    starred = False
    for p in list(sig.parameters.values())[1:]:
        if p.kind is p.KEYWORD_ONLY and not starred:
            parts.append("*")
            starred = True
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            starred = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            d = p.default
            literal = d is None or isinstance(d, bool | int | float | str)
            parts.append(f"{p.name}={d!r}" if literal else f"{p.name}=None")
    return ", ".join(parts)
