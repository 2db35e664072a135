"""Wall time by phase: the seconds a stage records beside its result (Measurement.seconds in the worker,
Profile.seconds in the orchestrator), so a run's log says where an evaluation's or a profile's time went."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def phase(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's wall time to seconds[name] (ms resolution), also when the block raises or returns."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = round(seconds.get(name, 0.0) + time.perf_counter() - t0, 3)
