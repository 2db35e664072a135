"""Fused attention (families/attention.py, templates/attention.py) on the CPU: which attentions the family
takes (SDPA and hand-written chains) and why it refuses others, its plans and edits, its kernel run by the
CUDA emulator against a float64 PyTorch reference (3xTF32 emulated bit for bit on the tf32 products), and
its kernels compiled for sm_90a without spills (tests/test_gpu_expert.py runs them on the GPU)."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import torch
from cuda_emulator import build, load_model

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, capture, plan_of
from pipeline.generate.expert.edits import base_plan, for_arch, legal_edits
from pipeline.generate.expert.families import attention
from pipeline.generate.expert.policy import analyse
from pipeline.generate.expert.render import prepare, render
from pipeline.generate.expert.templates.code import LAUNCHER_HELPERS, RESHAPE_HELPERS
from pipeline.static_check import check_launcher
from pipeline.tasks import load_module, probe
from pipeline.types import Status

HEADER = "import math\n\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"


def _task(folder: Path, name: str, forward: str, inputs: list[str], init: str = "") -> Path:
    body = "class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    body += textwrap.indent(textwrap.dedent(init).strip() or "pass", " " * 8) + "\n\n"
    head, _, rest = textwrap.dedent(forward).strip().partition("\n")
    body += "    def forward(self, " + head + "\n" + textwrap.indent(rest, " " * 4) + "\n"
    path = folder / f"{name}.py"
    path.write_text(
        HEADER + body + f"\n\ndef get_inputs():\n    return [{', '.join(inputs)}]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    return path


def _qkv(b, h, lq, sk, d, dv=None, dt=""):
    return [f"torch.randn({b}, {h}, {lq}, {d}{dt})", f"torch.randn({b}, {h}, {sk}, {d}{dt})",
            f"torch.randn({b}, {h}, {sk}, {dv or d}{dt})"]  # fmt: skip


GPT_INIT = """
self.qkv = nn.Linear(32, 96)
self.proj = nn.Linear(32, 32)
self.register_buffer("bias", torch.tril(torch.ones(80, 80)).view(1, 1, 80, 80))
"""
GPT = """x):
    B, T, C = x.size()
    q, k, v = self.qkv(x).split(32, dim=2)
    q, k, v = (t.view(B, T, 2, 16).transpose(1, 2) for t in (q, k, v))
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(16))
    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
    att = F.dropout(F.softmax(att, dim=-1), 0.0)
    y = att @ v
    return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
"""
RELU = """q, k, v):
    T = q.size(-2)
    att = F.relu((q @ k.transpose(-2, -1)) * 0.25 + self.bias[:T, :T])
    return att @ v
"""
# Swin's shifted windows (level 3's SwinV2): cosine scores, a bias a head, and a mask a window added through a
# view that splits the batch, (images, windows, heads, L, S); 37 keys, not a multiple of any tile.
SWIN_INIT = """
self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(2, 1, 1)))
self.bias = nn.Parameter(torch.randn(2, {n}, {n}))
m = torch.randint(0, 3, (3, {n}))
self.register_buffer("mask", (m.unsqueeze(1) - m.unsqueeze(2) != 0).float() * -100.0)
"""
SWIN = """q, k, v):
    nw = self.mask.shape[0]
    att = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    att = att * torch.clamp(self.logit_scale, max=4.6052).exp() + 16 * torch.sigmoid(self.bias)
    att = att.view(-1, nw, 2, {n}, {n}) + self.mask.unsqueeze(1).unsqueeze(0)
    return F.softmax(att.view(-1, 2, {n}, {n}), dim=-1) @ v
"""
TASKS = {  # name -> (forward, inputs, init)
    "sdpa_causal": ("q, k, v):\n    return F.scaled_dot_product_attention(q, k, v, is_causal=True)",
                    _qkv(2, 2, 45, 45, 16), ""),
    "sdpa_causal_short_queries": ("q, k, v):\n    return F.scaled_dot_product_attention(q, k, v, is_causal=True)",
                                  _qkv(1, 2, 21, 70, 8, 24), ""),
    "sdpa_bool_mask": ("q, k, v, m):\n    return F.scaled_dot_product_attention(q, k, v, attn_mask=m > 0, scale=0.3)",
                       [*_qkv(2, 1, 33, 40, 16), "torch.randn(33, 40)"], ""),
    "sdpa_float_mask_3d": ("q, k, v, m):\n    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)",
                           ["torch.randn(3, 20, 8)", "torch.randn(3, 36, 8)", "torch.randn(3, 36, 8)",
                            "torch.randn(3, 1, 36)"], ""),
    "sdpa_gqa": ("q, k, v):\n    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)",
                 ["torch.randn(1, 4, 30, 16)", "torch.randn(1, 2, 50, 16)", "torch.randn(1, 2, 50, 16)"], ""),
    "sdpa_wide_head": ("q, k, v):\n    return F.scaled_dot_product_attention(q, k, v)",  # no prefetch
                       _qkv(1, 1, 20, 40, 128), ""),
    "gpt_block": (GPT, ["torch.randn(2, 70, 32)"], GPT_INIT),
    "relu_attention": (RELU, _qkv(2, 2, 37, 37, 16, 8),
                       'self.register_buffer("bias", torch.randn(64, 64))'),
    # Few keys: the CUDA-core form (templates/attention_rows.py) in the tuned plan.
    "sdpa_short_causal": ("q, k, v):\n    return F.scaled_dot_product_attention(q, k, v, is_causal=True)",
                          _qkv(3, 2, 5, 7, 24), ""),
    "sdpa_short_bool_mask": ("q, k, v, m):\n    return F.scaled_dot_product_attention(q, k, v, attn_mask=m > 0)",
                             [*_qkv(2, 3, 4, 9, 16, 32), "torch.randn(3, 4, 9)"], ""),
    "mha_short_sequence": ("x):\n    return self.mha(x, x, x, need_weights=False)[0]", ["torch.randn(2, 9, 32)"],
                           "self.mha = nn.MultiheadAttention(32, 4)"),  # not batch_first: a sequence of 2
    "swin_shifted_windows": (SWIN.format(n=37), _qkv(6, 2, 37, 37, 16), SWIN_INIT.format(n=37)),
    "swin_shifted_windows_short": (SWIN.format(n=9), _qkv(6, 2, 9, 9, 16), SWIN_INIT.format(n=9)),
    "relu_attention_short": (RELU, _qkv(2, 2, 6, 6, 16, 8), 'self.register_buffer("bias", torch.randn(64, 64))'),
}  # fmt: skip
SHORT = (
    "sdpa_short_causal", "sdpa_short_bool_mask", "mha_short_sequence", "relu_attention_short",
    "swin_shifted_windows_short",
)  # fmt: skip


def _path(tmp_path: Path, name: str) -> Path:
    forward, inputs, init = TASKS[name]
    return _task(tmp_path, name, forward, inputs, init)


def _attention(path: Path):
    low = prepare(capture(path))
    hits = [(r, attention.match(r, low)) for r in low.regions]
    hits = [(r, m) for r, m in hits if not isinstance(m, str)]
    return low, hits


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_family_takes_sdpa_and_hand_written_attention(tmp_path, name):
    low, hits = _attention(_path(tmp_path, name))
    assert len(hits) == 1
    r, m = hits[0]
    plan = base_plan(low, True)
    rp = plan.get(r.rid)
    assert isinstance(rp, attention.AttnPlan)
    # the absorbed regions have no entries of their own, and nothing else fused them
    gone = set(rp.absorbed())
    assert gone == set(m.absorbs.values())
    assert not gone & {x.rid for x in plan.regions}
    assert all(not set(x.absorbed()) & gone for x in plan.regions if x is not rp)
    if name == "gpt_block":  # mask, softmax, a dropout of p = 0 and the product; heads merged back
        assert set(m.absorbs) == {"scores", "softmax", "between", "pv"} and m.form.out_order == (0, 2, 1, 3)
    if name == "mha_short_sequence":  # MHA's (L, B, H, Dv) permute of the output: written in that order
        assert m.form.out_order == (2, 0, 1, 3)
    if name.startswith("swin_shifted_windows"):  # the mask a window added through the batch split
        assert (
            set(m.absorbs) == {"scores", "scores2", "softmax", "pv", "qnorm", "knorm"} and m.form.split == 3
        )
        # F.normalize of Q and K done in the kernel, which reads the raw operands (K not transposed)
        assert (m.form.q, m.form.k, m.form.k_transposed, m.form.norm_q, m.form.norm_k) == (
            "q",
            "k",
            False,
            1e-12,
            1e-12,
        )
        assert len(m.form.extras2) == 1 and m.form.chain2 is not None
    if name.startswith("relu_attention"):
        assert not m.form.softmax and m.form.chain is not None
    assert rp.rows == (name in SHORT)  # few keys: the CUDA cores'


@pytest.mark.parametrize(
    ("forward", "inputs", "why"),
    [
        ("q, k, v):\n    return F.scaled_dot_product_attention(q, k, v)", _qkv(1, 2, 8, 8, 16, dt=", dtype=torch.float16"),
         "fp32"),
        ("q, k, v):\n    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)", _qkv(1, 2, 8, 8, 16), "dropout"),
        ("q, k, v):\n    return F.scaled_dot_product_attention(q, k, v)", _qkv(1, 2, 8, 8, 12), "multiple of 8"),
        ("q, k, v):\n    return F.scaled_dot_product_attention(q, k, v)", _qkv(1, 2, 8, 8, 136), "up to 128"),
        ("q, k, v):\n    return (q @ k.transpose(-2, -1)) @ v", _qkv(1, 2, 8, 8, 16), "GEMMs, not an attention"),
        ("q, k, v):\n    a = F.softmax(q @ k.transpose(-2, -1), dim=-1)\n    return a @ v, a", _qkv(1, 2, 8, 8, 16),
         "product with V alone"),
        ("q, k, v):\n    return F.softmax(q @ k.transpose(-2, -1), dim=-2) @ v", _qkv(1, 2, 8, 8, 16), "last dim"),
        ("q, k, v):\n    return v @ F.softmax(q @ k.transpose(-2, -1), dim=-1)", _qkv(1, 2, 8, 8, 8),
         "left operand"),
        ("q, k, v):\n    return F.softmax(torch.tril(q @ k.transpose(-2, -1)), dim=-1) @ v", _qkv(1, 2, 8, 8, 16),
         "positional op"),
        # a batch split that is not viewed back (the softmax over the 5-D scores), or whose split scores are
        # returned too
        ("q, k, v, m):\n    a = (q @ k.transpose(-2, -1)).view(2, 2, 2, 8, 8) + m\n    return F.softmax(a, -1).view(4, 2, 8, 8) @ v",
         [*_qkv(4, 2, 8, 8, 16), "torch.randn(2, 1, 8, 8)"], "not viewed back"),
        ("q, k, v, m):\n    a = (q @ k.transpose(-2, -1)).view(2, 2, 2, 8, 8)\n    return F.softmax((a + m).view(4, 2, 8, 8), -1) @ v, a",
         [*_qkv(4, 2, 8, 8, 16), "torch.randn(2, 1, 8, 8)"], "no elementwise op"),
    ],
)  # fmt: skip
def test_what_the_family_refuses_says_why(tmp_path, forward, inputs, why):
    low = prepare(capture(_task(tmp_path, "t", forward, inputs)))
    whys = [
        m for r in low.regions if isinstance(m := attention.match(r, low), str) and m != "not an attention"
    ]
    assert any(why in w for w in whys), whys
    assert all(rp.TAG != "attention" for rp in base_plan(low, True).regions)


def test_plans_and_edits(tmp_path):
    """Tuned: fused; plain: the reference's kernels (a hand-written chain) or fused (SDPA alone: nothing
    else would be ours). Edits move rows a block, keys a tile and the launch bounds, and fuse from plain."""
    low, [(r, _)] = _attention(_path(tmp_path, "gpt_block"))
    plain = base_plan(low, False)
    assert plain.get(r.rid) is None
    fuse = [p for label, p in legal_edits(plain, low) if label.startswith("use_fused_attention")]
    assert len(fuse) == 1 and isinstance(fuse[0].get(r.rid), attention.AttnPlan)
    tuned = base_plan(low, True)
    moves = {label.split("(")[0]: p.get(r.rid) for label, p in legal_edits(tuned, low) if label.endswith(")")
             and f"({r.rid}:" in label}  # fmt: skip
    assert moves["coarsen_threads"].warps == 8 and moves["more_parallelism"].warps == 2
    assert moves["tile_shared_memory"].bn == 64 and moves["increase_occupancy"].min_blocks == 2
    sdpa_low, [(s, _)] = _attention(_path(tmp_path, "sdpa_causal"))
    assert isinstance(base_plan(sdpa_low, False).get(s.rid), attention.AttnPlan)


def _reference(path: Path) -> tuple[dict, list, torch.Tensor]:
    """The task's weights (seeded), inputs and float64 output."""
    module = load_module(path)
    torch.manual_seed(0)
    ref = module.Model()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    xs = module.get_inputs()
    with torch.no_grad():
        want = ref.double()(*[x.double() for x in xs])
    return state, xs, want


def test_few_keys_go_to_the_cuda_cores_and_back(tmp_path):
    """The tuned plan over few keys computes on the CUDA cores; use_tensor_cores goes back to the tensor-core
    kernel, and more_parallelism offers the CUDA cores to a tensor-core plan over up to a key tile of 64."""
    low, [(r, _)] = _attention(_path(tmp_path, "sdpa_short_causal"))
    tuned = base_plan(low, True)
    assert tuned.get(r.rid).rows
    moves = dict(legal_edits(tuned, low))
    back = [p.get(r.rid) for label, p in moves.items() if label.startswith("use_tensor_cores")]
    assert len(back) == 1 and not back[0].rows
    assert not [x for x in moves if x.startswith(("coarsen_threads", "tile_shared_memory")) and r.rid in x]
    offered = [p.get(r.rid) for label, p in legal_edits(tuned.replace(back[0]), low) if "rows=True" in label]
    assert len(offered) == 1 and offered[0].rows
    long_low, [(lr, _)] = _attention(_path(tmp_path, "sdpa_causal"))  # 45 keys: tensor cores, rows offered
    long_plan = base_plan(long_low, True)
    assert not long_plan.get(lr.rid).rows
    assert any("rows=True" in label for label, _ in legal_edits(long_plan, long_low))
    wide_low, [_] = _attention(_path(tmp_path, "gpt_block"))  # 70 keys: past a key tile of 64
    assert not any("rows=True" in label for label, _ in legal_edits(base_plan(wide_low, True), wide_low))


@pytest.mark.parametrize("name", SHORT)
def test_emulated_short_attention_matches_pytorch_in_both_forms(tmp_path, name):
    """The CUDA-core form (plain fp32) and the tensor-core form it came from, on the same few-key task."""
    path = _path(tmp_path, name)
    state, xs, want = _reference(path)
    low, _ = analyse(path)
    tuned = base_plan(low, True)
    (rp,) = [x for x in tuned.regions if x.TAG == "attention"]
    plans = {"rows": tuned, "tensor cores": tuned.replace(dataclasses.replace(rp, rows=False))}
    for form, plan in plans.items():
        source, launcher = render(low, for_arch(plan, "sm_80"))
        kernels = build(source, tmp_path)
        model = load_model(launcher, kernels)()
        model.load_state_dict(state, strict=False)
        with torch.no_grad():
            got = model(*xs)
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel < (1e-6 if form == "tensor cores" else 3e-7), (form, rel)
        assert any(n.endswith("_attn") for n, *_ in kernels.launches), form


def _ours(path: Path) -> list:
    """The expert's first proposals and one edit of the tuned one that use the fused kernel, rendered for
    sm_80 (our WGMMA GEMMs, which the emulator cannot run, go back to the library there)."""
    t = probe(path)
    policy = ExpertPolicy()
    first = policy.propose(Context(task=t, reference=t.source, parent=None), 2)
    kids = policy.propose(Context(task=t, reference=t.source, parent=first[-1].candidate), 6)
    low, why = analyse(path)  # as the policy lowered it
    assert low is not None, why
    out = {}
    for p in (*first, *kids):
        plan = plan_of(p.candidate.source) if p.candidate else None
        if plan is not None and any(rp.TAG == "attention" for rp in plan.regions):
            plan = for_arch(plan, "sm_80")
            out[plan.to_json()] = (p.edit, *render(low, plan))
    return list(out.values())


@pytest.mark.parametrize("name", sorted(TASKS))
def test_emulated_attention_matches_pytorch(tmp_path, name):
    path = _path(tmp_path, name)
    state, xs, want = _reference(path)
    cands = _ours(path)
    assert cands
    for edit, source, launcher in cands[:2]:
        kernels = build(source, tmp_path)
        model = load_model(launcher, kernels)()
        model.load_state_dict(state, strict=False)
        with torch.no_grad():
            got = model(*xs)
        assert got.shape == want.shape and got.dtype == torch.float32
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel < 1e-6, (edit, rel)  # fp32-accurate: one tf32 product alone is off by ~1e-4
        launched = [n for n, *_ in kernels.launches]
        assert any(n.endswith("_attn") for n in launched), (edit, launched)
        if name != "mha_short_sequence":  # its copies are the reference's own (MHA's contiguous, a permute)
            assert not any(n.startswith("kp_gather") for n in launched), (
                edit,
                launched,
            )  # no copies of Q, K, V


def test_one_tf32_product_alone_is_not_fp32_accurate(tmp_path):
    """The split is what makes the kernel fp32-accurate: without the two correction products the same
    kernel is off by about tf32's rounding."""
    path = _path(tmp_path, "sdpa_causal")
    module = load_module(path)
    xs = module.get_inputs()
    want = module.Model()(*[x.double() for x in xs])
    _, source, launcher = _ours(path)[0]
    one = source.replace("    mma(d, al, bh);\n    mma(d, ah, bl);\n", "")
    assert one != source
    errors = []
    for src in (source, one):
        model = load_model(launcher, build(src, tmp_path))()
        with torch.no_grad():
            errors.append(((model(*xs).double() - want).norm() / want.norm()).item())
    assert errors[0] < 1e-6 < 1e-4 < errors[1], errors


def test_launchers_pass_the_static_check(tmp_path):
    for name in ("gpt_block", "sdpa_bool_mask", "swin_shifted_windows"):
        for _, _, launcher in _ours(_path(tmp_path, name)):
            report = check_launcher(launcher)
            assert report.ok, report.violations


def test_fused_kernels_compile_for_sm90a_without_spills(tmp_path):
    cands = []
    for name in (
        "sdpa_causal",
        "gpt_block",
        "sdpa_wide_head",
        "sdpa_short_bool_mask",
        "mha_short_sequence",
        "swin_shifted_windows",
    ):
        t = probe(_path(tmp_path, name))
        cands += [
            p.candidate
            for p in ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)
            if any(rp.TAG == "attention" for rp in plan_of(p.candidate.source).regions)
        ][:1]
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for b in builds:
        assert b.status == Status.OK and not b.log, b.log
        (k,) = [r for r in b.resources if r.name.endswith("_attn")]
        assert k.spill_stores == 0, k


def test_reshape_views_whenever_torch_can():
    """The launchers' reshape: a view exactly when torch.view exists (no copy of heads split off a
    projection), our gather otherwise."""
    ns: dict = {"torch": torch, "math": __import__("math"), "numpy": __import__("numpy")}
    exec(LAUNCHER_HELPERS + RESHAPE_HELPERS, ns)
    base = torch.randn(2, 6, 4, 5)
    cases = [
        (base, (12, 20)), (base.transpose(1, 2), (2, 24, 5)), (base.transpose(1, 2), (8, 6, 5)),
        (base[:, :, :2], (2, 6, 10)), (base[:, :, :, :3], (48, 3)), (base[:, :3], (6, 20)),
        (base.permute(0, 2, 1, 3), (2, 4, 30)), (base.expand(3, 2, 6, 4, 5), (6, 120)),
        (base.expand(3, 2, 6, 4, 5), (3, 240)), (base[..., :1], (2, 6, 4)), (torch.randn(3, 1, 4)[:, :, ::2], (3, 2)),
    ]  # fmt: skip
    for t, shape in cases:
        try:
            t.view(shape)
            viewable = True
        except RuntimeError:
            viewable = False
        assert ns["_viewable"](t, shape) == viewable, (t.shape, t.stride(), shape)
