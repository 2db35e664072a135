"""The `kernelpro` command on bad input: one clear line on stderr, a non-zero exit, nothing half-written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "candidates" / "elementwise_chain"


def kp(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=full_env,
        timeout=300,
    )


def assert_one_line_error(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error:") and needle in lines[0], lines
    assert "Traceback" not in r.stderr


def test_missing_task_file(tmp_path):
    r = kp(
        "eval",
        "--task",
        str(tmp_path / "nope.py"),
        "--candidate",
        str(EXAMPLE),
        "--device",
        "cpu",
        "--home",
        str(tmp_path / "h"),
    )
    assert_one_line_error(r, "task file not found")


@pytest.mark.slow
def test_task_with_syntax_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("class Model(:\n")
    r = kp(
        "eval",
        "--task",
        str(bad),
        "--candidate",
        str(EXAMPLE),
        "--device",
        "cpu",
        "--home",
        str(tmp_path / "h"),
    )
    assert_one_line_error(r, "broken.py: syntax error at line 1")


def test_missing_candidate_folder(tmp_path):
    task = ROOT / "tasks" / "elementwise_chain.py"
    r = kp(
        "export",
        "--task",
        str(task),
        "--candidate",
        str(tmp_path / "none"),
        "-o",
        str(tmp_path / "x.py"),
        "--home",
        str(tmp_path / "h"),
    )
    assert_one_line_error(r, "candidate folder not found")
    assert not (tmp_path / "x.py").exists()


def test_no_gpu_is_a_clear_error(tmp_path):
    # An empty PATH hides nvidia-smi, as on a machine without a GPU driver.
    r = kp("calibrate", "--home", str(tmp_path / "h"), env={"PATH": str(tmp_path)})
    assert_one_line_error(r, "no NVIDIA GPU found")


def test_missing_toolchain_is_a_clear_error(tmp_path):
    task = ROOT / "tasks" / "elementwise_chain.py"
    r = kp(
        "export",
        "--task",
        str(task),
        "--candidate",
        str(EXAMPLE),
        "-o",
        str(tmp_path / "x.py"),
        "--home",
        str(tmp_path / "h"),
        env={"KERNELPRO_NVCC": str(tmp_path / "no-nvcc")},
    )
    assert_one_line_error(r, "nvcc")
    assert not (tmp_path / "x.py").exists()


def test_bad_config_value_is_a_clear_error(tmp_path):
    r = kp("calibrate", "--home", str(tmp_path / "h"), env={"KERNELPRO_TRIALS": "three"})
    assert_one_line_error(r, "KERNELPRO_TRIALS='three' is not a valid int")


def test_unknown_baseline_mode(tmp_path):
    r = kp(
        "baseline",
        "--task",
        str(ROOT / "tasks" / "softmax.py"),
        "--modes",
        "eager,turbo",
        "--home",
        str(tmp_path / "h"),
    )
    assert_one_line_error(r, "unknown baseline mode(s): turbo")


@pytest.mark.slow
def test_export_writes_a_standalone_file(tmp_path):
    out = tmp_path / "model_new.py"
    r = kp(
        "export",
        "--task",
        str(ROOT / "tasks" / "elementwise_chain.py"),
        "--candidate",
        str(EXAMPLE),
        "-o",
        str(out),
        "--home",
        str(tmp_path / "h"),
    )
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    compile(text, str(out), "exec")  # valid Python as a whole
    assert "class ModelNew" in text and "_CUBIN" in text and "CUDA_SOURCE" in text
    assert "import pipeline" not in text and "from pipeline" not in text
    # importing it needs no GPU (the cubin loads on first use) and nothing of kernelpro
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = (
        "import importlib.util as u; s = u.spec_from_file_location('m', 'model_new.py'); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); print(len(m._CUBIN), m.ModelNew.__name__)"
    )
    r2 = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r2.returncode == 0, r2.stderr
    size, name = r2.stdout.split()
    assert int(size) > 1000 and name == "ModelNew"
    assert r2.stdout and not (tmp_path / "pipeline").exists()


@pytest.mark.slow
def test_eval_json_on_cpu_standin(tmp_path):
    """The whole eval path on the CPU: a Python stand-in is statically rejected (no kernel), as JSON."""
    cand = tmp_path / "cand"
    cand.mkdir()
    (cand / "kernel.cu").write_text('extern "C" __global__ void noop() {}\n')
    (cand / "launcher.py").write_text(
        "import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n"
        "    def __init__(self, scale, shift):\n        super().__init__()\n"
        "    def forward(self, x):\n        return torch.tanh(x)\n"
    )
    r = kp(
        "eval",
        "--task",
        str(ROOT / "tasks" / "elementwise_chain.py"),
        "--candidate",
        str(cand),
        "--json",
        "--device",
        "cpu",
        "--home",
        str(tmp_path / "h"),
    )
    assert r.returncode == 1, r.stderr
    (result,) = json.loads(r.stdout)
    assert result["verdict"]["status"] == "rejected"
    assert any(x.startswith("static:no_kernel_launch") for x in result["verdict"]["reasons"])
