"""The fast fp32 gather (templates/gather.py): its host-side division constants checked at the edges, its
launcher plan (unit dims dropped, dims that step as one merged, 16-byte vectors where they fit), its
kernels exact in the CPU emulator against PyTorch, compiled for sm_90a without spills, and emitted only
where the task's graph makes views (the replay fixtures' candidates keep their keys)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy
import pytest
from test_expert import _emulate, task_file
from test_expert_decompose import needs_gxx

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy
from pipeline.generate.expert.templates import gather
from pipeline.generate.expert.templates.code import LAUNCHER_HELPERS
from pipeline.tasks import probe
from pipeline.types import Status

torch = pytest.importorskip("torch")


def _helpers() -> dict:
    scope: dict = {"torch": torch, "math": math, "numpy": numpy}
    exec(compile(LAUNCHER_HELPERS + gather.FAST_CONTIG, "<helpers>", "exec"), scope)
    return scope


def _first(tmp_path: Path, name: str, body: str, inputs: str, k: int = 2) -> tuple[Path, list]:
    path = task_file(
        tmp_path, name, f"class Model(nn.Module):\n    def forward(self, x):\n        {body}", inputs
    )
    task = probe(path)
    return path, [
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), k)
    ]


def test_the_magic_divisions_are_exact_below_2_to_the_31():
    divider = _helpers()["_divider"]
    rng = random.Random(0)
    divisors = [*range(1, 300), 3 * 7 * 11 * 13, 65537, 2**20 + 1, 2**30 - 1, 2**30, 2**31 - 1]
    divisors += [rng.randrange(1, 2**31) for _ in range(200)]
    for d in divisors:
        m, s = divider(d)
        assert 0 < m < 2**32 and 0 <= s <= 31
        xs = {0, 1, d - 1, d, d + 1, 2**31 - 1, 2**31 - 2, (2**31 - 1) // d * d, (2**31 - 1) // d * d - 1}
        xs |= {rng.randrange(2**31) for _ in range(300)}
        for x in (x for x in xs if 0 <= x < 2**31):
            assert (((x * m) >> 32) + x) >> s == x // d, (d, x)


def test_the_plan_merges_dims_and_takes_vectors_where_they_fit():
    plan = _helpers()["_gather_plan"]
    # Swin's window partition (B, H/7, 7, W/7, 7, C) -> (B, H/7, W/7, 7, 7, C)
    x = torch.empty(2, 8, 7, 8, 7, 96).permute(0, 1, 3, 2, 4, 5)
    vec, consts = plan(tuple(x.shape), tuple(x.stride()))
    nd, sizes, strides = int(consts[0]), [int(v) for v in consts[1:7]], [int(v) for v in consts[19:25]]
    # the batch and the window rows step as one, and so do a window's columns and the channels: 4 dims
    assert vec == 4 and nd == 4
    assert sizes[:nd] == [16, 8, 7, 7 * 96 // 4] and strides[:nd] == [7 * 8 * 7 * 96, 7 * 96, 8 * 7 * 96, 4]
    # a transpose: the innermost dim strided, one element a thread; a unit dim dropped
    t = torch.empty(5, 1, 33, 40).transpose(-1, -2)
    vec, consts = plan(tuple(t.shape), tuple(t.stride()))
    assert vec == 1 and int(consts[0]) == 3
    assert plan((3, 2**30), (2**30, 1)) is None  # 2^31 elements or more: the generic gather
    assert plan(tuple(range(2, 9)), (1, 2, 6, 24, 120, 720, 5040)) is None  # 7 dims that do not merge


# name -> (forward's body over x, input shape, the fast kernel that gathers it)
CASES = {
    # three components of (6, 3, 12): each a strided slice read by one chain, gathered 16 bytes a thread
    "components": ("return x[:, 0] * x[:, 1] - x[:, 2]", "(6, 3, 12)", "kp_gather_fast_f32x4"),
    # windows transposed within, read by an elementwise chain: rows in five runs of dims, gathered
    "windows_transposed": (
        "w = x.view(2, 4, 3, 4, 3, 16).permute(0, 3, 1, 4, 2, 5)\n        return w * 2.0 + 1.0",
        "(2, 12, 12, 16)",
        "kp_gather_fast_f32x4",
    ),
    # the innermost dim contiguous but 7 long: one element a thread
    "odd_runs": (
        "return x.view(2, 3, 5, 7).permute(0, 2, 1, 3).contiguous() - 1.0",
        "(2, 105)",
        "kp_gather_fast_f32",
    ),
    # a transpose: the innermost dim strided
    "transposed": ("return x.mT * 2.0 + x", "(4, 37, 37)", "kp_gather_fast_f32"),
}


@needs_gxx
@pytest.mark.parametrize("name", sorted(CASES))
def test_views_are_gathered_by_the_fast_kernel_exactly(tmp_path, name):
    body, shape, kernel = CASES[name]
    path, cands = _first(tmp_path, name, body, f"[torch.randn{shape}]")
    assert all("kp_gather_fast_f32x4" in c.source and "_gather_plan" in c.launcher for c in cands)
    launched = _emulate(path, cands, 1e-6)
    assert kernel in launched and "kp_gather_f32" not in launched, launched


@needs_gxx
def test_a_view_off_a_16_byte_boundary_takes_the_generic_gather(tmp_path):
    """x[:, :, 1:5] starts 4 bytes into the storage: its vector plan fits the shape, not the address."""
    from cuda_emulator import build, load_model

    body = "return x[:, :, 1:5].permute(1, 0, 2).contiguous() * 3.0"
    _, (cand,) = _first(tmp_path, "offset", body, "[torch.randn(2, 4, 8)]", 1)
    kernels = build(cand.source, tmp_path)
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        got = load_model(cand.launcher, kernels, sms=4)()(x)
    torch.testing.assert_close(got, x[:, :, 1:5].permute(1, 0, 2) * 3.0, rtol=0, atol=0)
    names = [name for name, *_ in kernels.launches]
    assert "kp_gather_f32" in names and not any(n.startswith("kp_gather_fast") for n in names), names


def test_tasks_without_strided_views_keep_their_sources():
    """The replay fixtures' tasks (softmax, an elementwise chain) make no view the launcher gathers: no fast
    gather in their candidates, so their keys are those recorded on the GPU."""
    root = Path(__file__).resolve().parent.parent / "tasks"
    for name in ("softmax", "elementwise_chain"):
        task = probe(root / f"{name}.py")
        for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2):
            assert "kp_gather_fast" not in p.candidate.source and "_gather_plan" not in p.candidate.launcher


def test_the_fast_gather_compiles_for_sm90a_without_spills(tmp_path):
    body = "return x.view(2, 3, 4, 3, 4, 8).permute(0, 1, 3, 2, 4, 5).contiguous() * 2.0"
    _, (cand,) = _first(tmp_path, "w", body, "[torch.randn(2, 12, 12, 8)]", 1)
    (b,) = compile_candidates([cand], Config(home=tmp_path / "home", arch="sm_90a"))
    assert b.status == Status.OK and not b.log, b.log
    fast = {r.name: r for r in b.resources if r.name.startswith("kp_gather_fast")}
    assert set(fast) == {"kp_gather_fast_f32", "kp_gather_fast_f32x4"}
    assert all(r.spill_stores == 0 and r.registers <= 40 for r in fast.values()), fast
