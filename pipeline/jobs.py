"""What travels between the orchestrator and a worker (and into the ncu target's job file): one frozen
record per job kind and one per answer kind, each named by a `kind` on the wire.

`encode` and `decode` are the only way either side writes or reads a message: JSON, never pickle, since
answers come from a process that runs untrusted code. A message that does not decode is a JobFormatError;
the orchestrator treats an answer that does not decode as a crashed worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pipeline.calibrate import Ceilings
from pipeline.config import Config
from pipeline.types import Baselines, Kind, Measurement, Task, Verdict, from_dict, to_dict


class JobFormatError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    """How a worker verifies and times: the Config fields it needs, nothing else (it never sees Config)."""

    device: str = Config.device
    trials: int = Config.trials
    seed: int = Config.seed
    timing_trials: int = Config.timing_trials
    timing_budget_s: float = Config.timing_budget_s
    warmup: int = Config.warmup
    l2_flush: str = Config.l2_flush
    check_fraction: float = Config.check_fraction
    energy: bool = Config.energy
    energy_window_s: float = Config.energy_window_s
    energy_repeats: int = Config.energy_repeats
    energy_max_repeats: int = Config.energy_max_repeats
    energy_spread: float = Config.energy_spread
    baselines: tuple[str, ...] = Config.baselines
    suspicious_speedup: float = Config.suspicious_speedup
    time: bool = True  # False: verify only

    @staticmethod
    def of(cfg: Config, **extra: Any) -> Settings:
        return Settings(
            device=cfg.device,
            trials=cfg.trials,
            seed=cfg.seed,
            timing_trials=cfg.timing_trials,
            timing_budget_s=cfg.timing_budget_s,
            warmup=cfg.warmup,
            l2_flush=cfg.l2_flush,
            check_fraction=cfg.check_fraction,
            energy=cfg.energy,
            energy_window_s=cfg.energy_window_s,
            energy_repeats=cfg.energy_repeats,
            energy_max_repeats=cfg.energy_max_repeats,
            energy_spread=cfg.energy_spread,
            baselines=tuple(cfg.baselines),
            suspicious_speedup=cfg.suspicious_speedup,
            **extra,
        )


@dataclass(frozen=True)
class CandidateCode:
    """A compiled candidate as a worker loads it."""

    key: str
    launcher: str
    cubin_path: str | None = None  # absolute; None for Python stand-ins (CPU tests)
    kernel_names: tuple[str, ...] = ()  # our kernels: what the profiler must see run
    kind: Kind = Kind.CUSTOM
    library_ops: tuple[str, ...] = ()


# -- jobs ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    KIND: ClassVar[str] = ""


@dataclass(frozen=True)
class Ping(Job):
    KIND: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Probe(Job):
    """Load a task file and describe it (shapes, dtype, FLOPs, bytes) without running it on real data."""

    KIND: ClassVar[str] = "probe"
    path: str


@dataclass(frozen=True)
class Environment(Job):
    KIND: ClassVar[str] = "environment"
    device: str = "cuda"


@dataclass(frozen=True)
class Calibrate(Job):
    KIND: ClassVar[str] = "calibrate"


@dataclass(frozen=True)
class Evaluate(Job):
    KIND: ClassVar[str] = "evaluate"
    task: Task
    candidate: CandidateCode
    settings: Settings
    ceilings: Ceilings | None = None


@dataclass(frozen=True)
class Baseline(Job):
    """Eager and torch.compile timings of the task's reference (the reference worker: Inductor runs ptxas)."""

    KIND: ClassVar[str] = "baseline"
    task: Task
    settings: Settings


@dataclass(frozen=True)
class SystemProfile(Job):
    """Kernels per call, GPU busy time and launch gaps of a verified candidate (or of the reference)."""

    KIND: ClassVar[str] = "system_profile"
    task: Task
    settings: Settings
    candidate: CandidateCode | None = None


@dataclass(frozen=True)
class Ncu(Job):
    """The job file of the process Nsight Compute wraps (pipeline/profile/target.py)."""

    KIND: ClassVar[str] = "ncu"
    task_path: str
    seed: int
    candidate: CandidateCode | None = None  # None: profile the reference
    sandbox: str | None = None  # the plan's JSON: the target applies its late layers itself


# Jobs the unconfined reference worker takes: none of them loads candidate code.
TRUSTED = frozenset({Ping, Probe, Environment, Calibrate, Baseline})


# -- answers ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Answer:
    KIND: ClassVar[str] = ""
    exit: bool = False  # this worker is spent (a sticky CUDA error, an out-of-memory): start a fresh one
    loaded_modules: int | None = None  # cubins the worker holds loaded (never unloaded)
    sandbox: dict[str, str] | None = None  # a confined worker's first answer: what each layer did


@dataclass(frozen=True, kw_only=True)
class Pong(Answer):
    KIND: ClassVar[str] = "pong"


@dataclass(frozen=True, kw_only=True)
class Probed(Answer):
    KIND: ClassVar[str] = "probed"
    task: Task


@dataclass(frozen=True, kw_only=True)
class EnvironmentAnswer(Answer):
    KIND: ClassVar[str] = "environment_info"
    environment: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Calibrated(Answer):
    KIND: ClassVar[str] = "calibrated"
    ceilings: Ceilings


@dataclass(frozen=True, kw_only=True)
class Evaluated(Answer):
    KIND: ClassVar[str] = "evaluated"
    verdict: Verdict
    measurement: Measurement | None = None


@dataclass(frozen=True, kw_only=True)
class BaselinesAnswer(Answer):
    KIND: ClassVar[str] = "baselines"
    baselines: Baselines


@dataclass(frozen=True, kw_only=True)
class SystemProfiled(Answer):
    KIND: ClassVar[str] = "system_profiled"
    system: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Failed(Answer):
    """The job could not be done: a handler raised, or refused (no CUDA device, a task that does not load)."""

    KIND: ClassVar[str] = "failed"
    error: str
    traceback: str = ""
    task_error: bool = False  # the task itself is at fault (a TaskError), not the harness


_MESSAGES: tuple[type[Job] | type[Answer], ...] = (
    Ping, Probe, Environment, Calibrate, Evaluate, Baseline, SystemProfile, Ncu,
    Pong, Probed, EnvironmentAnswer, Calibrated, Evaluated, BaselinesAnswer, SystemProfiled, Failed,
)  # fmt: skip
_KINDS: dict[str, type] = {c.KIND: c for c in _MESSAGES}  # distinct: tests/test_jobs.py


def encode(message: Job | Answer) -> bytes:
    return json.dumps({"kind": message.KIND, **to_dict(message)}, default=str).encode()


def decode(raw: bytes | str) -> Job | Answer:
    """The record a message holds; JobFormatError for anything else (not JSON, an unknown kind, a field
    missing or of the wrong shape)."""
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise JobFormatError(f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise JobFormatError("not a JSON object")
    kind = data.pop("kind", None)
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise JobFormatError(f"unknown job kind {kind!r}")
    try:
        return from_dict(cls, data)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise JobFormatError(f"a malformed {kind} message: {e}") from None
