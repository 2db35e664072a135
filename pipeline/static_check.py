"""Static checks on a candidate's launcher: a pure AST analysis; the launcher is never executed.

`check_launcher(source)` returns a `LauncherReport`: the rules the launcher breaks (each violation reads
"<code>: line N: <why>"), the kernels it names, and whether ModelNew.forward computes only in our kernels
(`Kind.CUSTOM`) or also through torch library calls (`Kind.HYBRID`, with those calls in `library_ops`).

Violation codes (the rest of the project matches on them, see `CODES`):
  syntax_error        the source does not parse
  no_model_new        no top-level `class ModelNew`, or the name ModelNew is bound more than once
  subclass_reference  ModelNew's bases are anything but nn.Module (or it passes a metaclass)
  calls_reference     names Model, get_inputs or get_init_inputs; imports from the task, reference, __main__
  forbidden_import    imports (or reaches through torch.<x>) a module outside the allow-list
  try_except          a try statement, or a context manager's __exit__ that could swallow errors
  monkey_patch        sets or deletes an attribute of anything but self or an object the function created;
                      setattr/delattr; `global`; module hooks; torch.set_* and other global torch state
  dynamic_access      eval/exec/getattr/...; dunder attributes (except super().__init__ and
                      nn.Module.__init__); frame objects; private torch or runtime internals; special methods
  sync_or_timer       streams, events, CUDA graphs, synchronisation, torch.backends switches; in forward
                      also .item()/.tolist()/.cpu()/.numpy() and int()/float()/bool() of a tensor
  no_kernel_launch    forward never reaches `kernels`, directly or through a helper it calls

How forward-time compute is classified (only code reachable from ModelNew.forward counts; __init__ and
module-level code may use any allowed torch call):
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
import builtins
import re
from dataclasses import dataclass, field

from pipeline.types import Kind

CODES = (
    "syntax_error",
    "no_model_new",
    "subclass_reference",
    "calls_reference",
    "forbidden_import",
    "try_except",
    "monkey_patch",
    "dynamic_access",
    "sync_or_timer",
    "no_kernel_launch",
)


@dataclass(frozen=True)
class LauncherReport:
    ok: bool
    kind: Kind
    library_ops: tuple[str, ...] = ()  # HYBRID: the torch calls forward makes, in evaluation order
    kernels_used: tuple[str, ...] = ()  # names after `kernels.`, first appearance first
    violations: tuple[str, ...] = ()  # "<code>: line N: <why>"

    @property
    def codes(self) -> tuple[str, ...]:
        """The code of each violation, in the same order."""
        return tuple(v.split(":", 1)[0] for v in self.violations)


def check_launcher(source: str) -> LauncherReport:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as e:  # ValueError: NUL bytes in the source
        line = getattr(e, "lineno", None) or 1
        why = getattr(e, "msg", None) or str(e)
        return LauncherReport(
            ok=False,
            kind=Kind.CUSTOM,
            violations=(f"syntax_error: line {line}: the launcher does not parse ({why})",),
        )
    return _Checker(tree).run()


# --- rule tables -----------------------------------------------------------------------------------------


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


RUNTIME_METHODS = frozenset({"tensor_map"})  # helpers of the runtime's `kernels`, not kernel names
_ALLOWED_IMPORTS = _words(
    "torch torch.nn torch.nn.functional numpy math typing functools dataclasses __future__"
)
_REFERENCE_MODULES = frozenset({"reference", "task", "tasks", "__main__"})
_REFERENCE_NAMES = frozenset({"Model", "get_inputs", "get_init_inputs"})
_DYNAMIC_BUILTINS = _words("eval exec compile getattr __import__ globals locals vars open breakpoint input")
_PATCH_BUILTINS = frozenset({"setattr", "delattr"})
_ALLOWED_DUNDER_NAMES = frozenset({"__name__", "__doc__", "__all__"})
_ALLOWED_DUNDER_METHODS = frozenset({"__init__", "__post_init__", "__repr__", "__str__", "__enter__"})
_FRAME_ATTRS = _words(
    "gi_frame gi_code cr_frame ag_frame f_globals f_locals f_builtins f_back f_code tb_frame tb_next "
    "func_globals"
)
_SYNC_METHODS = _words("synchronize wait_stream record_stream record wait_event elapsed_time")
_SYNC_WORDS = ("stream", "event", "graph", "synchron", "sync_debug", "_sleep")  # in a torch.* path
_HOOK_ATTR = re.compile(r"^(register_\w*hook\w*|_\w*hooks?|_\w*call_impl)$")
# torch.<x> modules outside the allow-list: extension builders, compilers, process pools, op registries
_TORCH_FORBIDDEN = _words(
    "utils multiprocessing distributed jit compile compiler library hub fx package overrides testing "
    "profiler export onnx"
)
_TORCH_GLOBAL_STATE = _words("manual_seed manual_seed_all seed seed_all use_deterministic_algorithms")
_NUMPY_FORBIDDEN = _words(
    "ctypeslib load save savez savez_compressed fromfile memmap loadtxt savetxt genfromtxt fromregex "
    "lib f2py distutils testing DataSource"
)
_ALLOWED_TEXT = (
    "torch, torch.nn, torch.nn.functional, numpy, math, typing, functools, dataclasses, __future__"
)
_MODULE_BASES = frozenset({("torch", "nn", "Module"), ("torch", "nn", "modules", "module", "Module")})
_BUILTIN_NAMES = frozenset(dir(builtins))

# torch functions that allocate, reshape or describe rather than compute
_TORCH_PLUMBING = _words(
    "empty empty_like empty_strided zeros zeros_like ones ones_like full full_like tensor as_tensor "
    "reshape flatten unflatten permute transpose t squeeze unsqueeze narrow select split chunk unbind "
    "movedim as_strided view_as_real view_as_complex Size finfo iinfo device dtype is_tensor "
    "is_floating_point is_complex numel get_default_dtype no_grad inference_mode enable_grad "
    "is_grad_enabled is_inference_mode_enabled broadcast_shapes result_type promote_types can_cast"
)
# torch functions whose result is not a tensor
_TORCH_NON_TENSOR = _words(
    "Size finfo iinfo device dtype is_tensor is_floating_point is_complex numel get_default_dtype "
    "no_grad inference_mode enable_grad is_grad_enabled is_inference_mode_enabled broadcast_shapes "
    "result_type promote_types can_cast"
)
# torch attributes that are values, not functions: dtypes, memory formats, numbers
_TORCH_CONSTANTS = _words(
    "float32 float float64 double float16 half bfloat16 int8 int16 short int32 int int64 long uint8 uint16 "
    "uint32 uint64 bool complex32 complex64 complex128 cfloat cdouble chalf float8_e4m3fn float8_e5m2 "
    "pi e inf nan newaxis strided sparse_coo contiguous_format channels_last channels_last_3d "
    "preserve_format"
)
_NN_TENSOR_CTORS = frozenset({"Parameter", "Buffer", "UninitializedParameter", "UninitializedBuffer"})
# tensor methods that allocate, reshape or describe rather than compute
_TENSOR_PLUMBING = _words(
    "view view_as reshape reshape_as flatten unflatten unsqueeze squeeze permute transpose t expand "
    "expand_as contiguous as_strided narrow select split chunk unbind movedim new_empty new_zeros "
    "new_ones new_full new_empty_strided new_tensor zero_ fill_ detach requires_grad_"
)
# tensor methods whose result is a Python value
_NON_TENSOR_METHODS = _words(
    "size numel nelement dim ndimension stride storage_offset data_ptr element_size is_contiguous "
    "is_floating_point is_complex get_device item tolist dim_order"
)
_FORWARD_SYNC = frozenset({"item", "tolist", "cpu", "numpy"})  # copy to the host: a hidden synchronisation
# methods of Python containers, strings, numpy scalars and autograd contexts
_PY_METHODS = _words(
    "append extend insert pop items keys values get format join index count update setdefault "
    "startswith endswith lower upper strip bit_length is_integer astype copy save_for_backward "
    "mark_dirty mark_non_differentiable set_materialize_grads"
)
_MODULE_PLUMBING = _words(
    "parameters named_parameters buffers named_buffers children named_children modules named_modules "
    "get_parameter get_buffer get_submodule extra_repr"
)
_MODULE_COMPUTE = _words("to cuda float half double bfloat16 type apply")
_NON_TENSOR_ATTRS = _words("shape dtype device ndim is_cuda requires_grad layout itemsize nbytes names")
_TENSOR_ATTRS = _words("T mT H mH data real imag grad")
_MODULE_TENSORS = _words("weight bias running_mean running_var in_proj_weight in_proj_bias")
_OPS: dict[type, str] = {
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

_Path = tuple[str, ...]
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _display(path: _Path) -> str:
    if path[:3] == ("torch", "nn", "functional"):
        return ".".join(("F", *path[3:]))
    if path[:2] == ("torch", "nn"):
        return ".".join(("nn", *path[2:]))
    return ".".join(path)


def _short(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


def _annotation_is_tensor(ann: ast.expr | None) -> bool | None:
    """True/False when an annotation says whether a parameter is a tensor; None without one."""
    if ann is None:
        return None
    return "Tensor" in ast.unparse(ann)


@dataclass(eq=False)
class _Scope:
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


class _Checker:
    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.violations: list[tuple[int, str, str]] = []
        self.parent: dict[int, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[id(child)] = node
        self.imports: dict[str, str] = {}  # local name -> module path it stands for
        self.star: list[str] = []
        self._collect_imports()
        self.functions: dict[str, ast.AST] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        self.func_scopes: dict[str, _Scope] = {}
        self.methods: dict[tuple[str, str], _Scope] = {}
        self.scopes: list[_Scope] = []
        self._toplevel: set[int] = set()
        self._build_scopes()
        self.attr_values: dict[tuple[str, str], list[tuple[ast.expr, _Scope]]] = {}
        self._collect_attrs()
        self._tensor_cache: dict[int, set[str]] = {}
        self._attr_cache: dict[tuple[str, str], tuple] = {}
        self._active: set[object] = set()  # recursion guards
        self._pseudo: dict[int, _Scope] = {}
        self.base_nodes: set[int] = set()

    # --- building ----------------------------------------------------------------------------------------

    def _collect_imports(self) -> None:
        for node in ast.walk(self.tree):
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
                if isinstance(stmt, _FUNCS):
                    roots.append((stmt, cls.name))
                elif isinstance(stmt, ast.ClassDef):
                    add_class(stmt)

        for stmt in self.tree.body:
            if isinstance(stmt, _FUNCS):
                self.functions[stmt.name] = stmt
                self._toplevel.add(id(stmt))
                roots.append((stmt, None))
            elif isinstance(stmt, ast.ClassDef):
                self.classes[stmt.name] = stmt
                self._toplevel.add(id(stmt))
                add_class(stmt)
        root_ids = {id(r) for r, _ in roots}
        module_nodes: list[ast.AST] = []
        stack: list[ast.AST] = [self.tree]
        while stack:
            node = stack.pop()
            module_nodes.append(node)
            stack.extend(c for c in ast.iter_child_nodes(node) if id(c) not in root_ids)
        self.module = self._make_scope(self.tree, None, None, module_nodes)
        self.scopes.append(self.module)
        for root, cls in roots:
            scope = self._make_scope(root, cls, None, list(ast.walk(root)))
            self.scopes.append(scope)
            if cls is None:
                self.func_scopes[root.name] = scope  # type: ignore[attr-defined]
            else:
                self.methods[(cls, root.name)] = scope  # type: ignore[attr-defined]

    def _make_scope(
        self, root: ast.AST, cls: str | None, self_name: str | None, nodes: list[ast.AST]
    ) -> _Scope:
        s = _Scope(root=root, cls=cls, self_name=self_name, nodes=nodes)
        root_args: set[int] = set()
        if isinstance(root, (*_FUNCS, ast.Lambda)):
            args = root.args
            positional = [a.arg for a in (*args.posonlyargs, *args.args)]
            static = isinstance(root, _FUNCS) and any(
                isinstance(d, ast.Name) and d.id == "staticmethod" for d in root.decorator_list
            )
            if cls is not None and isinstance(root, _FUNCS) and positional and not static:
                s.self_name = positional.pop(0)
            s.positional = positional
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
            defaults = [None] * (len(args.posonlyargs) + len(args.args) - len(args.defaults)) + list(
                args.defaults
            )
            for a, d in zip(every, defaults + list(args.kw_defaults), strict=False):
                root_args.add(id(a))
                says = _annotation_is_tensor(a.annotation)
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

    def _collect_binding(self, s: _Scope, node: ast.AST, root_args: set[int]) -> None:
        if isinstance(node, ast.arg) and id(node) not in root_args:
            s.params.add(node.arg)  # a nested function's or lambda's parameter: an unknown object
        elif (
            isinstance(node, (*_FUNCS, ast.ClassDef))
            and node is not s.root
            and id(node) not in self._toplevel
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

    def _bind(self, s: _Scope, target: ast.AST, value: ast.AST, how: str) -> None:
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

    # --- resolution --------------------------------------------------------------------------------------

    def _resolve(self, expr: ast.AST, s: _Scope, depth: int = 0) -> _Path | None:
        """The dotted path an expression stands for: ("torch", "matmul"), ("self", "conv"), ("kernels", k),
        ("<local>", f) for a launcher function or class, ("<nested>", f), ("<builtin>", f); None: unknown."""
        if depth > 16:
            return None
        if isinstance(expr, ast.Name):
            return self._resolve_name(expr.id, s, depth)
        if isinstance(expr, ast.Attribute):
            base = self._resolve(expr.value, s, depth + 1)
            return (*base, expr.attr) if base else None
        if isinstance(expr, ast.Subscript):  # an element of a container stands for the container
            return self._resolve(expr.value, s, depth + 1)
        if isinstance(expr, ast.Call) and self._resolve(expr.func, s, depth + 1) == ("<builtin>", "super"):
            return ("super",)
        return None

    def _resolve_name(self, n: str, s: _Scope, depth: int) -> _Path | None:
        if n == s.self_name:
            return ("self",)
        if n in s.kernel_params:
            return ("kernels",)
        if n in s.aliases:
            return self._resolve(s.aliases[n], s, depth + 1)
        if n in s.nested:
            return ("<nested>", n)
        if n in s.bound:
            return None
        m = self.module
        if s is not m:
            if n in m.aliases:
                return self._resolve(m.aliases[n], m, depth + 1)
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
        if n in _BUILTIN_NAMES:
            return ("<builtin>", n)
        if self.star:
            return (*self.star[0].split("."), n)
        return None

    def _attr_kind(self, cls: str | None, attr: str) -> tuple:
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

    def _value_kind(self, value: ast.expr, s: _Scope) -> tuple:
        if any(
            isinstance(n, ast.Name) and n.id == "kernels" and self._resolve(n, s) == ("kernels",)
            for n in ast.walk(value)
        ):
            return ("kernel",)
        if isinstance(value, ast.Call):
            p = self._resolve(value.func, s)
            if p and p[:2] == ("torch", "nn") and p[2:3] != ("functional",) and p[-1] not in _NN_TENSOR_CTORS:
                return ("nn", ".".join(p[2:]))
            if p and p[0] == "<local>" and p[1] in self.classes:
                return ("class", p[1])
        if isinstance(value, ast.Lambda):
            return ("callable", value, s)
        if isinstance(value, (ast.Name, ast.Attribute)):
            p = self._resolve(value, s)
            if p and p[0] == "<local>":
                return ("callable", self.functions[p[1]], s) if p[1] in self.functions else ("class", p[1])
            if p and p[0] == "<nested>":
                return ("callable", s.nested[p[1]], s)
            if p and p[0] == "torch":
                return ("torchfn", p)
        if self._is_tensor(value, s):
            return ("tensor",)
        return ("value",)

    # --- tensor or plain value? ----------------------------------------------------------------------------

    def _tensor_names(self, s: _Scope) -> set[str]:
        names = self._tensor_cache.get(id(s))
        if names is not None:
            return names
        names = set(s.tensor_params)
        self._tensor_cache[id(s)] = names  # visible while growing: the fixpoint below reads it
        changed = True
        while changed:
            changed = False
            for name, _, expr in s.bindings:
                if name not in names and name not in s.nested and self._is_tensor(expr, s):  # type: ignore[arg-type]
                    names.add(name)
                    changed = True
        return names

    def _is_tensor(self, e: ast.expr, s: _Scope, depth: int = 0) -> bool:
        if depth > 24:
            return False
        d = depth + 1
        if isinstance(e, ast.Name):
            if e.id == s.self_name:
                return False
            if e.id in self._tensor_names(s):
                return True
            return e.id not in s.bound and s is not self.module and e.id in self._tensor_names(self.module)
        if isinstance(e, ast.Attribute):
            if e.attr in _NON_TENSOR_ATTRS:
                return False
            if e.attr in _TENSOR_ATTRS:
                return self._is_tensor(e.value, s, d)
            p = self._resolve(e, s)
            if p and p[0] == "self" and len(p) >= 2:
                kind = self._attr_kind(s.cls, p[1])[0]
                return kind == "tensor" if len(p) == 2 else kind == "nn" and p[-1] in _MODULE_TENSORS
            return False
        if isinstance(e, (ast.Subscript, ast.Starred, ast.NamedExpr)):
            return self._is_tensor(e.value, s, d)
        if isinstance(e, ast.Call):
            return self._call_returns_tensor(e, s, d)
        if isinstance(e, ast.BinOp):
            return self._is_tensor(e.left, s, d) or self._is_tensor(e.right, s, d)
        if isinstance(e, ast.UnaryOp):
            return not isinstance(e.op, ast.Not) and self._is_tensor(e.operand, s, d)
        if isinstance(e, ast.IfExp):
            return self._is_tensor(e.body, s, d) or self._is_tensor(e.orelse, s, d)
        if isinstance(e, ast.BoolOp):
            return any(self._is_tensor(v, s, d) for v in e.values)
        if isinstance(e, ast.Compare):
            if all(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in e.ops):
                return False
            return any(self._is_tensor(v, s, d) for v in (e.left, *e.comparators))
        return False

    def _call_returns_tensor(self, e: ast.Call, s: _Scope, d: int) -> bool:
        p = self._resolve(e.func, s)
        if p:
            if p[0] == "torch":
                return self._torch_returns_tensor(p)
            if p[0] == "self" and len(p) >= 2:
                kind = self._attr_kind(s.cls, p[1])
                if kind[0] == "nn":
                    return p[-1] not in _NON_TENSOR_METHODS
                if kind[0] == "method" and len(p) == 2:
                    return self._returns_tensor(self.methods[(s.cls, p[1])])  # type: ignore[index]
                if kind[0] == "torchfn" and len(p) == 2:
                    return self._torch_returns_tensor(kind[1])
                if kind[0] == "tensor" and len(p) > 2:
                    return p[-1] not in _NON_TENSOR_METHODS
                return False
            if p[0] == "<local>" and p[1] in self.func_scopes:
                return self._returns_tensor(self.func_scopes[p[1]])
            if p[0] == "<nested>":
                node = s.nested[p[1]]
                if isinstance(node, ast.Lambda):
                    return self._is_tensor(node.body, s, d)
                return any(
                    isinstance(r, ast.Return) and r.value and self._is_tensor(r.value, s, d)
                    for r in ast.walk(node)
                )
            return False  # kernels, numpy, math, builtins, launcher classes
        if isinstance(e.func, ast.Attribute):
            if e.func.attr in _NON_TENSOR_METHODS or e.func.attr in _PY_METHODS:
                return False
            return self._is_tensor(e.func.value, s, d)
        return False

    def _returns_tensor(self, s: _Scope) -> bool:
        if id(s) in self._active:
            return False
        self._active.add(id(s))
        try:
            return any(isinstance(r, ast.Return) and r.value and self._is_tensor(r.value, s) for r in s.nodes)
        finally:
            self._active.discard(id(s))

    @staticmethod
    def _torch_returns_tensor(p: _Path) -> bool:
        if p[:3] == ("torch", "nn", "functional"):
            return True
        if p[1:2] == ("nn",):
            return p[-1] in _NN_TENSOR_CTORS
        if p[1:2] in (("cuda",), ("backends",)):
            return False
        return not (len(p) == 2 and p[1] in _TORCH_NON_TENSOR)

    def _is_value(self, e: ast.expr, s: _Scope, depth: int = 0) -> bool:
        """Obviously a plain host value (number, string, container, numpy scalar), not a tensor."""
        if depth > 24:
            return False
        d = depth + 1
        if isinstance(e, (ast.Constant, ast.JoinedStr, ast.Tuple, ast.List, ast.Set, ast.Dict)):
            return True
        if isinstance(e, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return True
        if isinstance(e, ast.Name):
            if e.id in self._tensor_names(s):
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
                    self._is_range(x, scope) if how == "iter" else self._is_value(x, scope, d)  # type: ignore[arg-type]
                    for how, x in found
                )
            finally:
                self._active.discard(key)
        if isinstance(e, ast.Attribute):
            if e.attr in _NON_TENSOR_ATTRS:
                return True
            p = self._resolve(e, s)
            if p and p[0] == "self" and len(p) == 2:
                return self._attr_kind(s.cls, p[1])[0] == "value"
            return bool(p) and p[0] in ("numpy", "math", "torch")  # constants such as math.pi, torch.float32
        if isinstance(e, ast.Subscript):
            return self._is_value(e.value, s, d)
        if isinstance(e, ast.Call):
            if isinstance(e.func, ast.Attribute) and e.func.attr in _NON_TENSOR_METHODS:
                return True
            p = self._resolve(e.func, s)
            if p and p[0] == "torch":
                return not self._torch_returns_tensor(p)
            return bool(p) and p[0] in ("numpy", "math", "<builtin>")
        if isinstance(e, ast.BinOp):
            return self._is_value(e.left, s, d) and self._is_value(e.right, s, d)
        if isinstance(e, ast.UnaryOp):
            return self._is_value(e.operand, s, d)
        if isinstance(e, ast.IfExp):
            return self._is_value(e.body, s, d) and self._is_value(e.orelse, s, d)
        return False

    def _is_range(self, e: ast.AST, s: _Scope) -> bool:
        return isinstance(e, ast.Call) and self._resolve(e.func, s) == ("<builtin>", "range")

    # --- the checks ----------------------------------------------------------------------------------------

    def _flag(self, node: ast.AST, code: str, why: str) -> None:
        self.violations.append((getattr(node, "lineno", 1), code, why))

    def run(self) -> LauncherReport:
        forward = self._check_model_new()
        for s in self.scopes:
            for node in s.nodes:
                self._check_node(s, node)
        ops: list[tuple[int, int, str]] = []
        if forward is not None:
            ops = self._check_forward(forward)
        kernels_used: list[tuple[int, int, str]] = []  # after forward: it finds `kernels` passed to helpers
        for s in self.scopes:
            for node in s.nodes:
                if isinstance(node, ast.Attribute) and not node.attr.startswith("_"):
                    p = self._resolve(node, s)
                    if p and len(p) == 2 and p[0] == "kernels" and node.attr not in RUNTIME_METHODS:
                        kernels_used.append((node.lineno, node.col_offset, node.attr))
        library_ops = tuple(dict.fromkeys(op for *_, op in sorted(ops)))
        seen: set[tuple[int, str]] = set()
        violations = []
        for line, code, why in sorted(self.violations, key=lambda v: v[0]):
            if (line, code) not in seen:  # one report per rule and line is enough to act on
                seen.add((line, code))
                violations.append(f"{code}: line {line}: {why}")
        return LauncherReport(
            ok=not violations,
            kind=Kind.HYBRID if library_ops else Kind.CUSTOM,
            library_ops=library_ops,
            kernels_used=tuple(dict.fromkeys(k for *_, k in sorted(kernels_used))),
            violations=tuple(violations),
        )

    def _check_model_new(self) -> _Scope | None:
        """Checks ModelNew's definition and bases; returns the scope of its forward, if any."""
        cls = next((n for n in self.tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelNew"), None)
        if cls is None:
            self._flag(self.tree, "no_model_new", "the launcher defines no top-level class ModelNew")
            return None
        bindings = [n for n, _, _ in self.module.bindings if n == "ModelNew"]
        bindings += [n for n in self.imports if n == "ModelNew"]
        bindings += [
            n.name
            for n in self.module.nodes
            if isinstance(n, (*_FUNCS, ast.ClassDef)) and n.name == "ModelNew"
        ]
        if len(bindings) > 1:
            self._flag(
                cls,
                "no_model_new",
                f"the name ModelNew is bound {len(bindings)} times; define it once, as a class",
            )
        if not cls.bases:
            self._flag(cls, "subclass_reference", "ModelNew has no base class; it must subclass nn.Module")
        for base in cls.bases:
            self.base_nodes.update(id(n) for n in ast.walk(base))
            if self._resolve(base, self.module) not in _MODULE_BASES:
                self._flag(
                    base,
                    "subclass_reference",
                    f"ModelNew subclasses {_short(base)}; it must subclass nn.Module directly and compute "
                    "the result itself",
                )
        for kw in cls.keywords:
            self._flag(
                kw,
                "subclass_reference",
                f"ModelNew's class statement passes {kw.arg}=; it must be a plain nn.Module subclass",
            )
        forward = self.methods.get(("ModelNew", "forward"))
        if forward is None:  # `forward = helper` in the class body
            for stmt in cls.body:
                if isinstance(stmt, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "forward" for t in stmt.targets
                ):
                    p = self._resolve(stmt.value, self.module)
                    if p and p[0] == "<local>" and p[1] in self.func_scopes:
                        forward = self.func_scopes[p[1]]
        if forward is None:
            self._flag(cls, "no_kernel_launch", "ModelNew defines no forward, so it launches no kernel")
            return None
        if forward.self_name is None and forward.positional:  # `forward = helper`: helper's first parameter
            forward.self_name = forward.positional.pop(0)
            forward.params.discard(forward.self_name)
        forward.cls = "ModelNew"
        forward.tensor_params = {p for p in forward.params if p not in forward.value_params}
        return forward

    def _check_node(self, s: _Scope, node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            self._check_import(node)
        elif isinstance(node, (ast.Try, ast.TryStar)):
            self._flag(
                node,
                "try_except",
                "a try statement: a fallback or a swallowed error would hide a broken kernel",
            )
        elif isinstance(node, ast.Global):
            self._flag(
                node,
                "monkey_patch",
                f"`global {', '.join(node.names)}`: a launcher may not rebind module-level state",
            )
        elif isinstance(node, ast.Name):
            self._check_name(s, node)
        elif isinstance(node, ast.Attribute):
            self._check_attribute(s, node)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            p = self._resolve(node.value, s)
            if p and p[0] not in ("self", "<nested>", "<local>"):
                self._flag(
                    node,
                    "monkey_patch",
                    f"writes into {_short(node)}, which belongs to {p[0]}; a launcher may not change it",
                )
        elif isinstance(node, ast.Call):
            if self._resolve(node.func, s) == ("<builtin>", "type") and len(node.args) == 3:
                self._flag(node, "dynamic_access", "type(name, bases, dict) builds a class at run time")
        elif isinstance(node, _FUNCS) and _is_dunder(node.name):
            if node.name in ("__exit__", "__aexit__"):
                self._flag(
                    node, "try_except", f"defines {node.name}, which can swallow exceptions like a try/except"
                )
            elif node.name not in _ALLOWED_DUNDER_METHODS:
                self._flag(
                    node,
                    "dynamic_access",
                    f"defines {node.name}, a special method that changes how Python or torch treats it",
                )

    def _check_import(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                self._check_module(a.name, node)
            return
        mod = node.module or ""
        if node.level:
            refs = mod.split(".")[0] in _REFERENCE_MODULES or any(
                a.name in _REFERENCE_NAMES for a in node.names
            )
            if refs:
                self._flag(
                    node,
                    "calls_reference",
                    f"imports from the relative module {'.' * node.level}{mod}, the task's reference",
                )
            else:
                self._flag(
                    node,
                    "forbidden_import",
                    f"a relative import (from {'.' * node.level}{mod}); allowed are only {_ALLOWED_TEXT}",
                )
            return
        self._check_module(mod, node)
        for a in node.names:
            if a.name in _REFERENCE_NAMES:
                self._flag(node, "calls_reference", f"imports {a.name}, a name of the task's reference")
            elif a.name != "*":
                self._check_path((*mod.split("."), a.name), node, store=False)

    def _check_module(self, name: str, node: ast.AST) -> None:
        if name.split(".")[0] in _REFERENCE_MODULES:
            self._flag(
                node,
                "calls_reference",
                f"imports from {name}, where the task's reference lives; a candidate must compute the "
                "result itself",
            )
        elif name not in _ALLOWED_IMPORTS:
            self._flag(
                node,
                "forbidden_import",
                f"imports {name}; a launcher may import only {_ALLOWED_TEXT}",
            )

    def _check_name(self, s: _Scope, node: ast.Name) -> None:
        n = node.id
        local = n in s.bound or n in self.functions or n in self.classes
        if n in _REFERENCE_NAMES and id(node) not in self.base_nodes:
            self._flag(
                node,
                "calls_reference",
                f"names {n}, part of the task's reference; a candidate must compute the result itself",
            )
        elif n in _DYNAMIC_BUILTINS and not local:
            self._flag(
                node,
                "dynamic_access",
                f"uses {n}, which runs or reaches code by name, out of sight of this check",
            )
        elif n in _PATCH_BUILTINS and not local:
            self._flag(
                node,
                "monkey_patch",
                f"uses {n}, which can replace an attribute of any object, torch's included",
            )
        elif _is_dunder(n) and n not in _ALLOWED_DUNDER_NAMES:
            self._flag(node, "dynamic_access", f"uses {n}, one of Python's internals")

    def _check_attribute(self, s: _Scope, node: ast.Attribute) -> None:
        attr = node.attr
        if _is_dunder(attr):
            init_of_base = attr == "__init__" and (
                self._resolve(node.value, s) in (("super",), *_MODULE_BASES)
            )  # super().__init__() or nn.Module.__init__(self)
            if not init_of_base:
                self._flag(
                    node, "dynamic_access", f"accesses .{attr}; dunder attributes reach Python's internals"
                )
        elif attr in _FRAME_ATTRS:
            self._flag(node, "dynamic_access", f"accesses .{attr}, a frame or code object")
        if _HOOK_ATTR.match(attr):
            self._flag(node, "monkey_patch", f"uses .{attr}; module hooks can change what forward returns")
        path = self._resolve(node, s)
        if path and path[0] == "kernels":
            if attr.startswith("_"):
                self._flag(node, "dynamic_access", f"reaches {_short(node)}, the runtime's internals")
        elif attr in _SYNC_METHODS:
            self._flag(
                node, "sync_or_timer", f"uses .{attr}; synchronisation and timing belong to the harness"
            )
        parent = self.parent.get(id(node))
        maximal = not (isinstance(parent, ast.Attribute) and parent.value is node)
        store = isinstance(node.ctx, (ast.Store, ast.Del))
        if path and maximal:
            self._check_path(path, node, store)
        if store:
            self._check_store(s, node, path)

    def _check_path(self, path: _Path, node: ast.AST, store: bool) -> None:
        dotted = ".".join(path)
        rest = path[1:]
        if path[0] == "torch":
            if any(w in c.lower() for c in rest for w in _SYNC_WORDS):
                self._flag(
                    node,
                    "sync_or_timer",
                    f"uses {dotted}; streams, events, graphs and synchronisation belong to the harness "
                    "that times the launcher",
                )
            elif rest[:1] == ("backends",) and store:
                self._flag(
                    node,
                    "sync_or_timer",
                    f"sets {dotted}, a global backend switch that changes how the reference and timing run",
                )
            elif rest and rest[0] in _TORCH_FORBIDDEN:
                self._flag(
                    node,
                    "forbidden_import",
                    f"reaches torch.{rest[0]}; a launcher may use only {_ALLOWED_TEXT}",
                )
            elif any(c.startswith("_") and not _is_dunder(c) for c in rest):
                self._flag(node, "dynamic_access", f"reaches {dotted}, a private torch internal")
            elif rest and (rest[-1].startswith("set_") or rest[-1] in _TORCH_GLOBAL_STATE):
                self._flag(
                    node,
                    "monkey_patch",
                    f"uses {dotted}, which changes torch's global state for all that runs after the launcher",
                )
        elif path[0] == "numpy" and rest and rest[0] in _NUMPY_FORBIDDEN:
            self._flag(
                node,
                "forbidden_import",
                f"uses {dotted}: files and foreign code through numpy are off limits",
            )
        elif path[:2] == ("typing", "get_type_hints"):
            self._flag(node, "dynamic_access", "uses typing.get_type_hints, which evaluates strings as code")

    def _check_store(self, s: _Scope, node: ast.Attribute, path: _Path | None) -> None:
        verb = "deletes" if isinstance(node.ctx, ast.Del) else "assigns"
        if path and path[:2] == ("torch", "backends"):
            return  # reported as sync_or_timer
        if isinstance(node.value, ast.Name) and node.value.id == s.self_name:
            if s.cls is not None and ((s.cls, node.attr) in self.methods or node.attr == "forward"):
                self._flag(
                    node,
                    "monkey_patch",
                    f"{verb} self.{node.attr}, replacing the method that nn.Module or forward calls",
                )
            return
        if self._root_is_global(node.value, s):
            self._flag(
                node,
                "monkey_patch",
                f"{verb} {_short(node)}, an attribute of an object the launcher did not create; set "
                "attributes only on self or on objects the function creates",
            )

    def _root_is_global(self, e: ast.AST, s: _Scope, depth: int = 0) -> bool:
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
            scope = s if n in s.bound else self.module
            if n not in scope.bound:
                return True  # imports, launcher classes and functions, kernels, builtins
            key = ("global", id(scope), n)
            if key in self._active:
                return False  # x = x.attr: the other bindings decide
            self._active.add(key)
            try:
                return any(self._root_is_global(x, scope, d) for name, _, x in scope.bindings if name == n)
            finally:
                self._active.discard(key)
        if isinstance(e, (ast.Attribute, ast.Subscript, ast.Starred, ast.NamedExpr)):
            return self._root_is_global(e.value, s, d)
        if isinstance(e, ast.Call):
            return not self._makes_fresh_object(e, s)
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return any(self._root_is_global(x, s, d) for x in e.elts)
        if isinstance(e, ast.IfExp):
            return self._root_is_global(e.body, s, d) or self._root_is_global(e.orelse, s, d)
        if isinstance(e, ast.BoolOp):
            return any(self._root_is_global(x, s, d) for x in e.values)
        return False

    def _makes_fresh_object(self, call: ast.Call, s: _Scope) -> bool:
        """A call that returns a new object: torch/numpy constructors, builtins (but type(x), x's class),
        launcher classes, methods of local values. A launcher function or lambda could return torch itself."""
        p = self._resolve(call.func, s)
        if p is None:
            return isinstance(call.func, ast.Attribute)  # out.view(...), t.clone(), ...
        if p == ("<builtin>", "type"):
            return False
        if p[0] in ("torch", "numpy", "<builtin>"):
            return True
        if p[0] == "<local>":
            return p[1] in self.classes
        return p[0] == "<nested>" and isinstance(s.nested[p[1]], ast.ClassDef)

    # --- forward-time analysis -----------------------------------------------------------------------------

    def _check_forward(self, forward: _Scope) -> list[tuple[int, int, str]]:
        reachable = self._reachable(forward)
        self._propagate_tensors(reachable)
        if not any(self._reaches_kernels(s) for s in reachable):
            self._flag(
                forward.root,
                "no_kernel_launch",
                "ModelNew.forward never uses `kernels`, directly or through a helper it calls; a candidate "
                "must launch its own kernels",
            )
        ops: list[tuple[int, int, str]] = []
        for s in reachable:
            for node in s.nodes:
                op = self._forward_op(node, s)
                if op:
                    # by where the expression ends: operands before the operation, i.e. evaluation order
                    ops.append((node.end_lineno, node.end_col_offset, op))  # type: ignore[attr-defined]
        return ops

    def _reachable(self, start: _Scope) -> list[_Scope]:
        seen: dict[int, _Scope] = {}
        todo = [start]
        while todo:
            s = todo.pop()
            if id(s.root) in seen:
                continue
            seen[id(s.root)] = s
            for node in s.nodes:
                if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
                    todo.extend(self._targets(node, s))
        return list(seen.values())

    def _targets(self, node: ast.AST, s: _Scope) -> list[_Scope]:
        """The code a reference leads to: a launcher function, a class's methods, a method of self."""
        p = self._resolve(node, s)
        if not p:
            return []
        if p[0] == "<local>":
            return self._scopes_of(p[1])
        if p[0] == "self" and len(p) >= 2:
            kind = self._attr_kind(s.cls, p[1])
            if kind[0] == "method":
                return [self.methods[(s.cls, p[1])]]  # type: ignore[index]
            if kind[0] == "class":
                return self._scopes_of(kind[1])
            if kind[0] == "callable":
                return [self._callable_scope(kind[1], kind[2])]
        return []

    def _scopes_of(self, name: str) -> list[_Scope]:
        if name in self.func_scopes:
            return [self.func_scopes[name]]
        return [sc for (cls, _), sc in self.methods.items() if cls == name]

    def _callable_scope(self, node: ast.AST, ctx: _Scope) -> _Scope:
        if id(node) in self._toplevel:
            return self.func_scopes[node.name]  # type: ignore[attr-defined]
        if id(node) not in self._pseudo:  # a lambda or nested def stored on self: analyse it on its own
            scope = self._make_scope(node, None, ctx.self_name, list(ast.walk(node)))
            scope.cls, scope.self_name = ctx.cls, ctx.self_name
            self._pseudo[id(node)] = scope
        return self._pseudo[id(node)]

    def _propagate_tensors(self, reachable: list[_Scope]) -> None:
        """A helper's parameter is a tensor (or `kernels`) when some call in reachable code passes it one."""
        changed = True
        while changed:
            changed = False
            self._tensor_cache.clear()
            for s in reachable:
                for node in s.nodes:
                    if not isinstance(node, ast.Call):
                        continue
                    callee = self._callee(node, s)
                    if callee is None:
                        continue
                    target, positional, names = callee
                    passed = [(positional[i], a) for i, a in enumerate(node.args[: len(positional)])]
                    passed += [(k.arg, k.value) for k in node.keywords if k.arg in names]
                    if any(isinstance(a, ast.Starred) for a in node.args[: len(positional)]):
                        continue
                    for param, arg in passed:
                        if param not in target.tensor_params and self._is_tensor(arg, s):
                            target.tensor_params.add(param)
                            changed = True
                        if param not in target.kernel_params and self._resolve(arg, s) == ("kernels",):
                            target.kernel_params.add(param)
                            changed = True

    def _callee(self, call: ast.Call, s: _Scope) -> tuple[_Scope, list[str], set[str]] | None:
        p = self._resolve(call.func, s)
        if not p:
            return None
        if p[0] == "self" and len(p) == 2 and (s.cls, p[1]) in self.methods:
            target = self.methods[(s.cls, p[1])]  # type: ignore[index]
        elif p[0] == "<local>" and p[1] in self.func_scopes:
            target = self.func_scopes[p[1]]
        elif p[0] == "<nested>" and isinstance(s.nested[p[1]], (*_FUNCS, ast.Lambda)):
            args = s.nested[p[1]].args  # type: ignore[attr-defined]
            positional = [a.arg for a in (*args.posonlyargs, *args.args)]
            return s, positional, {*positional, *(a.arg for a in args.kwonlyargs)}
        else:
            return None
        return target, target.positional, target.params

    def _reaches_kernels(self, s: _Scope) -> bool:
        for node in s.nodes:
            if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
                p = self._resolve(node, s)
                if p and p[0] == "kernels":
                    return True
                if p and p[0] == "self" and len(p) >= 2 and self._attr_kind(s.cls, p[1])[0] == "kernel":
                    return True
        return False

    def _forward_op(self, node: ast.AST, s: _Scope) -> str | None:
        """The library op a node of forward-reachable code performs, if any; flags hidden syncs."""
        if isinstance(node, ast.Call):
            self._check_forward_sync(node, s)
            return self._call_op(node, s)
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
            return self._passed_function_op(node, s)
        if isinstance(node, (ast.BinOp, ast.AugAssign)):
            left = node.left if isinstance(node, ast.BinOp) else node.target
            right = node.right if isinstance(node, ast.BinOp) else node.value
            if isinstance(node.op, ast.MatMult) or self._is_tensor(left, s) or self._is_tensor(right, s):  # type: ignore[arg-type]
                return _OPS.get(type(node.op))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Invert)):
            if self._is_tensor(node.operand, s):
                return _OPS[type(node.op)]
        elif isinstance(node, ast.Compare):
            if any(self._is_tensor(v, s) for v in (node.left, *node.comparators)):
                return next((_OPS[type(op)] for op in node.ops if type(op) in _OPS), None)
        elif isinstance(node, ast.Subscript) and self._is_tensor(node.value, s):
            if isinstance(node.ctx, ast.Store):
                return "setitem ([]=)"
            index = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if any(self._is_tensor(i, s) for i in index):
                return "index ([])"
        return None

    def _passed_function_op(self, node: ast.Name | ast.Attribute, s: _Scope) -> str | None:
        """A torch function handed to another call runs there: functools.reduce(torch.matmul, xs)."""
        call = self.parent.get(id(node))
        if not isinstance(call, ast.Call) or call.func is node:
            return None
        if self._resolve(call.func, s) in (("<builtin>", "isinstance"), ("<builtin>", "issubclass")):
            return None
        p = self._resolve(node, s)
        if not p or p[0] != "torch" or p[-1] in _TORCH_CONSTANTS:
            return None
        if p[:3] == ("torch", "nn", "functional") or (len(p) == 2 and p[1][:1].islower()):
            return self._torch_op(p)
        return None

    def _check_forward_sync(self, call: ast.Call, s: _Scope) -> None:
        func = call.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in _FORWARD_SYNC
            and not self._is_value(func.value, s)
        ):
            self._flag(
                call,
                "sync_or_timer",
                f"calls .{func.attr}() in forward, which copies to the host and waits for the GPU",
            )
        p = self._resolve(func, s)
        to_number = p is not None and p[0] == "<builtin>" and p[1] in ("int", "float", "bool", "complex")
        if to_number and call.args and self._is_tensor(call.args[0], s):
            self._flag(
                call, "sync_or_timer", f"calls {p[1]}() on a tensor in forward, which waits for the GPU"
            )

    def _call_op(self, call: ast.Call, s: _Scope) -> str | None:
        func = call.func
        p = self._resolve(func, s)
        if p:
            if p[0] == "torch":
                return self._torch_op(p)
            if p[0] == "self":
                return self._self_call_op(p, func, s)
            return None  # kernels, launcher code (followed separately), numpy, math, builtins
        if isinstance(func, ast.Attribute):
            return self._method_op(func.attr, func.value, s)
        if isinstance(func, (ast.Call, ast.Lambda)):
            return None  # nn.ReLU()(x), (lambda ...)(...): the inner expression is classified on its own
        return f"{_short(func)} (unresolved call)"

    @staticmethod
    def _torch_op(p: _Path) -> str | None:
        if p[:3] == ("torch", "nn", "functional"):
            return _display(p) if len(p) > 3 else None
        if p[1:2] == ("nn",):
            return None if p[-1] in _NN_TENSOR_CTORS or p[-1] == "Module" else _display(p)
        if p[1:2] in (("cuda",), ("backends",)) or (len(p) == 2 and p[1] in _TORCH_PLUMBING):
            return None
        if p[1:2] == ("Tensor",) and p[-1] in (_TENSOR_PLUMBING | _NON_TENSOR_METHODS):
            return None
        return _display(p)

    def _self_call_op(self, p: _Path, func: ast.expr, s: _Scope) -> str | None:
        if len(p) == 1:
            return None
        attr, last = p[1], p[-1]
        kind = self._attr_kind(s.cls, attr)
        if kind[0] == "nn":
            if len(p) > 2 and (
                last in _TENSOR_PLUMBING or last in _NON_TENSOR_METHODS or last in _MODULE_PLUMBING
            ):
                return None
            return f"self.{attr} (nn.{kind[1]})"
        if kind[0] in ("method", "class", "kernel", "callable"):
            return None
        if kind[0] == "torchfn":
            return self._torch_op(kind[1]) if len(p) == 2 else None
        if len(p) == 2:
            if kind[0] == "unknown" and attr in _MODULE_PLUMBING:
                return None  # nn.Module's own introspection: self.parameters(), ...
            if kind[0] == "unknown" and attr in _MODULE_COMPUTE:
                return f"Module.{attr}"  # self.to(...), self.half(): torch converts the parameters
            return f"self.{attr} (unresolved call)"
        assert isinstance(func, ast.Attribute)
        return self._method_op(last, func.value, s)

    def _method_op(self, method: str, receiver: ast.expr, s: _Scope) -> str | None:
        if method in _FORWARD_SYNC or method in _SYNC_METHODS:
            return None  # flagged as sync_or_timer instead
        if method in _TENSOR_PLUMBING or method in _NON_TENSOR_METHODS:
            return None
        if self._is_tensor(receiver, s):
            return f"Tensor.{method}"
        if self._is_value(receiver, s) or method in _PY_METHODS:
            return None
        return f"Tensor.{method}"  # an unknown receiver: most likely a tensor
