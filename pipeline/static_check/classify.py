"""Custom or hybrid: which library ops ModelNew.forward performs, and which kernels the launcher names.

Only code reachable from ModelNew.forward counts (__init__ and module-level code may use any allowed torch
call):
- Reachable code is forward itself plus every method, launcher function or launcher class it names
  (`self.helper(...)`, `helper(...)`, a `self.block` built from a launcher class), followed transitively.
- A call is a library op when it resolves, through any import alias (`import torch.nn.functional as F`,
  `from torch import matmul`) or simple local alias, to a torch function that is not plumbing
  ("torch.matmul", "F.conv2d", "nn.ReLU" when a module is built in forward); when it calls a
  `self.<attr>` assigned `nn.<X>(...)` ("self.conv (nn.Conv2d)"); or when it calls a tensor method that
  is not plumbing ("Tensor.sum"). Plumbing is allocation (empty*, zeros*, ones*, full*, new_*, zero_,
  fill_), views and shape queries (view, reshape, permute, contiguous, size, numel, stride, ...),
  torch.Size, finfo, device, no_grad, and numpy, math, functools and Python builtins on host values.
  Conversions and copies done by torch (.to, .float, .half, .clone, .copy_, torch.cat) are compute.
  A torch function handed to another call (functools.reduce(torch.matmul, xs)) counts too.
- Operators: `@` is always "matmul (@)". Other arithmetic, comparisons, unary minus, tensor-indexed reads
  and item assignment count only when an operand is obviously a tensor: a forward parameter (unless
  annotated as a non-tensor or given a constant default), a name bound to a tensor-producing expression,
  a `self.<attr>` assigned a tensor (nn.Parameter, torch.*, register_buffer) or an nn submodule's weight or
  bias, or a helper parameter that receives a tensor at some call site. Values derived from numel(),
  size(), .shape, len(), int(), numpy scalars and math are plain numbers.
- A call this analysis cannot resolve (a callable held in a variable) counts as "<name> (unresolved call)":
  the check errs toward HYBRID rather than CUSTOM.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from pipeline.static_check.resolver import Launcher
from pipeline.static_check.scopes import Scope
from pipeline.static_check.vocab import (
    FORWARD_SYNC,
    FUNCS,
    MODULE_COMPUTE,
    MODULE_PLUMBING,
    NN_TENSOR_CTORS,
    NON_TENSOR_METHODS,
    PY_METHODS,
    RUNTIME_METHODS,
    SYNC_METHODS,
    TENSOR_PLUMBING,
    TORCH_CONSTANTS,
    TORCH_PLUMBING,
    Path,
    display,
    short,
)
from pipeline.types import Kind

OPS: dict[type, str] = {
    ast.Add: "add (+)",
    ast.Sub: "sub (-)",
    ast.Mult: "mul (*)",
    ast.Div: "div (/)",
    ast.FloorDiv: "floordiv (//)",
    ast.Mod: "remainder (%)",
    ast.Pow: "pow (**)",
    ast.BitAnd: "bitwise_and (&)",
    ast.BitOr: "bitwise_or (|)",
    ast.BitXor: "bitwise_xor (^)",
    ast.LShift: "lshift (<<)",
    ast.RShift: "rshift (>>)",
    ast.MatMult: "matmul (@)",
    ast.Lt: "lt (<)",
    ast.LtE: "le (<=)",
    ast.Gt: "gt (>)",
    ast.GtE: "ge (>=)",
    ast.Eq: "eq (==)",
    ast.NotEq: "ne (!=)",
    ast.USub: "neg (-)",
    ast.Invert: "bitwise_not (~)",
}


@dataclass(frozen=True)
class Classification:
    forward: Scope | None  # ModelNew.forward, None when there is none
    reachable: tuple[Scope, ...]  # forward and the code it reaches
    library_ops: tuple[str, ...]
    kernels_used: tuple[str, ...]

    @property
    def kind(self) -> Kind:
        return Kind.HYBRID if self.library_ops else Kind.CUSTOM


def model_new(tree: ast.Module) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelNew"), None)


def classify(launcher: Launcher) -> Classification:
    forward = _forward(launcher)
    reachable: list[Scope] = []
    ops: list[tuple[int, int, str]] = []
    if forward is not None:
        reachable = _reachable(launcher, forward)
        _propagate_tensors(launcher, reachable)
        for s in reachable:
            for node in s.nodes:
                op = _forward_op(launcher, node, s)
                if op:
                    # by where the expression ends: operands before the operation, i.e. evaluation order
                    ops.append((node.end_lineno, node.end_col_offset, op))  # type: ignore[attr-defined]
    used: list[tuple[int, int, str]] = []  # after the propagation: it finds `kernels` passed to helpers
    for s in launcher.scopes:
        for node in s.nodes:
            if isinstance(node, ast.Attribute) and not node.attr.startswith("_"):
                p = launcher.resolve(node, s)
                if p and len(p) == 2 and p[0] == "kernels" and node.attr not in RUNTIME_METHODS:
                    used.append((node.lineno, node.col_offset, node.attr))
    return Classification(
        forward=forward,
        reachable=tuple(reachable),
        library_ops=tuple(dict.fromkeys(op for *_, op in sorted(ops))),
        kernels_used=tuple(dict.fromkeys(k for *_, k in sorted(used))),
    )


def _forward(launcher: Launcher) -> Scope | None:
    """The scope of ModelNew.forward (or of the function `forward = helper` names), ready for analysis."""
    cls = model_new(launcher.tree)
    if cls is None:
        return None
    forward = launcher.methods.get(("ModelNew", "forward"))
    if forward is None:  # `forward = helper` in the class body
        for stmt in cls.body:
            if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "forward" for t in stmt.targets
            ):
                p = launcher.resolve(stmt.value, launcher.module)
                if p and p[0] == "<local>" and p[1] in launcher.func_scopes:
                    forward = launcher.func_scopes[p[1]]
    if forward is None:
        return None
    if forward.self_name is None and forward.positional:  # `forward = helper`: helper's first parameter
        forward.self_name = forward.positional.pop(0)
        forward.params.discard(forward.self_name)
    forward.cls = "ModelNew"
    forward.tensor_params = {p for p in forward.params if p not in forward.value_params}
    return forward


def _reachable(launcher: Launcher, start: Scope) -> list[Scope]:
    seen: dict[int, Scope] = {}
    todo = [start]
    while todo:
        s = todo.pop()
        if id(s.root) in seen:
            continue
        seen[id(s.root)] = s
        for node in s.nodes:
            if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
                todo.extend(_targets(launcher, node, s))
    return list(seen.values())


def _targets(launcher: Launcher, node: ast.AST, s: Scope) -> list[Scope]:
    """The code a reference leads to: a launcher function, a class's methods, a method of self."""
    p = launcher.resolve(node, s)
    if not p:
        return []
    if p[0] == "<local>":
        return _scopes_of(launcher, p[1])
    if p[0] == "self" and len(p) >= 2:
        kind = launcher.attr_kind(s.cls, p[1])
        if kind[0] == "method":
            return [launcher.methods[(s.cls, p[1])]]  # type: ignore[index]
        if kind[0] == "class":
            return _scopes_of(launcher, kind[1])
        if kind[0] == "callable":
            return [launcher.callable_scope(kind[1], kind[2])]
    return []


def _scopes_of(launcher: Launcher, name: str) -> list[Scope]:
    if name in launcher.func_scopes:
        return [launcher.func_scopes[name]]
    return [sc for (cls, _), sc in launcher.methods.items() if cls == name]


def _propagate_tensors(launcher: Launcher, reachable: list[Scope]) -> None:
    """A helper's parameter is a tensor (or `kernels`) when some call in reachable code passes it one."""
    changed = True
    while changed:
        changed = False
        launcher._tensor_cache.clear()
        for s in reachable:
            for node in s.nodes:
                if not isinstance(node, ast.Call):
                    continue
                node = _unwrapped(launcher, node, s)
                callee = _callee(launcher, node, s)
                if callee is None:
                    continue
                target, positional, names = callee
                for param, arg in _passed(node, positional, names):
                    if param not in target.tensor_params and launcher.is_tensor(arg, s):
                        target.tensor_params.add(param)
                        changed = True
                    if param not in target.kernel_params and launcher.resolve(arg, s) == ("kernels",):
                        target.kernel_params.add(param)
                        changed = True


def _unwrapped(launcher: Launcher, call: ast.Call, s: Scope) -> ast.Call:
    """`kernels.graphed(self, fn, (a, b))` read as the call `fn(a, b)` it makes (the runtime replays it from
    a CUDA graph), so fn's parameters are known tensors like those of any helper forward calls."""
    if len(call.args) == 3 and not call.keywords and launcher.resolve(call.func, s) == ("kernels", "graphed"):
        held = call.args[2]
        args = list(held.elts) if isinstance(held, (ast.Tuple, ast.List)) else [ast.Starred(held, ast.Load())]
        return ast.Call(func=call.args[1], args=args, keywords=[])
    return call


def _passed(call: ast.Call, positional: list[str], names: set[str]) -> list[tuple[str, ast.expr]]:
    """(parameter, what the call passes it). From a `*args` on, each remaining positional parameter gets the
    container (forward(self, *args) handing its tensors on); `**kwargs` stands for every other name."""
    passed: list[tuple[str, ast.expr]] = []
    for i, a in enumerate(call.args[: len(positional)]):
        if isinstance(a, ast.Starred):
            passed += [(p, a.value) for p in positional[i:]]
            break
        passed.append((positional[i], a))
    for k in call.keywords:
        if k.arg in names:
            passed.append((k.arg, k.value))
        elif k.arg is None:
            given = {p for p, _ in passed}
            passed += [(n, k.value) for n in sorted(names - given)]
    return passed


def _callee(launcher: Launcher, call: ast.Call, s: Scope) -> tuple[Scope, list[str], set[str]] | None:
    p = launcher.resolve(call.func, s)
    if not p:
        return None
    if p[0] == "self" and len(p) == 2 and (s.cls, p[1]) in launcher.methods:
        target = launcher.methods[(s.cls, p[1])]  # type: ignore[index]
    elif p[0] == "<local>" and p[1] in launcher.func_scopes:
        target = launcher.func_scopes[p[1]]
    elif p[0] == "<nested>" and isinstance(s.nested[p[1]], (*FUNCS, ast.Lambda)):
        args = s.nested[p[1]].args  # type: ignore[attr-defined]
        positional = [a.arg for a in (*args.posonlyargs, *args.args)]
        return s, positional, {*positional, *(a.arg for a in args.kwonlyargs)}
    else:
        return None
    return target, target.positional, target.params


def reaches_kernels(launcher: Launcher, s: Scope) -> bool:
    for node in s.nodes:
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
            p = launcher.resolve(node, s)
            if p and p[0] == "kernels":
                return True
            if p and p[0] == "self" and len(p) >= 2 and launcher.attr_kind(s.cls, p[1])[0] == "kernel":
                return True
    return False


def _forward_op(launcher: Launcher, node: ast.AST, s: Scope) -> str | None:
    """The library op a node of forward-reachable code performs, if any."""
    if isinstance(node, ast.Call):
        return _call_op(launcher, node, s)
    if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
        return _passed_function_op(launcher, node, s)
    if isinstance(node, (ast.BinOp, ast.AugAssign)):
        left = node.left if isinstance(node, ast.BinOp) else node.target
        right = node.right if isinstance(node, ast.BinOp) else node.value
        tensor = launcher.is_tensor(left, s) or launcher.is_tensor(right, s)  # type: ignore[arg-type]
        if isinstance(node.op, ast.MatMult) or tensor:
            return OPS.get(type(node.op))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Invert)):
        if launcher.is_tensor(node.operand, s):
            return OPS[type(node.op)]
    elif isinstance(node, ast.Compare):
        if any(launcher.is_tensor(v, s) for v in (node.left, *node.comparators)):
            return next((OPS[type(op)] for op in node.ops if type(op) in OPS), None)
    elif isinstance(node, ast.Subscript) and launcher.is_tensor(node.value, s):
        if isinstance(node.ctx, ast.Store):
            return "setitem ([]=)"
        index = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if any(launcher.is_tensor(i, s) for i in index):
            return "index ([])"
    return None


def _passed_function_op(launcher: Launcher, node: ast.Name | ast.Attribute, s: Scope) -> str | None:
    """A torch function handed to another call runs there: functools.reduce(torch.matmul, xs)."""
    call = launcher.parent.get(id(node))
    if not isinstance(call, ast.Call) or call.func is node:
        return None
    if launcher.resolve(call.func, s) in (("<builtin>", "isinstance"), ("<builtin>", "issubclass")):
        return None
    p = launcher.resolve(node, s)
    if not p or p[0] != "torch" or p[-1] in TORCH_CONSTANTS:
        return None
    if p[:3] == ("torch", "nn", "functional") or (len(p) == 2 and p[1][:1].islower()):
        return torch_op(p)
    return None


def _call_op(launcher: Launcher, call: ast.Call, s: Scope) -> str | None:
    func = call.func
    p = launcher.resolve(func, s)
    if p:
        if p[0] == "torch":
            return torch_op(p)
        if p[0] == "self":
            return _self_call_op(launcher, p, func, s)
        return None  # kernels, launcher code (followed separately), numpy, math, builtins
    if isinstance(func, ast.Attribute):
        return _method_op(launcher, func.attr, func.value, s)
    if isinstance(func, (ast.Call, ast.Lambda)):
        return None  # nn.ReLU()(x), (lambda ...)(...): the inner expression is classified on its own
    return f"{short(func)} (unresolved call)"


def torch_op(p: Path) -> str | None:
    if p[:3] == ("torch", "nn", "functional"):
        return display(p) if len(p) > 3 else None
    if p[1:2] == ("nn",):
        return None if p[-1] in NN_TENSOR_CTORS or p[-1] == "Module" else display(p)
    if p[1:2] in (("cuda",), ("backends",)) or (len(p) == 2 and p[1] in TORCH_PLUMBING):
        return None
    if p[1:2] == ("Tensor",) and p[-1] in (TENSOR_PLUMBING | NON_TENSOR_METHODS):
        return None
    return display(p)


def _self_call_op(launcher: Launcher, p: Path, func: ast.expr, s: Scope) -> str | None:
    if len(p) == 1:
        return None
    attr, last = p[1], p[-1]
    kind = launcher.attr_kind(s.cls, attr)
    if kind[0] == "nn":
        if len(p) > 2 and (last in TENSOR_PLUMBING or last in NON_TENSOR_METHODS or last in MODULE_PLUMBING):
            return None
        return f"self.{attr} (nn.{kind[1]})"
    if kind[0] in ("method", "class", "kernel", "callable"):
        return None
    if kind[0] == "torchfn":
        return torch_op(kind[1]) if len(p) == 2 else None
    if len(p) == 2:
        if kind[0] == "unknown" and attr in MODULE_PLUMBING:
            return None  # nn.Module's own introspection: self.parameters(), ...
        if kind[0] == "unknown" and attr in MODULE_COMPUTE:
            return f"Module.{attr}"  # self.to(...), self.half(): torch converts the parameters
        return f"self.{attr} (unresolved call)"
    assert isinstance(func, ast.Attribute)
    return _method_op(launcher, last, func.value, s)


def _method_op(launcher: Launcher, method: str, receiver: ast.expr, s: Scope) -> str | None:
    if method in FORWARD_SYNC or method in SYNC_METHODS:
        return None  # a sync_or_timer violation instead
    if method in TENSOR_PLUMBING or method in NON_TENSOR_METHODS:
        return None
    if launcher.is_tensor(receiver, s):
        return f"Tensor.{method}"
    if launcher.is_value(receiver, s) or method in PY_METHODS:
        return None
    return f"Tensor.{method}"  # an unknown receiver: most likely a tensor
