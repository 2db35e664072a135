"""Baselines measured before, reused: a search run over a task it has seen on this GPU and software skips
eager and torch.compile's timing (and torch.compile's compile, ~5-10 s a task).

The key is everything the numbers depend on: the task's source, the worker's verification and timing
settings, and the GPU, driver and library versions (not the clocks of the moment). A hit is a number
measured on this machine's kind before, so the run says where it came from; each candidate is still timed
next to a fresh eager call, and the best's final re-measure times eager and torch.compile again, so no
speedup a run reports rests on the cached figures alone.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pipeline.types import Baselines, Task, from_dict, to_dict

# The environment fields a timing depends on; the clocks read at that moment are left out.
_STABLE = (
    "gpu",
    "sm_count",
    "capability",
    "driver",
    "power_limit_w",
    "python",
    "torch",
    "cuda_runtime",
    "cupy",
)


def key(task: Task, settings: Any, environment: dict[str, str]) -> str:
    what = {
        "source": task.source_hash,
        "settings": to_dict(settings),
        "environment": {k: environment.get(k) for k in _STABLE},
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def path(home: Path, k: str) -> Path:
    return Path(home) / "baselines" / "cache" / f"{k}.json"


def load(home: Path, k: str) -> Baselines | None:
    """The cached baselines under this key, with a note that says when they were measured; None on a miss
    or an unreadable entry (measured again, not trusted)."""
    p = path(home, k)
    try:
        doc = json.loads(p.read_text())
        base = from_dict(Baselines, doc["baselines"])
        when = str(doc["measured"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    note = f"baselines from the cache, measured {when} on this GPU and software ({p.name})"
    return dataclasses.replace(base, notes=(*base.notes, note))


def save(home: Path, k: str, base: Baselines) -> Path:
    """Atomically: a kill mid-write leaves the old entry or none, never half of one."""
    p = path(home, k)
    p.parent.mkdir(parents=True, exist_ok=True)
    measured = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"measured": measured, "baselines": to_dict(base)}, indent=1))
    os.replace(tmp, p)
    return p
