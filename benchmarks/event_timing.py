"""The variants scripts' timer: CUDA events around each call, after warm-ups, the median of `reps` (their
tensors are GBs, so L2 holds nothing of a call before the next and no flush is needed)."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def event_median_ms(fn: Callable[[], object], reps: int, warmups: int) -> float:
    import torch

    for _ in range(warmups):
        fn()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)
