"""Evidence collection for the micro-profiling tools: Nsight Compute counters (one ncu run per candidate,
a curated metric set, clocks left alone), SASS statistics from cuobjdump, and parsers for both.

Counters only: timings come from the harness (CUDA events), never from ncu, whose durations are
cold-cache replays. ncu silently drops metric names it does not know, so the curated set is validated
against `ncu --query-metrics` where ncu is installed, and the parser reports which names came back.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from pipeline import jobs, sandbox
from pipeline.config import Config
from pipeline.profile import warm
from pipeline.profile.target import JOB_FILE, TIMES_FILE
from pipeline.types import Status

METRICS_FILE = Path(__file__).with_name("metrics.txt")
# A GPU's performance monitors serve one profiling session at a time: a second ncu started while one replays
# fails or profiles nothing. Every kernelpro process on the machine (search workers, benches, test workers)
# takes this lock for the span of its profile; one lock a machine (the safe side for several GPUs), a user's
# own (another user's file would not open for writing: their profiles are theirs to order).
NCU_LOCK = Path(tempfile.gettempdir()) / f"kernelpro-ncu-{os.getuid()}.lock"


def curated_metrics() -> tuple[str, ...]:
    return tuple(line.strip() for line in METRICS_FILE.read_text().splitlines() if line.strip())


@dataclass(frozen=True)
class KernelCounters:
    """One profiled kernel launch: its name, launch geometry and metric values in base units."""

    name: str
    metrics: dict[str, float]
    grid: str = ""
    block: str = ""

    def get(self, metric: str, default: float = 0.0) -> float:
        return self.metrics.get(metric, default)


@dataclass(frozen=True)
class NcuResult:
    status: Status
    kernels: tuple[KernelCounters, ...] = ()
    missing_metrics: tuple[str, ...] = ()  # asked for, but not in ncu's output (unknown names are dropped)
    log: str = ""
    seconds: float = 0.0
    raw: str = ""  # ncu's CSV output as written
    warm: bool = False  # the target was started ahead (its start is not in `seconds`)
    # `seconds` by part, from the target's marks (target.TIMES_FILE): start (to the job read: a cold target's
    # Python and imports, a waiting one's poll), setup (CUDA under ncu, the task and its reference),
    # candidate, warmup, replay (the profiled call, replayed per metric pass), exit (ncu's CSV and exit)
    parts: dict[str, float] = field(default_factory=dict)
    cuda_ahead: bool = False  # a waiting target brought CUDA up before its job (not in `seconds`)

    @property
    def reason(self) -> str:
        """One line on why there are no counters: ncu's own error where it printed one (e.g. its counters
        taken by another profiler), else the log's first line."""
        lines = [ln.strip() for ln in self.log.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("==ERROR==")]
        return (errors or lines or [self.status.value])[0]


@dataclass(frozen=True)
class SassStats:
    """What a kernel's SASS says without running it."""

    kernel: str
    instructions: int
    opcodes: dict[str, int] = field(default_factory=dict)  # full mnemonic with modifiers -> count

    def count(self, prefix: str) -> int:
        return sum(n for op, n in self.opcodes.items() if op == prefix or op.startswith(prefix + "."))

    @property
    def global_loads(self) -> dict[int, int]:
        """LDG count by access width in bits (32 when the mnemonic carries no width)."""
        return _by_width(self.opcodes, "LDG")

    @property
    def global_stores(self) -> dict[int, int]:
        return _by_width(self.opcodes, "STG")


_WIDTHS = {"128": 128, "64": 64, "U8": 8, "S8": 8, "U16": 16, "S16": 16}


def _by_width(opcodes: dict[str, int], base: str) -> dict[int, int]:
    widths: Counter[int] = Counter()
    for op, n in opcodes.items():
        parts = op.split(".")
        if parts[0] != base:
            continue
        width = next((_WIDTHS[p] for p in parts[1:] if p in _WIDTHS), 32)
        widths[width] += n
    return dict(widths)


# -- Nsight Compute --------------------------------------------------------------------------------------
def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def query_metrics(ncu: str, chip: str = "gh100") -> set[str]:
    """The base metric names ncu knows for a chip (runs without a GPU)."""
    out = subprocess.run(
        [ncu, "--query-metrics", "--chip", chip], capture_output=True, text=True, timeout=120
    )
    names = set()
    for line in out.stdout.splitlines():
        token = line.split(" ", 1)[0].strip()
        if "__" in token:
            names.add(token)
    return names


_ATTRIBUTE_PREFIXES = ("launch__", "device__", "profiler__", "sm__maximum_warps_per_active_cycle_pct")


def metric_known(metric: str, base_names: set[str]) -> bool:
    """`dram__bytes_read.sum` is known when its base `dram__bytes_read` is (suffixes are roll-ups)."""
    base = metric.split(".", 1)[0]
    # Launch and device attributes are not listed by --query-metrics, yet the raw page reports them.
    return base in base_names or metric in base_names or metric.startswith(_ATTRIBUTE_PREFIXES)


PER_CONFIG = 1  # launches profiled per distinct kernel and launch configuration


def ncu_command(
    ncu: str,
    job_path: Path | None,
    metrics: tuple[str, ...],
    log_path: Path,
    launch_count: int = PER_CONFIG,
    wait_in: Path | None = None,
    lock: Path | None = None,
) -> list[str]:
    """ncu's argv over the target: for `job_path`, or (`wait_in`) a target that waits for its job there."""
    # Each replay costs one pass per metric group, so a call of 256 identical launches profiled in full takes
    # minutes; a launch per distinct (kernel, grid, block, shared memory) says the same, and the system
    # profile's launch counts weight it back up (Evidence.weight).
    limit = (
        ["--filter-mode", "per-launch-config", "--launch-count", str(launch_count)] if launch_count else []
    )
    return [
        ncu,
        *limit,
        "--clock-control",
        "none",  # leave the clocks as we find them; timings come from the harness
        "--cache-control",
        "all",
        "--target-processes",
        "all",
        "--profile-from-start",
        "off",  # only the call between cudaProfilerStart/Stop in target.py
        "--csv",
        "--page",
        "raw",
        "--print-units",
        "base",
        "--log-file",
        str(log_path),
        "--metrics",
        ",".join(metrics),
        sys.executable,
        "-m",
        "pipeline.profile.target",
        *(["--wait", str(wait_in)] if wait_in is not None else [str(job_path)]),
        # a waiting target given the profiles' lock brings CUDA up between profiles (its own temporary
        # folder is its scratch: the lock's path is passed)
        *([str(lock)] if wait_in is not None and lock is not None else []),
    ]


def run_ncu(
    job: jobs.Ncu,
    cfg: Config,
    metrics: tuple[str, ...] | None = None,
    timeout_s: float = 300.0,
    launch_count: int = PER_CONFIG,
    warm_next: bool = False,
) -> NcuResult:
    """Profile one candidate (or the reference, when the job names none) under ncu in an isolated process:
    the target started ahead with these settings if one waits (pipeline/profile/warm.py), else a new one.
    With `warm_next`, a target is started for the next profile once this one is done."""
    ncu = find_ncu()
    if ncu is None:
        return NcuResult(Status.LAUNCH_ERROR, log="ncu (Nsight Compute) not found on this machine")
    metrics = metrics or curated_metrics()
    lock = FileLock(NCU_LOCK)
    try:
        lock.acquire(timeout=timeout_s)
    except Timeout:
        return NcuResult(
            Status.TIMEOUT,
            log=f"another process's profile held the GPU's counters for {timeout_s:.0f} s ({NCU_LOCK})",
            seconds=timeout_s,
        )
    try:
        return _profile(ncu, job, cfg, metrics, timeout_s, launch_count, warm_next)
    finally:
        lock.release()


def _profile(
    ncu: str,
    job: jobs.Ncu,
    cfg: Config,
    metrics: tuple[str, ...],
    timeout_s: float,
    launch_count: int,
    warm_next: bool,
) -> NcuResult:
    t0, wall0 = time.monotonic(), time.time()

    # The namespaces go on ncu's whole tree through the trampoline; the target applies Landlock and seccomp
    # itself once CUDA is up (job.sandbox), since ncu must exec it and talk to its injected library.
    def planned(plan: sandbox.Plan | None) -> jobs.Ncu:  # the job with its plan, for the target's late layers
        return dataclasses.replace(job, sandbox=plan.to_json()) if plan else job

    waiting = warm.take(cfg, ncu, metrics, launch_count)
    if waiting is not None:
        proc, log_path = waiting.proc, waiting.log_path
        wall0 = time.time()  # the parts count from the handover (the job is ready to read)
        warm.hand_over(waiting, planned(sandbox.ncu_plan(cfg, waiting.scratch, job)))
    else:

        def command(scratch: Path, log: Path, plan: sandbox.Plan | None) -> list[str]:
            job_path = scratch / JOB_FILE
            job_path.write_bytes(jobs.encode(planned(plan)))
            return ncu_command(ncu, job_path, metrics, log, launch_count)

        proc, _, log_path = warm.spawn_tree(cfg, job, command)
    if warm_next:
        # The next target starts now, not after this profile: its imports (seconds under ncu) overlap this
        # profile and the next batch. It touches no CUDA until its job comes (with ncu_cuda_ahead, until this
        # profile has let go of the lock), so it cannot disturb this one.
        prewarm(cfg, metrics, launch_count)
    res = _finish(proc, log_path, metrics, timeout_s, t0)
    times = log_path.parent / TIMES_FILE
    parts = target_parts(times, wall0, time.time())
    return dataclasses.replace(res, warm=waiting is not None, parts=parts, cuda_ahead=_cuda_ahead(times))


def _cuda_ahead(times_path: Path) -> bool:
    try:
        return json.loads(times_path.read_text()).get("cuda_ahead") is True
    except (OSError, ValueError, AttributeError):
        return False


# (part, the target's mark that ends it), in order
_PARTS = (("start", "job"), ("setup", "reference"), ("candidate", "candidate"), ("warmup", "warmup"),
          ("replay", "replayed"))  # fmt: skip


def target_parts(times_path: Path, begin: float, end: float) -> dict[str, float]:
    """A profile's seconds by part, from the target's wall-clock marks between `begin` and `end` (both
    time.time()); empty when the target left none (it failed before its profiled call)."""
    try:
        marks = json.loads(times_path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(marks, dict):
        return {}
    parts, last = {}, begin
    for name, mark in _PARTS:
        t = marks.get(mark)
        if not isinstance(t, int | float):
            return {}
        parts[name], last = round(max(t - last, 0.0), 4), t
    parts["exit"] = round(max(end - last, 0.0), 4)
    return parts


def prewarm(cfg: Config, metrics: tuple[str, ...] | None = None, launch_count: int = PER_CONFIG) -> None:
    """Start a profiling target ahead of the next run_ncu with these settings (nothing without ncu)."""
    ncu = find_ncu()
    if ncu is None:
        return
    metrics = metrics or curated_metrics()
    lock = NCU_LOCK if cfg.ncu_cuda_ahead else None
    warm.start(cfg, ncu, metrics, launch_count, lambda scratch, log, plan: ncu_command(
        ncu, None, metrics, log, launch_count, wait_in=scratch, lock=lock))  # fmt: skip


def _finish(
    proc: subprocess.Popen, log_path: Path, metrics: tuple[str, ...], timeout_s: float, t0: float
) -> NcuResult:
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return NcuResult(
            Status.TIMEOUT, log=f"ncu did not finish within {timeout_s:.0f} s", seconds=timeout_s
        )
    seconds = time.monotonic() - t0
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    if proc.returncode != 0:
        tail = "\n".join((output + "\n" + text).strip().splitlines()[-15:])
        return NcuResult(
            Status.CRASH, log=f"ncu exited with {proc.returncode}:\n{tail}", seconds=seconds, raw=text
        )
    kernels = parse_ncu_csv(text)
    if not kernels:
        tail = "\n".join((output + "\n" + text).strip().splitlines()[-15:])
        return NcuResult(
            Status.LAUNCH_ERROR, log=f"ncu profiled no kernel:\n{tail}", seconds=seconds, raw=text
        )
    present = set().union(*(k.metrics for k in kernels))
    missing = tuple(m for m in metrics if m not in present)
    return NcuResult(Status.OK, kernels, missing, seconds=seconds, raw=text)


_NUMBER = re.compile(r"^-?[\d,]*\.?\d+(e[-+]?\d+)?$", re.IGNORECASE)


def parse_ncu_csv(text: str) -> tuple[KernelCounters, ...]:
    """ncu `--csv --page raw --print-units base`: a header row, a units row, then a row per launch.
    Numbers may carry thousands separators; ==PROF== lines and the program's output are skipped."""
    import csv

    rows = [r for r in csv.reader(line for line in text.splitlines() if line.startswith('"'))]
    if not rows:
        return ()
    header = rows[0]
    try:
        name_col = header.index("Kernel Name")
    except ValueError:
        return ()
    grid_col = header.index("Grid Size") if "Grid Size" in header else None
    block_col = header.index("Block Size") if "Block Size" in header else None
    first_metric = name_col + 1
    for fixed in ("Context", "Stream", "Block Size", "Grid Size", "Device", "CC"):
        if fixed in header:
            first_metric = max(first_metric, header.index(fixed) + 1)
    out = []
    for row in rows[1:]:
        if len(row) != len(header) or row[0] == "" or not row[0].isdigit():
            continue  # the units row and anything malformed
        metrics = {}
        for col in range(first_metric, len(header)):
            value = _number(row[col])
            if value is not None:
                metrics[header[col]] = value
        out.append(
            KernelCounters(
                name=row[name_col],
                metrics=metrics,
                grid=row[grid_col] if grid_col is not None else "",
                block=row[block_col] if block_col is not None else "",
            )
        )
    return tuple(out)


def _number(cell: str) -> float | None:
    cell = cell.strip()
    if not cell or not _NUMBER.match(cell):
        return None
    return float(cell.replace(",", ""))


# -- SASS ------------------------------------------------------------------------------------------------
def find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    if Path("/usr/local/cuda/bin/cuobjdump").exists():
        return "/usr/local/cuda/bin/cuobjdump"
    try:
        import nvidia  # the nvidia-cuda-cuobjdump wheel installs under the `nvidia` namespace

        for root in nvidia.__path__:
            hits = sorted(glob.glob(os.path.join(root, "**", "bin", "cuobjdump"), recursive=True))
            if hits:
                return hits[-1]
    except ImportError:
        pass
    return None


def dump_sass(cubin_path: str) -> str | None:
    tool = find_cuobjdump()
    if tool is None:
        return None
    # cuobjdump runs nvdisasm, which NVIDIA's wheels install beside it, not on PATH
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(tool), os.environ.get("PATH", "")])}
    out = subprocess.run([tool, "-sass", cubin_path], capture_output=True, text=True, timeout=120, env=env)
    return out.stdout if out.returncode == 0 else None


_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.IGNORECASE)


def parse_sass(text: str) -> dict[str, SassStats]:
    """Per-kernel opcode counts from `cuobjdump -sass` (predicates stripped, modifiers kept)."""
    stats: dict[str, Counter[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = m.group(1)
            stats.setdefault(current, Counter())
            continue
        if current is None:
            continue
        m = _INSTR.search(line)
        if m:
            stats[current][m.group(1)] += 1
    return {k: SassStats(k, sum(c.values()), dict(c)) for k, c in stats.items()}
