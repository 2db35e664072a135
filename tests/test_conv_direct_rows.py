"""A column of output rows a thread in the direct convolution (DirectPlan.rows, templates/conv_direct.py) on the
CPU: which convolutions take it and the edits that propose it, its kernels run by the CUDA emulator against
PyTorch's convolution (the last column of rows partial), and KernelBench's depthwise 3 x 3 (level 1, 84)
compiled for sm_90a without spills, each input row loaded once a thread (tests/test_gpu_expert.py runs the
family on the GPU)."""

from __future__ import annotations

import dataclasses

import pytest
from test_conv import conv_region, conv_task
from test_conv_direct import emulated_error, reference

from pipeline.candidates import make_candidate
from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.expert import capture
from pipeline.generate.expert.edits import base_plan
from pipeline.generate.expert.families import conv_direct
from pipeline.generate.expert.families.base import RenderError
from pipeline.generate.expert.plan import Plan
from pipeline.generate.expert.render import nvcc_flags, prepare, render
from pipeline.generate.expert.templates import conv_direct as template
from pipeline.profile.collect import dump_sass, find_cuobjdump, parse_sass
from pipeline.types import Status

# Every output height odd (11, 13 or 9): the last column of 2, 4 or 8 rows is partial. With the default
# expression the bias and a chain after the convolution are fused on its stores.
GEOMETRIES = {
    "depthwise_3x3": dict(cin=4, cout=4, g=4, k=3, p=0, size=(13, 19)),
    "depthwise_dilated": dict(cin=4, cout=4, g=4, k=3, p=1, dl=2, size=(15, 12)),  # rows 2 apart in a window
    "depthwise_stride2": dict(cin=4, cout=4, g=4, k=3, s=2, p=1, size=(21, 10)),  # windows overlap by a row
    "depthwise_5x3_f16": dict(cin=4, cout=4, g=4, k=(5, 3), p=(2, 1), size=(11, 9), dt="float16"),
    "depthwise_x2_bf16": dict(cin=4, cout=8, g=4, k=3, p=1, size=(9, 12), dt="bfloat16"),  # a multiplier
    "grouped": dict(cin=8, cout=16, g=2, k=3, p=1, size=(9, 11)),
    "grouped_3d": dict(d=3, cin=4, cout=8, g=2, k=3, p=1, size=(3, 7, 5)),
}
TOLERANCE = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}


def _plans(name: str, rp: conv_direct.DirectPlan) -> list[conv_direct.DirectPlan]:
    """rows 2, 4 and 8 within MAX_ACC accumulators; a grouped one also with several channels a thread, both
    loop orders, the weight as given (2 channels) and re-laid channel-inner (4)."""
    plans = [dataclasses.replace(rp, rows=ro, outs=2, chans=1, ci_inner=False) for ro in (2, 4, 8)]
    if name.startswith("grouped"):
        plans += [
            dataclasses.replace(rp, rows=4, outs=2, chans=4, ci_inner=True),
            dataclasses.replace(rp, rows=2, outs=4, chans=4, ci_inner=False),
            dataclasses.replace(rp, rows=8, outs=2, chans=2, ci_inner=True),
        ]
    for p in plans:
        assert p.rows * p.outs * p.chans <= conv_direct.MAX_ACC, p
    return plans


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_a_column_of_output_rows_matches_pytorch(tmp_path, name):
    """The tuned plan (the chain after the convolution fused on its stores) with 2, 4 and 8 output rows a
    thread, run on the emulator against a float64 reference."""
    kw = GEOMETRIES[name]
    path = conv_task(tmp_path, "c", batch=2, **kw)
    low = prepare(capture(path))
    tuned = base_plan(low, True)
    (rp,) = [q for q in tuned.regions if isinstance(q, conv_direct.DirectPlan)]
    ref = reference(path)
    assert ref[3].shape[-2] % 2 == 1, ref[3].shape  # the last column partial
    for q in _plans(name, rp):
        source, launcher = render(low, tuned.replace(q))
        assert f"constexpr int RO = {q.rows}," in source
        rel = emulated_error(source, launcher, tmp_path, ref)
        assert rel < TOLERANCE[kw.get("dt", "float32")], (q, rel)


def _moves(edit: str, rp: conv_direct.DirectPlan, r, low) -> list[tuple[int, int, int]]:
    return [
        (p.regions[0].rows, p.regions[0].outs, p.regions[0].chans)
        for _, p in conv_direct.FAMILY.edits[edit](Plan((rp,)), rp, r, low)
    ]


def test_coarsen_threads_doubles_the_rows_where_windows_overlap_vertically(tmp_path):
    """After the outputs of a row and the channels: rows x2 up to MAX_ROWS, within MAX_ACC accumulators;
    more_parallelism halves the rows first. None where a stride along H reaches past the window (no input
    row shared), for a transposed convolution (it gathers) or a 1-D one."""
    r, low = conv_region(conv_task(tmp_path, "c", **GEOMETRIES["depthwise_3x3"]))
    rp = conv_direct.DirectPlan(r.rid)
    assert (rp.rows, rp.outs, rp.chans) == (1, 4, 1)
    assert _moves("coarsen_threads", rp, r, low) == [(1, 8, 1), (2, 4, 1)]
    assert _moves("coarsen_threads", dataclasses.replace(rp, rows=4), r, low) == [(4, 8, 1), (8, 4, 1)]
    assert _moves("coarsen_threads", dataclasses.replace(rp, rows=4, outs=8), r, low) == []  # 64 accumulators
    assert _moves("coarsen_threads", dataclasses.replace(rp, rows=8, outs=2), r, low) == [(8, 4, 1)]
    assert _moves("more_parallelism", dataclasses.replace(rp, rows=4, outs=8), r, low) == [
        (2, 8, 1),
        (4, 4, 1),
    ]
    g, lowg = conv_region(conv_task(tmp_path, "g", **GEOMETRIES["grouped"]))  # 8 channels a group
    gp = conv_direct.DirectPlan(g.rid, outs=2, chans=8)
    assert _moves("coarsen_threads", gp, g, lowg) == [(1, 4, 8), (2, 2, 8)]
    assert _moves("coarsen_threads", dataclasses.replace(gp, rows=2), g, lowg) == []  # 2 x 2 x 8: 32 already
    assert _moves("coarsen_threads", dataclasses.replace(gp, chans=4, rows=2), g, lowg) == [
        (2, 4, 4),
        (2, 2, 8),
        (4, 2, 4),
    ]
    for kw in (
        dict(cin=4, cout=4, g=4, k=2, s=2, p=0, size=(12, 10)),  # windows side by side
        dict(cin=4, cout=4, g=4, k=3, s=2, p=1, op=1, size=(7, 9)),  # transposed
        dict(d=1, cin=4, cout=4, g=4, k=3, p=1, size=(29,)),
    ):
        rn, lown = conv_region(conv_task(tmp_path, "n", **kw))
        assert conv_direct.FAMILY.claims(rn, lown)
        rows = [m for m in _moves("coarsen_threads", conv_direct.DirectPlan(rn.rid), rn, lown) if m[0] > 1]
        assert rows == [], kw


def test_a_column_of_rows_where_windows_share_no_row_is_refused(tmp_path):
    """A plan given rows where they do not apply (a transposed convolution) does not render: the template
    says why, not a kernel that computes one row of each column."""
    path = conv_task(tmp_path, "t", cin=4, cout=4, g=4, k=3, s=2, p=1, op=1, size=(7, 9), expr="self.conv(x)")
    low = prepare(capture(path))
    (r,) = [r for r in low.regions if conv_direct.FAMILY.claims(r, low)]
    f = conv_direct.form(r, low)
    assert "share no input row" in template.why_no_rows(f, conv_direct.DirectPlan(r.rid, rows=2))
    with pytest.raises((ValueError, RenderError), match="share no input row"):
        render(low, Plan((conv_direct.DirectPlan(r.rid, rows=2),)))


# KernelBench level 1, 84: depthwise 3 x 3, stride 1, no padding, (N, 128, 256, 512) fp32
KB84 = dict(cin=128, cout=128, g=128, k=3, p=0, size=(256, 512), batch=1, bias=False, expr="self.conv(x)")


def test_columns_of_rows_compile_for_sm90a_without_spills_and_load_each_input_row_once(tmp_path):
    """KernelBench's depthwise 3 x 3 with rows 1, 4 (8 outputs of a row) and 8 (4 of a row), and each
    geometry above with 4 rows at a realistic size, for sm_90a: no spills nor warnings (ptxas spilled one
    register of the dilated one at its emulated 15 x 12); in KernelBench's SASS at most one load a thread of
    each input its column's windows read (T rows x KW taps x OUTS columns) besides the KH x KW weights,
    where a thread of one output row loaded KH rows of them."""
    path = conv_task(tmp_path, "kb84", **KB84)
    low = prepare(capture(path))
    (r,) = [r for r in low.regions if conv_direct.FAMILY.claims(r, low)]
    f = conv_direct.form(r, low)
    plans = [conv_direct.DirectPlan(r.rid, outs=o, rows=ro) for ro, o in ((1, 8), (4, 8), (8, 4))]
    cands = []
    for rp in plans:
        source, launcher = render(low, Plan((rp,)))
        cands.append(make_candidate("kb84", source, launcher, nvcc_flags(Plan((rp,)))))
    for name, kw in sorted(GEOMETRIES.items()):
        size = (9, 61, 50) if kw.get("d") == 3 else (61, 250)
        lowg = prepare(capture(conv_task(tmp_path, name, **{**kw, "size": size})))
        tuned = base_plan(lowg, True)
        (rp,) = [q for q in tuned.regions if isinstance(q, conv_direct.DirectPlan)]
        plan = tuned.replace(dataclasses.replace(rp, rows=4, outs=2, chans=1, ci_inner=False))
        cands.append(make_candidate(name, *render(lowg, plan), nvcc_flags(plan)))
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status == Status.OK and not b.log, (c.task_id, b.log)  # not even a warning
        (k,) = [x for x in b.resources if x.name.endswith("_dconv")]
        assert k.spill_stores == 0 and k.spill_loads == 0, (c.task_id, k)
    if find_cuobjdump() is None:
        return
    for rp, b in zip(plans, builds, strict=False):  # KernelBench's, the first builds
        ops = parse_sass(dump_sass(b.cubin_path) or "")[f"kp_{r.rid}_dconv"].opcodes
        loads = sum(n for op, n in ops.items() if op.startswith("LDG"))
        taps = f.kernel[1] * f.kernel[2]
        assert loads <= template.rows_span(f, rp.rows) * f.kernel[2] * rp.outs + taps, (rp, loads)
