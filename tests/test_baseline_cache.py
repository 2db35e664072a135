"""The baseline cache (pipeline/baseline_cache.py): what its key depends on, a round trip with the note a
hit carries, and entries it must not trust. The GPU side (a second run reusing the first's baselines) is in
tests/test_gpu_harness.py."""

from __future__ import annotations

import dataclasses

from pipeline import baseline_cache, jobs
from pipeline.config import load
from pipeline.types import Baselines, Task, TensorSpec, Timing

SPEC = (TensorSpec((8, 8), "float32"),)
TASK = Task(
    "softmax", "/t/softmax.py", "src", "abc123", "float32", 1e-4, 1e-3, 1e-4, SPEC, SPEC, "[]", 0.0, 512, 0
)
ENV = {"gpu": "NVIDIA H200", "sm_count": "132", "capability": "9.0", "driver": "580.159.04", "torch": "2.11.0",
       "cuda_runtime": "13.0", "python": "3.12.3", "sm_clock_mhz": "1980", "mem_clock_mhz": "3201"}  # fmt: skip
BASE = Baselines(
    timings={
        "eager": Timing(0.21, 0.2, 0.22, 0.2, 0.3, 100),
        "compile": Timing(0.17, 0.16, 0.18, 0.16, 0.2, 100),
    },
    energy_eager_j=0.1,
    compile_s={"compile": 6.9},
    environment=ENV,
    notes=("eager ran once",),
)


def settings(**kw):
    return jobs.Settings.of(load(**kw))


def test_the_key_follows_the_source_the_settings_and_the_software_not_the_clocks():
    k = baseline_cache.key(TASK, settings(), ENV)
    assert k == baseline_cache.key(TASK, settings(), {**ENV, "sm_clock_mhz": "1500", "mem_clock_mhz": "2600"})
    assert k != baseline_cache.key(dataclasses.replace(TASK, source_hash="abc124"), settings(), ENV)
    assert k != baseline_cache.key(TASK, settings(energy=False), ENV)
    assert k != baseline_cache.key(TASK, settings(baselines=("eager",)), ENV)
    assert k != baseline_cache.key(TASK, settings(l2_flush="writes"), ENV)  # how L2 was emptied moves a time
    assert k != baseline_cache.key(TASK, settings(), {**ENV, "driver": "590.1"})
    assert k != baseline_cache.key(TASK, settings(), {**ENV, "torch": "2.13.0"})
    assert k != baseline_cache.key(TASK, settings(), {**ENV, "gpu": "NVIDIA H100 80GB HBM3"})


def test_a_hit_gives_the_saved_baselines_with_a_note_saying_when(tmp_path):
    k = baseline_cache.key(TASK, settings(), ENV)
    assert baseline_cache.load(tmp_path, k) is None
    p = baseline_cache.save(tmp_path, k, BASE)
    assert p.parent == tmp_path / "baselines" / "cache" and not list(p.parent.glob("*.tmp"))
    hit = baseline_cache.load(tmp_path, k)
    assert hit is not None and hit.timings == BASE.timings and hit.energy_eager_j == 0.1
    assert hit.compile_s == {"compile": 6.9} and hit.environment == ENV
    assert hit.notes[0] == "eager ran once" and hit.notes[1].startswith(
        "baselines from the cache, measured 20"
    )


def test_an_unreadable_entry_is_a_miss(tmp_path):
    k = baseline_cache.key(TASK, settings(), ENV)
    p = baseline_cache.save(tmp_path, k, BASE)
    for text in (
        "{cut short",
        '{"measured": "2026-12-02"}',
        '{"measured": "x", "baselines": {"timings": 3}}',
    ):
        p.write_text(text)
        assert baseline_cache.load(tmp_path, k) is None, text
