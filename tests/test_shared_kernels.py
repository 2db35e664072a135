"""One copy of each distinct kernel text in a rendered source (pipeline/generate/expert/shared_kernels.py):
the rule on hand-made region codes, then repeated blocks rendered by the expert, built by nvcc and run
by the CPU emulator against the float64 reference."""

from __future__ import annotations

import re

import pytest
from test_expert import _emulate, ctx, needs_gxx, needs_nvcc, task_file

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.expert import ExpertPolicy
from pipeline.generate.expert.shared_kernels import share_kernels
from pipeline.generate.expert.templates.code import Code
from pipeline.types import Status


def _code(rid: str, cuda: str, launcher: str = "") -> Code:
    launcher = (
        launcher or f"def _run_{rid}(sms, x):\n    kernels.kp_{rid}_k((1,), (32,), (x,))\n    return x\n"
    )
    return Code(cuda, launcher, f"_run_{rid}", (f"kp_{rid}_k",), ("x",), (f"y_{rid}",))


def _kernel(rid: str, n: int = 64, extra: str = "") -> str:
    return (
        f"// region {rid}: scale\n"
        f"__device__ __forceinline__ float kp_{rid}_f(float a) {{ const float v_{rid}_s = a * 2.f; return v_{rid}_s; }}\n"
        f'extern "C" __global__ void kp_{rid}_k(float* x) {{\n'
        f"    const int i = threadIdx.x; if (i < {n}) x[i] = kp_{rid}_f(x[i]){extra};\n}}\n"
    )


def test_a_repeated_text_is_kept_once_and_its_launcher_calls_the_first():
    codes = {r: _code(r, _kernel(r)) for r in ("a", "b_1", "c")}
    out = share_kernels(codes)
    assert out["a"] == codes["a"]
    for r in ("b_1", "c"):
        assert out[r].cuda == ""
        assert "kernels.kp_a_k(" in out[r].launcher and f"kp_{r}_k" not in out[r].launcher
        assert out[r].kernels == ("kp_a_k",)
        # its own launcher, arguments and outputs: only the kernel it calls changed
        assert out[r].fn == f"_run_{r}" and out[r].outputs == (f"y_{r}",)


def test_texts_that_differ_beyond_their_names_are_both_kept():
    codes = {"a": _code("a", _kernel("a", 64)), "b": _code("b", _kernel("b", 65))}
    assert share_kernels(codes) == codes
    codes = {"a": _code("a", _kernel("a")), "b": _code("b", _kernel("b", extra=" + 1.f"))}
    assert share_kernels(codes) == codes


def test_comments_do_not_keep_a_copy():
    other = _kernel("b").replace("// region b: scale", "// region b: another comment")
    out = share_kernels({"a": _code("a", _kernel("a")), "b": _code("b", other)})
    assert out["b"].cuda == ""


def test_a_name_another_region_or_a_helper_mentions_is_not_renamed():
    """a and b call two different functions of the same shape defined elsewhere (z's and y's): were those
    names counted as a's and b's own, b would call z's function through a's kernel."""
    call = 'extern "C" __global__ void kp_{r}_k(float* x) {{ x[threadIdx.x] = {f}(x[threadIdx.x]); }}\n'
    z = _code("z", "__device__ float kp_z_g(float a) { return a + 1.f; }\n")
    y = _code("y", "__device__ float kp_y_g(float a) { return a - 1.f; }\n")
    a = _code("a", call.format(r="a", f="kp_z_g"))
    b = _code("b", call.format(r="b", f="kp_y_g"))
    assert share_kernels({"z": z, "y": y, "a": a, "b": b})["b"] == b
    # the same through a shared helper's names: kp_relu and kp_gelu are the prelude's, not a's or b's
    a = _code("a", call.format(r="a", f="kp_relu"))
    b = _code("b", call.format(r="b", f="kp_gelu"))
    helpers = ("__device__ float kp_relu(float a);\n__device__ float kp_gelu(float a);\n",)
    assert share_kernels({"a": a, "b": b}, helpers)["b"] == b
    # and the same helper in both: one copy
    b = _code("b", call.format(r="b", f="kp_relu"))
    assert share_kernels({"a": a, "b": b}, helpers)["b"].cuda == ""


def test_a_region_without_kernel_text_is_left_alone():
    codes = {"a": _code("a", ""), "b": _code("b", "")}
    assert share_kernels(codes) == codes


# ---------------------------------------------------------------------------------------- rendered tasks

RNN = """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.i2h = nn.Linear(5 + 7, 7)
        self.h2o = nn.Linear(7, 3)

    def forward(self, x, h):
        outs = []
        for t in range(6):
            h = torch.tanh(self.i2h(torch.cat((x[t], h), dim=1)))
            outs.append(self.h2o(h))
        return torch.stack(outs), h
"""

BLOCKS = """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(48) for _ in range(3)])
        self.wide = nn.LayerNorm(80)

    def forward(self, x, y):
        for n in self.norms:
            x = F.gelu(n(x)) * 0.5 + x
        return x, F.gelu(self.wide(y))
"""


def _defined(source: str) -> list[str]:
    return re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(kp_\w+)\s*\(", source)


def _called(launcher: str) -> set[str]:
    return set(re.findall(r"kernels\.(kp_\w+)\(", launcher)) - {"kp_gather_f16", "kp_gather_bf16"}


@pytest.fixture(scope="module")
def rnn(tmp_path_factory):
    return task_file(tmp_path_factory.mktemp("rnn"), "rnn", RNN, "[torch.randn(6, 2, 5), torch.randn(2, 7)]")


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    return task_file(
        tmp_path_factory.mktemp("blocks"), "blocks", BLOCKS, "[torch.randn(4, 9, 48), torch.randn(5, 80)]"
    )


def test_an_unrolled_recurrence_compiles_one_kernel_a_step_form(rnn):
    """Six time steps of the same cell: each step's kernels are the first step's, every call the launcher
    makes is to a kernel the source defines, and nvcc builds exactly those."""
    props = ExpertPolicy().propose(ctx(rnn), 2)
    for p in props:
        c = p.candidate
        defined = _defined(c.source)
        assert len(defined) == len(set(defined)), "a kernel defined twice"
        assert _called(c.launcher) <= set(defined), _called(c.launcher) - set(defined)
        # the launchers stay one a region (forward calls one a step), their kernels shared: the two GEMMs'
        # (input-to-hidden and hidden-to-output) and one cat's, where each step rendered its own before
        launchers = re.findall(r"def (_\w+)\(sms", c.launcher)
        assert (
            sum("linear" in f for f in launchers) == 12
            and sum(f.startswith("_move_cat") for f in launchers) == 6
        )
        assert sum(k.startswith("kp_linear") for k in defined) == 2, defined
        assert not [k for k in defined if re.match(r"kp_(linear|cat)_\d", k) and "linear_1_" not in k], (
            defined
        )


@needs_nvcc
def test_shared_kernels_build_for_sm90a(rnn, blocks, tmp_path):
    cands = [p.candidate for path in (rnn, blocks) for p in ExpertPolicy().propose(ctx(path), 2)]
    builds = compile_candidates(cands, Config(home=tmp_path, arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status is Status.OK, b.log[-2000:]
        assert {r.name for r in b.resources} >= _called(c.launcher)


@needs_gxx
def test_shared_kernels_compute_each_steps_own_values(rnn):
    """Emulated against the float64 reference: a step that ran another step's arguments (or the first
    step's tensors) through the shared kernels would give other hidden states."""
    launched = _emulate(rnn, [p.candidate for p in ExpertPolicy().propose(ctx(rnn), 2)], 1e-5)
    counts = {n: launched.count(n) for n in set(launched)}
    assert max(counts.values()) >= 6, counts  # one kernel serving every step


@needs_gxx
def test_blocks_of_another_form_keep_their_kernels(blocks):
    """Three LayerNorm-GELU residual blocks share one text (the row kernel takes the row's length at run
    time); the fourth norm, with another chain fused on it (GELU alone), keeps its own. Emulated: each block
    ran its own weights and rows through the shared kernels."""
    props = ExpertPolicy().propose(ctx(blocks), 2)
    for p in props:
        norms = [k for k in _defined(p.candidate.source) if not k.startswith("kp_gather")]
        assert all(re.match(r"kp_(layer_norm|gelu)(_3)?_v\d$", k) for k in norms), norms
        assert any("_3_" in k for k in norms), norms
    _emulate(blocks, [p.candidate for p in props], 1e-5)


@needs_nvcc
def test_build_times_script_times_the_tuned_build(rnn):
    """benchmarks/build_times.py (the figures of docs/benchmarks.md): the tuned candidate built into an
    empty cache, and its kernels counted: those its source defines, once each."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import build_times
    from expert_plans import tuned

    row = build_times.build_time(rnn, "sm_90a")
    source = tuned(rnn).source
    assert row["status"] == "ok" and row["seconds"] > 0 and row["source_bytes"] == len(source)
    assert row["kernels"] == len(set(_defined(source))), row
