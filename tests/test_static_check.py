"""pipeline.static_check: launcher snippets that must pass, be classified HYBRID, or be caught by each rule."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pipeline.static_check.rules as rules_package
from pipeline.static_check import CODES, RUNTIME_METHODS, Violation, allowlist, check_launcher
from pipeline.static_check.rules import RULES, Rule
from pipeline.static_check.rules.dynamic_access import KERNELS_CLASS_ATTRS
from pipeline.types import Kind

HEADER = """\
import math
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
"""


def src(body: str) -> str:
    return HEADER + textwrap.dedent(body)


def launcher(forward: str, init: str = "", top: str = "", params: str = "x") -> str:
    """A ModelNew whose forward body is `forward` (and __init__ body `init`), after module-level `top`."""
    init_body = textwrap.indent(textwrap.dedent(init), " " * 8) if init.strip() else ""
    return (
        HEADER
        + textwrap.dedent(top)
        + "\n\nclass ModelNew(nn.Module):\n"
        + "    def __init__(self):\n"
        + "        super().__init__()\n"
        + init_body
        + f"\n    def forward(self, {params}):\n"
        + textwrap.indent(textwrap.dedent(forward), " " * 8)
    )


LAUNCH = "kernels.scale(((x.numel() + 255) // 256,), (256,), (x, out, np.int64(x.numel())))\n"

# --- honest launchers: pass, CUSTOM --------------------------------------------------------------------

CUSTOM = [
    (
        "elementwise_chain",
        src("""
        class ModelNew(nn.Module):
            def __init__(self, scale: float, shift: float):
                super().__init__()
                self.scale = np.float32(scale)
                self.shift = np.float32(shift)

            def forward(self, x):
                x = x.contiguous()
                out = torch.empty_like(x)
                n = x.numel()
                kernels.chain(((n + 1023) // 1024,), (256,), (x, out, self.scale, self.shift, np.int64(n)))
                return out
        """),
        ("chain",),
    ),
    (
        "plumbing_and_helpers",
        src("""
        BLOCK = 256


        def cdiv(a: int, b: int) -> int:
            return (a + b - 1) // b


        class ModelNew(nn.Module):
            def __init__(self, in_features: int, out_features: int, eps: float = 1e-5):
                super().__init__()
                self.weight = nn.Parameter(torch.randn(out_features, in_features))
                self.eps = np.float32(eps)
                self.tile = 64

            @torch.no_grad()
            def forward(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
                B, C, H, W = x.shape
                x = x.contiguous().view(B, -1)
                rows = x.size(0)
                hw = H * W
                grid = (cdiv(rows * hw, BLOCK), min(math.ceil(C / self.tile), 65535))
                acc = torch.zeros(rows, device=x.device, dtype=torch.float32)
                out = x.new_empty((rows, self.weight.shape[0]))
                out.zero_()
                acc.fill_(0.0)
                self._launch(grid, x, out, acc, rows)
                if self.eps.item() > 0 and dim == 1:
                    pass
                return out.view(B, -1, 1).squeeze(-1).reshape(rows, -1)

            def _launch(self, grid, x, out, acc, rows):
                n = np.int32(rows * (x.stride(0) + 1))
                kernels.rows_gemv(grid, (BLOCK,), (x, self.weight, out, acc, self.eps, n), shared_mem=4 * BLOCK)
        """),
        ("rows_gemv",),
    ),
    (
        "parameters_of_nn_modules_fed_to_kernels",
        src("""
        class ModelNew(nn.Module):
            def __init__(self, n_in, n_out):
                nn.Module.__init__(self)
                self.linear = nn.Linear(n_in, n_out)
                self.register_buffer("shift", torch.zeros(n_out))

            def forward(self, x):
                out = torch.empty(x.shape[0], self.linear.out_features, device=x.device)
                k = kernels.linear_bias
                k((x.shape[0],), (128,), (x, self.linear.weight, self.linear.bias, self.shift, out))
                return out
        """),
        ("linear_bias",),
    ),
    (
        "kernels_passed_to_a_function",
        src("""
        def run(k, x, out):
            n = x.numel()
            k.relu(((n + 127) // 128,), (128,), (x, out, np.int64(n)))
            return out


        class ModelNew(nn.Module):
            def __init__(self):
                super(ModelNew, self).__init__()

            def forward(self, input):
                out = torch.empty_like(input)
                return run(kernels, input.contiguous(), out)
        """),
        ("relu",),
    ),
    (
        "kernel_bound_on_self",
        src("""
        import functools


        class ModelNew(nn.Module):
            def __init__(self):
                super().__init__()
                self.pre = functools.partial(kernels.pre, (1,), (32,))

            def forward(self, x):
                out = torch.empty_like(x)
                self.pre((x, out))
                return out
        """),
        ("pre",),
    ),
    (
        "launcher_submodule",
        src("""
        class Block(nn.Module):
            def forward(self, x):
                out = torch.empty_like(x)
                kernels.block((x.shape[0],), (128,), (x, out))
                return out


        class ModelNew(nn.Module):
            def __init__(self):
                super().__init__()
                self.block = Block()

            def forward(self, x):
                return self.block(x)
        """),
        ("block",),
    ),
]


@pytest.mark.parametrize(("source", "kernels"), [c[1:] for c in CUSTOM], ids=[c[0] for c in CUSTOM])
def test_honest_custom_launchers_pass(source: str, kernels: tuple[str, ...]) -> None:
    report = check_launcher(source)
    assert report.violations == ()
    assert report.ok
    assert report.kind is Kind.CUSTOM
    assert report.library_ops == ()
    assert report.kernels_used == kernels


# --- hybrid launchers: pass, HYBRID, with the library calls named ------------------------------------------

HYBRID = [
    (
        "conv_then_kernel_epilogue",
        src("""
        class ModelNew(nn.Module):
            def __init__(self, in_channels, out_channels, kernel_size, bias_shape):
                super().__init__()
                self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
                self.bias = nn.Parameter(torch.randn(bias_shape))

            def forward(self, x):
                y = self.conv(x)
                out = torch.empty_like(y)
                n = y.numel()
                hw = y.shape[2] * y.shape[3]
                kernels.bias_relu(
                    ((n + 255) // 256,), (256,), (y, self.bias, out, np.int32(hw), np.int32(y.shape[1]), np.int64(n))
                )
                return out
        """),
        ("self.conv (nn.Conv2d)",),
        ("bias_relu",),
    ),
    (
        "matmul_then_kernel",
        src("""
        class ModelNew(nn.Module):
            def forward(self, a, b):
                c = torch.matmul(a, b)
                out = torch.empty_like(c)
                n = c.numel()
                kernels.gelu(((n + 255) // 256,), (256,), (c, out, np.int64(n)))
                return out
        """),
        ("torch.matmul",),
        ("gelu",),
    ),
    (
        "from_import_alias_and_duplicates",
        src("""
        from torch import matmul as mm


        class ModelNew(nn.Module):
            def forward(self, a, b):
                c = mm(a, b)
                d = mm(c, b)
                out = torch.empty_like(d)
                kernels.gelu((d.numel() // 256 + 1,), (256,), (d, out, np.int64(d.numel())))
                return out
        """),
        ("torch.matmul",),
        ("gelu",),
    ),
    (
        "operators_functional_and_tensor_methods",
        src("""
        class ModelNew(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.weight = nn.Parameter(torch.randn(d, d))
                self.gain = nn.Parameter(torch.ones(d))
                self.act = F.gelu

            def forward(self, x):
                y = x @ self.weight.t()
                y = F.softmax(y, dim=-1)
                s = y.sum(dim=1)
                z = s * self.gain
                z = self.act(z)
                out = torch.empty_like(z)
                kernels.finish((z.shape[0],), (128,), (z, out))
                return out
        """),
        ("matmul (@)", "F.softmax", "Tensor.sum", "mul (*)", "F.gelu"),
        ("finish",),
    ),
    (
        "compute_in_a_helper_and_a_module_list",
        src("""
        class ModelNew(nn.Module):
            def __init__(self, d, depth):
                super().__init__()
                self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(depth)])

            def forward(self, x):
                for layer in self.layers:
                    x = layer(x)
                x = torch.exp(self._scale(x, 2.0))
                out = torch.empty_like(x)
                kernels.norm((x.shape[0],), (256,), (x, out))
                return out

            def _scale(self, t, s):
                return t * s  # t is a tensor only because forward passes one
        """),
        ("self.layers (nn.ModuleList)", "torch.exp", "mul (*)"),
        ("norm",),
    ),
    (
        "torch_functions_passed_as_values",
        src("""
        import functools


        class ModelNew(nn.Module):
            def forward(self, *xs):
                y = functools.reduce(torch.matmul, xs)
                out = torch.empty(y.shape, dtype=torch.float32, device=y.device)
                kernels.k((1,), (1,), (y, out))
                return out if isinstance(out, torch.Tensor) else None
        """),
        ("torch.matmul",),
        ("k",),
    ),
]

HYBRID.append(
    (
        "aten_fallback_of_the_expert",
        src("""
        class ModelNew(nn.Module):
            def forward(self, x):
                s = torch.ops.aten.linalg_svd.default(x)[1]
                out = torch.empty_like(s)
                kernels.relu((1,), (128,), (s, out))
                return out
        """),
        ("torch.ops.aten.linalg_svd.default",),
        ("relu",),
    )
)
HYBRID.append(
    (
        "varargs_forward_hands_its_tensors_on",
        src("""
        class ModelNew(nn.Module):
            def reference(self, a, b):
                return a.unsqueeze(1) * b

            def forward(self, *args, **kwargs):
                y = self.reference(*args, **kwargs)
                out = torch.empty_like(y)
                kernels.copy((1,), (1,), (y, out))
                return out
        """),
        ("mul (*)",),
        ("copy",),
    )
)


@pytest.mark.parametrize(("source", "ops", "kernels"), [c[1:] for c in HYBRID], ids=[c[0] for c in HYBRID])
def test_hybrid_launchers_pass_and_name_their_library_calls(
    source: str, ops: tuple[str, ...], kernels: tuple[str, ...]
) -> None:
    report = check_launcher(source)
    assert report.violations == ()
    assert report.ok
    assert report.kind is Kind.HYBRID
    assert report.library_ops == ops
    assert report.kernels_used == kernels


# --- each rule, caught ------------------------------------------------------------------------------------

VIOLATIONS = [
    # syntax_error
    ("syntax", "class ModelNew(nn.Module):\n    def forward(self, x)\n        return x\n", {"syntax_error"}),
    # no_model_new
    (
        "no_class",
        src("class Net(nn.Module):\n    def forward(self, x):\n        return x\n"),
        {"no_model_new"},
    ),
    (
        "rebound",
        launcher("out = torch.empty_like(x)\n" + LAUNCH + "return out\n", top="")
        + "\n\nclass _Other(nn.Module):\n    pass\n\n\nModelNew = _Other\n",
        {"no_model_new"},
    ),
    # subclass_reference
    (
        "subclass_model",
        src("""
        class ModelNew(Model):
            def forward(self, x):
                out = torch.empty_like(x)
                kernels.k((1,), (1,), (x, out))
                return out
        """),
        {"subclass_reference"},
    ),
    (
        "subclass_linear",
        src("""
        class ModelNew(nn.Linear):
            def forward(self, x):
                out = torch.empty_like(x)
                kernels.k((1,), (1,), (x, out))
                return out
        """),
        {"subclass_reference"},
    ),
    # calls_reference
    (
        "instantiates_model",
        launcher("out = torch.empty_like(x)\n" + LAUNCH + "return out\n", init="self.ref = Model()\n"),
        {"calls_reference"},
    ),
    (
        "imports_reference",
        launcher(
            "out = torch.empty_like(x)\n" + LAUNCH + "return out\n", top="from reference import Model\n"
        ),
        {"calls_reference"},
    ),
    (
        "calls_get_inputs",
        launcher("x = get_inputs()[0]\nout = torch.empty_like(x)\n" + LAUNCH + "return out\n"),
        {"calls_reference"},
    ),
    (
        "imports_main",
        launcher("out = torch.empty_like(x)\n" + LAUNCH + "return out\n", top="import __main__\n"),
        {"calls_reference"},
    ),
    # forbidden_import
    *[
        (
            f"imports_{name.split()[-1]}",
            launcher("out = torch.empty_like(x)\n" + LAUNCH + "return out\n", top=name + "\n"),
            {"forbidden_import"},
        )
        for name in (
            "import os",
            "import threading",
            "from concurrent.futures import ThreadPoolExecutor",
            "import subprocess",
            "import ctypes",
            "import cupy",
            "from pipeline import runtime",
            "import torch.utils.cpp_extension",
        )
    ],
    (
        "reaches_cpp_extension",
        launcher("ext = torch.utils.cpp_extension.load_inline('e', '', cuda_sources='')\n" + LAUNCH),
        {"forbidden_import"},
    ),
    # try_except
    (
        "fallback_to_torch",
        launcher(
            "out = torch.empty_like(x)\ntry:\n    "
            + LAUNCH
            + "except Exception:\n    out = F.relu(x)\nreturn out\n"
        ),
        {"try_except"},
    ),
    (
        "context_manager_swallows",
        launcher(
            "out = torch.empty_like(x)\nwith Quiet():\n    " + LAUNCH + "return out\n",
            top="""
            class Quiet:
                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    return True
            """,
        ),
        {"try_except"},
    ),
    # monkey_patch
    *[
        (
            f"patch_{i}",
            launcher("out = torch.empty_like(x)\n" + LAUNCH + "return out\n", top=top),
            {"monkey_patch"},
        )
        for i, top in enumerate(
            (
                "torch.matmul = lambda a, b: a\n",
                "F.gelu = F.relu\n",
                "np.fast = True\n",
                "kernels.scale = kernels.copy\n",
                "setattr(torch, 'matmul', lambda a, b: a)\n",
                "del torch.nn.functional.relu\n",
                "t = torch\nt.mm = None\n",
                "torch.set_float32_matmul_precision('high')\n",
            )
        )
    ],
    (
        "global_statement",
        launcher(
            "global CALLS\nCALLS += 1\nout = torch.empty_like(x)\n" + LAUNCH + "return out\n",
            top="CALLS = 0\n",
        ),
        {"monkey_patch"},
    ),
    (
        "patch_in_forward_through_type",
        launcher("type(x).add = lambda a, b: a\nout = torch.empty_like(x)\n" + LAUNCH + "return out\n"),
        {"monkey_patch"},
    ),
    (
        "patch_through_a_function_result",
        launcher(
            "get().matmul = None\nout = torch.empty_like(x)\n" + LAUNCH + "return out\n",
            top="def get():\n    return torch\n",
        ),
        {"monkey_patch", "dynamic_access"},  # `return torch`: the module object escapes as a value
    ),
    (
        "replace_forward",
        launcher("out = torch.empty_like(x)\n" + LAUNCH + "return out\n", init="self.forward = F.relu\n"),
        {"monkey_patch"},
    ),
    (
        "forward_hook",
        launcher(
            "out = torch.empty_like(x)\n" + LAUNCH + "return out\n",
            init="self.register_forward_hook(lambda m, i, o: F.relu(i[0]))\n",
        ),
        {"monkey_patch"},
    ),
    # dynamic_access
    *[
        (
            f"dynamic_{i}",
            launcher(line + "out = torch.empty_like(x)\n" + LAUNCH + "return out\n"),
            {"dynamic_access"},
        )
        for i, line in enumerate(
            (
                "y = eval('torch.matmul')(x, x)\n",
                "mm = getattr(torch, 'matmul')\n",
                "cls = x.__class__\n",
                "b = __builtins__\n",
                "exec('x = x')\n",
                "m = kernels._module\n",
                "g = torch._C._get_tracing_state()\n",
                "d = vars(torch)\n",
                "src = open('/tmp/ref.py').read()\n",
            )
        )
    ],
    (
        "defines_call",
        src("""
        class ModelNew(nn.Module):
            def forward(self, x):
                out = torch.empty_like(x)
                kernels.k((1,), (1,), (x, out))
                return out

            def __call__(self, x):
                return F.relu(x)
        """),
        {"dynamic_access"},
    ),
    # sync_or_timer
    *[
        (
            f"sync_{i}",
            launcher("out = torch.empty_like(x)\n" + LAUNCH + line + "return out\n"),
            {"sync_or_timer"},
        )
        for i, line in enumerate(
            (
                "torch.cuda.synchronize()\n",
                "start = torch.cuda.Event(enable_timing=True)\n",
                "s = torch.cuda.Stream()\n",
                "torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())\n",
                "out.record_stream(torch.cuda.current_stream())\n",
                "g = torch.cuda.CUDAGraph()\n",
                "torch.cuda._sleep(100000)\n",
                "torch.cuda.set_sync_debug_mode(0)\n",
                "n = out.item()\n",
                "flag = bool(out)\n",
            )
        )
    ],
    (
        "timing_events_record",
        launcher("e = make_event()\ne.record()\nout = torch.empty_like(x)\n" + LAUNCH + "return out\n"),
        {"sync_or_timer"},
    ),
    (
        "backends_switch",
        launcher(
            "out = torch.empty_like(x)\n" + LAUNCH + "return out\n",
            init="torch.backends.cuda.matmul.allow_tf32 = True\n",
        ),
        {"sync_or_timer"},
    ),
    (
        "stream_context",
        launcher(
            "with torch.cuda.stream(torch.cuda.Stream()):\n    out = torch.empty_like(x)\n    " + LAUNCH
        ),
        {"sync_or_timer"},
    ),
    # no_kernel_launch
    ("torch_only", launcher("return F.relu(x) * 2\n"), {"no_kernel_launch"}),
    (
        "helper_never_called",
        launcher(
            "return torch.relu(x)\n",
            top="""
            def unused(x, out):
                kernels.relu((1,), (1,), (x, out))
            """,
        ),
        {"no_kernel_launch"},
    ),
    (
        "no_forward",
        src("""
        class ModelNew(nn.Module):
            def run(self, x):
                kernels.relu((1,), (1,), (x, x))
        """),
        {"no_kernel_launch"},
    ),
]

# --- what a launcher may reach: the allow-list ---------------------------------------------------------------

FORWARD = "out = torch.empty_like(x)\n" + LAUNCH + "return out\n"

VIOLATIONS += [
    # forbidden_import: any module object off the list on a path, whatever its name
    *[
        (f"reach_{i}", launcher(FORWARD, top=top), {"forbidden_import"})
        for i, top in enumerate(
            (
                "torch.cuda.os.system('true')\n",
                "torch.os.getcwd()\n",
                "import typing\nmods = typing.sys.modules\n",
                "import dataclasses\nb = dataclasses.sys\n",
                "F.torch.os.system('true')\n",
                "t = torch\nc = t.cuda\nc.os.system('true')\n",
                "from torch import cuda\ncuda.os.system('true')\n",
                "from torch import os as o\n",
                "lib = torch.ops.load_library\n",
                "torch.classes.load_library('x.so')\n",
                "data = torch.utils.data\n",
                "torch.serialization.load('x.pt')\n",
                "r = np.random.rand(3)\n",
                "k = np.ctypeslib.as_ctypes\n",
                "g = nn.utils.parametrizations\n",
                "from torch.nn.functional import *\nimportlib.import_module('os')\n",
                "import torch.cuda\n",
                "import torch.nn.functional as F2\nimp = F2.importlib\n",
                "j = torch.cuda.jiterator\n",
            )
        )
    ],
    # forbidden_name: a name off the list of an allowed module
    *[
        (f"name_{i}", launcher(line + FORWARD), {"forbidden_name"})
        for i, line in enumerate(
            (
                "w = torch.load('w.pt')\n",
                "torch.save(x, 'x.pt')\n",
                "m = torch.from_file('x.bin', shared=True, size=4)\n",
                "f = torch.compile(F.relu)\n",
                "np.save('x.npy', [1.0])\n",
                "a = np.memmap('x.bin')\n",
                "a = np.fromfile('x.bin')\n",
                "torch.cuda.empty_cache()\n",
                "h = torch.Tensor.no_such_method\n",
                "y = F.handle_torch_function\n",
                "y = torch.ops.aten.from_file.default('x', True, 4)\n",
            )
        )
    ],
    (
        "get_type_hints",
        launcher(FORWARD, top="from typing import get_type_hints\n"),
        {"forbidden_name"},
    ),
    # dynamic_access: builtins off the list
    *[
        (f"builtin_{name}", launcher(f"{name}\n" + FORWARD), {"dynamic_access"})
        for name in (
            "compile",
            "globals",
            "memoryview",
            "breakpoint",
            "input",
            "help",
            "exit",
            "quit",
            "dir",
            "id",
            "hasattr(x, name)",
            "hasattr(x, '__class__')",
        )
    ],
    # dynamic_access: a module object used as a value
    *[
        (f"module_value_{i}", launcher(FORWARD, init=init, top=top), {"dynamic_access"})
        for i, (init, top) in enumerate(
            (
                ("", "c = [torch][0].cuda\n"),
                ("", "def f(m):\n    return m\n\n\nc = f(torch)\n"),
                ("", "get = lambda: torch\n"),
                ("", "def get():\n    return F\n"),
                ("self.t = torch\n", ""),
                ("", "m = torch if F else np\n"),
                ("", "m = torch\nm = np\n"),
                ("", "a, b = torch, np\n"),
                ("", "def f(m=torch.cuda):\n    return 1\n"),
                ("", "print(torch)\n"),
                ("", "class Holder:\n    t = torch\n"),
            )
        )
    ],
    # dynamic_access: private attributes, foreign code, the runtime's internals
    *[
        (f"private_{i}", launcher(line + FORWARD, init=init), {"dynamic_access"})
        for i, (line, init) in enumerate(
            (
                ("p = self.linear._parameters\n", "self.linear = nn.Linear(4, 4)\n"),
                ("out2 = torch.empty_like(x)\nout2._tag = 1\n", ""),
                ("m = self._modules\n", ""),
                ("d = self._buffers\n", "self._buffers = {}\n"),
                ("s = super()._apply\n", ""),
                ("n = kernels.scale.name\n", ""),
                ("k = kernels.from_file('other.cubin')\n", ""),
                ("c = np.float32(1).ctypes\n", ""),
                ("np.float32(1).tofile('x.bin')\n", ""),
                ("s = x.untyped_storage().from_file('x.bin', True, 4)\n", ""),
                ("c = self.dims.ctypes\n", "self.dims = np.int64(3)\n"),
            )
        )
    ],
]

# dynamic_access: a name that would mean one thing here and another there (the check reads it one way)
VIOLATIONS += [
    *[
        (f"shadow_{i}", launcher(FORWARD, init=init, top=top), {"dynamic_access"})
        for i, (init, top) in enumerate(
            (
                ("_ = [0 for torch in range(1)]\ntorch.cuda.os.getcwd()\n", ""),
                ("", "torch.cuda.os.getcwd()\ntorch = torch\n"),
                ("", "f = lambda getattr: 0\n"),
                ("", "def g():\n    import math as open\n"),
                ("", "t = torch\n\n\ndef g():\n    return [t for t in range(3)]\n"),
                ("", "class Holder:\n    F = None\n"),
                ("", "def vars():\n    return 1\n"),
            )
        )
    ],
    ("shadow_kernels", launcher(FORWARD, top="kernels = None\n"), {"dynamic_access", "no_kernel_launch"}),
    # the later import wins in the resolver: torch.empty_like reads as math's
    ("shadow_import", launcher(FORWARD, top="import math as torch\n"), {"dynamic_access", "forbidden_name"}),
]

VIOLATIONS.append(
    ("numpy_scalar_of_a_tensor", launcher(FORWARD.replace("return out", "s = np.float32(out)\nreturn out")),
     {"sync_or_timer"})
)  # fmt: skip

# launchers that reach only what the allow-list names: they pass (CUSTOM)
ALLOWED = [
    ("plain_alias", launcher(FORWARD, top="t = torch\nfn = t.nn.functional\nz = t.zeros(3)\n")),
    ("alias_in_function", launcher("t = torch\nout = t.empty_like(x)\n" + LAUNCH + "return out\n")),
    (
        "cuda_queries",
        launcher(
            FORWARD,
            init="self.sms = torch.cuda.get_device_properties(0).multi_processor_count\n"
            "self.ok = torch.cuda.is_available() and torch.cuda.device_count() > 0\n",
            top="from torch import cuda\nCAP = cuda.get_device_capability()\n",
        ),
    ),
    (
        "init_and_submodules",
        launcher(
            FORWARD,
            init="self.linear = nn.Linear(4, 4)\ninit.zeros_(self.linear.bias)\n"
            "torch.nn.init.kaiming_normal_(self.linear.weight)\n",
            top="import torch.nn.init as init\n",
        ),
    ),
    (
        "stdlib_helpers",
        launcher(
            FORWARD,
            init="self.dims = list(itertools.repeat(2, 3))\nself.total = functools.reduce(lambda a, b: a * b, "
            "self.dims)\nself.cfg = Cfg()\nself.seen = collections.OrderedDict()\n",
            top="import collections\nimport collections.abc\nimport dataclasses\nimport functools\n"
            "import itertools\nfrom typing import Optional\n\n\n@dataclasses.dataclass\nclass Cfg:\n"
            "    n: Optional[int] = None\n    tags: list = dataclasses.field(default_factory=list)\n\n\n"
            "ITER = collections.abc.Iterable\nPI = math.pi * np.float32(2) + np.sqrt(np.float64(2))\n",
        ),
    ),
    (
        "einops_in_init",
        launcher(
            FORWARD,
            init="self.w = rearrange(torch.zeros(2, 3), 'a b -> b a')\n",
            top="from einops import rearrange\n",
        ),
    ),
    (
        "own_private_attributes_and_hasattr",
        src("""
        class ModelNew(nn.Module):
            _BLOCK = 256

            def __init__(self):
                super().__init__()
                self._calls = 0

            def forward(self, x):
                if not hasattr(self, "cache"):
                    self.cache = None
                out = self._alloc(x)
                kernels.scale((x.numel() // self._BLOCK + 1,), (self._BLOCK,), (x, out))
                self._calls += 1
                return out

            def _alloc(self, x):
                return torch.empty_like(x)
        """),
    ),
    (
        "builtin_names_local_to_a_method",
        src("""
        class ModelNew(nn.Module):
            def forward(self, input, id: int = 0):
                dir = input.contiguous()
                out = torch.empty_like(dir)
                kernels.scale((1,), (128,), (dir, out))
                return out

            def compile(self):
                return None
        """),
    ),
    ("from_future", "from __future__ import annotations\n" + launcher(FORWARD)),
    ("isinstance_of_classes", launcher("assert isinstance(x, torch.Tensor)\n" + FORWARD)),
]


@pytest.mark.parametrize("source", [c[1] for c in ALLOWED], ids=[c[0] for c in ALLOWED])
def test_what_the_allow_list_names_passes(source: str) -> None:
    report = check_launcher(source)
    assert report.violations == ()
    assert report.kind is Kind.CUSTOM


@pytest.mark.parametrize(("source", "codes"), [c[1:] for c in VIOLATIONS], ids=[c[0] for c in VIOLATIONS])
def test_each_rule_is_caught(source: str, codes: set[str]) -> None:
    report = check_launcher(source)
    assert set(report.codes) == codes, report.violations
    assert not report.ok


def test_every_code_has_a_launcher_that_triggers_it() -> None:
    assert set().union(*(c[2] for c in VIOLATIONS)) == set(CODES)


def test_rules_that_overlap_report_each_code() -> None:
    patched = launcher(
        "out = torch.empty_like(x)\n" + LAUNCH + "return out\n", top="torch.cuda.synchronize = lambda: None\n"
    )
    assert set(check_launcher(patched).codes) == {"monkey_patch", "sync_or_timer"}
    imported = launcher(
        "out = torch.empty_like(x)\n" + LAUNCH + "synchronize()\nreturn out\n",
        top="from torch.cuda import synchronize\n",
    )
    assert set(check_launcher(imported).codes) == {"forbidden_import", "sync_or_timer"}


def test_violations_name_code_and_line() -> None:
    source = launcher(
        "out = torch.empty_like(x)\ntry:\n    " + LAUNCH + "except Exception:\n    pass\nreturn out\n"
    )
    try_line = source.splitlines().index("        try:") + 1
    report = check_launcher(source)
    assert report.violations == (report.violations[0],)
    v = report.violations[0]
    assert (v.code, v.line) == ("try_except", try_line)
    assert re.fullmatch(rf"try_except: line {try_line}: \S.*", str(v))


def test_every_reported_violation_is_well_formed() -> None:
    sources = [c[1] for c in VIOLATIONS] + [c[1] for c in CUSTOM] + [c[1] for c in HYBRID]
    for source in sources:
        report = check_launcher(source)
        assert report.ok == (not report.violations)
        for v in report.violations:
            assert isinstance(v, Violation)
            assert v.code in CODES
            assert v.line >= 1
            assert v.why.strip()
            assert str(v) == f"{v.code}: line {v.line}: {v.why}"
            assert f"static:{v}".startswith(f"static:{v.code}: line ")


def test_hybrid_with_a_violation_keeps_its_classification() -> None:
    report = check_launcher(
        launcher("out = torch.matmul(x, x)\nn = out.sum().item()\n" + LAUNCH + "return out\n")
    )
    assert report.codes == ("sync_or_timer",)
    assert report.kind is Kind.HYBRID
    assert report.library_ops == ("torch.matmul", "Tensor.sum")


def test_numpy_scalar_item_and_int_math_are_not_syncs() -> None:
    report = check_launcher(
        launcher(
            "eps = self.eps.item()\nn = int(x.shape[0]) * int(x.numel() // 4)\nout = torch.empty_like(x)\n"
            + LAUNCH
            + "return out\n",
            init="self.eps = np.float32(1e-5)\n",
        )
    )
    assert report.ok, report.violations
    assert report.kind is Kind.CUSTOM


def test_attributes_of_local_objects_and_self_may_be_set() -> None:
    report = check_launcher(
        launcher(
            "out = torch.empty_like(x)\nout.tag = 'scratch'\nself.calls = 1\n" + LAUNCH + "return out\n",
        )
    )
    assert report.ok, report.violations


def test_the_launcher_is_never_executed(tmp_path) -> None:
    marker = tmp_path / "ran"
    source = launcher(
        "out = torch.empty_like(x)\n" + LAUNCH + "return out\n",
        top=f"open({str(marker)!r}, 'w').write('x')\n1 / 0\n",
    )
    report = check_launcher(source)
    assert not marker.exists()
    assert "dynamic_access" in report.codes  # open(...) is itself a finding


def test_violation_reads_as_before() -> None:
    v = Violation("try_except", 12, "a try statement")
    assert str(v) == f"{v}" == "try_except: line 12: a try statement"
    assert f"static:{v}" == "static:try_except: line 12: a try statement"
    assert v.startswith("try_except:") and not v.startswith("dynamic_access:")


def test_codes_come_from_the_rule_modules() -> None:
    """Each module under rules/ declares one code; CODES is exactly those, and every rule checks its own."""
    declared = {}
    for info in pkgutil.iter_modules(rules_package.__path__):
        module = importlib.import_module(f"{rules_package.__name__}.{info.name}")
        if hasattr(module, "CODE"):
            declared[info.name] = module.CODE
    assert all(name == code for name, code in declared.items())  # one module per rule, named for its code
    assert sorted(declared.values()) == sorted(CODES)
    assert len(set(CODES)) == len(CODES)
    assert {r.code for r in RULES} == set(CODES) - {"syntax_error"}
    assert all(isinstance(r, Rule) for r in RULES)


def test_importing_the_package_imports_no_torch() -> None:
    """The torch allow-list is introspected on the first check, not at import."""
    code = "import sys, pipeline.static_check; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_kernels_class_attributes_are_in_step_with_the_runtime() -> None:
    from pipeline.runtime import Kernels

    public = {n for n in dir(Kernels) if not n.startswith("_")}
    assert public - RUNTIME_METHODS == KERNELS_CLASS_ATTRS
    for attr in KERNELS_CLASS_ATTRS:
        assert "dynamic_access" in check_launcher(launcher(f"k = kernels.{attr}\n" + FORWARD)).codes


@pytest.mark.parametrize(
    ("namespace", "allowed", "refused"),
    [
        ("torch", "matmul einsum empty zeros_like float32 bfloat16 Size finfo no_grad Tensor", "load save "
         "from_file set_default_dtype manual_seed compile jit cuda ops utils hub library set_num_threads"),
        ("torch.Tensor", "add view shape dtype new_empty stride unflatten", "__class__ _make_subclass"),
        ("torch.nn", "Module Linear Conv2d LSTM Sequential Parameter Buffer ModuleList", "utils modules init"),
        ("torch.nn.functional", "relu gelu conv2d hardsigmoid scaled_dot_product_attention",
         "torch importlib np handle_torch_function"),
        ("torch.nn.init", "zeros_ ones_ kaiming_normal_ xavier_uniform_", "torch math warnings"),
        ("torch.linalg", "svd norm solve", "_linalg"),
        ("torch.cuda", "is_available get_device_properties", "os synchronize Stream empty_cache set_device"),
        ("numpy", "float32 int64 intp bool_ add sqrt prod pi", "load save memmap fromfile ctypeslib random lib"),
        ("math", "sqrt ceil pi inf", ""),
        ("typing", "Optional Any TYPE_CHECKING cast", "get_type_hints sys"),
        ("collections.abc", "Iterable Sequence Mapping", "sys"),
        ("itertools", "repeat product chain", ""),
    ],
)  # fmt: skip
def test_allow_list_names(namespace: str, allowed: str, refused: str) -> None:
    names = allowlist.names(namespace)
    assert set(allowed.split()) <= names, set(allowed.split()) - names
    assert not set(refused.split()) & names


def test_allow_list_judges_modules_and_names() -> None:
    judge = allowlist.judge
    assert judge(("torch", "nn", "functional", "relu")) is None
    assert judge(("torch", "Tensor", "add")) is None
    assert judge(("torch", "nn", "Module", "__init__")) is None  # past an allowed name, attributes are free
    assert judge(("torch", "cuda", "os", "system")) == allowlist.Reach("module", ("torch", "cuda", "os"))
    assert judge(("typing", "sys")) == allowlist.Reach("module", ("typing", "sys"))
    assert judge(("numpy", "ctypeslib")) == allowlist.Reach("module", ("numpy", "ctypeslib"))
    assert judge(("torch", "load")) == allowlist.Reach("name", ("torch", "load"))
    assert judge(("os", "system")) is None  # `import os` is reported as such
    assert allowlist.is_module(("torch", "cuda")) and not allowlist.is_module(("torch", "Tensor"))


# --- KernelBench: every task's own Model, renamed ModelNew, passes ------------------------------------------

KERNELBENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "kernelbench"
KERNELBENCH_TASKS = sorted(KERNELBENCH.glob("level*/*.py")) if KERNELBENCH.is_dir() else []


class _RenameModel(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id == "Model":
            node.id = "ModelNew"
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        if node.name == "Model":
            node.name = "ModelNew"
        self.generic_visit(node)
        return node


def self_consistency_launcher(task_source: str) -> str:
    """The task's Model as ModelNew, without get_inputs/get_init_inputs, launching a kernel first in forward."""
    tree = ast.parse(task_source)
    tree.body = [
        s
        for s in tree.body
        if not (isinstance(s, ast.FunctionDef) and s.name in ("get_inputs", "get_init_inputs"))
    ]
    tree = _RenameModel().visit(tree)
    launch = ast.parse("kernels.noop(1, 1, ())").body[0]
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name == "ModelNew":
            for f in cls.body:
                if isinstance(f, ast.FunctionDef) and f.name == "forward":
                    f.body.insert(0, launch)
    return ast.unparse(ast.fix_missing_locations(tree))


@pytest.mark.skipif(not KERNELBENCH_TASKS, reason="no KernelBench checkout next to the repository")
@pytest.mark.parametrize(
    "task", KERNELBENCH_TASKS, ids=[f"{p.parent.name}/{p.stem}" for p in KERNELBENCH_TASKS]
)
def test_kernelbench_models_pass_as_their_own_candidates(task: Path) -> None:
    """The torch, nn, F, numpy, itertools, collections and einops use of every task is on the allow-list."""
    report = check_launcher(self_consistency_launcher(task.read_text()))
    assert report.violations == ()
    assert report.kind is Kind.HYBRID and report.library_ops  # the reference computes with torch
    assert report.kernels_used == ("noop",)
