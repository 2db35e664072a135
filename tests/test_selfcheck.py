"""The self-consistency mode: each task's reference as a hybrid candidate (pipeline/selfcheck.py).

CPU: every KernelBench task's reference candidate is built and passes the static check as HYBRID; the copy
kernel compiles with the real nvcc; the generated forward runs on the CPU with a stand-in `kernels` whose
kernel does the byte copy in Python, emulating the CUDA kernel's loops; the store resumes, through a real
CPU worker pool. The sweep itself runs on the GPU (benchmarks/selfcheck_sweep.py).
"""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
import time
import tokenize
from pathlib import Path

import numpy
import pytest
import torch

from pipeline import selfcheck
from pipeline.config import load
from pipeline.selfcheck import SelfcheckError, reference_candidate, reference_launcher
from pipeline.static_check import check_launcher
from pipeline.types import Kind, Status
from pipeline.worker_jobs import load_launcher

ROOT = Path(__file__).resolve().parent.parent
KERNELBENCH = ROOT.parent / "shared" / "kernelbench"
KB_TASKS = selfcheck.task_files([KERNELBENCH]) if KERNELBENCH.is_dir() else []
KB_IDS = [selfcheck.task_key(p) for p in KB_TASKS]
needs_kb = pytest.mark.skipif(not KB_TASKS, reason="../shared/kernelbench is not beside the repository")


def names_in(source: str) -> set[str]:
    """Identifier tokens of a source (strings and comments excluded)."""
    toks = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.string for t in toks if t.type == tokenize.NAME}


# ------------------------------------------------------------------------------- every KernelBench task


@needs_kb
def test_kernelbench_folder_is_the_expected_suite() -> None:
    levels = {p.parent.name for p in KB_TASKS}
    assert levels == {"level1", "level2", "level3"}
    assert len(KB_TASKS) == 218


@needs_kb
@pytest.mark.parametrize("path", KB_TASKS, ids=KB_IDS)
def test_reference_candidate_is_built(path: Path) -> None:
    cand = reference_candidate(path)
    assert cand.task_id == path.stem
    assert cand.source == selfcheck.KERNEL_SOURCE
    tree = ast.parse(cand.launcher)
    classes = [s.name for s in tree.body if isinstance(s, ast.ClassDef)]
    assert "ModelNew" in classes
    names = names_in(cand.launcher)
    assert not names & {"Model", "get_inputs", "get_init_inputs", "get_alt_inputs"}
    [model_new] = [s for s in tree.body if isinstance(s, ast.ClassDef) and s.name == "ModelNew"]
    methods = {s.name for s in model_new.body if isinstance(s, ast.FunctionDef)}
    assert {"forward", selfcheck.REFERENCE_FORWARD} <= methods
    # the launcher is a module a worker can compile (load_launcher's first step)
    compile(cand.launcher, f"<{path.stem}>", "exec")


@needs_kb
@pytest.mark.parametrize("path", KB_TASKS, ids=KB_IDS)
def test_static_check_passes_reference_as_hybrid(path: Path) -> None:
    report = check_launcher(reference_candidate(path).launcher)
    assert report.ok, f"{path.stem}: rejected: {list(report.violations)}"
    assert report.kind == Kind.HYBRID, f"{path.stem}: classified {report.kind.value}"
    assert report.kernels_used == (selfcheck.KERNEL_NAME,)


# ------------------------------------------------------------------------------------ the transform


TASK = '''"""A task: Model here in a docstring stays."""
import torch
import torch.nn as nn

SCALE = 2.0  # a constant the model uses


def helper(x):
    return x * SCALE


def make_data(n):  # only get_inputs uses it
    return torch.randn(n, 4)


def unused():
    return 1


class Block(nn.Module):
    def forward(self, x):
        return helper(x)


class Model(nn.Module):
    def __init__(self, k: int):
        super(Model, self).__init__()
        self.block = Block()
        self.k = k

    def forward(self, x, y=None):
        out = self.block(x) + self.k  # Model comment
        assert isinstance(self, Model)
        return out, out.sum(), x[:0], [out > 0, 3]


def get_inputs():
    return [make_data(8)]


def get_init_inputs():
    return [3]


if __name__ == "__main__":
    print(Model(1)(*get_inputs()))
'''


def test_launcher_keeps_what_the_model_uses_and_drops_the_rest() -> None:
    launcher = reference_launcher(TASK, "synthetic.py")
    tree = ast.parse(launcher)
    top = {s.name for s in tree.body if isinstance(s, ast.FunctionDef | ast.ClassDef)}
    assert {"helper", "Block", "ModelNew"} <= top
    assert not top & {"make_data", "unused", "get_inputs", "get_init_inputs", "Model"}
    assert not any(isinstance(s, ast.If) for s in tree.body), "the __main__ block is dropped"
    assert "SCALE = 2.0" in launcher
    assert "super(ModelNew, self).__init__()" in launcher
    assert "isinstance(self, ModelNew)" in launcher
    assert "Model here in a docstring stays" in launcher
    assert "Model" not in names_in(launcher)
    assert launcher.count("import torch\n") == 1 and "import numpy\n" in launcher


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("import torch\nclass Model:\n    def __init__(self):\n        pass\n", "forward"),
        ("class Model:\n    def forward(self, x):\n        return x\n" * 2, "2 top-level classes"),
        ("class Other:\n    pass\n", "0 top-level classes"),
        ("def forward(:\n", "does not parse"),
        ("SIZE = get_inputs()\nclass Model:\n    def forward(self, x):\n        return x\n", "get_inputs"),
        ("class Model:\n    def forward(self, x):\n        return ModelNew\n", "already uses"),
        ("class Model:\n    forward = None\n", "forward"),
    ],
)
def test_untransformable_task_is_one_line_naming_the_task(source: str, why: str) -> None:
    with pytest.raises(SelfcheckError) as info:
        reference_launcher(source, "broken_task.py")
    message = str(info.value)
    assert message.startswith("broken_task.py: ") and why in message and "\n" not in message


def test_reference_candidate_of_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SelfcheckError, match=r"missing\.py"):
        reference_candidate(tmp_path / "missing.py")


# ----------------------------------------------------------- the generated forward, with a Python kernel


class ByteCopyKernels:
    """Stand-in for the runtime's `kernels`: kp_selfcheck_copy done in Python, loop for loop as kernel.cu
    does it (16-byte vectors when both pointers are 16-byte aligned, then bytes, grid-stride)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def kp_selfcheck_copy(self, grid, block, args, shared_mem: int = 0) -> None:
        src, dst, nbytes = args
        assert isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
        assert isinstance(nbytes, numpy.int64), "scalars carry their C type"
        assert src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype
        assert isinstance(grid, int) and 1 <= grid <= 4096 and block == 256 and shared_mem == 0
        n = int(nbytes)
        assert n == src.numel() * src.element_size() == dst.numel() * dst.element_size() > 0
        s = src.reshape(-1).view(torch.uint8).numpy()
        d = dst.reshape(-1).view(torch.uint8).numpy()  # shares dst's memory
        threads = grid * block
        head = 0
        if (src.data_ptr() | dst.data_ptr()) % 16 == 0:
            vectors = n // 16
            for start in range(min(threads, vectors)):
                for i in range(start, vectors, threads):
                    d[16 * i : 16 * i + 16] = s[16 * i : 16 * i + 16]
            head = vectors * 16
        for start in range(min(threads, n - head)):
            for i in range(head + start, n, threads):
                d[i] = s[i]
        self.calls.append((grid, block, n))


def build_pair(source: str, init: list, kernels: ByteCopyKernels):
    """Model from the task source and ModelNew from its launcher, with the same weights."""
    task_ns: dict = {}
    exec(compile(source, "<task>", "exec"), task_ns)
    model_new = load_launcher(reference_launcher(source, "t.py"), kernels, "selfcheck")
    torch.manual_seed(0)
    ref = task_ns["Model"](*init)
    torch.manual_seed(0)
    new = model_new(*init)
    return ref, new


def test_forward_copies_every_tensor_through_the_kernel() -> None:
    kernels = ByteCopyKernels()
    ref, new = build_pair(TASK, [3], kernels)
    x = torch.randn(5, 4)
    expected = ref(x)
    got = new(x)
    assert isinstance(got, tuple) and len(got) == 4
    out, total, empty, (mask, three) = got
    assert torch.equal(out, expected[0]) and torch.equal(total, expected[1])
    assert total.dim() == 0 and empty.shape == (0, 4) and mask.dtype == torch.bool
    assert torch.equal(mask, expected[3][0]) and three == 3
    # the tensor, the 0-d sum and the bool mask were copied; the empty slice launched nothing
    assert sorted(n for _, _, n in kernels.calls) == sorted([20 * 4, 4, 20])
    assert out.data_ptr() != expected[0].data_ptr()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(1000, dtype=torch.float64).reshape(10, 100).t(),  # non-contiguous
        lambda: torch.arange(37, dtype=torch.int16)[1:],  # starts 2 bytes in: the byte path
        lambda: torch.tensor(7, dtype=torch.int8),  # 0-d, a single byte
        lambda: torch.randn(3, 5, dtype=torch.complex64),
        lambda: torch.empty(0, 3),
    ],
    ids=["transposed_f64", "offset_int16", "scalar_int8", "complex64", "empty"],
)
def test_copy_handles_any_layout_and_dtype(make) -> None:
    source = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
    kernels = ByteCopyKernels()
    _, new = build_pair(source, [], kernels)
    x = make()
    y = new(x)
    assert torch.equal(y, x) and y.dtype == x.dtype and y.shape == x.shape
    assert y.is_contiguous()
    assert len(kernels.calls) == (0 if x.numel() == 0 else 1)
    if x.numel():
        assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_builtin_task_reference_candidate_matches_its_model() -> None:
    path = ROOT / "tasks" / "elementwise_chain.py"
    source = path.read_text()
    kernels = ByteCopyKernels()
    ns: dict = {}
    exec(compile(source, str(path), "exec"), ns)
    ref, new = build_pair(source, list(ns["get_init_inputs"]()), kernels)
    x = torch.randn(4, 8)
    assert torch.equal(new(x), ref(x))
    assert kernels.calls == [(1, 256, 4 * 8 * 4)]


# -------------------------------------------------------------------------------------------- the kernel


def test_kernel_compiles_for_sm90a(tmp_path: Path) -> None:
    from pipeline.compile import ToolchainError, compile_candidates, find_nvcc

    cfg = load(home=tmp_path / "home", arch="sm_90a")
    try:
        find_nvcc(cfg)
    except ToolchainError:
        pytest.skip("no nvcc on this machine")
    [build] = compile_candidates([reference_candidate(ROOT / "tasks" / "softmax.py")], cfg)
    assert build.status == Status.OK, build.log
    assert build.arch == "sm_90a" and Path(build.cubin_path).stat().st_size > 0
    assert [r.name for r in build.resources] == [selfcheck.KERNEL_NAME]
    assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in build.resources)


# ------------------------------------------------------------------------------------ causes and summary


def row(key: str, status: str, eager: bool | None = True, seconds: float = 1.0, reasons=()) -> dict:
    level, task = key.split("/")
    reasons = list(reasons)
    return {
        "key": key,
        "task": task,
        "level": level,
        "status": status,
        "reasons": reasons,
        "eager_runs": eager,
        "cause": selfcheck.cause_of(status, reasons, eager),
        "code": None,
        "seconds": seconds,
        "date": "2026-12-01T00:00:00+00:00",
        "environment": {"gpu": "NVIDIA H200", "torch": "2.11.0"},
    }


def test_cause_of_failures() -> None:
    cause = selfcheck.cause_of
    assert cause("ok", [], True) is None
    assert cause("unbuildable", ["transform: x"], None) == "transform"
    assert cause("launch_error", ["out_of_memory: out of GPU memory: x"], False) == "eager_fails"
    assert cause("launch_error", ["out_of_memory: out of GPU memory: x"], True) == "out_of_memory"
    # By code, never by the text: a launch error that mentions memory is a launch error.
    assert (
        cause("launch_error", ["launch_error: forward raised RuntimeError: out of GPU memory"], True)
        == "launch_error"
    )
    assert cause("rejected", ["static:forbidden_import: line 3: imports einops"], True) == "static_check"
    assert cause("rejected", ["note: hybrid", "kernels_no_work: 2 us"], True) == "runtime_check"
    assert cause("mismatch", ["mismatch: 3 of 9 elements (trial 0, first run)"], True) == "tolerance"
    assert cause("mismatch", ["shape_mismatch: output 0"], True) == "output_format"
    assert cause("suspicious", ["too_fast: 12x over eager"], True) == "too_fast"
    assert cause("error", ["task_error: TaskError: x"], None) == "task_error"
    assert set(selfcheck.CAUSES) >= {"transform", "eager_fails", "tolerance", "runtime_check"}


def test_summary_counts_pass_rate_over_tasks_where_eager_runs() -> None:
    rows = [
        row("level1/1_a", "ok", seconds=2.0),
        row("level1/2_b", "mismatch", reasons=["mismatch: far off (trial 0, first run)"], seconds=4.0),
        row("level2/1_c", "launch_error", eager=False, reasons=["out_of_memory: out of GPU memory"]),
        row("level2/2_d", "ok", seconds=10.0),
    ]
    s = selfcheck.summarize(rows)
    assert (s["tasks"], s["ok"], s["eager_runs"], s["eager_fails"]) == (4, 2, 3, 1)
    assert s["pass_rate"] == pytest.approx(2 / 3)
    assert s["by_level"]["level1"]["pass_rate"] == pytest.approx(0.5)
    assert s["by_level"]["level2"]["pass_rate"] == pytest.approx(1.0)
    assert [f["key"] for f in s["failures"]] == ["level1/2_b", "level2/1_c"]
    assert s["causes"] == {"tolerance": 1, "eager_fails": 1}
    assert s["seconds"] == {"median": 3.0, "max": 10.0, "total": 17.0}
    md = selfcheck.markdown(rows)
    assert "| all | 4 | 3 | 2 | 66.7% |" in md
    assert "| level1/2_b | mismatch | tolerance | yes | mismatch: far off (trial 0, first run) |" in md
    assert "NVIDIA H200" in md


def test_task_files_orders_by_level_and_number(tmp_path: Path) -> None:
    for rel in ("level2/10_x.py", "level2/9_y.py", "level1/2_z.py", "level3/1_w.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    found = selfcheck.task_files([tmp_path])
    assert [selfcheck.task_key(p) for p in found] == ["level1/2_z", "level2/9_y", "level2/10_x", "level3/1_w"]
    assert [p.stem for p in selfcheck.task_files([tmp_path], levels=["level2"])] == ["9_y", "10_x"]


# ------------------------------------------------------------------------- the store, with a CPU pool

SMALL = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x) * {k}


def get_inputs():
    return [torch.randn(64, 16)]


def get_init_inputs():
    return []
"""


def suite(tmp_path: Path) -> list[Path]:
    paths = []
    for level, name, text in (
        ("level1", "1_relu", SMALL.format(k=1)),
        ("level1", "2_relu_scaled", SMALL.format(k=2)),
        ("level2", "1_no_forward", "import torch\nclass Model(torch.nn.Module):\n    pass\n"),
        ("level2", "2_bad_inputs", SMALL.format(k=3).replace("return [torch.randn", "return [1 / 0, torch")),
    ):
        path = tmp_path / "suite" / level / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths.append(path)
    return paths


@pytest.mark.slow
def test_store_resumes_through_a_real_cpu_pool(tmp_path: Path) -> None:
    cfg = selfcheck.sweep_config(load(home=tmp_path / "home", device="cpu", job_timeout_s=120))
    paths = suite(tmp_path)
    store = tmp_path / "store.jsonl"
    seen: list[tuple[int, int, str]] = []

    first = selfcheck.run_suite(paths, cfg, store, progress=lambda *a: seen.append(a))
    assert first.ran == tuple(selfcheck.task_key(p) for p in paths) and not first.skipped
    assert seen == [(1, 4, "1_relu"), (2, 4, "2_relu_scaled"), (3, 4, "1_no_forward"), (4, 4, "2_bad_inputs")]
    rows = {r["key"]: r for r in first.rows}
    no_forward, bad = rows["level2/1_no_forward"], rows["level2/2_bad_inputs"]
    assert no_forward["status"] == "unbuildable" and no_forward["cause"] == "transform"
    assert "1_no_forward.py" in no_forward["reasons"][0]
    assert (
        bad["status"] == "error" and bad["cause"] == "task_error" and "ZeroDivisionError" in bad["reasons"][0]
    )
    for r in rows.values():
        assert r["level"] in ("level1", "level2") and r["seconds"] >= 0 and r["date"].startswith("20")
        assert r["eager_runs"] is None and "CUDA" in r["eager_error"]  # the baseline job needs a GPU
        assert r["environment"]["torch"] == torch.__version__
    # Here the candidate cannot load its cubin (no GPU): a launch error, reported as a value.
    relu = rows["level1/1_relu"]
    assert relu["status"] == Status.LAUNCH_ERROR.value and relu["kind"] == Kind.HYBRID.value
    assert relu["candidate_key"] == reference_candidate(paths[0]).key

    again = selfcheck.run_suite(paths, cfg, store)
    assert again.ran == () and len(again.skipped) == 4 and len(again.rows) == 4

    # A kill in the middle of writing the last row: the partial line is ignored, and that task is redone.
    lines = store.read_text().splitlines(keepends=True)
    store.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    assert len(selfcheck.read_store(store)) == 3
    resumed = selfcheck.run_suite(paths, cfg, store)
    assert resumed.ran == ("level2/2_bad_inputs",) and len(resumed.skipped) == 3
    text = store.read_text()
    assert text.endswith("\n") and [json.loads(line)["key"] for line in text.splitlines()] == list(rows)


def test_budget_stops_before_starting_a_task(tmp_path: Path) -> None:
    cfg = load(home=tmp_path / "home", device="cpu")
    paths = suite(tmp_path)[:2]
    store = tmp_path / "store.jsonl"
    result = selfcheck.run_suite(paths, cfg, store, budget_s=5.0, reserve_s=10.0)
    assert result.ran == () and result.remaining == tuple(selfcheck.task_key(p) for p in paths)
    assert result.stopped and "budget" in result.stopped
    assert selfcheck.read_store(store) == []


# ------------------------------------------------------------------------------------------- the scripts


@pytest.mark.parametrize("script", ["selfcheck_sweep.py", "adversarial_suite.py"])
def test_script_help_runs_without_the_index_stack(script: str) -> None:
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['{script}', '--help']\n"
        "try:\n"
        f"    runpy.run_path('benchmarks/{script}', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('chromadb', 'llama_index', 'torch'))\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and "HEAVY []" in proc.stdout


@pytest.mark.slow
def test_budget_ending_mid_task_leaves_it_out_of_the_store(tmp_path: Path) -> None:
    """The task in flight when the budget ends is stopped (its job capped) and not written: it is redone."""
    cfg = load(home=tmp_path / "home", device="cpu", job_timeout_s=120)
    slow = tmp_path / "suite" / "level1" / "1_slow_inputs.py"
    slow.parent.mkdir(parents=True)
    slow.write_text(
        SMALL.format(k=1).replace(
            "def get_inputs():\n", "def get_inputs():\n    import time\n    time.sleep(60)\n"
        )
    )
    store = tmp_path / "store.jsonl"
    t0 = time.monotonic()
    result = selfcheck.run_suite([slow], cfg, store, budget_s=12.0, reserve_s=1.0)
    assert time.monotonic() - t0 < 30, "the probe was cut at the budget, not at its own 120 s limit"
    assert result.ran == () and result.remaining == ("level1/1_slow_inputs",)
    assert result.stopped and "ran out during level1/1_slow_inputs" in result.stopped
    assert selfcheck.read_store(store) == []
