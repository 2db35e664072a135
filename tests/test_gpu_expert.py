"""The expert policy's kernels on a real GPU (run by `make test-gpu` on the H200): every template family
against its reference on awkward shapes (odd sizes, non-multiples of any tile, tiny and huge), and each
built-in task's first proposals plus an edited child. Statuses and correctness only: no timed asserts."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from expert_plans import tuned, tuned_with_edit, with_knobs

from pipeline import stages
from pipeline.candidates import make_candidate
from pipeline.config import load
from pipeline.generate.base import Context, ProposalStatus
from pipeline.generate.expert import ExpertPolicy
from pipeline.generate.expert.plan import plan_of
from pipeline.generate.expert.render import uses_cute
from pipeline.tasks import probe
from pipeline.types import Kind, Status

_torch = pytest.importorskip("torch")
# Every test here needs a CUDA device: on a machine without one, `make test-gpu` skips them and says why.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _torch.cuda.is_available(), reason="no CUDA device visible"),
]
ROOT = Path(__file__).resolve().parent.parent
BUILTIN = sorted(p.stem for p in (ROOT / "tasks").glob("*.py"))
HYBRID = {"matmul_bias_gelu", "conv_bias_relu_scale"}
HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-expert-home")


@pytest.fixture(scope="module")
def pool(home):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with stages.open_pool(cfg_for(home)) as p:
        yield p


def cfg_for(home):
    # Correctness is the point: few timing trials, no energy, the eager baseline only; one fused kernel
    # honestly beats a 20-op eager chain by more than 10x, so the anti-cheat speedup bar is raised.
    return load(home=home, baselines=("eager",), energy=False, job_timeout_s=120, timing_trials=5,
                timing_budget_s=0.2, warmup=1, suspicious_speedup=1000.0)  # fmt: skip


# name -> (Model source, init args); each runs on every shape of SHAPES[name]
FAMILIES = {
    # many small launches: the tuned plan replays forward from a CUDA graph (runtime.Graphs)
    "graph": (
        """
        class Model(nn.Module):
            def __init__(self, width):
                super().__init__()
                self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(6))
                self.scales = nn.Parameter(torch.randn(6, width))
            def forward(self, x):
                for i, n in enumerate(self.norms):
                    x = torch.softmax(n(x) * self.scales[i], dim=-1) + x
                return x.sum(dim=-1)
        """,
        "[129]",
    ),
    # cummax / cummin over 64-bit keys: values and indices along the last dim and a middle one
    "cummax": (
        """
        class Model(nn.Module):
            def forward(self, x):
                a, i = torch.cummax(x, dim=-1)
                b, j = torch.cummin(torch.round(x * 2), dim=1)
                return a, i, b, j
        """,
        "[]",
    ),
    # multi_margin_loss lowered: the target's score by a one-hot row sum, the others' hinge, over C
    "multi_margin": (
        """
        class Model(nn.Module):
            def forward(self, x, u):
                t = u.argmax(1)
                return F.multi_margin_loss(x, t), F.multi_margin_loss(x, t, p=2, margin=0.5, reduction="none")
        """,
        "[]",
    ),
    # cdist (p = 2) as PyTorch's mm form: squared norms, one GEMM (3xTF32 in the tuned plan), the root
    "cdist_mm": (
        """
        class Model(nn.Module):
            def forward(self, x, y):
                return torch.cdist(x, y)
        """,
        "[]",
    ),
    # bitonic sorts in shared memory: a median, a nanmedian (NaN rows), a stable argsort, a top-k
    "medians": (
        """
        class Model(nn.Module):
            def forward(self, x):
                n = torch.where(x < -1.0, float("nan"), x)
                m = torch.median(x, dim=-1)
                return (m.values, torch.nanmedian(n, dim=-1).values, torch.argsort(x, dim=-1, stable=True),
                        torch.topk(x, 5, dim=-1).values)
        """,
        "[]",
    ),
    # histc in shared-memory histograms with one global atomic a bin a block; bucketize and searchsorted by
    # eager's binary search, the boundaries staged in shared memory
    "bins": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("edges", torch.linspace(-2.0, 2.0, 101))
            def forward(self, x):
                return (torch.histc(x, bins=64, min=-3, max=3), torch.bucketize(x, self.edges, right=True),
                        torch.searchsorted(self.edges, x * 2.0).float())
        """,
        "[]",
    ),
    # operands read by broadcast over short rows (F.normalize's divisor over heads of 32 or 33): a block
    # takes several rows (templates/elementwise.py's _rowed); heads of a permuted projection read in place
    # (by the norms too), and a mask broadcast along no run of dims
    "head_norms": (
        """
        class Model(nn.Module):
            def forward(self, x):
                B, N, C = x.shape
                q = x.view(B, N, 4, C // 4).transpose(1, 2)
                h, k, v = x.view(B, N, 3, 4, C // 12).permute(2, 0, 3, 1, 4)
                m = torch.tanh(x[0, :, : C // 4]).unsqueeze(1)  # a mask over tokens, broadcast over batch and heads
                return (F.normalize(q, dim=-1) * 2.0, x / x.abs().sum(-1, keepdim=True).expand_as(x) - 1.0,
                        h * 2.0 + k * v, torch.softmax(x.view(B, N, 4, C // 4) + m, dim=-1))
        """,
        "[]",
    ),
    # strided views made contiguous by our gather (templates/code.py's _contig) or read in place: 6-D
    # windows, transposes, a comparison of a transposed view
    "gathers": (
        """
        class Model(nn.Module):
            def forward(self, x):
                B, H, W, C = x.shape
                w = x.view(B, H // 3, 3, W // 5, 5, C).permute(0, 1, 3, 2, 4, 5)
                return (torch.softmax(w, dim=-1), F.layer_norm(x.permute(0, 3, 1, 2), (H, W)),
                        torch.cumsum(x.transpose(1, 2), dim=-1), (x.mT > 0).float().sum(-1), torch.argmax(x.mT, dim=-1))
        """,
        "[]",
    ),
    # col2im: blocks summed into their planes by a thread a pixel; a strided, dilated one over a slice
    "fold": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return F.fold(x, (33, 35), 3, padding=1), F.fold(x[..., :306], (33, 35), 3, dilation=2, padding=2,
                                                               stride=2)
        """,
        "[]",
    ),
    "count_nonzero": (  # the fp32 sum of x != 0, stored as int64
        """
        class Model(nn.Module):
            def forward(self, x):
                n = x.round()
                return torch.count_nonzero(n), torch.count_nonzero(n, dim=1), torch.count_nonzero(n, dim=(0, 2))
        """,
        "[]",
    ),
    "chain": (
        """
        class Model(nn.Module):
            def forward(self, x):
                y = F.gelu(x * 1.5 - 0.25) + torch.sigmoid(x) * F.silu(x) - F.hardswish(x) / 3
                return torch.clamp(y, -2.0, 3.0) + F.leaky_relu(x, 0.1) + F.mish(x) + F.softplus(x) * F.elu(x)
        """,
        "[]",
    ),
    "broadcast": (
        """
        class Model(nn.Module):
            def __init__(self, channels, width):
                super().__init__()
                self.c = nn.Parameter(torch.randn(channels, 1, 1))
                self.f = nn.Parameter(torch.randn(width))
            def forward(self, x):
                return torch.relu(x * self.c + self.f) - torch.tanh(x + self.c)
        """,
        "[33, 19]",
    ),
    "bf16": (
        """
        class Model(nn.Module):
            def forward(self, x, y):
                return F.gelu(x + y, approximate="tanh") * 0.5 - y
        """,
        "[]",
    ),
    "reduce_last": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return (x.sum(dim=-1), torch.argmax(x, dim=-1), torch.var(x, dim=-1), torch.logsumexp(x, dim=-1),
                        torch.amax(x, dim=-1))
        """,
        "[]",
    ),
    "reduce_mid": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return x.mean(dim=1), torch.max(x, dim=1)[0], torch.argmin(x, dim=1), *torch.min(x, dim=1)
        """,
        "[]",
    ),
    "reduce_all": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return x.sum() * 1e-3, torch.amax(x)
        """,
        "[]",
    ),
    "softmax": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return torch.softmax(x, dim=-1), torch.log_softmax(x, dim=1)
        """,
        "[]",
    ),
    # over the channels of a conv's output (level 2's Conv3d + Softmax): each column's 16 or 7 rows held in
    # registers, read once; 100 rows stream
    "softmax_channels": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return torch.softmax(x, dim=1) * 2, torch.log_softmax(x, dim=1)
        """,
        "[]",
    ),
    # KernelBench's RMSNorm over the channels, written by hand: one column op, its 64 rows in registers
    "rms_channels": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return x / torch.sqrt(torch.mean(x ** 2, dim=1, keepdim=True) + 1e-5)
        """,
        "[]",
    ),
    "layer_rms": (
        """
        class Model(nn.Module):
            def __init__(self, width):
                super().__init__()
                self.ln = nn.LayerNorm(width)
                self.rms = nn.RMSNorm(width)
            def forward(self, x):
                return self.ln(x) + self.rms(x * 2.0)
        """,
        "[4097]",
    ),
    "rms_by_hand": (  # Llama's RMSNorm as written by hand: one rms_norm, the weight on its stores
        """
        class Model(nn.Module):
            def __init__(self, width):
                super().__init__()
                self.w = nn.Parameter(torch.ones(width))
            def forward(self, x):
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        """,
        "[4097]",
    ),
    "norms_by_hand": (  # x / ||x||_2 (an rms_norm without eps, scaled) and x / mean|x| (an l1_norm, scaled)
        """
        class Model(nn.Module):
            def forward(self, x):
                return x / torch.norm(x, p=2, dim=-1, keepdim=True), x / torch.mean(torch.abs(x), dim=-1, keepdim=True)
        """,
        "[]",
    ),
    "long_rows": (  # rows over 160 KB: each over a thread-block cluster, statistics through DSMEM
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.inn = nn.InstanceNorm2d(3, affine=True)
            def forward(self, x):
                return torch.log_softmax(x.flatten(2), dim=-1), self.inn(x)
        """,
        "[]",
    ),
    "layer_norm_few_rows": (  # 2 rows of a million: each split across blocks (templates/rowwise.py)
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln = nn.LayerNorm((64, 128, 129))
            def forward(self, x):
                return torch.relu(self.ln(x))
        """,
        "[]",
    ),
    "intrinsics": (  # logs and exponentials (elementwise, and fused into KL divergence's sum) on the MUFU
        """
        class Model(nn.Module):
            def forward(self, x):
                p, t = torch.softmax(x, dim=-1), torch.softmax(x * 0.7 + 0.3, dim=-1)
                return (F.kl_div(torch.log(p), t, reduction="batchmean"),
                        torch.log(x.abs() + 1e-3) + torch.exp(-x) * torch.sigmoid(x) + F.silu(x)
                        + torch.log10(x.abs() + 1.0) + torch.exp2(x * 0.5))
        """,
        "[]",
    ),
    "group_instance": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.gn = nn.GroupNorm(4, 12)
                self.inn = nn.InstanceNorm2d(12, affine=True)
            def forward(self, x):
                return self.gn(x) - self.inn(x)
        """,
        "[]",
    ),
    # GroupNorm over (N, C), channels of one element (level 2's Gemm_GroupNorm tasks): after our GEMM, and
    # with many groups before a min whose N x 1 result broadcasts against a 1 x C x 1 x 1 bias
    "linear_group_norm": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(1036, 1024)
                self.gn = nn.GroupNorm(16, 1024)
            def forward(self, x):
                return F.hardtanh(self.gn(self.fc(x)), -2.0, 2.0)
        """,
        "[]",
    ),
    "group_norm_min_bias": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.gn = nn.GroupNorm(256, 1024)
                self.bias = nn.Parameter(torch.randn(1, 96, 1, 1))
            def forward(self, x):
                return torch.min(self.gn(x), dim=1, keepdim=True)[0] + self.bias
        """,
        "[]",
    ),
    "scan": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return torch.cumsum(x, dim=-1), torch.cumsum(x, dim=1)
        """,
        "[]",
    ),
    "folded_scans": (  # reverse (flips folded) and exclusive (a cat of zeros folded) scans, rows and columns
        """
        class Model(nn.Module):
            def forward(self, x):
                return (torch.cumsum(x.flip(-1), -1).flip(-1), torch.cumsum(x.flip(1), 1).flip(1),
                        torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1].cumsum(1)), 1))
        """,
        "[]",
    ),
    "cosine": (  # three row sums, each product on its loads, the norms' clamp and the division after
        """
        class Model(nn.Module):
            def forward(self, a, b):
                return torch.mean(1 - F.cosine_similarity(a, b, dim=1)), F.cosine_similarity(a, -a, dim=1)
        """,
        "[]",
    ),
    "cross_entropy": (  # logsumexp in our row reduction, x[i, t[i]] our masked gather; the model's where PyTorch's
        """
        class Model(nn.Module):
            def forward(self, x, u):
                t = torch.where(u[:, 0] > 1.5, -100, u.argmax(1))  # about 7% of the targets ignored
                return (F.cross_entropy(x, t), F.cross_entropy(x * 0.5, t, reduction="none"),
                        F.cross_entropy(x, t, label_smoothing=0.1))
        """,
        "[]",
    ),
    "triplet": (  # one pass over the three inputs, a warp a row (families/triplet.py): mean, none, sum
        """
        class Model(nn.Module):
            def forward(self, a, p, n):
                return (F.triplet_margin_loss(a, p, n), F.triplet_margin_loss(a, p, n, p=1, reduction="none"),
                        F.triplet_margin_loss(a, n, p, margin=0.2, reduction="sum"))
        """,
        "[]",
    ),
    "kl_div": (  # elementwise ops and a reduction, batchmean a sum and a division
        """
        class Model(nn.Module):
            def forward(self, p, t):
                return F.kl_div(torch.log(p.sigmoid()), t.sigmoid(), reduction="batchmean")
        """,
        "[]",
    ),
    "prologue_vectors": (  # a whole-tensor loss and row logsumexps whose prologues read b as 16-byte vectors
        """
        class Model(nn.Module):
            def forward(self, a, b):
                return torch.mean((a - b) ** 2), torch.logsumexp(a * b, dim=-1)
        """,
        "[]",
    ),
    "linear_epilogue": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(1024, 1000, dtype=torch.bfloat16)
            def forward(self, x):
                return F.gelu(self.linear(x), approximate="tanh") * 0.5
        """,
        "[]",
    ),
    "rms_default_eps_f16": (  # no eps: PyTorch adds float32's epsilon, not fp16's (rows of small values)
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.n = nn.RMSNorm([33], dtype=torch.float16)
            def forward(self, x):
                return self.n(torch.softmax(x, dim=-1))
        """,
        "[]",
    ),
    "linear_lone_f16": (  # nothing after the GEMM: our WGMMA kernel alone, fp16, no bias
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(1024, 1000, bias=False, dtype=torch.float16)
            def forward(self, x):
                return self.linear(x)
        """,
        "[]",
    ),
    "linear_odd": (  # odd N (no paired stores), K not a multiple of the 64-wide k-tile, a per-feature scale
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(1032, 1001, dtype=torch.bfloat16)
                self.s = nn.Parameter(torch.rand(1001, dtype=torch.bfloat16) + 0.5)
            def forward(self, x):
                return torch.relu(self.linear(x)) * self.s + 0.5
        """,
        "[]",
    ),
    "matmul_triangular": (  # triu / tril in the WGMMA epilogue (rows per matrix), else their own kernel
        """
        class Model(nn.Module):
            def forward(self, a, b):
                return torch.tril(torch.triu(torch.matmul(a, b), -3), 5)
        """,
        "[]",
    ),
    "matmul_lone": (  # B row-major (K, N): MN-major operand boxes; A's leading dims are rows
        """
        class Model(nn.Module):
            def forward(self, a, b):
                return torch.matmul(a, b)
        """,
        "[]",
    ),
    "bmm_epilogue": (  # one GEMM per batch, a per-row operand indexed across batches
        """
        class Model(nn.Module):
            def forward(self, a, b, c):
                return torch.relu(torch.bmm(a, b)) * 2.0 + c
        """,
        "[]",
    ),
    "matmul_4d_f16": (  # batch dims flattened, a full residual
        """
        class Model(nn.Module):
            def forward(self, a, b, c):
                return a @ b + c
        """,
        "[]",
    ),
    "addmm": (  # alpha and beta, a per-feature bias
        """
        class Model(nn.Module):
            def forward(self, a, b, c):
                return torch.addmm(c, a, b, beta=0.5, alpha=2.0)
        """,
        "[]",
    ),
    "matmul_misaligned": (  # a contiguous view 2 bytes off alignment: the launcher copies it for TMA
        """
        class Model(nn.Module):
            def forward(self, x, b):
                return torch.matmul(x[1:].view(300, 1024), b)
        """,
        "[]",
    ),
    "linear_f32_epilogue": (  # fp32: our 3xTF32 kernel, K-major weight, bias and activation on the stores
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(1036, 1001)
            def forward(self, x):
                return F.gelu(self.linear(x)) * 0.5 + 1.0
        """,
        "[]",
    ),
    "linear_f32_persistent": (  # fp32 over a short K on a grid of several waves: the tuned plan's persistent
        # grid walks its tiles (the ring running on across them), its hedge a block a tile
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(100, 300)
            def forward(self, x):
                return F.gelu(self.linear(x)) + x[..., :1]
        """,
        "[]",
    ),
    "linear_f32_narrow": (  # into a few columns from a small x: the CUDA cores' kernel over many groups of rows
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(512, 24, bias=False)
            def forward(self, x):
                return 16.0 * torch.sigmoid(self.linear(torch.relu(x)))
        """,
        "[]",
    ),
    "linear_f32_tiny_k": (  # K = 3: an outer product on the CUDA cores, an output a thread, the epilogue fused
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(3, 300)
            def forward(self, x):
                return torch.relu(self.linear(x))
        """,
        "[]",
    ),
    "bmm_f32_persistent": (  # one GEMM a batch, the batch read from the tile index of a persistent grid
        """
        class Model(nn.Module):
            def forward(self, a, b):
                return torch.bmm(a, b) * 0.5
        """,
        "[]",
    ),
    "linear_f32_split": (  # fp32, few tiles and a long K: K split, bias + residual + ReLU in the sum kernel
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(4100, 200)
            def forward(self, x, y):
                return torch.relu(self.linear(x) + y)
        """,
        "[]",
    ),
    "matmul_f32": (  # fp32, B row-major (K, N): gathered K-major before our kernel
        """
        class Model(nn.Module):
            def forward(self, a, b):
                return torch.matmul(a, b)
        """,
        "[]",
    ),
    "matmul_f32_transposed": (  # fp32, both operands transposed views (level 1's 18): read in place
        """
        class Model(nn.Module):
            def forward(self, a, b):
                return torch.matmul(a.transpose(-1, -2), b.transpose(-1, -2))
        """,
        "[]",
    ),
    "bmm_f32_epilogue": (  # fp32, one GEMM per batch, a per-row term
        """
        class Model(nn.Module):
            def forward(self, a, b, c):
                return torch.relu(torch.bmm(a, b)) - c
        """,
        "[]",
    ),
    "gemv_f32": (  # matrix-vector products: row-wise dot products, the product on their loads
        """
        class Model(nn.Module):
            def forward(self, a, b):
                return torch.matmul(a, b), torch.mv(a, b[:, 0]) * 0.5
        """,
        "[]",
    ),
    "gemv_bf16": (  # the same in bf16: fp32 sums of the products, rounded once
        """
        class Model(nn.Module):
            def forward(self, a, b):
                return torch.matmul(a, b), torch.mv(a, b[:, 0]) * 0.5
        """,
        "[]",
    ),
    # the implicit GEMM's cases have K above the direct kernel's tap-wise bound (NARROW_K_TAPS, 96)
    "conv2d_f32": (  # fp32 implicit GEMM: strides, padding and dilation per axis, 13 channels padded to 16 per tap
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(13, 40, 3, stride=(2, 1), padding=(1, 2), dilation=(1, 2))
                self.s = nn.Parameter(torch.rand(40, 1, 1) + 0.5)
            def forward(self, x):
                return torch.relu(self.conv(x)) * self.s
        """,
        "[]",
    ),
    "conv_tapwise_f32": (  # 81 taps, more than the channel-inner gather's 64: the tap-wise gather, its prefetch
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(8, 24, 9, padding=4)
            def forward(self, x):
                return self.conv(x) - 0.25
        """,
        "[]",
    ),
    "conv3d_f32": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv3d(5, 24, 3, padding=1)
            def forward(self, x):
                return torch.tanh(self.conv(x))
        """,
        "[]",
    ),
    "conv1d_f32": (  # 130 channels: two tiles of 96, the second mostly past N
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv1d(20, 130, 5, stride=2, bias=False)
            def forward(self, x):
                return self.conv(x)
        """,
        "[]",
    ),
    "dwconv_f32": (  # depthwise on the CUDA cores (the direct kernel), stride 2, a multiplier of 2
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(12, 24, 3, stride=2, padding=1, groups=12)
            def forward(self, x):
                return torch.relu(self.conv(x))
        """,
        "[]",
    ),
    "grouped_conv_f16": (  # grouped 1-D, fp16
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv1d(12, 9, 4, stride=3, padding=2, groups=3, bias=False, dtype=torch.float16)
            def forward(self, x):
                return self.conv(x)
        """,
        "[]",
    ),
    "grouped_convt_f32": (  # grouped transposed 2-D: strided, padded, dilated, an output padding, a bias
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.ConvTranspose2d(32, 48, (3, 5), stride=(2, 3), padding=(1, 2), output_padding=1,
                                               groups=4, dilation=(2, 1))
            def forward(self, x):
                return self.conv(x)
        """,
        "[]",
    ),
    # pooling on the CUDA cores: max with dilation and ceil mode, average without the padding in the count
    "max_pool3d": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.p = nn.MaxPool3d(3, stride=2, padding=1, dilation=2, ceil_mode=True)
            def forward(self, x):
                return self.p(x)
        """,
        "[]",
    ),
    "pool_rows": (  # stride-1 windows over long rows: staged in a warp's shared memory, several warps a row
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.m = nn.MaxPool1d(8, stride=1, padding=4, dilation=3)
                self.a = nn.AvgPool2d(4, stride=1, padding=1)
            def forward(self, x):
                return self.m(x.flatten(2)), self.a(x)
        """,
        "[]",
    ),
    "avg_pool2d": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.p = nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
            def forward(self, x):
                return self.p(x)
        """,
        "[]",
    ),
    # attention (our fused kernel, 3xTF32): SDPA causal (top-left when L < S), SDPA with a bool mask and a
    # scale, a GPT block's hand-written chain (a causal mask sliced from a buffer), ReLU in place of softmax
    "sdpa_causal": (
        """
        class Model(nn.Module):
            def forward(self, q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        """,
        "[]",
    ),
    "sdpa_mask": (
        """
        class Model(nn.Module):
            def forward(self, q, k, v, m):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m > 0, scale=0.3)
        """,
        "[]",
    ),
    "attention_chain": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = nn.Linear(64, 192)
                self.proj = nn.Linear(64, 64)
                self.register_buffer("bias", torch.tril(torch.ones(256, 256)).view(1, 1, 256, 256))
            def forward(self, x):
                B, T, C = x.size()
                q, k, v = self.qkv(x).split(64, dim=2)
                q, k, v = (t.view(B, T, 2, 32).transpose(1, 2) for t in (q, k, v))
                att = (q @ k.transpose(-2, -1)) * (1.0 / 32 ** 0.5)
                att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
                y = F.softmax(att, dim=-1) @ v
                return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        """,
        "[]",
    ),
    "relu_attention": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("bias", torch.tril(torch.ones(256, 256)).view(1, 1, 256, 256))
            def forward(self, q, k, v):
                T = q.size(-2)
                att = (q @ k.transpose(-2, -1)) * 0.125
                att = F.relu(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")))
                return att @ v
        """,
        "[]",
    ),
    # Swin's shifted windows: cosine scores, a bias a head, a mask a window added through a view that splits
    # the batch (images, windows, heads, N, N), the softmax and the product in our kernel
    "swin_attention": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(3, 1, 1)))
                self.bias = nn.Parameter(torch.randn(3, 64, 64))
                m = torch.randint(0, 3, (4, 64))
                self.register_buffer("mask", (m.unsqueeze(1) - m.unsqueeze(2) != 0).float() * -100.0)
            def forward(self, q, k, v):
                B, H, N, _ = q.shape
                att = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
                scale = torch.clamp(self.logit_scale[:H], max=4.6052).exp()
                att = att * scale + 16 * torch.sigmoid(self.bias[:H, :N, :N])
                att = att.view(B // 4, 4, H, N, N) + self.mask[:, :N, :N].unsqueeze(1).unsqueeze(0)
                return F.softmax(att.view(B, H, N, N), dim=-1) @ v
        """,
        "[]",
    ),
    # one-pass reductions over short rows, several rows a warp: F.normalize over heads of a permuted
    # projection (32 floats, or 33: off the vector alignment), sums and arg-maxima over rows of 12
    "short_rows": (
        """
        class Model(nn.Module):
            def forward(self, x):
                q, k, v = x.view(x.shape[0], x.shape[1], 3, 4, -1).permute(2, 0, 3, 1, 4)
                r = x.view(-1, 12)
                return F.normalize(q, dim=-1), r.sum(-1), r.argmax(-1)
        """,
        "[]",
    ),
    # transposed, stride 2: the gather keeps the taps stride divides (32 x 2.25 products an output: the GEMM's)
    "convt2d_f32": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.ConvTranspose2d(32, 40, 3, stride=2, padding=1, output_padding=1)
            def forward(self, x):
                return torch.relu(self.conv(x))
        """,
        "[]",
    ),
    "convt3d_f32": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.ConvTranspose3d(12, 24, 3, stride=(1, 2, 2), padding=1, bias=False)
            def forward(self, x):
                return self.conv(x) * 2.0
        """,
        "[]",
    ),
    # 40 and 48 input channels: a k tile's two 16-channel halves gather a tap each (CINP 48, not 64)
    "conv_halves_f32": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.convt = nn.ConvTranspose3d(48, 40, 3, padding=1)
                self.conv = nn.Conv2d(40, 64, 3, padding=1)
            def forward(self, x):
                y = self.convt(x)
                return self.conv(y.flatten(1, 2)[:, :40]), y
        """,
        "[]",
    ),
    # ungrouped, stride 5 along the row, 6 x 0.36 products an output: the direct kernel's (KernelBench's 81)
    "sparse_convt_f32": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.ConvTranspose2d(6, 10, 3, stride=5, padding=1, dilation=2)
            def forward(self, x):
                return torch.relu(self.conv(x))
        """,
        "[]",
    ),
    # ungrouped, 3 to 16 channels (KernelBench level 2's 3-D ones): narrow, the direct kernel's, chain fused
    "narrow_conv3d_f32": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv3d(3, 16, 3, padding=(1, 0, 2))
            def forward(self, x):
                return torch.sigmoid(torch.tanh(self.conv(x) * 0.5))
        """,
        "[]",
    ),
    "conv_epilogue": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(16, 24, 3, padding=1)
                self.bn = nn.BatchNorm2d(24)
            def forward(self, x):
                return torch.relu(self.bn(self.conv(x))) * 2.0
        """,
        "[]",
    ),
    # data movement by our strided copies (families/movement.py): 16-byte pieces where rows align, element
    # pieces elsewhere, a transposed input read in place, a roll over the flat tensor, repeat, windows, a pad
    "movement": (
        """
        class Model(nn.Module):
            def forward(self, x, y):
                a = torch.flip(x, dims=(0, -1))
                b = torch.roll(x, shifts=(3, -5), dims=(-1, 0))
                c = torch.cat([a, y, b.transpose(0, 1).transpose(0, 1)], dim=1)
                return (c, torch.stack([x, a], -1), torch.roll(y.transpose(-1, -2), 7), x.repeat(1, 2, 3),
                        x.unfold(-1, 1, 1), F.pad(y, (3, 1, 0, -1), value=-2.0))
        """,
        "[]",
    ),
    # windows partitioned and merged back (Swin's): 6-D permuted views made contiguous by the fast fp32 gather,
    # 16 bytes a thread where the channels allow, an element a thread where they do not
    "window_gather": (
        """
        class Model(nn.Module):
            def forward(self, x):
                b, h, w, c = x.shape
                win = x.view(b, h // 7, 7, w // 7, 7, c).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, 49, c)
                back = (win * 2.0).view(b, h // 7, w // 7, 7, 7, c).permute(0, 1, 3, 2, 4, 5).contiguous()
                return back.view(b, h * w, c) + 1.0, win.transpose(1, 2).contiguous()
        """,
        "[]",
    ),
    # special functions: digamma (ours), Bessel i0 / i1, erfcx, erfinv, the normal CDF and its inverse (CUDA's)
    "special": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return (torch.digamma(x * 2.0), torch.special.i0(x), torch.special.i1(x * 0.5), torch.special.erfcx(x),
                        torch.erfinv(torch.tanh(x)), torch.special.ndtr(x), torch.special.ndtri(torch.sigmoid(x)))
        """,
        "[]",
    ),
    # logcumsumexp as a scan with log-add-exp: along rows (chunks, or a warp a row), down columns, reversed
    "logcumsumexp": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return torch.logcumsumexp(x, dim=-1), torch.logcumsumexp(x.flip(0), 0).flip(0) * 0.5
        """,
        "[]",
    ),
    # strided views read in place by a flat chain: SwiGLU's halves of one projection (rows at twice their
    # length), a slice of the middle dim
    "ew_views": (
        """
        class Model(nn.Module):
            def forward(self, x):
                a, b = x.chunk(2, dim=-1)
                return F.silu(a) * b, torch.relu(x[:, 8:40]) * x[:, :32]
        """,
        "[]",
    ),
    # constant padding written from the output's side in one launch: images padded on both sides, a
    # transposed input cropped by negative padding, a flag map padded with True, the channels padded
    "pads": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return (F.pad(x, (3, 3, 3, 3)), F.pad(x.mT, (1, -2, 0, 5), value=-1.5), F.pad(x > 0, (2, 2),
                        value=True), F.pad(x, (0, 0, 0, 0, 1, 2), value=7.0))
        """,
        "[]",
    ),
    # elementwise producers sunk into a cat's and a stack's output (the tuned plan): each writes its slice
    # with the output's row stride, 16-byte stores where the rows align; x copied
    "cat_sink": (
        """
        class Model(nn.Module):
            def forward(self, x, y):
                c = torch.cat([torch.relu(x), y * 0.5 - 1.0, x], dim=1)
                return c, torch.stack([torch.sigmoid(x), x], 0)
        """,
        "[]",
    ),
    # direct convolutions (bias and ReLU fused) written into their channel slices of a cat: a SqueezeNet fire
    # module and a depthwise branch, nothing copied
    "conv_fire_sink": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.squeeze = nn.Conv2d(16, 8, 1)
                self.expand1 = nn.Conv2d(8, 16, 1)
                self.expand3 = nn.Conv2d(8, 16, 3, padding=1)
                self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)

            def forward(self, x):
                s = torch.relu(self.squeeze(x))
                return torch.cat([torch.relu(self.expand1(s)), torch.relu(self.expand3(s)), self.dw(x)], 1)
        """,
        "[]",
    ),
    # a join of 20 inputs: 18 contiguous ones by two joined launches (16 a launch), a transposed view by its
    # own piece, a ReLU writing its own slice; a flip of the last dim read backwards 16 bytes at a time
    "join_many": (
        """
        class Model(nn.Module):
            def forward(self, x, y):
                return torch.cat([x] * 18 + [y.mT, torch.relu(y.mT)], 1), torch.flip(x, dims=(-1,))
        """,
        "[]",
    ),
    # implicit-GEMM convolutions (3xTF32 WGMMA, bias and ReLU fused) written into their channel slices of a
    # cat at its batch stride, an Inception join; x copied
    "conv_cat_sink": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Conv2d(64, 64, 1)
                self.b = nn.Conv2d(64, 32, 3, padding=1)

            def forward(self, x):
                return torch.cat([self.a(x), torch.relu(self.b(x)), x], 1)
        """,
        "[]",
    ),
    # a UNet decoder's join: a strided transposed convolution (the WGMMA kernel's phases) written into its
    # channel slice, the skip connection copied beside it
    "conv_t_cat_sink": (
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.up = nn.ConvTranspose2d(64, 64, 3, stride=2, padding=1, output_padding=1)

            def forward(self, x, skip):
                return torch.cat([self.up(x), skip], 1)
        """,
        "[]",
    ),
    # interpolation (families/resample.py): nearest at integer and fractional scales, bilinear both ways
    "resample": (
        """
        class Model(nn.Module):
            def forward(self, x):
                return (F.interpolate(x, scale_factor=2, mode="bilinear"), F.interpolate(x, scale_factor=1.7),
                        F.interpolate(x, size=(9, 31), mode="bilinear", align_corners=True),
                        F.interpolate(x, scale_factor=(0.5, 3), mode="nearest-exact"),
                        F.adaptive_avg_pool2d(x, (2, 3)), F.adaptive_max_pool2d(x, (1, 2), return_indices=True)[1])
        """,
        "[]",
    ),
    # batch norm on the batch's own statistics: per-channel mean and variance as reductions, the squares on
    # the variance's loads, then the affine norm
    "batch_stats": (
        """
        class Model(nn.Module):
            def __init__(self, c):
                super().__init__()
                self.bn = nn.BatchNorm2d(c, track_running_stats=False)
            def forward(self, x):
                return torch.relu(self.bn(x))
        """,
        "[64]",
    ),
    # a router's top-k and a stable sort of rows (families/select.py): bitonic sorts in shared memory
    "select": (
        """
        class Model(nn.Module):
            def forward(self, x):
                w, e = torch.softmax(x, dim=-1).topk(8, dim=-1)
                s = torch.sort(x, dim=-1, descending=True, stable=True)
                return w / w.sum(dim=-1, keepdim=True), e, s.values, s.indices
        """,
        "[]",
    ),
    # vector-matrix products: column-wise dot products, v * m on the loads
    "gevm_f32": (
        """
        class Model(nn.Module):
            def forward(self, v, m):
                return torch.relu(torch.matmul(v, m))
        """,
        "[]",
    ),
}
# Rows held in registers (4096 columns fit), weight and bias read as vectors: the same model, another width.
FAMILIES["layer_rms_4k"] = (FAMILIES["layer_rms"][0], "[4096]")
FAMILIES["linear_f32_skinny"] = (FAMILIES["linear_f32_split"][0].replace("4100", "1030"), "[]")
FAMILIES["movement_bf16"] = FAMILIES["movement"]  # 8 elements a 16-byte piece
FAMILIES["pads_bf16"] = FAMILIES["pads"]  # the fill rounded to bf16
FAMILIES["resample_bf16"] = FAMILIES["resample"]
SHAPES = {
    "graph": ["(3, 37, 129)"],
    "cummax": ["(3, 7, 4099)", "(5, 1000, 3)"],
    "bins": ["(1000, 777)", "(3,)", "(2**24 + 3,)"],
    "gathers": ["(4, 63, 65, 129)", "(2, 3, 5, 4)"],
    "head_norms": ["(3, 37, 396)", "(5, 999, 384)"],
    "fold": ["(4, 72, 1155)", "(1, 9, 1155)"],
    "count_nonzero": ["(33, 1001, 67)"],
    "medians": ["(7, 33, 999)", "(2, 4096)"],
    "cdist_mm": ["(4, 1000, 64); (4, 777, 64)", "(999, 128); (1001, 128)"],
    "multi_margin": ["(4097, 1000); (4097, 1000)", "(3, 5); (3, 5)"],
    "chain": ["(1000, 777)", "(3, 5, 4099)", "(7,)", "(2**25 + 3,)"],
    "broadcast": ["(5, 33, 17, 19)", "(1, 33, 1, 19)"],
    "bf16": ["(1001, 1003)"],
    "reduce_last": ["(4097, 999)", "(3, 2)", "(2, 100003)"],
    "reduce_mid": ["(3, 1001, 77)", "(5, 33, 7, 3)", "(64, 4096, 512)", "(96, 22, 900)"],  # the last: R short
    "reduce_all": ["(2**24 + 1,)", "(5,)"],
    "softmax": ["(999, 777)", "(3, 7, 20001)", "(2, 5, 1)", "(37, 4096)", "(2, 200003)"],
    "softmax_channels": ["(4, 16, 9, 33, 20)", "(3, 7, 1001)", "(2, 100, 8, 9)"],
    "rms_channels": ["(3, 64, 33, 65)", "(2, 80, 100)"],
    "layer_norm_few_rows": ["(2, 64, 128, 129)"],
    # clusters of 2 (361 KB rows, unaligned), of 8 (LogSoftmax's 1.5 MB, unaligned and whole: segments in
    # shared memory), rows too long for any (4 MB: the tiles of a cooperative grid); 256 KB rows, each
    # block's segment in registers; the edit (EDITED) takes each cluster to twice the blocks (16: where the
    # GPU has room)
    "long_rows": [
        "(2, 3, 300, 301)",
        "(1, 3, 1, 393215)",
        "(1, 3, 1003, 1001)",
        "(2, 3, 256, 256)",
        "(1, 3, 1, 393216)",
    ],
    "layer_rms": ["(1001, 4097)", "(2, 3, 4097)"],
    "layer_rms_4k": ["(1001, 4096)"],
    "rms_by_hand": ["(1001, 4097)", "(2, 3, 4097)"],
    "norms_by_hand": ["(1001, 4097)", "(3, 4096)", "(2, 5, 3)"],
    # the last: 3.6 MB groups over a cooperative grid's tiles, 1.2 MB instances over clusters of 16
    "intrinsics": ["(1001, 4097)", "(3, 5, 7)"],
    "group_instance": ["(3, 12, 31, 33)", "(1, 12, 1, 3)", "(2, 12, 600, 501)"],
    "linear_group_norm": ["(33, 1036)", "(1, 1036)"],
    "group_norm_min_bias": ["(300, 1024)", "(5, 1024)"],
    # rows of a multiple of 4 take the tuned plan's warp per row; the others, and the columns, a block or thread
    "scan": ["(129, 10007)", "(4, 1003, 65)", "(67, 8196)"],
    "folded_scans": ["(129, 10007)", "(4, 1003, 65)", "(67, 8196)"],
    "kl_div": ["(1001, 4097); (1001, 4097)"],
    "prologue_vectors": ["(7, 100003); (7, 100003)", "(2, 40001); (2, 40001)"],
    "triplet": ["(4097, 1000); (4097, 1000); (4097, 1000)", "(3, 7); (3, 7); (3, 7)"],
    "cross_entropy": ["(4097, 32000); (4097, 32000)", "(3, 5); (3, 5)"],
    "cosine": ["(128, 4096); (128, 4096)", "(3, 5); (3, 5)"],
    "matmul_triangular": [
        "(300, 1024); (1024, 1000)",
        "(3, 129, 1032); (3, 1032, 136)",
        "(2, 77, 1032); (1032, 136)",
    ],
    "linear_epilogue": ["(999, 1024)", "(3, 7, 1024)"],
    "linear_lone_f16": ["(300, 1024)", "(1, 1024)", "(4099, 1024)"],
    "rms_default_eps_f16": ["(5, 33)", "(4099, 33)"],
    "linear_odd": ["(77, 1032)", "(1, 1032)", "(2, 1300, 1032)"],
    "conv_epilogue": ["(3, 16, 37, 53)", "(1, 16, 5, 7)"],
    "conv2d_f32": ["(3, 13, 37, 53)", "(1, 13, 2, 9)"],
    "conv3d_f32": ["(2, 5, 9, 17, 13)"],
    "conv_tapwise_f32": ["(2, 8, 21, 19)"],
    "conv1d_f32": ["(4, 20, 301)"],
    "convt2d_f32": ["(2, 32, 17, 13)"],
    "dwconv_f32": ["(3, 12, 37, 53)", "(1, 12, 1, 2)"],
    "grouped_conv_f16": ["(2, 12, 301)"],
    "grouped_convt_f32": ["(3, 32, 37, 29)"],
    "convt3d_f32": ["(2, 12, 5, 9, 7)"],
    "conv_halves_f32": ["(2, 48, 1, 17, 19)"],
    "sparse_convt_f32": ["(3, 6, 13, 29)"],
    "narrow_conv3d_f32": ["(2, 3, 7, 13, 11)"],
    "sdpa_causal": [
        "(2, 3, 77, 64); (2, 3, 77, 64); (2, 3, 77, 64)",
        "(1, 2, 131, 40); (1, 2, 200, 40); (1, 2, 200, 16)",
        "(3, 45, 8); (3, 45, 8); (3, 45, 8)",
        "(197, 8, 2, 64); (197, 8, 2, 64); (197, 8, 2, 64)",  # few keys: the CUDA-core form (ViT's)
        "(2, 3, 5, 24); (2, 3, 7, 24); (2, 3, 7, 40)",
    ],
    "max_pool3d": ["(2, 3, 9, 17, 13)"],
    "avg_pool2d": ["(3, 5, 37, 53)", "(1, 1, 1, 2)"],
    "pool_rows": ["(2, 3, 3, 3001)", "(1, 2, 4, 700)"],
    "movement": ["(7, 33, 65); (7, 2, 65)", "(4, 64, 256); (4, 128, 256)", "(1, 1, 1); (1, 3, 1)"],
    "window_gather": ["(10, 56, 56, 96)", "(3, 14, 21, 3)"],
    "movement_bf16": ["(3, 16, 40); (3, 8, 40)"],
    "cat_sink": ["(4, 64, 56); (4, 32, 56)", "(3, 5, 7); (3, 2, 7)"],
    "ew_views": ["(4, 48, 2048)", "(3, 41, 2054)"],
    "logcumsumexp": ["(64, 8192)", "(3, 1001)", "(2, 5, 1)"],
    "special": ["(1000, 777)", "(7,)"],
    "pads": ["(8, 16, 56, 56)", "(2, 3, 5, 7)", "(1, 1, 2, 3)"],
    "pads_bf16": ["(4, 8, 30, 31)"],
    "join_many": ["(4, 16, 8, 64); (4, 3, 64, 8)", "(2, 5, 3, 7); (2, 3, 7, 3)"],
    "conv_fire_sink": ["(2, 16, 30, 30)", "(1, 16, 7, 9)"],
    "conv_cat_sink": ["(3, 64, 28, 28)", "(2, 64, 5, 7)"],
    "conv_t_cat_sink": ["(2, 64, 14, 14); (2, 32, 28, 28)", "(1, 64, 5, 7); (1, 16, 10, 14)"],
    "resample": ["(3, 5, 37, 53)", "(1, 1, 2, 3)"],
    "resample_bf16": ["(2, 64, 56, 56)"],
    "batch_stats": ["(16, 64, 56, 57)", "(1, 64, 1, 3)"],
    "select": ["(8192, 128)", "(9, 37)", "(3, 4096)"],
    "gevm_f32": ["(4096,); (4096, 8192)", "(1, 1027); (1027, 33)", "(37,); (3, 37, 40)"],
    "sdpa_mask": [
        "(2, 2, 70, 32); (2, 2, 90, 32); (2, 2, 90, 32); (70, 90)",
        "(3, 2, 4, 32); (3, 2, 9, 32); (3, 2, 9, 32); (4, 9)",
    ],
    "attention_chain": ["(2, 77, 64)", "(1, 200, 64)"],
    "swin_attention": [
        "(8, 3, 49, 32); (8, 3, 49, 32); (8, 3, 49, 32)",
        "(12, 2, 37, 16); (12, 2, 37, 16); (12, 2, 37, 16)",
    ],
    "short_rows": ["(2, 50, 384)", "(3, 7, 396)"],
    "relu_attention": [
        "(2, 3, 77, 64); (2, 3, 77, 64); (2, 3, 77, 24)",
        "(2, 3, 7, 64); (2, 3, 7, 64); (2, 3, 7, 24)",
    ],
    # products: the shapes of each input, ";"-separated
    # the last of each: K (and N) not 16 bytes of elements, rows copied wider for TMA by our kernel
    "matmul_lone": [
        "(300, 1024); (1024, 1000)",
        "(3, 7, 1032); (1032, 136)",
        "(1, 64); (64, 8)",
        "(129, 1001); (1001, 77)",
    ],
    "bmm_epilogue": [
        "(4, 300, 256); (4, 256, 136); (4, 300, 1)",
        "(1, 129, 1032); (1, 1032, 1000); (1, 129, 1)",
        "(33, 7, 64); (33, 64, 264); (33, 7, 1)",
    ],
    "matmul_4d_f16": ["(2, 3, 77, 128); (2, 3, 128, 200); (2, 3, 77, 200)"],
    "addmm": ["(513, 1024); (1024, 264); (264,)"],
    "matmul_misaligned": ["(300 * 1024 + 1,); (1024, 264)"],
    # fp32 (3xTF32): no size a multiple of any tile; K a multiple of 4 but not of the 32-deep k-tile
    "linear_f32_epilogue": ["(999, 1036)", "(3, 7, 1036)", "(1, 1036)"],
    # 266 x 3 tiles, 4 k tiles (the last one short), ragged at the bottom and right; one wave's worth: not persistent
    "linear_f32_persistent": ["(2, 16999, 100)", "(130, 100)"],
    "linear_f32_narrow": ["(169, 512)", "(3, 45, 512)"],  # SwinV2's position-bias MLP's second layer
    "linear_f32_tiny_k": ["(169, 3)", "(2, 1001, 3)"],
    "bmm_f32_persistent": ["(5, 4001, 68); (5, 68, 260)"],  # 5 x 32 x 3 tiles, B row-major, gathered K-major
    # 77 x 200: 2 tiles of 128 x 128, so 7 of 128 x 32 with K (129 k tiles) split 8 ways, the last short
    "linear_f32_split": ["(77, 4100); (77, 200)", "(3, 5, 4100); (3, 5, 200)"],  # the second: 15 rows, skinny
    # few rows (families/gemm_skinny.py), K = 1030 (scalar loads): two groups of 16 rows, one row, 32 rows
    "linear_f32_skinny": ["(20, 1030); (20, 200)", "(1, 1030); (1, 200)", "(2, 16, 1030); (2, 16, 200)"],
    "matmul_f32_transposed": ["(1030, 301); (1001, 1030)"],
    "matmul_f32": [
        "(300, 1028); (1028, 1000)",
        "(3, 7, 4100); (4100, 132)",
        "(1, 4); (4, 4)",
        "(301, 1030); (1030, 1001)",
        "(200, 8196); (8196, 136)",  # 4 tiles: K split 16 ways, the last split 2 k tiles of 257
        # A's two register sets by k tile (templates/gemm_tf32.py): one partial k tile, two (the second set
        # once), five (a promotion after the fourth, then the first set again)
        "(130, 20); (20, 260)",
        "(130, 36); (36, 200)",
        "(130, 132); (132, 200)",
    ],
    "bmm_f32_epilogue": [
        "(3, 257, 516); (3, 516, 388); (3, 257, 1)",
        "(3, 257, 514); (3, 514, 387); (3, 257, 1)",
    ],
    "gemv_f32": [
        "(257, 131075); (131075, 1)",
        "(4099, 1027); (1027, 1)",
        "(1, 3); (3, 1)",
        "(96, 8192); (8192, 1)",
    ],
    "gemv_bf16": ["(4099, 1027); (1027, 1)", "(1, 3); (3, 1)", "(96, 8192); (8192, 1)"],
}
BF16 = {
    "movement_bf16",
    "pads_bf16",
    "resample_bf16",
    "bf16",
    "gemv_bf16",
    "linear_epilogue",
    "linear_odd",
    "matmul_lone",
    "bmm_epilogue",
    "addmm",
    "matmul_misaligned",
}
F16 = {"rms_default_eps_f16", "linear_lone_f16", "matmul_4d_f16", "grouped_conv_f16"}
GEMMS = {n for n in FAMILIES if n.startswith("linear") or "mm" in n or "matmul" in n}
CONVS = {n for n in FAMILIES if n.startswith("conv")}  # fp32: our implicit GEMM in the tuned plan
DIRECT = {
    "dwconv_f32",
    "grouped_conv_f16",
    "grouped_convt_f32",
    "sparse_convt_f32",
    "narrow_conv3d_f32",
}  # grouped, sparse transposed or narrow: our direct kernel in the tuned plan, cuDNN in the plain
ATTENTION = {
    "sdpa_causal",
    "sdpa_mask",
    "attention_chain",
    "relu_attention",
    "swin_attention",
}  # fused when tuned
GATHERS = {"cross_entropy"}  # the model's own where on its int64 targets is PyTorch's: hybrid in every plan


def ours(c) -> bool:
    """Our own kernel computes the library region (a WGMMA GEMM or convolution, the direct convolution, the
    few-row linear layer on the CUDA cores), or the lowering left none (a one-row matmul: column dot
    products). The launcher's first line names each region's kind: library and torch ones are PyTorch's."""
    plan = plan_of(c.source)
    if uses_cute(plan) or any(rp.TAG in ("direct_conv", "skinny_gemm") for rp in plan.regions):
        return True
    head = c.launcher.splitlines()[0]
    return ": library" not in head and ": torch" not in head  # PyTorch's own op (a where on int64 targets)


def family_task(folder: Path, name: str, shape: str) -> Path:
    body, init = FAMILIES[name]
    dtype = ", dtype=torch.bfloat16" if name in BF16 else ", dtype=torch.float16" if name in F16 else ""
    shapes = shape.split("; ") if ";" in shape else [shape] * (2 if name == "bf16" else 1)
    inputs = ", ".join(f"torch.randn({s}{dtype})" for s in shapes)
    tag = "".join(c for c in shape if c.isalnum() or c == "_")
    path = folder / f"{name}_{tag}.py"
    path.write_text(
        HEADER + textwrap.dedent(body).strip() + f"\n\n\ndef get_inputs():\n    return [{inputs}]\n\n\n"
        f"def get_init_inputs():\n    return {init}\n"
    )
    return path


# Families with a kernel that only an edit makes (tile_shared_memory): pools staged where windows overlap
# vertically or at stride 2, scans, and long rows over a cluster of twice the blocks the tuned plan takes
# (where it takes fewer than 16).
EDITED = dict.fromkeys(("long_rows", "pool_rows", "avg_pool2d", "scan", "folded_scans"), "tile_shared_memory")
# more_parallelism on the fp32 GEMMs: the next narrower tile (128 x 64 where the tuned plan kept 128 x 128:
# 999 x 1001), else half or twice its split of K; on the few-row shapes (the skinny kernel) half its columns
EDITED |= dict.fromkeys(("linear_f32_epilogue", "matmul_f32"), "more_parallelism")
EDITED["bins"] = "tile_shared_memory"  # more copies of the histogram; the boundaries read from global
EDITED["intrinsics"] = "use_intrinsics"  # the harness's fp32 tolerance is what decides they may


def proposals(path: Path) -> list:
    """The first two proposals and the first edit of each: four candidates per task."""
    task = probe(path)
    policy = ExpertPolicy()
    first = policy.propose(Context(task=task, reference=task.source, parent=None), 2)
    assert first and all(p.status == ProposalStatus.OK for p in first), [p.reason for p in first]
    out = [p.candidate for p in first]
    for p in first:
        kids = policy.propose(Context(task=task, reference=task.source, parent=p.candidate), 1)
        out += [k.candidate for k in kids if k.status == ProposalStatus.OK]
    return out


def assert_ok(cands, results, hybrid: bool) -> None:
    """Every candidate compiles and verifies; hybrid unless our own kernels (a WGMMA GEMM) do all of it."""
    for c, r in zip(cands, results, strict=True):
        edit = c.edit
        assert r.build is not None and r.build.status == Status.OK, (edit, r.build and r.build.log)
        assert r.verdict.status == Status.OK, (edit, r.verdict.reasons)
        assert r.verdict.kind == (Kind.HYBRID if hybrid and not ours(c) else Kind.CUSTOM), (
            edit,
            r.verdict.library_ops,
        )


@pytest.mark.parametrize(("name", "shape"), [(name, shape) for name in FAMILIES for shape in SHAPES[name]])
def test_family_candidates_verify_on_awkward_shapes(pool, home, tmp_path, name, shape):
    path = family_task(tmp_path, name, shape)
    cands = proposals(path)
    if name in EDITED:  # a path neither first plan takes, reached by an edit on every region
        cands.append(tuned_with_edit(path, EDITED[name]))
    results = stages.evaluate_candidates(path, cands, cfg_for(home), pool=pool)
    assert_ok(cands, results, hybrid=name in GEMMS | CONVS | DIRECT | ATTENTION | GATHERS)
    if name in GEMMS | CONVS | DIRECT | ATTENTION:  # the tuned plan runs our kernel
        assert any(ours(c) for c in cands)
    if name == "graph":  # the tuned candidate's timed calls replayed its graph, and the harness says so
        graphed = [r for c, r in zip(cands, results, strict=True) if plan_of(c.source).graph]
        assert graphed and all(
            any("replayed from a CUDA graph" in n for n in r.measurement.reasons) for r in graphed
        ), [r.measurement.reasons for r in graphed]


@pytest.mark.parametrize("shape", [*SHAPES["long_rows"], "(64, 3, 300, 301)"])
def test_a_persistent_cluster_grid_verifies_on_long_rows(pool, home, tmp_path, shape):
    """persistent_grid on each long-row plan; on a cluster plan as many clusters as the GPU holds, each looping
    over rows: fewer rows than clusters on the family's shapes, 192 rows over clusters of 4 on the last."""
    path = family_task(tmp_path, "long_rows", shape)
    cand = tuned_with_edit(path, "persistent_grid")
    (r,) = stages.evaluate_candidates(path, [cand], cfg_for(home), pool=pool)
    assert_ok([cand], [r], hybrid=False)


@pytest.mark.parametrize(("lag", "hints", "ahead"), [(2, True, True), (3, False, False), (1, True, False),
                                                   (1, False, True)])  # fmt: skip
def test_grid_rows_with_cache_hints_or_a_lag_verify(pool, home, tmp_path, lag, hints, ahead):
    """The cooperative grid's 3.6 MB groups with the L2 cache hints (createpolicy, ld/st cache_hint), the
    tiles written `lag` steps after their statistics (the blocks drift that far apart before one waits), a
    step's loads issued before the last step's tile is written (`ahead`)."""
    path = family_task(tmp_path, "group_instance", "(2, 12, 600, 501)")
    base = tuned_with_edit(path, "pipeline_loads")  # the grid's first such move: its hints taken off
    assert '"grid_row":true,' in base.source.splitlines()[0], base.source.splitlines()[0]
    cand = with_knobs(path, base, "row", grid_lag=lag, l2_hints=hints, grid_prefetch=ahead)
    (r,) = stages.evaluate_candidates(path, [cand], cfg_for(home), pool=pool)
    assert_ok([cand], [r], hybrid=False)
    assert any("_grid_" in k for k in r.measurement.kernels), r.measurement.kernels


@pytest.mark.parametrize(("rows", "outs"), [(2, 4), (4, 4), (8, 2)])
def test_a_column_of_output_rows_a_thread_verifies_on_a_depthwise_convolution(
    pool, home, tmp_path, rows, outs
):
    """The direct convolution with `rows` output rows a thread (each input row read once for them): stride 2
    under a 3-row window, a channel multiplier of 2, 19 output rows (the last column partial)."""
    path = family_task(tmp_path, "dwconv_f32", "(3, 12, 37, 53)")
    probe_task = probe(path)
    base = ExpertPolicy().propose(Context(task=probe_task, reference=probe_task.source, parent=None), 2)[1]
    cand = with_knobs(path, base.candidate, "direct_conv", rows=rows, outs=outs)
    assert f"in each of {rows} output rows" in cand.launcher
    (r,) = stages.evaluate_candidates(path, [cand], cfg_for(home), pool=pool)
    assert_ok([cand], [r], hybrid=True)


@pytest.mark.parametrize(("name", "shape", "persistent"), [
    ("linear_f32_persistent", "(2, 16999, 100)", True), ("linear_f32_persistent", "(2, 16999, 100)", False),
    ("matmul_f32", "(300, 1028); (1028, 1000)", False),
])  # fmt: skip
def test_3xtf32_staged_stores_verify(pool, home, tmp_path, name, shape, persistent):
    """The 3xTF32 GEMM's stores through shared memory (whole 16-byte row pieces), on ragged tiles: the last
    rows and columns of each block past the output neither computed nor stored."""
    from pipeline.generate.expert.templates import gemm, gemm_tf32

    path = family_task(tmp_path, name, shape)
    t = probe(path)
    base = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
    (g,) = [rp for rp in plan_of(base.source).regions if rp.TAG == "wgmma_3xtf32"]
    depth = min(g.stages, gemm_tf32.max_stages(g.bn, gemm.staging_bytes("float32")))
    # K whole (a split's partials are stored directly), the ring shallow enough for the staging
    cand = with_knobs(path, base, "wgmma_3xtf32", staged=True, persistent=persistent, stages=depth, splits=1)
    assert "s.c + (wg - 1) * 64 * CP" in cand.source
    (r,) = stages.evaluate_candidates(path, [cand], cfg_for(home), pool=pool)
    assert_ok([cand], [r], hybrid=True)
    assert r.measurement is not None and r.measurement.timing is not None


@pytest.mark.parametrize(("name", "shape"), [
    ("linear_f32_epilogue", "(999, 1036)"), ("linear_f32_epilogue", "(3, 70, 1036)"),
    ("matmul_f32", "(301, 1030); (1030, 1001)"),  # B row-major: split and transposed; K padded to 1032
    ("matmul_f32", "(200, 8196); (8196, 136)"),  # a long K: the promotions hold its error to eager's
    ("bmm_f32_epilogue", "(3, 257, 516); (3, 516, 388); (3, 257, 1)"),
    ("matmul_f32_transposed", "(1030, 301); (1001, 1030)"),  # both split in place by the other kernel
])  # fmt: skip
def test_fp16x3_gemm_verifies(pool, home, tmp_path, name, shape):
    """Our fp32 GEMM as three fp16 products (templates/gemm_f16x3.py) passes the harness's fp32 rule on
    ragged tiles, both operand forms, batches and a fused epilogue."""
    from pipeline.generate.expert.templates import gemm_f16x3

    path = family_task(tmp_path, name, shape)
    t = probe(path)
    base = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
    (g,) = [rp for rp in plan_of(base.source).regions if rp.TAG == "wgmma_3xtf32"]
    # the tuned plan's own form where K is whole and long (families/gemm_tf32.py, F16_MIN_K)
    cand = base if g.f16 else with_knobs(path, base, "wgmma_3xtf32", f16=True, persistent=False, splits=1,
                                         staged=False, stages=gemm_f16x3.max_stages(g.bn))  # fmt: skip
    assert "fp16x3 WGMMA kernel" in cand.launcher
    (r,) = stages.evaluate_candidates(path, [cand], cfg_for(home), pool=pool)
    assert_ok([cand], [r], hybrid=True)
    assert r.measurement is not None and r.measurement.timing is not None


def test_fp16x3_split_k_verifies(pool, home, tmp_path):
    """The fp16x3 form with the tuned plan's split of K kept (77 x 200 over 4100, 8 ways): each block's
    unscaled partial into the workspace, the bias, residual and ReLU in the sum kernel."""
    from pipeline.generate.expert.templates import gemm_f16x3

    path = family_task(tmp_path, "linear_f32_split", "(77, 4100); (77, 200)")
    t = probe(path)
    base = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
    (g,) = [rp for rp in plan_of(base.source).regions if rp.TAG == "wgmma_3xtf32"]
    assert g.splits > 1
    cand = with_knobs(path, base, "wgmma_3xtf32", f16=True, stages=gemm_f16x3.max_stages(g.bn))
    assert "fp16x3 WGMMA kernel" in cand.launcher and "K split" in cand.launcher
    (r,) = stages.evaluate_candidates(path, [cand], cfg_for(home), pool=pool)
    assert_ok([cand], [r], hybrid=True)


@pytest.mark.parametrize(("name", "shape"), [
    ("linear_f32_persistent", "(2, 16999, 100)"),  # K = 100 over 266 tiles: a block walks two or three
    ("matmul_f32", "(2051, 72); (72, 4099)"),  # level 1's short K, ragged both ways, B row-major
])  # fmt: skip
def test_fp16x3_persistent_grid_verifies(pool, home, tmp_path, name, shape):
    """The fp16x3 form walked persistently (persistent_grid): the rings across a block's tiles, the stores
    from the promoted sums, the ragged tiles' rows and columns past the output neither computed nor stored."""
    from pipeline.generate.expert.templates import gemm_f16x3

    path = family_task(tmp_path, name, shape)
    t = probe(path)
    base = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
    (g,) = [rp for rp in plan_of(base.source).regions if rp.TAG == "wgmma_3xtf32"]
    cand = with_knobs(path, base, "wgmma_3xtf32", f16=True, persistent=True, splits=1, staged=False,
                      stages=gemm_f16x3.max_stages(g.bn))  # fmt: skip
    assert "fp16x3 WGMMA kernel" in cand.launcher and "stages, persistent)" in cand.launcher
    (r,) = stages.evaluate_candidates(path, [cand], cfg_for(home), pool=pool)
    assert_ok([cand], [r], hybrid=True)


@pytest.mark.parametrize(("name", "shape"), [
    ("conv2d_f32", "(3, 13, 37, 53)"),  # channel-inner, 13 channels padded to 16 a tap
    ("convt2d_f32", "(3, 32, 17, 13)"),  # strided transposed: by phases
    ("conv_tapwise_f32", "(3, 8, 21, 19)"),  # 81 taps: the tap-wise gather
])  # fmt: skip
def test_fp16x3_conv_verifies_on_images_of_other_scales(pool, home, tmp_path, name, shape):
    """The fp16x3 convolution (templates/conv_f16x3.py) on a batch whose images are scaled by 1e-6, 1 and
    1e6 (each image its own power of two, each weight row its own), and the 3xTF32 form beside it: both
    pass the harness's fp32 rule."""
    from pipeline.generate.expert.templates import conv_f16x3
    from pipeline.generate.expert.templates import conv_tf32 as template

    path = family_task(tmp_path, name, shape)
    ones = ", ".join(["1"] * shape.count(","))  # the dims after the batch
    path.write_text(path.read_text().replace(
        f"torch.randn({shape})", f"torch.randn({shape}) * torch.tensor([1e-6, 1.0, 1e6]).view(3, {ones})"))  # fmt: skip
    base = tuned(path)
    (c,) = [rp for rp in plan_of(base.source).regions if rp.TAG == "wgmma_conv_3xtf32"]
    f16, tf32 = (
        base if c.f16 == want else with_knobs(path, base, c.TAG, f16=want, stages=ring.max_stages(c.bn))
        for want, ring in ((True, conv_f16x3), (False, template))
    )
    assert "fp16x3 WGMMA kernel" in f16.launcher and "fp16x3" not in tf32.launcher
    results = stages.evaluate_candidates(path, [f16, tf32], cfg_for(home), pool=pool)
    assert_ok([f16, tf32], results, hybrid=True)


@pytest.mark.parametrize("task_id", BUILTIN)
def test_builtin_task_first_proposals_and_an_edit_verify(pool, home, task_id):
    path = ROOT / "tasks" / f"{task_id}.py"
    cands = proposals(path)
    results = stages.evaluate_candidates(path, cands, cfg_for(home), pool=pool)
    assert_ok(cands, results, hybrid=task_id in HYBRID)
    for r in results:
        assert r.measurement is not None and r.measurement.timing is not None


# The two correction passes of the 3xTF32 kernel: without them it is one tf32 product.
_LO_PASSES = (
    "for (int kb = 0; kb < size<2>(ah); ++kb) cute::gemm(mma, al(_, _, kb), tB(_, _, kb, st), acc);",
    "for (int kb = 0; kb < size<2>(ah); ++kb) cute::gemm(mma, ah(_, _, kb), tBl(_, _, kb, sl), acc);",
)


def test_one_tf32_pass_is_rejected_where_the_3xtf32_split_passes(pool, home, tmp_path):
    """The split is what makes our fp32 GEMM pass the harness's fp32 rule: the same kernel with a single
    tf32 product is a mismatch on the same inputs."""
    path = family_task(tmp_path, "matmul_f32", "(512, 4096); (4096, 512)")
    t = probe(path)
    (ours,) = [
        p.candidate
        for p in ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 1)
        if uses_cute(plan_of(p.candidate.source))
    ]
    assert all(line in ours.source for line in _LO_PASSES)
    one_pass = ours.source
    for line in _LO_PASSES:
        one_pass = one_pass.replace(line, "")
    single = make_candidate(t.id, one_pass, ours.launcher, flags=ours.flags, edit="one tf32 pass")
    results = stages.evaluate_candidates(path, [ours, single], cfg_for(home), pool=pool)
    assert results[0].verdict.status == Status.OK, results[0].verdict.reasons
    assert results[1].build is not None and results[1].build.status == Status.OK
    assert results[1].verdict.status == Status.MISMATCH, results[1].verdict.reasons


# MoE experts as a loop over groups of rows (grouped.py captures it as one grouped GEMM): odd group sizes, idle
# experts and one-token groups, rows not a multiple of the 128-row tile, K and N not multiples of the tiles.
MOE_LOOP = """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn({w}, dtype=torch.bfloat16) * 264**-0.5)
    def forward(self, x, counts):
        out = x.new_empty(x.shape[0], {cols})
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            h = x[start : start + n] @ self.w[e]{t}
            {write}
            start += n
        return out


def get_inputs():
    counts = torch.tensor({counts})
    return [torch.randn(int(counts.sum()), 264, dtype=torch.bfloat16), counts]


def get_init_inputs():
    return []
"""
MOE_CASES = {
    "swiglu_rows": dict(w="8, 264, 272", cols=136, t="", counts=[1, 0, 200, 129, 0, 77, 0, 1],
                        write="gate, up = h.chunk(2, dim=-1)\n            out[start : start + n] = F.silu(gate) * up"),
    "k_major_relu": dict(w="8, 200, 264", cols=200, t=".t()", counts=[0, 0, 300, 1, 0, 0, 0, 5],
                         write="out[start : start + n] = torch.relu(h) * 2"),
    "k_major_swiglu": dict(w="8, 272, 264", cols=136, t=".t()", counts=[129, 3, 0, 0, 256, 0, 1, 40],
                           write="gate, up = h.chunk(2, dim=-1)\n            out[start : start + n] = F.silu(gate) * up"),
}  # fmt: skip
# The same loop given int32 bounds with a leading zero: the kernel reads them as they are
MOE_BOUNDS = (
    MOE_LOOP.replace("for e, n in enumerate(counts.tolist()):", "b = counts.tolist()\n        for e in range(8):")
    .replace("            if n == 0:\n", "            start, n = b[e], b[e + 1] - b[e]\n            if n == 0:\n")
    .replace("            start += n\n", "")
    .replace("    return [torch.randn(int(counts.sum()), 264, dtype=torch.bfloat16), counts]",
             "    b = torch.cat((torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)))\n"
             "    return [torch.randn(int(counts.sum()), 264, dtype=torch.bfloat16), b]")
)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "bounds"), [(name, False) for name in sorted(MOE_CASES)] + [("swiglu_rows", True)]
)
def test_grouped_gemm_verifies_on_odd_groups(pool, home, tmp_path, name, bounds):
    """Tokens per expert, or int32 bounds: our kernel reads either as given, so the candidate running it is
    our kernels alone (no cumsum, no copy by torch)."""
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent((MOE_BOUNDS if bounds else MOE_LOOP).format(**MOE_CASES[name])))
    cands = proposals(path)
    results = stages.evaluate_candidates(path, cands, cfg_for(home), pool=pool)
    assert_ok(cands, results, hybrid=True)
    assert any(ours(c) for c in cands)


# (edit, what its plan line holds): multicast_loads, a cluster of two blocks per pair of row tiles, each loading
# half of the weight tile into both (groups of 1, 77, 129, 200 and 300 rows give pairs whose second tile has
# no row: its block still loads and releases its half); coalesce_accesses, stores from the accumulators instead
# of the default, staged in shared memory (odd_groups above: N = 200 and 136 end within a 64-column block)
GROUPED_EDITS = {"multicast_loads": '"cluster":2', "coalesce_accesses": '"staged":false'}


@pytest.mark.parametrize("edit", sorted(GROUPED_EDITS))
@pytest.mark.parametrize("name", sorted(MOE_CASES))
def test_grouped_gemm_edits_verify_on_odd_groups(pool, home, tmp_path, name, edit):
    """The edit on 128- and 256-wide tiles, MN- and K-major, with and without SwiGLU (the gate and up halves
    then one block's each, multicast)."""
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent(MOE_LOOP.format(**MOE_CASES[name])))
    task = probe(path)
    policy = ExpertPolicy()
    tuned = policy.propose(Context(task=task, reference=task.source, parent=None), 2)[1].candidate
    kids = policy.propose(Context(task=task, reference=task.source, parent=tuned), 30)
    cands = [k.candidate for k in kids if k.candidate and edit in k.edit]
    narrow = [k.candidate for k in kids if k.candidate and "bn=128" in k.edit]
    assert cands and narrow, [k.edit for k in kids]
    cands += [k.candidate for k in policy.propose(Context(task=task, reference=task.source, parent=narrow[0]), 30)
              if k.candidate and edit in k.edit]  # fmt: skip
    assert len(cands) == 2 and all(GROUPED_EDITS[edit] in c.source.splitlines()[0] for c in cands), name
    results = stages.evaluate_candidates(path, cands, cfg_for(home), pool=pool)
    assert_ok(cands, results, hybrid=True)


# Ping-pong consumers (overlap_epilogue): enough tiles that every block's two warpgroups take turns several
# times (about 4 tiles a block on 132 SMs), skewed groups with idle experts and groups of 1 row; K = 72 (2
# k-tiles, fewer than the ring's stages: a warpgroup's next tile starts a lap of the ring ahead) and K = 264;
# SwiGLU (a value's gate and up in one warpgroup's half: 64 outputs a 128-wide tile)
PINGPONG_CASES = {
    "rows_k72": dict(w="16, 72, 256", cols=256, t="", k=72, write="out[start : start + n] = h",
                     counts=[0, 9000, 1, 0, 12000, 129, 3000, 0, 7000, 64, 0, 5000, 2000, 1, 0, 1805]),
    "k_major_relu": dict(w="8, 200, 264", cols=200, t=".t()", k=264, write="out[start : start + n] = torch.relu(h) * 2",
                         counts=[0, 20000, 300, 1, 0, 9000, 77, 5]),
    "swiglu_rows": dict(w="8, 264, 272", cols=136, t="", k=264, counts=[1, 0, 30000, 129, 0, 7700, 0, 1],
                        write="gate, up = h.chunk(2, dim=-1)\n            out[start : start + n] = F.silu(gate) * up"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PINGPONG_CASES))
def test_grouped_gemm_with_ping_pong_consumers_verifies(pool, home, tmp_path, name):
    case = PINGPONG_CASES[name]
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent(MOE_LOOP.replace("264", "{k}").format(**case)))
    task = probe(path)
    policy = ExpertPolicy()
    tuned = policy.propose(Context(task=task, reference=task.source, parent=None), 2)[1].candidate
    kids = policy.propose(Context(task=task, reference=task.source, parent=tuned), 30)
    (pp,) = [k.candidate for k in kids if k.candidate and "overlap_epilogue" in k.edit]
    deeper = [k.candidate for k in policy.propose(Context(task=task, reference=task.source, parent=pp), 30)
              if k.candidate and "pipeline_loads" in k.edit]  # fmt: skip
    cands = [pp, *deeper]
    assert len(cands) == 2 and all('"pingpong":true' in c.source.splitlines()[0] for c in cands), name
    results = stages.evaluate_candidates(path, cands, cfg_for(home), pool=pool)
    assert_ok(cands, results, hybrid=True)


def test_a_whole_moe_block_verifies_with_its_routing_computed(pool, home):
    """Router, top-2, sort and bincount in the candidate (left to PyTorch), fc1 + SwiGLU and fc2 as two grouped
    GEMMs on the routing it computes: groups of 0 to ~180 rows, some of one row. Verified against the loop."""
    path = ROOT / "tests" / "fixtures" / "moe" / "small_block.py"
    cands = proposals(path)
    results = stages.evaluate_candidates(path, cands, cfg_for(home), pool=pool)
    for c, r in zip(cands, results, strict=True):
        assert r.build is not None and r.build.status == Status.OK, (c.edit, r.build and r.build.log)
        assert r.verdict.status == Status.OK, (c.edit, r.verdict.reasons)
        assert r.verdict.kind == Kind.HYBRID, (c.edit, r.verdict.library_ops)  # top-k and sort stay torch's
    assert sum('"family":"wgmma_grouped"' in c.source.splitlines()[0] for c in cands) >= 2


@pytest.mark.parametrize("task_id", ["softmax", "elementwise_chain"])
def test_the_power_edit_verifies_as_our_kernels(pool, home, task_id):
    """lower_power (objective energy): the same kernels on a persistent grid over 75% and 50% of the SMs."""
    path = ROOT / "tasks" / f"{task_id}.py"
    t = probe(path)
    policy = ExpertPolicy()
    (parent,) = policy.propose(Context(task=t, reference=t.source, parent=None), 1)
    ctx = Context(task=t, reference=t.source, parent=parent.candidate, extra={"objective": "energy"})
    kids = [k for k in policy.propose(ctx, 2) if k.status == ProposalStatus.OK]
    assert [k.edit.split("(")[0] for k in kids] == ["lower_power", "lower_power"], [k.edit for k in kids]
    cands = [k.candidate for k in kids]
    results = stages.evaluate_candidates(path, cands, cfg_for(home), pool=pool)
    assert_ok(cands, results, hybrid=False)


def verify_ours(pool, home, path: Path, text: str) -> None:
    """A whole task file (model and inputs, dedented) written at `path`: its first proposals and their edits
    verify, all our own kernels."""
    path.write_text(HEADER + textwrap.dedent(text).lstrip())
    cands = proposals(path)
    results = stages.evaluate_candidates(path, cands, cfg_for(home), pool=pool)
    assert_ok(cands, results, hybrid=False)


def test_rows_picked_by_an_index_tensor_verify_as_our_copies(pool, home, tmp_path):
    """embedding, x[:, i], index_select and gather (families/movement.py): the index an int64 input, bf16."""
    body = """
            class Model(nn.Module):
                def forward(self, i, w):
                    return (F.embedding(i, w), w[:, i[0]], torch.index_select(w, 0, i.flatten()[:5]) * 2,
                            torch.gather(w, 1, i[:, :3]), torch.gather(w.t(), 0, i))


            def get_inputs():
                return [torch.randint(0, 64, (37, 5)), torch.randn(1000, 128, dtype=torch.bfloat16)]


            def get_init_inputs():
                return []
            """
    verify_ours(pool, home, tmp_path / "takes.py", body)


def test_scatters_verify_as_our_kernels(pool, home, tmp_path):
    """scatter_add, scatter_reduce(sum), index_add, index_put (accumulating over repeated rows, and storing
    at distinct ones) as our atomics (families/scatter.py); the indices int64 inputs."""
    body = """
            class Model(nn.Module):
                def forward(self, x, idx, src, rows, v, once):
                    y = x.clone()
                    y[once] = v[: once.shape[0]] * 2
                    return (x.scatter_add(1, idx, src), torch.scatter_reduce(x, 1, idx, src, reduce="sum"),
                            x.index_add(0, rows, v, alpha=0.5), x.index_put((rows,), v, accumulate=True), y)


            def get_inputs():
                return [torch.randn(1001, 333), torch.randint(0, 333, (1001, 777)), torch.randn(1001, 777),
                        torch.randint(0, 1001, (4099,)), torch.randn(4099, 333), torch.randperm(1001)[:517]]


            def get_init_inputs():
                return []
            """
    verify_ours(pool, home, tmp_path / "scatters.py", body)


def test_weighted_and_spatial_losses_verify_as_our_kernels(pool, home, tmp_path):
    """Cross-entropy and NLL with class weights (rows, a warp each) and over (N, C, H, W) scores (a thread a
    position, families/xent.py), ignored targets among them."""
    body = """
            class Model(nn.Module):
                def __init__(self, classes):
                    super().__init__()
                    self.register_buffer("w", torch.rand(classes) + 0.25)
                def forward(self, x, t, s, u):
                    return (F.cross_entropy(x, t, weight=self.w), F.nll_loss(F.log_softmax(x, 1), t, weight=self.w,
                            reduction="none"), F.cross_entropy(s, u), F.cross_entropy(s, u, weight=self.w,
                            reduction="sum"), F.cross_entropy(s, u, label_smoothing=0.1, reduction="none"))


            def get_inputs():
                return [torch.randn(4097, 1001), torch.where(torch.rand(4097) < 0.1, -100, torch.randint(0, 1001, (4097,))),
                        torch.randn(5, 1001, 33, 17), torch.randint(0, 1001, (5, 33, 17))]


            def get_init_inputs():
                return [1001]
            """
    verify_ours(pool, home, tmp_path / "weighted_losses.py", body)


def test_repeated_blocks_share_their_wgmma_kernels_and_verify(pool, home, tmp_path):
    """Blocks of one form render one kernel text (generate/expert/shared_kernels.py): three identical fp32
    convolutions over 64 channels (K = 576: the fp16x3 form, each with its own weights and scales) and
    three identical linears (3xTF32), each block's launcher calling the first block's kernels. The first
    proposals (plain: cuDNN and cuBLAS; tuned: ours) verify."""
    body = """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.convs = nn.ModuleList([nn.Conv2d(64, 64, 3, padding=1) for _ in range(3)])
                self.fcs = nn.ModuleList([nn.Linear(200, 200) for _ in range(3)])

            def forward(self, x, y):
                for c in self.convs:
                    x = torch.relu(c(x)) + x
                for f in self.fcs:
                    y = torch.tanh(f(y))
                return x, y


        def get_inputs():
            return [torch.randn(3, 64, 19, 23), torch.randn(333, 200)]


        def get_init_inputs():
            return []
        """
    path = tmp_path / "blocks.py"
    path.write_text(HEADER + textwrap.dedent(body).lstrip())
    cands = proposals(path)
    tuned_c = next(c for c in cands if ours(c))
    assert "fp16x3 WGMMA kernel" in tuned_c.launcher
    defined = tuned_c.source.count('extern "C" __global__')
    for kernel in ("kp_conv2d_conv_conv", "kp_linear_mm_gemm"):  # the first block's, called by all three
        assert tuned_c.launcher.count(f"kernels.{kernel}(") == 3, kernel
    assert defined < 12, defined
    results = stages.evaluate_candidates(path, cands, cfg_for(home), pool=pool)
    assert_ok(cands, results, hybrid=True)
