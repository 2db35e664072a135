"""Energy per call from NVML's total-energy counter.

The counter updates about every 100 ms on the H200, so a single launch reads as zero: loop the call for a
window of seconds, read the counter before and after, divide by the count, and take the median of repeats.

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
from collections.abc import Callable

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


def measure_energy(
    fn: Callable[..., object],
    inputs_for: Callable[[int], list],
    *,
    call_ms: float,
    window_s: float,
    repeats: int,
    check: Callable[[list, object], None] | None = None,
    set_bytes: int = 0,
    out_bytes: int = 0,
    free_bytes: int = 1 << 40,
) -> Energy:
    """Joules per call over `repeats` windows. `check(inputs, outputs)` raises for a wrong output; a loop
    faster than LOOP_SPEED_FLOOR of `call_ms` raises LoopMismatch."""
    import pynvml

    device = torch.device("cuda", torch.cuda.current_device())
    handle = nvml_handle(device)
    n = max(1, math.ceil(window_s * 1e3 / max(call_ms, 1e-3)))
    # Enough sets that consecutive calls do not find each other's data in L2, as few as memory allows.
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 << 20)
    sets = max(2, min(MAX_SETS, n, math.ceil(3 * l2 / max(set_bytes, 1))))
    sets = max(1, min(sets, int(0.2 * free_bytes / max(set_bytes, 1))))
    pick = random.Random()
    joules: list[float] = []
    watts: list[float] = []
    seconds: list[float] = []
    checked = 0
    with torch.no_grad():
        warm = inputs_for(90_000)
        for _ in range(max(1, min(n // 10, 1000))):  # warm the clocks up before the first window
            fn(*warm)
        del warm
        torch.cuda.synchronize()
        for w in range(repeats):
            data = [inputs_for(100_000 + w * MAX_SETS + k) for k in range(sets)]
            # Kept outputs stay alive until the window ends: as many as a tenth of free memory holds.
            room = max(2, int(0.1 * free_bytes / max(out_bytes, 1)))
            keep = set(range(min(sets, n, room - 1))) | {pick.randrange(n)}
            keep |= {pick.randrange(n) for _ in range(min(RANDOM_CHECKS, room - len(keep)))}
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
            joules.append(de / n)
            watts.append(de / dt if dt > 0 else 0.0)
            seconds.append(dt)
    return Energy(
        joules_per_call=statistics.median(joules),
        avg_power_w=statistics.median(watts),
        window_s=statistics.median(seconds),
        repeats=repeats,
        checked_calls=checked,
        ms_per_call=statistics.median(seconds) * 1e3 / n,
    )
