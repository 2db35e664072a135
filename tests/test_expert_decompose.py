"""Ops no template covers, replaced by PyTorch's own decomposition of them where that leaves fewer regions to
PyTorch (policy._decompose): the expert then writes tasks it refused (a lone glu, nan_to_num, pixel_shuffle,
a margin loss, pairwise_distance through a norm that decomposes in turn), and its kernels compute what PyTorch does, NaN and infinities included (CPU emulator). A
decomposition into ops we lack is not taken. Also what the expert took up beside them: constants of an
operand's shape (zeros_like, ones_like, full_like) in the element-wise kernels, adaptive average pools whose
windows tile the input as plain pools, var_mean and std_mean as two reductions, and 16-bit matrix-vector
products as row-wise dot products."""

from __future__ import annotations

import shutil

import pytest
from fuzz_expert import check_task
from test_expert import needs_nvcc, task_file

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, supports
from pipeline.tasks import probe
from pipeline.types import Status

torch = pytest.importorskip("torch")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the CPU emulator")

X = "torch.randn(37, 130)"
# name: (forward's return expression of x, inputs); each was refused or left to PyTorch before
DECOMPOSED = {
    "glu": ("F.glu(x, dim=1)", X),
    "nan_to_num": ("torch.nan_to_num(x, posinf=7.0)", X),
    "logit": ("torch.logit(torch.sigmoid(x), eps=1e-6)", X),
    "outer": ("torch.outer(x[0], x[1])", X),
    "pixel_shuffle": ("F.pixel_shuffle(x, 2)", "torch.randn(2, 12, 5, 7)"),
    "margin_ranking": ("F.margin_ranking_loss(x[0], x[1], torch.sign(x[2]), margin=0.1)", X),
    "soft_margin": ("F.soft_margin_loss(x, torch.sign(x + 0.1))", X),
    "bce_logits": ("F.binary_cross_entropy_with_logits(x, torch.sigmoid(x * 3))", X),
    "poisson_nll": ("F.poisson_nll_loss(x, x.abs())", X),
    "addmv": ("torch.addmv(x[:, 0], x, x[0, :130])", "torch.randn(130, 130)"),
    "dot": ("torch.dot(x[0], x[1])", X),
    "logaddexp": ("torch.logaddexp(x, x * 0.5)", X),
    # a composite op export keeps whole, written in another one (a norm) that decomposes in its turn
    "pairwise_distance": ("F.pairwise_distance(x[:18], x[18:36], p=3.0, eps=1e-3)", X),
}
EMULATED = ("glu", "nan_to_num", "pixel_shuffle", "bce_logits", "addmv", "pairwise_distance")


def _task(tmp_path, name: str, expr: str, inputs: str):
    body = f"class Model(nn.Module):\n    def forward(self, x):\n        return {expr}"
    return task_file(tmp_path, name, body, f"[{inputs}]")


def test_ops_without_a_template_are_written_through_pytorchs_decomposition(tmp_path):
    for name, (expr, inputs) in DECOMPOSED.items():
        ok, why = supports(_task(tmp_path, name, expr, inputs))
        assert ok and "decomposed by PyTorch's own rule" in why and "left to PyTorch" not in why, (name, why)


def test_a_decomposition_into_ops_we_lack_is_not_taken(tmp_path):
    # grid_sample decomposes into index arithmetic and gathers at computed positions (integer ops): more
    # regions left to PyTorch. (linalg_cross and col2im, the examples before, have kernels of their own now.)
    expr = "F.grid_sample(x, torch.tanh(x[:, :2].permute(0, 2, 3, 1)), align_corners=False)"
    ok, why = supports(_task(tmp_path, "grid_sample", expr, "torch.randn(2, 4, 6, 6)"))
    assert ok and "aten.grid_sampler.default left to PyTorch" in why and "aten.index" not in why, why


@needs_gxx
@pytest.mark.parametrize("name", EMULATED)
def test_emulated_decomposed_tasks_match_pytorch(tmp_path, name):
    expr, inputs = DECOMPOSED[name]
    path = _task(tmp_path, name, expr, inputs)
    special = None
    if name == "nan_to_num":  # what the op is for: NaN, both infinities, signed zeros
        special = [torch.randn(37, 130)]
        special[0][3, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    result = check_task(path, 1e-5, edits=1, inputs=special)
    assert result["outcome"] == "ok", result


@needs_gxx
def test_emulated_16_bit_matrix_vector_products_are_dot_products(tmp_path):
    body = "class Model(nn.Module):\n    def forward(self, a, v):\n        return a @ v, torch.mv(a, v[:, 0]) * 0.5"
    path = task_file(
        tmp_path,
        "gemv_bf16",
        body,
        "[torch.randn(300, 129, dtype=torch.bfloat16), torch.randn(129, 1, dtype=torch.bfloat16)]",
    )
    result = check_task(path, 2e-2, edits=1)
    assert result["outcome"] == "ok" and "reduce" in result["why"], result


@needs_gxx
def test_emulated_constants_of_an_operands_shape_are_element_wise(tmp_path):
    expr = (
        "torch.minimum(torch.maximum(x, torch.zeros_like(x)) + torch.ones_like(x), torch.full_like(x, 1.25))"
    )
    path = _task(tmp_path, "likes", f"{expr}, torch.zeros_like(x)", X)
    result = check_task(path, 1e-6, edits=1)
    assert result["outcome"] == "ok" and "left to PyTorch" not in result["why"], result


@needs_gxx
def test_a_float64_operand_leaves_its_op_to_pytorch_instead_of_raising(tmp_path):
    """float_power computes in float64: the cast back to fp32 read a float64 operand, which our kernels
    cannot, and supports() raised KeyError('float64') (probe of uncommon ops). The cast stays PyTorch's."""
    path = _task(tmp_path, "f64", "torch.float_power(x.abs(), 2).float() * 2 + x", X)
    ok, why = supports(path)
    assert ok and "dtype float64" in why, why
    result = check_task(path, 1e-6, edits=1)
    assert result["outcome"] == "ok", result


@needs_gxx
def test_signed_zeros_and_nan_operands_keep_eagers_values(tmp_path):
    """A -0.0 constant was written as 0.0f (1 / x gave +inf where eager gives -inf); xlogy is NaN where y is
    NaN even where x is 0, and 0 where x is 0 otherwise."""
    expr = (
        "1.0 / torch.where(x > 0, x, -0.0), torch.xlogy(torch.where(x.abs() < 0.5, 0.0, x),"
        " torch.where(x > 1.5, float('nan'), x.abs()))"
    )
    path = _task(tmp_path, "zeros", expr, X)
    result = check_task(path, 1e-6, edits=1)
    assert result["outcome"] == "ok" and "left to PyTorch" not in result["why"], result


@needs_nvcc
def test_decomposed_kernels_compile_for_sm_90a(tmp_path):
    """The element-wise vocabulary the decompositions brought (isposinf, isneginf, hypot, copysign), and a
    constant of an operand's shape, in nvcc."""
    expr = (
        "torch.nan_to_num(x) + torch.hypot(x, x + 1) + torch.copysign(x, x - 1) + torch.isfinite(x).float()"
    )
    expr += " + torch.full_like(x, 0.5)"
    path = _task(tmp_path, "vocabulary", expr, X)
    task = probe(path)
    props = ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    builds = compile_candidates([p.candidate for p in props], Config(home=tmp_path, arch="sm_90a"))
    assert [b.status for b in builds] == [Status.OK, Status.OK], [b.log[-400:] for b in builds]


def test_recurrent_layers_are_never_decomposed():
    """PyTorch's table decomposes LSTM/GRU/RNN layers too, unrolled over every layer and time step: a 512-step
    LSTM took over 15 GB on the meta device before it was excluded."""
    from pipeline.generate.expert import graph

    table = {str(op) for op in graph._decompositions()}
    assert {"aten.lstm.input", "aten.gru.input", "aten.rnn_tanh.input"} <= table
    ops = {
        "aten.lstm.input",
        "aten.gru.input",
        "aten.rnn_tanh.input",
        "aten.rnn_relu.input",
        "aten.glu.default",
    }
    assert graph.decomposable(ops) == {"aten.glu.default"}


@needs_gxx
@pytest.mark.parametrize(
    "expr, inputs",
    [
        ("F.adaptive_avg_pool2d(x, (7, 5))", "torch.randn(3, 8, 28, 30)"),
        ("F.adaptive_avg_pool1d(x, 6)", "torch.randn(3, 8, 30)"),
        ("torch.relu(F.adaptive_avg_pool3d(x * 2, 2))", "torch.randn(2, 3, 4, 6, 8)"),
    ],
)
def test_emulated_adaptive_average_pools_that_tile_their_input_are_pools(tmp_path, expr, inputs):
    result = check_task(_task(tmp_path, "adaptive", expr, inputs), 1e-5, edits=1)
    assert result["outcome"] == "ok" and "left to PyTorch" not in result["why"], result


def test_an_adaptive_pool_whose_windows_overlap_is_the_resample_kernels(tmp_path):
    """Windows of 30 / 7 overlap, so no average pool tiles them: our resample kernel sums each one (it was
    left to PyTorch, and a task of it alone was refused)."""
    ok, why = supports(
        _task(tmp_path, "adaptive_uneven", "F.adaptive_avg_pool2d(x, 7)", "torch.randn(3, 8, 30, 30)")
    )
    assert ok and "(resample)" in why and "left to PyTorch" not in why, why


def test_a_decomposition_that_fails_leaves_the_task_as_it_was_read(tmp_path, monkeypatch):
    from pipeline.generate.expert import policy

    real = policy._capture

    def failing(path, source, task_id, decompose=frozenset()):
        if decompose:
            raise RuntimeError("a decomposition PyTorch cannot trace")
        return real(path, source, task_id, decompose)

    monkeypatch.setattr(policy, "_capture", failing)
    ok, why = supports(_task(tmp_path, "glu_failing", "F.glu(x, dim=1) * 2.0", X))
    assert ok and "aten.glu.default left to PyTorch" in why, why  # the multiply is still ours


@needs_gxx
def test_emulated_var_mean_and_std_mean_are_two_reductions(tmp_path):
    body = (
        "class Model(nn.Module):\n    def forward(self, x):\n"
        "        v, m = torch.var_mean(x, dim=-1, keepdim=True)\n"
        "        s, m2 = torch.std_mean(x, dim=1, unbiased=False)\n"
        "        v3, m3 = torch.var_mean(x, dim=(0, 1), correction=0)\n"
        "        return (x - m) / torch.sqrt(v + 1e-5), s + m2, v3 * m3"
    )
    result = check_task(task_file(tmp_path, "var_mean", body, "[torch.randn(8, 64, 5)]"), 1e-5, edits=1)
    assert result["outcome"] == "ok" and "left to PyTorch" not in result["why"], result


@needs_gxx
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_emulated_16_bit_rms_norm_takes_pytorchs_default_eps(tmp_path, dtype):
    """Without an eps, PyTorch's RMSNorm adds float32's epsilon for 16-bit inputs too (its opmath type's); the
    input dtype's, 8000 times larger in fp16, put rows of small values 30% off (found by the hunt)."""
    body = (
        "class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        f"        self.n = nn.RMSNorm([33], dtype=torch.{dtype})\n"
        "    def forward(self, x):\n        return self.n(torch.softmax(x, dim=-1))"
    )
    path = task_file(tmp_path, f"rms_{dtype}", body, f"[torch.randn(5, 33, dtype=torch.{dtype})]")
    result = check_task(path, 2e-2, edits=1)
    assert result["outcome"] == "ok", result


def test_a_decomposition_whose_launcher_would_fail_the_static_check_is_not_taken(tmp_path):
    """logit's decomposition in bf16 before a GEMM kept an aten.scalar_tensor in PyTorch's hands, which no
    launcher may call (found by the hunt, seed 6223): the task stays as it was read, logit left to PyTorch."""
    body = (
        "class Model(nn.Module):\n    def forward(self, x, w, t):\n"
        "        y = torch.logit(torch.sigmoid(x.transpose(0, 3).contiguous()), eps=1e-6)\n"
        "        return torch.mean(1 - F.cosine_similarity(torch.matmul(y, w), t, dim=2))"
    )
    inputs = (
        "[torch.randn(7, 31, 3, 17, dtype=torch.bfloat16), torch.randn(7, 2, dtype=torch.bfloat16), "
        "torch.randn(17, 31, 3, 2, dtype=torch.bfloat16)]"
    )
    ok, why = supports(task_file(tmp_path, "logit_bf16", body, inputs))
    assert ok and "aten.logit.default left to PyTorch" in why, why
