"""pipeline.static_check: launcher snippets that must pass, be classified HYBRID, or be caught by each rule."""

from __future__ import annotations

import re
import textwrap

import pytest

from pipeline.static_check import CODES, LauncherReport, check_launcher
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
        {"monkey_patch"},
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
    assert re.fullmatch(rf"try_except: line {try_line}: \S.*", report.violations[0])


def test_every_reported_violation_is_well_formed() -> None:
    sources = [c[1] for c in VIOLATIONS] + [c[1] for c in CUSTOM] + [c[1] for c in HYBRID]
    for source in sources:
        report = check_launcher(source)
        assert report.ok == (not report.violations)
        for v in report.violations:
            code, line, why = v.split(": ", 2)
            assert code in CODES
            assert re.fullmatch(r"line \d+", line)
            assert why.strip()


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


def test_report_is_frozen() -> None:
    report = check_launcher(CUSTOM[0][1])
    assert isinstance(report, LauncherReport)
    with pytest.raises(AttributeError):
        report.ok = False  # type: ignore[misc]
