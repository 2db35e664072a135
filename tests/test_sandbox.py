"""OS confinement of the worker (pipeline/sandbox.py), proven with payloads that try to escape.

Each payload is a candidate launcher that tries one escape when it is loaded, then behaves as an honest CPU
stand-in. Every payload runs twice, in real worker processes: without the sandbox, where the escape must
succeed (else the payload is broken and proves nothing), and with it, where it must not. Evidence of an
escape is outside the payload's say where possible: a marker file, a connection our server saw, a secret in
the verdict, the worker replaced by another program.

Convention shared with the static check's suite: payloads create /tmp/kernelpro_escape/<name>, or connect to
the port in /tmp/kernelpro_escape/port and send their name; the tests/adversarial/reach_* launchers follow it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline import jobs, sandbox
from pipeline.config import SANDBOX_LAYERS, load
from pipeline.profile.collect import find_ncu
from pipeline.types import Status, Task, Verdict
from pipeline.worker import JobResult, Worker, WorkerPool

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "tasks"
ADVERSARIAL = ROOT / "tests" / "adversarial"
ESCAPE = Path("/tmp/kernelpro_escape")
IS_ROOT = os.geteuid() == 0


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Asked at collection, not inside the test: a skip there comes after the module's arena is set up and torn
# down, which empties ESCAPE under the tests another process (make test-gpu run by test_cli, beside this
# file's own worker) is running.
needs_cuda = pytest.mark.skipif(not _cuda(), reason="no CUDA device")

HONEST_FORWARD = "        return torch.tanh(x * self.scale) + 0.5 * x\n"


def launcher(attempt: str, name: str) -> str:
    """A small_chain candidate that tries `attempt` at load time and, in forward, says whether it got through
    (with whatever it put in LEAK); a stopped attempt leaves an honest candidate."""
    body = "".join(f"    {line}\n" for line in attempt.strip().splitlines())
    return (
        "import os\nimport torch\nimport torch.nn as nn\n\nLEAK = ''\n"
        f"try:\n{body}    ESCAPED = True\nexcept Exception:\n    ESCAPED = False\n\n\n"
        "class ModelNew(nn.Module):\n"
        "    def __init__(self, scale):\n        super().__init__()\n        self.scale = scale\n\n"
        "    def forward(self, x):\n"
        f"        if ESCAPED:\n            raise RuntimeError('escaped: {name} ' + LEAK)\n" + HONEST_FORWARD
    )


@dataclass(frozen=True)
class Payload:
    name: str
    attempt: str  # Python run at the launcher's load; a raise means it was stopped
    evidence: str  # reason | marker | tcp | unix | exit0 | secret
    stopped_by: tuple[str, ...]  # layers that stop it on their own
    root_only: bool = False


PAYLOADS = [
    Payload("exec_os_system", "assert os.system('true') == 0", "reason", ("landlock", "seccomp")),
    Payload(
        "exec_subprocess",
        "import subprocess\nassert subprocess.run(['true']).returncode == 0",
        "reason",
        ("landlock", "seccomp"),
    ),
    Payload(
        "exec_execv",
        "import shutil\nos.execv(shutil.which('true'), ['true'])",
        "exit0",  # the worker becomes `true` and exits 0
        ("landlock", "seccomp"),
    ),
    Payload(
        "exec_ctypes_system",
        "import ctypes\nassert ctypes.CDLL(None).system(b'true') == 0",
        "reason",
        ("landlock", "seccomp"),
    ),
    Payload(
        "fork",
        "pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)",
        "reason",
        ("seccomp",),
    ),
    Payload(
        "write_outside_scratch",
        f"open('{ESCAPE}/write_outside_scratch', 'w').write('out')",
        "marker",
        ("landlock",),
    ),
    Payload(
        "read_home",
        "LEAK = open(os.path.expanduser('~/secret.txt')).read()",
        "secret",
        ("landlock",),
    ),
    Payload(
        "tcp_connect",
        "import socket\n"
        f"port = int(open('{ESCAPE}/port').read())\n"
        "s = socket.create_connection(('127.0.0.1', port), timeout=5)\n"
        "s.sendall(b'tcp_connect')\ns.close()",
        "tcp",
        ("netns", "landlock", "seccomp"),
    ),
    Payload(
        "unix_connect",
        "import socket\ns = socket.socket(socket.AF_UNIX)\n"
        f"s.connect('{ESCAPE}/sock')\ns.sendall(b'unix_connect')\ns.close()",
        "unix",
        ("seccomp",),
    ),
    Payload("signal_parent", "os.kill(os.getppid(), 0)", "reason", ("landlock",)),
    Payload("parent_environ", "open(f'/proc/{os.getppid()}/environ', 'rb').read()", "reason", ("landlock",)),
    Payload(
        "root_capability",  # root of the machine may rename it; root of a user namespace may not
        "import socket\nsocket.sethostname(socket.gethostname())",
        "reason",
        ("userns",),
        root_only=True,
    ),
]
BY_NAME = {p.name: p for p in PAYLOADS}


def layer_needs(payload: Payload, layer: str) -> str | None:
    """Why `layer` alone cannot stop `payload` on this kernel (Landlock's network and signal rules need
    newer ABIs), or None."""
    abi = sandbox.landlock_abi()
    if layer == "landlock" and payload.name == "tcp_connect" and abi < 4:
        return f"Landlock ABI {abi} has no TCP rules"
    if layer == "landlock" and payload.name == "signal_parent" and abi < 6:
        return f"Landlock ABI {abi} has no signal scope"
    return None


class Listener:
    """A TCP or unix-socket server that records what clients send."""

    def __init__(self, family: int, address: str | tuple[str, int]):
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.seen: list[str] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError), self._changed:
                    self.seen.append(conn.recv(256).decode(errors="replace").strip())
                    self._changed.notify_all()

    def saw(self, name: str, timeout_s: float = 1.5) -> bool:
        """Whether a client sent `name`, waiting a little: this thread may not have read it yet."""
        with self._changed:
            return self._changed.wait_for(lambda: name in self.seen, timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@dataclass
class Arena:
    secret: str
    tcp: Listener
    unix: Listener
    small_chain: Task
    home: Path
    twins: dict[
        str, Task
    ]  # small CPU stand-ins of tasks/*.py, same constructor: what reach_* launchers expect


# A small twin of tasks/elementwise_chain.py: the same constructor and computation on a CPU-sized input.
CHAIN_TWIN = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, scale: float, shift: float):
        super().__init__()
        self.scale = scale
        self.shift = shift

    def forward(self, x):
        y = torch.nn.functional.gelu(x * self.scale + self.shift, approximate="tanh")
        return 0.75 * torch.clamp(y, min=-1.0, max=4.0) + 0.25 * x


def get_inputs():
    return [torch.randn(64, 256)]


def get_init_inputs():
    return [1.7, -0.3]
"""


@pytest.fixture(scope="module")
def arena(tmp_path_factory) -> Iterator[Arena]:
    """A fake $HOME holding a secret, servers on loopback, the escape folder; HOME stays fake for the module,
    so every worker started here (and restarted) inherits it."""
    fake_home = tmp_path_factory.mktemp("fake-home")
    secret = f"kp-secret-{uuid.uuid4().hex}"
    (fake_home / "secret.txt").write_text(secret)
    shutil.rmtree(ESCAPE, ignore_errors=True)
    ESCAPE.mkdir(parents=True)
    tcp = Listener(socket.AF_INET, ("127.0.0.1", 0))
    (ESCAPE / "port").write_text(str(tcp.sock.getsockname()[1]))
    unix = Listener(socket.AF_UNIX, str(ESCAPE / "sock"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(fake_home))
        twin = tmp_path_factory.mktemp("twins") / "elementwise_chain.py"
        twin.write_text(CHAIN_TWIN)
        probe_worker = Worker(load(home=tmp_path_factory.mktemp("probe-home"), device="cpu", sandbox=False))
        tasks = {}
        for name, path in (("small_chain", FIX / "small_chain.py"), ("elementwise_chain", twin)):
            r = probe_worker.request(jobs.Probe(str(path)))
            assert isinstance(r.answer, jobs.Probed), r.reason
            tasks[name] = r.answer.task
        probe_worker.close()
        twins = {"elementwise_chain": tasks["elementwise_chain"]}
        yield Arena(secret, tcp, unix, tasks["small_chain"], fake_home, twins)
    tcp.close()
    unix.close()
    shutil.rmtree(ESCAPE, ignore_errors=True)


def make_worker(home: Path, **kw) -> Worker:
    cfg = load(
        home=home, device="cpu", job_timeout_s=60, worker_memory_mb=4096, sandbox_read=(str(ESCAPE),), **kw
    )
    return Worker(cfg, name="sbx")


@pytest.fixture(scope="module")
def open_worker(arena, tmp_path_factory) -> Iterator[Worker]:
    w = make_worker(tmp_path_factory.mktemp("open"), sandbox=False)
    yield w
    w.close()


@pytest.fixture(scope="module")
def confined_worker(arena, tmp_path_factory) -> Iterator[Worker]:
    w = make_worker(tmp_path_factory.mktemp("confined"))
    yield w
    w.close()


def evaluate(worker: Worker, task: Task, source: str, device: str = "cpu", trials: int = 1) -> JobResult:
    settings = jobs.Settings(device=device, trials=trials, seed=0, time=False)
    return worker.request(jobs.Evaluate(task, jobs.CandidateCode("payload", source), settings))


def verdict(r: JobResult) -> Verdict:
    assert isinstance(r.answer, jobs.Evaluated), r
    return r.answer.verdict


def escaped(payload: Payload, arena: Arena, r: JobResult) -> bool:
    reasons = " ".join(r.answer.verdict.reasons) if isinstance(r.answer, jobs.Evaluated) else ""
    match payload.evidence:
        case "reason":
            return f"escaped: {payload.name}" in reasons
        case "secret":
            return arena.secret in reasons
        case "marker":
            return (ESCAPE / payload.name).exists()
        case "tcp":
            return arena.tcp.saw(payload.name)
        case "unix":
            return arena.unix.saw(payload.name)
        case "exit0":  # the worker became another program, which exited cleanly
            return r.status == Status.CRASH and "exited with code 0" in r.reason
    raise ValueError(payload.evidence)


def attempt(worker: Worker, payload: Payload, arena: Arena, device: str = "cpu") -> bool:
    (ESCAPE / payload.name).unlink(missing_ok=True)
    arena.tcp.seen.clear()
    arena.unix.seen.clear()
    r = evaluate(worker, arena.small_chain, launcher(payload.attempt, payload.name), device)
    return escaped(payload, arena, r)


def applicable(payload: Payload) -> None:
    if payload.root_only and not IS_ROOT:
        pytest.skip("only root holds the capability this payload tries to use")


def available(layer: str) -> None:
    state = sandbox.probe()[layer]
    if state != sandbox.APPLIED:
        pytest.skip(f"{layer} on this machine: {state}")


# -- the sandbox as configured by default -----------------------------------------------------------------
@pytest.mark.parametrize("name", list(BY_NAME))
def test_payload_escapes_without_the_sandbox_and_not_with_it(open_worker, confined_worker, arena, name):
    payload = BY_NAME[name]
    applicable(payload)
    if not any(sandbox.probe()[layer] == sandbox.APPLIED for layer in payload.stopped_by):
        pytest.skip(f"none of {payload.stopped_by} is available here")
    assert attempt(open_worker, payload, arena), f"{name} did not escape even without the sandbox"
    assert not attempt(confined_worker, payload, arena), f"{name} escaped the sandbox"


def test_honest_candidate_verifies_in_the_confined_worker(confined_worker, arena):
    honest = launcher("raise ValueError('tries nothing')", "honest")
    r = evaluate(confined_worker, arena.small_chain, honest, trials=3)
    assert r.ok, r.reason
    v = verdict(r)
    assert v.status == Status.OK and v.trials_passed == 3, v.reasons
    assert confined_worker.sandbox is not None


def test_threads_still_start_under_seccomp(confined_worker, arena):
    # clone with CLONE_THREAD stays allowed; clone3 answers ENOSYS and glibc falls back to clone.
    threads = (
        "import threading\nbox = []\nt = threading.Thread(target=box.append, args=(1,))\nt.start()\nt.join()"
    )
    threads += "\nassert box == [1]"
    r = evaluate(confined_worker, arena.small_chain, launcher(threads, "threads"))
    assert any("escaped: threads" in x for x in verdict(r).reasons), r


def test_job_paths_name_the_files_a_job_reads(arena):
    settings = jobs.Settings(device="cpu")
    standin = jobs.CandidateCode("k", "launcher")
    assert sandbox.job_paths(jobs.Evaluate(arena.small_chain, standin, settings)) == ()  # the source travels
    cand = jobs.CandidateCode("k", "launcher", "/x/k.cubin", ("k",))
    assert sandbox.job_paths(jobs.Evaluate(arena.small_chain, cand, settings)) == ("/x/k.cubin",)
    assert sandbox.job_paths(jobs.SystemProfile(arena.small_chain, settings, cand)) == ("/x/k.cubin",)
    assert sandbox.job_paths(jobs.Ncu("/t.py", 0, cand)) == ("/t.py", "/x/k.cubin")
    assert sandbox.job_paths(jobs.Ncu("/t.py", 0)) == ("/t.py",)  # the reference: no cubin
    assert sandbox.job_paths(jobs.Probe("/t.py")) == ()  # probed by the trusted worker, unconfined


def test_the_system_stays_readable(confined_worker, arena):
    # Read after both Landlock layers, through paths granted as a whole (/usr, /etc's other files).
    reads = "open('/etc/passwd').read(1)\nopen(os.path.realpath('/usr/bin/env'), 'rb').read(1)"
    r = evaluate(confined_worker, arena.small_chain, launcher(reads, "reads"))
    assert r.ok and any("escaped: reads" in x for x in verdict(r).reasons), r


def test_worker_report_matches_the_probe(confined_worker, arena):
    confined_worker.request(jobs.Ping())
    report = confined_worker.sandbox
    assert report is not None
    probed = sandbox.probe()
    for layer in SANDBOX_LAYERS:
        assert (report[layer] == sandbox.APPLIED) == (probed[layer] == sandbox.APPLIED), (
            layer,
            report,
            probed,
        )
    assert report["rlimits"] == sandbox.APPLIED


# -- each layer alone stops what it claims to stop ---------------------------------------------------------
@pytest.mark.parametrize("layer", SANDBOX_LAYERS)
def test_each_layer_alone(layer, arena, tmp_path):
    available(layer)
    w = make_worker(tmp_path / "home", sandbox_layers=(layer,))
    try:
        w.request(jobs.Ping())
        assert w.sandbox is not None and w.sandbox[layer] == sandbox.APPLIED, w.sandbox
        assert all(w.sandbox[other] == sandbox.OFF for other in SANDBOX_LAYERS if other != layer)
        tried = 0
        for payload in PAYLOADS:
            if layer not in payload.stopped_by or (payload.root_only and not IS_ROOT):
                continue
            if layer_needs(payload, layer):
                continue
            assert not attempt(w, payload, arena), f"{payload.name} got past {layer} alone"
            tried += 1
        assert tried, f"no payload exercises {layer}"
    finally:
        w.close()


# -- the launchers of tests/adversarial/reach_* (another suite's escape attempts) -------------------------
REACH = sorted(p for p in ADVERSARIAL.glob("reach_*") if (p / "launcher.py").is_file())


def reach_task(case: Path) -> str:
    return tomllib.loads((case / "expect.toml").read_text())["task"]


def reach_clear(arena: Arena) -> None:
    for p in ESCAPE.iterdir():
        if p.name not in ("port", "sock"):
            p.unlink()
    arena.tcp.seen.clear()
    arena.unix.seen.clear()


def reach_evidence(case: Path, arena: Arena) -> bool:
    made = {p.name for p in ESCAPE.iterdir()} - {"port", "sock"}
    return bool(made) or arena.tcp.saw(case.name, 0.5) or arena.unix.saw(case.name, 0.5)


@pytest.mark.parametrize("case", REACH, ids=[p.name for p in REACH])
def test_reach_launchers(case, open_worker, confined_worker, arena):
    """On the CPU the launcher runs without its kernels (`kernels` is None), against a small twin of its
    task: an escape placed after a kernel launch is reached only on the GPU (test_gpu_reach_launchers)."""
    if reach_task(case) not in arena.twins:
        pytest.skip(f"no CPU twin of the task {reach_task(case)!r}; test_gpu_reach_launchers runs it")
    task = arena.twins[reach_task(case)]
    source = (case / "launcher.py").read_text()
    reach_clear(arena)
    evaluate(open_worker, task, source)
    if not reach_evidence(case, arena):
        pytest.skip(f"{case.name} reaches nothing without its kernels; test_gpu_reach_launchers runs it")
    reach_clear(arena)
    evaluate(confined_worker, task, source)
    assert not reach_evidence(case, arena), f"{case.name} escaped the sandbox"


# -- the orchestrator's side -------------------------------------------------------------------------------
def test_summary_and_the_warning_said_once(caplog, monkeypatch):
    monkeypatch.setattr(sandbox, "_said", set())
    report = {
        "rlimits": "applied",
        "userns": "applied",
        "netns": "applied",
        "landlock": "unavailable: the kernel has no Landlock",
        "seccomp": "applied",
    }
    line = "sandbox: landlock unavailable (the kernel has no Landlock); userns, netns, seccomp active"
    assert sandbox.summary(report) == line
    with caplog.at_level(logging.INFO, logger="kernelpro.sandbox"):
        sandbox.note(report)
        sandbox.note(dict(report))
    said = [r for r in caplog.records if r.name == "kernelpro.sandbox"]
    assert [(r.levelno, r.getMessage()) for r in said] == [(logging.WARNING, line)]
    assert sandbox.reports()[-1] == report


def test_two_workers_say_it_once(arena, tmp_path, caplog, monkeypatch):
    available("seccomp")
    monkeypatch.setattr(sandbox, "_said", set())
    cfg = load(home=tmp_path / "home", device="cpu", job_timeout_s=60, sandbox_layers=("seccomp",))
    with caplog.at_level(logging.INFO, logger="kernelpro.sandbox"), WorkerPool(cfg, [None, None]) as pool:
        results = pool.map([jobs.Ping(), jobs.Ping()])
        assert all(r.ok for r in results)
        assert [w.sandbox for w in pool.workers] == [pool.workers[0].sandbox] * 2
    said = [r.getMessage() for r in caplog.records if r.name == "kernelpro.sandbox"]
    assert said == ["sandbox: seccomp active; userns, netns, landlock off"]


STANDIN_RUNS_A_PROGRAM = """
import subprocess
raise RuntimeError('ran a program: exit ' + str(subprocess.run(['true']).returncode))
"""


def test_reference_worker_is_not_confined(tmp_path):
    available("seccomp")
    task = tmp_path / "runs_a_program.py"
    task.write_text(STANDIN_RUNS_A_PROGRAM)
    cfg = load(home=tmp_path / "home", device="cpu", job_timeout_s=60, sandbox_read=(str(tmp_path),))
    with WorkerPool(cfg, [None]) as pool:
        trusted = pool.reference.request(jobs.Probe(str(task)))
        confined = pool.first.request(jobs.Probe(str(task)))
        assert pool.reference.trusted and pool.reference.sandbox is None
        assert pool.first.sandbox is not None
        small = pool.reference.request(jobs.Probe(str(FIX / "small_chain.py"))).answer
        assert isinstance(small, jobs.Probed)
        evaluate = jobs.Evaluate(small.task, jobs.CandidateCode("k", "launcher"), jobs.Settings(device="cpu"))
        refused = pool.reference.request(evaluate)  # candidate code never goes there
        assert (
            not refused.ok
            and refused.reason == "refused: the unconfined reference worker runs no 'evaluate' job"
        )
    assert "ran a program: exit 0" in trusted.reason
    assert "ran a program" not in confined.reason and "Operation not permitted" in confined.reason


# Patches the worker's job handler from inside the worker (a probe runs the "task" file): every later answer
# then carries a growing module count, as the evaluate answers of worker_jobs do.
STANDIN_COUNTS_MODULES = """
import dataclasses, itertools
from pipeline import worker_jobs
count = itertools.count(1)
original = worker_jobs.handle
def handle(job):
    return dataclasses.replace(original(job), loaded_modules=next(count))
worker_jobs.handle = handle
raise RuntimeError('patched')
"""


def test_worker_is_recycled_at_the_module_cap(tmp_path):
    task = tmp_path / "counts_modules.py"
    task.write_text(STANDIN_COUNTS_MODULES)
    cfg = load(home=tmp_path / "home", device="cpu", job_timeout_s=60, worker_max_modules=2)
    w = Worker(cfg.replace(sandbox_read=(str(tmp_path),)))
    try:
        assert "patched" in w.request(jobs.Probe(str(task))).reason
        first = w.proc.pid
        assert w.request(jobs.Ping()).answer.loaded_modules == 1
        assert w.alive() and w.recycles == 0
        assert w.request(jobs.Ping()).answer.loaded_modules == 2
        assert not w.alive() and w.recycles == 1  # recycled after the answer, before the next job
        again = w.request(jobs.Ping())
        assert again.ok and again.answer.loaded_modules is None  # a fresh, unpatched worker
        assert w.proc.pid != first
    finally:
        w.close()


def test_a_cubin_outside_the_grants_restarts_the_worker_with_a_grant(arena, tmp_path):
    available("landlock")
    hidden = arena.home / "kernels"  # inside the fake home: not readable by default
    hidden.mkdir(exist_ok=True)
    cubin = hidden / "k.cubin"
    cubin.write_bytes(b"not really a cubin")
    w = make_worker(tmp_path / "home")
    try:
        w.request(jobs.Ping())
        plan = sandbox.worker_plan(w.cfg, w.scratch)
        assert plan is not None and not plan.readable(cubin) and not plan.readable(arena.home / "secret.txt")
        pid = w.proc.pid
        # The bogus cubin fails to load (a launch error, no escape): what matters is the grant before it.
        job = jobs.Evaluate(
            arena.small_chain,
            jobs.CandidateCode("k", "launcher", str(cubin), ("k",)),
            jobs.Settings(device="cpu"),
        )
        assert verdict(w.request(job)).status == Status.LAUNCH_ERROR
        assert w.proc.pid != pid and w._extra_read == [str(cubin)]
        plan = sandbox.worker_plan(w.cfg, w.scratch, w._extra_read)
        assert plan.readable(cubin) and not plan.readable(arena.home / "secret.txt")
        assert attempt(w, BY_NAME["read_home"], arena) is False  # the grant is the file, not the home
    finally:
        w.close()


# -- the rules themselves ---------------------------------------------------------------------------------
def test_fs_rules_hide_homes_secrets_and_devices(tmp_path):
    home = tmp_path / "user"
    home.mkdir()
    plan = sandbox.Plan(layers=SANDBOX_LAYERS, scratch=str(tmp_path / "scratch"), hide=(str(home),))
    rules = dict(sandbox.fs_rules(plan, execute=False))
    hidden_top = "/" + home.resolve().parts[1]
    grants = {*sandbox.process_paths(), plan.scratch}
    for path in rules:
        if any(sandbox._under(path, g) for g in grants):
            continue
        assert not sandbox._under(path, hidden_top), path
        assert not sandbox._under(path, "/root"), path
        assert not any(sandbox._under(path, s) for s in sandbox.SYSTEM_SECRETS), path
        assert not path.startswith("/dev/") or path in sandbox.DEVICE_FILES or path.startswith("/dev/nvidia")
        assert (
            not path.startswith("/proc/")
            or not path.split("/")[2].isdigit()
            or path == f"/proc/{os.getpid()}"
        )
    assert all(not rights & sandbox.FS_EXECUTE for rights in rules.values())
    assert rules[plan.scratch] & sandbox.FS_WRITE_FILE
    assert "/etc/passwd" in rules or "/etc" in rules or not os.path.exists("/etc/passwd")
    with_exec = dict(sandbox.fs_rules(plan, execute=True))
    assert any(rights & sandbox.FS_EXECUTE for rights in with_exec.values())


TRAMPOLINED = """
import json, socket, sys
out = {}
for host, port in (("127.0.0.1", int(sys.argv[1])), ("127.0.0.1", 9)):
    try:
        socket.create_connection((host, port), timeout=3).close()
        out[port] = "connected"
    except OSError as e:
        out[port] = e.errno
print(json.dumps(out))
"""


def test_trampoline_puts_a_program_in_its_own_network(arena, tmp_path):
    """How ncu starts: `python -m pipeline.sandbox exec PLAN -- ncu ...`; its tree gets a network namespace
    with only `lo` up (ncu talks to its target over loopback), and none of the machine's network."""
    available("netns")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cfg = load(home=tmp_path / "home", sandbox_ncu_layers=("userns", "netns"))
    plan = sandbox.ncu_plan(cfg, scratch, jobs.Ncu(str(FIX / "small_chain.py"), 0))
    assert plan is not None and plan.loopback and set(plan.layers) <= {"userns", "netns"}
    port = str(arena.tcp.sock.getsockname()[1])
    argv = [sys.executable, "-c", TRAMPOLINED, port]
    for p, expect in ((None, "connected"), (plan, errno.ECONNREFUSED)):
        proc = sandbox.spawn(
            argv, cwd=scratch, scratch=scratch, plan=p, trampoline=True, stdout=subprocess.PIPE
        )
        out, _ = proc.communicate(timeout=60)
        got = json.loads(out.decode().strip().splitlines()[-1])
        assert got[port] == expect, got  # the test's server is out of reach from the namespace
        assert got["9"] == errno.ECONNREFUSED  # lo is up inside: refused, not unreachable
    early = json.loads((scratch / "sandbox-early.json").read_text())
    assert early["netns"] == sandbox.APPLIED and early["landlock"] == sandbox.OFF


def test_doctor_gathers_without_loading_nvml_or_chromadb(tmp_path):
    from pipeline import doctor
    from pipeline.compile import ToolchainError, find_nvcc

    manifest = tmp_path / "home" / "index" / "kp-cutlass-4.2" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"corpus": "cutlass", "version": "4.2", "chunks": 1234}))
    (tmp_path / "home" / "chroma").mkdir()
    before = {m for m in ("pynvml", "chromadb") if m in sys.modules}
    checks = {c.name: c for c in doctor.gather(load(home=tmp_path / "home"))}
    assert {m for m in ("pynvml", "chromadb") if m in sys.modules} == before
    for layer in ("rlimits", *SANDBOX_LAYERS):
        assert checks[f"sandbox: {layer}"].ok == (sandbox.probe()[layer] == sandbox.APPLIED)
    assert checks["source index"].ok and "cutlass 4.2: 1234 chunks" in checks["source index"].detail
    try:
        find_nvcc(load(home=tmp_path / "home"))
        has_nvcc = True
    except ToolchainError:
        has_nvcc = False
    assert checks["nvcc"].ok == has_nvcc
    assert checks["GPU and driver"].ok <= (shutil.which("nvidia-smi") is not None)
    assert doctor.render(list(checks.values())).row_count == len(checks)


def test_config_rejects_unknown_layers():
    with pytest.raises(ValueError, match="sandbox_layers = 'chroot' is not one of"):
        load(sandbox_layers=("seccomp", "chroot"))
    with pytest.raises(ValueError, match="worker_max_modules"):
        load(worker_max_modules=0)


# -- the same payloads on a GPU -----------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
def test_gpu_payloads(arena, tmp_path):
    cfg_kw = dict(device="cuda", job_timeout_s=120, sandbox_read=(str(ESCAPE),), energy=False)
    open_w = Worker(load(home=tmp_path / "open", sandbox=False, **cfg_kw), name="gpu-open")
    shut_w = Worker(load(home=tmp_path / "shut", **cfg_kw), name="gpu-shut")
    try:
        honest = evaluate(shut_w, arena.small_chain, launcher("raise ValueError('honest')", "honest"), "cuda")
        assert honest.ok, honest.reason
        assert verdict(honest).status == Status.OK, honest
        assert shut_w.sandbox is not None and all(
            shut_w.sandbox[x] == sandbox.APPLIED for x in SANDBOX_LAYERS
        )
        for payload in PAYLOADS:
            if payload.root_only and not IS_ROOT:
                continue
            assert attempt(open_w, payload, arena, "cuda"), payload.name
            assert not attempt(shut_w, payload, arena, "cuda"), payload.name
    finally:
        open_w.close()
        shut_w.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_reach_launchers(arena, tmp_path):
    """Every reach_* launcher with its compiled kernels on its real task, sent straight to the workers (the
    static check, which rejects them all, is bypassed): each escapes an open worker, none a confined one."""
    if not REACH:
        pytest.skip("no tests/adversarial/reach_* case yet")
    from pipeline.candidates import load_candidate
    from pipeline.compile import compile_candidates

    cfg_kw = dict(device="cuda", job_timeout_s=120, sandbox_read=(str(ESCAPE),), energy=False)
    open_w = Worker(load(home=tmp_path / "open", sandbox=False, **cfg_kw), name="gpu-open")
    shut_w = Worker(load(home=tmp_path / "shut", **cfg_kw), name="gpu-shut")
    probe_w = Worker(load(home=tmp_path / "probe", sandbox=False, **cfg_kw), trusted=True)
    try:
        tasks: dict[str, Task] = {}
        for name in sorted({reach_task(case) for case in REACH}):
            r = probe_w.request(jobs.Probe(str(ROOT / "tasks" / f"{name}.py")))
            assert isinstance(r.answer, jobs.Probed), r.reason
            tasks[name] = r.answer.task
        cands = [load_candidate(case, reach_task(case)) for case in REACH]
        wrong: list[str] = []
        builds = compile_candidates(cands, shut_w.cfg)  # into the confined worker's home: readable there
        for case, cand, build in zip(REACH, cands, builds, strict=True):
            assert build.cubin_path, build.log
            code = jobs.CandidateCode(
                cand.key,
                cand.launcher,
                str(Path(build.cubin_path).resolve()),
                tuple(sorted(k.name for k in build.resources)),
            )
            settings = jobs.Settings(device="cuda", trials=1, seed=0, time=False)
            job = jobs.Evaluate(tasks[reach_task(case)], code, settings)
            for worker, escapes in ((open_w, True), (shut_w, False)):
                reach_clear(arena)
                r = worker.request(job)
                if reach_evidence(case, arena) != escapes:
                    reasons = r.answer.verdict.reasons if isinstance(r.answer, jobs.Evaluated) else r.reason
                    wrong.append(
                        f"{case.name}: {'no escape from' if escapes else 'escaped'} {worker.name}: {reasons}"
                    )
        # Every case is tried: a launcher that cannot escape even an open worker is broken (on this Python)
        assert not wrong, "\n".join(wrong)
    finally:
        for w in (open_w, shut_w, probe_w):
            w.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_softmax_verifies_confined_and_ncu_profiles_it(tmp_path):
    """The honest softmax in full (timing, profiler, energy) in a confined GPU worker, then profiled: the
    system profile in the confined worker, the counters from ncu with the layers cfg gives its tree."""
    from pipeline import stages

    task, folder = ROOT / "tasks" / "softmax.py", ROOT / "examples" / "candidates" / "softmax"
    cfg = load(home=tmp_path / "home", baselines=("eager",), energy=True, job_timeout_s=180)
    with stages.open_pool(cfg) as pool:
        (r,) = stages.evaluate_candidates(task, [folder], cfg, pool=pool)
        assert r.verdict.status == Status.OK, r.verdict.reasons
        assert pool.first.sandbox is not None and pool.reference.sandbox is None
        pr = stages.profile_candidate(task, folder, cfg, pool=pool, evaluation=r)
    assert pr.evidence is not None and pr.evidence.system is not None, pr.notes
    if find_ncu() is None:
        pytest.skip("ncu not installed")
    assert pr.evidence.kernels, pr.notes
