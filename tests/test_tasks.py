"""Task loading and probing: the built-in tasks and every kind of bad task file."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.tasks import MAX_TASK_BYTES, TaskError, probe

ROOT = Path(__file__).resolve().parent.parent
BUILTIN = sorted((ROOT / "tasks").glob("*.py"))
L2 = 60 * 2**20


def test_there_are_six_builtin_tasks():
    assert {p.stem for p in BUILTIN} >= {
        "elementwise_chain",
        "softmax",
        "layernorm",
        "matmul_bias_gelu",
        "conv_bias_relu_scale",
        "reduce_mean",
    }


@pytest.mark.parametrize("path", BUILTIN, ids=[p.stem for p in BUILTIN])
def test_builtin_task_probes_with_realistic_sizes(path):
    task = probe(path)
    assert task.id == path.stem
    assert task.min_bytes >= 4 * L2, "data must be several times the 60 MB L2"
    assert task.inputs and task.outputs
    assert task.atol > 0 and task.rtol > 0 and task.norm_tol > 0


def test_matmul_flops_and_bytes():
    task = probe(ROOT / "tasks" / "matmul_bias_gelu.py")
    assert task.dtype == "bfloat16"
    assert task.flops == pytest.approx(2 * 8192**3, rel=0.01)
    # x, weight, bias and the output, 2 bytes each
    assert task.min_bytes == 2 * (8192 * 8192 * 3 + 8192)


def test_conv_flops_counted():
    task = probe(ROOT / "tasks" / "conv_bias_relu_scale.py")
    assert task.flops == pytest.approx(2 * 32 * 128 * 128 * 128 * 64 * 9, rel=0.01)
    assert task.outputs[0].shape == (32, 128, 128, 128)


BAD = {
    "syntax": ("def broken(:\n", "syntax error at line 1"),
    "missing_inputs": (
        "import torch\nclass Model(torch.nn.Module):\n    pass\ndef get_init_inputs():\n    return []\n",
        "missing `get_inputs`",
    ),
    "import_raises": ("raise ImportError('no such thing')\n", "importing the task raised ImportError"),
    "forward_raises": (
        "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        raise ValueError('boom')\n"
        "def get_inputs():\n    return [torch.randn(4, 4)]\ndef get_init_inputs():\n    return []\n",
        "the reference forward raised ValueError: boom",
    ),
    "absurd": (
        "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
        "def get_inputs():\n    return [torch.randn(10**6, 10**6)]\ndef get_init_inputs():\n    return []\n",
        "GiB, more than the",
    ),
    "no_tensors": (
        "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
        "def get_inputs():\n    return [3]\ndef get_init_inputs():\n    return []\n",
        "returned no tensors",
    ),
    "returns_int": (
        "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return 3\n"
        "def get_inputs():\n    return [torch.randn(2)]\ndef get_init_inputs():\n    return []\n",
        "forward must return a tensor",
    ),
    "ctor_raises": (
        "import torch\nclass Model(torch.nn.Module):\n    def __init__(self, n):\n        super().__init__()\n"
        "    def forward(self, x):\n        return x\n"
        "def get_inputs():\n    return [torch.randn(2)]\ndef get_init_inputs():\n    return []\n",
        "building the model raised TypeError",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_task_is_one_clear_line(tmp_path, name):
    source, expected = BAD[name]
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    with pytest.raises(TaskError) as info:
        probe(path)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message and message.startswith(f"{name}.py")


def test_missing_file(tmp_path):
    with pytest.raises(TaskError, match="task file not found"):
        probe(tmp_path / "nope.py")


def test_size_limit_is_sane():
    assert 16 * 2**30 <= MAX_TASK_BYTES <= 141 * 2**30


def test_a_constructor_that_reads_values_is_built_on_the_cpu_and_probed(tmp_path):
    """Swin's constructor calls `.item()` on a linspace, which the meta device cannot answer."""
    task = tmp_path / "reads_values.py"
    task.write_text(
        "import torch\nimport torch.nn as nn\n\n"
        "class Model(nn.Module):\n"
        "    def __init__(self, depth):\n"
        "        super().__init__()\n"
        "        rates = [x.item() for x in torch.linspace(0, 0.1, depth)]\n"
        "        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in rates)\n"
        "    def forward(self, x):\n"
        "        for b in self.blocks:\n"
        "            x = b(x)\n"
        "        return x\n\n"
        "def get_inputs():\n    return [torch.randn(32, 64)]\n\n"
        "def get_init_inputs():\n    return [3]\n"
    )
    t = probe(task)
    assert t.flops == 3 * 2 * 32 * 64 * 64
    assert t.param_bytes == 3 * (64 * 64 + 64) * 4
