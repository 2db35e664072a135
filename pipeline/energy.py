"""Energy per call from NVML's total-energy counter.

The counter updates about every 100 ms on the H200, so a single launch reads as zero: loop the call for a
window of seconds, read the counter before and after, divide by the count, and take the median of repeats.
Windows are repeated (`repeat_windows`, pure: a CPU test drives it with made-up readings) until the
relative standard error of the energy per call over them is at most a target, between a minimum and a
maximum number of windows; that spread travels with the figure (Energy.spread) so the search can refuse
to rank two energies the noise cannot tell apart (pipeline/search/matched.py).

Like the timed calls, the loop's results must be honest: each window cycles over input sets made fresh for
it, the outputs of a sample of calls (the first on each set, then random ones) are checked against the
reference after the window, and the loop's wall time per call must agree with the timed median: a candidate
that recognises repeated inputs and skips the work runs the loop far faster than it was timed.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipeline.types import Energy

LOOP_SPEED_FLOOR = 0.3  # loop calls faster than this fraction of the timed median did not do the work
RANDOM_CHECKS = 4  # checked calls per window beyond the first call on each input set
MAX_SETS = 32


class EnergyUnavailable(Exception):
    pass


def nvml_handle(device: torch.device):
    import pynvml

    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except pynvml.NVMLError as e:
        raise EnergyUnavailable(f"NVML: {e}") from None


class LoopMismatch(Exception):
    """The loop's results or speed betray work not done; the message starts with a reason code."""


@dataclass(frozen=True)
class Window:
    """One NVML window: the loop's energy per call, its average power and its length."""

    joules_per_call: float
    watts: float
    seconds: float


def relative_spread(joules: Sequence[float]) -> float | None:
    """stdev / sqrt(n) / mean: the relative standard error of the energy per call over the windows. It
    shrinks as windows are added (a range would only grow), and one outlying window raises it. None
    under two windows; inf for a mean that is not positive (no usable reading)."""
    if len(joules) < 2:
        return None
    mean = statistics.fmean(joules)
    if not mean > 0:
        return math.inf
    return statistics.stdev(joules) / math.sqrt(len(joules)) / mean


def repeat_windows(
    read: Callable[[int], Window], *, min_repeats: int, max_repeats: int, target_spread: float
) -> list[Window]:
    """`read(i)` for i = 0, 1, ...: at least min_repeats windows, then more until their spread is known
    and at most target_spread, at most max(min_repeats, max_repeats) in all (the budget). Whatever `read`
    raises goes through: a loop caught skipping work stops the measurement."""
    low = max(1, min_repeats)
    high = max(low, max_repeats)
    windows: list[Window] = []
    while len(windows) < high:
        windows.append(read(len(windows)))
        if len(windows) >= low:
            spread = relative_spread([w.joules_per_call for w in windows])
            if spread is not None and spread <= target_spread:
                break
    return windows


def energy_record(windows: Sequence[Window], calls_per_window: int, checked: int = 0) -> Energy:
    """The Energy of a measurement: medians over the windows (one odd window does not move them), the
    spread of the energy per call, every window's reading."""
    joules = [w.joules_per_call for w in windows]
    seconds = statistics.median(w.seconds for w in windows)
    return Energy(
        joules_per_call=statistics.median(joules),
        avg_power_w=statistics.median(w.watts for w in windows),
        window_s=seconds,
        repeats=len(windows),
        checked_calls=checked,
        ms_per_call=seconds * 1e3 / max(1, calls_per_window),
        spread=relative_spread(joules),
        windows=tuple(joules),
    )


def calls_per_window(window_s: float, call_ms: float, loop_ms: float | None = None) -> int:
    """Calls that fill a window of window_s seconds. A call's GPU time (call_ms) is not its loop's pace
    when the host launches slower than the GPU runs (a cat of 13 pieces: 0.014 ms on the GPU, 0.17 ms a
    call in the loop); loop_ms, the wall time a call took while warming up, then sets the count, or the
    windows would last ten times the intended seconds."""
    pace = max(call_ms, loop_ms or 0.0, 1e-3)
    return max(1, math.ceil(window_s * 1e3 / pace))


def kept_calls(n: int, sets: int, out_bytes: int, free_bytes: int, pick: random.Random) -> set[int]:
    """The calls of a window whose outputs are kept for the check: the first call on each input set and
    RANDOM_CHECKS random ones, as many as a tenth of free memory holds (two at least). Kept outputs stay
    alive until the window ends, so an output size of 0 (unknown) keeps the fewest."""
    room = max(2, int(0.1 * free_bytes / out_bytes)) if out_bytes > 0 else 2
    keep = set(range(min(sets, n, room - 1))) | {pick.randrange(n)}
    keep |= {pick.randrange(n) for _ in range(min(RANDOM_CHECKS, room - len(keep)))}
    return keep


def measure_energy(
    fn: Callable[..., object],
    inputs_for: Callable[[int], list],
    *,
    call_ms: float,
    window_s: float,
    repeats: int,
    max_repeats: int | None = None,
    target_spread: float = 0.01,
    check: Callable[[list, object], None] | None = None,
    set_bytes: int = 0,
    out_bytes: int = 0,
    free_bytes: int = 1 << 40,
) -> Energy:
    """Joules per call over `repeats` to `max_repeats` windows (until the spread is at most `target_spread`,
    see repeat_windows). `check(inputs, outputs)` raises for a wrong output; a loop faster than
    LOOP_SPEED_FLOOR of `call_ms` raises LoopMismatch. Without a check no output outlives its call (eager's
    baseline: ten kept 8 GB outputs were an out-of-memory error)."""
    import pynvml

    device = torch.device("cuda", torch.cuda.current_device())
    handle = nvml_handle(device)
    n = calls_per_window(window_s, call_ms)
    with torch.no_grad():
        warm = inputs_for(90_000)
        torch.cuda.synchronize()
        t0, warm_calls = time.perf_counter(), max(1, min(n // 10, 1000))
        for _ in range(warm_calls):  # warm the clocks up before the first window, and time the loop's pace
            fn(*warm)
        torch.cuda.synchronize()
        n = calls_per_window(window_s, call_ms, (time.perf_counter() - t0) * 1e3 / warm_calls)
        del warm
    # Enough sets that consecutive calls do not find each other's data in L2, as few as memory allows.
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 << 20)
    sets = max(2, min(MAX_SETS, n, math.ceil(3 * l2 / max(set_bytes, 1))))
    sets = max(1, min(sets, int(0.2 * free_bytes / max(set_bytes, 1))))
    pick = random.Random()
    checked = 0

    def window(w: int) -> Window:
        nonlocal checked
        data = [inputs_for(100_000 + w * MAX_SETS + k) for k in range(sets)]
        keep = kept_calls(n, sets, out_bytes, free_bytes, pick) if check is not None else set()
        kept: list[tuple[int, object]] = []
        torch.cuda.synchronize()
        try:
            e0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except pynvml.NVMLError as e:
            raise EnergyUnavailable(f"NVML energy counter: {e}") from None
        t0 = time.perf_counter()
        for i in range(n):
            out = fn(*data[i % sets])
            if i in keep:
                kept.append((i % sets, out))
            del out  # its memory is the next call's (stream-ordered reuse), unless it is kept
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        de = (pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) - e0) / 1e3  # mJ -> J
        if check is not None:
            for k, out in kept:
                check(data[k], out)
                checked += 1
        del kept, data
        per_call_ms = dt * 1e3 / n
        if per_call_ms < LOOP_SPEED_FLOOR * call_ms:
            raise LoopMismatch(
                f"energy_loop_faster: the energy loop ran {per_call_ms:.4f} ms per call against a timed "
                f"median of {call_ms:.4f} ms: the loop did not do the work it was timed doing"
            )
        return Window(de / n, de / dt if dt > 0 else 0.0, dt)

    with torch.no_grad():
        windows = repeat_windows(
            window,
            min_repeats=repeats,
            max_repeats=repeats if max_repeats is None else max_repeats,
            target_spread=target_spread,
        )
    return energy_record(windows, n, checked)
