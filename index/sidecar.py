"""Files kept next to a Chroma collection for the lexical side of retrieval, and the tokenizer they use.

Layout, under ``sidecar_dir(cfg, collection)`` = ``<cfg.home>/index/<collection>/``:

- ``bm25/``          a ``bm25s`` index (``BM25.save``, no corpus stored), over ``tokenize(document)``;
                     document i of the index is chunk ``ids[i]``.
- ``ids.json``       ``["<chunk id>", ...]``: chunk ids in the bm25 corpus order.
- ``symbols.json``   ``{"<symbol>": ["<chunk id>", ...]}``; keys from ``symbol_keys``: the symbol as
                     chunked, with its namespace, its last ``::`` component, and each without template
                     arguments (case kept; look up exact first, then lowercase via ``Sidecars.find``).
- ``manifest.json``  ``{"corpus", "version", "collection", "model", "dimension", "chunks", "files",
                     "built_at" (ISO 8601 UTC), "seconds"}``.

The whole folder is written into a temporary sibling and swapped in with renames, so a reader sees the
old set or the new one, never a mix; an interrupted write leaves the previous set in place.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from index.store import StoreError

if TYPE_CHECKING:
    from pipeline.config import Config

BM25_DIR = "bm25"
IDS_FILE = "ids.json"
SYMBOLS_FILE = "symbols.json"
MANIFEST_FILE = "manifest.json"
_OLD_SUFFIX = ".old"  # the previous set during a swap; read if the swap was interrupted

# Identifiers, possibly qualified (`cute::make_tensor`), and bare numbers.
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*|\d+")
# CamelCase and digit boundaries inside one `_`-free part: `SM90TmaLoad` -> SM 90 Tma Load.
_PART_RE = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
_TEMPLATE_RE = re.compile(r"<[^<>]*>")


def tokenize(text: str) -> list[str]:
    """Code-aware, lowercase tokens: each identifier whole, then its `::`, `_`, CamelCase and digit parts.

    `cute::SM90_TMA_LOAD` -> cute::sm90_tma_load, cute, sm90_tma_load, sm90, sm, 90, tma, load.
    Single characters are dropped (template parameters, loop variables): they only add noise.
    """
    out: list[str] = []
    for word in _IDENT_RE.findall(text):
        out.extend(_word_tokens(word))
    return out


@functools.lru_cache(maxsize=1 << 16)
def _word_tokens(word: str) -> tuple[str, ...]:
    """One identifier's tokens (an index build meets the same identifiers thousands of times)."""
    toks: dict[str, None] = {word.lower(): None}  # ordered set: no repeats within one identifier
    for comp in word.split("::"):
        toks[comp.lower()] = None
        for piece in comp.split("_"):
            toks[piece.lower()] = None
            for part in _PART_RE.findall(piece):
                toks[part.lower()] = None
    return tuple(t for t in toks if len(t) > 1)


def symbol_keys(symbol: str, namespace: str = "") -> list[str]:
    """The keys under which a chunk's symbol is filed in symbols.json (and looked up)."""
    keys: dict[str, None] = {}
    for full in (symbol, f"{namespace}{symbol}" if namespace else symbol):
        for variant in (full, _strip_templates(full)):
            variant = variant.strip()
            if not variant:
                continue
            keys[variant] = None
            last = variant.rsplit("::", 1)[-1].strip()
            if last:
                keys[last] = None
    return list(keys)


def _strip_templates(name: str) -> str:
    prev = None
    while prev != name:  # innermost first, for nested arguments
        prev, name = name, _TEMPLATE_RE.sub("", name)
    return name


@dataclass(frozen=True)
class Sidecars:
    bm25: Any  # bm25s.BM25, or None when the index holds no chunks
    ids: list[str]
    symbols: dict[str, list[str]]
    manifest: dict[str, Any]
    _lower: dict[str, list[str]] = field(default_factory=dict, repr=False, compare=False)

    def find(self, symbol: str) -> list[str]:
        """Chunk ids for a symbol: exact key first, else case-insensitive, else by the last component."""
        for key in (symbol, _strip_templates(symbol)):
            if key in self.symbols:
                return list(self.symbols[key])
        if not self._lower:
            for k, v in self.symbols.items():
                self._lower.setdefault(k.lower(), []).extend(v)
        for key in (symbol.lower(), _strip_templates(symbol).rsplit("::", 1)[-1].lower()):
            if key in self._lower:
                return list(dict.fromkeys(self._lower[key]))
        return []


def sidecar_dir(cfg: Config, collection_name: str) -> Path:
    return Path(cfg.home) / "index" / collection_name


def write_sidecars(
    dir: Path,
    ids: Sequence[str],
    documents: Sequence[str],
    symbols: Mapping[str, Sequence[str]],
    manifest: Mapping[str, Any],
) -> None:
    """Write the whole sidecar set for `dir` atomically (temp folder, then renames)."""
    import bm25s  # numpy/scipy: only when needed

    if len(ids) != len(documents):
        raise ValueError("write_sidecars: ids and documents differ in length")
    dir = Path(dir)
    dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dir.name}-", dir=dir.parent))
    try:
        if ids:
            retriever = bm25s.BM25()
            retriever.index([tokenize(d) or ["<empty>"] for d in documents], show_progress=False)
            retriever.save(str(tmp / BM25_DIR), show_progress=False)
        _write_json(tmp / IDS_FILE, list(ids))
        _write_json(tmp / SYMBOLS_FILE, {k: list(v) for k, v in symbols.items()})
        _write_json(tmp / MANIFEST_FILE, dict(manifest))
        old = dir.with_name(dir.name + _OLD_SUFFIX)
        if old.exists():
            shutil.rmtree(old)
        if dir.exists():
            os.replace(dir, old)
        os.replace(tmp, dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())


def load_sidecars(cfg: Config, collection_name: str) -> Sidecars:
    """The sidecar set of a collection; StoreError (one line) when it is missing or damaged."""
    import bm25s

    dir = sidecar_dir(cfg, collection_name)
    if not (dir / MANIFEST_FILE).is_file():
        old = dir.with_name(dir.name + _OLD_SUFFIX)  # a swap interrupted between its two renames
        if (old / MANIFEST_FILE).is_file():
            dir = old
        else:
            raise StoreError(
                f"no index files for {collection_name!r} in {dir.parent}; build it with `kernelpro index build`"
            )
    try:
        ids = json.loads((dir / IDS_FILE).read_text(encoding="utf-8"))
        symbols = json.loads((dir / SYMBOLS_FILE).read_text(encoding="utf-8"))
        manifest = json.loads((dir / MANIFEST_FILE).read_text(encoding="utf-8"))
        bm25 = None
        if ids:
            bm25 = bm25s.BM25.load(str(dir / BM25_DIR), show_progress=False)
    except (OSError, ValueError) as e:
        raise StoreError(
            f"index files in {dir} are damaged ({e}); rebuild with `kernelpro index build`"
        ) from None
    return Sidecars(bm25=bm25, ids=ids, symbols=symbols, manifest=manifest)
