"""Profiling on the GPU: ncu counters, SASS and the system profile gathered for a verified candidate, then
stage 1 and the tools. Status and content assertions only."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline import stages
from pipeline.config import load
from pipeline.profile.advice import advice_block, analyze
from pipeline.profile.roofline import Bound
from pipeline.profile.target import CUDA_UP_FILE

_torch = pytest.importorskip("torch")
# Every test here needs a CUDA device: on a machine without one, `make test-gpu` skips them and says why.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _torch.cuda.is_available(), reason="no CUDA device visible"),
]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cfg = load(home=tmp_path_factory.mktemp("prof-home"), baselines=("eager",), energy=False)
    with stages.open_pool(cfg) as p:
        yield cfg, p


def test_profile_softmax_example(pool):
    cfg, p = pool
    pr = stages.profile_candidate(
        ROOT / "tasks" / "softmax.py", ROOT / "examples" / "candidates" / "softmax", cfg, pool=p
    )
    assert pr.evidence is not None, pr.notes
    ev = pr.evidence
    assert ev.our_counters, pr.notes  # ncu saw our kernel
    assert ev.dominant().get("dram__bytes_read.sum") >= 0.9 * 16384 * 4096 * 4
    assert ev.sass and any(s.count("LDG") for s in ev.sass.values())
    assert ev.system and ev.system["kernels_per_call"] >= 1
    cls, findings = analyze(ev)
    assert cls.bound == Bound.MEMORY
    assert all(f.severity < 0.5 for f in findings), findings  # a kernel at ~94% of its floor: no alarms
    assert advice_block(cls, findings).startswith("Bottleneck: memory-bound")


def test_profile_refuses_an_unverified_candidate(pool, tmp_path):
    cfg, p = pool
    bad = tmp_path / "bad"
    bad.mkdir()
    src = ROOT / "tests" / "adversarial" / "partial_write"
    for f in ("kernel.cu", "launcher.py"):
        (bad / f).write_text((src / f).read_text())
    pr = stages.profile_candidate(ROOT / "tasks" / "elementwise_chain.py", bad, cfg, pool=p)
    assert pr.evidence is None and "not profiled" in pr.notes[0]


def test_a_profile_started_ahead_reads_the_same_counters(pool):
    """The search's profiles: the first starts ncu's target for the second (pipeline/profile/warm.py), which
    then takes its job, task and candidate included, and reads the same kernels."""
    from pipeline.profile import warm

    cfg, p = pool
    cfg = cfg.replace(ncu_cuda_ahead=True)
    task, cand = ROOT / "tasks" / "softmax.py", ROOT / "examples" / "candidates" / "softmax"
    try:
        cold = stages.profile_candidate(task, cand, cfg, pool=p, warm_next=True)
        assert warm._waiting is not None and warm._waiting.proc.poll() is None
        # it brings CUDA up once its imports are done and no profile holds the counters
        deadline = time.monotonic() + 120
        while not (warm._waiting.scratch / CUDA_UP_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        hot = stages.profile_candidate(task, cand, cfg, pool=p, warm_next=True)
        assert cold.evidence is not None and hot.evidence is not None, (cold.notes, hot.notes)
        assert any("started ahead" in n for n in hot.notes) and not any(
            "started ahead" in n for n in cold.notes
        )
        assert any("CUDA up before its job" in n for n in hot.notes), hot.notes
        names = lambda pr: sorted(k.name for k in pr.evidence.our_counters)  # noqa: E731
        assert names(hot) == names(cold) and names(hot)
        assert hot.evidence.dominant().get("dram__bytes_read.sum") >= 0.9 * 16384 * 4096 * 4
        # Both say where their ncu seconds went, from the target's marks; the parts add up to the whole.
        for pr in (cold, hot):
            parts = {k: v for k, v in pr.seconds.items() if k.startswith("ncu_")}
            assert set(parts) == {
                f"ncu_{k}" for k in ("start", "setup", "candidate", "warmup", "replay", "exit")
            }
            assert abs(sum(parts.values()) - pr.seconds["ncu"]) < 0.05 * pr.seconds["ncu"] + 0.05
        assert hot.seconds["ncu_start"] < cold.seconds["ncu_start"]  # the waiting target had imported all
    finally:
        warm.stop()
