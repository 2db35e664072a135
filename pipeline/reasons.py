"""Every reason code the harness gives, with the status it carries.

A reason is one line that starts with its code: `mismatch: output 0 ...`, `static:try_except: line 4 ...`.
Producers spell their codes through the constants here; classifiers (the worker's restart rule, the
self-check's causes, the adversarial suite) read them back with `code_of`, never by matching the text.
A `note` carries no status: it explains a result without failing it. The static check's own codes
(`static:<rule>`, pipeline.static_check.CODES) all carry REJECTED.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.types import Status


@dataclass(frozen=True)
class Code:
    name: str
    status: Status | None  # None: a note
    check: bool  # an anti-cheat check of verification or measurement (tests/adversarial name these)
    what: str


NOTE = "note"
STATIC = "static"  # the prefix of the static check's codes: static:<rule>
# Verification and measurement checks: what a cheating candidate trips.
INPUT_MUTATED = "input_mutated"
OUTPUT_ALIASES_INPUT = "output_aliases_input"
BACKGROUND_THREAD = "background_thread"
HIDDEN_WORK = "hidden_work"
KERNELS_NOT_RUN = "kernels_not_run"
KERNELS_NO_WORK = "kernels_no_work"
UNDECLARED_LIBRARY_WORK = "undeclared_library_work"
ENERGY_LOOP_FASTER = "energy_loop_faster"
SHAPE_MISMATCH = "shape_mismatch"
DTYPE_MISMATCH = "dtype_mismatch"
DEVICE_MISMATCH = "device_mismatch"
UNWRITTEN_OUTPUT = "unwritten_output"
MISMATCH = "mismatch"
NEAR_CONSTANT = "near_constant"
TIMED_OUTPUT_MISMATCH = "timed_output_mismatch"
TOO_FAST = "too_fast"
# Failures that are not cheats.
BAD_TASK = "bad_task"
COMPILE_ERROR = "compile_error"
COMPILE_TIMEOUT = "compile_timeout"
LAUNCH_ERROR = "launch_error"
OUT_OF_MEMORY = "out_of_memory"
CRASH = "crash"
TIMEOUT = "timeout"
REPLAY = "replay"

_S = Status
CODES: dict[str, Code] = {
    c.name: c
    for c in (
        Code(NOTE, None, False, "an explanation; the result stands"),
        Code(INPUT_MUTATED, _S.REJECTED, True, "an input changed"),
        Code(OUTPUT_ALIASES_INPUT, _S.REJECTED, True, "an output shares storage with an input"),
        Code(BACKGROUND_THREAD, _S.REJECTED, True, "a thread of the candidate outlived forward"),
        Code(HIDDEN_WORK, _S.REJECTED, True, "host time of synchronised calls far above their events"),
        Code(KERNELS_NOT_RUN, _S.REJECTED, True, "the profiler saw none of our kernels"),
        Code(KERNELS_NO_WORK, _S.REJECTED, True, "our kernels ran too briefly to have done the work"),
        Code(UNDECLARED_LIBRARY_WORK, _S.REJECTED, True, "a custom candidate's work ran in library kernels"),
        Code(ENERGY_LOOP_FASTER, _S.REJECTED, True, "the energy loop ran faster than the timed calls"),
        Code(SHAPE_MISMATCH, _S.MISMATCH, True, "outputs of the wrong number or shape"),
        Code(DTYPE_MISMATCH, _S.MISMATCH, True, "an output of the wrong dtype"),
        Code(DEVICE_MISMATCH, _S.MISMATCH, True, "an output on the wrong device"),
        Code(UNWRITTEN_OUTPUT, _S.MISMATCH, True, "the poison survived in an output"),
        Code(MISMATCH, _S.MISMATCH, True, "outside the tolerance, elementwise or by norm"),
        Code(NEAR_CONSTANT, _S.MISMATCH, True, "an output with almost none of the reference's spread"),
        Code(TIMED_OUTPUT_MISMATCH, _S.MISMATCH, True, "a measured call returned a wrong result"),
        Code(TOO_FAST, _S.SUSPICIOUS, True, "faster than the roofline floor or the speedup bound allows"),
        Code(BAD_TASK, _S.REJECTED, False, "the task cannot be verified (e.g. an all-zero input)"),
        Code(COMPILE_ERROR, _S.COMPILE_ERROR, False, "nvcc failed"),
        Code(COMPILE_TIMEOUT, _S.COMPILE_TIMEOUT, False, "nvcc did not finish in time"),
        Code(LAUNCH_ERROR, _S.LAUNCH_ERROR, False, "loading or running the candidate raised"),
        Code(OUT_OF_MEMORY, _S.LAUNCH_ERROR, False, "out of GPU memory; the worker restarts"),
        Code(CRASH, _S.CRASH, False, "the worker died, or CUDA's context broke"),
        Code(TIMEOUT, _S.TIMEOUT, False, "over the wall-time or CPU-time limit; the worker was killed"),
        Code(REPLAY, _S.REJECTED, False, "a replayed run met a candidate its recordings lack"),
    )
}


def first_line(e: BaseException, empty: str = "(no message)") -> str:
    """An exception's message as one line of a reason (its first, at most 300 characters); `empty` when it
    has none."""
    text = str(e).strip().splitlines()
    return text[0][:300] if text else empty


def code_of(reason: str) -> str:
    """The code a reason starts with: "mismatch" for "mismatch: ...", "static:try_except" for
    "static:try_except: ..."."""
    head, _, rest = reason.partition(":")
    head = head.strip()
    if head == STATIC and rest and not rest.startswith(" "):
        return f"{STATIC}:{rest.partition(':')[0].strip()}"
    return head


def status_of(code: str) -> Status | None:
    """The status a code carries; None for a note or a code no one registered."""
    if code.startswith(f"{STATIC}:"):
        return Status.REJECTED
    known = CODES.get(code)
    return known.status if known else None


def is_note(reason: str) -> bool:
    return code_of(reason) == NOTE


def as_note(text: str) -> str:
    """`text` as a note, unless it is one already."""
    return text if is_note(text) else f"{NOTE}: {text}"


def checks(status: Status) -> tuple[str, ...]:
    """The runtime anti-cheat codes that carry `status` (the static ones come from pipeline.static_check)."""
    return tuple(c.name for c in CODES.values() if c.check and c.status == status)
