"""The implicit-GEMM fp32 convolution (families/conv_tf32.py, templates/conv_tf32.py) on the CPU: which
convolutions it takes, its index maps run by the CUDA emulator against PyTorch's convolution, its plans and
launcher, and its kernels compiled for sm_90a without spills, their SASS read (the GPU runs it in
tests/test_gpu_expert.py)."""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy
import pytest
import torch
import torch.nn.functional as F
from cuda_emulator import build
from expert_plans import with_knobs

from pipeline.compile import _cutlass, compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, capture, plan_of
from pipeline.generate.expert.edits import base_plan, legal_edits
from pipeline.generate.expert.families import conv_tf32
from pipeline.generate.expert.families.gemm_kit import FEW_TILES
from pipeline.generate.expert.regions import RegionKind
from pipeline.generate.expert.render import prepare, render, uses_cute
from pipeline.generate.expert.templates import conv_f16x3
from pipeline.generate.expert.templates import conv_tf32 as template
from pipeline.profile.collect import dump_sass, find_cuobjdump, parse_sass
from pipeline.static_check import check_launcher
from pipeline.tasks import probe
from pipeline.types import Kind, Status


@pytest.fixture(autouse=True, scope="module")
def _small_convolutions_stay_implicit_gemms():
    """This file tests the implicit GEMM on small shapes (K of 15 to 45 with several taps), which the
    tap-wise narrow bound (NARROW_K_TAPS) sends to the direct kernel: here only the pointwise bound applies."""
    mp = pytest.MonkeyPatch()
    mp.setattr(template, "NARROW_K_TAPS", template.NARROW_K)
    yield
    mp.undo()


HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"
CONV = """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv{t}{d}d({cin}, {cout}, {k}, stride={s}, padding={p}, dilation={dl}, groups={g},
                               bias={bias}, dtype=torch.{dt}{op})
        self.b = nn.Parameter(torch.randn({cout}, {ones}) * 0.1)
    def forward(self, x):
        return {expr}
"""


def conv_task(folder: Path, name: str, d=2, cin=5, cout=24, k=3, s=1, p=1, dl=1, g=1, bias=True, dt="float32",
              size=(13, 11), batch=2, expr="torch.relu(self.conv(x) + self.b) * 0.5", op=None) -> Path:  # fmt: skip
    """A convolution task; with `op` (its output padding) a transposed one."""
    body = CONV.format(d=d, cin=cin, cout=cout, k=k, s=s, p=p, dl=dl, g=g, bias=bias, dt=dt,
                       ones=", ".join(["1"] * d), expr=expr, t="" if op is None else "Transpose",
                       op="" if op is None else f", output_padding={op}")  # fmt: skip
    shape = ", ".join(str(v) for v in (batch, cin, *size))
    path = folder / f"{name}.py"
    path.write_text(
        HEADER + textwrap.dedent(body).strip() + f"\n\n\ndef get_inputs():\n    return [torch.randn({shape}, "
        f"dtype=torch.{dt})]\n\n\ndef get_init_inputs():\n    return []\n"
    )
    return path


def conv_region(path: Path):
    low = prepare(capture(path))
    (r,) = [r for r in low.regions if r.kind is RegionKind.LIBRARY]
    return r, low


# ----------------------------------------------------------------------------------------- what it takes


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        (dict(d=1, size=(17,), k=5, s=2, p=2), ((1, 1, 17), (1, 1, 5), (1, 1, 2), (0, 0, 2), (1, 1, 9))),
        (
            dict(d=2, k=3, s=(2, 1), p=(0, 2), dl=2),
            ((1, 13, 11), (1, 3, 3), (1, 2, 1), (0, 0, 2), (1, 5, 11)),
        ),
        (dict(d=3, size=(4, 6, 5), k=2), ((4, 6, 5), (2, 2, 2), (1, 1, 1), (1, 1, 1), (5, 7, 6))),
        (
            dict(d=2, k=3, s=2, p=1, op=1),
            ((1, 13, 11), (1, 3, 3), (1, 2, 2), (0, 1, 1), (1, 26, 22)),
        ),  # transposed
    ],
)
def test_the_geometry_of_1d_2d_and_3d_convolutions(tmp_path, kw, want):
    r, low = conv_region(conv_task(tmp_path, "c", **kw))
    f = conv_tf32.form(r, low)
    assert isinstance(f, template.ConvForm), f
    assert (f.size, f.kernel, f.stride, f.pad, f.out) == want
    assert f.dims == kw["d"] and f.cin == 5 and f.cout == 24 and f.transposed == ("op" in kw)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        (dict(g=5, cout=25), "groups = 5"),
        (dict(dt="bfloat16"), "fp32 operands"),
    ],
)
def test_what_the_implicit_gemm_does_not_take_says_why(tmp_path, kw, why):
    r, low = conv_region(conv_task(tmp_path, "c", **kw))
    got = conv_tf32.form(r, low)
    assert isinstance(got, str) and why in got, got
    assert not conv_tf32.FAMILY.claims(r, low)


@pytest.mark.parametrize(
    ("p", "k", "pad"), [("'same'", 3, (0, 1, 1)), ("'valid'", 3, (0, 0, 0)), ("'same'", 5, (0, 2, 2))]
)
def test_padding_given_as_a_word_is_taken_as_its_numbers(tmp_path, p, k, pad):
    """conv(padding="same" / "valid") is lowered to the numbers (regions._conv_padding): it was left to cuDNN."""
    r, low = conv_region(conv_task(tmp_path, "c", p=p, k=k))
    f = conv_tf32.form(r, low)
    assert isinstance(f, template.ConvForm) and f.pad == pad, f


def test_the_channel_tile_covers_the_channels_in_multiples_of_8():
    assert [template.tile_n(c) for c in (1, 16, 24, 64, 100, 128, 129, 192, 256, 300)] == [
        8, 16, 32, 64, 128, 128, 96, 96, 128, 128,
    ]  # fmt: skip
    assert [template.tiles(c) for c in (8, 24, 128, 130)] == [(8,), (16, 32), (64, 128), (96,)]
    for bn in (8, 64, 128):
        top = template.max_stages(bn)
        assert 2 <= top <= template.MAX_STAGES and template.smem_bytes(bn, top) <= 227 * 1024


# ---------------------------------------------------------------------- its index maps, on the emulator

_TAPWISE = r"""
extern "C" __global__ void __launch_bounds__(64) im2col(const float* __restrict__ x, float* __restrict__ a,
                                                        int M, int K, int KT) {
    const long long p = (long long)blockIdx.x * 64 + threadIdx.x;
    const Window w = window(p, M);  // rows past M (a whole block of them here) must gather zeros
    for (int k = 0; k < KT * 32; ++k) a[p * KT * 32 + k] = tap(x, w, k, K);
}
"""
_CHANNELS = r"""
extern "C" __global__ void __launch_bounds__(64) im2col(const float* __restrict__ x, float* __restrict__ a,
                                                        int M, int K, int KT) {
    const long long p = (long long)blockIdx.x * 64 + threadIdx.x;
    const Gather g = gather_of(x, p, M);  // rows past M (a whole block of them here) must gather zeros
    for (int kt = 0; kt < KT; ++kt) {
        float v[32];
        gather_tile(g, kt, v, TAPS, 0);
        for (int j = 0; j < 32; ++j) a[p * KT * 32 + kt * 32 + j] = v[j];
    }
}
"""
_PHASED = r"""
extern "C" __global__ void __launch_bounds__(64) im2col(const float* __restrict__ x, float* __restrict__ a,
                                                        int M, int ph, int KT) {
    const Phase Q = PHASE_OF[ph];
    const long long p = (long long)blockIdx.x * 64 + threadIdx.x;
    const Gather g = gather_of_phase(x, Q, p, (long long)(M / P) * Q.pix);  // rows past the phase's: zeros
    for (int kt = 0; kt < Q.ktiles; ++kt) {
        float v[32];
        gather_tile(g, kt, v, Q.taps, Q.tap0);
        for (int j = 0; j < 32; ++j) a[p * KT * 32 + kt * 32 + j] = v[j];
    }
}
extern "C" __global__ void __launch_bounds__(64) scatter(const float* __restrict__ c, float* __restrict__ out,
                                                         int M, int ph, int N) {
    const Phase Q = PHASE_OF[ph];
    const long long p = (long long)blockIdx.x * 64 + threadIdx.x;
    if (p < (long long)(M / P) * Q.pix)
        for (int co = 0; co < N; ++co) out[out_at_phase(Q, p, co, N)] = c[p * N + co];
}
"""
_SCATTER = r"""
extern "C" __global__ void __launch_bounds__(64) scatter(const float* __restrict__ c, float* __restrict__ out,
                                                         int M, int N) {
    const long long p = (long long)blockIdx.x * 64 + threadIdx.x;
    if (p < M)
        for (int co = 0; co < N; ++co) out[out_at(p, co, N)] = c[p * N + co];
}
"""


def _lo(v: torch.Tensor) -> torch.Tensor:
    """What tf32 drops of v: v minus v with its low 13 mantissa bits cleared."""
    return v - (v.view(torch.int32) & ~0x1FFF).view(torch.float32)


@pytest.mark.parametrize(
    ("kw", "cinp"),
    [
        (dict(d=2, k=3, p=1), 8),
        (dict(d=2, k=3, s=(2, 1), p=(0, 2), dl=2, cin=3), 4),  # 9 taps of 4 channels: 2 k tiles
        (dict(d=1, size=(17,), k=5, s=2, p=2), 8),
        (dict(d=3, size=(4, 6, 5), k=2, s=(1, 2, 1), p=1), 8),
        (dict(d=2, k=1, p=0, size=(3, 7)), 8),
        (dict(d=2, k=3, p=1, cin=40, size=(6, 5)), 48),  # 16-channel halves, a tap's third 8 channels wide
        (dict(d=2, k=3, p=1, cin=72, size=(6, 5)), 80),  # five halves a tap: k tiles straddle taps
        (dict(d=3, size=(3, 4, 5), k=3, p=1, cin=48, op=0), 48),  # transposed at stride 1 (level 1's 61, 70)
        (dict(d=2, k=(3, 2), p=1, cin=96, size=(4, 5)), 96),  # three whole k tiles a tap
        (dict(d=2, k=(3, 2), p=(2, 0), dl=(1, 2), cin=32, size=(5, 7)), 32),
        (dict(d=3, size=(3, 4, 5), k=3, p=1, cin=16, op=0), 16),  # transposed at stride 1: channel-inner
        (dict(d=1, size=(20,), k=65, p=32, cin=2), 0),  # 65 taps: more than the window mask holds
    ],
)
def test_the_kernels_index_maps_compute_pytorchs_convolution(tmp_path, kw, cinp):
    """The gather (channel-inner or tap-wise), the weight kernel (B and its low part, in the gather's K
    order) and out_at (the stores), compiled from the template's own text, build the implicit GEMM on the
    CPU; a float64 product of it is PyTorch's convolution."""
    r, low = conv_region(conv_task(tmp_path, "c", batch=3, **kw))
    f = conv_tf32.form(r, low)
    assert template.cin_pad(f) == cinp
    probe_src = _CHANNELS if cinp else _TAPWISE
    src = "namespace g {\n" + template.geometry(f) + "\n}\nusing namespace g;\n" + probe_src + _SCATTER
    src += template.weight_kernel("t", f)
    emu = build(src, tmp_path)
    x = torch.randn(3, f.cin, *f.size[3 - f.dims :])
    d = f.dims
    w = torch.randn(*((f.cin, f.cout) if f.transposed else (f.cout, f.cin)), *f.kernel[3 - d :])
    m, k = 3 * int(numpy.prod(f.out)), template.gemm_k(f)
    k4, kt = -(-k // 4) * 4, -(-k // 32)
    blocks = -(-m // 64) + 1  # one block of rows past M
    a = torch.full((blocks * 64, kt * 32), float("nan"))
    emu.im2col((blocks,), (64,), (x, a, numpy.int32(m), numpy.int32(k), numpy.int32(kt)))
    assert torch.all(a[m:] == 0) and torch.all(a[:, k:] == 0)
    wk = torch.full((2, f.cout, k4), float("nan"))
    emu.kp_t_w((4,), (256,), (w, wk))
    taps = int(numpy.prod(f.kernel))
    rows = (w.transpose(0, 1) if f.transposed else w).reshape(f.cout, f.cin, taps)  # (C_out, C_in, taps)
    if cinp:  # taps, then channels zero-padded to CINP
        rows = F.pad(rows.transpose(1, 2), (0, cinp - f.cin))
    rows = rows.reshape(f.cout, k)
    assert torch.equal(wk[0, :, :k], rows) and torch.all(wk[0, :, k:] == 0)
    assert torch.equal(wk[1], _lo(wk[0])) and wk[1].abs().max() > 0
    c = (a[:m, :k].double() @ wk[0, :, :k].double().t()).float().contiguous()
    out = torch.full((3, f.cout, *f.out[3 - f.dims :]), float("nan"))
    emu.scatter((blocks,), (64,), (c, out, numpy.int32(m), numpy.int32(f.cout)))
    geo = (f.stride[3 - d :], f.pad[3 - d :])
    if f.transposed:
        conv = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[d]
        ref = conv(x.double(), w.double(), None, *geo, f.out_pad[3 - d :], 1, f.dil[3 - d :])
    else:
        conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[d]
        ref = conv(x.double(), w.double(), None, *geo, f.dil[3 - d :])
    assert torch.allclose(out.double(), ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    ("kw", "cinp", "taps"),
    [
        (dict(d=2, k=3, s=2, p=1, op=1), 8, (1, 2, 2, 4)),  # each output phase takes 1, 2 or 4 of the 9 taps
        (
            dict(d=2, k=(3, 2), s=(1, 3), p=(0, 1), dl=(2, 1), op=(0, 2), cin=3),
            4,
            (3, 0, 3),
        ),  # a phase of no taps
        (dict(d=1, size=(9,), k=4, s=3, p=2, op=0), 8, (1, 2, 1)),
        (dict(d=3, size=(3, 4, 5), k=3, s=(2, 1, 2), p=1, op=(1, 0, 0), cin=40), 64, (3, 6, 6, 12)),
        (
            dict(d=2, k=4, s=4, p=0, cin=16, size=(3, 2), op=0),
            16,
            (1,) * 16,
        ),  # stride = kernel: one tap a phase
    ],
)
def test_strided_transposed_convolutions_gather_by_phases(tmp_path, kw, cinp, taps):
    """A strided transposed convolution, phase by phase: each phase's gather (channel-inner over its own taps),
    its columns of the weight kernel's B, and its scatter, build the convolution on the CPU: a float64
    product per phase is PyTorch's conv_transpose."""
    r, low = conv_region(conv_task(tmp_path, "c", batch=2, **kw))
    f = conv_tf32.form(r, low)
    assert template.phased(f) and template.cin_pad(f) == cinp
    phases = template.phases(f)
    assert tuple(len(q.taps) for q in phases) == taps
    src = "namespace g {\n" + template.geometry(f) + "\n}\nusing namespace g;\n" + _PHASED
    src += template.weight_kernel("t", f)
    emu = build(src, tmp_path)
    d = f.dims
    x = torch.randn(2, f.cin, *f.size[3 - d :])
    w = torch.randn(f.cin, f.cout, *f.kernel[3 - d :])
    k = template.gemm_k(f)
    assert k == sum(template.phase_k(f)) and k % 32 == 0
    wk = torch.full((2, f.cout, k), float("nan"))
    emu.kp_t_w((4,), (256,), (w, wk))
    assert torch.equal(wk[1], _lo(wk[0]))
    rows = w.transpose(0, 1).reshape(f.cout, f.cin, -1)  # (C_out, C_in, taps)
    m = 2 * int(numpy.prod(f.out))
    out = torch.full((2, f.cout, *f.out[3 - d :]), float("nan"))
    col = 0
    for ph, (q, kq) in enumerate(zip(phases, template.phase_k(f), strict=True)):
        want = F.pad(rows[:, :, [t for t, _ in q.taps]].transpose(1, 2), (0, cinp - f.cin)).reshape(
            f.cout, -1
        )
        assert torch.equal(wk[0, :, col : col + want.shape[1]], want)
        assert torch.all(wk[0, :, col + want.shape[1] : col + kq] == 0)
        mq = 2 * int(numpy.prod(q.dims))
        blocks = -(-mq // 64) + 1  # one block of rows past the phase's
        a = torch.full((blocks * 64, max(1, kq)), float("nan"))
        emu.im2col((blocks,), (64,), (x, a, numpy.int32(m), numpy.int32(ph), numpy.int32(kq // 32)))
        if kq:
            assert torch.all(a[mq:] == 0)
        c = (a[:mq, :kq].double() @ wk[0, :, col : col + kq].double().t()).float().contiguous()
        emu.scatter((blocks,), (64,), (c, out, numpy.int32(m), numpy.int32(ph), numpy.int32(f.cout)))
        col += kq
    conv = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[d]
    ref = conv(
        x.double(), w.double(), None, f.stride[3 - d :], f.pad[3 - d :], f.out_pad[3 - d :], 1, f.dil[3 - d :]
    )
    assert not out.isnan().any()  # every output pixel lies in one phase
    assert torch.allclose(out.double(), ref, atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------------------- plans and the launcher


def test_the_tuned_plan_takes_our_kernel_with_the_bias_and_chain_fused(tmp_path):
    path = conv_task(tmp_path, "c", cout=40)
    low = prepare(capture(path))
    plain, tuned = base_plan(low, False), base_plan(low, True)
    assert not uses_cute(plain) and uses_cute(tuned)  # cuDNN first, then ours
    (c,) = [rp for rp in tuned.regions if isinstance(rp, conv_tf32.ConvPlan)]
    assert c.bn == 64 and c.epilogue  # the tile sized to the 40 channels; the chain on its stores
    assert [label for label, _ in legal_edits(tuned, low) if "bn=32" in label]  # and a narrower one
    assert not c.f16  # K = 45: 3xTF32 (the fp16x3 form where K is long: test_conv_f16x3.py)
    source, launcher = render(low, tuned)
    assert (
        "F32TF32TF32_SS_TN" in source and "kp_conv2d_conv_w" in launcher
    )  # B laid out in the gather's K order
    assert "constexpr int CIN = 5, ID = 1, IH = 13, IW = 11;" in source
    rep = check_launcher(launcher)
    assert rep.ok and rep.kind is Kind.CUSTOM, rep.violations  # no cuDNN call left
    # the conv's bias, a (C, 1, 1) view of its (C,) parameter, is read per channel from the parameter itself
    assert launcher.count(".reshape(-1))") == 2  # the bias and the scale: per channel


def test_a_narrower_channel_tile_is_offered_only_to_a_grid_of_few_tiles(tmp_path):
    """more_parallelism, resize_grid and reduce_registers halve the channel tile where the grid is too small
    to fill the GPU; with thousands of tiles they are not offered (the narrower tile lost on every such
    convolution measured) and the next edits take their place among the first kernels, except
    reduce_registers' 128 channels to 64, which brings a second gathering warpgroup (it won on level 2's 93
    and 100)."""
    cases = (
        (2, (13, 11), 64, "more_parallelism"),
        (64, (128, 128), 64, None),
        (64, (128, 128), 128, "reduce"),
    )
    for batch, size, cout, want in cases:
        low = prepare(
            capture(conv_task(tmp_path, f"c{batch}{cout}", cin=16, cout=cout, batch=batch, size=size))
        )
        tuned = base_plan(low, True)
        (c,) = [rp for rp in tuned.regions if isinstance(rp, conv_tf32.ConvPlan)]
        (r,) = [r for r in low.regions if r.rid == c.rid]
        tiles = conv_tf32.SPEC.grid_tiles(r, low, conv_tf32.form(r, low), c.bn)
        assert (tiles < FEW_TILES) == (want == "more_parallelism")
        assert tiles == {64: 3 if want else 8192, 128: 8192}[cout]
        labels = [label for label, _ in legal_edits(tuned, low)]
        narrower = [lbl for lbl in labels if f"conv2d_conv: bn={cout // 2}" in lbl]  # one plan, listed once
        assert (len(narrower) == 1 and narrower[0].startswith(want)) if want else not narrower, labels


def test_a_convolutions_plain_plan_takes_the_widest_tile_when_all_regions_are_ours(tmp_path):
    """With nothing but the convolution, the plain plan is our kernel (no cuDNN region to keep beside it) at
    the channel tile the tuned one takes: the narrow plain kernel ran 1.2-1.8x slower on every level-1
    convolution, an evaluation spent on a known loss."""
    low = prepare(capture(conv_task(tmp_path, "only", expr="self.conv(x)", cin=16, cout=64, bias=False)))
    plain, tuned = base_plan(low, False), base_plan(low, True)
    (p,), (t,) = ([rp for rp in x.regions if isinstance(rp, conv_tf32.ConvPlan)] for x in (plain, tuned))
    assert p.bn == t.bn == 64 and not p.epilogue


def test_an_epilogue_operand_of_another_layout_is_not_fused(tmp_path):
    path = conv_task(tmp_path, "c", expr="self.conv(x) * x.mean(1, keepdim=True)", cout=5)
    r, low = conv_region(path)
    assert conv_tf32.epilogue(r, low) is None  # (N, 1, H, W) varies per pixel, not per channel


@pytest.mark.skipif(not _cutlass()[0], reason="nvidia-cutlass is not installed")
def test_conv_instantiations_compile_for_sm90a_without_spills(tmp_path):
    paths = [
        conv_task(tmp_path, "c2", cin=16, cout=128),
        conv_task(tmp_path, "c1", d=1, size=(40,), cin=8, cout=24, k=5, s=2, p=2),
        conv_task(tmp_path, "c3", d=3, size=(5, 9, 7), cin=4, cout=72, k=3, expr="self.conv(x) - self.b"),
        conv_task(tmp_path, "t2", cin=32, cout=64, s=2, op=1),  # 72 products an output: the GEMM's
        conv_task(tmp_path, "tw", cin=8, cout=64, k=9, p=4, size=(20, 20)),  # 81 taps: the tap-wise gather
        conv_task(tmp_path, "h3", d=3, size=(6, 7, 8), cin=48, cout=48, k=3, p=1, op=0),  # 16-channel halves
    ]
    cands = []
    for path in paths:
        t = probe(path)
        (tuned,) = [
            p.candidate
            for p in ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)
            if uses_cute(plan_of(p.candidate.source))
        ]
        cands.append(tuned)
    # each in both forms: 3xTF32 and fp16x3 (templates/conv_f16x3.py), whichever the tuned plan took
    forms = []
    for f16 in (False, True):
        for p, c in zip(paths, cands, strict=True):
            (rp,) = [rp for rp in plan_of(c.source).regions if rp.TAG == "wgmma_conv_3xtf32"]
            stages = (conv_f16x3.max_stages if f16 else template.max_stages)(rp.bn)
            forms.append(c if rp.f16 == f16 else with_knobs(p, c, rp.TAG, f16=f16, stages=stages))
    cands = forms
    assert not any("fp16x3" in c.launcher for c in cands[:6]) and all(
        "fp16x3" in c.launcher for c in cands[6:]
    )
    assert "tap(x, win, (kt + GATHERERS) * BK + j, K)" in cands[4].source
    assert "constexpr int TAPS = KD * KH * KW, CINP = 48;" in cands[5].source
    # tiles of 64 channels or fewer: two gathering warpgroups (512 threads); the 128-channel tile one (384)
    bns = [next(rp.bn for rp in plan_of(c.source).regions if rp.TAG == "wgmma_conv_3xtf32") for c in cands]
    assert [template.threads(bn) for bn in bns] == [384, 512, 384, 512, 512, 512] * 2, bns
    for c, bn in zip(cands, bns, strict=True):
        assert (
            f"({template.threads(bn)},), (" in c.launcher
            and f"GATHERERS = {template.gatherers(bn)};" in c.source
        )
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for b, bn in zip(builds, bns, strict=True):
        assert b.status == Status.OK and not b.log, b.log  # not even a warning
        (k,) = [r for r in b.resources if r.name.endswith("_conv")]
        assert k.spill_stores == 0 and k.registers <= 65536 // template.threads(bn), k
        assert not k.wgmma_serialized and not k.wgmma_waits_injected, k  # the MMAs pipelined (C7518/C7517)


def _gather_loop(sass: str, kernel: str) -> list[str]:
    """The opcodes of the loop in `kernel` that holds its global loads (the gathering warpgroup's k loop): the
    shortest backward branch around at least half a k tile's loads (the first tile's, before the loop, and the
    out-of-line barrier waits that jump back to the kernel's top are not it)."""
    text = sass.split(f"Function : {kernel}")[1].split("Function :")[0]
    ins = [
        (int(m.group(1), 16), m.group(2).strip())
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)
    ]
    loads = [at for at, i in ins if re.search(r"\bLDG\.", i)]  # not the TMA's UTMALDG
    loops = []
    for at, i in ins:
        jump = re.search(r"BRA\S* (0x[0-9a-f]+)", i)
        if jump and int(jump.group(1), 16) < at:
            start = int(jump.group(1), 16)
            if sum(start <= a <= at for a in loads) >= 16:
                loops.append((at - start, start, at))
    if not loops:
        raise AssertionError(f"no loop around {kernel}'s loads")
    _, start, end = min(loops)
    return [re.sub(r"^@!?U?P\w+\s+", "", i).split()[0] for a, i in ins if start <= a <= end]


def _linear_task(folder: Path) -> Path:
    """An fp32 linear layer, 512 x 1024 by 512 x 1024: the 3xTF32 GEMM's tuned plan."""
    path = folder / "g.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, a, b):\n"
        "        return torch.nn.functional.linear(a, b)\n\n\ndef get_inputs():\n"
        "    return [torch.randn(512, 1024), torch.randn(512, 1024)]\n\n\ndef get_init_inputs():\n    return []\n"
    )
    return path


@pytest.mark.skipif(not _cutlass()[0], reason="nvidia-cutlass is not installed")
@pytest.mark.skipif(find_cuobjdump() is None, reason="no cuobjdump (pip install -e '.[dev]' brings one)")
def test_the_channel_inner_gather_costs_few_instructions_an_element(tmp_path):
    """The SASS of the gathering loop: each k tile's 32 elements take their loads from one base (immediate
    offsets), 16-byte shared stores, and about 8 instructions an element in all (the tap-wise gather took
    about 37 on the H200, docs/benchmarks.md); no generic loads or stores anywhere in the kernel, nor in
    the 3xTF32 GEMM's (its shared memory is addressed as such)."""
    conv = conv_task(tmp_path, "c", cin=64, cout=128, size=(32, 32), bias=False, expr="self.conv(x)")
    convt = conv_task(
        tmp_path, "t", cin=64, cout=64, size=(16, 16), s=2, op=1, bias=False, expr="self.conv(x)"
    )
    gemm = _linear_task(tmp_path)
    cands = []
    for path in (conv, convt, gemm):
        t = probe(path)
        props = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)
        cands += [p.candidate for p in props if uses_cute(plan_of(p.candidate.source))][:1]
    # 64 channels: the channel-inner gather; stride 2, transposed: by phases. Each loads the next k tile
    # before it stores this one (and the first before its loop).
    assert (
        "gather_tile(g, kt + GATHERERS, vn, TAPS, 0)" in cands[0].source
        and "gather_tile(g, wg, v, TAPS, 0)" in cands[0].source
    )
    assert "gather_tile(g, kt + GATHERERS, vn, Q.taps, Q.tap0)" in cands[1].source
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    assert all(b.status == Status.OK for b in builds), [b.log for b in builds]
    conv_sass, convt_sass, gemm_sass = (dump_sass(b.cubin_path) for b in builds)
    assert conv_sass and convt_sass and gemm_sass
    for sass, kernel in ((conv_sass, "kp_conv2d_conv"), (convt_sass, "kp_conv_transpose2d_conv")):
        loop = _gather_loop(sass, kernel)
        counts = Counter(loop)
        assert counts["LDG.E.CONSTANT"] == 32 and counts["STS.128"] == 16, (kernel, counts)
        assert parse_sass(sass)[kernel].opcodes["LDG.E.CONSTANT"] >= 64  # the first tile's, before the loop
        assert len(loop) <= 10 * 32, (
            f"{kernel}: {len(loop)} instructions for 32 elements: {counts.most_common(8)}"
        )
    for sass, kernel in (
        (conv_sass, "kp_conv2d_conv"),
        (convt_sass, "kp_conv_transpose2d_conv"),
        (gemm_sass, "kp_linear_gemm"),
    ):
        ops = parse_sass(sass)[kernel].opcodes
        generic = {op: n for op, n in ops.items() if re.match(r"(LD|ST)\.E", op)}
        assert not generic, f"{kernel}: generic shared-memory accesses {generic}"


@pytest.mark.skipif(not _cutlass()[0], reason="nvidia-cutlass is not installed")
def test_without_the_wait_after_the_k_loop_ptxas_serializes_or_drains_the_mmas(tmp_path):
    """The 3xTF32 templates' wait after the k loop (gemm_tf32._DRAINED) is what keeps ptxas from waiting on
    its own: taken out, it serializes the convolution's MMAs (C7518) and injects a wait in the GEMM's loop
    (C7517), and the compile's report says so per kernel (the wgmma_pipeline tool's evidence). The builds
    with it are checked clean by the compile tests above and in test_gemm.py."""
    from pipeline.generate.expert.templates import gemm_tf32

    conv = conv_task(tmp_path, "c", cin=64, cout=128, size=(32, 32), bias=False, expr="self.conv(x)")
    gemm = _linear_task(tmp_path)
    cands = []
    for path in (conv, gemm):
        t = probe(path)
        props = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)
        (tuned,) = [p.candidate for p in props if uses_cute(plan_of(p.candidate.source))][:1]
        assert tuned.source.count(gemm_tf32._DRAINED) == 1
        cands.append(
            replace(tuned, key=tuned.key + "-nowait", source=tuned.source.replace(gemm_tf32._DRAINED, ""))
        )
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    assert all(b.status == Status.OK for b in builds), [b.log for b in builds]
    (conv_k,) = [r for r in builds[0].resources if r.name == "kp_conv2d_conv"]
    (gemm_k,) = [r for r in builds[1].resources if r.name.endswith("_gemm")]
    assert "divergent path" in conv_k.wgmma_serialized, conv_k
    assert gemm_k.wgmma_waits_injected >= 1 and not gemm_k.wgmma_serialized, gemm_k
