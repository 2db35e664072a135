"""System-level evidence from the PyTorch profiler (CUPTI), run in the worker: kernels per call, GPU busy
time against wall time, and the gaps between launches (Nsight Systems makes no reports on the H200 machine).
"""

from __future__ import annotations

import time
from typing import Any

import torch


def system_profile(model: Any, inputs: list, calls: int = 5, warmup: int = 2) -> dict[str, Any]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(warmup):
            model(*inputs)
        torch.cuda.synchronize()
        # Wall time without the profiler, whose own CPU overhead would make any candidate look host-bound.
        t0 = time.perf_counter()
        for _ in range(calls):
            model(*inputs)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                model(*inputs)
            torch.cuda.synchronize()
    spans: list[tuple[float, float]] = []
    names: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA:
            continue
        start, end = evt.time_range.start, evt.time_range.end
        spans.append((start, end))
        names.setdefault(evt.name, []).append(end - start)
    spans.sort()
    busy = 0.0
    cur_start, cur_end = None, None
    for s, e in spans:  # union of intervals: overlapping kernels count once
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        busy += cur_end - cur_start
    first, last = (spans[0][0], max(e for _, e in spans)) if spans else (0.0, 0.0)
    return {
        "calls": calls,
        "kernels_per_call": len(spans) / calls,
        "gpu_busy_us_per_call": busy / calls,
        "gpu_span_us_per_call": (last - first) / calls,
        "wall_us_per_call": wall_us / calls,
        "kernels": {
            n: {"count_per_call": len(d) / calls, "us_per_call": sum(d) / calls} for n, d in names.items()
        },
    }
