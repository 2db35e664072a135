"""The append-only run log of a search: the evaluation cache, the resume point and the GPU-free replay.

`runs/<run-id>/log.jsonl` holds one JSON object a line: {"seq": int, "type": str, "t": unix time, "data": {}}.
Each append is one os.write of a whole line to an O_APPEND fd, then fsync, so a kill at any moment leaves at
most one torn last line; readers drop it and a writer that reopens the run cuts it off first. One writer at a
time holds flock on `runs/<run-id>/lock`; the kernel releases it when the process dies, kill -9 included.

The events' types and data are pipeline/events.py's records (start, baselines, ceilings, proposal, result,
profile, llm, lesson, closed, iteration, proposal_failed, repair_failed, resume, interrupted, final, end);
pipeline/runstate.py folds them into the run's state. Any other lower_case type may be appended; readers skip
types they do not know.

A proposal's usage attributes cost to it; the totals come from "llm" events only, so nothing counts twice.
Strings holding a configured secret are scrubbed to "***" before they reach the disk, and so is any non-empty
string under a key that names a credential (api_key, authorization, token, ...; not prompt_tokens).
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import fcntl
import gzip
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
            names = run_ids(runs_dir)
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
    """The events of a run (its folder, its log.jsonl, or a bench's kept copy of it, gzipped: <run id>.jsonl.gz),
    read-only, without the lock: replay, reports."""
    path = Path(path) / LOG if Path(path).is_dir() else Path(path)
    raw = path.read_bytes()
    return _parse(gzip.decompress(raw) if path.suffix == ".gz" else raw, path)[0]


def run_ids(runs_dir: Path) -> list[str]:
    """The ids of the runs under runs_dir, oldest first (ids start with the time)."""
    runs_dir = Path(runs_dir)
    return sorted(p.name for p in runs_dir.iterdir() if (p / LOG).is_file()) if runs_dir.is_dir() else []


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


def is_locked(folder: Path) -> bool:
    """Whether a writer holds the run (it may be mid-step)."""
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
