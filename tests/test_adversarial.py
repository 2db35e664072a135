"""The adversarial suite: candidates that cheat the harness, and honest controls that must pass it.

Each case is a folder under tests/adversarial/ holding a candidate (kernel.cu, launcher.py) and expect.toml:

    task = "elementwise_chain"          # a file under tasks/, or else under tests/fixtures/tasks/
    status = "rejected"                 # the verdict's status: rejected | mismatch | suspicious | ok, or a
                                        # list when checks of two statuses may catch it first
    checks = ["static:try_except"]      # reason codes, any one of which may catch it; [] for honest controls
    exploit = "one line: what it tries"

A code `static:X` is the static check of the launcher (pipeline/static_check/, violation "X: ..."); the
other codes are the runtime checks of the worker (pipeline/verify.py, measure.py, energy.py). A case
whose checks name a static code must be caught by the static check alone; the runtime codes beside it are
the backstop should that rule ever be relaxed. A case with only runtime codes must pass the static check,
or the GPU test would never reach the runtime check it is there to exercise. The runtime codes and the status
each carries come from the harness's registry (pipeline/reasons.py).

CPU tests: the folders are complete and consistent, every kernel compiles with the real nvcc, and the static
check agrees with expect.toml. The GPU test runs every case through pipeline.stages.evaluate_candidates.
"""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pipeline import reasons
from pipeline.static_check import CODES
from pipeline.types import Status

ROOT = Path(__file__).resolve().parent.parent
CASES_DIR = Path(__file__).resolve().parent / "adversarial"
TASKS_DIR = ROOT / "tasks"
FIXTURE_TASKS_DIR = ROOT / "tests" / "fixtures" / "tasks"
NVCC_CMD = ("-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17")

STATUSES = ("rejected", "mismatch", "suspicious", "ok")
# Every reason code the harness gives for a cheat, by the status it carries.
STATIC_CODES = CODES
CODES_BY_STATUS: dict[str, tuple[str, ...]] = {
    "rejected": (*(f"{reasons.STATIC}:{c}" for c in STATIC_CODES), *reasons.checks(Status.REJECTED)),
    "mismatch": reasons.checks(Status.MISMATCH),
    "suspicious": reasons.checks(Status.SUSPICIOUS),
}
CODE_STATUS = {code: status for status, codes in CODES_BY_STATUS.items() for code in codes}

MIN_CHEATS = 14
MIN_HONEST = 3
MIN_CODES = 10


@dataclass(frozen=True)
class Case:
    name: str
    folder: Path
    task: str
    statuses: tuple[str, ...]
    checks: tuple[str, ...]
    exploit: str

    @property
    def status(self) -> str:
        return "|".join(self.statuses)

    @property
    def honest(self) -> bool:
        return self.statuses == ("ok",)

    @property
    def static_codes(self) -> tuple[str, ...]:
        """The static codes without their prefix, as check_launcher's violations spell them."""
        return tuple(c.removeprefix("static:") for c in self.checks if c.startswith("static:"))

    @property
    def task_path(self) -> Path:
        builtin = TASKS_DIR / f"{self.task}.py"
        return builtin if builtin.is_file() else FIXTURE_TASKS_DIR / f"{self.task}.py"

    @property
    def launcher(self) -> str:
        return (self.folder / "launcher.py").read_text()

    @property
    def source(self) -> str:
        return (self.folder / "kernel.cu").read_text()


def statuses_of(status: str | list[str]) -> tuple[str, ...]:
    return (status,) if isinstance(status, str) else tuple(status)


def case_names() -> list[str]:
    return sorted(p.name for p in CASES_DIR.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def load_case(name: str) -> Case:
    folder = CASES_DIR / name
    data = tomllib.loads((folder / "expect.toml").read_text())
    return Case(
        name=name,
        folder=folder,
        task=data["task"],
        statuses=statuses_of(data["status"]),
        checks=tuple(data["checks"]),
        exploit=data["exploit"],
    )


NAMES = case_names()


def cases_where(predicate) -> list[str]:
    """Case names selected by their expect.toml; unreadable cases are left to test_case_folder to report."""
    chosen = []
    for name in NAMES:
        try:
            case = load_case(name)
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            continue
        if predicate(case):
            chosen.append(name)
    return chosen


# ------------------------------------------------------------------------------------------- the folders


@pytest.mark.parametrize("name", NAMES)
def test_case_folder(name: str) -> None:
    folder = CASES_DIR / name
    for f in ("kernel.cu", "launcher.py", "expect.toml"):
        assert (folder / f).is_file(), f"{name}: missing {f}"
    data = tomllib.loads((folder / "expect.toml").read_text())
    keys = {"task", "status", "checks", "exploit"}
    assert set(data) == keys, f"{name}: expect.toml has keys {sorted(data)}, want {sorted(keys)}"
    case = load_case(name)
    assert case.task_path.is_file(), f"{name}: no task file {case.task_path}"
    assert case.statuses and set(case.statuses) <= set(STATUSES), (
        f"{name}: status {case.status!r} not in {STATUSES}"
    )
    assert isinstance(data["checks"], list) and all(isinstance(c, str) for c in data["checks"])
    assert isinstance(case.exploit, str) and case.exploit.strip() and "\n" not in case.exploit
    if case.honest:
        assert not case.checks, f"{name}: an honest control names no checks"
        return
    assert case.checks, f"{name}: a cheat names the checks that may catch it"
    unknown = [c for c in case.checks if c not in CODE_STATUS]
    assert not unknown, f"{name}: unknown check codes {unknown}"
    inconsistent = [c for c in case.checks if CODE_STATUS[c] not in case.statuses]
    assert not inconsistent, f"{name}: {inconsistent} give another status than {case.status!r}"
    unused = [s for s in case.statuses if s not in {CODE_STATUS[c] for c in case.checks}]
    assert not unused, f"{name}: no check gives status {unused}"


@pytest.mark.parametrize("name", NAMES)
def test_launcher_parses_and_uses_only_its_own_kernels(name: str) -> None:
    """Every `kernels.NAME` the launcher names is an extern "C" __global__ function of its kernel.cu."""
    case = load_case(name)
    tree = ast.parse(case.launcher)  # the syntax_error code is not what any case is about
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kernels"
    }
    defined = set(re.findall(r'extern\s+"C"\s+__global__\s+void\s+(\w+)', case.source))
    assert defined, f'{name}: kernel.cu defines no extern "C" __global__ kernel'
    assert used, f"{name}: the launcher never names a kernel"
    assert used <= defined, f"{name}: the launcher names {sorted(used - defined)}, not in kernel.cu"


# ------------------------------------------------------------------------------------------- compiling


def _nvcc() -> str | None:
    from pipeline.compile import ToolchainError, find_nvcc
    from pipeline.config import Config

    try:
        return find_nvcc(Config())
    except ToolchainError:
        return None


NVCC = _nvcc()


@pytest.mark.skipif(NVCC is None, reason="no nvcc (CUDA toolkit) on this machine")
@pytest.mark.parametrize("name", NAMES)
def test_kernel_compiles(name: str, tmp_path: Path) -> None:
    """Each kernel.cu builds to an sm_90a cubin, as the pipeline builds it (about a second each)."""
    assert NVCC is not None
    cubin = tmp_path / f"{name}.cubin"
    cmd = [NVCC, *NVCC_CMD, "-o", str(cubin), str(CASES_DIR / name / "kernel.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name}: nvcc failed:\n{proc.stdout}{proc.stderr}"
    assert cubin.stat().st_size > 0


# ---------------------------------------------------------------------------------------- static check


@pytest.mark.parametrize("name", cases_where(lambda c: bool(c.static_codes)))
def test_static_check_catches(name: str) -> None:
    from pipeline.static_check import check_launcher

    case = load_case(name)
    report = check_launcher(case.launcher)
    assert not report.ok, f"{name}: the static check let it through ({case.exploit})"
    caught = [v for v in report.violations if any(v.startswith(f"{code}:") for code in case.static_codes)]
    assert caught, f"{name}: expected one of {list(case.static_codes)}, got {list(report.violations)}"


@pytest.mark.parametrize("name", cases_where(lambda c: not c.static_codes))
def test_static_check_passes_honest_and_runtime_cases(name: str) -> None:
    """Honest controls pass; so do cheats left to the runtime checks, which must get to run."""
    from pipeline.static_check import check_launcher

    case = load_case(name)
    report = check_launcher(case.launcher)
    assert report.ok, f"{name}: rejected statically: {list(report.violations)}"
    assert not report.violations


# ------------------------------------------------------------------------------------------ suite size


def test_suite_is_big_enough() -> None:
    cases = [load_case(n) for n in NAMES]
    cheats = [c for c in cases if not c.honest]
    honest = [c for c in cases if c.honest]
    codes = {code for c in cheats for code in c.checks}
    assert len(cheats) >= MIN_CHEATS, f"{len(cheats)} cheats, want at least {MIN_CHEATS}"
    assert len(honest) >= MIN_HONEST, f"{len(honest)} honest controls, want at least {MIN_HONEST}"
    assert len(codes) >= MIN_CODES, f"{len(codes)} distinct check codes covered ({sorted(codes)})"
    assert {c.task for c in honest} == {c.task for c in cases}, "every task used has an honest control"


# -------------------------------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def gpu_cfg(tmp_path_factory: pytest.TempPathFactory):
    """One home for the module, so the GPU's calibration and the compile cache are measured once."""
    from pipeline.config import load

    # Energy stays on (one case cheats only in the energy loop), with short windows to keep the suite quick.
    return load(
        home=tmp_path_factory.mktemp("adversarial-home"),
        baselines=(),
        timing_budget_s=0.5,
        energy_window_s=0.5,
        energy_repeats=2,
    )


@pytest.fixture(scope="module")
def gpu_pool(gpu_cfg):
    """One worker pool for the module (a worker restarts by itself after a crash or timeout)."""
    from pipeline.stages import open_pool

    with open_pool(gpu_cfg) as pool:
        yield pool


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_harness_verdict(name: str, gpu_cfg, gpu_pool) -> None:
    from pipeline.stages import evaluate_candidates

    case = load_case(name)
    [result] = evaluate_candidates(case.task_path, [case.folder], gpu_cfg, pool=gpu_pool)
    verdict = result.verdict
    why = list(verdict.reasons)
    assert verdict.status.value in case.statuses, (
        f"{name} ({case.exploit}): got {verdict.status.value}, expected {case.status}; reasons: {why}"
    )
    if case.honest:
        assert result.build is not None and result.build.status == Status.OK
        return
    assert any(
        reasons.code_of(r) in case.checks and CODE_STATUS[reasons.code_of(r)] == verdict.status for r in why
    ), f"{name}: no reason starts with one of {list(case.checks)}; reasons: {why}"
