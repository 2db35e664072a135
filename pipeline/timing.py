"""Timing on the GPU: CUDA events, warm-up, L2 flushed before every trial, inputs rotated, median of many.

Each trial also reads the host clock around the call and a device-wide synchronise, and the two are
compared: work hidden on another stream or finished by a thread after return shows up in host time only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from pipeline.types import Timing

HIDDEN_WORK_RATIO = 1.5  # host time this much above event time (plus slack) means work the events missed
HIDDEN_WORK_SLACK_MS = 0.2


def l2_bytes(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


class L2Flusher:
    """A write of twice the L2 size between trials, so no trial starts with its data already cached."""

    def __init__(self, device: torch.device):
        self.buffer = torch.empty(2 * l2_bytes(device), dtype=torch.uint8, device=device)
        self._value = 0

    def __call__(self) -> None:
        self._value = (self._value + 1) % 251
        self.buffer.fill_(self._value)


def time_cuda(fn: Callable[..., object], input_sets: Sequence[Sequence], *, trials: int, budget_s: float,
              warmup: int, flusher: L2Flusher | None = None) -> Timing:  # fmt: skip
    """Median and spread of `fn(*inputs)` over trials, each on the next input set, each after an L2 flush."""
    device = torch.device("cuda", torch.cuda.current_device())
    flusher = flusher or L2Flusher(device)
    with torch.no_grad():
        for i in range(max(1, warmup)):
            fn(*input_sets[i % len(input_sets)])
        torch.cuda.synchronize()
        # Fit the trial count to the budget from one measured call.
        t0 = time.perf_counter()
        fn(*input_sets[0])
        torch.cuda.synchronize()
        one = time.perf_counter() - t0
        n = int(max(10, min(trials, budget_s / max(one + 50e-6, 1e-6))))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        host_ms: list[float] = []
        for i in range(n):
            flusher()
            torch.cuda.synchronize()
            h0 = time.perf_counter()
            starts[i].record()
            fn(*input_sets[i % len(input_sets)])
            ends[i].record()
            torch.cuda.synchronize()  # device-wide: waits for work on every stream, which the events do not
            host_ms.append((time.perf_counter() - h0) * 1e3)
    event_ms = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return summarize(event_ms, host_ms)


def summarize(event_ms: list[float], host_ms: list[float] | None = None) -> Timing:
    xs = sorted(event_ms)
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return Timing(
        median_ms=statistics.median(xs),
        q1_ms=q[0],
        q3_ms=q[2],
        min_ms=xs[0],
        max_ms=xs[-1],
        trials=len(xs),
        host_median_ms=statistics.median(host_ms) if host_ms else None,
    )


def hidden_work(t: Timing) -> str | None:
    """A reason string when the host saw much more time than the events on the current stream did."""
    if t.host_median_ms is None:
        return None
    if t.host_median_ms > HIDDEN_WORK_RATIO * t.median_ms + HIDDEN_WORK_SLACK_MS:
        return (
            f"hidden_work: host time {t.host_median_ms:.3f} ms against {t.median_ms:.3f} ms of events on the "
            "current stream: work on another stream or after return"
        )
    return None
