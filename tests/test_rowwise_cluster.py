"""Two-pass row ops whose rows are too long for one block's shared memory (over 160 KB of fp32) but fit a
thread-block cluster's: each row spread over the cluster's blocks, each block's segment cached in its shared
memory and the statistics merged through distributed shared memory (templates/rowwise.py). Emulated against
PyTorch on the CPU (tests/cuda_emulator.py runs a cluster's blocks at once), with the cluster path checked to
be the one that ran; compiled for sm_90a by nvcc."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from cuda_emulator import build, load_model
from expert_plans import op_task, tuned, tuned_with_edit

from pipeline.candidates import make_candidate
from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.expert import plan_of
from pipeline.generate.expert.edits import legal_edits
from pipeline.generate.expert.families.rowwise import regs_for
from pipeline.generate.expert.plan import Plan
from pipeline.generate.expert.policy import analyse
from pipeline.generate.expert.render import nvcc_flags, render
from pipeline.profile.collect import dump_sass, parse_sass
from pipeline.static_check import check_launcher
from pipeline.tasks import load_module
from pipeline.types import Kind, Status

# name -> (module, what forward returns of y, input shape, blocks a cluster): rows of 176-400 KB
CASES = {
    "log_softmax_odd": ("nn.LogSoftmax(dim=-1)", "y", "2, 45001", 2),  # rows start unaligned
    "softmax_scaled": ("nn.Softmax(dim=-1)", "y * 2", "2, 100000", 4),
    # 1.2 MB rows: 150 KB a block of 8 fits no block's registers: cached in shared memory (75 KB a block of
    # 16 would fit them, but clusters of 16 ran slower than 8 however their segments were held)
    "log_softmax_wide": ("nn.LogSoftmax(dim=-1)", "y", "2, 300000", 8),
    "layer_norm_affine": ("nn.LayerNorm(50000)", "torch.relu(y)", "2, 50000", 2),
    "rms_norm": ("nn.RMSNorm(41000)", "y", "3, 41000", 2),
    "instance_norm": ("nn.InstanceNorm2d(3, affine=True)", "y", "2, 3, 210, 210", 2),
    "group_norm_spanning": ("nn.GroupNorm(2, 6)", "y", "2, 6, 121, 121", 2),  # segments cross channels
    # channels of whole vectors: the segments (crossing channels) held in registers
    "group_norm_regs": ("nn.GroupNorm(2, 6)", "y", "2, 6, 120, 120", 2),
    # 16-bit rows: 8 elements a vector, half the vectors in flight (all of them spilled at 1024 threads)
    "layer_norm_bf16": ("nn.LayerNorm(60000).to(torch.bfloat16)", "y", "2, 60000", 2, "bfloat16"),
    # two cluster regions in one source: the cluster helpers are emitted once
    "two_regions": (
        "nn.InstanceNorm2d(3)",
        "y, torch.log_softmax(x.flatten(2), dim=-1)",
        "2, 3, 150, 301",
        2,
    ),
}


def _task(folder: Path, name: str) -> Path:
    mod, ret, shape, _, *dtype = CASES[name]
    return op_task(folder, name, mod, ret, shape, *dtype)


# Rows of whole, aligned vectors (and channels of them): the tuned plan's blocks hold their segments in
# registers; the others fall back to the segment cached in shared memory.
# Segments too large for a block's registers at the cluster the tuned plan takes (8 at most): no regs in its plan.
SHARED_TUNED = {"log_softmax_wide"}
IN_REGISTERS = {"group_norm_regs", "instance_norm", "layer_norm_affine", "layer_norm_bf16", "rms_norm",
                "softmax_scaled"}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("form", ["tuned", "shared"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_long_rows_are_spread_over_a_cluster_and_match_pytorch(tmp_path, name, form):
    path = _task(tmp_path, name)
    module = load_module(path)
    torch.manual_seed(0)
    ref = module.Model()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
    x = module.get_inputs()[0]
    with torch.no_grad():
        want = ref(x)
    # "shared": reduce_registers takes the segments out of the registers, into shared memory
    if form == "shared" and name in SHARED_TUNED:
        pytest.skip("the tuned plan caches its segments in shared memory already")
    cand = tuned(path) if form == "tuned" else tuned_with_edit(path, "reduce_registers")
    assert f'"cluster":{CASES[name][3]}' in cand.source.splitlines()[0]
    assert ('"regs"' in cand.source.splitlines()[0]) == (form == "tuned" and name not in SHARED_TUNED)
    u = 4 if len(CASES[name]) > 4 else 8  # vectors in flight a thread: fewer of 16-bit ones
    assert f'"unroll":{u}' in cand.source.splitlines()[0] and f"t_[{u}]" in cand.source  # batched loads
    report = check_launcher(cand.launcher)
    assert report.ok and report.kind == Kind.CUSTOM, (report.library_ops, report.violations)
    kernels = build(cand.source, tmp_path)
    model = load_model(cand.launcher, kernels, sms=4)()
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():
        got = model(x)
    names = [launch[0] for launch in kernels.launches]
    assert names and all("_cluster_" in n for n in names), names
    in_regs = form == "tuned" and name in IN_REGISTERS
    assert all(("_cluster_regs_" in n) == in_regs for n in names), (names, in_regs)
    grids = {launch[1][0] for launch in kernels.launches}
    assert all(g % CASES[name][3] == 0 for g in grids), grids  # whole clusters
    tol = 2e-2 if len(CASES[name]) > 4 else 1e-4  # a bf16 output: one rounding of 2^-8 relative
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["log_softmax_odd", "softmax_scaled"])
def test_cluster_softmax_statistics_keep_minus_infinity_and_nan_as_pytorch_does(tmp_path, name):
    """Softmax's max and sum are taken a batch of loads at a time (segment in shared memory: the odd row)
    or from the segment's max (in registers): a block whose whole segment is -inf (its max stays -inf),
    -inf scattered through a row, and NaN, which spreads over its row."""
    path = _task(tmp_path, name)
    x = load_module(path).get_inputs()[0]
    x[0, :30000] = float("-inf")  # over the first block's whole segment
    x[1, 100:20000:7] = float("-inf")
    x[1, 40000] = float("nan")
    want = torch.softmax(x, dim=-1) * 2 if name == "softmax_scaled" else torch.log_softmax(x, dim=-1)
    cand = tuned(path)
    kernels = build(cand.source, tmp_path)
    got = load_model(cand.launcher, kernels, sms=4)()(x)
    assert {launch[0] for launch in kernels.launches} == {
        "kp_log_softmax_cluster_v4" if name == "log_softmax_odd" else "kp_softmax_cluster_regs_v4"
    }
    assert got[1].isnan().all() and not got[0].isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


def test_kernelbench_long_norms_hold_their_segments_in_registers(tmp_path):
    """Level 1's InstanceNorm (1 MB rows, 8 blocks), L1 and L2 norms (256 KB rows, 2 blocks): each block's
    128 KB segment in registers; LogSoftmax's 1.5 MB rows over 8 blocks, 192 KB each in shared memory (16
    blocks would fit them in registers, but ran slower); compiled for sm_90a without spills."""
    ops = {  # name -> (forward's expression of x, its shape): KernelBench level 1's 34, 38, 39 and 24
        "instance": ("F.instance_norm(x)", "112, 64, 512, 512"),
        "l1": ("x / torch.sum(torch.abs(x), dim=1, keepdim=True)", "32768, 65536"),
        "l2": ("x / torch.norm(x, p=2, dim=1, keepdim=True)", "32768, 65536"),
        "log_softmax": ("torch.log_softmax(x, dim=1)", "4096, 393216"),
    }
    paths = []
    for name, (expr, shape) in ops.items():  # only planned and compiled: nothing of this size is allocated
        paths.append(tmp_path / f"{name}.py")
        paths[-1].write_text(
            "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\nclass Model(nn.Module):\n"
            f"    def forward(self, x):\n        return {expr}\n\n\ndef get_inputs():\n    return [torch.randn({shape})]\n\n\n"
            "def get_init_inputs():\n    return []\n"
        )
    cands = [tuned(p) for p in paths]
    plans = [plan_of(c.source).regions[0] for c in cands]
    # an FMA an element written (instance norm): 256 threads; a division (L1), a fused epilogue (L2's) or an exp
    # an element in the statistics (log-softmax): 1024
    assert [(rp.cluster, rp.threads, rp.regs) for rp in plans] == [(8, 256, 32), (2, 1024, 8), (2, 1024, 8),
                                                                    (8, 1024, 0)]  # fmt: skip
    for c, rp in zip(cands, plans, strict=True):
        call = (
            f"kp_{rp.rid}_cluster_regs_v4(cgrid, ({rp.threads},)"
            if rp.regs
            else f"kp_{rp.rid}_cluster_v4(cgrid,"
        )
        assert call in c.launcher and (rp.regs or f"cblock = min({rp.threads}, " in c.launcher)
        assert "kernels.active_clusters(" not in c.launcher  # 8 is every Hopper's: no need to ask
    for b, rp in zip(
        compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a")), plans, strict=True
    ):
        assert b.status == Status.OK and not b.log, b.log
        regs = [r for r in b.resources if "_cluster_regs_" in r.name]
        assert len(regs) == bool(rp.regs) and all(r.spill_stores == r.spill_loads == 0 for r in regs), regs


def _cluster_of_16(path: Path, in_regs: bool):
    """The tuned plan's row over a cluster of 16 (a search's edit may take it there), its segments in
    registers or in shared memory."""
    base = tuned(path)
    low, why = analyse(path)
    assert low is not None, why
    (rp,) = plan_of(base.source).regions
    (r,) = [r for r in low.regions if r.rid == rp.rid]
    rp = dataclasses.replace(rp, cluster=16, regs=0)
    if in_regs:
        rp = dataclasses.replace(rp, regs=regs_for(rp, r, low))
        assert rp.regs
    source, launcher = render(low, Plan((rp,)))
    return make_candidate(base.task_id, source, launcher, nvcc_flags(Plan((rp,))), parent=None, edit="16")


@pytest.mark.parametrize("form", ["tuned", "shared"])
def test_without_room_for_a_cluster_of_16_a_row_takes_a_block(tmp_path, form):
    """A GPU whose GPCs cannot hold 16 blocks of the kernel (the runtime's active_clusters says 0): the
    launcher asks before each cluster kernel it could launch, then runs the block per row, still right."""
    path = _task(tmp_path, "log_softmax_wide")
    x = load_module(path).get_inputs()[0]
    cand = _cluster_of_16(path, in_regs=form == "tuned")
    kernels = build(cand.source, tmp_path)
    kernels.gpcs = 0
    got = load_model(cand.launcher, kernels, sms=4)()(x)
    names = [launch[0] for launch in kernels.launches]
    assert names and not any("_cluster_" in n for n in names), names
    asked = ["kp_log_softmax_cluster_v4", "kp_log_softmax_cluster_v1"]
    assert kernels.asked == (["kp_log_softmax_cluster_regs_v4"] if form == "tuned" else []) + asked
    torch.testing.assert_close(got, torch.log_softmax(x, dim=-1), rtol=1e-4, atol=1e-4)


def test_a_row_one_block_can_cache_takes_no_cluster(tmp_path):
    """Below 160 KB a row keeps its block (registers or shared memory); a cluster only costs barriers."""
    path = tmp_path / "short.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
        "        return torch.log_softmax(x, dim=-1)\n\n\ndef get_inputs():\n    return [torch.randn(4, 40000)]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    assert '"cluster"' not in tuned(path).source.splitlines()[0]
    assert '"smem_row":true' in tuned_with_edit(path, "tile_shared_memory").source.splitlines()[0]


def test_cluster_kernels_compile_for_sm90a_without_spills(tmp_path):
    cands = [tuned(_task(tmp_path, name)) for name in sorted(CASES)]
    for name, b in zip(sorted(CASES), compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a")),
                       strict=True):  # fmt: skip
        assert b.status == Status.OK and not b.log, b.log
        cluster = [r for r in b.resources if "_cluster_" in r.name]
        assert len(cluster) >= 2 and all(r.spill_stores == 0 for r in cluster), cluster
        # the fp32 vector kernels cache each loaded vector with one 16-byte shared store (NVVM split the
        # float4 store into STS.64 pairs until it went through PTX), 8 of them in flight a thread
        sass = parse_sass(dump_sass(b.cubin_path) or "")
        if len(CASES[name]) == 4 and name != "two_regions":
            (vec,) = [k for k in sass if k.endswith("_cluster_v4")]
            assert sass[vec].opcodes.get("STS.128", 0) >= 8, (name, sass[vec].opcodes)


def test_the_search_can_leave_the_cluster_for_a_block_per_row(tmp_path):
    """increase_occupancy on a cluster plan drops the cluster: a block per row, several an SM, whose
    launcher then takes no cluster kernel (on the H200 the cluster lost to it on LogSoftmax's 1.5 MB rows)."""
    path = _task(tmp_path, "log_softmax_odd")
    left = tuned_with_edit(path, "increase_occupancy")
    assert '"cluster"' in tuned(path).source.splitlines()[0]
    assert '"cluster"' not in left.source.splitlines()[0] and "_cluster_v" not in left.launcher


@pytest.mark.parametrize("name", ["log_softmax_odd", "layer_norm_affine"])
def test_a_persistent_cluster_plan_launches_the_clusters_the_gpu_holds_each_looping_over_rows(tmp_path, name):
    """persistent_grid on a cluster plan: as many clusters as the runtime says fit at once (the emulator's one
    GPC: 8 clusters of 2), each taking rows in turn, where the plan before launched a cluster a row; the
    other plans' launchers are unchanged (no runtime query)."""
    mod, ret, _, blocks, *_ = CASES[name]
    path = op_task(tmp_path, name, mod, ret, f"20, {CASES[name][2].split(', ')[-1]}")
    ref = load_module(path).Model()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
    x = load_module(path).get_inputs()[0]
    cand = tuned_with_edit(path, "persistent_grid")
    assert '"persistent"' in cand.source.splitlines()[0] and "kernels.active_clusters(" in cand.launcher
    assert "kernels.active_clusters(" not in tuned(path).launcher
    kernels = build(cand.source, tmp_path)
    kernels.gpcs = 1
    model = load_model(cand.launcher, kernels, sms=4)()
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():
        got, want = model(x), ref(x)
    grids = [launch[1][0] for launch in kernels.launches if "_cluster" in launch[0]]
    assert grids == [blocks * (16 // blocks)], kernels.launches  # 8 clusters for 20 rows
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_every_edit_of_a_register_held_segment_renders_and_matches_pytorch(tmp_path):
    """The search's moves from a cluster whose blocks hold their segments in registers: a cluster of twice
    the blocks (the segment re-divided), a resized block (re-divided or cached), the segment in shared memory
    (reduce_registers), a block per row (increase_occupancy); each launches what its plan says."""
    path = _task(tmp_path, "layer_norm_affine")
    low, why = analyse(path)
    assert low is not None, why
    base = tuned(path)
    plan = plan_of(base.source)
    x = load_module(path).get_inputs()[0]
    ref = load_module(path).Model()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
        want = ref(x)
    seen = set()
    for label, edited in legal_edits(plan, low):
        rp = edited.regions[0]
        if rp == plan.regions[0] or label.split("(")[0] in seen:
            continue
        seen.add(label.split("(")[0])
        source, launcher = render(low, edited)
        assert check_launcher(launcher).ok, label
        kernels = build(source, tmp_path)
        model = load_model(launcher, kernels, sms=4)()
        model.load_state_dict(ref.state_dict())
        with torch.no_grad():
            got = model(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=label)
        names = {launch[0] for launch in kernels.launches}
        in_regs = bool(rp.cluster and rp.regs)
        assert any("_cluster_regs_" in n for n in names) == in_regs, (label, rp, names)
    assert {"tile_shared_memory", "reduce_registers", "increase_occupancy", "resize_grid"} <= seen, seen
