"""What a name or an attribute chain of the launcher stands for: a dotted path through its imports and
aliases ("torch", "matmul"), self's attributes, `kernels`, launcher functions and classes, or builtins.
Also where the launcher reaches into a module (its reach sites), which the allow-list then judges."""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass

from pipeline.static_check.scopes import Scope, Scopes
from pipeline.static_check.tensors import TensorTyping
from pipeline.static_check.vocab import NN_TENSOR_CTORS, Path

BUILTIN_NAMES = frozenset(dir(builtins))
# first elements of a path that are not a module: the launcher's own objects, the runtime, builtins
NON_MODULE_ROOTS = frozenset({"self", "kernels", "<local>", "<nested>", "<builtin>", "super"})
# what a self.<attr> holds, most telling first: a method, an nn module, a launcher class instance, ...
_KIND_RANK = {
    "method": 0,
    "nn": 1,
    "class": 2,
    "kernel": 3,
    "torchfn": 4,
    "callable": 5,
    "tensor": 6,
    "value": 7,
    "unknown": 8,
}


@dataclass(frozen=True, eq=False)
class Site:
    """A place where the launcher reaches into a module: a maximal attribute chain, a name a star import
    brings, or a name `from <module> import` takes. `store`: the chain is assigned or deleted."""

    node: ast.AST
    path: Path
    store: bool


class Launcher(Scopes, TensorTyping):
    """The launcher's AST with its scopes, and the resolution of its names."""

    def __init__(self, tree: ast.Module):
        super().__init__(tree)
        self._tensor_cache: dict[int, set[str]] = {}
        self._attr_cache: dict[tuple[str, str], tuple] = {}
        self._returned: dict[int, list[ast.expr]] = {}  # nested function -> the values it returns
        self._active: set[object] = set()  # recursion guards
        self.pseudo: dict[int, Scope] = {}

    def resolve(self, expr: ast.AST, s: Scope, depth: int = 0) -> Path | None:
        """The dotted path an expression stands for: ("torch", "matmul"), ("self", "conv"), ("kernels", k),
        ("<local>", f) for a launcher function or class, ("<nested>", f), ("<builtin>", f); None: unknown."""
        if depth > 16:
            return None
        if isinstance(expr, ast.Name):
            return self._resolve_name(expr.id, s, depth)
        if isinstance(expr, ast.Attribute):
            base = self.resolve(expr.value, s, depth + 1)
            return (*base, expr.attr) if base else None
        if isinstance(expr, ast.Subscript):  # an element of a container stands for the container
            return self.resolve(expr.value, s, depth + 1)
        if isinstance(expr, ast.Call) and self.resolve(expr.func, s, depth + 1) == ("<builtin>", "super"):
            return ("super",)
        return None

    def _resolve_name(self, n: str, s: Scope, depth: int) -> Path | None:
        if n == s.self_name:
            return ("self",)
        if n in s.kernel_params:
            return ("kernels",)
        if n in s.aliases:
            return self.resolve(s.aliases[n], s, depth + 1)
        if n in s.nested:
            return ("<nested>", n)
        if n in s.bound:
            return None
        m = self.module
        if s is not m:
            if n in m.aliases:
                return self.resolve(m.aliases[n], m, depth + 1)
            if n in m.nested:
                return None
        if n in self.functions or n in self.classes:
            return ("<local>", n)
        if n in m.bound:
            return None
        if n in self.imports:
            return tuple(self.imports[n].split("."))
        if n == "kernels":
            return ("kernels",)
        if n in BUILTIN_NAMES:
            return ("<builtin>", n)
        if self.star:
            return (*self.star[0].split("."), n)
        return None

    def attr_kind(self, cls: str | None, attr: str) -> tuple:
        """What self.<attr> holds in class cls: ("method",), ("nn", "Conv2d"), ("class", name), ("kernel",),
        ("torchfn", path), ("callable", node, scope), ("tensor",), ("value",) or ("unknown",)."""
        if cls is None:
            return ("unknown",)
        if (cls, attr) in self.methods:
            return ("method",)
        key = (cls, attr)
        if key in self._attr_cache:
            return self._attr_cache[key]
        if key in self._active:
            return ("unknown",)
        self._active.add(key)
        best: tuple = ("unknown",)
        for value, s in self.attr_values.get(key, []):
            kind = self._value_kind(value, s)
            if _KIND_RANK[kind[0]] < _KIND_RANK[best[0]]:
                best = kind
        self._active.discard(key)
        self._attr_cache[key] = best
        return best

    def _value_kind(self, value: ast.expr, s: Scope) -> tuple:
        if any(
            isinstance(n, ast.Name) and n.id == "kernels" and self.resolve(n, s) == ("kernels",)
            for n in ast.walk(value)
        ):
            return ("kernel",)
        if isinstance(value, ast.Call):
            p = self.resolve(value.func, s)
            if p and p[:2] == ("torch", "nn") and p[2:3] != ("functional",) and p[-1] not in NN_TENSOR_CTORS:
                return ("nn", ".".join(p[2:]))
            if p and p[0] == "<local>" and p[1] in self.classes:
                return ("class", p[1])
        if isinstance(value, ast.Lambda):
            return ("callable", value, s)
        if isinstance(value, (ast.Name, ast.Attribute)):
            p = self.resolve(value, s)
            if p and p[0] == "<local>":
                return ("callable", self.functions[p[1]], s) if p[1] in self.functions else ("class", p[1])
            if p and p[0] == "<nested>":
                return ("callable", s.nested[p[1]], s)
            if p and p[0] == "torch":
                return ("torchfn", p)
        if self.is_tensor(value, s):
            return ("tensor",)
        return ("value",)

    def callable_scope(self, node: ast.AST, ctx: Scope) -> Scope:
        """The scope of a function stored on self: a top-level one's own, or a lambda's or nested def's."""
        if id(node) in self.toplevel:
            return self.func_scopes[node.name]  # type: ignore[attr-defined]
        if id(node) not in self.pseudo:  # a lambda or nested def stored on self: analyse it on its own
            scope = self.make_scope(node, None, ctx.self_name, list(ast.walk(node)))
            scope.cls, scope.self_name = ctx.cls, ctx.self_name
            self.pseudo[id(node)] = scope
        return self.pseudo[id(node)]

    def is_maximal(self, node: ast.AST) -> bool:
        """Not the base of a longer attribute chain."""
        parent = self.parent.get(id(node))
        return not (isinstance(parent, ast.Attribute) and parent.value is node)

    def _from_star(self, n: str, s: Scope) -> bool:
        """The name resolves only through a star import."""
        if not self.star or n == s.self_name or n in s.kernel_params or n in s.bound or n in s.nested:
            return False
        m = self.module
        return not (
            n in m.bound or n in m.nested or n in self.functions or n in self.classes or n in self.imports
        ) and not (n == "kernels" or n in BUILTIN_NAMES)

    def sites(self) -> list[Site]:
        """Every place the launcher reaches into a module, in source order."""
        found: list[Site] = []
        for s in self.scopes:
            for node in s.nodes:
                if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    mod = tuple(node.module.split("."))
                    found += [Site(node, (*mod, a.name), False) for a in node.names if a.name != "*"]
                elif isinstance(node, ast.Attribute) and self.is_maximal(node):
                    path = self.resolve(node, s)
                    if path and path[0] not in NON_MODULE_ROOTS:
                        found.append(Site(node, path, isinstance(node.ctx, (ast.Store, ast.Del))))
                elif isinstance(node, ast.Name) and self._from_star(node.id, s):
                    path = (*self.star[0].split("."), node.id)
                    found.append(Site(node, path, isinstance(node.ctx, (ast.Store, ast.Del))))
        found.sort(key=lambda site: (getattr(site.node, "lineno", 1), getattr(site.node, "col_offset", 0)))
        return found
