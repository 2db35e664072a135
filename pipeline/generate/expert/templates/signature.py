"""One record per kernel parameter, from which both sides of a launch are written: the C parameter list
(and the forwarding call to the kernel's body) and the launcher's argument tuple. They cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

# Scalar C types and the numpy type the runtime passes them as (by value, the exact width).
_SCALARS = {"long long": "numpy.int64", "int": "numpy.int32"}


@dataclass(frozen=True)
class Param:
    name: str  # the C name, used by the kernel body
    ctype: str  # "const float* __restrict__", "long long", "const __grid_constant__ CUtensorMap"...
    value: str  # the launcher's Python expression for it: a tensor (or tensor map) name, an int expression

    @property
    def decl(self) -> str:
        return f"{self.ctype} {self.name}"

    @property
    def arg(self) -> str:
        scalar = _SCALARS.get(self.ctype)
        return f"{scalar}({self.value})" if scalar else self.value


def ptr(name: str, ctype: str, value: str = "", const: bool = True) -> Param:
    """A pointer to `ctype` elements, restrict-qualified; the launcher passes the tensor `value` (or `name`)."""
    return Param(name, f"{'const ' if const else ''}{ctype}* __restrict__", value or name)


def i64(name: str, value: str = "") -> Param:
    return Param(name, "long long", value or name)


def i32(name: str, value: str = "") -> Param:
    return Param(name, "int", value or name)


@dataclass(frozen=True)
class Signature:
    params: tuple[Param, ...]

    def decls(self) -> str:
        return ", ".join(p.decl for p in self.params)

    def names(self) -> str:
        return ", ".join(p.name for p in self.params)

    def args(self) -> str:
        return ", ".join(p.arg for p in self.params)


def kernel(bounds: str, name: str, sig: Signature, body: str) -> str:
    """An extern "C" kernel that forwards its parameters to a device function (or template) `body`."""
    return f'extern "C" __global__ void {bounds}\n{name}({sig.decls()}) {{\n    {body}({sig.names()});\n}}'


def row_kernels(rid: str, sig: Signature, threads: int, vec: bool) -> tuple[list[str], str]:
    """A warp-a-row kernel's two forms (families/common.py, warp_row_family): `kp_<rid>_rows` (scalar loads,
    always: a misaligned input) and, `vec`, `kp_<rid>_rows4` (16-byte loads), each forwarding to
    `kp_<rid>_rows_body<VEC>`. Their names, and their text."""
    names = [f"kp_{rid}_rows", *([f"kp_{rid}_rows4"] if vec else [])]
    text = "\n".join(
        f'extern "C" __global__ void __launch_bounds__({threads}) {name}({sig.decls()}) {{\n'
        f"    kp_{rid}_rows_body<{'true' if name.endswith('4') else 'false'}>({sig.names()});\n}}"
        for name in names
    )
    return names, text


def balanced_blocks(units: str, per_block: int, threads: int, waves: int = 16) -> str:
    """The launcher's expression for the blocks of a grid-stride kernel over `units` (rows a warp takes,
    positions a thread takes; `per_block` of them a block): one pass each where that is at most `waves` full
    waves of `threads`-thread blocks, else the fewest blocks that give every warp (thread) the same count.
    A grid capped at a couple of waves left some warps two rows and others one, and a last wave a fraction
    full (the triplet loss on 32768 rows of 8192: 2112 blocks, 5 resident an SM, at 71% of its floor)."""
    cap = f"sms * {max(1, 2048 // threads) * waves}"
    nb = f"max(1, -(-({units}) // {per_block}))"
    return f"-(-{nb} // -(-{nb} // ({cap})))"


def row_launch(rid: str, sig: Signature, threads: int, vec: bool, aligned: str, pad: str) -> list[str]:
    """The launcher lines of row_kernels' pair over `blocks`: the 16-byte kernel where `aligned` (a Python
    condition on the inputs) holds, else the scalar one; the scalar one alone without `vec`."""
    call = f"((blocks,), ({threads},), ({sig.args()}))  # noqa: F821"
    if not vec:
        return [f"{pad}kernels.kp_{rid}_rows{call}"]
    return [f"{pad}if {aligned}:", f"{pad}    kernels.kp_{rid}_rows4{call}", f"{pad}else:",
            f"{pad}    kernels.kp_{rid}_rows{call}"]  # fmt: skip


@dataclass(frozen=True)
class Variant:
    """One compiled form of a region's kernel and what the launcher checks before it launches it."""

    name: str
    vec: int = 1  # elements per vector access: the tensors must be aligned to vec elements
    cached: bool = False  # the row is cached in shared memory: it must fit
    regs: bool = False  # the row is held in registers: it must fit and split into whole vectors
