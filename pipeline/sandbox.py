"""The one way a process that runs candidate code starts, and the confinement it puts itself under.

`spawn` starts the process: a scrubbed environment (no secrets; temporary files and every cache in its scratch
folder), its own process group, stdin closed. The process then confines itself, in layers, each applied only
where the kernel offers it and each reported (`Report`: layer -> "applied" | "unavailable: why" | "off"):

- userns: a user namespace that maps our ids onto themselves. Root stays root for file permissions and the
  GPU's device nodes, but holds no capability over the machine (mount, modules, raw I/O, other processes).
- netns: a network namespace with no interface up: no network at all.
- rlimits: no core dumps, a cap on tasks (threads count) and on the size of a written file.
- landlock: the file system. Read the system, but neither the users' homes (only the paths the process needs
  inside them), nor other processes' /proc entries, nor a few system secrets (/etc/shadow, ...), nor /dev
  beyond the GPU's device files and null/zero/random; write only the scratch folder, those devices and its
  own /proc entry; execute nothing. From ABI 4 no TCP, from ABI 6 no signals out of the sandbox and no
  abstract unix sockets.
- seccomp: no execve, no new process (threads only), no socket but AF_UNIX pairs, no ptrace, mount, kernel
  keyrings, BPF, io_uring, module loading.

Namespaces need a single-threaded process, so `apply_early` runs first thing in the child. Landlock binds only
the thread that restricts itself and the threads it starts later (ABI 7 has no way to sync a ruleset onto
running threads), so its file-system rules are applied early too, before torch and CUDA start their threads;
the late step (`apply_late`, after the heavy imports and CUDA's initialisation, before any candidate code)
takes execution away with a second Landlock layer and installs seccomp on every thread (TSYNC).

Only the kernel's own interfaces, through ctypes; x86-64 Linux. Elsewhere each layer reports itself
unavailable.

    python -m pipeline.sandbox probe DIR          (what `probe()` runs in a short-lived child)
    python -m pipeline.sandbox exec PLAN -- CMD   (the trampoline: namespaces and rlimits, then exec CMD)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import glob
import json
import logging
import os
import platform
import pwd
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any

from pipeline.config import PROJECT_ROOT, SANDBOX_LAYERS, Config, candidate_environ
from pipeline.jobs import Job

log = logging.getLogger("kernelpro.sandbox")

Report = dict[str, str]  # layer -> "applied" | "unavailable: why" | "off"
APPLIED = "applied"
OFF = "off"

# Paths no confined process reads even where their folder is readable.
SYSTEM_SECRETS = (
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssh",
    "/etc/ssl/private",
    "/run/secrets",
    "/run/user",
    "/proc/kcore",
)
DEVICE_FILES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
DEVICE_GLOBS = ("/dev/nvidia*", "/dev/nvidia-caps")


@dataclass(frozen=True)
class Plan:
    """What a confined child applies to itself; it travels as JSON on the child's command line."""

    layers: tuple[str, ...]  # among SANDBOX_LAYERS
    scratch: str  # read and write
    read: tuple[
        str, ...
    ] = ()  # read-only grants inside hidden places: the kernelpro home, task files, extras
    hide: tuple[str, ...] = ()  # users' homes: the top-level folder holding each is not readable
    file_mb: int = 16384  # RLIMIT_FSIZE
    max_tasks: int = 4096  # RLIMIT_NPROC: threads count; a bound on runaway thread creation
    loopback: bool = False  # bring `lo` up in the new network namespace (ncu talks to its target over it)
    unix_sockets: bool = False  # socket(AF_UNIX); pathname sockets reach services Landlock cannot stop

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> Plan:
        d = json.loads(text)
        return Plan(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def wants(self, layer: str) -> bool:
        return layer in self.layers

    def readable(self, path: str | Path) -> bool:
        """Whether a confined process can read `path` (the orchestrator's view of the Landlock rules)."""
        p = os.path.realpath(path)
        grants = (*self.read, self.scratch, *process_paths())
        if any(_under(p, g) for g in grants):
            return True
        hidden = {_top(h) for h in self.hide} | {"/root", "/dev"}
        return not any(_under(p, h) for h in (*hidden, *SYSTEM_SECRETS)) and not _under(p, "/proc")


def worker_plan(cfg: Config, scratch: Path, extra_read: Sequence[str] = ()) -> Plan | None:
    """The plan of a confined worker, or None when the sandbox is off."""
    if not cfg.sandbox:
        return None
    return Plan(
        layers=tuple(cfg.sandbox_layers),
        scratch=str(scratch),
        read=_grants(cfg, extra_read),
        hide=user_homes(),
        file_mb=cfg.sandbox_file_mb,
    )


def ncu_plan(cfg: Config, scratch: Path, job: Job) -> Plan | None:
    """The ncu tree's plan: the layers cfg.sandbox_ncu_layers names, among those the probe found working.
    The namespaces go on the whole tree (ncu and its target) through the trampoline; Landlock and seccomp
    only on the target, after CUDA's initialisation (ncu itself must exec the target and write its report)."""
    if not cfg.sandbox:
        return None
    available = {name for name, state in probe().items() if state == APPLIED}
    layers = tuple(layer for layer in cfg.sandbox_ncu_layers if layer in available)
    return Plan(
        layers=layers,
        scratch=str(scratch),
        read=_grants(cfg, job_paths(job)),
        hide=user_homes(),
        file_mb=cfg.sandbox_file_mb,
        loopback="netns" in layers,
        unix_sockets=True,  # the injected profiler library may speak to ncu over a unix socket
    )


def _grants(cfg: Config, extra: Sequence[str]) -> tuple[str, ...]:
    paths = [cfg.home, *cfg.sandbox_read, *extra]
    return tuple(dict.fromkeys(os.path.realpath(p) for p in paths))


def job_paths(job: Job) -> tuple[str, ...]:
    """The files a job makes a confined process read: the candidate's cubin, and the task file of an ncu
    job (a worker's jobs carry the task's source)."""
    task_path: str | None = getattr(job, "task_path", None)
    cubin_path: str | None = getattr(getattr(job, "candidate", None), "cubin_path", None)
    return tuple(dict.fromkeys(p for p in (task_path, cubin_path) if p))


def user_homes() -> tuple[str, ...]:
    homes = {os.path.expanduser("~"), "/root"}
    with contextlib.suppress(KeyError):
        homes.add(pwd.getpwuid(os.getuid()).pw_dir)
    return tuple(sorted(os.path.realpath(h) for h in homes if h.startswith("/") and h != "/"))


def process_paths() -> tuple[str, ...]:
    """What this interpreter reads to import its modules: the project, the prefixes, every sys.path entry."""
    paths = [str(PROJECT_ROOT), sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path]
    return tuple(dict.fromkeys(os.path.realpath(p) for p in paths if p and os.path.exists(p)))


def _under(path: str, root: str) -> bool:
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root + "/") or root == "/"


def _top(path: str) -> str:
    parts = Path(os.path.realpath(path)).parts
    return "/" + parts[1] if len(parts) > 1 else "/"


# -- starting a process ----------------------------------------------------------------------------------
def child_environ(scratch: Path | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The scrubbed environment, with temporary files and caches in the scratch folder when one is given,
    so a confined process never needs to write anywhere else."""
    env = candidate_environ()
    if scratch is not None:
        s = str(scratch)
        for name in ("TMPDIR", "TMP", "TEMP", "XDG_CACHE_HOME", "CUPY_CACHE_DIR", "CUDA_CACHE_PATH"):
            env[name] = s
        env["TRITON_CACHE_DIR"] = os.path.join(s, "triton")
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(s, "inductor")
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # __pycache__ folders are read-only to it
    env.update(extra or {})
    return env


def spawn(
    argv: Sequence[str],
    *,
    cwd: Path,
    scratch: Path | None,
    plan: Plan | None = None,
    trampoline: bool = False,
    env: Mapping[str, str] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = subprocess.STDOUT,
    pass_fds: Sequence[int] = (),
    text: bool = False,
) -> subprocess.Popen:
    """Start a process that will run candidate code. With `trampoline`, the namespaces and rlimits of `plan`
    are applied by `python -m pipeline.sandbox exec` before it execs `argv` (for programs that cannot confine
    themselves, such as ncu); otherwise the child applies `plan` itself (the worker, the ncu target)."""
    argv = list(argv)
    if trampoline and plan is not None:
        argv = [sys.executable, "-m", "pipeline.sandbox", "exec", plan.to_json(), "--", *argv]
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=child_environ(scratch, env),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        pass_fds=tuple(pass_fds),
        text=text,
        start_new_session=True,  # its own process group: a kill takes its children too
    )


# -- saying what is in force, once ----------------------------------------------------------------------
_said: set[str] = set()
_reports: list[Report] = []


def summary(report: Mapping[str, str]) -> str:
    """One line: "sandbox: landlock unavailable (kernel has no Landlock); userns, netns, seccomp active"."""
    active = [k for k, v in report.items() if v == APPLIED and k in SANDBOX_LAYERS]
    missing = [f"{k} {v.replace('unavailable: ', 'unavailable (', 1)})" for k, v in report.items()
               if v.startswith("unavailable")]  # fmt: skip
    off = [k for k, v in report.items() if v == OFF]
    parts = []
    if missing:
        parts.append("; ".join(missing))
    if active:
        parts.append(", ".join(active) + " active")
    if off:
        parts.append(", ".join(off) + " off")
    return "sandbox: " + ("; ".join(parts) if parts else "nothing applied")


def note(report: Mapping[str, str]) -> None:
    """Record a child's report; say it once per process (a warning when a wanted layer is missing)."""
    line = summary(report)
    _reports.append(dict(report))
    if line in _said:
        return
    _said.add(line)
    if any(v.startswith("unavailable") for v in report.values()):
        log.warning(line)
    else:
        log.info(line)


def reports() -> list[Report]:
    """Every report the children of this process gave, in order, for a run's record."""
    return [dict(r) for r in _reports]


# -- probing, in a short-lived child --------------------------------------------------------------------
def supported_platform() -> str | None:
    """None on x86-64 Linux, else why no layer can be applied."""
    if sys.platform != "linux":
        return f"not Linux ({sys.platform})"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not x86-64 ({platform.machine()})"
    return None


@functools.cache
def probe() -> Report:
    """Which layers this machine offers: each applied and checked in a child, never in this process."""
    why = supported_platform()
    if why:
        return {layer: f"unavailable: {why}" for layer in ("rlimits", *SANDBOX_LAYERS)}
    with tempfile.TemporaryDirectory(prefix="kernelpro-probe-") as tmp:
        os.mkdir(os.path.join(tmp, "scratch"))  # its cwd, which `-m` puts on sys.path: a granted folder
        try:
            out = subprocess.run(
                [sys.executable, "-m", "pipeline.sandbox", "probe", tmp],
                env=child_environ(None),
                cwd=os.path.join(tmp, "scratch"),
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return _probe_failed(f"{type(e).__name__}: {e}")
    try:
        report = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return _probe_failed(f"exit {out.returncode}: {(out.stderr or out.stdout).strip()[-300:]}")
    return {str(k): str(v) for k, v in report.items()}


def _probe_failed(detail: str) -> Report:
    return {layer: f"unavailable: the probe failed ({detail})" for layer in ("rlimits", *SANDBOX_LAYERS)}


def _probe_child(root: str) -> Report:
    """Apply every layer to this (throwaway) process and check that each one holds."""
    base = Path(root)
    (base / "granted").mkdir()
    (base / "granted" / "file").write_text("granted")
    (base / "hidden").mkdir()
    (base / "hidden" / "secret").write_text("secret")
    (base / "scratch").mkdir(exist_ok=True)
    plan = Plan(
        layers=SANDBOX_LAYERS,
        scratch=str(base / "scratch"),
        read=(str(base / "granted"),),
        hide=(str(base / "hidden"),),
    )
    report = apply_early(plan, filesystem=False)
    if report["netns"] == APPLIED and _connect_errno() != errno.ENETUNREACH:
        report["netns"] = "unavailable: a loopback connection was not refused as unreachable"
    report["landlock"] = _attempt(lambda: _landlock(plan, execute=True))
    if report["landlock"] == APPLIED:
        report["landlock"] = _failed(_landlock_holds(base))
    report = apply_late(replace(plan, layers=("landlock",)), report)
    if report["landlock"] == APPLIED:
        report["landlock"] = _failed(_landlock_holds(base) or _exec_refused())
    report = apply_late(replace(plan, layers=("seccomp",)), report)
    if report["seccomp"] == APPLIED:
        report["seccomp"] = _failed(_seccomp_holds())
    return report


def _failed(problem: str) -> str:
    return f"unavailable: {problem}" if problem else APPLIED


def _exec_refused() -> str:
    """Landlock alone (no seccomp yet) must refuse an exec; tried in a forked child."""
    pid = os.fork()
    if pid == 0:
        try:
            os.execv(sys.executable, [sys.executable, "-c", "pass"])
        finally:
            os._exit(13)
    _, status = os.waitpid(pid, 0)
    return "" if os.waitstatus_to_exitcode(status) == 13 else "an exec was not refused"


def _connect_errno() -> int:
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(2)
        s.connect(("127.0.0.1", 9))
    except OSError as e:
        return e.errno or 0
    finally:
        s.close()
    return 0


def _landlock_holds(base: Path) -> str:
    checks = [
        (lambda: (base / "granted" / "file").read_text(), True, "a granted file could not be read"),
        (lambda: (base / "scratch" / "w").write_text("x"), True, "the scratch folder could not be written"),
        (lambda: (base / "hidden" / "secret").read_text(), False, "a hidden file could be read"),
        (lambda: (base / "granted" / "w").write_text("x"), False, "a read-only folder could be written"),
    ]
    for fn, allowed, message in checks:
        try:
            fn()
            ok = allowed
        except PermissionError:
            ok = not allowed
        if not ok:
            return message
    return ""


def _seccomp_holds() -> str:
    import socket
    import threading

    try:
        pid = os.fork()
    except PermissionError:
        pass
    else:
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        return "fork was not refused"
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
        return "an AF_INET socket was not refused"
    except OSError:
        pass
    box: list[bool] = []
    t = threading.Thread(target=lambda: box.append(True))
    t.start()
    t.join(5)
    return "" if box else "a thread could not start"


# -- applying: the early layers (single-threaded), then the late ones -----------------------------------
def apply_early(plan: Plan, filesystem: bool = True) -> Report:
    """Namespaces, rlimits and (with `filesystem`) Landlock's file-system rules, execution still allowed.
    Call while the process is single-threaded, before torch is imported."""
    report: Report = {layer: OFF for layer in ("rlimits", *SANDBOX_LAYERS)}
    why = supported_platform()
    report["rlimits"] = _attempt(lambda: _rlimits(plan))
    if why:
        return {k: (f"unavailable: {why}" if k != "rlimits" else v) for k, v in report.items()}
    ns = [layer for layer in ("userns", "netns") if plan.wants(layer)]
    if ns:
        report.update(_namespaces(ns, plan.loopback))
    if filesystem and plan.wants("landlock"):
        report["landlock"] = _attempt(lambda: _landlock(plan, execute=True))
    return report


def apply_late(plan: Plan, report: Report | None = None) -> Report:
    """No execution (a second Landlock layer, or the only one where none was applied early) and seccomp on
    every thread. Call after the heavy imports and CUDA's initialisation, before any candidate code."""
    report = dict(report or {layer: OFF for layer in ("rlimits", *SANDBOX_LAYERS)})
    why = supported_platform()
    if why:
        return report
    if plan.wants("landlock") and not report.get("landlock", OFF).startswith("unavailable"):
        report["landlock"] = _attempt(lambda: _landlock(plan, execute=False))
    if plan.wants("seccomp"):
        report["seccomp"] = _attempt(lambda: _seccomp(plan.unix_sockets))
    return report


def _attempt(fn) -> str:
    try:
        fn()
    except _Unavailable as e:
        return f"unavailable: {e}"
    except OSError as e:
        return f"unavailable: {e.strerror or e}"
    return APPLIED


class _Unavailable(Exception):
    pass


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _syscall(nr: int, *args) -> int:
    assert _libc is not None
    _libc.syscall.restype = ctypes.c_long
    result = _libc.syscall(ctypes.c_long(nr), *args)
    if result < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return result


def _rlimits(plan: Plan) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    size = plan.file_mb * 2**20
    _lower(resource.RLIMIT_FSIZE, size)
    _lower(resource.RLIMIT_NPROC, plan.max_tasks)  # root ignores it outside a user namespace


def _lower(which: int, value: int) -> None:
    import resource

    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


# namespaces
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


def _namespaces(wanted: list[str], loopback: bool) -> Report:
    assert _libc is not None
    out: Report = {}
    uid, gid = os.getuid(), os.getgid()
    flags = (CLONE_NEWUSER if "userns" in wanted else 0) | (CLONE_NEWNET if "netns" in wanted else 0)
    if _libc.unshare(flags) != 0:
        e = ctypes.get_errno()
        if "userns" in wanted and "netns" in wanted and _libc.unshare(CLONE_NEWUSER) == 0:
            flags = CLONE_NEWUSER
            out["netns"] = f"unavailable: unshare(CLONE_NEWNET): {os.strerror(e)}"
        else:
            why = f"unshare: {os.strerror(e)}"
            if e == errno.EINVAL:
                why += " (the process already runs threads)"
            return {layer: f"unavailable: {why}" for layer in wanted}
    if flags & CLONE_NEWUSER:
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
            _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
            out["userns"] = APPLIED
        except OSError as e:
            out["userns"] = f"unavailable: id maps: {e.strerror}"
    if flags & CLONE_NEWNET:
        out["netns"] = APPLIED
        if loopback:
            try:
                _loopback_up()
            except OSError as e:
                out["netns"] = f"unavailable: bringing lo up: {e.strerror}"
    return out


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s, siocgifflags, struct.pack("16sH22x", b"lo", 0))  # struct ifreq: 40 bytes
        flags = struct.unpack("16sH", got[:18])[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


# Landlock (include/uapi/linux/landlock.h)
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK = 1 << 8, 1 << 9, 1 << 10, 1 << 11
FS_MAKE_SYM, FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 12, 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # valid on a file
READ = FS_READ_FILE | FS_READ_DIR
DEVICE = FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE | FS_IOCTL_DEV
SCRATCH = (
    READ | FS_WRITE_FILE | FS_TRUNCATE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_DIR | FS_MAKE_REG
    | FS_MAKE_SOCK | FS_MAKE_FIFO | FS_MAKE_SYM | FS_REFER
)  # fmt: skip


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when it has none (or it is disabled at boot)."""
    if supported_platform():
        return 0
    try:
        return _syscall(
            SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION
        )
    except OSError:
        return 0


def fs_rules(plan: Plan, execute: bool) -> list[tuple[str, int]]:
    """(path, rights) pairs: the system readable, homes and secrets hidden, the plan's grants, the scratch
    folder writable, the GPU's device files usable. Rights are later cut to what the kernel's ABI knows."""
    extra = FS_EXECUTE if execute else 0
    return [(path, rights | (extra if rights == READ else 0)) for path, rights in _rules(plan)]


@functools.lru_cache(maxsize=4)
def _rules(plan: Plan) -> tuple[tuple[str, int], ...]:
    # Listed once, before the first layer: under it, "/" itself can no longer be listed.
    hidden = sorted({_top(h) for h in plan.hide} | {"/root"})
    excluded = {*hidden, *SYSTEM_SECRETS, "/dev", "/proc"}
    rules = [(p, READ) for p in _all_but("/", excluded)]
    rules += [(e.path, READ) for e in _scandir("/proc") if not e.name.isdigit() and e.path not in excluded]
    # Its own /proc entry, writable: CUDA's initialisation rewrites a file there (Error 304 without it).
    rules.append((f"/proc/{os.getpid()}", READ | FS_WRITE_FILE | FS_TRUNCATE))
    rules += [(p, READ) for p in (*process_paths(), *plan.read)]
    rules.append((plan.scratch, SCRATCH))
    devices = sorted({*DEVICE_FILES, *(p for g in DEVICE_GLOBS for p in glob.glob(g))})
    rules += [(p, DEVICE | (FS_READ_DIR if os.path.isdir(p) else 0)) for p in devices]
    return tuple(rules)


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _all_but(root: str, excluded: set[str]) -> list[str]:
    """Entries under `root` that hold none of `excluded`, descending only into folders that hold some."""
    out = []
    for entry in _scandir(root):
        path = entry.path
        if path in excluded:
            continue
        holds = [x for x in excluded if x.startswith(path + "/")]
        if entry.is_symlink():
            target = os.path.realpath(path)
            # A link is granted as its target: never one that reaches a hidden place (/var/run -> /run).
            if any(_under(target, x) or x.startswith(target.rstrip("/") + "/") for x in excluded):
                continue
            out.append(path)
        elif holds and entry.is_dir(follow_symlinks=False):
            out += _all_but(path, excluded)
        else:
            out.append(path)
    return out


def _landlock(plan: Plan, execute: bool) -> None:
    abi = landlock_abi()
    if abi < 1:
        raise _Unavailable("the kernel has no Landlock")
    fs = _FS_BY_ABI.get(abi, (1 << 16) - 1)
    attr = _RulesetAttr(
        fs=fs,
        net=(NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 else 0,  # no rule: no port for TCP
        scoped=(SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0,
    )
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = _syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    try:
        for path, rights in fs_rules(plan, execute):
            _add_rule(ruleset, path, rights & fs)
        _no_new_privs()
        _syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)


def _add_rule(ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # gone, or not ours to see: nothing to grant
    try:
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            rights &= FILE_RIGHTS
        if rights:
            rule = _PathBeneath(allowed=rights, parent_fd=fd)
            _syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
    finally:
        os.close(fd)


PR_SET_NO_NEW_PRIVS = 38


def _no_new_privs() -> None:
    assert _libc is not None
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(e)}")


# seccomp (BPF on struct seccomp_data: nr at 0, arch at 4, args[i] at 16 + 8 i)
SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 317, 1, 1
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
SYS_CLONE, SYS_SOCKET, CLONE_THREAD, AF_UNIX = 56, 41, 0x10000, 1
DENIED_SYSCALLS: dict[int, int] = {
    **dict.fromkeys((59, 322), errno.EPERM),  # execve, execveat
    **dict.fromkeys((57, 58), errno.EPERM),  # fork, vfork
    435: errno.ENOSYS,  # clone3: its flags live in memory BPF cannot read; glibc then uses clone for threads
    **dict.fromkeys((101, 310, 311, 438), errno.EPERM),  # ptrace, process_vm_readv/writev, pidfd_getfd
    **dict.fromkeys((165, 166, 155, 161, 428, 429, 430, 431, 432, 433, 442), errno.EPERM),  # mounts, chroot
    **dict.fromkeys((246, 320, 169, 167, 168, 172, 173, 163), errno.EPERM),  # kexec, reboot, swap, I/O ports
    **dict.fromkeys((175, 313, 176), errno.EPERM),  # kernel modules
    **dict.fromkeys((321, 323), errno.EPERM),  # bpf, userfaultfd
    **dict.fromkeys((248, 249, 250), errno.EPERM),  # add_key, request_key, keyctl
    **dict.fromkeys((272, 308), errno.EPERM),  # unshare, setns
    **dict.fromkeys((303, 304), errno.EPERM),  # name_to_handle_at, open_by_handle_at (escapes path checks)
    **dict.fromkeys((425, 426, 427), errno.EPERM),  # io_uring: its operations bypass this filter
}


def seccomp_program(unix_sockets: bool) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions; everything not listed is allowed."""
    prog = [
        (LD_ABS, 0, 0, 4),
        (JEQ, 1, 0, AUDIT_ARCH_X86_64),
        (RET, 0, 0, RET_ERRNO | errno.EPERM),  # 32-bit system calls (int 0x80): another numbering
        (LD_ABS, 0, 0, 0),
        (JGE, 0, 1, X32_SYSCALL_BIT),
        (RET, 0, 0, RET_ERRNO | errno.EPERM),  # x32 system calls, likewise
    ]
    for nr, err in DENIED_SYSCALLS.items():
        prog += [(JEQ, 0, 1, nr), (RET, 0, 0, RET_ERRNO | err)]
    # clone: threads (CLONE_THREAD) only
    prog += [
        (JEQ, 0, 4, SYS_CLONE),
        (LD_ABS, 0, 0, 16),
        (JSET, 0, 1, CLONE_THREAD),
        (RET, 0, 0, RET_ALLOW),
        (RET, 0, 0, RET_ERRNO | errno.EPERM),
    ]
    if unix_sockets:
        prog += [
            (JEQ, 0, 4, SYS_SOCKET),
            (LD_ABS, 0, 0, 16),
            (JEQ, 0, 1, AF_UNIX),
            (RET, 0, 0, RET_ALLOW),
            (RET, 0, 0, RET_ERRNO | errno.EAFNOSUPPORT),
        ]
    else:
        prog += [(JEQ, 0, 1, SYS_SOCKET), (RET, 0, 0, RET_ERRNO | errno.EAFNOSUPPORT)]
    prog.append((RET, 0, 0, RET_ALLOW))
    return prog


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp(unix_sockets: bool) -> None:
    prog = seccomp_program(unix_sockets)
    filters = (_SockFilter * len(prog))(*(_SockFilter(*ins) for ins in prog))
    fprog = _SockFprog(len(prog), filters)
    _no_new_privs()
    tid = _syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(fprog))
    if tid > 0:
        raise _Unavailable(f"thread {tid} could not take the filter (TSYNC)")


# -- the command line: the probe child and the trampoline -----------------------------------------------
def main(argv: list[str]) -> int:
    if argv[:1] == ["probe"] and len(argv) == 2:
        print(json.dumps(_probe_child(argv[1])), flush=True)
        return 0
    if argv[:1] == ["exec"] and len(argv) >= 4 and argv[2] == "--":
        plan = Plan.from_json(argv[1])
        report = apply_early(plan, filesystem=False)
        with contextlib.suppress(OSError):
            Path(plan.scratch, "sandbox-early.json").write_text(json.dumps(report))
        cmd = argv[3:]
        os.execvp(cmd[0], cmd)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
