"""Energy per call from NVML's total-energy counter.

The counter updates about every 100 ms on the H200, so a single launch reads as zero: loop the call for a
window of seconds, read the counter before and after, divide by the count, and take the median of repeats.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from pipeline.types import Energy


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


def measure_energy(
    fn: Callable[..., object], inputs: Sequence, *, call_ms: float, window_s: float, repeats: int
) -> Energy:
    import pynvml

    device = torch.device("cuda", torch.cuda.current_device())
    handle = nvml_handle(device)
    n = max(1, math.ceil(window_s * 1e3 / max(call_ms, 1e-3)))
    joules: list[float] = []
    watts: list[float] = []
    seconds: list[float] = []
    with torch.no_grad():
        for _ in range(max(1, n // 10)):  # warm the clocks up before the first window
            fn(*inputs)
        torch.cuda.synchronize()
        for _ in range(repeats):
            try:
                e0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            except pynvml.NVMLError as e:
                raise EnergyUnavailable(f"NVML energy counter: {e}") from None
            t0 = time.perf_counter()
            for _ in range(n):
                fn(*inputs)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            de = (pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) - e0) / 1e3  # mJ -> J
            joules.append(de / n)
            watts.append(de / dt if dt > 0 else 0.0)
            seconds.append(dt)
    return Energy(
        joules_per_call=statistics.median(joules),
        avg_power_w=statistics.median(watts),
        window_s=statistics.median(seconds),
        repeats=repeats,
    )
