"""monkey_patch: sets or deletes an attribute of anything but self or an object the function created;
setattr/delattr; `global`; module hooks; torch.set_* and other global torch state."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from pipeline.static_check.report import Violation
from pipeline.static_check.resolver import Launcher
from pipeline.static_check.rules.base import Context, violation
from pipeline.static_check.scopes import Scope
from pipeline.static_check.vocab import Path, short, words

CODE = "monkey_patch"
HOOK_ATTR = re.compile(r"^(register_\w*hook\w*|_\w*hooks?|_\w*call_impl)$")
_PATCH_BUILTINS = frozenset({("<builtin>", "setattr"), ("<builtin>", "delattr")})
_TORCH_GLOBAL_STATE = words("manual_seed manual_seed_all seed seed_all use_deterministic_algorithms")


class MonkeyPatch:
    code = CODE

    def check(self, ctx: Context) -> Iterator[Violation]:
        launcher = ctx.launcher
        for site in ctx.open_sites():
            rest = site.path[1:]
            if (
                site.path[0] == "torch"
                and rest
                and (rest[-1].startswith("set_") or rest[-1] in _TORCH_GLOBAL_STATE)
            ):
                ctx.claim(site)
                yield violation(
                    CODE,
                    site.node,
                    f"uses {'.'.join(site.path)}, which changes torch's global state for all that runs after "
                    "the launcher",
                )
        for s, node in ctx.nodes():
            if isinstance(node, ast.Global):
                yield violation(
                    CODE,
                    node,
                    f"`global {', '.join(node.names)}`: a launcher may not rebind module-level state",
                )
            elif isinstance(node, ast.Name) and launcher.resolve(node, s) in _PATCH_BUILTINS:
                yield violation(
                    CODE,
                    node,
                    f"uses {node.id}, which can replace an attribute of any object, torch's included",
                )
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                p = launcher.resolve(node.value, s)
                if p and p[0] not in ("self", "<nested>", "<local>"):
                    yield violation(
                        CODE,
                        node,
                        f"writes into {short(node)}, which belongs to {p[0]}; a launcher may not change it",
                    )
            elif isinstance(node, ast.Attribute):
                if HOOK_ATTR.match(node.attr):
                    yield violation(
                        CODE, node, f"uses .{node.attr}; module hooks can change what forward returns"
                    )
                if isinstance(node.ctx, (ast.Store, ast.Del)):
                    yield from _store(launcher, s, node, launcher.resolve(node, s))


def _store(launcher: Launcher, s: Scope, node: ast.Attribute, path: Path | None) -> Iterator[Violation]:
    verb = "deletes" if isinstance(node.ctx, ast.Del) else "assigns"
    if path and path[:2] == ("torch", "backends"):
        return  # a sync_or_timer violation
    if isinstance(node.value, ast.Name) and node.value.id == s.self_name:
        if s.cls is not None and ((s.cls, node.attr) in launcher.methods or node.attr == "forward"):
            yield violation(
                CODE, node, f"{verb} self.{node.attr}, replacing the method that nn.Module or forward calls"
            )
        return
    if _root_is_global(launcher, node.value, s):
        yield violation(
            CODE,
            node,
            f"{verb} {short(node)}, an attribute of an object the launcher did not create; set "
            "attributes only on self or on objects the function creates",
        )


def _root_is_global(launcher: Launcher, e: ast.AST, s: Scope, depth: int = 0) -> bool:
    """Could this expression be a module, a class or an object from outside the current function?"""
    if depth > 20:
        return True
    d = depth + 1
    if isinstance(e, ast.Name):
        n = e.id
        if n == s.self_name or n in s.nested:
            return False
        if n in s.params:
            return True  # passed in: possibly torch itself
        scope = s if n in s.bound else launcher.module
        if n not in scope.bound:
            return True  # imports, launcher classes and functions, kernels, builtins
        key = ("global", id(scope), n)
        if key in launcher._active:
            return False  # x = x.attr: the other bindings decide
        launcher._active.add(key)
        try:
            return any(_root_is_global(launcher, x, scope, d) for name, _, x in scope.bindings if name == n)
        finally:
            launcher._active.discard(key)
    if isinstance(e, (ast.Attribute, ast.Subscript, ast.Starred, ast.NamedExpr)):
        return _root_is_global(launcher, e.value, s, d)
    if isinstance(e, ast.Call):
        return not _makes_fresh_object(launcher, e, s)
    if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
        return any(_root_is_global(launcher, x, s, d) for x in e.elts)
    if isinstance(e, ast.IfExp):
        return _root_is_global(launcher, e.body, s, d) or _root_is_global(launcher, e.orelse, s, d)
    if isinstance(e, ast.BoolOp):
        return any(_root_is_global(launcher, x, s, d) for x in e.values)
    return False


def _makes_fresh_object(launcher: Launcher, call: ast.Call, s: Scope) -> bool:
    """A call that returns a new object: torch/numpy constructors, builtins (but type(x), x's class),
    launcher classes, methods of local values. A launcher function or lambda could return torch itself."""
    p = launcher.resolve(call.func, s)
    if p is None:
        return isinstance(call.func, ast.Attribute)  # out.view(...), t.clone(), ...
    if p == ("<builtin>", "type"):
        return False
    if p[0] in ("torch", "numpy", "<builtin>"):
        return True
    if p[0] == "<local>":
        return p[1] in launcher.classes
    return p[0] == "<nested>" and isinstance(s.nested[p[1]], ast.ClassDef)


RULE = MonkeyPatch()
