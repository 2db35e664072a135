"""The launcher's scopes: its functions and methods, the names each binds, its imports, and what each
launcher class stores on self. Built once from the AST; the resolver reads them."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from pipeline.static_check.vocab import FUNCS


def annotation_is_tensor(ann: ast.expr | None) -> bool | None:
    """True/False when an annotation says whether a parameter is a tensor; None without one."""
    if ann is None:
        return None
    return "Tensor" in ast.unparse(ann)


@dataclass(eq=False)
class Scope:
    """A top-level function or method (nested functions and lambdas folded in), or the module."""

    root: ast.AST
    cls: str | None  # the launcher class this is a method of
    self_name: str | None  # the method's first parameter
    nodes: list[ast.AST]
    positional: list[str] = field(default_factory=list)  # root's positional parameters, self excluded
    params: set[str] = field(default_factory=set)  # every parameter, nested functions' too
    value_params: set[str] = field(default_factory=set)  # annotated or defaulted as non-tensors
    bindings: list[tuple[str, str, ast.AST]] = field(default_factory=list)  # (name, how, expression)
    bound: set[str] = field(default_factory=set)
    aliases: dict[str, ast.expr] = field(default_factory=dict)  # names bound once to another name/attribute
    nested: dict[str, ast.AST] = field(default_factory=dict)  # nested defs, classes and named lambdas
    tensor_params: set[str] = field(default_factory=set)
    kernel_params: set[str] = field(default_factory=set)  # parameters some call passes `kernels` to


class Scopes:
    """The launcher's structure: imports, top-level functions and classes, one Scope per function."""

    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.parent: dict[int, ast.AST] = {}
        # every node once, in ast.walk's order (breadth first): the rules read this list rather than walk a
        # level-3 launcher's 2000 lines again each (a walk is most of a check's time)
        self.walked: list[ast.AST] = [tree]
        i = 0
        while i < len(self.walked):
            node = self.walked[i]
            i += 1
            for child in ast.iter_child_nodes(node):
                self.parent[id(child)] = node
                self.walked.append(child)
        self.imports: dict[str, str] = {}  # local name -> module path it stands for
        self.star: list[str] = []
        self._collect_imports()
        self.functions: dict[str, ast.AST] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        self.func_scopes: dict[str, Scope] = {}
        self.methods: dict[tuple[str, str], Scope] = {}
        self.scopes: list[Scope] = []
        self.toplevel: set[int] = set()
        self._build_scopes()
        self.attr_values: dict[tuple[str, str], list[tuple[ast.expr, Scope]]] = {}
        self._collect_attrs()

    def _collect_imports(self) -> None:
        for node in self.walked:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.imports[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.imports[top] = top
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                for a in node.names:
                    if a.name == "*":
                        self.star.append(node.module)
                    else:
                        self.imports[a.asname or a.name] = f"{node.module}.{a.name}"

    def _build_scopes(self) -> None:
        roots: list[tuple[ast.AST, str | None]] = []

        def add_class(cls: ast.ClassDef) -> None:
            for stmt in cls.body:
                if isinstance(stmt, FUNCS):
                    roots.append((stmt, cls.name))
                elif isinstance(stmt, ast.ClassDef):
                    add_class(stmt)

        for stmt in self.tree.body:
            if isinstance(stmt, FUNCS):
                self.functions[stmt.name] = stmt
                self.toplevel.add(id(stmt))
                roots.append((stmt, None))
            elif isinstance(stmt, ast.ClassDef):
                self.classes[stmt.name] = stmt
                self.toplevel.add(id(stmt))
                add_class(stmt)
        root_ids = {id(r) for r, _ in roots}
        module_nodes: list[ast.AST] = []
        stack: list[ast.AST] = [self.tree]
        while stack:
            node = stack.pop()
            module_nodes.append(node)
            stack.extend(c for c in ast.iter_child_nodes(node) if id(c) not in root_ids)
        self.module = self.make_scope(self.tree, None, None, module_nodes)
        self.scopes.append(self.module)
        for root, cls in roots:
            scope = self.make_scope(root, cls, None, list(ast.walk(root)))
            self.scopes.append(scope)
            if cls is None:
                self.func_scopes[root.name] = scope  # type: ignore[attr-defined]
            else:
                self.methods[(cls, root.name)] = scope  # type: ignore[attr-defined]

    def make_scope(
        self, root: ast.AST, cls: str | None, self_name: str | None, nodes: list[ast.AST]
    ) -> Scope:
        s = Scope(root=root, cls=cls, self_name=self_name, nodes=nodes)
        root_args: set[int] = set()
        if isinstance(root, (*FUNCS, ast.Lambda)):
            args = root.args
            positional = [a.arg for a in (*args.posonlyargs, *args.args)]
            static = isinstance(root, FUNCS) and any(
                isinstance(d, ast.Name) and d.id == "staticmethod" for d in root.decorator_list
            )
            if cls is not None and isinstance(root, FUNCS) and positional and not static:
                s.self_name = positional.pop(0)
            s.positional = positional
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
            defaults = [None] * (len(args.posonlyargs) + len(args.args) - len(args.defaults)) + list(
                args.defaults
            )
            for a, d in zip(every, defaults + list(args.kw_defaults), strict=False):
                root_args.add(id(a))
                says = annotation_is_tensor(a.annotation)
                if says is False or (says is None and isinstance(d, ast.Constant) and d.value is not None):
                    s.value_params.add(a.arg)
            for a in (args.vararg, args.kwarg):
                if a is not None:
                    root_args.add(id(a))
            s.params = {a.arg for a in every} | {a.arg for a in (args.vararg, args.kwarg) if a is not None}
            s.params.discard(s.self_name or "")
        for node in nodes:
            self._collect_binding(s, node, root_args)
        s.bound |= s.params
        counts: dict[str, int] = {}
        for name, _, _ in s.bindings:
            counts[name] = counts.get(name, 0) + 1
        for name, how, expr in s.bindings:
            if (
                counts[name] == 1
                and how in ("value", "iter")
                and name not in s.nested
                and isinstance(expr, (ast.Name, ast.Attribute, ast.Subscript))
                and not (isinstance(expr, ast.Name) and expr.id == name)
            ):
                s.aliases[name] = expr
        return s

    def _collect_binding(self, s: Scope, node: ast.AST, root_args: set[int]) -> None:
        if isinstance(node, ast.arg) and id(node) not in root_args:
            s.params.add(node.arg)  # a nested function's or lambda's parameter: an unknown object
        elif (
            isinstance(node, (*FUNCS, ast.ClassDef)) and node is not s.root and id(node) not in self.toplevel
        ):
            s.nested[node.name] = node
            s.bound.add(node.name)
        elif isinstance(node, ast.Assign):
            if (
                isinstance(node.value, ast.Lambda)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                s.nested[node.targets[0].id] = node.value
            for t in node.targets:
                self._bind(s, t, node.value, "value")
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            self._bind(s, node.target, node.value, "value")
        elif isinstance(node, ast.AugAssign):
            self._bind(s, node.target, node.value, "aug")
        elif isinstance(node, ast.NamedExpr):
            self._bind(s, node.target, node.value, "value")
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            self._bind(s, node.target, node.iter, "iter")
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            self._bind(s, node.optional_vars, node.context_expr, "with")
        elif isinstance(node, ast.ExceptHandler) and node.name:
            s.bound.add(node.name)

    def _bind(self, s: Scope, target: ast.AST, value: ast.AST, how: str) -> None:
        if isinstance(target, ast.Name):
            s.bindings.append((target.id, how, value))
            s.bound.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            pairwise = (
                how == "value"
                and isinstance(value, (ast.Tuple, ast.List))
                and len(value.elts) == len(target.elts)
                and not any(isinstance(e, ast.Starred) for e in (*target.elts, *value.elts))
            )
            for i, elt in enumerate(target.elts):
                if pairwise:
                    self._bind(s, elt, value.elts[i], how)  # type: ignore[attr-defined]
                else:
                    self._bind(s, elt, value, "elem" if how == "value" else how)
        elif isinstance(target, ast.Starred):
            self._bind(s, target.value, value, "elem")

    def _collect_attrs(self) -> None:
        """What each launcher class stores in self.<attr>, from all its methods."""
        for (cls, _), s in self.methods.items():
            if not s.self_name:
                continue
            for node in s.nodes:
                if isinstance(node, ast.Assign):
                    pairs = [(t, node.value) for t in node.targets]
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                    pairs = [(node.target, node.value)]
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == s.self_name
                    and node.func.attr in ("register_buffer", "register_parameter", "add_module")
                    and len(node.args) >= 2
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                ):
                    self.attr_values.setdefault((cls, node.args[0].value), []).append((node.args[1], s))
                    continue
                else:
                    continue
                while pairs:
                    target, value = pairs.pop()
                    if isinstance(target, (ast.Tuple, ast.List)):
                        pairs.extend((elt, value) for elt in target.elts)
                    elif (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == s.self_name
                    ):
                        self.attr_values.setdefault((cls, target.attr), []).append((value, s))
