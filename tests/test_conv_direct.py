"""Grouped and depthwise convolutions on the CUDA cores (families/conv_direct.py, templates/conv_direct.py)
on the CPU: which convolutions the family takes, its candidates run by the CUDA emulator against PyTorch's
convolution, and its kernels compiled for sm_90a without spills or warnings (tests/test_gpu_expert.py runs
them on the GPU)."""

from __future__ import annotations

import pytest
import torch
from cuda_emulator import build, load_model
from test_conv import conv_region, conv_task

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, capture, plan_of, supports
from pipeline.generate.expert.edits import base_plan
from pipeline.generate.expert.families import conv_direct, conv_tf32
from pipeline.generate.expert.plan import Plan
from pipeline.generate.expert.render import prepare, render
from pipeline.generate.expert.templates import conv_direct as direct_template
from pipeline.generate.expert.templates import conv_tf32 as conv_template
from pipeline.tasks import load_module, probe
from pipeline.types import Status

GEOMETRIES = {
    "depthwise": dict(cin=8, cout=8, g=8, k=3, s=2, p=1, size=(13, 11)),
    "depthwise_x2": dict(cin=6, cout=12, g=6, k=(3, 5), p=(1, 2), dl=(2, 1), size=(9, 14)),  # a multiplier
    "grouped_1d": dict(d=1, cin=12, cout=9, g=3, k=4, s=3, p=2, size=(29,)),
    "grouped_3d": dict(d=3, cin=4, cout=6, g=2, k=2, p=1, size=(3, 5, 4)),
    "depthwise_f16": dict(cin=16, cout=16, g=16, k=3, p=1, size=(7, 9), dt="float16"),
    # transposed (weight (C_in, C_out / groups, taps)): strided, padded, dilated, with an output padding
    "transposed_2d": dict(cin=8, cout=6, g=2, k=(3, 4), s=(2, 3), p=(1, 2), dl=(2, 1), op=1, size=(7, 9)),
    "transposed_1d": dict(d=1, cin=6, cout=9, g=3, k=5, s=3, p=2, dl=2, op=0, size=(11,)),
    "transposed_depthwise_3d": dict(d=3, cin=4, cout=4, g=4, k=3, s=2, p=1, op=1, size=(3, 4, 5)),
    # 8 and 16 output channels a group: a thread takes 8 or 16 of them (each input read once for them all)
    "grouped_transposed_3d_c8": dict(
        d=3, cin=16, cout=16, g=2, k=(3, 5, 7), s=2, p=(1, 2, 3), op=1, size=(3, 4, 6)
    ),
    "grouped_2d_c16": dict(cin=8, cout=32, g=2, k=3, p=1, size=(9, 11)),
    "grouped_f16_c8": dict(cin=8, cout=16, g=2, k=3, s=2, p=1, size=(9, 12), dt="float16"),  # 16-bit vectors
    # ungrouped, strided along the row, few products an output (ConvForm.sparse): KernelBench's 81 and 79
    "sparse_transposed_2d": dict(cin=6, cout=5, k=3, s=5, p=1, dl=2, op=0, size=(4, 6)),
    "sparse_transposed_1d": dict(d=1, cin=8, cout=6, k=3, s=2, p=1, dl=2, op=0, size=(13,)),
}


def _ours(path):
    """The proposals whose plan puts the convolution in our direct kernel."""
    t = probe(path)
    props = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 3)
    return [
        p.candidate
        for p in props
        if p.candidate and any(rp.TAG == "direct_conv" for rp in plan_of(p.candidate.source).regions)
    ]


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_the_family_takes_grouped_and_sparse_transposed_convolutions(tmp_path, name):
    r, low = conv_region(conv_task(tmp_path, "c", **GEOMETRIES[name]))
    assert conv_direct.FAMILY.claims(r, low)
    assert not conv_tf32.FAMILY.claims(r, low)  # the implicit GEMM refuses groups, and sparse transposed ones


def test_a_thread_takes_as_many_channels_of_its_group_as_divide_it_and_fit(tmp_path):
    """16 output channels a group: the tuned plan takes 8 a thread with 2 outputs each; the edits move the
    channels (more_parallelism halves them first) and never past the group or MAX_ACC (32 accumulators)."""
    r, low = conv_region(conv_task(tmp_path, "c", **GEOMETRIES["grouped_2d_c16"]))
    rp = conv_direct.first(r, low, True)
    assert (rp.outs, rp.chans) == (2, 8)
    edits = conv_direct.FAMILY.edits

    def moves(edit, rp):
        return [(p.regions[0].outs, p.regions[0].chans) for _, p in edits[edit](Plan((rp,)), rp, r, low)]

    assert moves("coarsen_threads", rp) == [(4, 8), (2, 16), (2, 8)]  # the last 2 rows a thread
    assert moves("more_parallelism", rp) == [(2, 4), (1, 8)]
    four = conv_direct.DirectPlan(r.rid, outs=4, chans=8)
    assert moves("coarsen_threads", four) == []  # 8 x 8 or 4 x 16: 64 accumulators
    r3, low3 = conv_region(conv_task(tmp_path, "g", **GEOMETRIES["transposed_1d"]))  # 3 channels a group
    assert (conv_direct.first(r3, low3, True).chans, conv_direct.first(r3, low3, True).outs) == (1, 4)
    assert moves("coarsen_threads", conv_direct.DirectPlan(r.rid, outs=8, chans=4)) == []


def test_a_narrow_ungrouped_convolution_goes_to_the_direct_kernel(tmp_path, monkeypatch):
    """Few output channels (the GEMM's N) or few products an output (its K): the routing constants move an
    ungrouped convolution from the implicit GEMM to the direct kernel, and the emulated candidate is right."""
    kw = dict(cin=3, cout=16, k=3, p=1, size=(9, 14))
    r, low = conv_region(conv_task(tmp_path, "c", **kw))
    assert conv_direct.FAMILY.claims(r, low) and not conv_tf32.FAMILY.claims(r, low)  # the defaults
    monkeypatch.setattr(conv_template, "NARROW_COUT", 0)
    monkeypatch.setattr(conv_template, "NARROW_K", 0)
    monkeypatch.setattr(conv_template, "NARROW_K_TAPS", 0)
    assert conv_tf32.FAMILY.claims(r, low) and not conv_direct.FAMILY.claims(r, low)
    monkeypatch.setattr(conv_template, "NARROW_K_TAPS", 27)  # 3 channels x 3 x 3 taps
    assert conv_direct.FAMILY.claims(r, low) and not conv_tf32.FAMILY.claims(r, low)
    monkeypatch.setattr(conv_template, "NARROW_K_TAPS", 26)
    assert conv_tf32.FAMILY.claims(r, low)
    # one tap (pointwise): NARROW_K bounds it, NARROW_K_TAPS not
    rp, lowp = conv_region(conv_task(tmp_path, "p", cin=48, cout=64, k=1, p=0, size=(9, 14)))
    monkeypatch.setattr(conv_template, "NARROW_K_TAPS", 96)
    assert conv_tf32.FAMILY.claims(rp, lowp) and not conv_direct.FAMILY.claims(rp, lowp)
    monkeypatch.setattr(conv_template, "NARROW_K", 48)
    assert conv_direct.FAMILY.claims(rp, lowp)
    monkeypatch.setattr(conv_template, "NARROW_K", 32)
    # several taps: K and output channels x K bound it (the defaults: 2-D 8 -> 64 direct, 3-D 3 -> 64 not)
    for kw2, direct in ((dict(cin=8, cout=64), True), (dict(cin=3, cout=64, d=3, size=(5, 6, 7)), False)):
        rt, lowt = conv_region(conv_task(tmp_path, "t", k=3, **kw2))
        assert (
            conv_direct.FAMILY.claims(rt, lowt) is direct and conv_tf32.FAMILY.claims(rt, lowt) is not direct
        )
    monkeypatch.setattr(conv_template, "NARROW_PRODUCTS", 64 * 81)
    assert conv_direct.FAMILY.claims(rt, lowt)
    monkeypatch.setattr(conv_template, "NARROW_K_TAPS", 0)
    monkeypatch.setattr(conv_template, "NARROW_COUT", 16)
    assert conv_direct.FAMILY.claims(r, low) and not conv_tf32.FAMILY.claims(r, low)
    path = conv_task(tmp_path, "n", batch=2, **kw)
    (cand,) = [c for c in _ours(path) if '"chans":8' in c.source.splitlines()[0]][:1]
    module = load_module(path)
    torch.manual_seed(0)
    ref = module.Model()
    x = module.get_inputs()[0]
    kernels = build(cand.source, tmp_path)
    model = load_model(cand.launcher, kernels)()
    model.load_state_dict(ref.state_dict(), strict=False)
    with torch.no_grad():
        want, got = ref.double()(x.double()), model(x)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6
    assert any(n.endswith("_dconv") for n, *_ in kernels.launches)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        (dict(cin=11, cout=24), "ungrouped"),  # K 99: above the tap-wise narrow bound
        (dict(cin=64, cout=24, s=2, op=1), "ungrouped"),  # transposed, 64 x 1.5 x 1.5 products an output
        (dict(cin=8, cout=8, g=8, dt="float64"), "fp32, fp16 or bf16"),
    ],
)
def test_what_the_direct_kernel_does_not_take_says_why(tmp_path, kw, why):
    r, low = conv_region(conv_task(tmp_path, "c", **kw))
    got = conv_direct.form(r, low)
    assert isinstance(got, str) and why in got, got
    assert not conv_direct.FAMILY.claims(r, low)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_emulated_direct_convolutions_match_pytorch(tmp_path, name):
    """The tuned candidate and its coarser and finer edits, run on the emulator, against a float64 reference
    (the bias and the chain after the convolution run as the plan's other kernels)."""
    kw = GEOMETRIES[name]
    path = conv_task(tmp_path, "c", batch=2, **kw)
    cands = _ours(path)
    assert cands, "no proposal takes the direct kernel"
    ref = reference(path)
    for cand in cands:
        rel = emulated_error(cand.source, cand.launcher, tmp_path, ref)
        assert rel < (2e-3 if ref[1].dtype == torch.float16 else 1e-6), (cand.edit, rel)


def reference(path) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The task's model seeded: its parameters (for a candidate), an input, its output in its own dtype
    and in float64."""
    module = load_module(path)
    torch.manual_seed(0)
    ref = module.Model()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    x = module.get_inputs()[0]
    with torch.no_grad():
        native = ref(x)  # its dtype: a chain's fp32 parameter promotes a 16-bit convolution's output
        want = ref.double()(x.double())
    return state, x, native, want


def emulated_error(source: str, launcher: str, tmp_path, ref) -> float:
    """A candidate run on the emulator against `reference`'s: the relative error of its output (its shape and
    dtype eager's), the direct kernel launched."""
    state, x, native, want = ref
    kernels = build(source, tmp_path)
    model = load_model(launcher, kernels)()
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        got = model(x)
    assert got.shape == want.shape and got.dtype == native.dtype
    assert any(n.endswith("_dconv") for n, *_ in kernels.launches)
    return ((got.double() - want).norm() / want.norm()).item()


ORDERS = [
    (name, chans, inner)
    for name in ("grouped_transposed_3d_c8", "grouped_2d_c16", "transposed_2d")
    for chans, inner in ((1, False), (1, True), (4, False), (4, True), (8, True))
    if (GEOMETRIES[name]["cout"] // GEOMETRIES[name].get("g", 1)) % chans == 0
]


@pytest.mark.parametrize(("name", "chans", "inner"), ORDERS)
def test_both_loop_orders_and_weight_layouts_match_pytorch(tmp_path, name, chans, inner):
    """Input channels outermost or innermost, the weight as given (scalar loads) or re-laid channel-inner
    (vector loads, 4 channels or more), on the emulator against a float64 reference."""
    kw = GEOMETRIES[name]
    path = conv_task(tmp_path, "c", batch=2, bias=False, expr="self.conv(x)", **kw)
    low = prepare(capture(path))
    (rid,) = [r.rid for r in low.regions if conv_direct.FAMILY.claims(r, low)]
    plan = Plan((conv_direct.DirectPlan(rid, outs=2, chans=chans, ci_inner=inner),))
    source, launcher = render(low, plan)
    assert ("kp_" + rid + "_dw") in source if chans >= 4 else "_dw(" not in source
    module = load_module(path)
    torch.manual_seed(0)
    ref = module.Model()
    x = module.get_inputs()[0]
    kernels = build(source, tmp_path)
    model = load_model(launcher, kernels)()
    model.load_state_dict(ref.state_dict(), strict=False)
    with torch.no_grad():
        want, got = ref.double()(x.double()), model(x)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6


STAGED = {  # several segments a row at 2 outputs a thread (1-D: 602 columns; 2-D: 348, stride 5 along it)
    "staged_1d": dict(d=1, cin=8, cout=16, k=3, s=2, p=1, dl=2, op=1, size=(300,)),
    "staged_2d": dict(cin=4, cout=8, k=3, s=(3, 5), p=1, dl=2, op=0, size=(3, 70)),
}


@pytest.mark.parametrize("name", sorted(STAGED))
@pytest.mark.parametrize("outs", [2, 4])
def test_staged_stores_match_the_unstaged_ones_and_pytorch(tmp_path, name, outs):
    """A strided transposed convolution's stores through shared memory (a block a segment of the row, its
    columns in order) or each thread's own, on the emulator against a float64 reference; the tuned plan
    stages them (with the chain after the convolution: test_emulated_direct_convolutions_match_pytorch's
    sparse geometries), coalesce_accesses undoes it."""
    kw = STAGED[name]
    path = conv_task(tmp_path, "c", batch=2, bias=False, expr="self.conv(x)", **kw)
    low = prepare(capture(path))
    (r,) = [r for r in low.regions if conv_direct.FAMILY.claims(r, low)]
    f = conv_direct.form(r, low)
    tuned = conv_direct.tuned_plan(r.rid, f)
    assert tuned.staged, tuned
    module = load_module(path)
    torch.manual_seed(0)
    ref = module.Model()
    x = module.get_inputs()[0]
    with torch.no_grad():
        want = ref.double()(x.double())
    for staged in (True, False):
        rp = conv_direct.DirectPlan(r.rid, outs=outs, chans=4, ci_inner=True, staged=staged)
        assert outs == 4 or direct_template.segment(f, rp) < f.out[2], direct_template.segment(f, rp)
        source, launcher = render(low, Plan((rp,)))
        assert ("__shared__ float stage[CH][SEG]" in source) == staged
        kernels = build(source, tmp_path)
        model = load_model(launcher, kernels)()
        model.load_state_dict(ref.state_dict(), strict=False)
        with torch.no_grad():
            got = model(x)
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-6, staged
    moves = [
        m.split("(")[0] + str(p.get(r.rid).staged)
        for m, p in conv_direct.FAMILY.edits["coalesce_accesses"](Plan((tuned,)), tuned, r, low)
    ]
    assert moves == ["coalesce_accessesFalse"], moves


def test_direct_convolutions_compile_for_sm90a_without_spills(tmp_path):
    cands = [
        c for name in sorted(GEOMETRIES) for c in _ours(conv_task(tmp_path, name, **GEOMETRIES[name]))[:1]
    ]
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for b in builds:
        assert b.status == Status.OK and not b.log, b.log  # not even a warning
        (k,) = [r for r in b.resources if r.name.endswith("_dconv")]
        assert k.spill_stores == 0, k


def test_a_lone_grouped_convolution_is_ours_in_the_plain_plan_too(tmp_path):
    """Nothing else to compute (no bias, no chain after it): the plain plan takes our kernel too, else the
    expert would have nothing to write for KernelBench's lone depthwise convolutions."""
    path = conv_task(tmp_path, "c", cin=8, cout=8, g=8, bias=False, expr="self.conv(x)")
    ok, why = supports(path)
    assert ok, why
    low = prepare(capture(path))
    assert [rp.TAG for rp in base_plan(low, False).regions] == ["direct_conv"]
    with_bias = prepare(capture(conv_task(tmp_path, "b", cin=8, cout=8, g=8, expr="self.conv(x)")))
    assert "direct_conv" not in [rp.TAG for rp in base_plan(with_bias, False).regions]  # cuDNN, bias ours
