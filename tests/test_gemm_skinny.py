"""fp32 linear layers over few rows on the CUDA cores (families/gemm_skinny.py, templates/gemm_skinny.py) on
the CPU: which layers the family takes (and which it leaves to the 3xTF32 kernel), its candidates and their
edits run by the CUDA emulator against float64, and its kernel compiled for sm_90a without spills
(tests/test_gpu_expert.py runs it on the GPU)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from cuda_emulator import build, load_model

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, capture, plan_of
from pipeline.generate.expert.edits import base_plan, legal_edits
from pipeline.generate.expert.families import gemm_skinny, gemm_tf32
from pipeline.generate.expert.render import prepare, render
from pipeline.tasks import load_module, probe
from pipeline.types import Status

BODY = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({k}, {n}, dtype=torch.{dt})

    def forward(self, x, y):
        return torch.relu(self.fc(x) + y) * 2.0


def get_inputs():
    return [torch.randn({lead}, {k}, dtype=torch.{dt}), torch.randn({lead}, {n}, dtype=torch.{dt})]


def get_init_inputs():
    return []
"""


def task(folder: Path, name: str, lead: str, k: int, n: int, dt: str = "float32") -> Path:
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(BODY).format(lead=lead, k=k, n=n, dt=dt))
    return path


def plans(path: Path):
    low = prepare(capture(path))
    return low, base_plan(low, False), base_plan(low, True)


def test_few_row_fp32_linear_layers_take_the_skinny_kernel_and_more_rows_the_tensor_cores(tmp_path):
    low, plain, tuned = plans(task(tmp_path, "s", "20", 1032, 37))
    (rp,) = [x for x in tuned.regions if isinstance(x, gemm_skinny.SkinnyPlan)]
    assert (rp.rows, rp.cols, rp.epilogue) == (16, 4, "linear")  # bias, y, relu, x2 fused on its stores
    assert not any(isinstance(x, gemm_skinny.SkinnyPlan) for x in plain.regions)  # cuBLAS in the plain plan
    labels = [label for label, _ in legal_edits(tuned, low)]
    # 16 x 8 sums a thread would pass MAX_SUMS, and 32 rows a group 16: coarser is not offered
    assert labels == ["more_parallelism(linear_mm: cols=2)", "resize_grid(linear_mm: rows=8)"], labels
    _, _, big = plans(task(tmp_path, "b", "3, 11", 1032, 37))  # 33 rows
    assert any(isinstance(x, gemm_tf32.Tf32Plan) for x in big.regions)
    assert not any(isinstance(x, gemm_skinny.SkinnyPlan) for x in big.regions)
    # into few columns from a small x: more rows too (SwinV2's position-bias MLP: 169 rows into a column a head)
    for name, lead, k, n, ours in [
        ("cpb", "169", 512, 24, True),
        ("wide", "169", 512, 33, False),  # more columns than a narrow tile
        ("tall", "300", 512, 24, False),  # more rows than two tiles
        ("long", "200", 8192, 8, False),  # x (6.5 MB) past what every block of columns re-reads from L2
    ]:
        _, _, p = plans(task(tmp_path, name, lead, k, n))
        assert any(isinstance(x, gemm_skinny.SkinnyPlan) for x in p.regions) == ours, name
        assert any(isinstance(x, gemm_tf32.Tf32Plan) for x in p.regions) != ours, name
    r = next(
        r
        for r in prepare(capture(task(tmp_path, "h", "4", 64, 8, "float16"))).regions
        if r.rid == "linear_mm"
    )
    assert "fp32" in gemm_skinny.form(r, prepare(capture(tmp_path / "h.py")))


def _candidates(path: Path) -> list:
    """The tuned candidate and each of its skinny edits."""
    t = probe(path)
    policy = ExpertPolicy()
    first = policy.propose(Context(task=t, reference=t.source, parent=None), 2)
    tuned = first[1].candidate
    kids = policy.propose(Context(task=t, reference=t.source, parent=tuned), 12)
    out = [tuned] + [
        k.candidate
        for k in kids
        if k.candidate
        and any(isinstance(x, gemm_skinny.SkinnyPlan) for x in plan_of(k.candidate.source).regions)
    ]
    assert all(any(isinstance(x, gemm_skinny.SkinnyPlan) for x in plan_of(c.source).regions) for c in out)
    return out


def _float64_reference(path: Path):
    """(the reference's fp32 weights, its inputs, its output in float64) of a task file."""
    module = load_module(path)
    torch.manual_seed(0)
    ref = module.Model()
    xs = module.get_inputs()
    with torch.no_grad():
        want = ref.double()(*(x.double() for x in xs))
    return ref.float().state_dict(), xs, want


def _emulated(source: str, launcher: str, state, xs, tmp_path: Path):
    """(the candidate's output on the inputs, the emulator's kernels with their launches)."""
    kernels = build(source, tmp_path)
    model = load_model(launcher, kernels)()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(*xs), kernels


@pytest.mark.parametrize(
    ("lead", "k", "n"),
    [("20", 264, 9), ("3, 5", 262, 6), ("1", 2056, 8), ("2, 16", 264, 5), ("3, 45", 128, 20)],
    ids=["vec_two_groups", "scalar_3d", "tiny", "full_group", "narrow_many_rows"],
)
def test_emulated_skinny_candidates_match_float64(tmp_path, lead, k, n):
    """float4 loads (K a multiple of 4) and scalar ones, each thread's K loop run more than once (K 2056 and
    262), rows past a group's 16, columns past a block's, the epilogue's full and column operands; the
    tuned candidate and its edits (other cols and rows)."""
    path = task(tmp_path, "e", lead, k, n)
    cands = _candidates(path)
    assert len(cands) >= 3
    cands = cands[:3]  # the tuned candidate and two edits: the emulator runs every thread as a thread
    state, xs, want = _float64_reference(path)
    assert want.norm() > 0  # not every output cut to zero by the ReLU
    for c in cands:
        got, kernels = _emulated(c.source, c.launcher, state, xs, tmp_path)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-6, c.edit
        assert any(name.endswith("_skinny") for name, *_ in kernels.launches)


@pytest.mark.parametrize(("lead", "k", "n"), [("169", 2, 512), ("3, 50", 3, 37), ("4", 8, 9)])
def test_a_layer_over_a_tiny_k_is_an_outer_product_on_the_cuda_cores(tmp_path, lead, k, n):
    """K of at most TINY_K, any rows: one output a thread, its weight row in registers (SwinV2's Linear(2,
    512) over 169 positions took two pad launches and a tensor-core tile); no rows or cols edits, which the
    kernel does not read; emulated against float64, and built for sm_90a without spills."""
    path = task(tmp_path, "t", lead, k, n)
    low, _, tuned = plans(path)
    assert len([x for x in tuned.regions if isinstance(x, gemm_skinny.SkinnyPlan)]) == 1
    assert not any(isinstance(x, gemm_tf32.Tf32Plan) for x in tuned.regions)
    assert not [label for label, _ in legal_edits(tuned, low) if "rows=" in label or "cols=" in label]
    source, launcher = render(low, tuned)
    assert f"constexpr int TK = {k};" in source and "_pad" not in launcher
    state, xs, want = _float64_reference(path)
    got, kernels = _emulated(source, launcher, state, xs, tmp_path)
    assert got.shape == want.shape and ((got.double() - want).norm() / want.norm()).item() < 1e-6
    assert [name for name, *_ in kernels.launches if name.startswith("kp_linear")] == ["kp_linear_mm_outer"]
    if k == 2:
        t = probe(path)
        cand = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
        (b,) = compile_candidates([cand], Config(home=tmp_path / "h", arch="sm_90a"))
        assert b.status == Status.OK, b.log
        (res,) = [x for x in b.resources if x.name.endswith("_outer")]
        assert res.spill_stores == 0


def test_a_lone_few_row_linear_layer_is_ours_in_the_plain_plan_and_compiles_without_spills(tmp_path):
    body = "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n"
    body += "        super().__init__()\n        self.fc = nn.Linear(8192, 128, bias=False)\n\n    def forward(self, x):\n"
    body += "        return self.fc(x)\n\n\ndef get_inputs():\n    return [torch.randn(10, 8192)]\n\n\n"
    body += "def get_init_inputs():\n    return []\n"
    path = tmp_path / "lone.py"
    path.write_text(body)
    low, plain, tuned = plans(path)
    assert any(isinstance(x, gemm_skinny.SkinnyPlan) for x in plain.regions)  # no bias: nothing else is ours
    source, _ = render(low, tuned)
    assert "kp_linear_skinny" in source  # a bias-free linear layer: its region is the layer itself
    cands = _candidates(task(tmp_path, "c", "20", 1032, 37))
    builds = compile_candidates([cands[0], _candidates(path)[0]], Config(home=tmp_path / "h", arch="sm_90a"))
    for b in builds:
        assert b.status == Status.OK, b.log
        (res,) = [r for r in b.resources if r.name.endswith("_skinny")]
        assert res.spill_stores == 0 and res.registers <= 128, res
