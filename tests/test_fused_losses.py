"""Losses and similarities in one pass over their inputs (fused_losses.py): the triplet margin loss
(families/triplet.py) and the cosine similarity over the last dim (families/cosine.py). In the CPU emulator
against float64 eager for p = 2 and 1, each reduction, margins and eps, rows of a multiple of 4 (float4
loads) and not, a misaligned input (the scalar kernel), NaN; the forms the lowering decomposes instead;
KernelBench's shape compiled for sm_90a, its loads batched in the SASS."""

from __future__ import annotations

import pytest
from test_expert import _emulate, needs_nvcc, task_file
from test_expert_decompose import needs_gxx

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, plan_of, supports
from pipeline.generate.expert.policy import analyse
from pipeline.generate.expert.templates.signature import balanced_blocks
from pipeline.profile.collect import dump_sass, find_cuobjdump, parse_sass
from pipeline.static_check import check_launcher
from pipeline.tasks import probe
from pipeline.types import Kind, Status

torch = pytest.importorskip("torch")

BODY = """class Model(nn.Module):
    def forward(self, a, p, n):
        return (F.triplet_margin_loss(a, p, n), F.triplet_margin_loss(a, p, n, margin=0.3, p=1, reduction="none"),
                F.triplet_margin_loss(a, n, p, margin=2.5, eps=1e-3, reduction="sum"))"""


def _path(tmp_path, rows: int, cols: int, body: str = BODY, dtype: str = "torch.float32"):
    inputs = ", ".join(f"torch.randn({rows}, {cols}, dtype={dtype}) * {s}" for s in (1.0, 1.1, 0.9))
    return task_file(tmp_path, f"triplet_{rows}_{cols}", body, f"[{inputs}]")


def _candidates(path, n: int = 2):
    task = probe(path)
    props = ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), n)
    return [p.candidate for p in props]


@needs_gxx
@pytest.mark.parametrize(("rows", "cols"), [(37, 300), (70, 64), (3, 5), (1, 1)])
def test_emulated_triplet_losses_match_eager(tmp_path, rows, cols):
    path = _path(tmp_path, rows, cols)
    ok, why = supports(path)
    assert ok, why
    low, _ = analyse(path)
    assert [r.node.op for r in low.regions] == ["triplet_margin_loss"] * 3  # kept whole, not decomposed
    cands = _candidates(path, 4)  # plain, tuned and the tuned plan's edits
    launched = _emulate(path, cands, 1e-5)
    assert any(k.endswith("_total") for k in launched)  # the mean and the sum: partials added in order
    assert ("_rows4" in " ".join(launched)) == (cols % 4 == 0), launched  # the tuned plan's float4 kernel
    for c in cands:
        report = check_launcher(c.launcher)
        assert report.ok and report.kind is Kind.CUSTOM, (c.edit, report.library_ops)


@needs_gxx
def test_a_misaligned_input_takes_the_scalar_kernel_and_nan_stays(tmp_path):
    from cuda_emulator import build, load_model

    body = "class Model(nn.Module):\n    def forward(self, a, p, n):\n        return F.triplet_margin_loss(a, p, n, reduction='none')"
    path = _path(tmp_path, 6, 64, body)
    (tuned,) = [c for c in _candidates(path) if '"vec":true' in c.source.splitlines()[0]]
    kernels = build(tuned.source)
    model = load_model(tuned.launcher, kernels, sms=4)()
    # contiguous, 4 bytes past a 16-byte boundary: _contig keeps them where they are
    args = [torch.randn(6 * 64 + 1)[1:].view(6, 64) for _ in range(3)]
    args[0][2, 7] = float("nan")
    got = model(*args)
    want = torch.nn.functional.triplet_margin_loss(*args, reduction="none")
    assert {k[0] for k in kernels.launches} == {"kp_triplet_margin_loss_rows"}, kernels.launches
    assert got[2].isnan() and not got[[0, 1, 3, 4, 5]].isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize(
    ("body", "dtype"),
    [
        ("return F.triplet_margin_loss(a, p, n, swap=True)", "torch.float32"),  # the swap: a third distance
        ("return F.triplet_margin_loss(a, p, n, p=3)", "torch.float32"),
        ("return F.triplet_margin_loss(a, p, n)", "torch.bfloat16"),  # eager rounds each distance to bf16
    ],
)
def test_forms_the_kernel_does_not_take_are_decomposed(tmp_path, body, dtype):
    path = _path(
        tmp_path, 5, 8, f"class Model(nn.Module):\n    def forward(self, a, p, n):\n        {body}", dtype
    )
    low, why = analyse(path)
    ops = [r.node.op for r in (low.regions if low else [])]
    assert "triplet_margin_loss" not in ops, (ops, why)


@needs_nvcc
def test_kernelbench_shape_compiles_with_its_loads_batched(tmp_path):
    """KernelBench level 1's 99 (32768 rows of 8192): the tuned plan's float4 kernel compiles for sm_90a
    without spills, and a lane's 12 16-byte loads (4 of each input) go out before their sums."""
    path = _path(
        tmp_path,
        32768,
        8192,
        "class Model(nn.Module):\n    def forward(self, a, p, n):\n        return F.triplet_margin_loss(a, p, n)",
    )
    cands = _candidates(path)
    assert [plan_of(c.source).regions[0].vec for c in cands] == [False, True]
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status == Status.OK and not b.log, (c.edit, b.log)
        # no local arrays: at most the registers saved around sqrtf's slow path (4 bytes, lane 0 once a row)
        ours = [r for r in b.resources if "triplet" in r.name]
        assert len(ours) >= 2 and all(r.spill_stores <= 8 for r in ours), (c.edit, ours)
    for c in cands:  # a warp a row, as many blocks as rows need: no warp takes a second row after the others
        assert f"blocks = {balanced_blocks('rows', 8, 256)}" in c.launcher, c.launcher
    if find_cuobjdump() is None:
        return
    sass = parse_sass(dump_sass(builds[1].cubin_path) or "")
    ops = sass["kp_triplet_margin_loss_rows4"].opcodes
    assert sum(n for op, n in ops.items() if op.startswith("LDG.E.128")) >= 12, ops


@pytest.mark.parametrize("rows", [0, 1, 5, 32768, 160000, 10**6, 10**9])
def test_a_warp_a_row_grid_gives_every_warp_the_same_count(rows):
    """balanced_blocks: one pass a warp up to 16 full waves (KernelBench's 99: 4096 blocks of 8 warps for
    32768 rows, where a grid capped at two waves left warps one or two rows); past that, the fewest blocks
    that give every warp the same number of rows (the last block's warps fewer)."""
    sms, warps = 132, 8
    blocks = eval(balanced_blocks("rows", warps, 256), {}, {"rows": rows, "sms": sms})
    units = max(1, -(-rows // warps))  # a block's worth of rows, one a warp
    each = -(-units // blocks)  # what a block's warps take through the grid-stride loop
    assert 1 <= blocks <= sms * 8 * 16
    assert (blocks - 1) * each < units <= blocks * each
    assert each == 1 or blocks > sms * 8 * 16 // 2  # several rows a warp only past the cap
    if rows == 32768:
        assert blocks == 4096


COSINE = """class Model(nn.Module):
    def forward(self, a, b):
        return (torch.mean(1 - F.cosine_similarity(a, b, dim=-1)), F.cosine_similarity(a, b * 0.0, dim=-1),
                F.cosine_similarity(a, b, dim=a.dim() - 1, eps=1e-3))"""


@needs_gxx
@pytest.mark.parametrize("shape", ["37, 300", "70, 64", "2, 3, 5", "1, 1"])
def test_emulated_cosine_similarities_match_eager(tmp_path, shape):
    """A zero operand (its norm clamped to eps: 0, not NaN), three dims, one element a row."""
    path = task_file(tmp_path, "cosine", COSINE, f"[torch.randn({shape}), torch.randn({shape})]")
    low, why = analyse(path)
    assert low is not None, why
    assert [r.node.op for r in low.regions].count("cosine_similarity") == 3  # kept whole, not decomposed
    cands = _candidates(path, 4)
    launched = _emulate(path, cands, 1e-5)
    assert ("_rows4" in " ".join(launched)) == (int(shape.split(", ")[-1]) % 4 == 0), launched
    for c in cands:
        report = check_launcher(c.launcher)
        assert report.ok and report.kind is Kind.CUSTOM, (c.edit, report.library_ops)


def test_a_cosine_similarity_over_another_dim_is_decomposed(tmp_path):
    body = "class Model(nn.Module):\n    def forward(self, a, b):\n        return F.cosine_similarity(a, b, dim=1)"
    path = task_file(tmp_path, "cos_mid", body, "[torch.randn(3, 40, 7), torch.randn(3, 40, 7)]")
    low, why = analyse(path)
    assert low is not None, why
    assert "cosine_similarity" not in [r.node.op for r in low.regions]
