"""Incremental, atomic index builds: corpus files -> chunks -> llama-index ingestion -> Chroma, plus sidecars.

One collection per corpus version (`kp-<name>-<version>`). A file is re-ingested only when its content
hash differs from the one in its chunks' metadata. For a changed file the new chunks are upserted first
and the stale ids deleted after, so a crash leaves old + new chunks, never nothing; a small journal of the
batch in flight makes the next build redo that batch even where the hashes would look complete.

Embeddings are computed from a SHORT text per chunk (location, symbol words, path words, signature):
embedding cost grows with tokens, and whole ~40-line chunks would take 15-20 minutes for CUTLASS on two
cores. The full chunk text is still what Chroma stores as the document (and what BM25 indexes).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corpora import Corpus, load_corpus, resolve_root
from corpora import iter_files as corpus_files
from index.chunk import Chunk, chunk_file
from index.sidecar import MANIFEST_FILE, sidecar_dir, symbol_keys, write_sidecars
from index.store import (
    DEFAULT_MODEL_NAME,
    META_PATH,
    Collection,
    Embedder,
    Store,
    StoreError,
    open_store,
)

if TYPE_CHECKING:
    from pipeline.config import Config

Progress = Callable[[str, int, int], None]

BATCH_CHUNKS = 512  # chunks per ingestion batch: bounds memory and what an interruption loses
EMBED_BATCH = 64
EMBED_CHARS = 180  # ~48 MiniLM tokens of code-ish text
_PAGE = 2000  # records per get() when reading the collection back for the sidecars
COLLECTION_PREFIX = "kp-"


@dataclass(frozen=True)
class BuildReport:
    corpus: str
    version: str
    collection: str
    files_total: int
    files_changed: int  # new or modified, re-ingested
    files_unchanged: int
    files_removed: int
    chunks_added: int  # chunks written (new or replaced)
    chunks_embedded: int  # short texts embedded for them: chunks with the same one share its vector
    chunks_deleted: int  # stale or removed-file chunks deleted
    chunks_total: int
    seconds: float
    index_bytes: int  # the Chroma folder (0 for a server) plus this collection's sidecars


# --- names -------------------------------------------------------------------------------------------


def collection_name(corpus: Corpus) -> str:
    """`kp-<name>-<version>` within Chroma's rules: 3-512 chars of [a-zA-Z0-9._-], alnum at both ends."""
    raw = f"{COLLECTION_PREFIX}{corpus.name}-{corpus.version}"
    name = re.sub(r"[^a-zA-Z0-9._-]+", "-", raw)
    name = re.sub(r"\.{2,}", ".", name).strip("._-")[:512].rstrip("._-")
    return name if len(name) >= 3 else (name + "-ix")[:3]


def _corpus(corpus: str | Corpus, folder: str | Path | None) -> Corpus:
    if isinstance(corpus, Corpus):
        return corpus
    return load_corpus(corpus, folder=folder)


# --- short embedding text ----------------------------------------------------------------------------

_CAMEL_RE = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
_SKIP_LINE = ("#include", "//", "/*", "*", "#pragma", "import ", "from ", '"""', "@")


def _words(text: str) -> str:
    """`SM90_TmaLoad<T>` -> `SM 90 Tma Load T`: what a sentence model reads as words."""
    return " ".join(_CAMEL_RE.findall(text))


def embed_text(text: str, meta: dict[str, Any]) -> str:
    """The short text a chunk is embedded from (~50 tokens): path words, symbol words, first signature line.

    Words rather than raw paths and identifiers: the tokenizer spends a token on every `/`, `_` and digit
    run, and a sentence model matches words. The full chunk text stays the stored document.
    """
    lines = text.splitlines()
    body = lines[1:] if lines and lines[0].startswith(("// ", "# ")) else lines
    sig = ""
    for ln in body:
        s = ln.strip()
        if s and not s.startswith(_SKIP_LINE):
            sig = s.split("{", 1)[0].strip()
            break
    path = str(meta.get("path", "")).rsplit(".", 1)[0]
    # Drop repeated words (`gemm/basic_gemm` -> gemm basic) and the namespace's `cute`/`cutlass` noise.
    path_words = list(dict.fromkeys(_CAMEL_RE.findall(path)))
    ns = str(meta.get("namespace", "")).strip(":").rsplit("::", 1)[-1]
    parts = [" ".join(path_words), f"{ns} {_words(str(meta.get('symbol', '')))}".strip(), sig]
    out = " | ".join(p for p in parts if p)[:EMBED_CHARS]
    return out if out.strip() else (text[:EMBED_CHARS].strip() or "empty")


# --- llama-index pieces ------------------------------------------------------------------------------


def _ingestion_pipeline(collection: Collection, embedder: Embedder, max_batch: int) -> tuple[Any, Any]:
    """IngestionPipeline: Document(chunk) -> TextNode with our id and metadata -> embedding of the short
    text -> Chroma (upsert, not add: a replaced chunk keeps its id when its symbol and line stay). Returns it
    and its embedding step, which counts the texts it embedded."""
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.schema import BaseNode, MetadataMode, TextNode, TransformComponent
    from llama_index.core.vector_stores.utils import node_to_metadata_dict
    from llama_index.vector_stores.chroma import ChromaVectorStore
    from pydantic import PrivateAttr

    class ChunksToNodes(TransformComponent):
        def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[BaseNode]:
            keys = list(nodes[0].metadata) if nodes else []
            return [
                TextNode(
                    id_=n.id_,
                    text=n.get_content(metadata_mode=MetadataMode.NONE),
                    metadata=dict(n.metadata),
                    excluded_embed_metadata_keys=keys,
                    excluded_llm_metadata_keys=keys,
                )
                for n in nodes
            ]

    class ShortTextEmbedding(TransformComponent):
        _embed: Any = PrivateAttr()
        embedded: int = 0

        def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
            # Each distinct short text once: overloads and #if branches of one symbol in one file often
            # share theirs (a tenth of CUTLASS's chunks), and the model is most of an index build's time.
            texts = [embed_text(n.get_content(metadata_mode=MetadataMode.NONE), n.metadata) for n in nodes]
            # By length, so each of the model's batches pads its texts to about the same length (a fifth
            # less model time than in file order).
            unique = sorted(dict.fromkeys(texts), key=len)
            vecs = dict(zip(unique, self._embed.get_text_embedding_batch(unique), strict=True))
            for n, t in zip(nodes, texts, strict=True):
                n.embedding = vecs[t]
            self.embedded += len(unique)
            return nodes

    class UpsertChromaVectorStore(ChromaVectorStore):
        def add(self, nodes: list[BaseNode], **add_kwargs: Any) -> list[str]:
            ids: list[str] = []
            for lo in range(0, len(nodes), max_batch):
                part = nodes[lo : lo + max_batch]
                metas = []
                for n in part:
                    m = node_to_metadata_dict(n, remove_text=True, flat_metadata=self.flat_metadata)
                    metas.append({k: ("" if v is None else v) for k, v in m.items()})
                self._collection.upsert(
                    ids=[n.node_id for n in part],
                    embeddings=[n.get_embedding() for n in part],
                    metadatas=metas,
                    documents=[n.get_content(metadata_mode=MetadataMode.NONE) for n in part],
                )
                ids.extend(n.node_id for n in part)
            return ids

    embed = ShortTextEmbedding()
    embed._embed = embedder.llama_index(batch_size=EMBED_BATCH)
    pipeline = IngestionPipeline(
        transformations=[ChunksToNodes(), embed],
        vector_store=UpsertChromaVectorStore(chroma_collection=collection.chroma),
        disable_cache=True,  # content hashes per file already decide what is re-embedded
    )
    return pipeline, embed


def _documents(chunks: Iterable[Chunk]) -> list[Any]:
    from llama_index.core import Document

    return [Document(id_=c.id, text=c.text, metadata=c.metadata()) for c in chunks]


# --- the build ---------------------------------------------------------------------------------------


def _journal(cfg: Config, name: str) -> Path:
    return Path(cfg.home) / "index" / f"{name}.pending.json"


def _read_manifest(cfg: Config, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((sidecar_dir(cfg, name) / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


def _read_text(path: Path) -> str:
    # The same decoding chunk_file's hash is computed over, so hashes compare across builds.
    return path.read_bytes().decode("utf-8", "replace")


def _file_hash(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()


_EMBEDDERS: dict[str | None, Embedder] = {}  # one loaded model per process and model: loading costs seconds


class _Lazy:
    """The embedding model, loaded only when something must be embedded."""

    def __init__(self, cfg: Config) -> None:
        self._cfg = cfg
        self.value: Embedder | None = None

    def get(self) -> Embedder:
        if self.value is None:
            key = self._cfg.embed_model
            if key not in _EMBEDDERS:
                _EMBEDDERS[key] = Embedder(self._cfg)
            self.value = _EMBEDDERS[key]
        return self.value


def _open_collection(store: Store, cfg: Config, name: str, lazy: _Lazy) -> Collection:
    """Open via the manifest's model/dimension when it names the configured model (no model load);
    otherwise load the model to learn its name and dimension."""
    manifest = _read_manifest(cfg, name)
    wanted = cfg.embed_model or DEFAULT_MODEL_NAME
    if manifest and manifest.get("model") == wanted and manifest.get("dimension"):
        try:
            return store.collection(name, model=wanted, dimension=int(manifest["dimension"]))
        except StoreError:
            pass  # the manifest is stale; ask the model itself
    emb = lazy.get()
    return store.collection(name, model=emb.name, dimension=emb.dimension)


def build_index(
    corpus: str | Corpus,
    cfg: Config,
    progress: Progress | None = None,
    folder: str | Path | None = None,
) -> BuildReport:
    """Bring the corpus's collection and sidecars up to date with its files; see the module docstring."""
    t0 = time.monotonic()
    note = progress or (lambda stage, done, total: None)
    corp = _corpus(corpus, folder)
    root = resolve_root(corp, cfg.cache_dir)
    name = collection_name(corp)
    store = open_store(cfg)  # fails (StoreError) before anything is written
    lazy = _Lazy(cfg)
    coll = _open_collection(store, cfg, name, lazy)

    indexed = coll.file_hashes()
    journal = _journal(cfg, name)
    try:
        pending = set(json.loads(journal.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        pending = set()

    # Which files changed: hash every file (fast: reading 35 MB), compare with the stored hashes.
    paths = list(corpus_files(corp, root))
    changed: list[tuple[str, Path]] = []
    present: set[str] = set()
    for i, p in enumerate(paths):
        rel = p.relative_to(root).as_posix()
        present.add(rel)
        text = _read_text(p)
        if not text.strip():
            continue  # chunk_file makes no chunks of it; never counts as changed
        if rel in pending or indexed.get(rel) != _file_hash(text):
            changed.append((rel, p))
        if i % 100 == 0:
            note("scan files", i, len(paths))
    note("scan files", len(paths), len(paths))
    removed = sorted(set(indexed) - present)

    added = deleted = embedded = 0
    if changed:
        pipeline, embedding = _ingestion_pipeline(coll, lazy.get(), store.max_batch)
        batch: list[tuple[str, list[Chunk]]] = []
        size = 0
        note("ingest files", 0, len(changed))

        def flush() -> None:
            nonlocal added, deleted, size
            _write_json_atomic(journal, [rel for rel, _ in batch])  # redo this batch if we die
            chunks = [c for _, cs in batch for c in cs]
            if chunks:
                pipeline.run(documents=_documents(chunks))
                added += len(chunks)
            for rel, cs in batch:  # only now, after the upsert: drop this file's stale chunks
                if rel in indexed:
                    stale = set(coll.ids_where({META_PATH: rel})) - {c.id for c in cs}
                    coll.delete(sorted(stale))
                    deleted += len(stale)
            batch.clear()
            size = 0

        for done, (rel, p) in enumerate(changed, 1):
            chunks = chunk_file(rel, _read_text(p), corp.name, corp.version, corp.kind_of(rel))
            batch.append((rel, list({c.id: c for c in chunks}.values())))  # ids unique per upsert
            size += len(chunks)
            if size >= BATCH_CHUNKS:
                flush()
            if size == 0:  # just flushed: report after the write, so an abort loses at most a batch
                note("ingest files", done, len(changed))
        if batch:
            flush()
        note("ingest files", len(changed), len(changed))
        journal.unlink(missing_ok=True)
        embedded = embedding.embedded
    elif journal.exists():
        journal.unlink()

    for i, rel in enumerate(removed):
        ids = coll.ids_where({META_PATH: rel})
        coll.delete(ids)
        deleted += len(ids)
        note("remove files", i + 1, len(removed))

    total = coll.count()
    manifest = _read_manifest(cfg, name)
    emb_name = lazy.value.name if lazy.value else (cfg.embed_model or DEFAULT_MODEL_NAME)
    # A folder corpus's index says where its files are (the runs' source tools read them there).
    moved = corp.source == "folder" and bool(manifest) and manifest.get("root") != _root_text(root)
    if changed or removed or moved or not manifest or manifest.get("chunks") != total:
        _write_all_sidecars(cfg, corp, coll, emb_name, len(present), t0, note, root)
    seconds = time.monotonic() - t0
    return BuildReport(
        corpus=corp.name,
        version=corp.version,
        collection=name,
        files_total=len(paths),
        files_changed=len(changed),
        files_unchanged=len(paths) - len(changed),
        files_removed=len(removed),
        chunks_added=added,
        chunks_embedded=embedded,
        chunks_deleted=deleted,
        chunks_total=total,
        seconds=seconds,
        index_bytes=_index_bytes(cfg, name),
    )


def _root_text(root: Path) -> str:
    return str(Path(root).resolve())


def _write_all_sidecars(
    cfg: Config,
    corp: Corpus,
    coll: Collection,
    model: str,
    files: int,
    t0: float,
    note: Progress,
    root: Path | None = None,
) -> None:
    """BM25 + ids + symbols + manifest, rebuilt from what the collection holds now (the source of truth)."""
    ids = coll.ids_where(None)
    records = []
    for lo in range(0, len(ids), _PAGE):
        records.extend(coll.get(ids[lo : lo + _PAGE]))
        note("read index", min(lo + _PAGE, len(ids)), len(ids))
    # A process killed mid-upsert can leave ids whose vector landed but whose document and metadata did not
    # (seen with kill -9): remove them here, so the sidecars and the collection agree again.
    orphans = [r.id for r in records if r.document is None and not r.metadata]
    if orphans:
        coll.delete(orphans)
        records = [r for r in records if r.document is not None or r.metadata]
    records.sort(key=lambda r: (str(r.metadata.get("path", "")), int(r.metadata.get("start_line", 0)), r.id))
    symbols: dict[str, list[str]] = {}
    for r in records:
        sym = str(r.metadata.get("symbol", ""))
        if sym:
            for key in symbol_keys(sym, str(r.metadata.get("namespace", ""))):
                symbols.setdefault(key, []).append(r.id)
    note("write bm25", 0, 1)
    manifest = {
        "corpus": corp.name,
        "version": corp.version,
        "collection": coll.name,
        "model": model,
        "dimension": coll.dimension,
        "chunks": len(records),
        "files": len({r.metadata.get("path") for r in records}),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - t0, 2),
    }
    if corp.source == "folder" and root is not None:
        manifest["root"] = _root_text(root)
    write_sidecars(
        sidecar_dir(cfg, coll.name),
        [r.id for r in records],
        [r.document or "" for r in records],
        symbols,
        manifest,
    )
    note("write bm25", 1, 1)


# --- status and drop ---------------------------------------------------------------------------------


def _tree_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _index_bytes(cfg: Config, name: str) -> int:
    chroma = 0 if cfg.chroma_host else _tree_bytes(Path(cfg.chroma_path))
    return chroma + _tree_bytes(sidecar_dir(cfg, name))


def index_status(cfg: Config) -> list[dict[str, Any]]:
    """One dict per kernelpro collection: corpus, version, collection, chunks, files, model, built_at,
    bytes (its sidecars), chroma_bytes (the whole Chroma folder, shared by all collections)."""
    store = open_store(cfg)
    chroma_bytes = 0 if cfg.chroma_host else _tree_bytes(Path(cfg.chroma_path))
    rows = []
    for name in store.names():
        if not name.startswith(COLLECTION_PREFIX):
            continue  # lessons and other collections
        m = _read_manifest(cfg, name) or {}
        chunks: int | None = None
        if m.get("model") and m.get("dimension"):
            try:
                chunks = store.collection(
                    name, model=m["model"], dimension=int(m["dimension"]), create=False
                ).count()
            except StoreError:
                chunks = None
        rows.append(
            {
                "collection": name,
                "corpus": m.get("corpus", name),
                "version": m.get("version", "?"),
                "chunks": chunks if chunks is not None else m.get("chunks"),
                "files": m.get("files"),
                "model": m.get("model", "?"),
                "built_at": m.get("built_at"),
                "bytes": _tree_bytes(sidecar_dir(cfg, name)),
                "chroma_bytes": chroma_bytes,
            }
        )
    return rows


def drop_index(corpus: str | Corpus, cfg: Config) -> str:
    """Drop the corpus's collection and its sidecars; returns the collection name."""
    import shutil

    corp = _corpus(corpus, None)
    name = collection_name(corp)
    store = open_store(cfg)
    side = sidecar_dir(cfg, name)
    if name not in store.names():
        if side.exists():
            shutil.rmtree(side)
            return name
        raise StoreError(f"no index for corpus {corp.name!r} ({name}) in {store.where}; nothing to drop")
    m = _read_manifest(cfg, name) or {}
    if m.get("model") and m.get("dimension"):
        coll = store.collection(name, model=m["model"], dimension=int(m["dimension"]), create=False)
    else:
        emb = Embedder(cfg)
        coll = store.collection(name, model=emb.name, dimension=emb.dimension, create=False)
    coll.drop()
    shutil.rmtree(side, ignore_errors=True)
    _journal(cfg, name).unlink(missing_ok=True)
    return name
