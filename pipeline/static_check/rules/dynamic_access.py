"""dynamic_access: reaches code by name or through Python's internals, out of sight of this check.

- builtins off the allow-list (eval, exec, compile, getattr, vars, globals, open, __import__, ...) and
  type(name, bases, dict);
- dunder names and attributes (except super().__init__ and nn.Module.__init__), special methods defined;
- private attributes (`._x`) on anything but self, and on self only those the launcher assigns itself;
- attribute names that lead to frames, code or foreign code on any object (f_globals, ctypes, tofile, ...);
- the runtime's internals: `kernels.<name>.<anything>`, the Kernels class's own methods;
- a module object used as a value (`f(torch)`, `return torch`, `[torch][0]`, `self.t = torch`); a plain
  alias (`t = torch`) stays resolvable and is allowed;
- a binding that makes a name mean one thing in one place and another elsewhere, which the check would
  misread: an imported name, a module alias, `kernels` or a builtin off the list, rebound at module level,
  in a class body, in a comprehension, lambda or nested function, or by an import. A method's own
  parameters and locals are local throughout it, so `def forward(self, input)` is fine.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator

from pipeline.static_check import allowlist
from pipeline.static_check.report import Violation
from pipeline.static_check.resolver import BUILTIN_NAMES, NON_MODULE_ROOTS, Launcher
from pipeline.static_check.rules.base import Context, violation
from pipeline.static_check.scopes import Scope
from pipeline.static_check.vocab import FUNCS, MODULE_BASES, is_dunder, short, words

CODE = "dynamic_access"
_BY_NAME = words("eval exec compile getattr __import__ globals locals vars open breakpoint input")
_PATCH_BUILTINS = frozenset({"setattr", "delattr"})  # monkey_patch's
_ALLOWED_DUNDER_NAMES = frozenset({"__name__", "__doc__", "__all__"})
# special methods a launcher may define (__exit__ and __aexit__ are try_except's to report)
_ALLOWED_DUNDER_METHODS = frozenset(
    {"__init__", "__post_init__", "__repr__", "__str__", "__enter__", "__exit__", "__aexit__"}
)
_FRAMES = words(
    "gi_frame gi_code gi_yieldfrom cr_frame cr_code cr_await ag_frame ag_code f_globals f_locals f_builtins "
    "f_back f_code tb_frame tb_next func_globals co_code co_consts"
)
_FOREIGN = words("ctypes cdll CDLL dlopen from_file fromfile tofile dump system popen")
# public attributes of the runtime's Kernels class that are not kernels (tests keep this in step)
KERNELS_CLASS_ATTRS = frozenset({"from_file"})
_SCOPE_OWNERS = (*FUNCS, ast.Lambda, ast.ClassDef, ast.Module)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_GUARDED_BUILTINS = BUILTIN_NAMES - allowlist.BUILTINS  # builtins whose uses this rule flags


class DynamicAccess:
    code = CODE

    def check(self, ctx: Context) -> Iterator[Violation]:
        launcher = ctx.launcher
        for site in ctx.open_sites():
            hidden = [c for c in site.path[1:] if c.startswith("_")]
            if hidden and not _is_base_init(site.path) and tuple(site.path) not in allowlist.PRIVATE_LIBRARY:
                ctx.claim(site)
                yield violation(CODE, site.node, f"reaches {'.'.join(site.path)}, a private internal")
        yield from _shadowing(launcher)
        own = _own_private_attrs(launcher)
        for s, node in ctx.nodes():
            if isinstance(node, ast.Name):
                yield from _name(launcher, s, node)
            elif isinstance(node, ast.Attribute):
                yield from _attribute(launcher, s, node, own)
            elif isinstance(node, ast.Call):
                if launcher.resolve(node.func, s) == ("<builtin>", "type") and len(node.args) == 3:
                    yield violation(CODE, node, "type(name, bases, dict) builds a class at run time")
            elif (
                isinstance(node, FUNCS) and is_dunder(node.name) and node.name not in _ALLOWED_DUNDER_METHODS
            ):
                yield violation(
                    CODE,
                    node,
                    f"defines {node.name}, a special method that changes how Python or torch treats it",
                )
            if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
                yield from _module_as_value(launcher, s, node)


def _name(launcher: Launcher, s: Scope, node: ast.Name) -> Iterator[Violation]:
    why = _builtin_use(launcher, s, node)
    if why:
        yield violation(CODE, node, why)
    if is_dunder(node.id) and node.id not in _ALLOWED_DUNDER_NAMES:
        yield violation(CODE, node, f"uses {node.id}, one of Python's internals")


def _builtin_use(launcher: Launcher, s: Scope, node: ast.Name) -> str | None:
    """Why this use of a builtin is off the list (None when it is allowed or not a builtin)."""
    n = node.id
    if launcher.resolve(node, s) != ("<builtin>", n) or n in allowlist.BUILTINS or n in _PATCH_BUILTINS:
        return None
    if n == "hasattr" and _literal_public_name(launcher.parent.get(id(node)), node):
        return None  # hasattr(obj, "name"): no more than reading obj.name
    if n in _BY_NAME:
        return f"uses {n}, which runs or reaches code by name, out of sight of this check"
    if is_dunder(n):
        return None  # reported as one of Python's internals
    return f"uses the builtin {n}, which is not on the list a launcher may use"


def _literal_public_name(call: ast.AST | None, func: ast.Name) -> bool:
    if not (isinstance(call, ast.Call) and call.func is func and len(call.args) == 2 and not call.keywords):
        return False
    name = call.args[1]
    return (
        isinstance(name, ast.Constant)
        and isinstance(name.value, str)
        and name.value.isidentifier()
        and not name.value.startswith("_")
        and name.value not in _FRAMES | _FOREIGN
    )


def _attribute(launcher: Launcher, s: Scope, node: ast.Attribute, own: frozenset[str]) -> Iterator[Violation]:
    attr = node.attr
    path = launcher.resolve(node, s)
    in_module = path if path and path[0] not in NON_MODULE_ROOTS else None  # a reach site's path
    if is_dunder(attr):
        if not (attr == "__init__" and launcher.resolve(node.value, s) in (("super",), *MODULE_BASES)):
            yield violation(CODE, node, f"accesses .{attr}; dunder attributes reach Python's internals")
    elif attr.startswith("_") and in_module is None:  # a reach site's private parts are claimed there
        on_self = isinstance(node.value, ast.Name) and node.value.id == s.self_name
        if not (on_self and attr in own):
            yield violation(
                CODE,
                node,
                f"accesses {short(node)}, a private attribute of an object the launcher did not define",
            )
    reported = in_module is not None and allowlist.judge(in_module) is not None  # off the allow-list
    if attr in _FRAMES and not reported:
        yield violation(CODE, node, f"accesses .{attr}, a frame or code object")
    elif attr in _FOREIGN and not reported:
        yield violation(CODE, node, f"accesses .{attr}, which reaches files or foreign code")
    if path and path[0] == "kernels" and len(path) >= 2:
        if len(path) > 2:
            yield violation(
                CODE,
                node,
                f"reaches {short(node)}: a kernel may only be called or passed on, not looked into",
            )
        elif attr in KERNELS_CLASS_ATTRS:
            yield violation(CODE, node, f"reaches kernels.{attr}, the runtime's internals, not a kernel")


def _module_as_value(launcher: Launcher, s: Scope, node: ast.Name | ast.Attribute) -> Iterator[Violation]:
    if not launcher.is_maximal(node):
        return
    path = launcher.resolve(node, s)
    if not path or not allowlist.is_module(path):
        return
    parent = launcher.parent.get(id(node))
    if isinstance(parent, ast.Call) and node is not parent.func and _flagged_call(launcher, s, parent):
        return  # getattr(torch, ...), setattr(torch, ...): reported as such
    if _plain_alias(launcher, s, node, parent):
        return
    yield violation(
        CODE,
        node,
        f"the module object {'.'.join(path)} is used as a value; a launcher may use a module only by "
        "naming its attributes",
    )


def _flagged_call(launcher: Launcher, s: Scope, call: ast.Call) -> bool:
    """A call of a builtin that is itself a violation (getattr, vars, setattr, ...)."""
    func = call.func
    if not isinstance(func, ast.Name):
        return False
    patch = func.id in _PATCH_BUILTINS and launcher.resolve(func, s) == ("<builtin>", func.id)
    return patch or _builtin_use(launcher, s, func) is not None


def _plain_alias(launcher: Launcher, s: Scope, node: ast.AST, parent: ast.AST | None) -> bool:
    """`t = torch` (or `t: Any = torch`) in a function or at module level, `t` bound nowhere else."""
    if isinstance(parent, ast.Assign) and len(parent.targets) == 1:
        target = parent.targets[0]
    elif isinstance(parent, ast.AnnAssign):
        target = parent.target
    else:
        return False
    if not isinstance(target, ast.Name) or s.aliases.get(target.id) is not node:
        return False
    owner = launcher.parent.get(id(parent))
    while owner is not None and not isinstance(owner, _SCOPE_OWNERS):
        owner = launcher.parent.get(id(owner))
    return not isinstance(owner, ast.ClassDef)  # a class attribute is reached through self, out of sight


def _shadowing(launcher: Launcher) -> Iterator[Violation]:
    imported: dict[str, str] = {}  # name -> what its first import binds it to
    for node in launcher.walked:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for a in node.names:
            if a.name == "*":
                continue
            name = a.asname or a.name.split(".")[0]
            if isinstance(node, ast.ImportFrom):
                target = f"{'.' * node.level}{node.module or ''}.{a.name}"
            else:
                target = a.name if a.asname else name
            if imported.setdefault(name, target) != target:
                yield violation(CODE, node, f"imports {target} as {name}, which another import binds already")
            if name in _GUARDED_BUILTINS:
                yield violation(CODE, node, f"imports something as {name}, hiding the builtin")
    guarded = {*launcher.imports, *launcher.module.aliases, *_GUARDED_BUILTINS, "kernels"}
    roots = {id(s.root) for s in launcher.scopes if s is not launcher.module}
    for node, name in _bindings(launcher):
        owner = _owner(launcher, node)
        if name not in guarded or id(owner) in roots:
            continue  # a method's own parameters and locals are local throughout it
        if name in launcher.module.aliases and name not in launcher.imports and owner is launcher.tree:
            continue  # the alias itself (a name bound twice at module level is no alias)
        yield violation(
            CODE,
            node,
            f"binds {name} outside a method's own body, so it would mean different things in different "
            "places; choose another name",
        )


def _bindings(launcher: Launcher) -> Iterator[tuple[ast.AST, str]]:
    """Every place a name is bound (imports and method names aside), with the name."""
    for node in launcher.walked:
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            yield node, node.id
        elif isinstance(node, ast.arg):
            yield node, node.arg
        elif isinstance(node, ast.MatchMapping) and node.rest:
            yield node, node.rest
        elif isinstance(node, (*FUNCS, ast.ClassDef, ast.ExceptHandler, ast.MatchAs, ast.MatchStar)):
            method = isinstance(launcher.parent.get(id(node)), ast.ClassDef) and isinstance(node, FUNCS)
            if node.name and not method:
                yield node, node.name


def _owner(launcher: Launcher, node: ast.AST) -> ast.AST:
    """The function, lambda, comprehension, class or module whose scope a binding belongs to."""
    owner = launcher.parent.get(id(node))
    while owner is not None and not isinstance(owner, (*_SCOPE_OWNERS, *_COMPREHENSIONS)):
        owner = launcher.parent.get(id(owner))
    return owner if owner is not None else launcher.tree


def _is_base_init(path: tuple[str, ...]) -> bool:
    return path[-1] == "__init__" and path[:-1] in MODULE_BASES


def _own_private_attrs(launcher: Launcher) -> frozenset[str]:
    """Private names the launcher defines on its classes (assigned on self, methods, class attributes),
    without nn.Module's own internals."""
    names = {attr for _, attr in launcher.attr_values} | {name for _, name in launcher.methods}
    for cls in launcher.classes.values():
        for stmt in cls.body:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return frozenset(n for n in names if n.startswith("_") and not is_dunder(n)) - _nn_module_internals()


@functools.cache
def _nn_module_internals() -> frozenset[str]:
    import torch.nn as nn

    return frozenset(n for n in (*vars(nn.Module()), *dir(nn.Module)) if n.startswith("_"))


RULE = DynamicAccess()
