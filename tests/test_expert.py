"""The offline expert policy on the CPU: capture and regions, plans and edits, determinism, the static check,
real nvcc compiles for sm_90a, and the generated kernels' results through a CPU emulator (g++ + threads)."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
import textwrap
from pathlib import Path

import pytest
from expert_plans import tuned, tuned_with_edit

from pipeline.candidates import load_candidate
from pipeline.compile import ToolchainError, compile_candidates, find_nvcc
from pipeline.config import Config
from pipeline.generate.base import Context, ProposalStatus, Tried
from pipeline.generate.expert import ExpertPolicy, capture, plan_of, supports
from pipeline.generate.expert.edits import base_plan, legal_edits
from pipeline.generate.expert.families import family_of
from pipeline.generate.expert.regions import RegionKind
from pipeline.generate.expert.render import prepare, render, uses_cute
from pipeline.static_check import check_launcher
from pipeline.tasks import TaskError, probe
from pipeline.types import Finding, Kind, Status, Task

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tasks"
EXAMPLES = ROOT / "examples" / "candidates"
BUILTIN = sorted(p.stem for p in TASKS.glob("*.py"))
HYBRID = {"matmul_bias_gelu", "conv_bias_relu_scale"}

try:
    find_nvcc(Config())
    HAVE_NVCC = True
except ToolchainError:
    HAVE_NVCC = False
needs_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="no nvcc on this machine")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the CPU emulator")

HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"


def task_file(folder: Path, name: str, body: str, inputs: str, init: str = "[]") -> Path:
    path = folder / f"{name}.py"
    path.write_text(
        HEADER + textwrap.dedent(body).strip() + f"\n\n\ndef get_inputs():\n    return {inputs}\n\n\n"
        f"def get_init_inputs():\n    return {init}\n"
    )
    return path


def ctx(path: Path, parent=None, findings=(), tried=()) -> Context:
    try:
        task = probe(path)
    except TaskError:  # a reference even the meta-device probe cannot run (data-dependent shapes)
        source = path.read_text()
        task = Task(path.stem, str(path), source, hashlib.sha256(source.encode()).hexdigest(), "float32", 1e-4,
                    1e-3, 1e-4, (), (), "[]", 0.0, 0, 0)  # fmt: skip
    return Context(task=task, reference=task.source, parent=parent, findings=findings, tried=tried)


# Small reference models covering every template family and the op vocabulary (inputs kept tiny: the
# emulator runs every CUDA thread of a block in turn).
CASES: dict[str, tuple[str, str, str, float]] = {
    "activations": (
        """
        class Model(nn.Module):
            def forward(self, x):
                y = F.leaky_relu(x, 0.2) + F.silu(x) + torch.sigmoid(x) + torch.tanh(x) + F.softplus(x) + F.elu(x)
                y = y + F.selu(x) + F.hardtanh(x, -2, 2) + F.hardsigmoid(x) + F.hardswish(x) + F.mish(x)
                y = y + torch.exp(x * 0.1) + torch.log(x.abs() + 1) + torch.sqrt(x.abs()) + torch.rsqrt(x.abs() + 1)
                y = y + x ** 2 + torch.pow(x, 3) * 0.1 - (-x) + torch.clamp_min(x, 0.1) + torch.clamp(x, max=0.3)
                y = y + F.gelu(x) + F.gelu(x, approximate="tanh") + F.relu(x) + F.relu6(x * 4) + x / 3
                return y + 2 / (x.abs() + 1) + F.celu(x) + F.softsign(x) + F.tanhshrink(x) + F.logsigmoid(x)
        """,
        "[torch.randn(13, 77)]",
        "[]",
        1e-5,
    ),
    "broadcast": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.c = nn.Parameter(torch.randn(16, 1, 1))
                self.f = nn.Parameter(torch.randn(9))
            def forward(self, x, r):
                y = torch.maximum(x * self.c + self.f, r) - torch.minimum(x, torch.tensor(0.5))
                return y + torch.where(x > 0, x, x * 0.1)
        """,
        "[torch.randn(2, 16, 5, 9), torch.randn(2, 16, 5, 1)]",
        "[]",
        1e-5,
    ),
    # one-element constants made on the input's device (KernelBench level 2's min against a value): on the
    # meta device they had no value and the task could not be read
    "constant_on_device": (
        """
        class Model(nn.Module):
            def forward(self, x):
                y = torch.min(x * 2.0, torch.tensor(0.25, device=x.device))
                return torch.max(y, torch.tensor(-1, device=x.device)) + 1.0
        """,
        "[torch.randn(6, 5, 33)]",
        "[]",
        1e-6,
    ),
    "bf16_chain": (
        """
        class Model(nn.Module):
            def forward(self, x, y):
                return F.gelu(x + y) * 0.5 - y.to(torch.float32).to(torch.bfloat16)
        """,
        "[torch.randn(17, 129, dtype=torch.bfloat16), torch.randn(17, 129, dtype=torch.bfloat16)]",
        "[]",
        1e-2,
    ),
    "batchnorm_dropout": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.bn = nn.BatchNorm2d(8)
                self.drop = nn.Dropout(0.3)
            def forward(self, x):
                return self.drop(F.relu(self.bn(x)))
        """,
        "[torch.randn(3, 8, 7, 5)]",
        "[]",
        1e-5,
    ),
    "reductions_last": (
        """
        class Model(nn.Module):
            def forward(self, x):
                m = torch.max(x, dim=-1)
                return (x.sum(dim=-1), torch.amax(x, dim=-1), m[0], m[1], torch.argmax(x, dim=-1),
                        torch.var(x, dim=-1), torch.logsumexp(x, dim=-1), torch.norm(x, dim=-1),
                        torch.prod(x * 0.1 + 1, dim=-1), x.mean(dim=-1, keepdim=True))
        """,
        "[torch.randn(3, 37, 29)]",
        "[]",
        1e-5,
    ),
    "reductions_strided": (
        """
        class Model(nn.Module):
            def forward(self, x):
                m = torch.min(x, dim=1)
                return (x.mean(dim=1), torch.amin(x, dim=1), m[0], m[1], torch.argmin(x, dim=1),
                        torch.std(x, dim=1, unbiased=False), x.sum(dim=(0, 2)), x.sum(), torch.argmax(x))
        """,
        "[torch.randn(3, 37, 29)]",
        "[]",
        1e-5,
    ),
    "softmaxes": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return torch.softmax(x, dim=1) + torch.log_softmax(x, dim=-1)
        """,
        "[torch.randn(2, 19, 21)]",
        "[]",
        1e-5,
    ),
    "norms": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln = nn.LayerNorm([6, 7])
                self.gn = nn.GroupNorm(3, 6)
                self.inn = nn.InstanceNorm2d(6, affine=True)
                self.rms = nn.RMSNorm(7)
            def forward(self, x):
                return self.ln(x) + self.gn(x) + self.inn(x) + self.rms(x)
        """,
        "[torch.randn(4, 6, 6, 7)]",
        "[]",
        1e-5,
    ),
    "scans": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return torch.cumsum(x, dim=-1) + torch.cumsum(x, dim=1) + torch.cumprod(x * 0.01 + 1, dim=-1)
        """,
        "[torch.randn(2, 9, 300)]",
        "[]",
        1e-5,
    ),
    "channel_shuffle": (  # views, the last one gathered by our copy kernel; nn.ChannelShuffle and the functional
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.shuffle = nn.ChannelShuffle(4)

            def forward(self, x):
                return self.shuffle(x) * 2.0, F.channel_shuffle(x[:, :6], 3)
        """,
        "[torch.randn(3, 8, 5, 7)]",
        "[]",
        1e-6,
    ),
    "take_along": (  # gathers of both operands expanded to their broadcast shape but along the dim
        """
        class Model(nn.Module):
            def forward(self, x, i):
                return (torch.take_along_dim(x, i, 0) * 2.0, torch.take_along_dim(x[:, None], i[None, :3, :1], 2))
        """,
        "[torch.randn(37, 130), torch.randint(0, 37, (4, 130))]",
        "[]",
        1e-6,
    ),
    "diag_embed": (  # x broadcast over the rows, kept on the diagonal by triu and tril: one positional kernel
        """
        class Model(nn.Module):
            def forward(self, x):
                return torch.diag_embed(x), torch.diag(x[0, 0] * 2.0) + 1.0, torch.diag_embed(x.mT.sigmoid())
        """,
        "[torch.randn(5, 37, 33)]",
        "[]",
        1e-6,
    ),
    "special": (  # digamma (ours: reflection by sinpi / cospi, recurrence, asymptotic series), Bessel i0 / i1,
        # erfcx, erfinv, the normal CDF and its inverse (CUDA's math library)
        """
        class Model(nn.Module):
            def forward(self, x):
                return (torch.digamma(x * 2.0), torch.special.i0(x), torch.special.i1(x * 0.5), torch.special.erfcx(x),
                        torch.erfinv(torch.tanh(x)), torch.special.ndtr(x), torch.special.ndtri(torch.sigmoid(x)),
                        torch.special.psi(x.abs() * 6.0 + 0.25))
        """,
        "[torch.randn(37, 130)]",
        "[]",
        1e-5,
    ),
    "logcumsumexp": (  # the scan's operator log-add-exp (identity -inf): rows in chunks, a warp a row
        # (rows of 4 multiples), a column walk, a reversed one through a folded flip, an epilogue
        """
        class Model(nn.Module):
            def forward(self, x):
                return (torch.logcumsumexp(x, dim=-1), torch.logcumsumexp(x, dim=0) * 2.0,
                        torch.logcumsumexp(x.flip(1), 1).flip(1), torch.logcumsumexp(x[:, :, :296] * 3.0, dim=-1))
        """,
        "[torch.randn(2, 9, 300)]",
        "[]",
        1e-5,
    ),
    "folded_scans": (  # flips and concatenations folded into reverse and exclusive scans (scans.py), any dim
        """
        class Model(nn.Module):
            def forward(self, x, z):
                return (torch.cumsum(x.flip(1), 1).flip(1), (z * 0.01 + 1).flip(-1).cumprod(-1).flip(-1),
                        torch.cumsum(x.flip(0), 2).flip(0), torch.cumsum(x.flip(0, 1), 1).flip(1, 0),
                        torch.cat((torch.zeros_like(x.select(1, 0).unsqueeze(1)), torch.cumsum(x.narrow(1, 0, x.size(1) - 1), 1)), 1),
                        torch.cat((x.new_zeros((x.shape[0], x.shape[1], 1)), x.cumsum(2)), 2),
                        torch.cat((torch.ones_like(z[:1]), torch.cumprod(z[:-1] * 0.01 + 1, 0)), 0),
                        torch.cat((torch.zeros_like(z[:, :1]), z[:, :-1].cumsum(-1)), -1))
        """,
        "[torch.randn(2, 7, 37), torch.randn(3, 300)]",
        "[]",
        1e-5,
    ),
    "bmm_epilogue": (
        """
        class Model(nn.Module):
            def forward(self, a, b, r):
                return torch.relu(torch.bmm(a, b) * 0.5 + r)
        """,
        "[torch.randn(3, 17, 9), torch.randn(3, 9, 13), torch.randn(3, 17, 13)]",
        "[]",
        1e-5,
    ),
    "conv_batchnorm": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 8, 3)
                self.bn = nn.BatchNorm2d(8)
            def forward(self, x):
                return torch.tanh(self.bn(self.conv(x)))
        """,
        "[torch.randn(2, 3, 9, 11)]",
        "[]",
        1e-5,
    ),
    "grouped_conv": (  # depthwise (a multiplier of 2): our direct kernel in the tuned plan, cuDNN in the plain
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(6, 12, 3, padding=1, groups=6)
            def forward(self, x):
                return torch.relu(self.conv(x)) * 0.5
        """,
        "[torch.randn(2, 6, 9, 11)]",
        "[]",
        1e-5,
    ),
    "losses": (  # lowered to elementwise ops and reductions: Huber, smooth L1 (broadcast), L1, MSE, triplet
        """
        class Model(nn.Module):
            def forward(self, x, y, z, w):
                return (F.smooth_l1_loss(x, y), F.smooth_l1_loss(x, y, beta=0.5, reduction="sum"),
                        F.huber_loss(x, y, delta=0.7), F.smooth_l1_loss(x, w, beta=0.0),
                        F.triplet_margin_loss(x, y, z, margin=0.7), F.triplet_margin_loss(x, y, z, p=1, reduction="none"),
                        F.mse_loss(x, z), F.l1_loss(y, z, reduction="sum"))
        """,
        "[torch.randn(6, 40), torch.randn(6, 40), torch.randn(6, 40), torch.randn(40)]",
        "[]",
        1e-5,
    ),
    "kl_div": (  # elementwise ops (xlogy's 0 where the target is 0) and a reduction: batchmean, none, mean, sum
        """
        class Model(nn.Module):
            def forward(self, p, t, u):
                return (F.kl_div(torch.log(p), t, reduction="batchmean"), F.kl_div(p, u, reduction="none", log_target=True),
                        F.kl_div(p, t), F.kl_div(p, t, reduction="sum"))
        """,
        "[torch.rand(6, 40) + 0.01, torch.rand(6, 40) * (torch.rand(6, 40) > 0.3), torch.randn(40)]",
        "[]",
        1e-5,
    ),
    "cosine": (  # three sums (the dot product and the squared norms, each product on its loads), then ew ops
        """
        class Model(nn.Module):
            def forward(self, a, b, c, d):
                return (torch.mean(1 - F.cosine_similarity(a, b, dim=1)), F.cosine_similarity(c, d, dim=1),
                        F.cosine_similarity(a, b * 0.0, dim=-1, eps=1e-6))
        """,
        "[torch.randn(9, 301), torch.randn(9, 301), torch.randn(3, 40, 7), torch.randn(3, 40, 7)]",
        "[]",
        1e-5,
    ),
    "cross": (  # a stack of three components x_i * y_j - x_j * y_i: along a middle dim, broadcast, by
        # default the first dim of size 3 (torch.cross), a transposed operand, in bf16
        """
        class Model(nn.Module):
            def forward(self, x, y, z):
                return (torch.linalg.cross(x, y, dim=1), torch.linalg.cross(z, y[:1, :, :3]) * 2.0,
                        torch.cross(x.mT, y.mT))
        """,
        "[torch.randn(6, 3, 40), torch.randn(6, 3, 40), torch.randn(6, 3, 3)]",
        "[]",
        1e-5,
    ),
    "cross_bf16": (  # each component rounded once to bf16 where eager rounds each product and the difference
        """
        class Model(nn.Module):
            def forward(self, x, y):
                return torch.linalg.cross(x, y, dim=1)
        """,
        "[torch.randn(6, 3, 40, dtype=torch.bfloat16), torch.randn(6, 3, 40, dtype=torch.bfloat16)]",
        "[]",
        1e-2,
    ),
    "cross_entropy": (  # one pass a row: logsumexp, pick, ignored targets (families/xent.py); the case's clamp
        """
        class Model(nn.Module):
            def forward(self, x, t):
                return (F.cross_entropy(x, t), F.cross_entropy(x, t, reduction="sum"),
                        F.cross_entropy(x, t.clamp(min=0), reduction="none", ignore_index=3),
                        F.cross_entropy(x * 2.0, t.clamp(min=0)))
        """,
        "[torch.randn(37, 301), torch.where(torch.rand(37) < 0.2, -100, torch.randint(0, 5, (37,)))]",
        "[]",
        1e-5,
    ),
    "triangular": (  # triu / tril as positional elementwise ops: on GEMM outputs (their epilogue), batched, offsets
        """
        class Model(nn.Module):
            def forward(self, a, b, x, y, m):
                return (torch.triu(torch.matmul(a, b)), torch.tril(torch.bmm(x, y), -1) * 2.0,
                        torch.triu(x, 2) + 1.0, torch.tril(x - 1.0, -3), x * torch.triu(m, -1))
        """,
        "[torch.randn(20, 32), torch.randn(32, 24), torch.randn(3, 9, 12), torch.randn(3, 12, 8), torch.randn(9, 12)]",
        "[]",
        1e-5,
    ),
    "pooling": (  # max and average pools on the CUDA cores, the chain after them in its own kernel
        """
        class Model(nn.Module):
            def forward(self, x):
                return F.max_pool2d(x, 3, stride=2, padding=1) + F.avg_pool2d(x, 2, stride=2, ceil_mode=True)
        """,
        "[torch.randn(2, 3, 8, 10)]",
        "[]",
        1e-5,
    ),
    "movement": (  # flip, roll, cat and stack as our strided copies (families/movement.py)
        """
        class Model(nn.Module):
            def forward(self, x):
                y = torch.cat([torch.flip(x, dims=(1,)), torch.roll(x, 3, 2) * 2.0], dim=1)
                return torch.stack([y, y.transpose(1, 2).transpose(1, 2)], 0)
        """,
        "[torch.randn(3, 5, 36)]",
        "[]",
        1e-6,
    ),
    "attention": (  # hand-written: scale, a causal mask from a buffer, softmax; fused in the tuned plan
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("mask", torch.tril(torch.ones(16, 16)))
            def forward(self, q, k, v):
                att = (q @ k.transpose(-2, -1)) * 0.25
                att = att.masked_fill(self.mask == 0, float("-inf"))
                return torch.softmax(att, dim=-1) @ v
        """,
        "[torch.randn(2, 2, 16, 16), torch.randn(2, 2, 16, 16), torch.randn(2, 2, 16, 8)]",
        "[]",
        1e-5,
    ),
    "fusions": (
        """
        class Model(nn.Module):
            def forward(self, x, y):
                return torch.softmax(x * 2.0 + 1.0, dim=-1) * 3.0 - 1.0, torch.sum(x * y, dim=1) * 0.5
        """,
        "[torch.randn(4, 50, 30), torch.randn(4, 50, 30)]",
        "[]",
        1e-5,
    ),
    "gemv": (  # fp32 matrix-vector products: a row-wise dot product with the product on its loads
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.head = nn.Linear(40, 1)
            def forward(self, a, b, x, c, d):
                return (torch.matmul(a, b), torch.relu(self.head(x)) * 2.0, torch.mv(a, b[:, 0]) - 1.0,
                        torch.matmul(c, d))
        """,  # 301 and 40 wrap by 32-bit division, 64 by a mask (kp_wrap)
        "[torch.randn(9, 301), torch.randn(301, 1), torch.randn(2, 3, 40), torch.randn(5, 64), torch.randn(64, 1)]",
        "[]",
        1e-5,
    ),
    "gevm": (  # vector-matrix products: a column-wise dot product, v read once a row of m on its loads
        """
        class Model(nn.Module):
            def forward(self, v, m, r, b):
                return torch.matmul(v, m), torch.relu(r @ m) + 1.0, torch.matmul(v, b)
        """,
        "[torch.randn(37), torch.randn(37, 50), torch.randn(1, 37), torch.randn(3, 37, 40)]",
        "[]",
        1e-5,
    ),
    "interpolate": (  # nearest and bilinear upsampling (families/resample.py), an epilogue after it
        """
        class Model(nn.Module):
            def forward(self, x):
                return F.interpolate(x, scale_factor=2, mode="bilinear") * 2, F.interpolate(x, size=(5, 3))
        """,
        "[torch.randn(2, 3, 6, 7)]",
        "[]",
        1e-6,
    ),
    "batch_stats": (  # batch norm on the batch's statistics (no running ones): reductions, then the affine norm
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.bn = nn.BatchNorm2d(6, track_running_stats=False)
                self.w = nn.Parameter(torch.rand(5) + 0.5)
            def forward(self, x, v):
                return self.bn(x) * 2, F.batch_norm(v, None, None, self.w, None, training=True, eps=1e-3)
        """,
        "[torch.randn(3, 6, 5, 7) * 3 + 1, torch.randn(4, 5, 33)]",
        "[]",
        1e-5,
    ),
    "diagonal": (  # diagonals as views (they went to PyTorch as calls), trace as the diagonal's sum
        """
        class Model(nn.Module):
            def forward(self, x, y):
                return torch.trace(x), torch.diagonal(y, 1, -2, -1) * 2, x.diagonal(-3).sum() + 1
        """,
        "[torch.randn(9, 12), torch.randn(3, 10, 10)]",
        "[]",
        1e-6,
    ),
    "any_all": (  # any / all as max / min of the truth on a reduction's loads; a pairwise distance's norm
        """
        class Model(nn.Module):
            def forward(self, x, y):
                n = torch.where(x.abs() > 2.5, float("nan"), x)  # NaN is true
                return ((n > 0).any(dim=1), (n > -2).all(dim=(0, 2)), torch.any(n > 2), n.all(-1, keepdim=True),
                        F.pairwise_distance(x[0], y), F.pairwise_distance(y, x[1], p=1, keepdim=True))
        """,
        "[torch.randn(6, 9, 5), torch.randn(9, 5)]",
        "[]",
        1e-5,
    ),
    "multi_margin": (  # the target's score by a one-hot row sum, the hinge of the others, over C, reduced
        """
        class Model(nn.Module):
            def forward(self, x, t):
                return (F.multi_margin_loss(x, t), F.multi_margin_loss(x, t, p=2, margin=0.5, reduction="sum"),
                        F.multi_margin_loss(x * 3, t, reduction="none"))
        """,
        "[torch.randn(37, 11), torch.randint(0, 11, (37,))]",
        "[]",
        1e-5,
    ),
    "cdist": (  # p = 2 as PyTorch's mm form: the squared norms as reductions, the dot products a GEMM
        """
        class Model(nn.Module):
            def forward(self, x, y, a, b):
                return torch.cdist(x, y), torch.cdist(a, b) * 0.5, torch.cdist(x, x)
        """,
        "[torch.randn(40, 7), torch.randn(33, 7), torch.randn(3, 30, 16), torch.randn(3, 27, 16)]",
        "[]",
        1e-4,  # cdist(x, x)'s zero diagonal comes out as sqrt of fp32 rounding, as eager's mm form gives it
    ),
    "count_nonzero": (  # the fp32 sum of x != 0 stored as int64 (NaN counts, as in eager), any dims
        """
        class Model(nn.Module):
            def forward(self, x):
                n = torch.where(x.abs() > 2.5, float("nan"), x.round())  # zeros and NaN
                return (torch.count_nonzero(n), torch.count_nonzero(n, dim=1), torch.count_nonzero(n, dim=(0, 2)),
                        torch.count_nonzero(n > 0, dim=-1))
        """,
        "[torch.randn(6, 9, 5)]",
        "[]",
        0.0,
    ),
    "bins": (  # histc in shared-memory histograms; bucketize / searchsorted by eager's binary search
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("edges", torch.linspace(-2.0, 2.0, 9))
            def forward(self, x):
                return (torch.histc(x, bins=7, min=-1.5, max=2.0), torch.bucketize(x, self.edges),
                        torch.searchsorted(self.edges, x * 2.0, right=True).float() * x)
        """,
        "[torch.randn(5, 33)]",
        "[]",
        1e-5,
    ),
    "scatters": (  # a copy of the destination, then one atomic add an element (index_put: a store)
        """
        class Model(nn.Module):
            def forward(self, x, idx, rows):
                return (x.scatter_add(1, idx, x[:, :6] * 2), x.index_add(0, rows, x[:4], alpha=0.5),
                        x.index_put((rows,), x[:4] + 1, accumulate=True))
        """,
        "[torch.randn(5, 9), torch.randint(0, 9, (5, 6)), torch.randint(0, 5, (4,))]",
        "[]",
        1e-5,
    ),
    "fold": (  # col2im: the blocks that cover a pixel summed by its thread
        """
        class Model(nn.Module):
            def forward(self, x):
                return F.fold(x, (5, 6), (2, 3), padding=1, stride=(1, 2)) * 2
        """,
        "[torch.randn(2, 18, 18)]",
        "[]",
        1e-5,
    ),
    "norms_p": (  # vector norms of other orders: |x|^p summed (the power on the loads), then the root
        """
        class Model(nn.Module):
            def forward(self, x):
                return (torch.norm(x, p=3, dim=1), torch.linalg.vector_norm(x, ord=0.5, dim=(0, 2), keepdim=True),
                        torch.linalg.vector_norm(x.relu(), ord=0), torch.linalg.vector_norm(x, ord=float("-inf"), dim=-1),
                        torch.norm(x, p=4))
        """,
        "[torch.randn(6, 9, 5)]",
        "[]",
        1e-5,
    ),
    "outer": (  # products of depth one (K = 1, batch dims broadcast): broadcast products, not GEMMs (fuzz 20129)
        """
        class Model(nn.Module):
            def forward(self, a, b, c):
                return (torch.matmul(a, b), c @ c.transpose(-1, -2)[..., :1, :],
                        torch.bmm(a[0], b[None, 0].expand(3, 1, 8)))
        """,
        "[torch.randn(7, 3, 12, 1), torch.randn(3, 1, 8), torch.randn(2, 5, 1)]",
        "[]",
        1e-6,
    ),
    "broadcast_matmul": (  # batch dims that broadcast: expanded and flattened into one bmm (they had no template)
        """
        class Model(nn.Module):
            def forward(self, a, w, q, h):
                return torch.matmul(a, w) * 2, torch.matmul(q, h), torch.matmul(q, h[:1])
        """,
        "[torch.randn(6, 8), torch.randn(5, 8, 12), torch.randn(2, 3, 4, 8), torch.randn(3, 8, 5)]",
        "[]",
        1e-5,
    ),
    "conv_same": (  # padding="same" / "valid" as numbers; an even kernel's odd total padded on the far side first
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Conv2d(3, 4, 3, padding="same")
                self.b = nn.Conv2d(4, 4, (4, 3), padding="same", dilation=(1, 2))
                self.c = nn.Conv1d(3, 5, 5, padding="valid", stride=2)
            def forward(self, x, v):
                return self.b(torch.relu(self.a(x))), self.c(v)
        """,
        "[torch.randn(2, 3, 7, 9), torch.randn(2, 3, 17)]",
        "[]",
        1e-5,
    ),
    "cells": (  # one step of nn.LSTMCell and nn.GRUCell: the gate GEMMs, then their math in our kernels
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lstm = nn.LSTMCell(12, 20)
                self.gru = nn.GRUCell(12, 20, bias=False)
            def forward(self, x, h, c):
                h2, c2 = self.lstm(x, (h, c))
                return h2, c2 * 2, self.gru(x, h)
        """,
        "[torch.randn(5, 12), torch.randn(5, 20), torch.randn(5, 20)]",
        "[]",
        1e-5,
    ),
    "more_lowered": (  # nanmean, addr, nn.Bilinear and heaviside (each was left to PyTorch)
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.bl = nn.Bilinear(6, 5, 7)
            def forward(self, x, v, u):
                n = torch.where(x > 1.0, float("nan"), x)
                return (torch.nanmean(n, dim=1), torch.nanmean(n), torch.addr(x[:, :5], v, u, beta=0.5, alpha=2),
                        self.bl(x[:, :6], x[:, 2:7]), torch.heaviside(x, u[0].expand(9, 8).contiguous()[:, :8]))
        """,
        "[torch.randn(9, 8), torch.randn(9), torch.randn(5)]",
        "[]",
        1e-5,
    ),
    "losses_more": (  # binary cross-entropy, NLL (an ignored target), hinge and cosine embedding losses
        """
        class Model(nn.Module):
            def forward(self, x, y, t, s):
                p = torch.sigmoid(x)
                return (F.binary_cross_entropy(p, torch.sigmoid(y)), F.binary_cross_entropy(p, y.gt(0).to(y.dtype),
                        weight=y.abs(), reduction="sum"), F.nll_loss(F.log_softmax(x, 1), t, ignore_index=2),
                        F.hinge_embedding_loss(x, s, margin=0.5), F.cosine_embedding_loss(x, y, s[:, 0].long(), 0.1),
                        F.cosine_embedding_loss(x, y, s[:, 1], reduction="none"))
        """,
        "[torch.randn(6, 9), torch.randn(6, 9), torch.randint(0, 9, (6,)), torch.randint(0, 2, (6, 9)).float() * 2 - 1]",
        "[]",
        1e-5,
    ),
    "router_topk": (  # a MoE router's top-k (families/select.py), the weights renormalised
        """
        class Model(nn.Module):
            def forward(self, x):
                w, e = torch.softmax(x, dim=-1).topk(4, dim=-1)
                return w / w.sum(dim=-1, keepdim=True), e
        """,
        "[torch.randn(6, 37)]",
        "[]",
        1e-6,
    ),
    "bits": (  # signbit (-0.0 too: a -0.0 literal kept its sign), nextafter, xlogy (0 where x is 0)
        """
        class Model(nn.Module):
            def forward(self, x, y):
                z = torch.where(x.abs() < 0.3, 0.0, x)  # NaN cases: test_expert_decompose (the fuzz comparison)
                s = torch.signbit(torch.where(x.abs() < 0.3, -0.0, x)).float()  # no NaN: its sign is the CPU's
                return (s + torch.nextafter(x, y), torch.xlogy(z, y.abs()),
                        torch.special.xlogy(x.abs(), z.abs() + 0.5))
        """,
        "[torch.randn(9, 33), torch.randn(9, 33)]",
        "[]",
        1e-6,
    ),
    "prelu_split": (  # PReLU (one weight a channel, or one), split by sizes then concatenated (both PyTorch's)
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.PReLU(4)
                self.b = nn.PReLU()
            def forward(self, x, v):
                p, q = torch.split(x, [1, 3], dim=1)
                return self.a(x), self.b(x) * 2, self.b(v), torch.cat([q, p], 1)
        """,
        "[torch.randn(2, 4, 5, 6), torch.randn(7)]",
        "[]",
        1e-6,
    ),
    "one_hot": (  # one_hot as a positional compare (its int64 result a cast of a mask), then as floats
        """
        class Model(nn.Module):
            def forward(self, x, t):
                return (F.one_hot(t, 10).to(x.dtype) * x).sum(1), F.one_hot(t[:5], 7), (t > 4).long()
        """,
        "[torch.randn(64, 10), torch.randint(0, 10, (64,))]",
        "[]",
        1e-6,
    ),
    "bool_masks": (  # masks combined with & | ^ ~ (bool bitwise ops are the logical ones), rrelu in eval
        """
        class Model(nn.Module):
            def forward(self, x, y):
                m = (x > 0) & (y < 0.5) | ~(x > 1) ^ (y > x)
                return torch.where(m, x, y) + F.rrelu(x, 0.1, 0.3, training=False), m
        """,
        "[torch.randn(7, 45), torch.randn(7, 45)]",
        "[]",
        1e-6,
    ),
    "transposed": (
        """
        class Model(nn.Module):
            def forward(self, x, y):
                return torch.relu(x.transpose(1, 2) + y), x.permute(0, 2, 1).reshape(x.shape[0], -1).sum(dim=-1)
        """,
        "[torch.randn(3, 5, 7), torch.randn(3, 7, 5)]",
        "[]",
        1e-5,
    ),
    "pool_flatten": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return F.adaptive_avg_pool2d(x, 1).flatten(1) * 2
        """,
        "[torch.randn(2, 5, 7, 9)]",
        "[]",
        1e-5,
    ),
}
LEFT_TO_TORCH = {"cross_entropy": {"clamp"}, "losses_more": {"to"}}  # the cases' own int64 ops
FAMILIES = {
    "activations": {"ew"},
    "broadcast": {"ew"},
    "constant_on_device": {"ew"},  # the constants folded into the chain as scalars
    "bf16_chain": {"ew"},
    "batchnorm_dropout": {"ew", "view"},  # batch norm's per-channel vectors seen as (C, 1, 1)
    "reductions_last": {"reduce", "view", "ew"},  # max over a dim: (values, indices) taken apart by views
    "reductions_strided": {"reduce", "view"},
    "softmaxes": {"softmax", "ew"},
    "norms": {"norm", "ew"},
    "scans": {"scan", "ew"},
    "channel_shuffle": {"ew", "view"},
    "take_along": {"torch", "ew", "view"},  # the gathers: torch regions the move family claims
    "diag_embed": {"ew", "view"},
    "special": {"ew"},
    "logcumsumexp": {"scan", "ew", "view"},
    "folded_scans": {"scan", "ew", "view"},
    "bmm_epilogue": {"library", "ew"},
    "conv_batchnorm": {"library", "view", "ew"},
    "grouped_conv": {"library", "view", "ew"},
    "attention": {"library", "view", "ew", "softmax"},
    "pooling": {"torch", "ew"},
    "movement": {"torch", "ew", "view"},  # the transposed-back stack input is a view
    "losses": {"ew", "reduce", "view", "torch"},  # the fp32 triplet losses: torch-kind regions ours claims
    "kl_div": {"ew", "reduce"},
    "cross_entropy": {"torch", "ew"},  # the loss ours (xent); the clamp of the targets, an int64 op
    "cosine": {"reduce", "ew", "torch"},  # over the last dim: torch-kind regions our cosine family claims
    "cross": {
        "ew",
        "view",
        "torch",
    },  # the selects are views; the stack a torch region the move family claims
    "cross_bf16": {"ew", "view", "torch"},
    "triangular": {"library", "ew"},
    "fusions": {"softmax", "reduce", "ew"},
    "gemv": {"view", "ew", "reduce"},  # the vector seen as (K,), x * v, summed over the last dim
    "pool_flatten": {"reduce", "view", "ew"},
    "transposed": {"view", "ew", "reduce"},
    "gevm": {"view", "ew", "reduce"},  # the vector seen as (K, 1), v * m, summed over K
    "bool_masks": {"ew"},
    "one_hot": {"view", "ew", "reduce"},
    "prelu_split": {"ew", "view", "torch"},
    "bits": {"ew"},
    "router_topk": {"softmax", "torch", "view", "reduce", "ew"},
    "losses_more": {"ew", "reduce", "softmax", "torch", "view"},
    "cells": {"library", "ew", "view"},
    "more_lowered": {"ew", "reduce", "view", "library"},
    "conv_same": {"library", "view", "ew", "torch"},
    "broadcast_matmul": {"view", "library", "ew"},
    "outer": {"ew", "view"},
    "norms_p": {"ew", "reduce"},
    "any_all": {"ew", "reduce", "view"},
    "count_nonzero": {"ew", "reduce", "view"},
    "bins": {"torch", "ew"},  # histc and the searches: torch-kind regions the bins family claims
    "scatters": {"torch", "ew", "view"},
    "fold": {"torch", "ew"},
    "cdist": {"ew", "reduce", "view", "library"},
    "multi_margin": {"ew", "reduce", "view"},
    "diagonal": {"view", "reduce", "ew"},
    "batch_stats": {"reduce", "ew", "view"},
    "interpolate": {"torch", "ew"},
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("expert-cases")
    return {
        name: task_file(folder, name, body, inputs, init) for name, (body, inputs, init, _) in CASES.items()
    }


# ------------------------------------------------------------------------------------ capture and regions

EXPECTED_REGIONS = {
    "elementwise_chain": ["ew"],
    "softmax": ["softmax"],
    "layernorm": ["norm"],
    "reduce_mean": ["reduce"],
    "matmul_bias_gelu": ["library", "ew"],
    "conv_bias_relu_scale": ["library", "view", "ew"],
}


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_tasks_capture_into_expected_regions(name):
    low = prepare(capture(TASKS / f"{name}.py"))
    assert [r.kind for r in low.regions] == EXPECTED_REGIONS[name]
    ew = [r for r in low.regions if r.kind is RegionKind.EW]
    if name in HYBRID:  # the epilogue overwrites the library's fresh output in place
        assert ew[0].inplace and ew[0].inplace[0][1] == low.regions[0].outputs[0]
    if name == "elementwise_chain":  # the whole chain, both uses of x, is one region
        assert len(ew[0].nodes) == 7 and ew[0].inputs == ("x",)
    ok, why = supports(TASKS / f"{name}.py")
    assert ok, why


def test_an_fp32_matrix_vector_product_lowers_to_a_row_wise_dot_product(cases, tmp_path):
    low = prepare(capture(cases["gemv"]))
    assert not [r for r in low.regions if r.kind is RegionKind.LIBRARY]  # no 1-column GEMM left to cuBLAS
    dots = [r for r in low.regions if r.kind is RegionKind.REDUCE]
    assert [r.node.shape for r in dots] == [(9, 1), (2, 3, 1), (9,), (5, 1)]
    tuned = base_plan(low, True)
    fused = {rp.rid: rp.prologue for rp in tuned.regions if getattr(rp, "prologue", "")}
    assert fused == {
        "matmul": "matmul_prod",
        "linear_dot": "linear_prod",
        "mv": "mv_prod",
        "matmul_1": "matmul_1_prod",
    }  # x * v on the loads
    # A product with more than one column stays a GEMM; a bf16 one of one column is a dot product too
    body = "class Model(nn.Module):\n    def forward(self, a, b, c):\n        return a @ b, c @ c[:, :1]"
    path = task_file(
        tmp_path, "not_gemv", body, "[torch.randn(9, 64), torch.randn(64, 2), torch.randn(64, 64).bfloat16()]"
    )
    regions = prepare(capture(path)).regions
    assert [r.node.op for r in regions if r.kind is RegionKind.LIBRARY] == ["gemm_matmul"]
    assert [(r.node.shape, r.node.dtype) for r in regions if r.kind is RegionKind.REDUCE] == [
        ((64, 1), "bfloat16")
    ]


def test_capture_keeps_shapes_parameters_and_signatures():
    g = capture(TASKS / "layernorm.py")
    assert g.forward_args == ("x",) and g.init_params == "normalized_shape, eps"
    assert g.inputs[0].shape == (8192, 8192) and g.inputs[0].dtype == "float32"
    assert [(s.key, s.shape, s.parameter) for s in g.state] == [
        ("norm.weight", (8192,), True),
        ("norm.bias", (8192,), True),
    ]
    node = next(n for n in g.nodes if n.op == "layer_norm")
    assert node.shape == (8192, 8192) and node.args[1] == (8192,)


def test_capture_covers_family_cases(cases):
    for name, path in cases.items():
        low = prepare(capture(path))
        kinds = {r.kind for r in low.regions}
        assert kinds == FAMILIES[name], (name, kinds, low.notes)
        # nothing left to PyTorch: a torch-kind region (a pool, an SDPA call) only where a family claims it,
        # but for what a case leaves there on purpose (int64 ops the cases' own code does on their targets)
        left = {
            n.op
            for r in low.regions
            if r.kind is RegionKind.TORCH and family_of(r, low) is None
            for n in r.nodes
        }
        assert left == LEFT_TO_TORCH.get(name, set()), (name, low.notes)


def test_cross_entropy_outside_its_lowering_stays_in_pytorch(tmp_path):
    """16-bit logits (ATen rounds x - lse once, the lowering would round lse first), class weights and
    label smoothing: the loss is left whole to PyTorch, and the task says so."""
    for name, call, inputs in (
        ("ce_bf16", "F.cross_entropy(x, t)", "[torch.randn(4, 7).bfloat16(), torch.randint(0, 7, (4,))]"),
        ("ce_smooth", "F.cross_entropy(x, t, label_smoothing=0.1)", "[torch.randn(4, 7), torch.randint(0, 7, (4,))]"),
        ("ce_weight", "F.cross_entropy(x, t, weight=x[0].abs())", "[torch.randn(4, 7), torch.randint(0, 7, (4,))]"),
    ):  # fmt: skip
        body = f"class Model(nn.Module):\n    def forward(self, x, t):\n        return {call}"
        low = prepare(capture(task_file(tmp_path, name, body, inputs)))
        assert any(n.op == "cross_entropy_loss" for n in low.nodes), name
        assert not any(n.op == "logsumexp" for n in low.nodes), name


def test_a_positional_epilogue_fuses_only_where_gemm_rows_are_each_matrix_rows(tmp_path):
    body = "class Model(nn.Module):\n    def forward(self, a, b, c):\n        return torch.triu(a @ b), torch.tril(c @ b, 1)"
    path = task_file(
        tmp_path, "tri_gemms", body, "[torch.randn(64, 32), torch.randn(32, 24), torch.randn(2, 5, 32)]"
    )
    tuned = base_plan(prepare(capture(path)), True)
    gemms = {rp.rid: rp.epilogue for rp in tuned.regions if rp.TAG.startswith("wgmma")}
    assert gemms == {"matmul": "triu", "matmul_1": ""}  # c's leading dim folds into the GEMM's rows


def _scans(low) -> list[tuple]:
    return [(r.node.op, int(r.node.args[1]), bool(r.node.kw("reverse")), bool(r.node.kw("exclusive")), r.node.shape)
            for r in low.regions if r.kind is RegionKind.SCAN]  # fmt: skip


def test_flips_and_concatenations_fold_into_scans(cases):
    low = prepare(capture(cases["folded_scans"]))
    assert not [n for n in low.nodes if n.op in ("flip", "cat", "zeros_like", "new_zeros", "ones_like")]
    assert _scans(low) == [
        ("cumsum", 1, True, False, (2, 7, 37)),
        ("cumprod", 1, True, False, (3, 300)),
        ("cumsum", 2, False, False, (2, 7, 37)),  # flips of another dim cancel: not a reversal
        ("cumsum", 1, True, False, (2, 7, 37)),
        ("cumsum", 1, False, True, (2, 7, 37)),  # reads x itself, not its narrow
        ("cumsum", 2, False, True, (2, 7, 38)),  # one longer than its input
        ("cumprod", 0, False, True, (3, 300)),
        ("cumsum", 1, False, True, (3, 300)),  # reads z itself, not its slice
    ]


@needs_gxx
def test_a_flip_of_another_dim_moves_past_the_scan(tmp_path):
    body = """
        class Model(nn.Module):
            def forward(self, x):
                return torch.cumsum(x.flip(2), 1), torch.cumsum(x.flip(0, 1), 1).flip(1)
    """
    path = task_file(tmp_path, "flips", body, "[torch.randn(2, 7, 37)]")
    low = prepare(capture(path))
    assert [s[:4] for s in _scans(low)] == [("cumsum", 1, False, False), ("cumsum", 1, True, False)]
    assert [n.args[1] for n in low.nodes if n.op == "flip"] == [(2,), (0,)]  # left to PyTorch, after the scan
    _emulate(path, [p.candidate for p in ExpertPolicy().propose(ctx(path), 2)], 1e-5)


def test_a_folded_scan_left_to_pytorch_is_written_with_torch():
    from pipeline.generate.expert import scans
    from pipeline.generate.expert.graph import Node, Ref

    x = torch.randn(3, 5)
    for kw, shape, want in [
        ((("reverse", True),), (3, 5), x.flip(1).cumsum(1).flip(1)),
        ((("exclusive", True),), (3, 6), torch.cat((torch.zeros(3, 1), x.cumsum(1)), 1)),
        ((("exclusive", True),), (3, 5), torch.cat((torch.zeros(3, 1), x[:, :4].cumsum(1)), 1)),
    ]:
        n = Node("s", "cumsum", "default", (Ref("x"), 1), kw, shape, "float32")
        expr = scans.torch_expr(n, "x", shape[1] - 5 if kw[0][0] == "exclusive" else 0)
        torch.testing.assert_close(eval(expr, {"torch": torch, "x": x}), want)


def test_unsupported_op_alone_is_unsupported_with_reason(tmp_path):
    path = task_file(
        tmp_path,
        "svd",
        "class Model(nn.Module):\n    def forward(self, x):\n        return torch.linalg.svd(x)[1]",
        "[torch.randn(8, 8)]",
    )
    (p,) = ExpertPolicy().propose(ctx(path), 2)
    assert p.status == ProposalStatus.UNSUPPORTED and "linalg_svd" in p.reason
    ok, why = supports(path)
    assert not ok and "linalg_svd" in why


def test_unsupported_op_is_left_to_pytorch_with_a_note(tmp_path):
    body = "class Model(nn.Module):\n    def forward(self, x):\n        return torch.relu(torch.linalg.svd(x)[1]) * 2"
    path = task_file(tmp_path, "svd_relu", body, "[torch.randn(8, 8)]")
    props = ExpertPolicy().propose(ctx(path), 2)
    assert props and all(p.status == ProposalStatus.OK for p in props)
    assert any("linalg_svd" in n and "PyTorch" in n for n in props[0].notes)
    report = check_launcher(props[0].candidate.launcher)
    assert report.ok and report.kind == Kind.HYBRID
    assert any("linalg_svd" in op for op in report.library_ops)


@needs_gxx
def test_a_python_scalar_argument_is_specialized_and_checked(tmp_path):
    """forward(A, s) called with a float s: captured as the reference's value (as torch.export does), and
    ModelNew refuses another value instead of silently computing with the old one."""
    body = "class Model(nn.Module):\n    def forward(self, a, s):\n        return torch.relu(a * s)"
    path = task_file(tmp_path, "scalar_arg", body, "[torch.randn(7, 33), 3.25]")
    g = capture(path)
    assert g.scalars == (("s", 3.25),) and [n.name for n in g.inputs] == ["a"]
    ok, why = supports(path)
    assert ok, why
    from cuda_emulator import build, load_model

    (tuned,) = ExpertPolicy().propose(ctx(path), 2)[1:]
    model = load_model(tuned.candidate.launcher, build(tuned.candidate.source))()
    a = torch.randn(7, 33)
    assert torch.allclose(model(a, 3.25), torch.relu(a * 3.25))
    with pytest.raises(ValueError, match=r"compiled for s = 3\.25"):
        model(a, 2.0)
    report = check_launcher(tuned.candidate.launcher)  # the guard is a Python comparison, not a tensor op
    assert report.ok and report.kind.value == "custom", report.library_ops


@needs_gxx
def test_a_constructor_that_reads_tensor_values_is_built_on_the_cpu(tmp_path):
    """Swin's constructors take drop rates from `torch.linspace(...)` with `.item()`, which the meta device
    cannot answer: such a model is built on the CPU and moved to the meta device, its values (a scale
    here) as the reference has them. A constructor that fails for another reason still says why."""
    body = """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = [x.item() for x in torch.linspace(0.0, 0.5, 3)][1] + 1.0
                self.fc = nn.Linear(16, 24)
            def forward(self, x):
                return torch.relu(self.fc(x)) * self.scale
        """
    path = task_file(tmp_path, "item_init", body, "[torch.randn(5, 16)]")
    props = ExpertPolicy().propose(ctx(path), 2)
    assert props and all(p.status == ProposalStatus.OK for p in props), [p.reason for p in props]
    assert all("1.25" in p.candidate.launcher + p.candidate.source for p in props)
    _emulate(path, [p.candidate for p in props], 1e-6)
    bad = body.replace("self.fc = nn.Linear(16, 24)", "self.fc = nn.Linear(16, int('24 units'))")
    (p,) = ExpertPolicy().propose(ctx(task_file(tmp_path, "bad_init", bad, "[torch.randn(5, 16)]")), 2)
    assert p.status == ProposalStatus.UNSUPPORTED and "building the model" in p.reason, p.reason


def test_einsums_that_are_products_become_gemms(tmp_path):
    """A matmul or bmm written as an einsum is a library GEMM region (ours in the tuned plan); other
    einsums stay in PyTorch, said so."""
    body = (
        "class Model(nn.Module):\n    def forward(self, a, b, c, d):\n"
        '        return torch.einsum("bijl,lk->bijk", a, b), torch.einsum("bij,bjk->bik", c, d), '
        'torch.einsum("ij,ij->i", b, b)'
    )
    inputs = "[torch.randn(2, 3, 5, 8), torch.randn(8, 12), torch.randn(4, 6, 8), torch.randn(4, 8, 12)]"
    low = prepare(capture(task_file(tmp_path, "einsum", body, inputs)))
    ops_ = [(r.kind, r.node.op) for r in low.regions]
    assert (RegionKind.LIBRARY, "gemm_matmul") in ops_ and (RegionKind.LIBRARY, "gemm_bmm") in ops_
    assert any("einsum" in note for note in low.notes)  # "ij,ij->i" is left to PyTorch


def test_a_value_nothing_returns_depends_on_is_not_computed(tmp_path):
    """A layer computed and never used (KernelBench's LSTM tasks return the state, not the head): no call
    for it in the launcher, which once wrote `= _r_linear(...)` with no name to assign and did not parse."""
    body = (
        "class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(8, 4)\n\n    def forward(self, x):\n        y = self.fc(x)\n"
        "        return torch.relu(x) * 2"
    )
    path = task_file(tmp_path, "dead", body, "[torch.randn(5, 8)]")
    low = prepare(capture(path))
    assert [r.kind for r in low.regions] == [RegionKind.EW]
    ok, why = supports(path)
    assert ok, why
    for p in ExpertPolicy().propose(ctx(path), 2):
        assert check_launcher(p.candidate.launcher).ok and "matmul" not in p.candidate.launcher
        assert "register_parameter('weight'" in p.candidate.launcher  # the weights are still the model's


def test_numpy_t_is_a_view_in_the_launcher(tmp_path):
    """x.T (aten.numpy_T) is plumbing: the launcher permutes the view, the product reads it."""
    body = "class Model(nn.Module):\n    def forward(self, a, b):\n        return torch.matmul(a.T, b.T) * 2"
    path = task_file(tmp_path, "numpy_t", body, "[torch.randn(64, 48), torch.randn(32, 64)]")
    ok, why = supports(path)
    assert ok, why
    for p in ExpertPolicy().propose(ctx(path), 2):
        assert ".permute(1, 0)" in p.candidate.launcher and "numpy_T" not in p.candidate.launcher
        assert check_launcher(p.candidate.launcher).ok


@pytest.mark.parametrize(
    ("body", "word"),
    [
        ("class Model(nn.Module):\n    def forward(self, x):\n        return x[x > 0] * 2", "data-dependent"),
        (
            "class Model(nn.Module):\n    def forward(self, x):\n        if x.sum() > 0:\n            return x * 2\n"
            "        return -x",
            "data-dependent",
        ),
    ],
)
def test_data_dependent_references_are_unsupported(tmp_path, body, word):
    path = task_file(tmp_path, "dd", body, "[torch.randn(8, 8)]")
    (p,) = ExpertPolicy().propose(ctx(path), 2)
    assert p.status == ProposalStatus.UNSUPPORTED and word in p.reason


def test_a_lone_library_call_no_template_takes_is_unsupported(tmp_path):
    body = "class Model(nn.Module):\n    def forward(self, a, b):\n        return torch.matmul(a, b)"
    path = task_file(tmp_path, "mm", body, "[torch.randn(8, 6).double(), torch.randn(6, 8).double()]")  # fp64
    (p,) = ExpertPolicy().propose(ctx(path), 2)
    assert p.status == ProposalStatus.UNSUPPORTED and "matmul" in p.reason


# ------------------------------------------------------------------------------------------- plans, edits


def test_first_proposals_plain_then_tuned_with_plan_header():
    path = TASKS / "softmax.py"
    props = ExpertPolicy().propose(ctx(path), 2)
    assert [p.edit for p in props] == ["expert: plain kernels", "expert: tuned kernels"]
    for p in props:
        assert p.candidate.source.startswith("// kernelpro-expert-plan: ")
        assert p.candidate.parent is None and p.candidate.edit == p.edit
    plain, tuned = (plan_of(p.candidate.source) for p in props)
    assert plain.regions[0].vec == 1 and tuned.regions[0].vec == 4 and tuned.regions[0].warp_reduce


def test_fp16_and_bf16_headers_and_gathers_only_where_a_kernel_uses_them(cases):
    """cuda_fp16.h and cuda_bf16.h are most of a small build's nvcc time: a float-only source leaves them
    out, with the 16-bit gathers (its launcher's _contig then copies a 16-bit view with torch)."""
    (f32,) = ExpertPolicy().propose(ctx(TASKS / "softmax.py"), 1)
    (b16,) = ExpertPolicy().propose(ctx(cases["bf16_chain"]), 1)
    assert (
        "#define KP_HALF_TYPES" not in f32.candidate.source and "kp_gather_bf16" not in f32.candidate.source
    )
    assert "_GATHERED = (torch.float32, torch.bool, torch.int64)" in f32.candidate.launcher
    assert f32.candidate.source.splitlines()[1].startswith(
        "#ifdef KP_HALF_TYPES"
    )  # the plan's line, the guard
    assert b16.candidate.source.splitlines()[1] == "#define KP_HALF_TYPES"
    assert "kp_gather_bf16" in b16.candidate.source and "torch.bfloat16," in b16.candidate.launcher


def test_proposals_and_edits_are_deterministic():
    path = TASKS / "layernorm.py"
    a = ExpertPolicy().propose(ctx(path), 2)
    b = ExpertPolicy().propose(ctx(path), 2)
    assert [p.candidate.key for p in a] == [p.candidate.key for p in b]
    kids_a = ExpertPolicy().propose(ctx(path, parent=a[0].candidate), 10)
    kids_b = ExpertPolicy().propose(ctx(path, parent=b[0].candidate), 10)
    assert [k.edit for k in kids_a] == [k.edit for k in kids_b]
    assert [k.candidate.key for k in kids_a] == [k.candidate.key for k in kids_b]
    assert all(k.candidate.parent == a[0].candidate.key for k in kids_a)
    plans = [k.candidate.source.split("\n", 1)[0] for k in kids_a]
    assert len(set(plans)) == len(plans) and a[0].candidate.source.split("\n", 1)[0] not in plans


def test_edit_sequence_is_fixed():
    low = prepare(capture(TASKS / "softmax.py"))
    labels = [label for label, _ in legal_edits(base_plan(low, False), low)]
    assert labels == [
        "vectorize_loads(softmax: vec=2)",
        "coarsen_threads(softmax: regs=16)",
        "coarsen_threads(softmax: unroll=2)",
        "tile_shared_memory(softmax: smem_row=True)",
        "remove_divergence(softmax: warp_reduce=True)",
        "persistent_grid(softmax: persistent=8)",
        "resize_grid(softmax: threads=512)",
        "resize_grid(softmax: threads=128)",
        "increase_occupancy(softmax: min_blocks=8)",
    ]


def test_suggested_edits_come_first_and_inapplicable_ones_are_noted():
    path = TASKS / "softmax.py"
    (parent,) = ExpertPolicy().propose(ctx(path), 1)
    finding = Finding("bank", 0.8, {}, "d", "a", edits=("use_tensor_cores", "tile_shared_memory"))
    kids = ExpertPolicy().propose(ctx(path, parent=parent.candidate, findings=(finding,)), 3)
    assert kids[0].edit == "tile_shared_memory(softmax: smem_row=True)"
    assert any(n.startswith("use_tensor_cores not applicable") for n in kids[0].notes)


def test_tried_edits_are_skipped_and_exhaustion_is_no_move():
    path = TASKS / "softmax.py"
    (parent,) = ExpertPolicy().propose(ctx(path), 1)
    kids = ExpertPolicy().propose(ctx(path, parent=parent.candidate), 50)
    tried = tuple(Tried(parent.candidate.key, k.edit, "ok") for k in kids[:2])
    again = ExpertPolicy().propose(ctx(path, parent=parent.candidate, tried=tried), 50)
    assert [k.edit for k in again] == [k.edit for k in kids[2:]]
    every = tuple(Tried(parent.candidate.key, k.edit, "ok") for k in kids)
    (none,) = ExpertPolicy().propose(ctx(path, parent=parent.candidate, tried=every), 50)
    assert none.status == ProposalStatus.NO_MOVE


def test_fusion_edits_move_neighbours_into_one_kernel(cases):
    low = prepare(capture(cases["fusions"]))
    plain = base_plan(low, False)
    labels = [label for label, _ in legal_edits(plain, low)]
    assert any(lbl.startswith("fuse_kernels(") and "prologue=" in lbl for lbl in labels)
    assert any("epilogue=" in lbl for lbl in labels)
    tuned = base_plan(low, True)
    assert tuned.fused() == {"mul", "mul_1", "mul_2", "mul_3"}  # both hosts' prologues and epilogues
    src, _launcher = render(low, tuned)
    assert src.count('extern "C" __global__') < render(low, plain)[0].count('extern "C" __global__')


def test_repair_returns_plainer_plan_then_no_move():
    path = TASKS / "softmax.py"
    plain, tuned = ExpertPolicy().propose(ctx(path), 2)
    from pipeline.generate.base import Outcome

    fixed = ExpertPolicy().repair(ctx(path), tuned.candidate, Outcome(tuned.candidate.key, "mismatch"))
    assert fixed.status == ProposalStatus.OK and fixed.edit.startswith("repair:")
    assert plan_of(fixed.candidate.source) == plan_of(plain.candidate.source)
    again = ExpertPolicy().repair(ctx(path), plain.candidate, Outcome(plain.candidate.key, "mismatch"))
    assert again.status == ProposalStatus.NO_MOVE


def test_a_widening_root_gets_tuned_variants_after_the_first_two():
    path = TASKS / "softmax.py"
    first = ExpertPolicy().propose(ctx(path), 2)
    tried = tuple(Tried("", p.edit, "ok") for p in first)  # the root's key in the search memory is ""
    more = ExpertPolicy().propose(ctx(path, tried=tried), 2)
    assert [p.edit.split(",")[0] for p in more] == ["expert: tuned kernels"] * 2
    assert {p.candidate.key for p in more}.isdisjoint({p.candidate.key for p in first})


def test_a_foreign_parent_gets_the_experts_first_kernels():
    path = TASKS / "softmax.py"
    parent = load_candidate(EXAMPLES / "softmax", "softmax")
    kids = ExpertPolicy().propose(ctx(path, parent=parent), 2)
    assert len(kids) == 2 and all("foreign parent" in k.edit for k in kids)
    assert all(k.candidate.parent == parent.key for k in kids)


# ---------------------------------------------------------------------------- static check and nvcc sweep


def _sweep(cases: dict[str, Path]) -> list:
    """The 6 tasks' first proposals plus two edits deep (a plan may run out of edits sooner), and every family
    case's plain and tuned plans."""
    policy, out = ExpertPolicy(), []

    def made(proposals) -> list:
        """The proposals' candidates; running out of edits is the only other answer allowed."""
        assert all(p.status in (ProposalStatus.OK, ProposalStatus.NO_MOVE) for p in proposals), [
            (p.status, p.reason) for p in proposals
        ]
        return [p for p in proposals if p.status == ProposalStatus.OK]

    for name in BUILTIN:
        path = TASKS / f"{name}.py"
        for first in made(policy.propose(ctx(path), 2)):
            out.append((name, first.candidate))
            for kid in made(policy.propose(ctx(path, parent=first.candidate), 2)):
                out.append((name, kid.candidate))
                out += [(name, g.candidate) for g in made(policy.propose(ctx(path, parent=kid.candidate), 1))]
    for name, path in cases.items():
        out += [(name, p.candidate) for p in made(policy.propose(ctx(path), 2))]
    return out


@needs_nvcc
def test_every_template_instantiation_passes_static_check_and_compiles(cases, tmp_path):
    sweep = _sweep(cases)
    assert len(sweep) > 80
    for name, cand in sweep:
        report = check_launcher(cand.launcher)
        assert report.ok, (name, cand.edit, report.violations)
        plan = plan_of(
            cand.source
        )  # our WGMMA GEMM, direct convolution or attention leaves nothing to the library
        ours = uses_cute(plan) or any(rp.TAG in ("direct_conv", "skinny_gemm") for rp in plan.regions)
        want = (
            Kind.HYBRID
            if name
            in HYBRID
            | {
                "bmm_epilogue",
                "conv_batchnorm",
                "grouped_conv",
                "attention",
                "triangular",
                "cross_entropy",
                "broadcast_matmul",
                "conv_same",
                "cells",
                "more_lowered",
                "losses_more",
                "cdist",
            }
            and not ours
            else Kind.CUSTOM
        )
        assert report.kind == want, (name, cand.edit, report.library_ops)
    builds = compile_candidates([c for _, c in sweep], Config(home=tmp_path, arch="sm_90a"))
    bad = [(n, c.edit, b.log) for (n, c), b in zip(sweep, builds, strict=True) if b.status != Status.OK]
    assert not bad, bad[:3]
    for (name, cand), b in zip(sweep, builds, strict=True):
        assert not b.log, (name, cand.edit, b.log)  # not even a warning
        # No local arrays: at most registers saved around the 64-bit division and sqrt subroutines that
        # loops call (28 bytes in the layer norm's scalar fallback at 32 registers; a 16-float array is 64).
        assert all(r.spill_stores <= 32 for r in b.resources), (name, cand.edit, b.resources)


# ------------------------------------------------------------------------------------ emulated execution


def _emulate(path: Path, candidates, tol: float, inputs: list | None = None, sms: int = 64) -> list[str]:
    """Each candidate's outputs against the float64 reference: same shapes and dtypes, values within tol."""
    from cuda_emulator import build, load_model
    from fuzz_expert import as_tuple, reference

    r = reference(path, inputs)
    module, state, inputs, native, expected = r.module, r.state, r.inputs, r.native, r.exact
    if any(o.dtype == torch.bfloat16 for o in native):  # bf16 weights: compare with the native result
        expected = tuple(o.double() for o in native)
    launched: list[str] = []
    # The emulator has no tensor cores or TMA: WGMMA candidates run in the GPU tests only.
    candidates = [c for c in candidates if not uses_cute(plan_of(c.source))]
    assert candidates, "every candidate uses the WGMMA kernel; nothing to emulate"
    for cand in candidates:
        kernels = build(cand.source)
        model = load_model(cand.launcher, kernels, sms=sms)(*module.get_init_inputs())
        model.load_state_dict(state, strict=False)
        with torch.no_grad():
            out = as_tuple(model(*inputs))
        assert len(out) == len(native)
        for i, (o, n, e) in enumerate(zip(out, native, expected, strict=True)):
            assert o.shape == n.shape and o.dtype == n.dtype, (cand.edit, i, o.shape, o.dtype)
            if not o.is_floating_point():
                assert torch.equal(o, n), (cand.edit, i)
                continue
            rel = ((o.double() - e).norm() / e.norm().clamp_min(1e-30)).item()
            assert rel < tol, (cand.edit, i, rel)
        launched += [name for name, *_ in kernels.launches]
    return launched


# The built-in tasks at small, awkward shapes (odd sizes, other ranks, tiny): sizes are read at run time.
SMALL = {
    "elementwise_chain": ([[37, 53], [3, 5, 41], [1]], torch.float32, 1e-5),
    "softmax": ([[7, 777], [3, 2, 40]], torch.float32, 1e-5),
    "layernorm": ([[3, 8192], [1, 2, 8192]], torch.float32, 1e-5),
    "reduce_mean": ([[3, 101, 77], [2, 33, 7, 3], [1, 9000, 8]], torch.float32, 1e-5),
    "conv_bias_relu_scale": ([[1, 64, 5, 7], [2, 64, 3, 1]], torch.float32, 1e-5),
    "matmul_bias_gelu": ([[3, 8192]], torch.bfloat16, 1e-2),
}


@needs_gxx
@pytest.mark.parametrize("name", sorted(SMALL))
def test_emulated_builtin_tasks_match_the_reference(name):
    shapes, dtype, tol = SMALL[name]
    path = TASKS / f"{name}.py"
    props = ExpertPolicy().propose(ctx(path), 2)
    for shape in shapes:
        torch.manual_seed(2)
        _emulate(path, [p.candidate for p in props], tol, inputs=[torch.randn(*shape, dtype=dtype)])


@needs_gxx
@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_family_kernels_match_the_reference(cases, name):
    path = cases[name]
    props = ExpertPolicy().propose(ctx(path), 2)
    _emulate(path, [p.candidate for p in props], CASES[name][3])


@needs_gxx
@pytest.mark.parametrize(
    "shapes",
    [[(5, 48), (3, 48)], [(2, 8, 1, 5), (2, 8, 24, 24), (1, 8, 64, 64)]],
    ids=["n_c", "images"],
)
def test_emulated_group_norm_with_short_and_long_channels(tmp_path, shapes):
    """GroupNorm whose channels hold one element (over (N, C), as after a Linear: level 2's Gemm_GroupNorm
    tasks) or a few, each element then scaled by its own channel's weight, and channels long enough for the
    block to write one channel at a time (4096 columns each): both paths against float64."""
    path = task_file(
        tmp_path,
        f"gn{len(shapes[0])}",
        """
        class Model(nn.Module):
            def __init__(self, c):
                super().__init__()
                self.gn = nn.GroupNorm(4, c)
            def forward(self, x):
                return torch.clamp(self.gn(x), -2.0, 2.0)
        """,
        f"[torch.randn{shapes[0]}]",
        f"[{shapes[0][1]}]",
    )
    props = ExpertPolicy().propose(ctx(path), 2)
    assert all(p.candidate and "hw >= (long long)nt * V" in p.candidate.source for p in props)
    for shape in shapes:
        torch.manual_seed(3)
        _emulate(path, [p.candidate for p in props], 1e-5, inputs=[torch.randn(*shape) * 3 + 1])


@needs_gxx
def test_extrema_over_a_dim_write_indices_only_when_read(tmp_path):
    """max/min over a dim whose [1] nobody reads write no int64 indices (the kernels have no yi store); one
    whose indices are returned still writes them. Short reduced dims (5 and 22 rows, level 2's 24 shape in
    small) leave each thread 2U rows at least; a long one (70) is still shared by threads and merged."""
    path = task_file(
        tmp_path,
        "extrema",
        """
        class Model(nn.Module):
            def forward(self, x):
                a = torch.min(x, dim=2)[0]
                b = torch.max(x, dim=-1)[0]
                c = torch.max(x, dim=1)
                return a * 2, b + 1, c[0], c[1]
        """,
        "[torch.randn(3, 4, 22, 30)]",
    )
    props = ExpertPolicy().propose(ctx(path), 2)
    for p in props:
        src = p.candidate.source
        assert src.count("yi[") == src.count("yi[t] = acc.i;") and "yi" in src, p.edit
        assert "while by > 1 and reduced < by *" in p.candidate.launcher, p.edit
        # two of the three extrema are values only: their kernels take no yi
        bodies = re.findall(r"void kp_(\w+)_body\(([^)]*)\)", src)
        with_yi = sorted(name for name, params in bodies if "yi" in params)
        assert len(bodies) >= 3 and len(with_yi) == 1, (p.edit, bodies)
    for shape in ((3, 4, 22, 30), (2, 5, 5, 7), (2, 70, 3, 9)):
        torch.manual_seed(5)
        _emulate(path, [p.candidate for p in props], 1e-6, inputs=[torch.randn(*shape)])


@needs_gxx
def test_a_broadcast_into_trailing_ones_is_split_for_long_rows(tmp_path):
    """An N x 1 column plus a 1 x C x 1 x 1 bias makes 1 x C x N x 1: the elementwise kernel sees rows of
    N (split before the trailing size-1 dim), not C x N rows of one element that idle a block each."""
    path = task_file(
        tmp_path,
        "bcast_ones",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.bias = nn.Parameter(torch.randn(1, 5, 1, 1))
            def forward(self, x):
                return torch.min(x, dim=1, keepdim=True)[0] + self.bias
        """,
        "[torch.randn(64, 16)]",
    )
    props = ExpertPolicy().propose(ctx(path), 2)
    for p in props:
        assert p.candidate and "split = max(0, nd - 2)" in p.candidate.launcher, p.edit
    for shape in ((64, 16), (3, 7)):
        torch.manual_seed(4)
        _emulate(path, [p.candidate for p in props], 1e-6, inputs=[torch.randn(*shape)])


@needs_gxx
@pytest.mark.slow
def test_emulated_scans_stage_chunks_through_shared_memory(cases):
    """Rows of several chunks (256 threads x 8 items), forward, reverse and exclusive, through the staged
    loads and stores of the tile_shared_memory edit and the direct ones of the plain and tuned plans."""
    for name, inputs in (
        ("scans", [torch.randn(2, 3, 4500)]),
        ("folded_scans", [torch.randn(2, 3, 4100), torch.randn(3, 4600)]),
    ):
        first = [p.candidate for p in ExpertPolicy().propose(ctx(cases[name]), 2)]
        staged = tuned_with_edit(cases[name], "tile_shared_memory")
        assert "__shared__ float stage[" in staged.source
        assert not any("__shared__ float stage[" in c.source for c in first)
        _emulate(cases[name], [*first, staged], 1e-4, inputs=inputs)


MASKED_SCAN = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x, mask):
        return torch.cumsum(x * mask, dim=1), torch.cumprod(x.flip(1) * 0.01 + 1, dim=1).flip(1)


def get_inputs():
    return [torch.randn(5, 2052), torch.rand(5, 2052) > 0.5]


def get_init_inputs():
    return []
"""


@needs_gxx
@pytest.mark.slow
def test_emulated_scans_take_a_warp_per_row(cases, tmp_path):
    """Rows whose length is a multiple of 4 (several steps of 32 lanes x 8 vectors, and a partial one):
    the tuned plan's warp per row, forward, reverse, exclusive, cumprod and a masked sum; the plain plan
    and misaligned rows keep the block per row."""
    masked = tmp_path / "masked_scan.py"
    masked.write_text(MASKED_SCAN)
    for path, inputs in (
        (cases["scans"], [torch.randn(2, 3, 4500)]),
        (cases["folded_scans"], [torch.randn(2, 3, 4100), torch.randn(3, 4600)]),
        (masked, None),
    ):
        plain, fast = (p.candidate for p in ExpertPolicy().propose(ctx(path), 2))
        assert "_wrow" in fast.source and "_wrow" not in plain.source
        assert any(k.endswith("_wrow") for k in _emulate(path, [fast], 1e-4, inputs=inputs))
        assert not any(k.endswith("_wrow") for k in _emulate(path, [plain], 1e-4, inputs=inputs))
    x = _misaligned(3, 4100)
    launched = _emulate(cases["scans"], [tuned(cases["scans"])], 1e-4, inputs=[x.view(1, 3, 4100)])
    assert not any(k.endswith("_wrow") for k in launched), launched


def _misaligned(*shape, dtype=torch.float32):
    """A contiguous tensor whose data starts 4 bytes past an aligned address (16-byte accesses would fault)."""
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n + 1, dtype=dtype)[1:].view(*shape)


@needs_gxx
@pytest.mark.parametrize(
    "name", ["elementwise_chain", "softmax", "layernorm", "reduce_mean", "conv_bias_relu_scale"]
)
def test_emulated_misaligned_inputs_take_the_scalar_path(name):
    shape = {"layernorm": (2, 8192), "reduce_mean": (3, 40, 16), "conv_bias_relu_scale": (1, 64, 4, 4)}.get(
        name, (9, 64)
    )
    path = TASKS / f"{name}.py"
    x = _misaligned(*shape)
    assert x.is_contiguous() and x.data_ptr() % 16
    props = ExpertPolicy().propose(ctx(path), 2)
    launched = _emulate(path, [p.candidate for p in props], 1e-5, inputs=[x])
    if name != "conv_bias_relu_scale":  # its kernel reads cuDNN's fresh (aligned) output
        assert all(k.endswith(("_v1", "_v1_smem", "_combine")) for k in launched), launched


@needs_gxx
def test_emulated_split_reductions_merge_partials(tmp_path):
    """Few rows over a long reduced dim: the reduced dim is split over blocks and a second kernel merges."""
    body = """
        class Model(nn.Module):
            def forward(self, x, y):
                return x.sum(dim=-1), torch.argmax(x, dim=-1), y.mean(dim=1), torch.amax(y, dim=1), torch.var(y, dim=1)
    """
    path = task_file(tmp_path, "splits", body, "[torch.randn(2, 3, 40000), torch.randn(2, 9000, 8)]")
    (tuned,) = ExpertPolicy().propose(ctx(path), 2)[1:]
    launched = _emulate(path, [tuned.candidate], 1e-5)
    combines = {k for k in launched if k.endswith("_combine")}
    assert len(combines) == 5, launched  # row-family sum/argmax and col-family mean/amax/var all split


MAX_EMULATED = 24


def test_expand_as_is_a_view_so_f_normalize_leaves_nothing_to_pytorch(tmp_path):
    """F.normalize decomposes into a norm, clamp_min, expand_as and a division: the expand_as is a view of
    ours (it was a region left to PyTorch between our kernels: 24 of them in level 3's SwinV2), and since
    the division and the addition broadcast by themselves, they read the unexpanded operands (regions.
    _unexpanded): no expand is left, so none is gathered into a full-size copy."""
    body = """
        class Model(nn.Module):
            def forward(self, q, k):
                return F.normalize(q, dim=-1) * 2 + k.expand_as(q)
    """
    path = task_file(tmp_path, "normalize", body, "[torch.randn(4, 3, 7, 33), torch.randn(3, 1, 33)]")
    low = prepare(capture(path))
    assert [r.kind for r in low.regions if r.kind in (RegionKind.TORCH, RegionKind.LIBRARY)] == []
    assert [n.op for n in low.nodes if n.op == "expand"] == []
    _emulate(path, [p.candidate for p in ExpertPolicy().propose(ctx(path), 2)], 1e-5)


def test_a_16_bit_chain_with_a_step_rounds_each_value_as_eager_stores_it(tmp_path):
    """bf16 `x * 1.5 + p` then `> 0.5`: eager rounds the product and the sum to bf16 before it compares; a
    chain that kept them in fp32 put values a hair from 0.5 on the other side (found by the fuzz hunt, seed
    10222, where the step followed a linear's bias)."""
    body = """
        class Model(nn.Module):
            def forward(self, x, p):
                y = x * 1.5 + p
                return y.masked_fill(y > 0.5, -1.0) * 2.0
    """
    inputs = "[torch.randn(64, 300).bfloat16() * 0.4, torch.randn(300).bfloat16() * 0.4]"
    path = task_file(tmp_path, "step_bf16", body, inputs)
    _emulate(path, [p.candidate for p in ExpertPolicy().propose(ctx(path), 2)], 1e-2)


def test_a_prologue_is_hosted_on_its_operand_of_the_regions_own_shape(tmp_path):
    """x1 (N,) has the elements of the (1, N) region but not its shape: the reduction hosting the prologue
    indexes by its main operand's shape, so x0 must be it (x1 was; found by the fuzz hunt, seed 6526)."""
    body = """
        class Model(nn.Module):
            def forward(self, x0, x1, x2):
                return torch.var(x0 / (x1.abs() + 1.0) - x2, dim=1)
    """
    inputs = "[torch.randn(1, 600), torch.randn(600), torch.randn(1, 600)]"
    path = task_file(tmp_path, "prologue_shape", body, inputs)
    props = ExpertPolicy().propose(ctx(path), 2)
    tuned = plan_of(props[1].candidate.source)
    assert [getattr(rp, "prologue", "") for rp in tuned.regions if rp.rid == "var"] != [""]  # still fused
    _emulate(path, [p.candidate for p in props], 1e-5)


@needs_gxx
@pytest.mark.slow
@pytest.mark.parametrize("name", ["norms", "reductions_last", "reductions_strided", "softmaxes", "fusions"])
def test_emulated_edits_match_the_reference(cases, name):
    path = cases[name]
    policy, cands = ExpertPolicy(), []
    for first in policy.propose(ctx(path), 2):
        cands += [k.candidate for k in policy.propose(ctx(path, parent=first.candidate), 30)]
    # A task of many regions has many edits, each an emulator build: an even sample across them (every
    # region's edits come in turn) keeps CI's time, and a fixed stride keeps it deterministic.
    _emulate(path, cands[:: -(-len(cands) // MAX_EMULATED)], CASES[name][3])


def test_without_advice_the_edits_come_in_an_order_drawn_from_the_seed():
    """The no-feedback arm of an ablation: the same vocabulary and budget, the order drawn per run seed and
    parent, the findings not read."""
    path = TASKS / "softmax.py"
    (parent,) = ExpertPolicy().propose(ctx(path), 1)
    finding = Finding("bank", 0.8, {}, "d", "a", edits=("tile_shared_memory",))

    def edits(seed=None, findings=()):
        c = ctx(path, parent=parent.candidate, findings=findings)
        if seed is not None:
            c = dataclasses.replace(c, extra={"blind_seed": seed})
        return [(k.edit, k.candidate.key) for k in ExpertPolicy().propose(c, 50)]

    advised, first, second = edits(findings=(finding,)), edits(1), edits(2)
    assert advised[0][0] == "tile_shared_memory(softmax: smem_row=True)"
    # the same kernels, nothing more or less (two edits may write the same kernel: the first label stays)
    assert {k for _, k in first} == {k for _, k in second} == {k for _, k in advised}
    assert first == edits(1, (finding,)) and first != second  # reproducible, blind to the findings


@needs_gxx
@pytest.mark.parametrize("name", ["elementwise_chain", "softmax", "layernorm"])
def test_the_power_edit_is_made_under_an_energy_objective_only_and_keeps_the_results(name):
    """lower_power (a persistent grid over 75% or 50% of the SMs) comes right after the profile's
    suggestions when the objective counts joules, never when it is time; its kernels compute the same."""
    path = TASKS / f"{name}.py"
    (parent,) = ExpertPolicy().propose(ctx(path), 1)

    def kids(objective):
        c = dataclasses.replace(ctx(path, parent=parent.candidate), extra={"objective": objective})
        return [k for k in ExpertPolicy().propose(c, 50) if k.candidate]

    def roots(objective):  # the root's children: plain, tuned, then the tuned plan with one edit each
        c = dataclasses.replace(ctx(path), extra={"objective": objective})
        return [k.edit for k in ExpertPolicy().propose(c, 50) if k.candidate]

    assert not [k for k in kids("time") if k.edit.startswith("lower_power")]
    assert not [e for e in roots("time") if "lower_power" in e]
    for objective in ("energy", "edp"):
        power = kids(objective)[:2]
        assert [k.edit.split("(")[0] for k in power] == ["lower_power", "lower_power"], [
            k.edit for k in power
        ]
        first = roots(objective)[2:4]  # a short run makes them before the speed edits
        assert [e.split(", ")[1].split("(")[0] for e in first] == ["lower_power"] * 2, first
    shares = [int(m) for k in power for m in re.findall(r"sms \* (\d+) // 100", k.candidate.launcher)]
    assert sorted(set(shares)) == [50, 75]
    torch.manual_seed(3)
    shape = {"layernorm": (5, 8192)}.get(name, (37, 777))
    _emulate(path, [k.candidate for k in power], 1e-5, inputs=[torch.randn(*shape)], sms=8)


@needs_gxx
def test_rms_and_l2_norms_written_by_hand_are_one_norm_reading_each_row_once(tmp_path):
    """Llama's RMSNorm, `x * rsqrt(mean(x^2, -1, keepdim) + eps) * w`, and its variants (x / sqrt, x * x,
    two trailing dims, the rsqrt first) become one rms_norm with the weight on its stores: the row is read
    once; so is x / ||x||. Emulated against float64 PyTorch. Not trailing, no keepdim, another tensor
    squared, or another norm: unchanged."""
    forms = {
        "rms_llama": ("x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w", "(3, 40)"),
        "rms_div": ("x / torch.sqrt(torch.mean(x * x, dim=(-2, -1), keepdim=True) + 1e-5)", "(3, 5, 8)"),
        "rms_first": ("torch.rsqrt(1e-6 + (x ** 2).mean(-1, keepdim=True)) * x", "(3, 40)"),
    }
    for name, (expr, shape) in forms.items():
        body = f"""
            class Model(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.w = nn.Parameter(torch.randn(40))

                def forward(self, x):
                    return {expr}
        """
        path = task_file(tmp_path, name, body, f"[torch.randn{shape}]")
        low = prepare(capture(path))
        norms = [n for n in low.nodes if n.op == "rms_norm"]
        assert len(norms) == 1 and not any(n.op in ("mean", "pow", "rsqrt", "sqrt") for n in low.nodes), name
        assert [r.kind for r in low.regions if r.kind is not RegionKind.EW] == [RegionKind.NORM], name
        tuned = base_plan(low, True)
        assert len(tuned.regions) - len(tuned.fused()) == 1, (name, tuned)  # the weight rides on the norm
        _emulate(path, [p.candidate for p in ExpertPolicy().propose(ctx(path), 2)], 1e-5)
    for name, expr, shape, op, scaled in (  # x / ||x||: one row op, a scale (if any) on its stores
        ("l2_norm", "x / torch.norm(x, p=2, dim=1, keepdim=True)", "(3, 40)", "rms_norm", True),
        (
            "l2_sqrt_sum",
            "x / torch.sqrt(torch.sum(x * x, dim=-1, keepdim=True))",
            "(3, 5, 8)",
            "rms_norm",
            True,
        ),
        ("l1_norm", "x / torch.norm(x, p=1, dim=1, keepdim=True)", "(3, 40)", "l1_norm", False),
        ("l1_sum", "x / torch.sum(torch.abs(x), dim=(-2, -1), keepdim=True)", "(3, 5, 8)", "l1_norm", False),
        ("l1_mean", "x / torch.mean(torch.abs(x), dim=-1, keepdim=True)", "(3, 5, 8)", "l1_norm", True),
        # a row of a block (the tuned plan holds it in registers, the plain one reads it twice)
        ("l1_long", "x / torch.sum(torch.abs(x), dim=-1, keepdim=True)", "(2, 3000)", "l1_norm", False),
    ):
        body = f"class Model(nn.Module):\n    def forward(self, x):\n        return {expr}"
        path = task_file(tmp_path, name, body, f"[torch.randn{shape}]")
        low = prepare(capture(path))
        (norm,) = [n for n in low.nodes if n.op in ("rms_norm", "l1_norm")]
        assert norm.op == op and (op == "l1_norm" or norm.args[3] == 0.0), name
        kinds = [RegionKind.NORM, RegionKind.EW] if scaled else [RegionKind.NORM]
        assert [r.kind for r in low.regions] == kinds, (name, low.regions)
        assert len(base_plan(low, True).regions) - len(base_plan(low, True).fused()) == 1, name
        _emulate(path, [p.candidate for p in ExpertPolicy().propose(ctx(path), 2)], 1e-5)
    for name, expr in (
        ("rms_dim0", "x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6)"),
        ("l2_dim0", "x / torch.norm(x, p=2, dim=0, keepdim=True)"),
        ("l1_other", "x / torch.sum(torch.abs(y), dim=1, keepdim=True)"),
        ("inf_norm", "x / torch.amax(torch.abs(x), dim=1, keepdim=True)"),
        ("normalize", "F.normalize(x, dim=1)"),  # max(||x||, eps): not an rms_norm without eps
        ("rms_nokeep", "x * torch.rsqrt(x.pow(2).mean(-1) + 1e-6)[:, None]"),
        ("rms_other", "x * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)"),
    ):
        body = f"class Model(nn.Module):\n    def forward(self, x, y):\n        return {expr}"
        low = prepare(capture(task_file(tmp_path, name, body, "[torch.randn(3, 40), torch.randn(3, 40)]")))
        assert not any(n.op in ("rms_norm", "l1_norm") for n in low.nodes), name


def test_a_plan_proposed_again_is_not_rendered_again(monkeypatch):
    """The search asks for a node's first moves before its profile and again after it: the second time the
    plans come from memory (a level-3 plan takes seconds to render), the same candidates."""
    from pipeline.generate.expert import policy

    calls: list[str] = []
    real = policy.render

    def counting(low, plan, hunter=None):
        calls.append(plan.to_json())
        return real(low, plan, hunter)

    monkeypatch.setattr(policy, "render", counting)
    monkeypatch.setattr(policy, "_RENDERED", {})
    task = probe(TASKS / "softmax.py")
    ctx = Context(task=task, reference=task.source, parent=None)
    first = ExpertPolicy().propose(ctx, 4)
    assert len(calls) >= 4
    again = ExpertPolicy().propose(ctx, 4)
    assert [p.candidate.key for p in again] == [p.candidate.key for p in first]
    assert len(calls) == len(set(calls))  # none rendered twice


def test_supports_says_when_the_tuned_plans_launcher_would_not_pass(monkeypatch):
    """supports() checks the launcher of the tuned plan as well as the plain one's: a broken one is an
    expert bug, said in the summary (the plain plan still writes the task)."""
    from pipeline.generate.expert import policy

    ok, why = supports(TASKS / "softmax.py")
    assert ok and policy.TUNED_BROKEN not in why, why
    real = policy.render

    def broken_when_tuned(low, plan, hunter=None):
        source, launcher = real(low, plan, hunter)
        tuned = plan != policy.edits.base_plan(low, False)
        return source, ("def forward(:\n" if tuned else launcher)

    monkeypatch.setattr(policy, "render", broken_when_tuned)
    ok, why = supports(TASKS / "softmax.py")
    assert ok and f"{policy.TUNED_BROKEN}: its launcher fails the static check" in why, why
    assert "does not parse" in why, why


@needs_gxx
def test_the_mish_helper_matches_pytorch_over_its_whole_range(tmp_path):
    """The one-exp mish the ops write (kp_mish_exp: n / (n + 2) for tanh(softplus)), element by element
    against float64, from where exp underflows to past its threshold: as close as PyTorch's own fp32 mish;
    and a source gets it only where a kernel calls it."""
    import numpy
    import torch.nn.functional as F
    from cuda_emulator import build

    from pipeline.generate.expert.templates.common import ON_USE, PRELUDE

    src = (
        PRELUDE
        + ON_USE["kp_mish_exp"]
        + textwrap.dedent("""
        extern "C" __global__ void __launch_bounds__(256) kp_mish_each(const float* x, float* y, int n) {
            int i = blockIdx.x * 256 + threadIdx.x;
            if (i < n) y[i] = kp_mish_exp(x[i]);
        }
    """)
    )
    x = torch.cat(
        [torch.linspace(-110.0, 45.0, 8191), torch.tensor([-0.0, 0.0, 1e-30, -1e-30, 20.0, 20.001])]
    )
    y = torch.empty_like(x)
    build(src).kp_mish_each((-(-x.numel() // 256),), (256,), (x, y, numpy.int32(x.numel())))
    exact = F.mish(x.double())
    rel = ((y.double() - exact).abs() / exact.abs().clamp_min(1e-37)).max().item()
    torch_rel = ((F.mish(x).double() - exact).abs() / exact.abs().clamp_min(1e-37)).max().item()
    assert rel < max(2 * torch_rel, 1e-6), (rel, torch_rel)
    with_mish, without = (
        ExpertPolicy()
        .propose(ctx(task_file(tmp_path, name, body, "[torch.randn(64, 256)]")), 1)[0]
        .candidate.source
        for name, body in (
            ("m", "class Model(nn.Module):\n    def forward(self, x):\n        return F.mish(x) * 2"),
            ("t", "class Model(nn.Module):\n    def forward(self, x):\n        return torch.tanh(x) * 2"),
        )
    )
    assert with_mish.count("float kp_mish_exp(") == 1 and "kp_mish_exp(" not in without


def test_a_forward_with_star_args_takes_its_inputs_one_by_one():
    """forward(self, x, *features, scale=2.0, **kw): the launcher's forward names the extra positional inputs
    features_0, features_1... (it was written with one `features` and refused 13 inputs); keyword-only and
    ** parameters keep their defaults and are not positional."""
    import inspect

    from pipeline.generate.expert.graph import _positional_names

    def forward(self, x, *features, scale=2.0, **kw):
        return x

    assert _positional_names(inspect.signature(forward), 4) == ("x", "features_0", "features_1", "features_2")
    assert _positional_names(inspect.signature(forward), 1) == ("x",)

    def plain(self, a, b=None):
        return a

    assert _positional_names(inspect.signature(plain), 1) == ("a", "b")
