"""Code-aware chunking with tree-sitter: one chunk per class, struct, function or template specialisation.

Each chunk carries its symbol as written (`MMA_Traits<SM90_64x8x16_F16F16F16_SS<...>>`), the enclosing
namespace (`cute::SM90::GMMA::`), architecture tags from the path and symbol, and the file's #include
lines, which are also prefixed to the chunk's text so that a chunk reads on its own.
Parsing never raises: tree-sitter recovers from CUDA syntax and macros it does not know, and whatever
code lies outside any definition (an example's `using` configuration, `main`'s neighbours) is kept in
file-level chunks named after the file.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import PurePosixPath

import tree_sitter
import tree_sitter_cpp
import tree_sitter_python

MAX_LINES = 150  # longer definitions are cut into windows of at most this many lines
HEADER_LINES = 20  # at most this many #include / import lines in a chunk's header
MIN_GAP_LINES = 3  # code outside definitions needs this many meaningful lines to become a chunk
PY_SUFFIXES = frozenset({".py"})


@dataclass(frozen=True)
class Chunk:
    id: str  # stable: hash of corpus, path, symbol and start line
    text: str  # header + namespace note + code
    path: str  # relative to the corpus root, posix
    symbol: str
    kind: str  # header / example / tool (from the corpus)
    arch: tuple[str, ...]
    includes: tuple[str, ...]
    namespace: str  # "cute::" style, "" at global scope
    start_line: int  # 1-based, inclusive
    end_line: int  # 1-based, inclusive
    file_hash: str
    corpus: str = ""
    version: str = ""

    def metadata(self) -> dict[str, str | int]:
        """Flat scalar metadata, as a vector store takes it (tuples joined by commas)."""
        return {
            "corpus": self.corpus,
            "version": self.version,
            "path": self.path,
            "symbol": self.symbol,
            "kind": self.kind,
            "arch": ",".join(self.arch),
            "includes": ",".join(self.includes),
            "namespace": self.namespace,
            "start_line": self.start_line,
            "end_line": self.end_line,
            "file_hash": self.file_hash,
        }


# --- architecture tags ---------------------------------------------------------------------------

_KNOWN_SM = frozenset(
    {"70", "72", "75", "80", "86", "87", "89", "90", "100", "101", "103", "110", "120", "121"}
)
# `SM90_`, `sm_90a`, `Sm90` inside a longer identifier; not `sm900` nor a version digit before it.
_SM_RE = re.compile(r"(?<![0-9])sm_?(\d{2,3})(?![0-9])(a(?![a-z]))?")
_CODENAMES = {"volta": "sm70", "turing": "sm75", "ampere": "sm80", "hopper": "sm90", "blackwell": "sm100"}


def arch_tags(*texts: str) -> tuple[str, ...]:
    """Architecture tags found in paths or symbols; sm90a also tags sm90 so that filters on sm90 find it."""
    tags: set[str] = set()
    for text in texts:
        low = text.lower()
        for m in _SM_RE.finditer(low):
            if m.group(1) in _KNOWN_SM:
                tags.add("sm" + m.group(1))
                if m.group(2):
                    tags.add("sm" + m.group(1) + "a")
        for word, tag in _CODENAMES.items():
            if word in low:
                tags.add(tag)
    return tuple(sorted(tags, key=lambda t: (int(re.sub(r"\D", "", t)), t)))


# --- parsing ----------------------------------------------------------------------------------------


@cache
def _parser(lang: str) -> tree_sitter.Parser:
    mod = tree_sitter_python if lang == "python" else tree_sitter_cpp
    return tree_sitter.Parser(tree_sitter.Language(mod.language()))


_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"\n]+)[>"]', re.M)
_PY_IMPORT_RE = re.compile(r"^(?:from[ \t]+([\w.]+)[ \t]+import\b|import[ \t]+([\w.]+))", re.M)
_WS_RE = re.compile(r"\s+")

_CLASS_TYPES = frozenset({"struct_specifier", "class_specifier", "union_specifier"})
# Nodes whose children live in the same scope: preprocessor blocks, recovered errors, extern "C" bodies.
_TRANSPARENT = frozenset(
    {
        "preproc_if",
        "preproc_ifdef",
        "preproc_else",
        "preproc_elif",
        "preproc_elifdef",
        "ERROR",
        "declaration_list",
        "linkage_specification",
    }
)
_NAME_TYPES = frozenset(
    {
        "identifier",
        "field_identifier",
        "qualified_identifier",
        "template_function",
        "template_method",
        "operator_name",
        "destructor_name",
        "operator_cast",
    }
)


@dataclass
class _Def:
    symbol: str
    namespace: str
    start: int  # 0-based row
    end: int  # 0-based row, inclusive


def _clean(name: bytes) -> str:
    return _WS_RE.sub(" ", name.decode("utf-8", "replace")).strip()


def _strip_type_prefix(name: str) -> str:
    """Drop a return type glued to the name: after a macro such as CUTE_HOST_DEVICE, tree-sitter takes the
    macro for the type and reads `GmmaDescriptor make_gmma_desc` as one qualified name."""
    parts, depth, cur = [], 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)" and depth:
            depth -= 1
        if ch == " " and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    parts = [p for p in parts if p]
    if len(parts) <= 1:
        return name
    for i, p in enumerate(parts):
        if "operator" in p:  # `operator new`, `operator bool`: the words after it belong to the name
            return " ".join(parts[i:])
    return parts[-1]


def _function_name(fn: tree_sitter.Node) -> str | None:
    """The declarator's name, through pointer/reference wrappers, as written (`Foo<T>::bar`, `operator()`)."""
    node = fn.child_by_field_name("declarator")
    for _ in range(8):
        if node is None:
            return None
        if node.type == "function_declarator":
            inner = node.child_by_field_name("declarator")
            if inner is not None and inner.type in _NAME_TYPES:
                return _strip_type_prefix(_clean(inner.text))
            node = inner
            continue
        if node.type in _NAME_TYPES:
            return _strip_type_prefix(_clean(node.text))
        node = node.child_by_field_name("declarator")
    return None


def _class_name(spec: tree_sitter.Node) -> str | None:
    if spec.child_by_field_name("body") is None:
        return None  # a forward declaration
    name = spec.child_by_field_name("name")
    return _clean(name.text) if name is not None else None


def _definition(node: tree_sitter.Node) -> str | None:
    """Symbol of a definition node (function, class/struct/union with a body, or a template of one)."""
    t = node.type
    if t == "function_definition":
        return _function_name(node)
    if t in _CLASS_TYPES:
        return _class_name(node)
    if t == "template_declaration":
        for child in reversed(node.named_children):
            if child.type != "template_parameter_list":
                return _definition(child)
        return None
    if t == "declaration":  # `struct X {...} x;` declares and defines
        typ = node.child_by_field_name("type")
        if typ is not None and typ.type in _CLASS_TYPES:
            return _class_name(typ)
    return None


def _namespace_name(ns: tree_sitter.Node) -> str:
    name = ns.child_by_field_name("name")
    return _clean(name.text).replace(" ", "") if name is not None else ""


def _cpp_defs(root: tree_sitter.Node, aliases: dict[int, str]) -> list[_Def]:
    """Definitions at namespace scope; class bodies and function bodies are not entered.
    Alias declarations (`using X = ...`, plain or templated) are recorded in `aliases` by row."""
    out: list[_Def] = []
    stack: list[tuple[tree_sitter.Node, str]] = [(root, "")]
    while stack:
        node, ns = stack.pop()
        for child in node.named_children:
            t = child.type
            if t == "namespace_definition":
                name = _namespace_name(child)
                body = child.child_by_field_name("body")
                if body is not None:
                    stack.append((body, ns + name + "::" if name else ns))
            elif t in _TRANSPARENT:
                stack.append((child, ns))
            elif t == "alias_declaration" or (
                t == "template_declaration" and child.named_children[-1].type == "alias_declaration"
            ):
                alias = child if t == "alias_declaration" else child.named_children[-1]
                name = alias.child_by_field_name("name")
                if name is not None:
                    aliases[alias.start_point.row] = _clean(name.text)
            else:
                symbol = _definition(child)
                if symbol:
                    out.append(_Def(symbol, ns, child.start_point.row, child.end_point.row))
    out.sort(key=lambda d: (d.start, d.end))
    return out


def _python_defs(root: tree_sitter.Node) -> list[_Def]:
    out: list[_Def] = []
    for child in root.named_children:
        node = child
        if node.type == "decorated_definition":
            node = node.child_by_field_name("definition") or node
        if node.type in ("class_definition", "function_definition"):
            name = node.child_by_field_name("name")
            if name is not None:
                out.append(_Def(_clean(name.text), "", child.start_point.row, child.end_point.row))
    return out


# --- assembling chunks ------------------------------------------------------------------------------

_SEPARATOR_CHARS = frozenset("/-=*#")
_BORING_RE = re.compile(
    r"^\s*(?:#(?!\s*define\s+\w+\()|namespace\b[^=]*\{?\s*$|}\s*(?://.*)?$|"
    r"[{};]\s*$|//|/\*|\*|import\b|from\s+\S+\s+import\b|using\s+namespace\b)"
)


def _prefix_start(lines: list[str], start: int, floor: int) -> int:
    """Extend a C++ definition upwards over declaration lines that error recovery cut off (a template
    header before `__launch_bounds__(...)`, say): contiguous code lines that end no statement or block."""
    i = start
    while i - 1 >= floor:
        s = lines[i - 1].strip()
        if not s or s.endswith((";", "}", "{", ":")) or s.startswith(("#", "//", "/*", "*", "namespace")):
            break
        i -= 1
    return i


def _leading_comment_start(lines: list[str], start: int, floor: int) -> int:
    """Extend a definition upwards over the comment lines right above it (its documentation)."""
    i = start
    while i - 1 >= floor:
        s = lines[i - 1].strip()
        if not (s.startswith("//") or s.startswith("/*") or s.startswith("*") or s.startswith("#[")):
            break
        if len(s) >= 8 and set(s) <= _SEPARATOR_CHARS:  # a `/////////` rule ends a doc block
            break
        i -= 1
    # Never begin inside a block comment whose opening line was left out (a `*/` alone, say).
    while i < start and not lines[i].lstrip().startswith(("//", "/*")):
        i += 1
    return i


def _windows(start: int, end: int) -> Iterator[tuple[int, int]]:
    """Split [start, end] (inclusive rows) into near-equal consecutive windows of at most MAX_LINES."""
    n = end - start + 1
    count = -(-n // MAX_LINES)
    size = -(-n // count)
    for s in range(start, end + 1, size):
        yield s, min(s + size - 1, end)


def _chunk_id(corpus: str, path: str, symbol: str, start_line: int) -> str:
    key = f"{corpus}\x00{path}\x00{symbol}\x00{start_line}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def chunk_file(rel_path: str, text: str, corpus: str, version: str, kind: str) -> list[Chunk]:
    """Chunks of one source file, in line order. Never raises on bad code."""
    path = PurePosixPath(rel_path).as_posix()
    stem = PurePosixPath(path).stem
    is_py = PurePosixPath(path).suffix.lower() in PY_SUFFIXES
    data = text.encode("utf-8", "replace")
    file_hash = hashlib.sha256(data).hexdigest()
    lines = text.splitlines()
    if not lines or not text.strip():
        return []

    if is_py:
        includes = tuple(dict.fromkeys(a or b for a, b in _PY_IMPORT_RE.findall(text)))
        header_lines = [ln for ln in lines if _PY_IMPORT_RE.match(ln)]
    else:
        includes = tuple(dict.fromkeys(m.strip() for m in _INCLUDE_RE.findall(text)))
        header_lines = [ln.strip() for ln in lines if _INCLUDE_RE.match(ln)]
    header = "\n".join(dict.fromkeys(header_lines[:HEADER_LINES]))

    aliases: dict[int, str] = {}
    try:
        tree = _parser("python" if is_py else "cpp").parse(data)
        defs = _python_defs(tree.root_node) if is_py else _cpp_defs(tree.root_node, aliases)
    except Exception:  # a parser failure must not stop an index build; fall back to whole-file chunks
        defs = []

    chunks: list[Chunk] = []

    def emit(symbol: str, ns: str, start: int, end: int) -> None:
        arch = arch_tags(path, symbol)
        for ws, we in _windows(start, end):
            body = "\n".join(lines[ws : we + 1])
            part = f" (lines {ws + 1}-{we + 1} of {start + 1}-{end + 1})" if (ws, we) != (start, end) else ""
            note = f"// {corpus} {version} {path} :: {ns}{symbol}{part}"
            chunk_text = "\n".join(x for x in (note, header, body) if x)
            chunks.append(
                Chunk(
                    id=_chunk_id(corpus, path, symbol, ws + 1),
                    text=chunk_text,
                    path=path,
                    symbol=symbol,
                    kind=kind,
                    arch=arch,
                    includes=includes,
                    namespace=ns,
                    start_line=ws + 1,
                    end_line=we + 1,
                    file_hash=file_hash,
                    corpus=corpus,
                    version=version,
                )
            )

    # Definitions, each widened over its doc comment; nested hits (rare, from error recovery) are dropped.
    covered_to = -1
    spans: list[tuple[int, int]] = []
    for d in defs:
        if d.start <= covered_to:
            continue
        start = d.start if is_py else _prefix_start(lines, d.start, covered_to + 1)
        start = _leading_comment_start(lines, start, covered_to + 1)
        end = min(d.end, len(lines) - 1)
        emit(d.symbol, d.namespace, start, end)
        spans.append((start, end))
        covered_to = end

    # Code between definitions (configuration `using`s, globals, macros) becomes file-level chunks.
    gap_start = 0
    for s, e in [*spans, (len(lines), len(lines))]:
        if s > gap_start:
            _emit_gap(lines, gap_start, s - 1, stem, aliases, emit)
        gap_start = e + 1

    if not chunks:  # nothing worth a chunk: the whole file, so that no file vanishes from the index
        emit(stem, "", 0, len(lines) - 1)
    chunks.sort(key=lambda c: (c.start_line, c.end_line))
    return chunks


def _emit_gap(lines: list[str], start: int, end: int, stem: str, aliases: dict[int, str], emit) -> None:
    # Trim blank and boilerplate lines at both ends so that a gap chunk holds code, not license text.
    meaningful = [i for i in range(start, end + 1) if lines[i].strip() and not _BORING_RE.match(lines[i])]
    if len(meaningful) < MIN_GAP_LINES:
        return
    # A gap that defines one alias (`using SM90_64x8x16_F16F16F16_SS = ...`) is named by it: that is the
    # name a search asks for. Several aliases (an example's configuration) keep the file's name.
    names = {aliases[r] for r in range(meaningful[0], meaningful[-1] + 1) if r in aliases}
    emit(names.pop() if len(names) == 1 else stem, "", meaningful[0], meaningful[-1])
