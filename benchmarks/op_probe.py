"""Operator coverage beyond the suites: one small task per PyTorch operator (the ones KernelBench-style tasks
and the models around them use, and less common ones), each put through the expert's `supports()`, and
the verdict counted as ours (every op in our kernels), hybrid (some op left to PyTorch or the library) or
refused (nothing for our kernels, or a task the expert cannot read). CPU only.

    python benchmarks/op_probe.py [--out verdicts.json] [--only NAME,...]

Each task is written with the same template: `forward(self, <params>)` returns the expression.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import textwrap
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

A, B = "torch.randn(64, 128)", "torch.randn(64, 128)"
IMG = "torch.randn(2, 4, 16, 16)"
# name -> (forward's parameters, its expression, get_inputs' list)
OPS: dict[str, tuple[str, str, str]] = {
    # data movement, indexing, selection
    "gather": ("x, i", "torch.gather(x, 1, i)", f"[{A}, torch.randint(0, 128, (64, 32))]"),
    "scatter_add": ("x, i", "torch.zeros_like(x).scatter_add(1, i, x[:, :32])", f"[{A}, torch.randint(0, 128, (64, 32))]"),
    "index_select": ("x, i", "torch.index_select(x, 0, i) * 2", f"[{A}, torch.randint(0, 64, (9,))]"),
    "embedding": ("w, i", "F.embedding(i, w)", "[torch.randn(100, 32), torch.randint(0, 100, (64,))]"),
    "one_hot": ("i", "F.one_hot(i, 16).float() * 2", "[torch.randint(0, 16, (64,))]"),
    "topk": ("x", "torch.topk(x, 8, dim=1).values", f"[{A}]"),
    "sort": ("x", "torch.sort(x, dim=1).values", f"[{A}]"),
    "argsort": ("x", "torch.argsort(x, dim=1)", f"[{A}]"),
    "median": ("x", "torch.median(x, dim=1).values", f"[{A}]"),
    "cummax": ("x", "torch.cummax(x, dim=1).values", f"[{A}]"),
    "logcumsumexp": ("x", "torch.logcumsumexp(x, dim=1)", f"[{A}]"),
    "cumsum": ("x", "torch.cumsum(x, dim=1)", f"[{A}]"),
    "diff": ("x", "torch.diff(x, dim=1)", f"[{A}]"),
    "flip_roll": ("x", "torch.flip(torch.roll(x, 3, 1), (0,))", f"[{A}]"),
    "cat_stack": ("x, y", "torch.stack([torch.cat([x, y], 1), torch.cat([y, x], 1)])", f"[{A}, {B}]"),
    "split_cat": ("x", "torch.cat(torch.split(x, [32, 96], dim=1)[::-1], dim=1)", f"[{A}]"),
    "repeat": ("x", "x.repeat(2, 3)", f"[{A}]"),
    "unfold": ("x", "x.unfold(1, 4, 2) * 2", f"[{A}]"),
    "pad_constant": ("x", "F.pad(x, (1, 2, 3, 4), value=0.5)", f"[{IMG}]"),
    "pad_reflect": ("x", "F.pad(x, (2, 2, 2, 2), mode='reflect')", f"[{IMG}]"),
    "pad_replicate": ("x", "F.pad(x, (2, 2), mode='replicate')", "[torch.randn(2, 4, 16)]"),
    "pad_circular": ("x", "F.pad(x, (2, 2, 1, 1), mode='circular')", f"[{IMG}]"),
    "rot90": ("x", "torch.rot90(x, 1, (1, 2)) * 2", "[torch.randn(4, 16, 24)]"),
    "pixel_shuffle": ("x", "F.pixel_shuffle(x, 2)", "[torch.randn(2, 16, 8, 8)]"),
    "channel_shuffle": ("x", "F.channel_shuffle(x, 4)", "[torch.randn(2, 16, 8, 8)]"),
    "movedim_contig": ("x", "torch.movedim(x, 0, 2).contiguous()", "[torch.randn(8, 64, 128)]"),
    "mT_contig": ("x", "x.mT.contiguous()", "[torch.randn(8, 64, 128)]"),
    "diagonal_trace": ("x", "torch.trace(x) + torch.diagonal(x, 1).sum()", "[torch.randn(64, 64)]"),
    "tril": ("x", "torch.tril(x)", "[torch.randn(128, 128)]"),
    "bool_index": ("x", "x[x > 0]", f"[{A}]"),
    "arange_add": ("x", "x + torch.arange(128, dtype=x.dtype, device=x.device)", f"[{A}]"),
    # element-wise
    "activations": ("x", "F.mish(x) + F.celu(x, 0.5) + F.logsigmoid(x) + F.hardshrink(x) + F.softshrink(x)", f"[{A}]"),
    "rrelu_eval": ("x", "F.rrelu(x, training=False)", f"[{A}]"),
    "exp_logs": ("x", "torch.exp2(x) + torch.expm1(x) + torch.log1p(x.abs()) + torch.log10(x.abs() + 1)", f"[{A}]"),
    "erf_erfc": ("x", "torch.erf(x) + torch.erfc(x)", f"[{A}]"),
    "erfinv": ("x", "torch.erfinv(torch.tanh(x))", f"[{A}]"),
    "xlogy": ("x", "torch.special.xlogy(x.abs(), x.abs() + 1)", f"[{A}]"),
    "atan2_hypot": ("x, y", "torch.atan2(x, y) + torch.hypot(x, y)", f"[{A}, {B}]"),
    "fmod_remainder": ("x", "torch.fmod(x, 0.7) + torch.remainder(x, 0.3)", f"[{A}]"),
    "round_trunc": ("x", "torch.round(x * 3) + torch.trunc(x) + torch.frac(x)", f"[{A}]"),
    "heaviside": ("x, y", "torch.heaviside(x, y)", f"[{A}, {B}]"),
    "lerp_addcmul": ("x, y", "torch.lerp(x, y, 0.3) + torch.addcmul(x, x, y, value=0.5)", f"[{A}, {B}]"),
    "where_masks": ("x, y", "torch.where((x > 0) & ~(y > 0.5) | (x < -1), x, y)", f"[{A}, {B}]"),
    "clamp_tensors": ("x, y", "torch.clamp(x, y, y + 1)", f"[{A}, {B}]"),
    "nan_to_num": ("x", "torch.nan_to_num(torch.log(x))", f"[{A}]"),
    "float64_step": ("x", "torch.float_power(x.abs(), 2).float()", f"[{A}]"),
    "int_arith": ("i", "(i * 3 + 1) % 7", "[torch.randint(0, 100, (64, 128))]"),
    "prelu": ("x, w", "F.prelu(x, w)", "[torch.randn(8, 4, 32), torch.full((4,), 0.2)]"),
    # reductions and norms
    "std_var": ("x", "torch.std(x, dim=1) + torch.var(x, dim=1, correction=0)", f"[{A}]"),
    "any_all": ("x", "(x > 0).any(dim=1).float() + (x > -3).all(dim=1).float()", f"[{A}]"),
    "count_nonzero": ("x", "(x > 0).sum(dim=1)", f"[{A}]"),
    "nanmean": ("x", "torch.nanmean(x, dim=1)", f"[{A}]"),
    "norm_p3": ("x", "torch.norm(x, p=3, dim=1)", f"[{A}]"),
    "logsumexp": ("x", "torch.logsumexp(x, dim=1)", f"[{A}]"),
    "softmin": ("x", "F.softmin(x, dim=1)", f"[{A}]"),
    "normalize": ("x", "F.normalize(x, dim=1)", f"[{A}]"),
    "pairwise": ("x, y", "F.pairwise_distance(x, y)", f"[{A}, {B}]"),
    "cosine_sim": ("x, y", "F.cosine_similarity(x, y, dim=1)", f"[{A}, {B}]"),
    "cdist": ("x, y", "torch.cdist(x, y)", "[torch.randn(64, 16), torch.randn(32, 16)]"),
    "batch_norm_stats": ("x", "F.batch_norm(x, None, None, training=True)", f"[{IMG}]"),
    "group_instance_norm": ("x", "F.group_norm(x, 2) + F.instance_norm(x)", f"[{IMG}]"),
    "local_response": ("x", "F.local_response_norm(x, 3)", f"[{IMG}]"),
    # pooling, resampling, convolutions
    "adaptive_avg_uneven": ("x", "F.adaptive_avg_pool2d(x, (3, 5))", f"[{IMG}]"),
    "adaptive_max": ("x", "F.adaptive_max_pool2d(x, (3, 3))", f"[{IMG}]"),
    "max_pool_indices": ("x", "F.max_pool2d(x, 2, return_indices=True)[1].float()", f"[{IMG}]"),
    "lp_pool": ("x", "F.lp_pool2d(x, 2, 2)", f"[{IMG}]"),
    "interp_nearest": ("x", "F.interpolate(x, scale_factor=2)", f"[{IMG}]"),
    "interp_bilinear": ("x", "F.interpolate(x, scale_factor=1.5, mode='bilinear')", f"[{IMG}]"),
    "interp_bicubic": ("x", "F.interpolate(x, scale_factor=2, mode='bicubic')", f"[{IMG}]"),
    "interp_antialias": ("x", "F.interpolate(x, scale_factor=0.5, mode='bilinear', antialias=True)", f"[{IMG}]"),
    "fold": ("x", "F.fold(x, (8, 8), 2, stride=2)", "[torch.randn(2, 16, 16)]"),
    "unfold_im2col": ("x", "F.unfold(x, 2, stride=2)", f"[{IMG}]"),
    "conv_same": ("x, w", "F.conv2d(x, w, padding='same')", f"[{IMG}, torch.randn(8, 4, 3, 3)]"),
    "conv1d_transposed": ("x, w", "F.conv_transpose1d(x, w, stride=2)", "[torch.randn(2, 4, 64), torch.randn(4, 8, 3)]"),
    # products
    "matmul_broadcast": ("x, w", "torch.matmul(x, w)", "[torch.randn(64, 32), torch.randn(5, 32, 48)]"),
    "vector_matrix": ("v, m", "torch.matmul(v, m)", "[torch.randn(128), torch.randn(128, 64)]"),
    "outer_k1": ("a, b", "torch.matmul(a, b)", "[torch.randn(7, 3, 128, 1), torch.randn(3, 1, 8)]"),
    "einsum_bmm": ("x, y", "torch.einsum('bij,bjk->bik', x, y)", "[torch.randn(4, 64, 32), torch.randn(4, 32, 16)]"),
    "addr": ("z, x, y", "torch.addr(z, x, y)", "[torch.randn(64, 32), torch.randn(64), torch.randn(32)]"),
    "tensordot": ("x, y", "torch.tensordot(x, y, dims=([1, 2], [0, 1]))", "[torch.randn(8, 16, 32), torch.randn(16, 32, 24)]"),
    "kron": ("x, y", "torch.kron(x, y)", "[torch.randn(8, 8), torch.randn(4, 4)]"),
    "cross": ("x, y", "torch.linalg.cross(x, y, dim=1)", "[torch.randn(64, 3), torch.randn(64, 3)]"),
    # losses
    "cross_entropy": ("x, t", "F.cross_entropy(x, t)", "[torch.randn(64, 10), torch.randint(0, 10, (64,))]"),
    "nll_loss": ("x, t", "F.nll_loss(F.log_softmax(x, 1), t)", "[torch.randn(64, 10), torch.randint(0, 10, (64,))]"),
    "bce": ("x, y", "F.binary_cross_entropy(torch.sigmoid(x), y)", f"[{A}, torch.rand(64, 128)]"),
    "kl_div": ("x, y", "F.kl_div(F.log_softmax(x, 1), F.softmax(y, 1), reduction='batchmean')", f"[{A}, {B}]"),
    "hinge_embedding": ("x, y", "F.hinge_embedding_loss(x, y)", f"[{A}, torch.randint(0, 2, (64, 128)).float() * 2 - 1]"),
    "cosine_embedding": ("x, y, t", "F.cosine_embedding_loss(x, y, t)", f"[{A}, {B}, torch.randint(0, 2, (64,)) * 2 - 1]"),
    "margin_ranking": ("x, y, t", "F.margin_ranking_loss(x, y, t)", "[torch.randn(64), torch.randn(64), torch.randint(0, 2, (64,)).float() * 2 - 1]"),
    "smooth_l1_huber": ("x, y", "F.smooth_l1_loss(x, y) + F.huber_loss(x, y)", f"[{A}, {B}]"),
    "gaussian_nll": ("x, y, v", "F.gaussian_nll_loss(x, y, v.abs() + 0.1)", f"[{A}, {B}, {A}]"),
    # layers
    "lstm_cell": ("x, h, c", "torch.stack(self.lstm(x, (h, c)))", "[torch.randn(32, 64), torch.randn(32, 128), torch.randn(32, 128)]"),
    "gru_cell": ("x, h", "self.gru(x, h)", "[torch.randn(32, 64), torch.randn(32, 128)]"),
    "bilinear": ("x, y", "self.bilinear(x, y)", "[torch.randn(64, 32), torch.randn(64, 24)]"),
    "multihead_attention": ("x", "self.mha(x, x, x)[0]", "[torch.randn(16, 2, 64)]"),
    "sdpa_mask": ("q, m", "F.scaled_dot_product_attention(q, q, q, attn_mask=m)", "[torch.randn(2, 4, 64, 32), torch.randn(64, 64)]"),
}  # fmt: skip
LAYERS = """        self.lstm = nn.LSTMCell(64, 128)
        self.gru = nn.GRUCell(64, 128)
        self.bilinear = nn.Bilinear(32, 24, 16)
        self.mha = nn.MultiheadAttention(64, 4)"""


def write(folder: Path, name: str) -> Path:
    params, expr, inputs = OPS[name]
    path = folder / f"{name}.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n"
        f"class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n{LAYERS}\n\n"
        f"    def forward(self, {params}):\n        return {expr}\n\n\n"
        f"def get_inputs():\n    return {inputs}\n\n\ndef get_init_inputs():\n    return []\n"
    )
    return path


def verdict(ok: bool, why: str) -> str:
    if not ok:
        return "refused"
    return "hybrid" if "left to PyTorch" in why or "stays in the library" in why else "ours"


def _supports(path: str) -> tuple[bool, str]:
    from pipeline.generate.expert import supports

    try:
        return supports(path)
    except Exception as e:  # a probe must report an expert that raises, not stop
        return False, f"RAISED {type(e).__name__}: {e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the verdicts as JSON")
    ap.add_argument("--only", default="", help="comma-separated op names")
    args = ap.parse_args()
    names = [n for n in OPS if not args.only or n in args.only.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        paths = [str(write(Path(tmp), n)) for n in names]
        workers = max(1, min(4, os.cpu_count() or 1))
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            results = dict(zip(names, ex.map(_supports, paths), strict=True))
    counts: dict[str, int] = {}
    for name, (ok, why) in results.items():
        v = verdict(ok, why)
        counts[v] = counts.get(v, 0) + 1
        print(f"{name:22s} {v:8s} {textwrap.shorten(why, 150)}")
    print(" ".join(f"{k}: {v}" for k, v in sorted(counts.items())), f"of {len(results)}")
    if args.out:
        args.out.write_text(
            json.dumps({n: {"ok": ok, "why": why} for n, (ok, why) in results.items()}, indent=1)
        )


if __name__ == "__main__":
    main()
