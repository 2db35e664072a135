"""Two-pass row ops whose rows no cluster can hold (over 3 MB: GroupNorm's 8 MB groups, a LayerNorm over 4M
elements): each row cut into tiles of a persistent cooperative grid, a step's tiles' statistics taken while
the last step's tiles are written, the partials merged through global memory (templates/rowwise.py,
`grid_row`). Emulated against PyTorch on the CPU with the grid forced on small rows (the emulator runs a
cooperative grid's blocks at once, a block spinning on a row's counter yielding to the others); the tuned
plans of KernelBench's shapes compiled for sm_90a."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from cuda_emulator import build, load_model
from expert_plans import op_task, tuned

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.expert import plan_of
from pipeline.generate.expert.policy import analyse
from pipeline.generate.expert.render import render
from pipeline.profile.collect import dump_sass, find_cuobjdump
from pipeline.static_check import check_launcher
from pipeline.tasks import load_module
from pipeline.types import Kind, Status

# name -> (module, forward's return of y, input shape): rows of 176-200 KB, over the 160 KB a block caches
CASES = {
    "layer_norm_affine": ("nn.LayerNorm(50000)", "torch.relu(y)", "3, 50000"),
    "log_softmax_odd": ("nn.LogSoftmax(dim=-1)", "y", "3, 45001"),  # rows (and tiles) start unaligned
    "softmax": ("nn.Softmax(dim=-1)", "y * 2", "2, 48000"),
    "rms_norm": ("nn.RMSNorm(41000)", "y", "3, 41000"),
    "group_norm_spanning": ("nn.GroupNorm(2, 6)", "y", "2, 6, 121, 121"),  # tiles cross channels
    "instance_norm": ("nn.InstanceNorm2d(3, affine=True)", "y", "2, 3, 210, 210"),
}


def _task(folder: Path, name: str) -> Path:
    return op_task(folder, name, *CASES[name])


def _grid(path: Path, **knobs):
    """The tuned plan with its row op moved onto the cooperative grid (what the tuned plan takes over 3 MB),
    `knobs` changed besides."""
    low, why = analyse(path)
    assert low is not None, why
    plan = plan_of(tuned(path).source)
    rp = next(r for r in plan.regions if r.TAG == "row")
    forced = dataclasses.replace(
        rp, cluster=0, regs=0, grid_row=True, persistent=2, threads=256, unroll=8, **knobs
    )
    plan = dataclasses.replace(plan, regions=tuple(forced if r is rp else r for r in plan.regions))
    return render(low, plan)


def _run(tmp_path, name: str, x: torch.Tensor, blocks_per_sm: int = 2, **knobs):
    path = _task(tmp_path, name)
    ref = load_module(path).Model()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
        want = ref(x)
    source, launcher = _grid(path, **knobs)
    report = check_launcher(launcher)
    assert report.ok and report.kind == Kind.CUSTOM, (report.library_ops, report.violations)
    kernels = build(source, tmp_path)
    kernels.blocks_per_sm = blocks_per_sm
    model = load_model(launcher, kernels, sms=4)()
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():
        got = model(x)
    return kernels, got, want


@pytest.mark.slow
@pytest.mark.parametrize("blocks_per_sm", [1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_rows_over_a_cooperative_grid_match_pytorch(tmp_path, name, blocks_per_sm):
    """One block an SM of 4: a row a step over 4 tiles; two: 8 blocks, whole rows a step (6 or 7 tiles a
    row here, so one): every step's statistics and the last step's writes, rows ending mid-grid."""
    x = load_module(_task(tmp_path, name)).get_inputs()[0]
    kernels, got, want = _run(tmp_path, name, x, blocks_per_sm)
    names = [launch[0] for launch in kernels.launches]
    assert len(names) == 1 and names[0].endswith("_grid_v4") and kernels.cooperative == names, names
    (grid,) = {launch[1][0] for launch in kernels.launches}
    assert grid <= 4 * blocks_per_sm, grid  # resident at once: the SMs times what each holds
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "lag", "hints", "ahead"), [
    ("group_norm_spanning", 2, True, True), ("softmax", 3, False, False), ("layer_norm_affine", 2, False, True),
    ("log_softmax_odd", 1, True, True), ("rms_norm", 1, False, True),
])  # fmt: skip
def test_grid_tiles_written_steps_later_cache_hinted_or_prefetched_match_pytorch(tmp_path, name, lag, hints,
                                                                                ahead):  # fmt: skip
    """A tile written `lag` steps after its statistics were taken (the blocks drift that far before one
    waits), its first read kept in L2 by cache hints (the emulator loads plainly: the hints are the GPU's),
    a step's first batch loaded before the last step's tile is written (`ahead`): at one block an SM of 4
    every row's tiles span two steps, so a row's wait crosses steps; rows start unaligned in one."""
    x = load_module(_task(tmp_path, name)).get_inputs()[0]
    for bps in (1, 2):
        kernels, got, want = _run(tmp_path, name, x, bps, grid_lag=lag, l2_hints=hints, grid_prefetch=ahead)
        assert len(kernels.launches) == 1 and kernels.cooperative == [kernels.launches[0][0]]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tile", [16384, 32768])
def test_grid_tiles_twice_or_four_times_as_large_match_pytorch(tmp_path, tile):
    """Larger tiles (fewer steps, more rows a step): 50000-element rows in 4 or 2 tiles over 8 blocks."""
    x = load_module(_task(tmp_path, "layer_norm_affine")).get_inputs()[0]
    kernels, got, want = _run(tmp_path, "layer_norm_affine", x, 2, grid_tile=tile)
    ((name, grid, *_),) = kernels.launches
    k = -(-50000 // tile)  # tiles a row; whole rows a step, 3 rows at most
    assert name == "kp_layer_norm_grid_v4" and grid[0] == min(3, 8 // k) * k, grid
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_grid_forms_cache_hints_prefetch_and_lag_compile_without_spills(tmp_path):
    """GroupNorm's 8 MB groups on the grid with the L2 cache hints, the step's loads issued ahead and a lag
    of 2: built for sm_90a (the createpolicy and cache_hint forms ptxas accepts), no spills, no warning; the
    pipeline_loads edit offers each."""
    from pipeline.generate.expert.edits import legal_edits
    from pipeline.generate.expert.families.rowwise import RowPlan

    path = op_task(tmp_path, "group", "nn.GroupNorm(8, 64)", "y", "112, 64, 512, 512")
    low, why = analyse(path)
    assert low is not None, why
    base = tuned(path)
    plan = plan_of(base.source)
    moves = [(label, p) for label, p in legal_edits(plan, low) if label.startswith("pipeline_loads(")]
    rows = [next(r for r in p.regions if isinstance(r, RowPlan)) for _, p in moves]
    assert [(r.l2_hints, r.grid_prefetch, r.grid_lag) for r in rows[:3]] == [
        (False, False, 1),  # the tuned plan's hints taken off
        (True, True, 1),
        (True, False, 2),
    ], moves
    assert rows[3].grid_tile == 16384 and rows[3].l2_hints, moves
    source, launcher = _grid(path, grid_lag=2, l2_hints=True, grid_prefetch=True)
    assert "kp_vload_last<" in source and "kp_vstore_first<" in source and "s < steps + 2" in source
    assert "t_[u] = j0 == tid ? p_[u] :" in source
    from pipeline.candidates import make_candidate
    from pipeline.generate.expert.render import nvcc_flags

    cand = make_candidate(base.task_id, source, launcher, nvcc_flags(plan), parent=None, edit="hinted")
    plain = make_candidate(base.task_id, *_grid(path, l2_hints=False), nvcc_flags(plan), parent=None, edit="")
    b, b_plain = compile_candidates([cand, plain], Config(home=tmp_path / "home", arch="sm_90a"))
    assert b.status == Status.OK and not b.log, b.log
    grid = [r for r in b.resources if "_grid_" in r.name]
    assert len(grid) == 2 and all(r.spill_stores == 0 and r.spill_loads == 0 for r in grid), grid
    if find_cuobjdump() is None:
        return
    # In SASS a hint is the access's memory descriptor: built from the policy (UMOV) where a plain access
    # takes the default one from the constant bank (ULDC c[0x0][0x208]).
    hinted = _descriptor_sources(dump_sass(b.cubin_path) or "", "kp_group_norm_grid_v4")
    assert {"LDG.E.128", "STG.E.128"} <= {op for op, src in hinted if src == "UMOV"}, hinted
    unhinted = _descriptor_sources(dump_sass(b_plain.cubin_path) or "", "kp_group_norm_grid_v4")
    assert unhinted and all(src == "ULDC" for op, src in unhinted if ".128" in op), unhinted


def _descriptor_sources(sass: str, kernel: str) -> set[tuple[str, str]]:
    """(opcode, what set its descriptor register: UMOV or ULDC) of each global load and store of `kernel`."""
    body = sass.split(f"Function : {kernel}", 1)[-1].split("Function :", 1)[0]
    setters: dict[str, str] = {}
    out: set[tuple[str, str]] = set()
    for line in body.splitlines():
        if m := re.search(r"\b(UMOV|ULDC)(?:\.64)?\s+(UR\d+),", line):
            setters[m.group(2)] = m.group(1)
        if m := re.search(r"\b((?:LDG|STG)\.[A-Z0-9.]+)\s.*desc\[(UR\d+)\]", line):
            out.add((m.group(1), setters.get(m.group(2), "?")))
    return out


@pytest.mark.slow
def test_grid_softmax_keeps_minus_infinity_and_nan_as_pytorch_does(tmp_path):
    """A tile of -inf alone (its max stays -inf, its sum 0), -inf scattered, and NaN over its row."""
    x = load_module(_task(tmp_path, "softmax")).get_inputs()[0]
    x[0, :20000] = float("-inf")  # over the first tiles whole
    x[1, 100:20000:7] = float("-inf")
    x[1, 40000] = float("nan")
    kernels, got, want = _run(tmp_path, "softmax", x)
    assert kernels.cooperative == ["kp_softmax_grid_v4"]
    assert got[1].isnan().all() and not got[0].isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


def test_without_resident_blocks_a_row_takes_a_block(tmp_path):
    """A kernel no SM can hold (active_blocks 0): no cooperative launch, the block per row instead."""
    x = load_module(_task(tmp_path, "layer_norm_affine")).get_inputs()[0]
    kernels, got, want = _run(tmp_path, "layer_norm_affine", x, blocks_per_sm=0)
    assert kernels.asked == ["kp_layer_norm_grid_v4"] and not kernels.cooperative
    assert kernels.launches and not any("_grid_" in launch[0] for launch in kernels.launches)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_kernelbench_rows_no_cluster_holds_take_the_grid(tmp_path):
    """Level 1's GroupNorm (8 MB groups) and KernelBench's LayerNorm over (64, 256, 256) (16 MB rows): the
    tuned plan takes the cooperative grid, 2 blocks an SM of 256 threads, 8 vectors in flight a thread, its
    first read kept in L2 (hints); the launcher sizes it by the runtime's answer and launches it
    cooperatively; compiled for sm_90a without spills. A 1.5 MB row keeps its cluster."""
    shapes = {  # name -> (forward's expression of x, init, its shape): nothing of this size is allocated
        "group": ("self.op(x)", "nn.GroupNorm(8, 64)", "112, 64, 512, 512"),
        "layer": ("self.op(x)", "nn.LayerNorm((64, 256, 256))", "16, 64, 256, 256"),
        "softmax_15mb": ("torch.softmax(x, dim=-1)", "nn.Identity()", "64, 393216"),
    }
    paths = []
    for name, (expr, init, shape) in shapes.items():
        paths.append(tmp_path / f"{name}.py")
        paths[-1].write_text(
            "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n"
            f"        super().__init__()\n        self.op = {init}\n\n    def forward(self, x):\n        return {expr}\n\n\n"
            f"def get_inputs():\n    return [torch.randn({shape})]\n\n\ndef get_init_inputs():\n    return []\n"
        )
    cands = [tuned(p) for p in paths]
    plans = [next(r for r in plan_of(c.source).regions if r.TAG == "row") for c in cands]
    assert [(rp.grid_row, rp.persistent, rp.threads, rp.unroll, rp.l2_hints) for rp in plans[:2]] == [
        (True, 2, 256, 8, True)
    ] * 2
    assert not plans[2].grid_row and plans[2].cluster == 8  # its segments in shared memory
    for c, rp in zip(cands[:2], plans[:2], strict=True):
        assert f"kernels.kp_{rp.rid}_grid_v4((gblocks,), (256,), gargs" in c.launcher
        assert "cooperative=True" in c.launcher and "kernels.active_blocks(" in c.launcher
    for b in compile_candidates(cands[:2], Config(home=tmp_path / "home", arch="sm_90a")):
        assert b.status == Status.OK and not b.log, b.log
        grid = [r for r in b.resources if "_grid_" in r.name]
        assert len(grid) == 2 and all(r.spill_stores == 0 and r.spill_loads == 0 for r in grid), grid


@pytest.mark.slow
def test_a_misaligned_input_takes_the_scalar_grid_kernel(tmp_path):
    x = (torch.randn(3 * 45001 + 1) * 3 + 2)[1:].view(3, 45001)  # 4 bytes past a 16-byte boundary
    kernels, got, want = _run(tmp_path, "log_softmax_odd", x)
    assert kernels.cooperative == ["kp_log_softmax_grid_v1"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_first_batch_times_a_grid_or_a_cluster_against_a_block_per_row(tmp_path):
    """A plan that puts a row over a cooperative grid (GroupNorm's 8 MB groups) or a cluster of 16
    (LogSoftmax's 1.5 MB rows) bets on the GPU; with no profile to follow, the tuned plan's first edit undoes
    the bet (increase_occupancy: a block per row), so the first batch of four times both. With advice, the
    advice leads."""
    from pipeline.generate.base import Context
    from pipeline.generate.expert import ExpertPolicy
    from pipeline.generate.expert.edits import legal_edits
    from pipeline.tasks import probe

    tasks = {
        "group": op_task(tmp_path, "group", "nn.GroupNorm(8, 64)", "y", "112, 64, 512, 512"),
        "log_softmax": op_task(tmp_path, "log_softmax", "nn.LogSoftmax(dim=1)", "y", "4096, 393216"),
    }
    for name, path in tasks.items():
        t = probe(path)
        props = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 4)
        edits = [p.candidate.edit for p in props]
        assert edits[2].startswith("expert: tuned kernels, increase_occupancy("), (name, edits)
        rows = [next(r for r in plan_of(p.candidate.source).regions if r.TAG == "row") for p in props[1:3]]
        assert (rows[0].grid_row or rows[0].cluster) and not (rows[1].grid_row or rows[1].cluster), (
            name,
            rows,
        )
        assert "_grid_v" not in props[2].candidate.launcher and "_cluster_" not in props[2].candidate.launcher
        low, why = analyse(path)
        assert low is not None, why
        plan = plan_of(props[1].candidate.source)
        assert legal_edits(plan, low)[0][0].startswith("increase_occupancy(")
        assert legal_edits(plan, low, suggested=("resize_grid",))[0][0].startswith("resize_grid(")
