"""Building blocks of the WGMMA GEMM, found in the CUTLASS/CuTe sources rather than named here.

The template knows what it needs in hardware terms (the PTX instruction an MMA atom wraps, the TMA copy
it issues, the mbarrier operations, the swizzled shared-memory layout GMMA reads) and asks for the C++
symbol that provides it. The source hunter answers when an index is built (`make index`); the same
question is then checked against, or answered from, the installed headers of the pinned nvidia-cutlass
wheel, so a candidate always names a symbol that exists in the headers it is compiled with. CUTLASS has
renamed these atoms between releases (`SM90_64x128x16_F32BF16BF16_SS` became
`SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS`); asking by instruction keeps the template working across them.
"""

from __future__ import annotations

import functools
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.compile import _cutlass


class AtomNotFound(LookupError):
    pass


@dataclass(frozen=True)
class Atom:
    name: str  # qualified C++ name, as the template writes it
    header: str  # include path, e.g. cute/arch/mma_sm90_gmma.hpp
    line: int
    via: str  # "index" (the source hunter) or "headers" (scan of the installed headers)

    def cite(self) -> str:
        """Where it is defined (the same with or without an index, so candidate keys do not depend on it)."""
        return f"{self.name} ({self.header}:{self.line})"


@dataclass(frozen=True)
class Need:
    """What a building block must do: a PTX fragment in its body, the files to look in, a name filter."""

    what: str  # words for the hunter and for error messages
    ptx: str  # a fragment of the inline PTX the definition must contain
    files: tuple[str, ...]  # header globs under the include directory
    name: str = r"\w+"  # regex the symbol's name must match (e.g. SS, not RS, operands)
    kind: str = "struct"  # struct, "function", or "using" for a layout alias matched on its definition text
    queries: tuple[str, ...] = ()  # what the source hunter is asked (CUTLASS's own words); `what` by default


def gmma(n: int, dtype: str) -> Need:
    """The warpgroup MMA atom 64 x n x 16, fp32 accumulators, both operands from shared memory."""
    t = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    return Need(
        f"warpgroup MMA atom 64x{n}x16 F32 {t.upper()} {t.upper()} SS shared-memory operands",
        f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t}",
        ("cute/arch/mma_sm90_gmma.hpp", "cute/arch/mma_sm90_gmma_ext.hpp"),
        name=r"\w*_SS(?:_TN)?",
        # CuTe's own name for the struct first: among the hundreds of near-identical GMMA structs the
        # embedding alone ranks the right one below its neighbours in some builds of the index
        queries=(
            f"MMA_64x{n}x16_F32{t.upper()}{t.upper()}_SS",
            f"64x{n}x16 F32{t.upper()}{t.upper()} SS",
            f"GMMA 64x{n}x16 F32{t.upper()}{t.upper()} SS",
        ),
    )


def gmma_tf32(n: int, a_regs: bool = False) -> Need:
    """The warpgroup MMA atom 64 x n x 8 on tf32 operands, fp32 accumulators, both from shared memory or
    (a_regs) A from registers (tf32 takes K-major operands only: "TN")."""
    ab = "RS" if a_regs else "SS"
    where = "register A, shared-memory B" if a_regs else "shared-memory operands"
    return Need(
        f"warpgroup MMA atom 64x{n}x8 F32 TF32 TF32 {ab} {where}",
        f"wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32",
        ("cute/arch/mma_sm90_gmma.hpp", "cute/arch/mma_sm90_gmma_ext.hpp"),
        name=rf"\w*_{ab}_TN",
        queries=(
            f"MMA_64x{n}x8_F32TF32TF32_{ab}_TN",
            f"64x{n}x8 F32TF32TF32 {ab} TN",
            f"GMMA 64x{n}x8 F32TF32TF32 {ab}",
        ),
    )


FENCE_ASYNC_SHARED = Need(  # generic-proxy writes to shared memory made visible to WGMMA's async proxy
    "fence making shared-memory writes visible to the async proxy",
    "fence.proxy.async.shared::cta",
    ("cutlass/arch/barrier.h",),
    name=r"fence_view_async_shared",
    kind="function",
    queries=("fence view async shared proxy",),
)


TMA_LOAD_3D = Need(  # (col, row, batch): a plain GEMM is a batch of one
    "TMA 3-D tile load into shared memory with mbarrier completion",
    "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes",
    ("cute/arch/copy_sm90_tma.hpp",),
    name=r"SM90_TMA_LOAD\w*3D",
    queries=("SM90 TMA LOAD 3D tile copy",),
)
TMA_LOAD_MULTICAST_3D = Need(  # the same load, written into the shared memory of each block in a mask
    "TMA 3-D tile load multicast to the blocks of a cluster, mbarrier completion in each",
    "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster",
    ("cute/arch/copy_sm90_tma.hpp",),
    name=r"SM90_TMA_LOAD_MULTICAST\w*3D",
    queries=("SM90 TMA LOAD MULTICAST 3D cluster multicast copy",),
)
TX_BARRIER = Need(
    "mbarrier with transaction bytes: arrive and expect tx, wait on phase parity",
    "mbarrier.arrive.expect_tx",
    ("cutlass/arch/barrier.h",),
    name=r"\w*TransactionBarrier",
    queries=("cluster transaction barrier mbarrier arrive expect tx bytes",),
)
ARRIVE_BARRIER = Need(
    "mbarrier arrive and wait, cluster scope",
    "mbarrier.try_wait.parity",
    ("cutlass/arch/barrier.h",),
    name=r"ClusterBarrier",
    queries=("cluster barrier mbarrier arrive wait",),
)


def _swizzled(major: str, row_bytes: int = 128) -> Need:
    """The GMMA shared-memory layout with the row_bytes swizzle (128 or 64): rows of that many bytes with K
    contiguous ("K"), or M / N contiguous ("MN": a row-major (K, N) B operand); typed by `upcast`."""
    return Need(
        f"GMMA shared-memory layout atom, {major}-major, {row_bytes}-byte swizzle",
        f"Swizzle<{row_bytes.bit_length() - 5},4,3>",  # 16-byte chunks, 2^B of them a row
        ("cute/atom/mma_traits_sm90_gmma.hpp",),
        name=rf"Layout_{major}_\w*Atom_Bits",
        kind="using",
        queries=(f"GMMA Layout {major} SW{row_bytes} Atom {major}-major swizzle",),
    )


SW128_K, SW128_MN = _swizzled("K"), _swizzled("MN")
# K-major rows of 64 bytes (32 fp16: the fp16x3 convolution's k tile, gathered 32 wide as its 3xTF32 one)
SW64_K = _swizzled("K", 64)


# Per hunter (a policy renders the same GEMM many times). Keyed by id, so each entry keeps a weak reference
# to its hunter: a later hunter that reuses a freed one's id must not get that one's answers.
_FOUND: dict[tuple[Need, int], tuple[Any, Atom]] = {}


def find(need: Need, hunter: Any = None) -> Atom:
    """The symbol that provides `need`: the hunter's pick if it checks out in the headers, else the headers'."""
    key = (need, id(hunter))
    hit = _FOUND.get(key)
    if hit is None or (hit[0]() if hit[0] is not None else None) is not hunter:
        _FOUND[key] = (weakref.ref(hunter) if hunter is not None else None, _find(need, hunter))
    return _FOUND[key][1]


def _find(need: Need, hunter: Any) -> Atom:
    defs = _definitions(need.files, need.kind)
    matching = [d for d in defs if need.ptx in d.body and re.fullmatch(need.name, d.short)]
    if need.kind == "using":  # a layout in bits: the alias that types it for an element (via upcast)
        matching = [
            t
            for d in matching
            for t in defs
            if f"{d.short}{{}}" in t.body and "upcast" in t.body and t.short != d.short
        ]
    if hunter is not None:
        blocks = []
        for query in need.queries or (need.what,):
            try:
                blocks += hunter.hunt(query, k=8, arch="sm90")
            except Exception:  # the index helps; the headers are the authority either way
                break
        # The hunter's definition itself, else a definition in a file it found (its chunk may be the
        # family's dispatcher, e.g. SM90_TMA_LOAD for SM90_TMA_LOAD_2D); the headers pin the exact struct.
        for b in blocks:
            short = str(getattr(b, "symbol", "")).split("::")[-1].split("<")[0].strip()
            hit = next((d for d in matching if d.short == short), None)
            if hit is not None:
                return Atom(hit.qualified, hit.header, hit.line, "index")
        for b in blocks:
            path = str(getattr(b, "path", ""))
            here = [d for d in matching if path.endswith(d.header)]
            if here:
                best = min(here, key=lambda d: (len(d.short), d.line))
                return Atom(best.qualified, best.header, best.line, "index")
    if not matching:
        raise AtomNotFound(
            f"no {need.what} ({need.ptx}) in {', '.join(need.files)} of the installed CUTLASS headers"
        )
    # Plain atoms before variants with extra template parameters: the shortest name wins, then the first.
    best = min(matching, key=lambda d: (len(d.short), d.header, d.line))
    return Atom(best.qualified, best.header, best.line, "headers")


@dataclass(frozen=True)
class _Def:
    short: str
    qualified: str
    header: str
    line: int
    body: str


_STRUCT = re.compile(r"\b(?:struct|class)\s+(\w+)\s*(?::[^{;]*)?\{")
_USING = re.compile(r"\busing\s+(\w+)\s*=\s*([^;]*);")
_FUNCTION = re.compile(r"\bvoid\s+(\w+)\s*\([^;{)]*\)\s*\{")


@functools.lru_cache(maxsize=16)
def _definitions(globs: tuple[str, ...], kind: str) -> tuple[_Def, ...]:
    dirs, _ = _cutlass()
    if not dirs:
        raise AtomNotFound("the nvidia-cutlass wheel is not installed: no CUTLASS headers to take atoms from")
    root = Path(dirs[0])
    out: list[_Def] = []
    for g in globs:
        for path in sorted(root.glob(g)):
            text = path.read_text(errors="replace")
            header = path.relative_to(root).as_posix()
            out += _scan(text, header, kind)
    return tuple(out)


def _scan(text: str, header: str, kind: str) -> list[_Def]:
    """Top-level definitions of one header with their namespaces (comments and strings skipped)."""
    code = _blank_comments(text)
    out: list[_Def] = []
    stack: list[str | None] = []  # one entry per open brace: a namespace name, or None
    pending_ns: str | None = None
    i, n = 0, len(code)
    ns_re = re.compile(r"namespace\s+([\w:]+)\s*\{")
    while i < n:
        c = code[i]
        if c == "n" and code.startswith("namespace", i) and (i == 0 or not code[i - 1].isalnum()):
            m = ns_re.match(code, i)
            if m:
                pending_ns = m.group(1)
                i = m.end() - 1
                continue
        if kind == "struct" and c in "sc" and (i == 0 or not (code[i - 1].isalnum() or code[i - 1] == "_")):
            m = _STRUCT.match(code, i)
            if m:
                end = _matching_brace(code, m.end() - 1)
                out.append(_def(m.group(1), stack, header, text, i, text[i:end]))
                i = end
                continue
        if kind == "function" and c == "v" and (i == 0 or not (code[i - 1].isalnum() or code[i - 1] == "_")):
            m = _FUNCTION.match(code, i)
            if m:
                end = _matching_brace(code, m.end() - 1)
                out.append(_def(m.group(1), stack, header, text, i, text[i:end]))
                i = end
                continue
        if kind == "using" and c == "u" and (i == 0 or not code[i - 1].isalnum()):
            m = _USING.match(code, i)
            if m:
                out.append(_def(m.group(1), stack, header, text, i, text[i : m.end()]))
                i = m.end()
                continue
        if c == "{":
            stack.append(pending_ns)
            pending_ns = None
        elif c == "}" and stack:
            stack.pop()
        i += 1
    return out


def _def(name: str, stack: list[str | None], header: str, text: str, pos: int, body: str) -> _Def:
    ns = "::".join(s for s in stack if s and s != "cute")  # the template opens `using namespace cute`
    return _Def(name, f"{ns}::{name}" if ns else name, header, text.count("\n", 0, pos) + 1, body)


def _matching_brace(code: str, open_at: int) -> int:
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(code)


def _blank_comments(text: str) -> str:
    """The text with comments, string and character literals replaced by spaces (offsets kept)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text[i] in "\"'":
            q, j = text[i], i + 1
            while j < n and text[j] != q and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(n, j + 1)
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)
