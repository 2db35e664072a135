"""Is an expression obviously a tensor, or obviously a plain host value? Part of the resolver (a mixin of
`Launcher`): operators count as library ops only on tensors, and .item() is a sync only on one."""

from __future__ import annotations

import ast

from pipeline.static_check.scopes import Scope
from pipeline.static_check.vocab import (
    MODULE_TENSORS,
    NN_TENSOR_CTORS,
    NON_TENSOR_ATTRS,
    NON_TENSOR_METHODS,
    PY_METHODS,
    TENSOR_ATTRS,
    TORCH_NON_TENSOR,
    Path,
)


class TensorTyping:
    # provided by Launcher
    module: Scope
    methods: dict[tuple[str, str], Scope]
    func_scopes: dict[str, Scope]
    _tensor_cache: dict[int, set[str]]
    _active: set[object]
    _returned: dict[int, list[ast.expr]]

    def resolve(self, expr: ast.AST, s: Scope, depth: int = 0) -> Path | None:
        raise NotImplementedError

    def attr_kind(self, cls: str | None, attr: str) -> tuple:
        raise NotImplementedError

    def tensor_names(self, s: Scope) -> set[str]:
        names = self._tensor_cache.get(id(s))
        if names is not None:
            return names
        names = set(s.tensor_params)
        self._tensor_cache[id(s)] = names  # visible while growing: the fixpoint below reads it
        changed = True
        while changed:
            changed = False
            for name, _, expr in s.bindings:
                if name not in names and name not in s.nested and self.is_tensor(expr, s):  # type: ignore[arg-type]
                    names.add(name)
                    changed = True
        return names

    def is_tensor(self, e: ast.expr, s: Scope, depth: int = 0) -> bool:
        if depth > 24:
            return False
        d = depth + 1
        if isinstance(e, ast.Name):
            if e.id == s.self_name:
                return False
            if e.id in self.tensor_names(s):
                return True
            return e.id not in s.bound and s is not self.module and e.id in self.tensor_names(self.module)
        if isinstance(e, ast.Attribute):
            if e.attr in NON_TENSOR_ATTRS:
                return False
            if e.attr in TENSOR_ATTRS:
                return self.is_tensor(e.value, s, d)
            p = self.resolve(e, s)
            if p and p[0] == "self" and len(p) >= 2:
                kind = self.attr_kind(s.cls, p[1])[0]
                return kind == "tensor" if len(p) == 2 else kind == "nn" and p[-1] in MODULE_TENSORS
            return False
        if isinstance(e, (ast.Subscript, ast.Starred, ast.NamedExpr)):
            return self.is_tensor(e.value, s, d)
        if isinstance(e, ast.Call):
            return self._call_returns_tensor(e, s, d)
        if isinstance(e, ast.BinOp):
            return self.is_tensor(e.left, s, d) or self.is_tensor(e.right, s, d)
        if isinstance(e, ast.UnaryOp):
            return not isinstance(e.op, ast.Not) and self.is_tensor(e.operand, s, d)
        if isinstance(e, ast.IfExp):
            return self.is_tensor(e.body, s, d) or self.is_tensor(e.orelse, s, d)
        if isinstance(e, ast.BoolOp):
            return any(self.is_tensor(v, s, d) for v in e.values)
        if isinstance(e, ast.Compare):
            if all(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in e.ops):
                return False
            return any(self.is_tensor(v, s, d) for v in (e.left, *e.comparators))
        return False

    def _call_returns_tensor(self, e: ast.Call, s: Scope, d: int) -> bool:
        p = self.resolve(e.func, s)
        if p:
            if p[0] == "torch":
                return torch_returns_tensor(p)
            if p[0] == "self" and len(p) >= 2:
                kind = self.attr_kind(s.cls, p[1])
                if kind[0] == "nn":
                    return p[-1] not in NON_TENSOR_METHODS
                if kind[0] == "method" and len(p) == 2:
                    return self.returns_tensor(self.methods[(s.cls, p[1])])  # type: ignore[index]
                if kind[0] == "torchfn" and len(p) == 2:
                    return torch_returns_tensor(kind[1])
                if kind[0] == "tensor" and len(p) > 2:
                    return p[-1] not in NON_TENSOR_METHODS
                return False
            if p[0] == "<local>" and p[1] in self.func_scopes:
                return self.returns_tensor(self.func_scopes[p[1]])
            if p[0] == "<nested>":
                node = s.nested[p[1]]
                if isinstance(node, ast.Lambda):
                    return self.is_tensor(node.body, s, d)
                return any(self.is_tensor(r, s, d) for r in self.returned(node))
            return False  # kernels, numpy, math, builtins, launcher classes
        if isinstance(e.func, ast.Attribute):
            if e.func.attr in NON_TENSOR_METHODS or e.func.attr in PY_METHODS:
                return False
            return self.is_tensor(e.func.value, s, d)
        return False

    def returned(self, node: ast.AST) -> list[ast.expr]:
        """The values a nested function returns, found once (a launcher asks of the same helpers often)."""
        if id(node) not in self._returned:
            self._returned[id(node)] = [
                r.value for r in ast.walk(node) if isinstance(r, ast.Return) and r.value
            ]
        return self._returned[id(node)]

    def returns_tensor(self, s: Scope) -> bool:
        if id(s) in self._active:
            return False
        self._active.add(id(s))
        try:
            return any(isinstance(r, ast.Return) and r.value and self.is_tensor(r.value, s) for r in s.nodes)
        finally:
            self._active.discard(id(s))

    def is_value(self, e: ast.expr, s: Scope, depth: int = 0) -> bool:
        """Obviously a plain host value (number, string, container, numpy scalar), not a tensor."""
        if depth > 24:
            return False
        d = depth + 1
        if isinstance(e, (ast.Constant, ast.JoinedStr, ast.Tuple, ast.List, ast.Set, ast.Dict)):
            return True
        if isinstance(e, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return True
        if isinstance(e, ast.Name):
            if e.id in self.tensor_names(s):
                return False
            if e.id in s.value_params:
                return True
            scope = s if e.id in s.bound else self.module
            found = [(how, x) for n, how, x in scope.bindings if n == e.id]
            key = ("value", id(scope), e.id)
            if not found or key in self._active:
                return False
            self._active.add(key)
            try:
                return all(
                    self.is_range(x, scope) if how == "iter" else self.is_value(x, scope, d)  # type: ignore[arg-type]
                    for how, x in found
                )
            finally:
                self._active.discard(key)
        if isinstance(e, ast.Attribute):
            if e.attr in NON_TENSOR_ATTRS:
                return True
            p = self.resolve(e, s)
            if p and p[0] == "self" and len(p) == 2:
                return self.attr_kind(s.cls, p[1])[0] == "value"
            return bool(p) and p[0] in ("numpy", "math", "torch")  # constants such as math.pi, torch.float32
        if isinstance(e, ast.Subscript):
            return self.is_value(e.value, s, d)
        if isinstance(e, ast.Call):
            if isinstance(e.func, ast.Attribute) and e.func.attr in NON_TENSOR_METHODS:
                return True
            p = self.resolve(e.func, s)
            if p and p[0] == "torch":
                return not torch_returns_tensor(p)
            return bool(p) and p[0] in ("numpy", "math", "<builtin>")
        if isinstance(e, ast.BinOp):
            return self.is_value(e.left, s, d) and self.is_value(e.right, s, d)
        if isinstance(e, ast.UnaryOp):
            return self.is_value(e.operand, s, d)
        if isinstance(e, ast.IfExp):
            return self.is_value(e.body, s, d) and self.is_value(e.orelse, s, d)
        return False

    def is_range(self, e: ast.AST, s: Scope) -> bool:
        return isinstance(e, ast.Call) and self.resolve(e.func, s) == ("<builtin>", "range")


def torch_returns_tensor(p: Path) -> bool:
    if p[:3] == ("torch", "nn", "functional"):
        return True
    if p[1:2] == ("nn",):
        return p[-1] in NN_TENSOR_CTORS
    if p[1:2] in (("cuda",), ("backends",)):
        return False
    return not (len(p) == 2 and p[1] in TORCH_NON_TENSOR)
