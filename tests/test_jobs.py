"""The worker pipe's messages: every job and answer kind through the one encode/decode pair, and what a
message that does not decode becomes."""

from __future__ import annotations

import json

import pytest

from pipeline import jobs, stages
from pipeline.calibrate import Ceilings
from pipeline.config import Config
from pipeline.types import (
    Baselines,
    Energy,
    Kind,
    Measurement,
    Status,
    Task,
    TensorSpec,
    Timing,
    Verdict,
)

T = Timing(0.5, 0.49, 0.52, 0.48, 0.7, 100, host_median_ms=0.6, checked_calls=100, fresh_inputs=True)
TASK = Task("softmax", "tasks/softmax.py", "src", "ab12", "float32", 1e-4, 1e-3, 1e-4,
            (TensorSpec((4, 8), "float32"),), (TensorSpec((4, 8), "float32"),), "[]", 0.0, 256, 0)  # fmt: skip
CODE = jobs.CandidateCode("k1", "launcher", "/c/k1.cubin", ("a", "b"), Kind.HYBRID, ("aten::mm",))
CEIL = Ceilings("NVIDIA H200", 4.3e12, 5.1e13, 3.7e14, 7.2e14, {"driver": "580"})
VERDICT = Verdict(
    "k1", Status.SUSPICIOUS, 3, 3, 1e-6, 1e-7, Kind.HYBRID, ("aten::mm",), ("too_fast: x",), 2e-7
)
MEASURED = Measurement("k1", Status.SUSPICIOUS, T, {"eager": T}, Energy(0.01, 300.0, 1.5, 3), 0.1)

MESSAGES = [
    jobs.Ping(),
    jobs.Probe("/t/softmax.py"),
    jobs.Environment("cpu"),
    jobs.Calibrate(),
    jobs.Evaluate(TASK, CODE, jobs.Settings(device="cpu", trials=1, baselines=("eager",)), CEIL),
    jobs.Evaluate(TASK, jobs.CandidateCode("s", "launcher"), jobs.Settings(time=False)),
    jobs.Baseline(TASK, jobs.Settings(energy=False)),
    jobs.SystemProfile(TASK, jobs.Settings(seed=3), CODE),
    jobs.Ncu("/t/softmax.py", 7, None, sandbox='{"layers": []}'),
    jobs.Pong(loaded_modules=3, sandbox={"seccomp": "applied"}),
    jobs.Probed(task=TASK),
    jobs.EnvironmentAnswer(environment={"gpu": "NVIDIA H200"}),
    jobs.Calibrated(ceilings=CEIL),
    jobs.Evaluated(verdict=VERDICT, measurement=MEASURED, exit=True, loaded_modules=1),
    jobs.Evaluated(verdict=Verdict("k2", Status.COMPILE_ERROR)),
    jobs.BaselinesAnswer(
        baselines=Baselines({"eager": T, "compile": T}, 0.2, None, {"compile": 40.0}, {}, ("n",))
    ),
    jobs.SystemProfiled(system={"kernels_per_call": 2, "gaps_us": [1.5, 2.0]}),
    jobs.Failed(error="TaskError: x", traceback="...", task_error=True),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_kind_round_trips_through_json(message):
    raw = jobs.encode(message)
    assert json.loads(raw)["kind"] == message.KIND  # the discriminator on the wire
    assert jobs.decode(raw) == message


def test_kinds_are_distinct_and_every_message_type_is_tried():
    kinds = [type(m).KIND for m in MESSAGES]
    assert len(set(kinds)) == len({type(m) for m in MESSAGES}) == len(jobs._MESSAGES) and "" not in kinds
    assert {jobs.Ping, jobs.Probe, jobs.Environment, jobs.Calibrate, jobs.Baseline} == jobs.TRUSTED


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"kind": "nonsense"}', "unknown job kind 'nonsense'"),
        (b'{"path": "/t.py"}', "unknown job kind None"),
        (b'{"kind": "probe"}', "a malformed probe message"),  # its path is missing
        (
            b'{"kind": "evaluated", "verdict": {"candidate_key": "k", "status": "great"}}',
            "malformed evaluated",
        ),
        (b'{"kind": "probed", "task": "softmax"}', "malformed probed"),
    ],
)
def test_what_does_not_decode_is_a_job_format_error(raw, why):
    with pytest.raises(jobs.JobFormatError, match=why):
        jobs.decode(raw)


def test_settings_carry_the_configs_fields():
    cfg = Config(device="cpu", trials=5, seed=9, energy=False, baselines=("eager",))
    s = stages.settings(cfg, time=False)
    assert (s.device, s.trials, s.seed, s.energy, s.baselines, s.time) == (
        "cpu",
        5,
        9,
        False,
        ("eager",),
        False,
    )
    assert jobs.Settings() == stages.settings(Config())  # the defaults are the config's
