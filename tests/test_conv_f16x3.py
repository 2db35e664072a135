"""The fp16x3 form of the implicit-GEMM convolution (templates/conv_f16x3.py) on the CPU: the gatherers' cut
and the weight and image kernels run by the CUDA emulator against the arithmetic the GEMM's split promises,
the gatherers' 64-byte swizzle checked against CuTe's layout, the launcher run with the WGMMA kernel
recorded, and the plans that take the form and leave it (test_conv.py builds both forms for sm_90a; the GPU
verifies it in tests/test_gpu_expert.py)."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess

import numpy
import pytest
import torch
from cuda_emulator import build, load_model
from expert_plans import with_knobs
from test_conv import conv_task
from test_gemm_f16x3 import split_ref

from pipeline.compile import _cutlass
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, capture, plan_of
from pipeline.generate.expert.edits import base_plan, legal_edits
from pipeline.generate.expert.families import conv_tf32
from pipeline.generate.expert.render import prepare
from pipeline.generate.expert.templates import conv_f16x3, gemm_f16x3
from pipeline.generate.expert.templates import conv_tf32 as tf32
from pipeline.generate.expert.templates.code import GATHER
from pipeline.static_check import check_launcher
from pipeline.tasks import probe

# Channel-inner (16 channels a tap), tap-wise (81 taps), a strided transposed one by phases, a 3-D one in
# 16-channel halves: each K wide enough, and each output wide enough, for the implicit GEMM.
GEOMETRIES = {
    "inner": dict(cin=16, cout=40, size=(9, 7)),
    "tapwise": dict(cin=8, cout=24, k=9, p=4, size=(11, 10)),
    "phased": dict(cin=32, cout=40, s=2, op=1, size=(5, 6)),
    "halves": dict(d=3, cin=48, cout=24, k=3, p=1, op=0, size=(3, 4, 5)),
}


def _task(tmp_path, name):
    return conv_task(tmp_path, name, bias=False, expr="self.conv(x)", **GEOMETRIES[name])


def _form(path):
    low = prepare(capture(path))
    (r,) = [r for r in low.regions if r.rid.startswith("conv")]
    f = conv_tf32.form(r, low)
    assert not isinstance(f, str) and not f.direct, f
    return f


def conv_split_ref(lines: torch.Tensor, ld: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GEMM's split (split_ref) with each line's exponent held at -126 or above (kp_conv_exp)."""
    mx = lines.abs().amax(-1)
    _, e = torch.frexp(mx)
    e = torch.where(mx > 0, e - 15, torch.zeros_like(e)).clamp(min=-126)
    v = (lines.double() * torch.pow(2.0, -e.double())[..., None]).float()
    hi = v.half()
    lo = (v - hi.float()).half()
    pad = ld - lines.shape[-1]
    return (torch.nn.functional.pad(hi, (0, pad)), torch.nn.functional.pad(lo, (0, pad)), e.to(torch.int32))


def test_the_gatherers_cut_is_the_gemms_split_for_every_exponent(tmp_path):
    """cut8 with the row's scale 2^-e (kp_conv_exp: e held at -126 or above, so that it is a float) gives the
    GEMM's split bit for bit from lines near fp32's largest (e = 113) to lines of 1e-30; a line of
    subnormals is scaled by 2^126, its largest magnitude then under 2^15 as everywhere."""
    k = build(
        gemm_f16x3.CUT
        + conv_f16x3.CUT8
        + r"""
extern "C" __global__ void __launch_bounds__(32) cut(const float* x, int* e, __half* h, __half* l, int n) {
    const int i = blockIdx.x * 32 + threadIdx.x;
    if (i >= n) return;
    float mx = 0.f;
    for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fabsf(x[8 * i + j]));
    e[i] = kp_conv_exp(mx);
    uint4 hv, lv;
    cut8(x + 8 * i, kp_pow2(-e[i]), hv, lv);
    reinterpret_cast<uint4*>(h)[i] = hv;
    reinterpret_cast<uint4*>(l)[i] = lv;
}""",
        tmp_path,
    )
    g = torch.Generator().manual_seed(5)
    scales = [1e-42, 1e-30, 1e-8, 0.5, 1.0, 3.0, 1e4, 1e20, 3e38]
    x = torch.cat([torch.randn(4, 8, generator=g) * s for s in scales]).clamp(-3.4e38, 3.4e38)
    x[3, 2] = 0.0
    n = x.shape[0]
    e = torch.full((n,), -999, dtype=torch.int32)
    h, lo = torch.zeros(n, 8, dtype=torch.float16), torch.zeros(n, 8, dtype=torch.float16)
    k.cut((-(-n // 32),), (32,), (x, e, h, lo, numpy.int32(n)))
    want_h, want_l, want_e = conv_split_ref(x, 8)
    assert torch.equal(e, want_e) and e.min() == -126 and e.max() > 100
    gemm_h, _, gemm_e = split_ref(x, 8)
    same = gemm_e >= -126  # the GEMM's own split wherever its exponent is a float's
    assert same.sum() == n - 4 and torch.equal(h[same].view(torch.int16), gemm_h[same].view(torch.int16))
    assert torch.equal(h.view(torch.int16), want_h.view(torch.int16))
    assert torch.equal(lo.view(torch.int16), want_l.view(torch.int16))


@pytest.mark.skipif(not _cutlass()[0], reason="nvidia-cutlass is not installed")
def test_the_gatherers_stores_follow_cutes_64_byte_swizzle(tmp_path):
    """The offset each gatherer writes element k of row t to (its 16-byte chunk swizzled by hand, as in
    STORE_F16) is where CuTe's K-major SW64 layout of fp16 puts it, through a shared-memory pointer (the
    address bits the hardware swizzles), in every stage of the ring; the WGMMAs read A by that layout."""
    at = re.search(r"const int at = (.*);", conv_f16x3.STORE_F16).group(1)
    (inc,) = _cutlass()[0][:1]
    src = tmp_path / "sw64.cu"
    src.write_text(
        f"""#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cstdio>
using namespace cute;
int main() {{
    using T = cutlass::half_t;
    constexpr int BM = {tf32.BM}, BK = {tf32.BK}, STAGES = 3;
    using SmemA = decltype(tile_to_shape(SM90::GMMA::Layout_K_SW64_Atom<T>{{}},
                                         make_shape(Int<BM>{{}}, Int<BK>{{}}, Int<STAGES>{{}})));
    alignas(1024) static T buf[BM * BK * STAGES];
    Tensor s = make_tensor(make_smem_ptr(buf), SmemA{{}});
    int bad = 0;
    for (int st = 0; st < STAGES; ++st)
        for (int t = 0; t < BM; ++t)
            for (int k = 0; k < BK; ++k) {{
                const int c = k / 8;
                const int at = {at};
                bad += (int)(&s(t, k, st) - buf) != st * BM * BK + t * BK + at + k % 8;
            }}
    printf("%d\\n", bad);
    return 0;
}}
"""
    )
    exe = tmp_path / "sw64"
    subprocess.run(
        ["nvcc", "-std=c++17", "-I", inc, str(src), "-o", str(exe)], check=True, capture_output=True
    )
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "0"


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_the_weight_kernel_cuts_each_row_of_b_as_the_gemms_split(tmp_path, name):
    """The fp16x3 weight kernel's planes are the split (gemm_f16x3's arithmetic, each row its own power of
    two 2^e, e at -126 or above) of the 3xTF32 weight kernel's B, in the gather's K order, zero-padded to
    16 bytes of fp16, and each row's 2^e as a float beside them."""
    f = _form(_task(tmp_path, name))
    k = tf32.gemm_k(f)
    k4, k8 = -(-k // 4) * 4, -(-k // 8) * 8
    emu = build(
        gemm_f16x3.CUT
        + conv_f16x3.CUT8
        + tf32.weight_kernel("a", f)
        + "\n"
        + conv_f16x3.weight_kernel("b", f),
        tmp_path,
    )
    g = torch.Generator().manual_seed(1)
    wshape = (
        (f.cin, f.cout, *f.kernel[3 - f.dims :]) if f.transposed else (f.cout, f.cin, *f.kernel[3 - f.dims :])
    )
    w = torch.randn(wshape, generator=g)
    w[0] *= 1e6  # rows of other scales: each takes its own exponent
    if not f.transposed:
        w[1] = 0.0
        w[2] *= 1e-42  # subnormals: scaled by 2^126
    b32 = torch.full((2, f.cout, k4), float("nan"))
    emu.kp_a_w((4,), (256,), (w, b32))
    planes = torch.full((2, f.cout, k8), float("nan"), dtype=torch.float16)
    pow2 = torch.full((f.cout,), float("nan"))
    emu.kp_b_w((3,), (256,), (w, planes, pow2))  # fewer blocks than rows: the grid strides
    hi, lo, e = conv_split_ref(b32[0, :, :k], k8)
    assert torch.equal(pow2, torch.pow(2.0, e.double()).float())
    assert torch.equal(planes[0].view(torch.int16), hi.view(torch.int16))
    assert torch.equal(planes[1].view(torch.int16), lo.view(torch.int16))
    assert (b32[0, :, :k] != 0).any(1).sum() >= f.cout - 1  # B holds the weight, not a padding of zeros


def test_the_image_kernel_takes_each_images_largest_magnitude(tmp_path):
    """kp_<rid>_amax: each image's max |x| as its float's bits (atomicMax on the bits of non-negative
    floats), by 16-byte loads where an image is a multiple of 4 floats and the input aligned, else one
    float at a time; an image of zeros stays 0 (exponent 0)."""
    for image, vec in ((4 * 9 * 7, True), (3 * 5 * 7, False)):
        emu = build(
            f"namespace kp_t {{ constexpr long long IMAGE = {image}; }}\n" + conv_f16x3.amax_kernel("t"),
            tmp_path,
        )
        g = torch.Generator().manual_seed(image)
        x = torch.randn(5, image, generator=g)
        x[1] = 0.0
        x[2] *= 1e-40  # subnormals: their bits order as their values
        x[3, 17] = -7e30  # the largest magnitude negative
        amax = torch.zeros(5, dtype=torch.int32)
        emu.kp_t_amax((2, 3), (256,), (x, amax, numpy.int64(5)))  # fewer y blocks than images
        want = x.abs().amax(-1)
        assert torch.equal(amax.view(torch.float32), want), (vec, amax.view(torch.float32), want)


class _ConvKernels:
    """The launcher's kernels: the weight and image kernels emulated from the source, the convolution
    kernel's launch recorded (its WGMMAs have no CPU form: the GPU tests verify its output)."""

    def __init__(self, emulated, rid):
        self.emulated, self.rid = emulated, rid
        self.maps: list[tuple] = []
        self.launch: tuple | None = None

    def tensor_map(self, t, box_rows, box_cols, swizzle=128):
        self.maps.append((t.dtype, tuple(t.shape), box_rows, box_cols, swizzle))
        return t

    def __getattr__(self, name):
        if name == f"kp_{self.rid}_conv":
            return self._conv
        return getattr(self.emulated, name)

    def _conv(self, grid, block, args, shared_mem=0):
        self.launch = (grid, block, args, shared_mem)


@pytest.mark.parametrize("name", ["inner", "phased"])
def test_the_launcher_prepares_both_operands_for_the_fp16_kernel(tmp_path, name):
    """The tuned candidate's launcher, run with the emulated weight and image kernels: B's fp16 planes and
    row exponents, each image's largest magnitude, a tensor map of fp16 rows 32 wide in the 64-byte swizzle,
    and the kernel launched with them, its ring in the shared memory it is given."""
    path = _task(tmp_path, name)
    t = probe(path)
    base = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
    (b,) = [rp for rp in plan_of(base.source).regions if isinstance(rp, conv_tf32.ConvPlan)]
    cand = with_knobs(path, base, b.TAG, f16=True, stages=conv_f16x3.max_stages(b.bn))
    (c,) = [rp for rp in plan_of(cand.source).regions if isinstance(rp, conv_tf32.ConvPlan)]
    assert check_launcher(cand.launcher).ok and "fp16x3 WGMMA kernel" in cand.launcher
    rid = re.search(r"kernels\.kp_(\w+)_amax\(", cand.launcher).group(1)
    f = _form(path)
    src = (
        gemm_f16x3.CUT
        + conv_f16x3.CUT8
        + f"namespace kp_{rid} {{ constexpr long long IMAGE = {f.cin * f.size[0] * f.size[1] * f.size[2]}; }}\n"
        + conv_f16x3.weight_kernel(rid, f)
        + "\n"
        + conv_f16x3.amax_kernel(rid)
        + "\n"
        + GATHER
    )
    fake = _ConvKernels(build(src, tmp_path), rid)
    model = load_model(cand.launcher, fake)()
    x = torch.randn(3, f.cin, *f.size[3 - f.dims :])
    x[1] *= 1e-3
    model(x)
    grid, block, args, smem = fake.launch
    tiles = sum(-(-3 * math.prod(q.dims) // 128) for q in tf32.phases(f)) if tf32.phased(f) else None
    assert grid == ((tiles or -(-3 * math.prod(f.out) // 128)) * -(-f.cout // c.bn),)
    ((dt, shape, rows, cols, swizzle),) = fake.maps
    k8 = -(-tf32.gemm_k(f) // 8) * 8
    assert (dt, shape, rows, cols, swizzle) == (torch.float16, (2, f.cout, k8), c.bn, 32, 64)
    assert block == (tf32.threads(c.bn),) and smem == conv_f16x3.smem_bytes(c.bn, c.stages)
    amax, wf = args[-2:]
    assert torch.equal(amax.view(torch.float32), x.abs().flatten(1).amax(1))
    assert wf.shape == (f.cout,) and wf.dtype == torch.float32 and (torch.frexp(wf).mantissa == 0.5).all()


def test_the_tuned_plan_takes_the_form_where_k_is_long_hedged_by_3xtf32_and_moved_back_and_forth(tmp_path):
    """Tuned, K at least F16_MIN_K: the fp16x3 form with the deepest ring its halves fit (twice the 3xTF32
    one's stages, or more); the first batch's hedge is use_tensor_cores, which moves to 3xTF32 with the
    ring cut to what fits, and from there back; pipeline_loads grows an fp16x3 ring past 3xTF32's depth.
    A shorter K keeps 3xTF32, unhedged."""
    short = base_plan(prepare(capture(_task(tmp_path, "inner"))), True)  # K = 144
    (s,) = [rp for rp in short.regions if isinstance(rp, conv_tf32.ConvPlan)]
    assert not s.f16 and conv_tf32.FAMILY.hedges(s) == ()
    path = conv_task(tmp_path, "long", cin=64, cout=40, size=(9, 7), bias=False, expr="self.conv(x)")
    low = prepare(capture(path))  # K = 576
    tuned = base_plan(low, True)
    (c,) = [rp for rp in tuned.regions if isinstance(rp, conv_tf32.ConvPlan)]
    assert c.f16 and c.stages == conv_f16x3.max_stages(c.bn) > tf32.max_stages(c.bn)
    assert conv_tf32.FAMILY.hedges(c) == ("use_tensor_cores",) and "fp16x3" in c.describe()
    back = [p for label, p in legal_edits(tuned, low) if label.startswith("use_tensor_cores")]
    (b,) = [rp for p in back for rp in p.regions if isinstance(rp, conv_tf32.ConvPlan)]
    assert not b.f16 and b.bn == c.bn and b.stages == tf32.max_stages(c.bn)
    assert conv_tf32.FAMILY.hedges(b) == ()
    (plan_b,) = back
    again = [p for label, p in legal_edits(plan_b, low) if label.startswith("use_tensor_cores")]
    assert [rp for p in again for rp in p.regions if isinstance(rp, conv_tf32.ConvPlan)] == [c]
    shorter = dataclasses.replace(c, stages=tf32.max_stages(c.bn))
    deeper = [
        p for label, p in legal_edits(tuned.replace(shorter), low) if label.startswith("pipeline_loads")
    ]
    assert [rp.stages for p in deeper for rp in p.regions if isinstance(rp, conv_tf32.ConvPlan)] == [
        shorter.stages + 1
    ]


def test_the_first_batch_undoes_the_heaviest_convolutions_bet_first(tmp_path):
    """A plan of several fp16x3 convolutions: the hedges (each convolution back to 3xTF32) come first among
    the edits, the one over the largest tensors before the first in the graph."""
    path = tmp_path / "two.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.small = nn.Conv2d(64, 40, 3, bias=False)\n"
        "        self.big = nn.Conv2d(64, 40, 3, bias=False)\n\n    def forward(self, x, y):\n"
        "        return self.small(x), self.big(y)\n\n\ndef get_inputs():\n"
        "    return [torch.randn(2, 64, 9, 9), torch.randn(2, 64, 40, 40)]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    low = prepare(capture(path))
    tuned = base_plan(low, True)
    convs = [rp for rp in tuned.regions if isinstance(rp, conv_tf32.ConvPlan)]
    assert len(convs) == 2 and all(c.f16 for c in convs)  # K = 576
    small, big = (r.rid for r in low.regions if r.rid in {c.rid for c in convs})  # graph order
    labels = [label for label, _ in legal_edits(tuned, low)][:2]
    assert labels[0].startswith(f"use_tensor_cores({big}:") and labels[1].startswith(
        f"use_tensor_cores({small}:"
    )
