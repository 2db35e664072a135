"""The data types every stage passes around. Frozen dataclasses, no logic beyond (de)serialisation."""

from __future__ import annotations

import dataclasses
import enum
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
    min_bytes: int  # each input, parameter and output moved once
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

    @property
    def speedup_eager(self) -> float | None:
        return _ratio(self.baselines.get("eager"), self.timing)

    @property
    def speedup_compile(self) -> float | None:
        return _ratio(self.baselines.get("compile"), self.timing)

    @property
    def fraction_of_floor(self) -> float | None:
        if self.floor_ms is None or self.timing is None or self.timing.median_ms <= 0:
            return None
        return self.floor_ms / self.timing.median_ms


def _ratio(base: Timing | None, ours: Timing | None) -> float | None:
    if base is None or ours is None or ours.median_ms <= 0:
        return None
    return base.median_ms / ours.median_ms


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
    """Inverse of to_dict for the types above (used for messages from the worker and for the run log)."""
    if data is None:
        return None
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        if name not in hints:
            continue
        kwargs[name] = _convert(hints[name], value)
    return cls(**kwargs)


_TYPES = {
    "Status": Status,
    "Kind": Kind,
    "TensorSpec": TensorSpec,
    "KernelResources": KernelResources,
    "Timing": Timing,
    "Energy": Energy,
}


def _convert(hint: str, value: Any) -> Any:
    if value is None:
        return None
    hint = hint.replace(" | None", "")
    if hint in _TYPES:
        t = _TYPES[hint]
        return t(value) if issubclass(t, enum.Enum) else from_dict(t, value)
    if hint.startswith("tuple["):
        inner = hint[len("tuple[") : -1].split(",")[0].strip()
        return tuple(_convert(inner, v) for v in value)
    if hint.startswith("dict[str, "):
        inner = hint[len("dict[str, ") : -1]
        return {k: _convert(inner, v) for k, v in value.items()}
    return value
