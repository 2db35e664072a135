"""What a launcher may reach: the modules it may import, the names it may use in each, and the builtins.

An allow-list, not a deny-list: every attribute path rooted at an imported module walks through allowed
modules (torch, torch.nn, ...; torch.cuda by attribute only) to a name on that module's list. Any other
module object on the way (torch.cuda.os, typing.sys, torch.utils, numpy.random, ...) is a forbidden module,
whatever its name; any other name is a forbidden name. Past an allowed name (torch.Tensor.add,
nn.Module.__init__) attributes are free, except module objects (and what the other rules catch: private
and dunder attributes, frames).

The torch lists are introspected (the ops torch.overrides lists for each namespace) plus a curated set of
factories, plumbing and constants, computed on first use and cached: importing this module imports no torch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pipeline.static_check.vocab import (
    FORWARD_SYNC,
    NON_TENSOR_ATTRS,
    NON_TENSOR_METHODS,
    TENSOR_ATTRS,
    TENSOR_PLUMBING,
    TORCH_CONSTANTS,
    TORCH_NON_TENSOR,
    TORCH_PLUMBING,
    Path,
    words,
)

IMPORTABLE = words(
    "torch torch.nn torch.nn.functional torch.nn.init torch.linalg torch.fft torch.special numpy math typing "
    "functools dataclasses itertools collections collections.abc einops __future__"
)
IMPORTABLE_TEXT = ", ".join(sorted(IMPORTABLE))
MODULES = IMPORTABLE | {"torch.cuda"}  # module objects a path may pass through
NAMESPACES = MODULES | {"torch.Tensor"}  # the objects with a list of allowed names
ROOTS = frozenset(m.split(".")[0] for m in IMPORTABLE)

BUILTINS = words(
    "abs all any ascii bin bool bytearray bytes callable chr classmethod complex dict divmod enumerate filter "
    "float format hex oct "
    "frozenset hash int isinstance issubclass iter len list map max min next object ord pow print property "
    "range repr reversed round set slice sorted staticmethod str sum super tuple type zip "
    "NotImplemented Ellipsis Exception ArithmeticError AssertionError AttributeError IndexError KeyError "
    "LookupError NotImplementedError OverflowError RuntimeError StopIteration TypeError ValueError "
    "ZeroDivisionError"
)

# Underscored torch calls that are libraries all the same: torch's grouped GEMM (MoE experts) is what a
# hybrid candidate leaves grouped products to, as torch.mm is for one product.
PRIVATE_LIBRARY = frozenset({("torch", "_grouped_mm")})

# Beside the introspected ops: factories (randn and friends initialise parameters), plumbing, types, and
# in-place activations torch.overrides does not list.
_TORCH_EXTRA = words(
    "empty empty_like empty_strided zeros zeros_like ones ones_like full full_like arange linspace logspace "
    "eye tensor as_tensor asarray from_numpy randn randn_like rand rand_like randint randint_like randperm "
    "normal bernoulli multinomial Size device dtype layout memory_format finfo iinfo no_grad inference_mode "
    "enable_grad is_grad_enabled is_inference_mode_enabled Tensor Generator get_default_dtype is_tensor "
    "is_floating_point is_complex numel broadcast_shapes result_type promote_types can_cast "
    "relu_ sigmoid_ tanh_ exp_ clamp_ zero_ " + " ".join(".".join(p[1:]) for p in PRIVATE_LIBRARY)
)
_TENSOR_EXTRA = words("new_empty new_empty_strided new_full new_ones new_tensor new_zeros stride unflatten")
# functional ops torch.overrides lists under another identity (wrapped or in-place variants)
_F_EXTRA = words(
    "hardsigmoid hardswish sigmoid tanh relu_ elu_ celu_ selu_ leaky_relu_ hardtanh_ rrelu_ threshold_ "
    "upsample upsample_bilinear upsample_nearest grouped_mm scaled_mm scaled_grouped_mm"
)
_NN_EXTRA = words(
    "Module Parameter Buffer UninitializedParameter UninitializedBuffer Sequential ModuleList ModuleDict "
    "ParameterList ParameterDict"
)
_CUDA = words(
    "is_available current_device device_count get_device_properties get_device_capability get_device_name"
)
# pure helpers beside the scalar types and ufuncs; nothing that reads or writes files or loads code
_NUMPY_EXTRA = words("prod sum sqrt log2 ceil floor pi e inf nan newaxis ndarray dtype finfo iinfo")
_STATIC: dict[str, frozenset[str]] = {
    "typing": words(
        "Any Optional Union List Tuple Dict Set FrozenSet Type Sequence Callable Iterable Iterator Mapping "
        "Final ClassVar Literal TYPE_CHECKING cast"
    ),
    "functools": words("reduce partial lru_cache cache cached_property wraps"),
    "dataclasses": words("dataclass field fields replace asdict astuple"),
    "collections": words("namedtuple OrderedDict defaultdict deque Counter abc"),
    "einops": words("rearrange repeat reduce einsum"),
    "torch.cuda": _CUDA,
}


_ATEN = ("torch", "ops", "aten")


@dataclass(frozen=True)
class Reach:
    """Why a path is off the allow-list: it passes a module ("module") or names a name ("name") that is not
    allowed; `upto` is the path up to and including the offending part."""

    what: str
    upto: Path

    @property
    def dotted(self) -> str:
        return ".".join(self.upto)


@functools.lru_cache(maxsize=4096)
def judge(path: Path) -> Reach | None:
    """None when the launcher may reach `path` (rooted at an imported module), else what is wrong with it."""
    namespace = path[0]
    if namespace not in ROOTS:
        return None  # the import of a module outside the list is reported on its own
    if path[:3] == _ATEN and len(path) > 3:  # the expert leaves ops without a public call to ATen
        return None if path[3] in names(".".join(_ATEN)) else Reach("name", path[:4])
    for i in range(1, len(path)):
        dotted = f"{namespace}.{path[i]}"
        if dotted in NAMESPACES and (dotted in MODULES or path[i] in names(namespace)):
            namespace = dotted
            continue
        if path[i] in names(namespace):
            tail = _module_in_tail(namespace, path[i:])
            return Reach("module", path[: i + 1 + tail]) if tail >= 0 else None
        return Reach("module" if _is_module(namespace, path[i]) else "name", path[: i + 1])
    return None


def is_module(path: Path) -> bool:
    """Does the path stand for one of the allowed module objects (torch, torch.nn, torch.cuda, ...)?"""
    return ".".join(path) in MODULES


def names(namespace: str) -> frozenset[str]:
    """The names a launcher may use in an allowed namespace (empty for any other)."""
    return _names(namespace)


@functools.cache
def _names(namespace: str) -> frozenset[str]:
    if namespace in _STATIC:
        return _STATIC[namespace]
    build = _BUILDERS.get(namespace)
    if build is None:
        return frozenset()
    try:
        return frozenset(build())
    except ImportError:  # not installed here (einops): nothing of it can be vouched for
        return frozenset()


def _public(obj: object) -> list[str]:
    return [n for n in dir(obj) if not n.startswith("_")]


def _static(obj: object, name: str) -> object:
    try:
        return inspect.getattr_static(obj, name)
    except AttributeError:
        return None


def _by_identity(namespace: object, functions: Iterable[object]) -> set[str]:
    """The public names under which `namespace` holds one of `functions`."""
    ids = {id(f) for f in functions}
    return {n for n in _public(namespace) if id(_static(namespace, n)) in ids}


def _overridable(namespace: object) -> list[object]:
    from torch.overrides import get_overridable_functions

    return list(get_overridable_functions().get(namespace, []))


def _torch() -> set[str]:
    import torch

    ops = _by_identity(torch, [*_overridable(torch), *_overridable(torch.functional)])
    dtypes = {n for n in _public(torch) if isinstance(_static(torch, n), torch.dtype)}
    return ops | dtypes | _TORCH_EXTRA | TORCH_PLUMBING | TORCH_NON_TENSOR | TORCH_CONSTANTS


def _tensor() -> set[str]:
    import torch

    descriptors = {
        n
        for n in _public(torch.Tensor)
        if isinstance(
            _static(torch.Tensor, n), (property, types.GetSetDescriptorType, types.MemberDescriptorType)
        )
    }
    methods = TENSOR_PLUMBING | NON_TENSOR_METHODS | FORWARD_SYNC | NON_TENSOR_ATTRS | TENSOR_ATTRS
    return _by_identity(torch.Tensor, _overridable(torch.Tensor)) | descriptors | methods | _TENSOR_EXTRA


def _aten() -> set[str]:
    """ATen ops reached as torch.ops.aten.<op>.<overload>: those of an allowed torch, Tensor or functional
    name ("linalg_svd" for torch.linalg.svd), and the nn kernels behind torch.nn.functional."""
    import torch

    prefixed = {f"{ns}_{n}" for ns in ("linalg", "fft", "special") for n in names(f"torch.{ns}")}
    nn_kernels = set(_public(torch._C._nn))
    return names("torch") | names("torch.Tensor") | names("torch.nn.functional") | prefixed | nn_kernels


def _namespace_ops(module: str, extra: frozenset[str] = frozenset()) -> Callable[[], set[str]]:
    def build() -> set[str]:
        ns = importlib.import_module(module)
        return _by_identity(ns, _overridable(ns)) | extra

    return build


def _nn() -> set[str]:
    import torch.nn as nn

    modules = {n for n in _public(nn) if isinstance(v := _static(nn, n), type) and issubclass(v, nn.Module)}
    return modules | _NN_EXTRA


def _init() -> set[str]:
    import torch.nn.init as init

    return {
        n
        for n in _public(init)
        if isinstance(v := _static(init, n), types.FunctionType) and v.__module__ == "torch.nn.init"
    }


def _numpy() -> set[str]:
    import numpy

    scalar_types = {
        n for n in _public(numpy) if isinstance(v := _static(numpy, n), type) and issubclass(v, numpy.generic)
    }
    ufuncs = {n for n in _public(numpy) if isinstance(_static(numpy, n), numpy.ufunc)}
    return scalar_types | ufuncs | _NUMPY_EXTRA


def _math() -> set[str]:
    import math

    return set(_public(math))


def _itertools() -> set[str]:
    import itertools

    return set(_public(itertools))


def _abc() -> set[str]:
    import collections.abc

    return {n for n in _public(collections.abc) if isinstance(_static(collections.abc, n), type)}


def _future() -> set[str]:
    import __future__

    return set(__future__.all_feature_names)


_BUILDERS: dict[str, Callable[[], set[str]]] = {
    "torch": _torch,
    "torch.Tensor": _tensor,
    "torch.ops.aten": _aten,
    "torch.nn": _nn,
    "torch.nn.functional": _namespace_ops("torch.nn.functional", _F_EXTRA),
    "torch.nn.init": _init,
    "torch.linalg": _namespace_ops("torch.linalg"),
    "torch.fft": _namespace_ops("torch.fft"),
    "torch.special": _namespace_ops("torch.special"),
    "numpy": _numpy,
    "math": _math,
    "itertools": _itertools,
    "collections.abc": _abc,
    "__future__": _future,
}


@functools.cache
def _object(dotted: str) -> object:
    """The object an allowed namespace stands for, looked up without running any attribute hook."""
    parts = dotted.split(".")
    if importlib.util.find_spec(parts[0]) is None:
        return None
    obj: object = importlib.import_module(parts[0])
    for part in parts[1:]:
        obj = _static(obj, part)
        if obj is None:
            return None
    return obj


def _is_module(namespace: str, name: str) -> bool:
    """Is namespace.name a module (whatever its name: torch.cuda.os, typing.sys, numpy.random)?"""
    dotted = f"{namespace}.{name}"
    if name in sys.stdlib_module_names or dotted in sys.modules:
        return True
    if namespace in MODULES and _submodule(dotted):
        return True  # a submodule not imported yet (numpy.ctypeslib loads on first access)
    obj = _object(namespace)
    return obj is not None and isinstance(_static(obj, name), types.ModuleType)


def _submodule(dotted: str) -> bool:
    """Is there a module of that name? Finding it imports only its (allowed, imported) parent package."""
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):
        return False


def _module_in_tail(namespace: str, tail: Path) -> int:
    """The index in `tail` (from an allowed name on) of the first module object, or -1."""
    obj = _object(namespace)
    for i, part in enumerate(tail):
        obj = _static(obj, part) if obj is not None else None
        if obj is None:
            return -1
        if isinstance(obj, types.ModuleType):
            return i
    return -1
