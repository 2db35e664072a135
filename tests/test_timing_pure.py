"""Pure parts of timing and the roofline floor: summaries, the hidden-work rule, floors, type round trips."""

from __future__ import annotations

import pytest

from pipeline.calibrate import Ceilings, floor_ms
from pipeline.timing import hidden_work, summarize
from pipeline.types import Measurement, Status, Task, TensorSpec, Timing, from_dict, to_dict


def test_summarize_median_and_quartiles():
    t = summarize([5.0, 1.0, 2.0, 3.0, 4.0], host_ms=[9.0, 9.0, 10.0], synced_ms=[8.0, 8.0, 8.0])
    assert t.median_ms == 3.0 and t.min_ms == 1.0 and t.max_ms == 5.0 and t.trials == 5
    assert t.q1_ms < t.median_ms < t.q3_ms
    assert t.host_median_ms == 9.0 and t.synced_median_ms == 8.0


def test_hidden_work_rule():
    honest = Timing(1.0, 0.9, 1.1, 0.9, 1.2, 50, host_median_ms=1.1, synced_median_ms=1.05)
    launch_bound = Timing(0.2, 0.2, 0.2, 0.2, 0.2, 50, host_median_ms=1.05, synced_median_ms=1.0)
    side_stream = Timing(1.0, 0.9, 1.1, 0.9, 1.2, 50, host_median_ms=4.0, synced_median_ms=1.0)
    assert hidden_work(honest) is None
    assert hidden_work(launch_bound) is None  # launch gaps are in the synchronised events too
    reason = hidden_work(side_stream)
    assert reason is not None and reason.startswith("hidden_work")


CEIL = Ceilings(
    "gpu", copy_bytes_per_s=4e12, fp32_flops=50e12, tf32_flops=400e12, bf16_flops=780e12, environment={}
)


def task(dtype: str, flops: float, nbytes: int) -> Task:
    spec = (TensorSpec((4,), dtype),)
    return Task("t", "/t.py", "", "h", dtype, 1e-4, 1e-3, 1e-4, spec, spec, "[]", flops, nbytes, 0)


def test_floor_memory_bound():
    assert floor_ms(task("float32", 0.0, 4_000_000_000), CEIL) == pytest.approx(1.0)


def test_floor_compute_bound_uses_the_fastest_honest_rate():
    assert floor_ms(task("bfloat16", 780e9, 1000), CEIL) == pytest.approx(1.0)
    assert floor_ms(task("float32", 400e9, 1000), CEIL) == pytest.approx(1.0)  # 3xTF32 reaches fp32 accuracy


def test_measurement_round_trip_and_derived_numbers():
    t = Timing(2.0, 1.9, 2.1, 1.8, 2.5, 40, 2.2, 2.1)
    m = Measurement("k", Status.OK, timing=t, baselines={"eager": Timing(6.0, 6, 6, 6, 6, 10)}, floor_ms=1.0)
    back = from_dict(Measurement, to_dict(m))
    assert back == m
    assert back.speedup_eager == pytest.approx(3.0) and back.speedup_compile is None
    assert back.fraction_of_floor == pytest.approx(0.5)
    assert t.spread == pytest.approx(0.1)
