"""Timing on the GPU: CUDA events, warm-up, L2 flushed before every trial, median of many.

Every call gets fresh inputs from the task's own factory (made outside the timed region), and the outputs
of a candidate's calls are checked against the reference on those same inputs: a time is believed only for
calls whose results were right, on inputs the candidate had never seen (no memoising by pointer, call count
or state). A few synchronised calls also read the host clock around the call and a device-wide synchronise,
and the two are compared: work hidden on another stream or finished by a thread after return shows up in
host time only.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable

import torch

from pipeline.types import Timing

HIDDEN_WORK_RATIO = 1.5  # host time this much above event time (plus slack) means work the events missed
HIDDEN_WORK_SLACK_MS = 0.2
HIDDEN_WORK_RETRIES = 2  # more rounds of synchronised calls before a gap is believed
_MAX_CLOCK_HZ = 2.0e9  # sleep cycles are counted at the SM clock; at a lower clock the cover only lengthens


def l2_bytes(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


class L2Flusher:
    """Twice the L2 size moved through it between trials, so no trial starts with its data cached.

    "clean" reads the buffer: the lines left in L2 are clean, and what the last trial wrote (its outputs,
    the next trial's fresh inputs) is written back during the flush, as ncu's cache control leaves it.
    "writes" fills the buffer (do_bench's convention): an L2 of dirty lines stays (50 MB on the H100, 60 on
    the H200), and the trial's own reads pay for writing back what they evict: traffic it never asked for.
    """

    MODES = ("clean", "writes")

    def __init__(self, device: torch.device, mode: str = "clean"):
        if mode not in self.MODES:
            raise ValueError(f"L2 flush mode {mode!r} is not one of {', '.join(self.MODES)}")
        self.mode = mode
        self.buffer = torch.empty(2 * l2_bytes(device) // 4, dtype=torch.int32, device=device)
        self.buffer.fill_(1)  # written once, so a read never touches memory the driver has not backed
        self._value = 0

    def __call__(self) -> None:
        if self.mode == "clean":
            self.buffer.amax()  # a read of every line; the one-element result stays on the GPU
        else:
            self._value = (self._value + 1) % 251
            self.buffer.fill_(self._value)


InputsFor = Callable[[int], list]  # call number -> a fresh input set from the task's own factory
Check = Callable[[list, object], None]  # (inputs, outputs) -> None, or raises with the reason


def time_cuda(
    fn: Callable[..., object],
    inputs_for: InputsFor,
    *,
    trials: int,
    budget_s: float,
    warmup: int,
    flusher: L2Flusher | None = None,
    check: Check | None = None,
    check_fraction: float = 1.0,
    check_trials: int = 5,
) -> Timing:
    """Median and spread of `fn(*inputs)` over trials, each on fresh inputs, each after an L2 flush. With
    `check`, the outputs of the synchronised calls and of the timed calls (all of them, or a random sample
    of `check_fraction` decided after each call returns, so the candidate cannot know) are checked."""
    device = torch.device("cuda", torch.cuda.current_device())
    flusher = flusher or L2Flusher(device)
    pick = random.Random()  # seeded from the OS: nothing the candidate can predict
    checked = 0
    call = 0
    parts = dict.fromkeys(("inputs", "flush", "calls", "checks"), 0.0)  # host seconds, for the throughput

    def run(timed: Callable[[], object] | None = None) -> tuple[float, float, float]:
        nonlocal call, checked
        t0 = time.perf_counter()
        inputs = inputs_for(call)
        call += 1
        t1 = time.perf_counter()
        flusher()
        parts["inputs"] += t1 - t0
        parts["flush"] += time.perf_counter() - t1
        if timed is not None:
            timed()
        else:
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if timed is None:
            start.synchronize()  # the host clock starts once the GPU reaches the call, not while it waits its turn
        h0 = time.perf_counter()
        out = fn(*inputs)
        end.record()
        launched = time.perf_counter() - h0
        torch.cuda.synchronize()  # device-wide: waits for work on every stream, which the events do not
        t2 = time.perf_counter()
        host = (t2 - h0) * 1e3
        parts["calls"] += t2 - h0
        if check is not None and (checked < MIN_CHECKS or pick.random() < check_fraction):
            check(inputs, out)
            checked += 1
            parts["checks"] += time.perf_counter() - t2
        return start.elapsed_time(end), host, launched

    with torch.no_grad():
        for i in range(max(1, warmup)):
            fn(*inputs_for(10_000 + i))
        torch.cuda.synchronize()
        # Synchronised calls first: host wall time against events (launch overhead in both), for the
        # hidden-work check, and the host's launch time, which the timed trials below must cover.
        host_ms, synced_ms, launch_s = [], [], []
        # Work hidden from the events delays every call; another process on the GPU delays some calls by a
        # time slice (about 2 ms). Before a gap is believed the synchronised calls are repeated, up to twice,
        # and the check reads the medians over all of them.
        for _ in range(1 + HIDDEN_WORK_RETRIES):
            for _ in range(check_trials):
                ev, host, launched = run()
                synced_ms.append(ev)
                host_ms.append(host)
                launch_s.append(launched)
            if not _gap(host_ms, synced_ms):
                break
        # Timed trials: the GPU is kept busy (flush, then a sleep longer than the host's launch work), so the
        # events measure the kernels and the gaps between them on the device, not the Python that issued them.
        cover = 2 * statistics.median(launch_s) + 20e-6
        cycles = int(cover * _MAX_CLOCK_HZ)
        n = int(max(10, min(trials, budget_s / (statistics.median(host_ms) * 1e-3 + cover + 1e-4))))
        event_ms = [run(lambda: torch.cuda._sleep(cycles))[0] for _ in range(n)]
    t = summarize(event_ms, host_ms, synced_ms, checked=checked if check is not None else 0)
    return dataclasses.replace(t, seconds={k: round(v, 4) for k, v in parts.items()})


MIN_CHECKS = 5  # the synchronised calls are always checked, whatever the sampled fraction


def summarize(
    event_ms: list[float],
    host_ms: list[float] | None = None,
    synced_ms: list[float] | None = None,
    checked: int = 0,
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
        checked_calls=checked,
        fresh_inputs=True,
    )


def _gap(host_ms: list[float], synced_ms: list[float]) -> bool:
    host, events = statistics.median(host_ms), statistics.median(synced_ms)
    return host > HIDDEN_WORK_RATIO * events + HIDDEN_WORK_SLACK_MS


def hidden_work(t: Timing) -> str | None:
    """A reason string when the host saw much more time than the events on the current stream did."""
    if t.host_median_ms is None or t.synced_median_ms is None:
        return None
    if _gap([t.host_median_ms], [t.synced_median_ms]):
        return (
            f"hidden_work: host time {t.host_median_ms:.3f} ms against {t.synced_median_ms:.3f} ms of events on the "
            "current stream: work on another stream or after return (or another process time-slicing this GPU)"
        )
    return None
