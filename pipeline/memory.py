"""Search memory across runs: lessons (task features, finding, edit, outcome) as embeddings in Chroma.

A lesson says "on a task like this, with this diagnosis, this edit gave that": what worked for one softmax
helps the next layernorm. Lessons live in their own collection (``kernelpro-memory`` by default) of the
store behind ``index/store.py``, embedded with the same model as the source index.

Failure contract: every problem with the store or the model (corrupt or locked folder, unreachable server,
missing model, a collection of another model) is an ``index.store.StoreError`` with one line. The loop
catches it and goes on without memory::

    try:
        lessons = memory.for_context(task, bound, findings)
    except StoreError as e:
        log(f"memory off: {e}"); lessons = ()

Nothing is opened until first use, and reading a memory that was never written creates nothing on disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from index.store import Collection, Embedder, Record, StoreError, open_store
from pipeline.generate.base import Lesson
from pipeline.types import Finding, Status, Task

if TYPE_CHECKING:
    from pipeline.config import Config

COLLECTION = "kernelpro-memory"
# Speedups within 3% of the parent (bounds included) are inside run-to-run timing noise: neither a lesson to copy nor to avoid.
NO_CHANGE_LO, NO_CHANGE_HI = 0.97, 1.03
# Above this many FLOPs per minimal byte a task is compute-heavy on any recent GPU. Only matmuls and
# convolutions count FLOPs (torch's counter), so anything else lands at 0 and is memory-heavy, as it should.
COMPUTE_HEAVY_FLOP_PER_BYTE = 20.0
_QUERY_FINDINGS = 3  # findings of the parent that go into a context query, worst first
_TEXT_MAX = 240  # a finding's diagnosis is kept to one short line


@dataclass(frozen=True)
class StoredLesson:
    """One lesson as stored. ``id`` is a hash of the content (not of ``created``), so storing the same
    lesson twice, e.g. after a run resumes from its log, keeps one copy."""

    task_id: str
    task_features: str  # task_features(): "softmax (row reduction over the last dim); float32; ..."
    finding: str  # "tool: one-line diagnosis" of the parent's top finding, or "no finding"
    edit: str  # the edit's label
    outcome: str  # "1.80x faster than its parent", "no change (1.01x)", "failed: mismatch"
    status: str  # a pipeline.types.Status value
    gain: float | None = None  # speedup vs the parent (<1 worse); None when the child failed or was not timed
    run_id: str = ""
    parent: str = ""  # the parent's candidate key
    created: float = field(default_factory=time.time)  # unix time
    id: str = ""  # filled from the content when empty

    def __post_init__(self) -> None:
        # Status is a StrEnum; keep a plain str so equality, JSON and Chroma metadata all agree.
        object.__setattr__(self, "status", str(self.status))
        if self.gain is not None:
            object.__setattr__(self, "gain", float(self.gain))
        if not self.id:
            object.__setattr__(self, "id", self._content_id())

    def _content_id(self) -> str:
        gain = None if self.gain is None else round(self.gain, 4)
        parts = [self.task_id, self.run_id, self.parent, self.task_features, self.finding, self.edit]
        blob = json.dumps([*parts, self.outcome, self.status, gain], ensure_ascii=False)
        return "lesson-" + hashlib.sha256(blob.encode()).hexdigest()[:24]

    @property
    def helpful(self) -> bool:
        """The edit made a correct kernel measurably faster than its parent."""
        return self.status == Status.OK.value and self.gain is not None and self.gain > NO_CHANGE_HI

    def document(self) -> str:
        """The text that is embedded: the situation first (what queries describe), then what was done."""
        return (
            f"task: {self.task_features}\nfinding: {self.finding}\nedit: {self.edit}\noutcome: {self.outcome}"
        )

    def metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "task_id": self.task_id,
            "task_features": self.task_features,
            "finding": self.finding,
            "edit": self.edit,
            "outcome": self.outcome,
            "status": self.status,
            "run_id": self.run_id,
            "parent": self.parent,
            "created": float(self.created),
            "helpful": self.helpful,  # a where-filter for only_helpful searches
        }
        if self.gain is not None:  # Chroma metadata has no null
            meta["gain"] = self.gain
        return meta

    @classmethod
    def from_record(cls, rec: Record) -> StoredLesson:
        m = rec.metadata
        gain = m.get("gain")
        return cls(
            task_id=str(m.get("task_id", "")),
            task_features=str(m.get("task_features", "")),
            finding=str(m.get("finding", "")),
            edit=str(m.get("edit", "")),
            outcome=str(m.get("outcome", "")),
            status=str(m.get("status", "")),
            gain=None if gain is None else float(gain),
            run_id=str(m.get("run_id", "")),
            parent=str(m.get("parent", "")),
            created=float(m.get("created", 0.0)),
            id=rec.id,
        )

    def as_lesson(self, similarity: float | None = None) -> Lesson:
        return Lesson(
            task_features=self.task_features,
            finding=self.finding,
            edit=self.edit,
            outcome=self.outcome,
            gain=self.gain,
            similarity=similarity,
        )


# --- task features --------------------------------------------------------------------------------------

# Op names (lower case, underscores and a trailing 1d/2d/3d dropped) -> what kind of kernel they make.
# Words, not names, are what carries across tasks: a layernorm query finds a softmax lesson through
# "row reduction over the last dim", not through the op name.
_KINDS: dict[str, str] = {}
for _kind, _names in {
    "softmax (row reduction)": "softmax logsoftmax logsumexp crossentropy nllloss",
    "normalization (row reduction)": "layernorm rmsnorm groupnorm batchnorm instancenorm normalize",
    "reduction": "sum mean max min amax amin argmax argmin prod norm var std cumsum cumprod mseloss",
    "matrix multiply (GEMM)": "matmul mm bmm addmm baddbmm linear bilinear einsum",
    "convolution": "conv convtranspose",
    "pooling": "maxpool avgpool adaptivemaxpool adaptiveavgpool",
    "attention": "scaleddotproductattention multiheadattention",
    "elementwise": "relu gelu silu sigmoid tanh exp log add mul sub div clamp dropout leakyrelu elu "
    "hardtanh hardswish softplus mish where abs sqrt rsqrt pow square erf",
}.items():
    for _n in _names.split():
        _KINDS[_n] = _kind

# Namespaced calls: torch.softmax(, F.gelu(, nn.LayerNorm(, torch.nn.functional.relu(
_CALL_RE = re.compile(r"\b(?:torch\.nn\.functional|torch\.nn|torch|nn|F)\.([A-Za-z_]\w*)\s*\(")
# Tensor methods (x.softmax(, y.sum() count only when they name a known op: .view( or .item( are not ops.
_METHOD_RE = re.compile(r"\.\s*([A-Za-z_]\w*)\s*\(")
_MATMUL_OP_RE = re.compile(r"[\w)\]]\s*@\s*[\w(]")  # a @ b, not a decorator
_LAST_DIM_RE = re.compile(r"dim\s*=\s*-1\b|\(\s*-1\s*\)")
_NOT_OPS = {
    "module",
    "parameter",
    "randn",
    "rand",
    "randint",
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "device",
    "nograd",
    "manualseed",
    "sequential",
    "modulelist",
    "identity",
}


def _op_key(name: str) -> str:
    return re.sub(r"[123]d$", "", name.lower().replace("_", ""))


def reference_ops(source: str) -> list[str]:
    """Op names the reference calls (torch.*, F.*, nn.*, known tensor methods, @), in order of appearance."""
    found: list[tuple[int, str]] = []
    for m in _CALL_RE.finditer(source):
        if _op_key(m.group(1)) not in _NOT_OPS:
            found.append((m.start(), m.group(1)))
    for m in _METHOD_RE.finditer(source):
        if _op_key(m.group(1)) not in _KINDS:
            continue
        receiver = source[_name_start(source, m.start()) : m.start()]
        # torch.softmax( is a namespaced call, counted above; self.norm( is a submodule, named by its nn.X.
        if receiver.split(".")[0] in {"torch", "nn", "F", "self"}:
            continue
        found.append((m.start(), m.group(1)))
    found.extend((m.start(), "matmul") for m in _MATMUL_OP_RE.finditer(source))
    out: list[str] = []
    for _, name in sorted(found):
        if name not in out:
            out.append(name)
    return out


def _name_start(source: str, pos: int) -> int:
    """Where the dotted name ending at pos starts ("torch.nn" in "y = torch.nn.x")."""
    while pos > 0 and (source[pos - 1].isalnum() or source[pos - 1] in "._"):
        pos -= 1
    return pos


def task_features(task: Task, bound: str = "") -> str:
    """A short, deterministic description of a task for embedding: op kinds, ops, dtype, shapes, size,
    arithmetic intensity class, and the parent's bound class when known. E.g.
    "normalization (row reduction) over the last dim; ops LayerNorm; float32; 8192x8192 -> 8192x8192;
    512 MB moved; memory-heavy (0 FLOP/B); memory-bound"."""
    ops = reference_ops(task.source)
    kinds: list[str] = []
    for op in ops:
        kind = _KINDS.get(_op_key(op))
        if kind and kind not in kinds:
            kinds.append(kind)
    parts: list[str] = []
    if kinds:
        head = ", ".join(kinds)
        if any("reduction" in k for k in kinds) and (
            _LAST_DIM_RE.search(task.source) or any("normalization" in k for k in kinds)
        ):
            head += " over the last dim"  # layer/RMS norms reduce the trailing dims by construction
        parts.append(head)
    if ops:
        parts.append("ops " + ", ".join(ops[:8]))
    parts.append(task.dtype)
    ins = ", ".join(_shape(s.shape) for s in task.inputs) or "?"
    outs = ", ".join(_shape(s.shape) for s in task.outputs) or "?"
    parts.append(f"{ins} -> {outs}")
    parts.append(f"{_mb(task.min_bytes)} moved")
    intensity = task.flops / task.min_bytes if task.min_bytes > 0 else 0.0
    heavy = "compute-heavy" if intensity >= COMPUTE_HEAVY_FLOP_PER_BYTE else "memory-heavy"
    parts.append(f"{heavy} ({intensity:.0f} FLOP/B)")
    bound_class = bound.split(":", 1)[0].strip()[:60]  # "memory-bound: DRAM at 62%" -> stable "memory-bound"
    if bound_class:
        parts.append(bound_class)
    return "; ".join(parts)


def _shape(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape) if shape else "scalar"


def _mb(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GB"
    if n >= 2**20:
        return f"{n / 2**20:.0f} MB"
    return f"{n / 2**10:.0f} KB"


def finding_text(finding: Finding | None) -> str:
    if finding is None:
        return "no finding"
    diagnosis = " ".join(finding.diagnosis.split())
    if len(diagnosis) > _TEXT_MAX:
        diagnosis = diagnosis[: _TEXT_MAX - 3] + "..."
    return f"{finding.tool}: {diagnosis}" if diagnosis else finding.tool


def outcome_text(status: Status | str, gain: float | None) -> str:
    status = str(status)
    if status != Status.OK.value:
        return "failed: " + status.replace("_", " ")
    if gain is None:
        return "correct, not timed"
    if gain > NO_CHANGE_HI:
        return f"{gain:.2f}x faster than its parent"
    if gain < NO_CHANGE_LO:
        return f"slower than its parent ({gain:.2f}x)"
    return f"no change ({gain:.2f}x)"


def lessons_from_result(
    task: Task,
    run_id: str,
    parent: str,
    edit: str,
    finding: Finding | None,
    status: Status | str,
    speedup: float | None,
    *,
    bound: str = "",
    created: float | None = None,
) -> StoredLesson:
    """The lesson of one evaluated child: `speedup` is the child's speedup over its parent (>1 better)."""
    ok = str(status) == Status.OK.value
    gain = float(speedup) if ok and speedup is not None else None  # a failed child has no speed
    return StoredLesson(
        task_id=task.id,
        task_features=task_features(task, bound),
        finding=finding_text(finding),
        edit=edit,
        outcome=outcome_text(status, gain),
        status=str(status),
        gain=gain,
        run_id=run_id,
        parent=parent,
        created=time.time() if created is None else created,
    )


def context_query(task: Task, bound: str, findings: Iterable[Finding]) -> str:
    """What a context search embeds: the same shape as a stored document's first lines."""
    top = [finding_text(f) for f in list(findings)[:_QUERY_FINDINGS]]
    text = f"task: {task_features(task, bound)}"
    if top:
        text += "\nfinding: " + "; ".join(top)
    return text


# --- the memory -----------------------------------------------------------------------------------------

_embedders: dict[str | None, Embedder] = {}
_embedders_lock = threading.Lock()


def _shared_embedder(cfg: Config) -> Embedder:
    # One model per process and embed_model, shared by every Memory (CLI commands, the loop, tests):
    # loading it takes seconds and hundreds of MB.
    with _embedders_lock:
        if cfg.embed_model not in _embedders:
            with _quiet_model_load():
                _embedders[cfg.embed_model] = Embedder(cfg)
        return _embedders[cfg.embed_model]


@contextlib.contextmanager
def _quiet_model_load() -> Iterator[None]:
    # transformers draws a "Loading weights" bar on stderr, which would break the CLI's one-line errors
    # (`kernelpro memory clear` loads the model before it refuses). Restored afterwards: it is global state.
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # sentence-transformers without transformers' logging helpers: nothing to quiet
        yield
        return
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


class Memory:
    """Lessons across runs, in their own Chroma collection. Opens the store and loads the model lazily.

    Every method may raise ``StoreError`` (one line); nothing else is expected from the store.
    """

    def __init__(
        self, cfg: Config, collection: str = COLLECTION, *, embedder: Embedder | None = None
    ) -> None:
        self.cfg = cfg
        self.name = collection
        self._embedder = embedder
        self._coll: Collection | None = None
        self._lock = threading.Lock()  # the loop may record and query from several threads

    def __repr__(self) -> str:
        return f"Memory({self.name!r} in {self.where})"

    @property
    def where(self) -> str:
        cfg = self.cfg
        return f"{cfg.chroma_host}:{cfg.chroma_port}" if cfg.chroma_host else str(cfg.chroma_path)

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = _shared_embedder(self.cfg)
        return self._embedder

    def open(self) -> Memory:
        """Open (and create) the collection now: a loop can check the memory once at start."""
        self._collection(create=True)
        return self

    def _collection(self, create: bool) -> Collection | None:
        """The collection; None when create is False and it does not exist (reading creates nothing)."""
        with self._lock:
            if self._coll is not None:
                return self._coll
            cfg = self.cfg
            if not create and not cfg.chroma_host and not cfg.chroma_path.exists():
                return None  # no folder: nothing stored yet, and `memory list` should not create one
            store = open_store(cfg)
            if not create:
                try:
                    names = store.names()
                except Exception as e:  # the store wraps chromadb; listing is the one call it leaves bare
                    raise StoreError(f"cannot list collections in {store.where}: {_short(e)}") from None
                if self.name not in names:
                    return None
            emb = self.embedder
            self._coll = store.collection(self.name, model=emb.name, dimension=emb.dimension, create=True)
            return self._coll

    def add(self, lessons: Sequence[StoredLesson]) -> int:
        """Store lessons (upsert by content id: adding one again changes nothing). Returns how many."""
        unique = list({s.id: s for s in lessons}.values())  # one upsert may not repeat an id
        if not unique:
            return 0
        coll = self._collection(create=True)
        assert coll is not None
        docs = [s.document() for s in unique]
        coll.upsert([s.id for s in unique], docs, self.embedder.embed(docs), [s.metadata() for s in unique])
        return len(unique)

    def hits(
        self, query_text: str, k: int = 5, only_helpful: bool = False
    ) -> list[tuple[StoredLesson, float]]:
        """The k lessons nearest to query_text, with cosine similarity (1 identical, 0 unrelated), best first."""
        if not query_text.strip():
            raise StoreError("the memory query is empty; describe the task or the problem")
        if k < 1:
            raise StoreError(f"k must be at least 1, got {k}")
        coll = self._collection(create=False)
        if coll is None or coll.count() == 0:
            return []
        vec = self.embedder.embed([query_text])[0]
        found = coll.query(vec, n=k, where={"helpful": True} if only_helpful else None)
        return [(StoredLesson.from_record(h), 1.0 - h.distance) for h in found]

    def search(self, query_text: str, k: int = 5, only_helpful: bool = False) -> list[Lesson]:
        """The k lessons nearest to query_text, as the Lessons a policy receives (similarity filled in)."""
        return [s.as_lesson(sim) for s, sim in self.hits(query_text, k, only_helpful)]

    def for_context(
        self, task: Task, bound: str, findings: Sequence[Finding], k: int = 5
    ) -> tuple[Lesson, ...]:
        """Up to k lessons for expanding a node of `task`: edits that helped on similar tasks and findings
        first, then what failed, slowed down or changed nothing there, as warnings.

        A third of the places (at least one) go to warnings when there are any, so that a memory full of
        successes still warns about the edit that broke a similar kernel; unused places go to the other side.
        """
        if k < 1:
            return ()
        pool = self.hits(context_query(task, bound, findings), k=max(4 * k, 20))
        helpful: list[Lesson] = []
        warnings: list[Lesson] = []
        seen: set[tuple[str, str, str, str]] = set()
        for s, sim in pool:  # nearest first, so each side stays ordered by similarity
            key = (s.task_features, s.finding, s.edit, s.outcome)  # the same lesson from several runs
            if key in seen:
                continue
            seen.add(key)
            (helpful if s.helpful else warnings).append(s.as_lesson(sim))
        n_warn = min(len(warnings), max(1, k // 3))
        n_help = min(len(helpful), k - n_warn)
        n_warn = min(len(warnings), k - n_help)
        return tuple(helpful[:n_help] + warnings[:n_warn])

    def list(self, limit: int | None = None) -> list[StoredLesson]:
        """Stored lessons, newest first (all of them, or the newest `limit`)."""
        if limit is not None and limit < 1:
            raise StoreError(f"limit must be at least 1, got {limit}")
        coll = self._collection(create=False)
        if coll is None:
            return []
        records = coll.get(coll.ids_where(None))
        lessons = sorted(
            (StoredLesson.from_record(r) for r in records if r.metadata),  # skip orphans of a killed write
            key=lambda s: (s.created, s.id),
            reverse=True,
        )
        return lessons if limit is None else lessons[:limit]

    def count(self) -> int:
        coll = self._collection(create=False)
        return 0 if coll is None else coll.count()

    def clear(self) -> int:
        """Delete every lesson; returns how many there were. The (empty) collection stays."""
        coll = self._collection(create=False)
        if coll is None:
            return 0
        ids = coll.ids_where(None)
        coll.delete(ids)
        return len(ids)


def as_dict(lesson: StoredLesson | Lesson) -> dict[str, Any]:
    """JSON-ready form of a lesson (for `kernelpro memory ... --json` and run logs)."""
    return dataclasses.asdict(lesson)


def _short(e: BaseException) -> str:
    return (" ".join(str(e).split()) or type(e).__name__)[:200]
