"""The source hunter: finds building blocks (an MMA atom, a TMA copy, a pipeline, a tile scheduler) in an
indexed corpus.

Four retrievers, fused by reciprocal rank (k=60):

- exact symbols: identifier-like words of the query (`SM90_TMA_LOAD`, `cute::make_tma_copy`, `Swizzle`
  alone) looked up in the sidecar's symbol table, and among the names inside specialisations' template
  arguments (`MMA_Traits<SM90_64x128x16_F32BF16BF16_SS<...>>`); a query made of identifiers puts them first;
- BM25 over the chunk texts, with the sidecar's code-aware tokenizer;
- dense vectors (the collection's embeddings, of short per-chunk texts);
- path words: files whose path shares the query's words (`stream-K tile scheduler` ->
  `sm90_tile_scheduler_stream_k.hpp`), each represented by its best BM25 chunk.

Everything a query needs is loaded once per `Hunter` (sidecars, chunk metadata, the embedding model), so a
warm query costs one embedding, one sparse product and one Chroma round trip.
"""

from __future__ import annotations

import math
import re
import statistics
import time
import tomllib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np

from corpora import Corpus, index_commands, load_corpus
from index.build import collection_name
from index.sidecar import load_sidecars, tokenize
from index.store import Embedder, StoreError, open_store

if TYPE_CHECKING:
    from pipeline.config import Config

RRF_K = 60
N_BM25 = 100  # candidates per retriever before fusion
N_DENSE = 60
N_DENSE_FILTERED = 200  # Chroma cannot filter comma-joined arch tags: over-fetch, then filter
N_PATH_FILES = 30
SNIPPET_LINES = 80
CHARS_PER_TOKEN = 4
INCLUDE_DEPTH = 3  # how far follow_includes walks the include graph

# Weights of each retriever's reciprocal-rank term.
W_EXACT, W_BM25, W_DENSE, W_PATH = 2.0, 1.0, 0.8, 1.5
# Added to exact hits when the query is made of identifiers: a named symbol's definition comes first.
# Index: match level (0 whole symbol, 1 last `::` part or without template arguments, 2 named inside a
# specialisation's template arguments).
EXACT_BONUS = (1.0, 0.8, 0.1)

_HEADER_SUFFIXES = frozenset({".h", ".hpp", ".hh", ".cuh", ".inl", ".inc"})
_INCLUDE_ROOTS = ("include/", "tools/util/include/", "tools/library/include/")
_QUERY_IDENT_RE = re.compile(r"`([^`]+)`|(?:::)?[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*")
_CAMEL_RE = re.compile(r"[a-z][A-Z]|[A-Z]{2,}[a-z]")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TEMPLATE_ARGS_RE = re.compile(r"<(.*)>", re.S)
_ARCH_RE = re.compile(r"^(?:sm_?)?(\d{2,3})(a?)$")
# Query words that carry no meaning for code search.
_STOP = frozenset(
    {
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "by",
        "can",
        "do",
        "does",
        "for",
        "from",
        "how",
        "i",
        "in",
        "into",
        "is",
        "it",
        "its",
        "of",
        "on",
        "or",
        "that",
        "the",
        "this",
        "to",
        "use",
        "used",
        "using",
        "via",
        "what",
        "when",
        "where",
        "which",
        "with",
        "without",
    }
)
# Codenames and their architecture tags, both ways: examples say `hopper`, headers say `sm90`.
_ARCH_WORDS = {
    "volta": "sm70",
    "turing": "sm75",
    "ampere": "sm80",
    "ada": "sm89",
    "hopper": "sm90",
    "blackwell": "sm100",
}
_ARCH_WORDS_REV = {v: k for k, v in _ARCH_WORDS.items()}
# Words that name nothing in a snippet worth following (keywords, CUTLASS/CuTe macros, common types).
_NOT_DEPS = frozenset(
    {
        "auto",
        "bool",
        "break",
        "case",
        "char",
        "class",
        "const",
        "constexpr",
        "continue",
        "decltype",
        "default",
        "delete",
        "do",
        "double",
        "else",
        "enum",
        "explicit",
        "extern",
        "false",
        "float",
        "for",
        "friend",
        "if",
        "inline",
        "int",
        "long",
        "namespace",
        "new",
        "noexcept",
        "nullptr",
        "operator",
        "private",
        "protected",
        "public",
        "return",
        "short",
        "signed",
        "sizeof",
        "static",
        "static_assert",
        "struct",
        "switch",
        "template",
        "this",
        "true",
        "typedef",
        "typename",
        "union",
        "unsigned",
        "using",
        "virtual",
        "void",
        "volatile",
        "while",
        "uint32_t",
        "uint64_t",
        "int32_t",
        "int64_t",
        "uint8_t",
        "uint16_t",
        "size_t",
        "CUTE_HOST_DEVICE",
        "CUTE_DEVICE",
        "CUTLASS_HOST_DEVICE",
        "CUTLASS_DEVICE",
        "CUTE_HOST",
        "CUTLASS_HOST",
        "CUTE_INLINE_CONSTANT",
        "CUTLASS_PRAGMA_UNROLL",
        "CUTE_UNROLL",
        "CUTLASS_PRAGMA_NO_UNROLL",
        "include",
        "cute",
        "cutlass",
        "std",
        "type",
        "value",
    }
)


@dataclass(frozen=True)
class Block:
    """One building block: a definition (or an example's part) and how to use it."""

    corpus: str
    path: str  # relative to the corpus root
    symbol: str
    kind: str  # header / example / tool
    arch: tuple[str, ...]
    snippet: str  # the chunk text, trimmed to a line budget
    include_line: str | None  # `#include <cute/...>` for headers; None for examples and sources
    score: float
    sources: tuple[str, ...]  # retrievers that found it: exact, bm25, dense, path (include: followed)
    id: str = ""
    start_line: int = 0
    end_line: int = 0
    namespace: str = ""
    includes: tuple[str, ...] = ()


@dataclass(frozen=True)
class EvalCase:
    query: str
    expected: tuple[str, ...]  # paths relative to the corpus root; a trailing `/` means a folder
    arch: str | None = None
    style: str = ""  # "nl" or "symbol", for the report


@dataclass(frozen=True)
class CaseResult:
    case: EvalCase
    rank: int | None  # 1-based rank of the first expected file among the results, None if absent
    top_paths: tuple[str, ...]
    ms: float


@dataclass(frozen=True)
class EvalReport:
    recall_at_5: float
    mrr: float  # over the top 10
    per_case: list[CaseResult] = field(default_factory=list)
    p50_ms: float = 0.0


def _no_index(corpus: str) -> StoreError:
    make, kp = index_commands(corpus)
    return StoreError(f"no index for corpus {corpus}: run `{make}` ({kp})")


def include_line(path: str, kind: str) -> str | None:
    """The line that brings a file's definitions into a kernel, or None where there is none to use."""
    p = PurePosixPath(path)
    if kind == "example" or p.suffix.lower() not in _HEADER_SUFFIXES:
        return None
    for root in _INCLUDE_ROOTS:
        if path.startswith(root):
            return f"#include <{path[len(root) :]}>"
    if "/include/" in path:
        return f"#include <{path.split('/include/', 1)[1]}>"
    return f'#include "{path}"'  # a user's own header, relative to its corpus root


def _arch_ok(tags: tuple[str, ...], arch: str | None) -> bool:
    if arch is None or not tags:
        return True
    return arch in tags or arch.rstrip("a") in tags


def _norm_arch(arch: str | None) -> str | None:
    if arch is None or not arch.strip():
        return None
    m = _ARCH_RE.match(arch.strip().lower())
    if not m:
        raise ValueError(f"unknown arch {arch!r}: use a form like sm90, sm_90a or 90")
    return f"sm{m.group(1)}{m.group(2)}"


def _stem(word: str) -> str:
    """Plural-insensitive matching of path words: `layouts` ~ `layout`, `kernels` ~ `kernel`."""
    if len(word) > 4 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def _template_names(symbol: str) -> set[str]:
    """Names inside a specialisation's template arguments: `MMA_Traits<SM90_X<a, b>>` -> {SM90_X}."""
    m = _TEMPLATE_ARGS_RE.search(symbol)
    if not m:
        return set()
    return {
        n for n in _NAME_RE.findall(m.group(1)) if len(n) > 3 and ("_" in n or any(c.isdigit() for c in n))
    }


def _identifier_like(word: str) -> bool:
    return (
        "_" in word
        or "::" in word
        or bool(_CAMEL_RE.search(word))
        or (any(c.isdigit() for c in word) and any(c.isalpha() for c in word) and len(word) > 4)
    )


class Hunter:
    """Retrieval over one corpus's index; open once, query many times."""

    def __init__(
        self, cfg: Config, corpus: str | Corpus = "cutlass", *, embedder: Embedder | None = None
    ) -> None:
        corp = corpus if isinstance(corpus, Corpus) else load_corpus(corpus)
        self.cfg = cfg
        self.corpus = corp.name
        self.collection_name = collection_name(corp)
        try:
            self.side = load_sidecars(cfg, self.collection_name)
        except StoreError:
            raise _no_index(corp.name) from None
        store = open_store(cfg)
        if self.collection_name not in store.names():
            raise _no_index(corp.name)
        man = self.side.manifest
        self.coll = store.collection(
            self.collection_name, model=str(man["model"]), dimension=int(man["dimension"]), create=False
        )
        self.embedder = embedder or _embedder(cfg)
        if self.embedder.name != man["model"]:
            raise StoreError(
                f"index of corpus {corp.name} was built with {man['model']}, not {self.embedder.name}; "
                "set embed_model to that model or rebuild the index"
            )
        self._load_metadata(store.max_batch)
        self._mask_cache: dict[tuple[str | None, tuple[str, ...] | None], np.ndarray | None] = {}

    # --- loading -----------------------------------------------------------------------------------

    def _load_metadata(self, batch: int) -> None:
        """Per-chunk metadata in bm25 order, and the lookup tables built from it."""
        ids = list(self.side.ids)
        metas: dict[str, dict[str, Any]] = {}
        for lo in range(0, len(ids), batch):
            # Metadata only (no documents): the public chromadb collection behind store.Collection.
            res = self.coll.chroma.get(ids=ids[lo : lo + batch], include=["metadatas"])
            for i, m in zip(res["ids"], res["metadatas"], strict=True):
                metas[i] = dict(m or {})
        self.ids = ids
        self.index = {cid: n for n, cid in enumerate(ids)}
        n = len(ids)
        self.paths = [""] * n
        self.symbols = [""] * n
        self.kinds = [""] * n
        self.archs: list[tuple[str, ...]] = [()] * n
        self.meta: list[dict[str, Any]] = [{}] * n
        self.file_chunks: dict[str, list[int]] = defaultdict(list)
        self.file_includes: dict[str, tuple[str, ...]] = {}
        mentions: dict[str, list[int]] = defaultdict(list)
        for j, cid in enumerate(ids):
            m = metas.get(cid, {})
            self.meta[j] = m
            path = str(m.get("path", ""))
            self.paths[j] = path
            self.symbols[j] = str(m.get("symbol", ""))
            self.kinds[j] = str(m.get("kind", ""))
            self.archs[j] = tuple(t for t in str(m.get("arch", "")).split(",") if t)
            self.file_chunks[path].append(j)
            self.file_includes.setdefault(path, tuple(t for t in str(m.get("includes", "")).split(",") if t))
            for name in _template_names(self.symbols[j]):
                mentions[name].append(j)
        self.mentions = dict(mentions)
        self.mentions_lower: dict[str, list[int]] = defaultdict(list)
        for k, v in mentions.items():
            self.mentions_lower[k.lower()].extend(v)
        self.symbols_lower: dict[str, list[str]] = defaultdict(list)
        for k, v in self.side.symbols.items():
            self.symbols_lower[k.lower()].extend(v)
        # Path words per file, and their document frequency (for an idf-weighted overlap).
        self.path_words: dict[str, set[str]] = {}
        df: dict[str, int] = defaultdict(int)
        for path in self.file_chunks:
            words = {_stem(t) for t in tokenize(path.replace("/", " ").replace(".", " "))}
            words |= {_ARCH_WORDS_REV[w] for w in words if w in _ARCH_WORDS_REV}
            words |= {_ARCH_WORDS[w] for w in words if w in _ARCH_WORDS}
            self.path_words[path] = words
            for w in words:
                df[w] += 1
        nf = max(1, len(self.file_chunks))
        self.path_idf = {w: math.log(1 + nf / c) for w, c in df.items()}
        self.all_paths = set(self.file_chunks)

    def _mask(self, arch: str | None, kinds: tuple[str, ...] | None) -> np.ndarray | None:
        """1.0 for chunks that pass the filters, 0.0 otherwise (None: no filter)."""
        key = (arch, kinds)
        if key not in self._mask_cache:
            if arch is None and kinds is None:
                self._mask_cache[key] = None
            else:
                self._mask_cache[key] = np.array(
                    [
                        float(_arch_ok(self.archs[j], arch) and (kinds is None or self.kinds[j] in kinds))
                        for j in range(len(self.ids))
                    ]
                )
        return self._mask_cache[key]

    # --- retrievers --------------------------------------------------------------------------------

    def _query_words(self, query: str) -> tuple[list[str], list[str]]:
        """(identifier-like words, bm25 tokens with codename expansion)."""
        idents: list[str] = []
        words = query.split()
        for m in _QUERY_IDENT_RE.finditer(query):
            word = (m.group(1) or m.group(0)).strip().removeprefix("::")
            if not word:
                continue
            if m.group(1) or _identifier_like(word) or (len(words) == 1 and self._symbol_ids(word)):
                idents.append(word)
        toks = [t for t in tokenize(query) if t not in _STOP]
        extra = [_ARCH_WORDS.get(t) or _ARCH_WORDS_REV.get(t) for t in toks]
        toks += [e for e in extra if e]
        # Hyphenated compounds are written joined in identifiers and paths: `stream-K` is `StreamK`.
        toks += [(a + b).lower() for a, b in re.findall(r"([A-Za-z0-9]+)-(?=([A-Za-z0-9]+))", query)]
        return idents, list(dict.fromkeys(toks))

    def _symbol_ids(self, word: str) -> list[str]:
        return list(self.side.symbols.get(word, ()))

    def _exact(self, idents: list[str]) -> list[tuple[int, int]]:
        """(chunk index, match level) for the query's identifiers, best level first."""
        found: dict[int, int] = {}

        def add(js: Iterable[int], level: int) -> None:
            for j in js:
                if level < found.get(j, 99):
                    found[j] = level

        for word in idents:
            last = word.rsplit("::", 1)[-1]
            for key in (word, last):
                ids = self.side.symbols.get(key) or self.symbols_lower.get(key.lower(), [])
                js = [self.index[i] for i in ids if i in self.index]
                # Level 0 only where the chunk's own symbol is this name (not a specialisation of it).
                add((j for j in js if self.symbols[j] in (word, last)), 0)
                add(js, 1)
            add(self.mentions.get(last) or self.mentions_lower.get(last.lower(), []), 2)
        return sorted(found.items(), key=lambda kv: kv[1])

    def _bm25(self, toks: list[str], mask: np.ndarray | None) -> tuple[list[int], np.ndarray | None]:
        bm = self.side.bm25
        if bm is None:
            return [], None
        known = [t for t in toks if t in bm.vocab_dict]
        if not known:
            return [], None
        scores = np.asarray(bm.get_scores(known), dtype=np.float64)
        if mask is not None:
            scores = scores * mask
        n = min(N_BM25, len(scores))
        top = np.argpartition(-scores, n - 1)[:n]
        top = top[np.argsort(-scores[top])]
        return [int(j) for j in top if scores[j] > 0], scores

    def _dense(self, query: str, filtered: bool) -> list[int]:
        vec = self.embedder.embed([query])[0]
        n = min(N_DENSE_FILTERED if filtered else N_DENSE, max(1, len(self.ids)))
        hits = self.coll.query(vec, n)
        return [self.index[h.id] for h in hits if h.id in self.index]

    def _path(self, toks: list[str], bm25_scores: np.ndarray | None) -> list[int]:
        """Files ranked by idf-weighted overlap of path words with query words; each file's best chunk."""
        q = {_stem(t) for t in toks}
        if not q:
            return []
        scored: list[tuple[float, str]] = []
        for path, words in self.path_words.items():
            common = q & words
            if common:
                s = sum(self.path_idf[w] for w in common)
                scored.append((s - 0.01 * len(words), path))  # fewer extra words: a closer name
        scored.sort(reverse=True)
        out: list[int] = []
        for _, path in scored[:N_PATH_FILES]:
            js = self.file_chunks[path]
            best = max(js, key=lambda j: bm25_scores[j]) if bm25_scores is not None else js[0]
            out.append(best)
        return out

    # --- the hunt ----------------------------------------------------------------------------------

    def hunt(
        self,
        query: str,
        k: int = 5,
        arch: str | None = None,
        kinds: Iterable[str] | None = None,
        snippet_lines: int = SNIPPET_LINES,
    ) -> list[Block]:
        """The k best building blocks for a query (natural language or identifiers), best first."""
        if not query or not query.strip():
            raise ValueError("empty query: give words or an identifier to search for")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        arch_n = _norm_arch(arch)
        kinds_t = tuple(sorted(set(kinds))) if kinds is not None else None
        mask = self._mask(arch_n, kinds_t)
        if not self.ids:
            return []

        idents, toks = self._query_words(query)
        exact = self._exact(idents)
        bm25, scores = self._bm25(toks, mask)
        dense = self._dense(query, mask is not None)
        path = self._path(toks, scores)

        fused: dict[int, float] = defaultdict(float)
        sources: dict[int, list[str]] = defaultdict(list)
        # Identifier queries: exact hits are the answer; in a sentence they are one vote among others.
        n_words = len([w for w in re.findall(r"\S+", query) if w.lower() not in _STOP])
        ident_query = bool(idents) and len(idents) * 2 >= n_words
        exact_sorted = sorted(exact, key=lambda e: (e[1], -(scores[e[0]] if scores is not None else 0.0)))
        for rank, (j, level) in enumerate(exact_sorted):
            fused[j] += W_EXACT / (RRF_K + rank + 1) + (EXACT_BONUS[level] if ident_query else 0.0)
            sources[j].append("exact")
        for name, weight, ranked in (
            ("bm25", W_BM25, bm25),
            ("dense", W_DENSE, dense),
            ("path", W_PATH, path),
        ):
            for rank, j in enumerate(ranked):
                fused[j] += weight / (RRF_K + rank + 1)
                sources[j].append(name)

        picked: list[tuple[int, float]] = []
        seen: set[tuple[str, str]] = set()
        for j, s in sorted(fused.items(), key=lambda kv: -kv[1]):
            if mask is not None and not mask[j]:
                continue
            key = (self.paths[j], self.symbols[j])
            if key in seen:  # windows of one long definition
                continue
            seen.add(key)
            picked.append((j, s))
            if len(picked) == k:
                break
        return self._blocks(picked, sources, snippet_lines)

    def _blocks(
        self, picked: Sequence[tuple[int, float]], sources: dict[int, list[str]], snippet_lines: int
    ) -> list[Block]:
        docs = {r.id: r.document or "" for r in self.coll.get([self.ids[j] for j, _ in picked])}
        out = []
        for j, s in picked:
            m = self.meta[j]
            cid = self.ids[j]
            out.append(
                Block(
                    corpus=self.corpus,
                    path=self.paths[j],
                    symbol=self.symbols[j],
                    kind=self.kinds[j],
                    arch=self.archs[j],
                    snippet=_trim(docs.get(cid, ""), snippet_lines),
                    include_line=include_line(self.paths[j], self.kinds[j]),
                    score=round(float(s), 6),
                    sources=tuple(dict.fromkeys(sources.get(j, ()))),
                    id=cid,
                    start_line=int(m.get("start_line", 0) or 0),
                    end_line=int(m.get("end_line", 0) or 0),
                    namespace=str(m.get("namespace", "")),
                    includes=self.file_includes.get(self.paths[j], ()),
                )
            )
        return out

    # --- dependencies ------------------------------------------------------------------------------

    def _resolve_include(self, inc: str, from_path: str) -> str | None:
        """The corpus path of an #include target: under an include root, or next to the includer."""
        for root in _INCLUDE_ROOTS:
            if root + inc in self.all_paths:
                return root + inc
        local = (PurePosixPath(from_path).parent / inc).as_posix()
        if local in self.all_paths:
            return local
        return inc if inc in self.all_paths else None

    def _reachable(self, path: str, depth: int) -> dict[str, int]:
        """Files included by `path`, transitively up to `depth` levels, with their distance."""
        dist: dict[str, int] = {}
        frontier = [path]
        for d in range(1, depth + 1):
            nxt = []
            for p in frontier:
                for inc in self.file_includes.get(p, ()):
                    q = self._resolve_include(inc, p)
                    if q is not None and q not in dist and q != path:
                        dist[q] = d
                        nxt.append(q)
            frontier = nxt
        return dist

    def follow_includes(
        self,
        block: Block,
        budget_tokens: int = 2000,
        depth: int = INCLUDE_DEPTH,
        snippet_lines: int = SNIPPET_LINES,
    ) -> list[Block]:
        """Definitions of names the block's snippet uses, found in the files it includes (transitively,
        nearest first), as blocks whose snippets fit within budget_tokens (about 4 characters a token)."""
        if budget_tokens <= 0:
            return []
        reach = self._reachable(block.path, depth)
        reach.setdefault(block.path, 0)  # helpers defined in the same file count too
        body = "\n".join(ln for ln in block.snippet.splitlines() if not ln.lstrip().startswith(("#", "//")))
        names = [n for n in dict.fromkeys(_NAME_RE.findall(body)) if n not in _NOT_DEPS and len(n) > 2]
        own = {block.symbol, block.symbol.split("<", 1)[0].rsplit("::", 1)[-1]}
        wanted: list[int] = []
        for name in names:
            if name in own:
                continue
            js = [self.index[i] for i in self.side.symbols.get(name, ()) if i in self.index]
            js = [j for j in js if self.paths[j] in reach and self.ids[j] != block.id]
            if not js:
                continue
            # Nearest file first; the primary template (no `<...>` in its symbol) before specialisations.
            js.sort(
                key=lambda j: (
                    reach[self.paths[j]],
                    "<" in self.symbols[j],
                    self.meta[j].get("start_line", 0),
                )
            )
            if js[0] not in wanted:
                wanted.append(js[0])
        if not wanted:
            return []
        docs = {r.id: r.document or "" for r in self.coll.get([self.ids[j] for j in wanted])}
        out: list[Block] = []
        used = 0
        for j in wanted:
            text = _trim(docs.get(self.ids[j], ""), snippet_lines)
            cost = -(-len(text) // CHARS_PER_TOKEN)
            if used + cost > budget_tokens:
                continue  # a smaller one further down may still fit
            used += cost
            blk = self._blocks([(j, 0.0)], {j: ["include"]}, snippet_lines)[0]
            out.append(blk)
        return out


def _trim(text: str, max_lines: int) -> str:
    lines = text.splitlines()
    if len(lines) <= max_lines:
        return text
    return "\n".join([*lines[:max_lines], f"// ... ({len(lines) - max_lines} more lines)"])


# --- module-level convenience --------------------------------------------------------------------

_EMBEDDERS: dict[str | None, Embedder] = {}
_HUNTERS: dict[tuple[str, ...], Hunter] = {}


def _embedder(cfg: Config) -> Embedder:
    """One loaded model per process and model name: loading costs seconds."""
    key = cfg.embed_model
    if key not in _EMBEDDERS:
        _EMBEDDERS[key] = Embedder(cfg)
    return _EMBEDDERS[key]


def get_hunter(cfg: Config, corpus: str = "cutlass") -> Hunter:
    """A cached Hunter per (home, store, corpus)."""
    key = (str(Path(cfg.home).resolve()), str(cfg.chroma_host or Path(cfg.chroma_path).resolve()), corpus)
    if key not in _HUNTERS:
        _HUNTERS[key] = Hunter(cfg, corpus)
    return _HUNTERS[key]


class Hunters:
    """Several corpora's hunters as one, with a Hunter's `hunt`: each corpus is asked for the k best and the
    answers are merged by score, best first (ties: the better rank within its corpus, then the corpora's
    order). The scores are on one scale: every corpus fuses its retrievers' ranks with the same weights
    (reciprocal rank, k=60), and an identifier query's exact hit gets the same bonus in any corpus. Each
    Block names its corpus (Block.corpus)."""

    def __init__(self, hunters: Sequence[Hunter]) -> None:
        if not hunters:
            raise ValueError("Hunters needs one hunter at least")
        names = [h.corpus for h in hunters]
        if len(set(names)) != len(names):
            raise ValueError(f"a corpus twice among {names}")
        self.hunters = tuple(hunters)
        self.cfg = hunters[0].cfg
        self.corpus = "+".join(names)

    def member(self, corpus: str) -> Hunter:
        """The hunter of one corpus (KeyError when it is not one of these)."""
        for h in self.hunters:
            if h.corpus == corpus:
                return h
        raise KeyError(corpus)

    def hunt(
        self,
        query: str,
        k: int = 5,
        arch: str | None = None,
        kinds: Iterable[str] | None = None,
        snippet_lines: int = SNIPPET_LINES,
    ) -> list[Block]:
        """The k best building blocks over all the corpora, best first."""
        kinds = tuple(kinds) if kinds is not None else None
        ranked = []
        for order, h in enumerate(self.hunters):
            for rank, b in enumerate(h.hunt(query, k=k, arch=arch, kinds=kinds, snippet_lines=snippet_lines)):
                ranked.append((-b.score, rank, order, b))
        ranked.sort(key=lambda t: t[:3])
        return [b for *_, b in ranked[:k]]

    def follow_includes(self, block: Block, *args: Any, **kwargs: Any) -> list[Block]:
        """Definitions the block uses, from its own corpus."""
        return self.member(block.corpus).follow_includes(block, *args, **kwargs)


def open_corpora(cfg: Config, names: Sequence[str]) -> tuple[Hunter | Hunters | None, dict[str, str]]:
    """The hunter over those of the named corpora whose index opens (a Hunters for several; None for none),
    and, for each other one, the first line of why not."""
    opened: list[Hunter] = []
    missing: dict[str, str] = {}
    for name in names:
        try:
            opened.append(get_hunter(cfg, name))
        except Exception as e:  # no index, another embedding model, a store that does not open
            missing[name] = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if not opened:
        return None, missing
    return (opened[0] if len(opened) == 1 else Hunters(opened)), missing


def hunt(
    query: str,
    cfg: Config,
    corpus: str = "cutlass",
    k: int = 5,
    arch: str | None = None,
    kinds: Iterable[str] | None = None,
) -> list[Block]:
    if not query or not query.strip():
        raise ValueError("empty query: give words or an identifier to search for")
    return get_hunter(cfg, corpus).hunt(query, k=k, arch=arch, kinds=kinds)


# --- evaluation ----------------------------------------------------------------------------------


def load_cases(path: str | Path) -> list[EvalCase]:
    """Cases from a TOML file of `[[case]]` tables: query, expect (a path or a list), arch, style."""
    data = tomllib.loads(Path(path).read_text())
    out = []
    for c in data.get("case", []):
        exp = c["expect"]
        out.append(
            EvalCase(
                query=c["query"],
                expected=(exp,) if isinstance(exp, str) else tuple(exp),
                arch=c.get("arch"),
                style=c.get("style", ""),
            )
        )
    return out


def _is_hit(path: str, expected: Sequence[str]) -> bool:
    return any(path.startswith(e) if e.endswith("/") else path == e for e in expected)


def _block_hit(b: Block, expected: Sequence[str]) -> bool:
    """An expected path as the corpus names it, or with its corpus in front (`cccl:cub/...`): over several
    corpora the second says which one must answer."""
    return _is_hit(b.path, expected) or _is_hit(f"{b.corpus}:{b.path}", expected)


def evaluate(hunter: Hunter | Hunters, cases: Iterable[EvalCase | tuple[Any, ...]], k: int = 5) -> EvalReport:
    """recall@k (any expected file among the top k) and MRR over the top 10; one warm-up query first."""
    norm: list[EvalCase] = []
    for c in cases:
        if isinstance(c, EvalCase):
            norm.append(c)
        else:
            q, exp, *rest = c
            norm.append(
                EvalCase(q, (exp,) if isinstance(exp, str) else tuple(exp), rest[0] if rest else None)
            )
    if not norm:
        raise ValueError("no evaluation cases")
    hunter.hunt(norm[0].query, k=1)  # warm-up: first-call costs are not query costs
    results = []
    for c in norm:
        t0 = time.perf_counter()
        blocks = hunter.hunt(c.query, k=max(k, 10), arch=c.arch)
        ms = (time.perf_counter() - t0) * 1000
        paths = tuple(b.path for b in blocks)
        rank = next((i + 1 for i, b in enumerate(blocks) if _block_hit(b, c.expected)), None)
        results.append(CaseResult(c, rank, paths, ms))
    recall = sum(1 for r in results if r.rank is not None and r.rank <= k) / len(results)
    mrr = sum(1 / r.rank for r in results if r.rank is not None) / len(results)
    p50 = statistics.median(r.ms for r in results)
    return EvalReport(round(recall, 4), round(mrr, 4), results, round(p50, 1))
