"""The append-only run log of a search: the evaluation cache, the resume point and the GPU-free replay.

`runs/<run-id>/log.jsonl` holds one JSON object a line: {"seq": int, "type": str, "t": unix time, "data": {}}.
Each append is one os.write of a whole line to an O_APPEND fd, then fsync, so a kill at any moment leaves at
most one torn last line; readers drop it and a writer that reopens the run cuts it off first. One writer at a
time holds flock on `runs/<run-id>/lock`; the kernel releases it when the process dies, kill -9 included.

Event types and their data (objects in pipeline.types.to_dict form; keys are candidate keys, nodes are ints):
  start      run_id, task {id, path, source_hash}, config (Config.public()), policy, search, seed, environment
  baselines  timings {name: Timing}, floor_ms
  proposal   node, parent, candidate (Candidate | null), edit, status (ProposalStatus), reason, usage (Usage)
  build      Build
  result     node, key, verdict (Verdict), measurement (Measurement | null), reward, objective
             (one for every evaluated candidate, failures included: a compile error has verdict and no
             measurement)
  profile    node, key, bound, findings [Finding]
  llm        the Usage fields (flat, or under "usage"): the token and cost ledger, one per exchange
  lesson     memory writes (pipeline.generate.base.Lesson)
  closed     node, reason
  resume     resumed_at (last seq before), dropped_bytes (the torn tail cut off), pending [keys re-evaluated];
             the loop's also hold more and budgets (the budgets a later resume keeps)
  end        reason, best_node, best_key, best_speedup_eager (or summary {best_speedup}), ...
Any other lower_case type may be appended (the loop adds iteration, proposal_failed, repair_failed,
interrupted, final, and ceilings: the GPU's measured ceilings, for the report); readers skip types they do
not know.

A proposal's usage attributes cost to it; the totals come from "llm" events only, so nothing counts twice.
Strings holding a configured secret are scrubbed to "***" before they reach the disk, and so is any non-empty
string under a key that names a credential (api_key, authorization, token, ...; not prompt_tokens).
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import fcntl
import itertools
import json
import os
import re
import secrets as _random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.types import to_dict

_TYPES = "start baselines proposal build result profile llm lesson closed resume end"
EVENT_TYPES = frozenset(_TYPES.split())  # the core schema above; append accepts others too
_TYPE = re.compile(r"[a-z][a-z0-9_]*")
LOG, LOCK = "log.jsonl", "lock"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_CRED_WORDS = {"token", "secret", "password", "passwd", "authorization", "credential", "credentials"}
_CRED_WORDS |= {"apikey", "bearer", "cookie"}
_CRED_PREFIXES = {"api", "access", "private", "secret", "auth"}  # ..._key pairs: api_key, access_key


class RunLogError(Exception):
    pass


@dataclass(frozen=True)
class Event:
    seq: int
    type: str
    t: float
    data: dict[str, Any]


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    task_id: str
    started: float | None  # unix time of the start event
    events: int
    evaluations: int  # result events
    status: str  # finished | interrupted | running | corrupt
    best_speedup: float | None = None


def new_run_id(task_id: str, now: float | None = None) -> str:
    """e.g. 20261130-031500-softmax-3f2a: sorts by start time (UTC), safe as a folder name."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    task = re.sub(r"[^A-Za-z0-9._-]+", "-", task_id).strip("-.")[:40] or "task"
    return f"{stamp}-{task}-{_random.token_hex(2)}"


class RunLog:
    def __init__(self, folder: Path, fd: int, lock_fd: int, events: list[Event], size: int, **kw: Any):
        self.folder, self.path, self.run_id = folder, folder / LOG, folder.name
        self.dropped_bytes: int = kw.get("dropped_bytes", 0)  # the torn tail cut off on open
        self._fd, self._lock_fd, self._events, self._size = fd, lock_fd, events, size
        self._fsync: bool = kw.get("fsync", True)
        self._secrets = tuple(s for s in kw.get("secrets", ()) if s)  # "" would match every string
        self._mutex = threading.Lock()  # the loop may append from several threads

    @classmethod
    def create(
        cls,
        runs_dir: Path,
        run_id: str,
        header: dict[str, Any],
        *,
        secrets: Sequence[str] = (),
        fsync: bool = True,
    ) -> RunLog:
        folder = Path(runs_dir) / _check_id(run_id)
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            folder.mkdir()  # exclusive: two runs never share a folder
        except FileExistsError:
            raise RunLogError(f"run {run_id} already exists under {runs_dir}") from None
        lock_fd = _lock(folder)
        fd = os.open(folder / LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fsync_dir(folder)  # a crashed machine must not lose the new file's entry
        log = cls(folder, fd, lock_fd, [], 0, secrets=secrets, fsync=fsync)
        try:
            log._append("start", {"run_id": run_id, **header})
        except BaseException:  # e.g. a header that is not JSON: leave no headless run behind
            log.close()
            for name in (LOG, LOCK):
                (folder / name).unlink(missing_ok=True)
            folder.rmdir()
            raise
        return log

    @classmethod
    def open(cls, runs_dir: Path, run_id: str, *, secrets: Sequence[str] = (), fsync: bool = True) -> RunLog:
        """Reopen a run for appending (resume): takes the lock and cuts off a torn last line."""
        folder = Path(runs_dir) / _check_id(run_id)
        if not (folder / LOG).is_file():
            names = [r.run_id for r in list_runs(runs_dir)]
            listing = ", ".join(names[-10:]) if names else "none"
            more = f" (and {len(names) - 10} older)" if len(names) > 10 else ""
            raise RunLogError(f"no run {run_id} under {runs_dir}; runs there: {listing}{more}")
        lock_fd = _lock(folder)
        try:
            raw = (folder / LOG).read_bytes()
            events, good = _parse(raw, folder / LOG)
            if not events or events[0].type != "start":
                raise RunLogError(f"run {run_id} has no start event (killed while being created?)")
            fd = os.open(folder / LOG, os.O_WRONLY | os.O_APPEND)
        except BaseException:
            os.close(lock_fd)
            raise
        if good < len(raw):  # new lines must not glue onto the garbage
            os.ftruncate(fd, good)
            os.fsync(fd)
        return cls(
            folder, fd, lock_fd, events, good, secrets=secrets, fsync=fsync, dropped_bytes=len(raw) - good
        )

    @property
    def header(self) -> Event:
        return self._events[0]  # the "start" event

    def append(self, type: str, data: dict[str, Any]) -> int:
        if type == "start" or not _TYPE.fullmatch(type):  # "start" is written once, by create
            raise RunLogError(f"cannot append an event of type {type!r}")
        return self._append(type, data)

    def _append(self, type: str, data: dict[str, Any]) -> int:
        with self._mutex:
            if self._fd < 0:
                raise RunLogError(f"run {self.run_id} is closed")
            seq = len(self._events)
            ev = {"seq": seq, "type": type, "t": time.time(), "data": self._clean(data, None)}
            line = (json.dumps(ev, separators=(",", ":")) + "\n").encode()  # ASCII: survives stray surrogates
            try:
                view = memoryview(line)
                while view:  # a regular file writes it whole; loop in case of a short write anyway
                    view = view[os.write(self._fd, view) :]
                if self._fsync:
                    os.fsync(self._fd)
            except OSError as e:
                os.ftruncate(self._fd, self._size)  # e.g. a full disk: leave no torn line behind
                raise RunLogError(f"cannot append to {self.path}: {e}") from e
            self._size += len(line)
            self._events.append(_event(json.loads(line)))  # exactly what a reader will see
            return seq

    def resync(self) -> None:
        """Take the file's events as the truth again. A KeyboardInterrupt can land between an append's write
        and its bookkeeping; the next append would then reuse a sequence number (and readers drop it)."""
        with self._mutex:
            if self._fd < 0:
                raise RunLogError(f"run {self.run_id} is closed")
            raw = self.path.read_bytes()
            events, good = _parse(raw, self.path)
            if good < len(raw):
                os.ftruncate(self._fd, good)
            self._events, self._size = events, good

    def _clean(self, obj: Any, key: str | None) -> Any:
        """JSON-ready, secrets scrubbed, anywhere in nested data."""
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            obj = to_dict(obj)
        if isinstance(obj, dict):
            return {self._clean(str(k), None): self._clean(v, str(k)) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self._clean(v, key) for v in obj]
        if isinstance(obj, enum.Enum):
            obj = obj.value
        if isinstance(obj, Path):
            obj = str(obj)
        if isinstance(obj, str):
            if obj and key is not None and _is_credential(key):
                return "***"
            for s in self._secrets:
                obj = obj.replace(s, "***")
            return obj
        if obj is None or isinstance(obj, bool | int | float):
            return obj
        raise RunLogError(f"cannot log a {type(obj).__name__} (under {key!r}); log its to_dict form")

    def events(self, types: set[str] | None = None) -> list[Event]:
        return [e for e in self._events if types is None or e.type in types]

    def close(self) -> None:
        with self._mutex:
            if self._fd >= 0:
                os.close(self._fd)
                os.close(self._lock_fd)  # releases the flock
                self._fd = self._lock_fd = -1

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: Path) -> list[Event]:
    """The events of a run (its folder or its log.jsonl), read-only, without the lock: replay, reports."""
    path = Path(path) / LOG if Path(path).is_dir() else Path(path)
    return _parse(path.read_bytes(), path)[0]


def completed_results(events: list[Event]) -> dict[str, Event]:
    """Candidate key -> its "result" event: on resume a candidate already evaluated is never evaluated again."""
    return {e.data["key"]: e for e in events if e.type == "result"}


def pending_proposals(events: list[Event]) -> list[Event]:
    """Proposals with a candidate but no result yet (in flight when the run died), one per key, in order."""
    done, closed = completed_results(events), {e.data.get("node") for e in events if e.type == "closed"}
    out, seen = [], set()
    for e in events:
        key = (e.data.get("candidate") or {}).get("key") if e.type == "proposal" else None
        if key and key not in done and key not in seen and e.data.get("node") not in closed:
            seen.add(key)
            out.append(e)
    return out


def usage_totals(events: list[Event]) -> dict[str, Any]:
    tot = {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "tokens": 0,
        "cost_usd": 0.0,
        "calls": 0,
        "tool_calls": 0,
    }
    for e in events:
        if e.type == "llm":
            u = e.data.get("usage", e.data)
            tot["prompt_tokens"] += u.get("prompt_tokens", 0)
            tot["completion_tokens"] += u.get("completion_tokens", 0)
            tot["cost_usd"] += u.get("cost_usd", 0.0)
            tot["calls"] += u.get("calls", 1)
            tot["tool_calls"] += len(u.get("tool_calls", ()))
    tot["tokens"] = tot["prompt_tokens"] + tot["completion_tokens"]
    return tot


def list_runs(runs_dir: Path) -> list[RunSummary]:
    """Every run under runs_dir, oldest first (ids start with the time)."""
    runs_dir = Path(runs_dir)
    folders = sorted(p for p in runs_dir.iterdir() if (p / LOG).is_file()) if runs_dir.is_dir() else []
    out = []
    for folder in folders:
        try:
            events = read_events(folder)
        except (RunLogError, OSError):
            out.append(RunSummary(folder.name, "?", None, 0, 0, "corrupt"))
            continue
        head = events[0].data if events and events[0].type == "start" else {}
        task = head.get("task")
        task = task.get("id", "?") if isinstance(task, dict) else str(task or "?")
        status = _status(folder, events)
        start = events[0].t if events else None
        n = sum(e.type == "result" for e in events)
        out.append(RunSummary(folder.name, task, start, len(events), n, status, _best_speedup(events)))
    return out


def _status(folder: Path, events: list[Event]) -> str:
    if _locked(folder):
        return "running"  # its writer holds it: the log may be mid-step
    if tree_problem(events):
        return "corrupt"  # not "finished": neither resume nor a report could fold it
    return "finished" if is_finished(events) else "interrupted"


def is_finished(events: list[Event]) -> bool:
    """An "end" after the last "resume": the run stopped by itself (a resumed run that ended again counts)."""
    marks = [e.type for e in events if e.type in ("end", "resume")]
    return bool(marks) and marks[-1] == "end"


def tree_problem(events: list[Event]) -> str | None:
    """Where the events stop making one search tree, in words, or None: a proposal under a node no proposal
    made, a node proposed twice, an event that names a node that does not exist. Resume, reports and the run
    list all fold the tree; a log edited by hand or written by other code must fail here, in one line."""
    nodes = {0}  # the root: the reference
    for e in events:
        node = e.data.get("node")
        if e.type == "proposal":
            parent = e.data.get("parent")
            if not isinstance(node, int) or parent not in nodes:
                return f"event {e.seq} proposes node {node} under node {parent}, which does not exist"
            if node in nodes:
                return f"event {e.seq} proposes node {node} a second time"
            nodes.add(node)
        elif isinstance(node, int) and node not in nodes:
            return f"event {e.seq} ({e.type}) names node {node}, which no proposal made"
        elif e.type == "end" and e.data.get("best_node") not in (None, *nodes):
            return f"event {e.seq} (end) names node {e.data['best_node']} as the best, which no proposal made"
    return None


def _best_speedup(events: list[Event]) -> float | None:
    ends = [e for e in events if e.type == "end"]
    if ends:
        end = ends[-1].data
        s = end.get("best_speedup_eager", (end.get("summary") or {}).get("best_speedup"))
        if s is not None:
            return s
    best = None
    for e in events:
        m = e.data.get("measurement") if e.type == "result" else None
        ok = e.type == "result" and (e.data.get("verdict") or {}).get("status") == "ok"
        if ok and m and m.get("status") == "ok" and m.get("timing") and "eager" in m.get("baselines", {}):
            ours, base = m["timing"]["median_ms"], m["baselines"]["eager"]["median_ms"]
            if ours > 0 and (best is None or base / ours > best):
                best = base / ours
    return best


def _is_credential(key: str) -> bool:
    # Whole words only: "token" and "api_key" are credentials, "prompt_tokens" and a candidate "key" are not.
    words = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z])([A-Z])", r"\1_\2", key).lower()) if w]
    pairs = itertools.pairwise(words)
    return bool(_CRED_WORDS & set(words)) or any(a in _CRED_PREFIXES and b == "key" for a, b in pairs)


def _check_id(run_id: str) -> str:
    if not _ID.fullmatch(run_id):  # it names a folder: no "..", no slashes
        raise RunLogError(f"bad run id {run_id!r}: letters, digits, '.', '_' and '-' only")
    return run_id


def _lock(folder: Path) -> int:
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes (PEP 446)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise RunLogError(f"run {folder.name} is being written by pid {pid}") from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _locked(folder: Path) -> bool:
    try:
        fd = os.open(folder / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # also drops the probe's own shared lock


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _event(obj: Any) -> Event:
    if not (isinstance(obj, dict) and isinstance(obj.get("seq"), int) and isinstance(obj.get("data"), dict)):
        raise ValueError("not an event")
    if not isinstance(obj.get("type"), str) or not isinstance(obj.get("t"), int | float):
        raise ValueError("not an event")
    return Event(obj["seq"], obj["type"], float(obj["t"]), obj["data"])


def _parse(raw: bytes, path: Path) -> tuple[list[Event], int]:
    """The events and the byte length of the good prefix. A bad LAST line (torn by a kill, zeros after a
    crashed machine) is dropped; a bad line before it is corruption, named by its line number."""
    lines = raw.split(b"\n")  # the last piece is b"" after a final newline, else a torn line
    events: list[Event] = []
    good = 0
    for i, line in enumerate(lines[:-1], 1):
        try:
            ev = _event(json.loads(line))
            if ev.seq != len(events):
                raise ValueError(f"seq {ev.seq} where {len(events)} was due")
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if i == len(lines) - 1 and not lines[-1]:
                break  # the last line: a torn write
            raise RunLogError(f"{path}: line {i} is corrupt ({e})") from None
        events.append(ev)
        good += len(line) + 1
    return events, good
