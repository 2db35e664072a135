"""An elementwise region computed inside another region's kernel: on its loads (a prologue, `pre`) or on
its stores (an epilogue, `post`). Its other operands are one-element tensors, tensors of the same shape
(read at the same flat index) or vectors along a run of its dims (read at the flat index, divided by the
size of the dims after the run, modulo their size: the vector of a matrix-vector product wraps, a
vector-matrix product's steps once a row), so the host kernel's indexing needs no change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.generate.expert import ops
from pipeline.generate.expert.layout import Bcast, operand_class
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates.code import chain_function, ctype
from pipeline.generate.expert.templates.signature import Param, i64, ptr

# Emitted only with a fused vector operand (guarded: several regions may carry it), so that no other
# kernel's source, and so no recorded candidate's key, changes with it.
WRAP = r"""#ifndef KP_WRAP_DEFINED
#define KP_WRAP_DEFINED
// i % n for an operand that repeats every n elements of a flat index (a fused matrix-vector product's
// vector, a bias): a mask when n is a power of two, 32-bit division when both fit. A 64-bit division is a
// software routine of ~70 instructions on the GPU: on every element it made a GEMV compute-bound.
__device__ __forceinline__ long long kp_wrap(long long i, long long n) {
    if ((n & (n - 1)) == 0) return i & (n - 1);
    if ((((unsigned long long)i | (unsigned long long)n) >> 32) == 0) return (unsigned)i % (unsigned)n;
    return i % n;
}
#endif"""


def prepare_lines(operands: list[tuple[str, Bcast]], shape: str) -> list[str]:
    """Launcher lines making each fused operand (launcher name, class) what a kernel indexes: contiguous at
    the host's shape (FULL), one value a column (COL), or a scalar."""
    out = []
    for name, cls in operands:
        if cls is Bcast.FULL:
            out.append(f"    {name} = _full({name}, {shape})")
        elif cls is Bcast.COL:
            out.append(f"    {name} = _contig({name}.reshape(-1))")
        else:
            out.append(f"    {name} = _scalar({name})")
    return out


@dataclass(frozen=True)
class Fused:
    region: Region
    main: str  # the operand bound to the lambda's `v`
    extra: tuple[tuple[str, str, Bcast], ...]  # (value, dtype, FULL, SCALAR or COL) of the others
    prefix: str  # "f" for a prologue, "e" for an epilogue (names of its kernel parameters)
    out_dtype: str
    main_dtype: str
    inner: tuple[int, ...] = ()  # per extra operand: the elements a COL one's value holds for (1: trailing)
    fast: bool = False  # logs and exponentials by the special-function unit (the host plan's use_intrinsics)

    def params(self) -> list[Param]:
        """The host kernel's parameters for the extra operands (the launcher's names for them alike)."""
        out = []
        for k, (_, dt, cls) in enumerate(self.extra):
            name = f"{self.prefix}{k}"
            out.append(ptr(name, ctype(dt)))
            if cls is Bcast.COL:  # its length: the flat index wraps around it
                out.append(i64(f"{name}n", f"{name}.numel()"))
        return out

    def inputs(self) -> list[tuple[str, str]]:
        """(launcher name, graph value) of each extra operand, in the order of params()."""
        return [(f"{self.prefix}{k}", v) for k, (v, _, _) in enumerate(self.extra)]

    def prepare(self, shape: str) -> list[str]:
        """Launcher lines making each extra operand contiguous at the host's shape."""
        return prepare_lines([(f"{self.prefix}{k}", cls) for k, (_, _, cls) in enumerate(self.extra)], shape)

    def chain(self) -> str:
        wrap = any(cls is Bcast.COL for _, _, cls in self.extra)
        chain = chain_function(self.region, list(self.region.inputs), fast=self.fast)
        return "\n".join([*([WRAP] if wrap else []), chain])

    def vector_operands(self) -> list[int]:
        """The extra operands a host can load as vectors beside `main`: same shape and dtype (FULL), so the
        vector of main's elements [i, i + V) has theirs at the same offsets."""
        return [k for k, (_, dt, cls) in enumerate(self.extra) if cls is Bcast.FULL and dt == self.main_dtype]

    def lam(self, name: str, loaded: tuple[int, ...] = ()) -> str:
        """The lambda `name(v, i)`: the region's value at flat index i, main's element being v, each other
        operand read at i. `loaded`: these operands' elements come as arguments after i instead (the host
        loaded them as vectors with main's), named a0, a1... in this order."""
        args = []
        extra = {v: k for k, (v, _, _) in enumerate(self.extra)}
        for i in self.region.inputs:
            if i == self.main:
                args.append("v")
            elif extra[i] in loaded:
                args.append(f"ld(a{loaded.index(extra[i])})")
            else:
                k = extra[i]
                cls = self.extra[k][2]
                operand = f"{self.prefix}{k}"
                step = self.inner[k] if self.inner else 1  # a constant: the division is a multiply
                flat = "i" if step == 1 else f"(i / {step}LL)"
                at = {Bcast.FULL: "i", Bcast.COL: f"kp_wrap({flat}, {operand}n)"}.get(cls, "0")
                args.append(f"ld({operand}[{at}])")
        given = "".join(f", {ctype(self.extra[k][1])} a{j}" for j, k in enumerate(loaded))
        return (
            f"    [[maybe_unused]] auto {name} = [&](float v, long long i{given}) -> float {{\n"
            f"        float o0;\n        kp_{self.region.rid}_f({', '.join([*args, 'o0'])});\n"
            "        (void)i;\n        return o0;\n    };"
        )


def identity(name: str) -> str:
    return (
        f"    [[maybe_unused]] auto {name} = [&](float v, long long i) -> float {{\n        (void)i;\n"
        "        return v;\n    };"
    )


def fusable(region: Region, main: str, low: Lowered, prefix: str) -> Fused | None:
    """A Fused view of an ew region around `main`, or None when its operands don't allow it."""
    if region.kind is not RegionKind.EW or len(region.outputs) != 1 or main not in region.inputs:
        return None
    if ops.positional(region.nodes):  # the host's lambdas know a flat index only, not a row and column
        return None
    extra, inner = [], []
    for i in region.inputs:
        if i == main:
            continue
        node = low.by_name[i]
        cls = operand_class(node.shape or (), region.shape, 0)
        if cls not in (Bcast.FULL, Bcast.SCALAR, Bcast.COL):
            return None
        extra.append((i, node.dtype or "float32", cls))
        inner.append(_after(node.shape or (), region.shape) if cls is Bcast.COL else 1)
    if tuple(low.by_name[main].shape or ()) != tuple(region.shape or ()):
        return None  # the host's shape is main's: the region's own, on its loads or its stores
    out_dt = next(n.dtype for n in region.nodes if n.name == region.outputs[0]) or "float32"
    return Fused(
        region, main, tuple(extra), prefix, out_dt, low.by_name[main].dtype or "float32", tuple(inner)
    )


def _after(shape: tuple[int, ...], out: tuple[int, ...]) -> int:
    """The elements of `out` after the last dim along which `shape` (broadcasting to it) varies."""
    dims = (1,) * (len(out) - len(shape)) + tuple(shape)
    last = max(i for i, d in enumerate(dims) if d != 1)
    return math.prod(out[last + 1 :])
