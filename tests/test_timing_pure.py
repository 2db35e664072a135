"""Pure parts of timing, energy and the roofline floor: summaries, the hidden-work rule, the energy windows'
repeat rule over injected readings, floors, type round trips."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import pytest

from pipeline import calibrate
from pipeline.calibrate import Ceilings, floor_ms
from pipeline.energy import LoopMismatch, Window, energy_record, relative_spread, repeat_windows
from pipeline.timing import L2Flusher, hidden_work, summarize
from pipeline.types import Energy, Measurement, Status, Task, TensorSpec, Timing, from_dict, to_dict


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


def test_ceilings_cached_by_an_older_measurement_are_measured_again(tmp_path):
    fresh = Ceilings("NVIDIA H200", 4.4e12, 5.1e13, 3.9e14, 7.9e14, {}, version=calibrate.VERSION)
    path = calibrate.save(tmp_path, fresh)
    assert calibrate.load_cached(tmp_path, "NVIDIA H200") == fresh
    # A cache of version 1 (the cold single memcpy that read 3.8 TB/s) carries no version field.
    old = {k: v for k, v in fresh.__dict__.items() if k != "version"} | {"copy_bytes_per_s": 3.8e12}
    path.write_text(json.dumps(old))
    assert calibrate.load_cached(tmp_path, "NVIDIA H200") is None
    path.write_text("{not json")
    assert calibrate.load_cached(tmp_path, "NVIDIA H200") is None


def test_a_calibration_on_a_busy_gpu_is_not_believed(tmp_path):
    """Another process's work during the measurement (NVML's utilization while ours sat idle) makes every
    ceiling read low and every floor high: such ceilings are refused, with the reason; a cache and a run
    log written before the field existed still load."""
    fresh = Ceilings("NVIDIA H100", 4.3e12, 5.1e13, 3.7e14, 7.2e14, {}, version=calibrate.VERSION)
    assert calibrate.untrusted(fresh) is None  # NVML not read: nothing to hold against it
    assert calibrate.untrusted(dataclasses.replace(fresh, busy_percent=2.0)) is None
    why = calibrate.untrusted(dataclasses.replace(fresh, busy_percent=63.0))
    assert why is not None and "63% busy" in why and "kernelpro calibrate" in why
    path = calibrate.save(tmp_path, dataclasses.replace(fresh, busy_percent=0.0))
    assert calibrate.load_cached(tmp_path, "NVIDIA H100").busy_percent == 0.0
    path.write_text(json.dumps({k: v for k, v in fresh.__dict__.items() if k != "busy_percent"}))
    assert calibrate.load_cached(tmp_path, "NVIDIA H100") == fresh
    assert from_dict(Ceilings, to_dict(dataclasses.replace(fresh, busy_percent=1.0))).busy_percent == 1.0


def test_a_measurements_phases_add_up_and_survive_the_round_trip():
    from pipeline.measure import Outcome

    out = Outcome()
    for _ in range(2):
        with out.phase("timing"):
            pass
    with pytest.raises(RuntimeError), out.phase("eager"):
        raise RuntimeError("a phase that fails still counts its time")
    assert set(out.seconds) == {"timing", "eager"} and all(v >= 0 for v in out.seconds.values())
    m = Measurement("k", Status.OK, seconds={"verify": 0.5, **out.seconds})
    assert from_dict(Measurement, to_dict(m)) == m
    assert from_dict(Measurement, {"candidate_key": "k", "status": "ok"}).seconds == {}  # older logs


def test_measurement_round_trip_and_derived_numbers():
    t = Timing(2.0, 1.9, 2.1, 1.8, 2.5, 40, 2.2, 2.1)
    m = Measurement("k", Status.OK, timing=t, baselines={"eager": Timing(6.0, 6, 6, 6, 6, 10)}, floor_ms=1.0)
    back = from_dict(Measurement, to_dict(m))
    assert back == m
    assert back.speedup_eager == pytest.approx(3.0) and back.speedup_compile is None
    assert back.fraction_of_floor == pytest.approx(0.5)
    assert t.spread == pytest.approx(0.1)


# -- energy windows (pipeline/energy.py): the repeat rule over injected readings ---------------------------


def readings(joules: list[float]):
    """A reading callable over fixed energies per call, and the list of windows it was asked for."""
    asked: list[int] = []

    def read(i: int) -> Window:
        asked.append(i)
        return Window(joules[i], 500.0 + i, 1.5)

    return read, asked


def test_windows_stop_once_the_spread_is_under_the_bound():
    read, asked = readings([1.0, 1.0, 1.0, 9.0])
    assert len(repeat_windows(read, min_repeats=3, max_repeats=8, target_spread=0.01)) == 3
    assert asked == [0, 1, 2]  # steady from the start: no window beyond the minimum
    # Noisy first, then steady: it stops at the first count whose spread is within the bound.
    js = [1.10, 0.90, 1.05, 0.97, 1.0, 1.0, 1.01, 0.99, 1.0, 1.0, 1.0, 1.0]
    target = 0.02
    want = next(k for k in range(3, len(js) + 1) if (relative_spread(js[:k]) or 1) <= target)
    read, asked = readings(js)
    got = repeat_windows(read, min_repeats=3, max_repeats=12, target_spread=target)
    assert 3 < len(got) == want < 12 and relative_spread([w.joules_per_call for w in got]) <= target  # type: ignore[operator]
    assert relative_spread(js[: want - 1]) > target  # type: ignore[operator]


def test_windows_stop_at_the_budget_and_need_two_for_a_spread():
    read, asked = readings([1.0, 1.5] * 10)
    assert len(repeat_windows(read, min_repeats=3, max_repeats=6, target_spread=0.01)) == 6 == len(asked)
    read, asked = readings([1.0, 1.0, 1.0])
    assert (
        len(repeat_windows(read, min_repeats=1, max_repeats=5, target_spread=0.01)) == 2
    )  # one has no spread
    read, asked = readings([1.0])
    assert len(repeat_windows(read, min_repeats=1, max_repeats=1, target_spread=0.01)) == 1
    read, asked = readings([1.0, 1.5] * 3)
    assert len(repeat_windows(read, min_repeats=4, max_repeats=2, target_spread=0.01)) == 4  # max < min: min


def test_a_window_that_raises_stops_the_measurement():
    def read(i: int) -> Window:
        if i == 1:
            raise LoopMismatch("energy_loop_faster: test")
        return Window(1.0, 500.0, 1.5)

    with pytest.raises(LoopMismatch):
        repeat_windows(read, min_repeats=3, max_repeats=8, target_spread=0.01)


def test_relative_spread_and_the_energy_record():
    assert relative_spread([1.0]) is None and relative_spread([]) is None
    assert relative_spread([0.0, 0.0]) == math.inf
    assert relative_spread([1.0, 1.0]) == 0.0
    assert relative_spread([0.9, 1.1]) == pytest.approx(statistics.stdev([0.9, 1.1]) / math.sqrt(2))
    windows = [Window(0.10, 700.0, 1.50), Window(0.12, 690.0, 1.52), Window(0.11, 710.0, 1.49)]
    e = energy_record(windows, calls_per_window=1000, checked=7)
    assert e.joules_per_call == 0.11 and e.avg_power_w == 700.0 and e.window_s == 1.50 and e.repeats == 3
    assert e.ms_per_call == pytest.approx(1.5) and e.checked_calls == 7 and e.windows == (0.10, 0.12, 0.11)
    assert e.spread == pytest.approx(relative_spread([0.10, 0.12, 0.11]))
    # Through a measurement and back; a record written before spreads were kept still loads (spread None).
    m = Measurement("k", Status.OK, timing=Timing(1.0, 1, 1, 1, 1, 10), energy=e)
    assert from_dict(Measurement, to_dict(m)) == m
    old = {"joules_per_call": 0.1, "avg_power_w": 700.0, "window_s": 1.5, "repeats": 3}
    assert from_dict(Energy, old).spread is None and from_dict(Energy, old).windows == ()


def test_recorded_run_logs_still_load():
    from pathlib import Path

    from pipeline.runlog import read_events
    from pipeline.runstate import fold

    fixtures = Path(__file__).parent / "fixtures"
    # a log recorded before eager's energy and the energies' spreads were logged: they load as unknown
    state = fold(read_events(fixtures / "legacy" / "softmax-2026-11-30" / "log.jsonl"))
    assert state.baselines is not None and state.baselines.energy_eager is None
    assert state.final is not None and state.final.evaluation.measurement.energy.spread is None  # type: ignore[union-attr]
    assert len(state.at_speed()) == sum(p.status == Status.OK for p in state.points)
    for log in sorted((fixtures / "runs").glob("*/*/log.jsonl")):  # the replay recordings: newer, with both
        state = fold(read_events(log))
        assert state.baselines is not None and state.baselines.energy_eager is not None
        assert state.final is not None and state.final.evaluation.measurement.energy.spread is not None  # type: ignore[union-attr]
        assert len(state.at_speed()) == sum(p.status == Status.OK for p in state.points)


def test_measure_energy_follows_the_repeat_rule_with_a_fake_counter(monkeypatch):
    """The GPU path's glue on the CPU: NVML and CUDA replaced, the counter's deltas chosen per window."""
    import sys
    import time
    import types

    import torch

    from pipeline import energy

    deltas_mj = [100.0, 115.0, 100.0, 101.0, 100.0, 100.0, 99.0, 100.0]
    reads = iter(x for d in deltas_mj for x in (0.0, d))  # each window reads the counter before and after
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(
        NVMLError=RuntimeError, nvmlDeviceGetTotalEnergyConsumption=lambda h: next(reads)))  # fmt: skip
    monkeypatch.setattr(energy, "nvml_handle", lambda d: "handle")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(L2_cache_size=1 << 20)
    )

    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        time.sleep(1e-4)
        calls.append(1)
        return x * 2

    checked = []

    def check(inputs: list, out: object) -> None:
        assert torch.equal(out, inputs[0] * 2)  # type: ignore[arg-type]
        checked.append(1)

    e = energy.measure_energy(fn, lambda i: [torch.full((4,), float(i))], call_ms=0.1, window_s=0.01,
                              repeats=3, max_repeats=8, target_spread=0.025, check=check, set_bytes=16,
                              out_bytes=16)  # fmt: skip
    # calls per window: 10 ms at the loop's pace (0.1 ms of sleep and the call's overhead), after 10 warm-ups
    n = (len(calls) - 10) // e.repeats
    assert 10 <= n <= 100 and len(calls) == 10 + n * e.repeats
    js = [d / 1e3 / n for d in deltas_mj]
    want = next(k for k in range(3, 9) if (relative_spread(js[:k]) or 1) <= 0.025)
    assert 3 < e.repeats == want < 8 and e.windows == pytest.approx(js[:want])
    assert e.spread == pytest.approx(relative_spread(js[:want])) and e.checked_calls == len(checked) > 0
    # A loop that runs far faster than its timed median did not do the work: rejected, not averaged.
    reads = iter([0.0, 1.0] * 4)
    with pytest.raises(LoopMismatch):
        energy.measure_energy(fn, lambda i: [torch.zeros(4)], call_ms=50.0, window_s=0.01, repeats=2)


def test_a_window_counts_calls_at_the_loops_pace_not_the_gpus():
    """A call the host launches slower than the GPU runs it (a 13-piece cat: 0.014 ms on the GPU, 0.17 ms a
    call in the loop) would make each 1.5 s window last 18 s if sized by its GPU time."""
    from pipeline.energy import calls_per_window

    assert calls_per_window(1.5, 0.0136) == 110295  # GPU-bound: the timed median sets the pace
    assert calls_per_window(1.5, 0.0136, loop_ms=0.17) == 8824
    assert calls_per_window(1.5, 2.0, loop_ms=0.17) == 750  # a loop faster than the median: the median
    assert calls_per_window(1e-6, 5.0) == 1 and calls_per_window(1.0, 0.0) == 1_000_000


def test_kept_calls_are_bounded_by_memory_and_by_what_is_checked():
    import random

    from pipeline.energy import RANDOM_CHECKS, kept_calls

    pick = random.Random(3)
    roomy = kept_calls(n=1000, sets=4, out_bytes=1 << 20, free_bytes=1 << 40, pick=pick)
    assert {0, 1, 2, 3} <= roomy and len(roomy) <= 4 + 1 + RANDOM_CHECKS
    # An 8 GB output with 100 GB free: a tenth of free memory holds one, two are kept at least.
    assert len(kept_calls(1000, 4, 8 << 30, 100 << 30, pick)) <= 2
    assert len(kept_calls(1000, 4, 0, 100 << 30, pick)) <= 2  # size unknown: the fewest


def test_energy_without_a_check_keeps_no_output_past_its_call(monkeypatch):
    """Eager's baseline measures energy with no check: an output kept for nothing is memory the task's own
    calls need (ten kept 8 GB outputs ran the reference worker out of memory on KernelBench's L2Norm)."""
    import sys
    import types

    import torch

    from pipeline import energy

    reads = iter(float(x) for x in range(1000))
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(
        NVMLError=RuntimeError, nvmlDeviceGetTotalEnergyConsumption=lambda h: next(reads) * 100))  # fmt: skip
    monkeypatch.setattr(energy, "nvml_handle", lambda d: "handle")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(L2_cache_size=1 << 20)
    )
    live: list[int] = [0, 0]  # outputs alive now, the most alive at once

    class Out:
        def __init__(self) -> None:
            live[0] += 1
            live[1] = max(live[1], live[0])

        def __del__(self) -> None:
            live[0] -= 1

    def fn(x: torch.Tensor) -> Out:
        import time

        time.sleep(2e-5)
        return Out()

    energy.measure_energy(fn, lambda i: [torch.zeros(4)], call_ms=0.02, window_s=0.004, repeats=2,
                          set_bytes=16, out_bytes=16)  # fmt: skip
    assert live == [0, 1]
    checked = []
    energy.measure_energy(fn, lambda i: [torch.zeros(4)], call_ms=0.02, window_s=0.004, repeats=2,
                          check=lambda i, o: checked.append(o), set_bytes=16, out_bytes=16)  # fmt: skip
    assert live[1] > 2 and checked  # with a check, the checked calls' outputs live until the window ends


def test_an_unknown_flush_mode_is_refused_before_any_memory_is_taken():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="L2 flush mode 'dirty' is not one of clean, writes"):
        L2Flusher(torch.device("cpu"), "dirty")
