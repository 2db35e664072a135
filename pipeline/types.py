"""The data types every stage passes around. Frozen dataclasses, no logic beyond (de)serialisation."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any


class Status(enum.StrEnum):
    OK = "ok"
    COMPILE_ERROR = "compile_error"
    COMPILE_TIMEOUT = "compile_timeout"
    LAUNCH_ERROR = "launch_error"
    CRASH = "crash"
    TIMEOUT = "timeout"
    MISMATCH = "mismatch"
    SUSPICIOUS = "suspicious"
    REJECTED = "rejected"


class Kind(enum.StrEnum):
    """How a candidate computes: all in our kernels, or partly in torch library calls."""

    CUSTOM = "custom"
    HYBRID = "hybrid"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Task:
    """A KernelBench-format task, probed without running it on real data (see pipeline/tasks.py)."""

    id: str
    path: str
    source: str
    source_hash: str
    dtype: str  # the dtype of the first floating-point input
    atol: float
    rtol: float
    norm_tol: float  # bound on ||out - ref|| / ||ref||
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    init_args: str  # repr of get_init_inputs(), for the record
    flops: float  # torch's flop counter on the reference forward
    min_bytes: int  # each input, parameter and output moved once; twice what no kernel can read once (forced_reads.py)
    param_bytes: int


@dataclass(frozen=True)
class Candidate:
    key: str  # hash of source, launcher and flags
    task_id: str
    source: str  # CUDA source
    launcher: str  # Python defining ModelNew; sees a global `kernels`
    flags: tuple[str, ...] = ()
    parent: str | None = None
    edit: str | None = None
    blocks: tuple[str, ...] = ()  # building blocks it used (paths or symbols)


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    barriers: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    cumulative_stack: int = 0
    shared_mem: int = 0  # static bytes reported by ptxas
    constant_mem: int = 0
    # ptxas's Hopper MMA diagnostics: why it serialized the warpgroup MMAs (each waited for before the next
    # issues, the tensor cores idle in between), and how many waits it inserted on its own (C7517).
    wgmma_serialized: str = ""
    wgmma_waits_injected: int = 0


@dataclass(frozen=True)
class Build:
    candidate_key: str
    status: Status
    cubin_path: str | None
    resources: tuple[KernelResources, ...] = ()
    log: str = ""  # trimmed compiler output: what a generator needs to fix an error
    seconds: float = 0.0
    cached: bool = False
    arch: str = ""


@dataclass(frozen=True)
class Verdict:
    candidate_key: str
    status: Status
    trials_passed: int = 0
    trials: int = 0
    worst_rel_error: float | None = None  # ||out - ref|| / ||ref||, worst trial
    worst_abs_error: float | None = None
    kind: Kind | None = None
    library_ops: tuple[
        str, ...
    ] = ()  # for hybrid candidates: the torch calls and kernels it leaves to libraries
    reasons: tuple[str, ...] = ()
    ref_rel_error: float | None = None  # how far eager itself is from float64: the tolerance's anchor


@dataclass(frozen=True)
class Timing:
    median_ms: float
    q1_ms: float
    q3_ms: float
    min_ms: float
    max_ms: float
    trials: int
    host_median_ms: float | None = None  # host wall time of a synchronised call, launch overhead included
    synced_median_ms: float | None = None  # events around that same synchronised call
    checked_calls: int = 0  # calls whose outputs were compared with the reference on the same inputs
    fresh_inputs: bool = False  # every call on inputs new to it (older records: rotated input sets)
    # host seconds of the timing loop by part: drawing inputs, flushing L2, the calls (launch and wait),
    # checking outputs against eager (older records: none)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def spread(self) -> float:
        """Interquartile range over median."""
        return (self.q3_ms - self.q1_ms) / self.median_ms if self.median_ms > 0 else 0.0


@dataclass(frozen=True)
class Energy:
    joules_per_call: float
    avg_power_w: float
    window_s: float
    repeats: int
    checked_calls: int = 0  # loop calls whose outputs were compared with the reference
    ms_per_call: float | None = None  # wall time per call in the loop (checked against the timed median)
    # Relative standard error of joules_per_call over the windows (stdev / sqrt(n) / mean); None with one
    # window and in logs written before it was recorded. pipeline/search/matched.py compares with it.
    spread: float | None = None
    windows: tuple[float, ...] = ()  # joules per call of each window, in order


@dataclass(frozen=True)
class Measurement:
    candidate_key: str
    status: Status
    timing: Timing | None = None
    baselines: dict[str, Timing] = field(
        default_factory=dict
    )  # "eager", "compile", "max-autotune-no-cudagraphs"
    energy: Energy | None = None
    floor_ms: float | None = None  # roofline floor from the task's FLOPs and minimal bytes
    counters: dict[str, float] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()
    # Wall seconds of the worker's phases for this candidate (verify, timing, eager, profile_check, energy):
    # where an evaluation's time goes, for the search's throughput
    seconds: dict[str, float] = field(default_factory=dict)
    # Every GPU kernel of the call the profiler check watched, its microseconds by name: which of a launcher's
    # paths ran (a cluster kernel, or the fallback its guard took on this GPU) and where the call's time went
    kernels: dict[str, float] = field(default_factory=dict)

    @property
    def speedup_eager(self) -> float | None:
        return speedup(_ms(self.baselines.get("eager")), _ms(self.timing))

    @property
    def speedup_compile(self) -> float | None:
        return speedup(_ms(self.baselines.get("compile")), _ms(self.timing))

    @property
    def fraction_of_floor(self) -> float | None:
        if self.floor_ms is None or self.timing is None or self.timing.median_ms <= 0:
            return None
        return self.floor_ms / self.timing.median_ms


def speedup(baseline: float | None, ours: float | None) -> float | None:
    """How many times better than the baseline a figure is, for figures where lower is better (ms, J, J*ms):
    baseline / ours, or None unless both are finite and positive. The one definition of a speedup."""
    if baseline is None or ours is None or not 0 < baseline < math.inf or not 0 < ours < math.inf:
        return None
    return baseline / ours


def _ms(t: Timing | None) -> float | None:
    return t.median_ms if t is not None else None


@dataclass(frozen=True)
class Finding:
    tool: str
    severity: float  # 0..1, worst first
    evidence: dict[str, float]
    diagnosis: str
    advice: str
    edits: tuple[str, ...] = ()
    expected_gain: float | None = None


@dataclass(frozen=True)
class Node:
    id: int
    parent: int | None
    candidate_key: str
    children: tuple[int, ...] = ()
    visits: int = 0
    value: float = 0.0
    status: Status | None = None
    pruned: bool = False


@dataclass(frozen=True)
class Evaluation:
    """One candidate through the stages (static check, compile, verify, time): the one record the stages,
    the evaluators, the search loop, the CLI and the run log ("result" events) all pass around."""

    key: str  # the candidate's
    build: Build | None  # None when the static check rejected it before compiling
    verdict: Verdict
    measurement: Measurement | None

    @property
    def status(self) -> Status:
        return self.verdict.status


@dataclass(frozen=True)
class Baselines:
    """The task's reference, timed once per run: eager and torch.compile, and eager's energy per call."""

    timings: dict[str, Timing]  # "eager", "compile", "max-autotune-no-cudagraphs"
    energy_eager_j: float | None = None
    floor_ms: float | None = None  # roofline floor, from the GPU's measured ceilings
    compile_s: dict[str, float] = field(default_factory=dict)  # compile time of each torch.compile mode
    environment: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    energy_eager: Energy | None = None  # the measurement behind energy_eager_j, with its spread


@dataclass(frozen=True)
class Profile:
    """What profiling one verified candidate told the search: stage-1 class, stage-2 findings, and the text
    a policy is shown."""

    key: str
    ok: bool = False
    bound: str = ""  # stage-1 summary
    bound_class: str = ""  # memory / compute / latency / launch
    findings: tuple[Finding, ...] = ()
    feedback: str = ""  # advice block, JSON, raw metrics or nothing
    notes: tuple[str, ...] = ()
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each part: sass, system, ncu


def to_dict(obj: Any) -> Any:
    """JSON-ready form of any of the types above (enums as their values, tuples as lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    return obj


def from_dict(cls: type, data: Any) -> Any:
    """Inverse of to_dict for any dataclass whose fields are annotated with the types here, containers of
    them, enums or plain JSON values (messages from the worker, the run log). Unknown keys are ignored;
    a missing field without a default is a TypeError."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    hints = _hints(cls)
    return cls(**{name: _convert(hints[name], value) for name, value in data.items() if name in hints})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return {k: v for k, v in typing.get_type_hints(cls).items() if k in names}


def _convert(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) != 1:
            return value
        hint = options[0]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_dict(hint, value)
    if origin is tuple:
        return tuple(_convert(args[0], v) for v in value) if args else tuple(value)
    if origin is dict and len(args) == 2:
        return {k: _convert(args[1], v) for k, v in value.items()}
    return value
