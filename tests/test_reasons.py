"""The registry of reason codes: reading a reason's code, the status each code carries, notes."""

from __future__ import annotations

import pytest

from pipeline import reasons
from pipeline.static_check import CODES as STATIC_CODES
from pipeline.types import Status


@pytest.mark.parametrize(
    ("reason", "code", "status"),
    [
        ("mismatch: 3 of 9 elements outside (trial 0, first run)", "mismatch", Status.MISMATCH),
        ("static:try_except: line 4: a try statement", "static:try_except", Status.REJECTED),
        (
            "static:no_model_new: the launcher defines no class ModelNew",
            "static:no_model_new",
            Status.REJECTED,
        ),
        ("out_of_memory: out of GPU memory: CUDA out of memory", "out_of_memory", Status.LAUNCH_ERROR),
        ("launch_error: forward raised RuntimeError: out of GPU memory", "launch_error", Status.LAUNCH_ERROR),
        ("too_fast: 0.01 ms is below the roofline floor of 0.05 ms", "too_fast", Status.SUSPICIOUS),
        ("crash: worker killed by SIGSEGV while running the job", "crash", Status.CRASH),
        ("note: energy not measured: no NVML", "note", None),
        ("replay: this candidate is not in the recording", "replay", Status.REJECTED),
        ("no colon at all", "no colon at all", None),
    ],
)
def test_code_and_status_of_a_reason(reason, code, status):
    assert reasons.code_of(reason) == code
    assert reasons.status_of(code) == status


def test_every_status_but_ok_has_a_code_and_every_code_names_a_status_or_is_a_note():
    carried = {c.status for c in reasons.CODES.values()}
    assert carried == {*Status, None} - {Status.OK}
    assert [c.name for c in reasons.CODES.values() if c.status is None] == [reasons.NOTE]
    assert all(code == c.name and c.what for code, c in reasons.CODES.items())


def test_the_anti_cheat_checks_by_status():
    assert reasons.checks(Status.SUSPICIOUS) == (reasons.TOO_FAST,)
    assert reasons.MISMATCH in reasons.checks(Status.MISMATCH)
    assert reasons.INPUT_MUTATED in reasons.checks(Status.REJECTED)
    assert reasons.REPLAY not in reasons.checks(Status.REJECTED)  # a harness outcome, not a check
    assert not {f"static:{c}" for c in STATIC_CODES} & set(reasons.CODES)  # those come from static_check


def test_notes():
    assert reasons.is_note("note: x") and not reasons.is_note("notes: x")
    assert reasons.as_note("energy not measured") == "note: energy not measured"
    assert reasons.as_note("note: baseline compile failed") == "note: baseline compile failed"
