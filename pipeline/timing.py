"""Timing on the GPU: CUDA events, warm-up, L2 flushed before every trial, inputs rotated, median of many.

A few synchronised calls also read the host clock around the call and a device-wide synchronise, and the
two are compared: work hidden on another stream or finished by a thread after return shows up in host time
only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from pipeline.types import Timing

HIDDEN_WORK_RATIO = 1.5  # host time this much above event time (plus slack) means work the events missed
HIDDEN_WORK_SLACK_MS = 0.2
_MAX_CLOCK_HZ = 2.0e9  # sleep cycles are counted at the SM clock; at a lower clock the cover only lengthens


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


def time_cuda(
    fn: Callable[..., object],
    input_sets: Sequence[Sequence],
    *,
    trials: int,
    budget_s: float,
    warmup: int,
    flusher: L2Flusher | None = None,
    check_trials: int = 5,
) -> Timing:
    """Median and spread of `fn(*inputs)` over trials, each on the next input set, each after an L2 flush."""
    device = torch.device("cuda", torch.cuda.current_device())
    flusher = flusher or L2Flusher(device)
    with torch.no_grad():
        for i in range(max(1, warmup)):
            fn(*input_sets[i % len(input_sets)])
        torch.cuda.synchronize()
        # Synchronised calls first: host wall time against events (launch overhead in both), for the
        # hidden-work check, and the host's launch time, which the timed trials below must cover.
        host_ms, synced_ms, launch_s = [], [], []
        for i in range(check_trials):
            flusher()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            h0 = time.perf_counter()
            start.record()
            fn(*input_sets[i % len(input_sets)])
            end.record()
            launch_s.append(time.perf_counter() - h0)
            torch.cuda.synchronize()  # device-wide: waits for work on every stream, which the events do not
            host_ms.append((time.perf_counter() - h0) * 1e3)
            synced_ms.append(start.elapsed_time(end))
        # Timed trials: the GPU is kept busy (flush, then a sleep longer than the host's launch work), so the
        # events measure the kernels and the gaps between them on the device, not the Python that issued them.
        cover = 2 * statistics.median(launch_s) + 20e-6
        cycles = int(cover * _MAX_CLOCK_HZ)
        n = int(max(10, min(trials, budget_s / (statistics.median(host_ms) * 1e-3 + cover + 1e-4))))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            flusher()
            torch.cuda._sleep(cycles)
            starts[i].record()
            fn(*input_sets[i % len(input_sets)])
            ends[i].record()
            torch.cuda.synchronize()
    event_ms = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return summarize(event_ms, host_ms, synced_ms)


def summarize(
    event_ms: list[float], host_ms: list[float] | None = None, synced_ms: list[float] | None = None
) -> Timing:
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
        synced_median_ms=statistics.median(synced_ms) if synced_ms else None,
    )


def hidden_work(t: Timing) -> str | None:
    """A reason string when the host saw much more time than the events on the current stream did."""
    if t.host_median_ms is None or t.synced_median_ms is None:
        return None
    if t.host_median_ms > HIDDEN_WORK_RATIO * t.synced_median_ms + HIDDEN_WORK_SLACK_MS:
        return (
            f"hidden_work: host time {t.host_median_ms:.3f} ms against {t.synced_median_ms:.3f} ms of events on the "
            "current stream: work on another stream or after return"
        )
    return None
