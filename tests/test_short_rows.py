"""Row ops over short rows, several rows a warp (templates/rowwise.py row_lanes): a group of lanes a row
where a warp a row left most of its vector lanes idle (F.normalize over heads of 32: 8 of 32). Exact in the
CPU emulator against eager, on row counts that leave the last warp part empty, contiguous and strided rows,
one-pass reductions and two-pass ops (softmax, layer norm, F.normalize as one l2_normalize); the plans that
keep a warp a row."""

from __future__ import annotations

import pytest
from test_elementwise_views import _first_two, _tuned_launches
from test_expert import _emulate, task_file
from test_expert_decompose import needs_gxx
from test_movement import needs_nvcc

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.expert import plan_of
from pipeline.types import Status

torch = pytest.importorskip("torch")


def _lanes(candidate) -> dict[str, int]:
    return {rp.rid: rp.lanes for rp in plan_of(candidate.source).regions if rp.TAG == "row"}


# name -> (forward's body over x, input shape, the tuned plan's lanes a row)
CASES = {
    # heads of 32 of a permuted projection, read in place: 8 lanes, 4 rows a warp; 2 x 4 x 7 = 56 rows
    "normalize_heads": (
        "q, k, v = x.view(2, 7, 3, 4, -1).permute(2, 0, 3, 1, 4)\n        return F.normalize(q, dim=-1)",
        "(2, 7, 384)",
        8,
    ),
    # heads of 33: no vectors (rows off the alignment), 16 lanes; 3 x 4 x 5 = 60 rows
    "normalize_odd_heads": (
        "q, k, v = x.view(3, 5, 3, 4, -1).permute(2, 0, 3, 1, 4)\n        return F.normalize(k, dim=-1)",
        "(3, 5, 396)",
        16,
    ),
    # 21 rows of 12: 4 lanes, 8 rows a warp, the third warp's last three rows past the end
    "sum_12": ("return x.sum(-1)", "(3, 7, 12)", 4),
    "amax_12": ("return x.amax(-1, keepdim=True)", "(3, 7, 12)", 4),
    "argmax_12": ("return x.argmax(-1)", "(3, 7, 12)", 4),
    "mean_12": ("return x.mean(-1)", "(3, 7, 12)", 4),
    "l1_12": ("return x.abs().sum(-1) * 0.5", "(21, 12)", 4),
    # rows of 3 and of 1: a lane a row, 32 rows a warp, 37 rows
    "sum_3": ("return x.sum(-1)", "(37, 3)", 1),
    "max_1": ("return x.max(dim=-1).values", "(37, 1)", 1),
    # the variance's sums shifted by its row's first element
    "var_12": ("return x.var(-1)", "(21, 12)", 4),
    # two-pass ops: the row's statistics, then its values written (a group past the last row writes the last
    # row's again); F.normalize one l2_normalize, rows of zeros divided by eps
    "softmax_12": ("return torch.softmax(x, -1)", "(3, 7, 12)", 4),
    "layer_norm_12": (
        "return F.layer_norm(x, (12,)) * 0.5 + 0.1",
        "(3, 7, 12)",
        4,
    ),
    "normalize_zero_rows": (
        "return F.normalize(torch.where(x[:, :1] > 0, x, 0.0), dim=-1, eps=1e-3)",
        "(37, 20)",
        8,
    ),
    # 64-float rows fill half a warp's vectors: a warp a row (16 lanes would be half of it again)
    "sum_64": ("return x.sum(-1)", "(9, 64)", 16),
    "sum_200": ("return x.sum(-1)", "(9, 200)", 0),
}


@needs_gxx
@pytest.mark.parametrize("name", sorted(CASES))
def test_short_rows_share_a_warp_and_match_eager(tmp_path, name):
    body, shape, lanes = CASES[name]
    path, (plain, tuned) = _first_two(tmp_path, name, body, shape)
    got = _lanes(tuned)
    assert got and max(got.values()) == lanes, got
    assert not any(_lanes(plain).values())  # the plain plan keeps a block a row
    for c in (plain, tuned):
        _emulate(path, [c], 1e-6)
    if lanes:
        assert f"constexpr int L = {lanes};" in tuned.source and "lanes_reduce(acc" in tuned.source
    else:
        assert "lanes_reduce" not in tuned.source  # the helper only where a kernel calls it


@needs_gxx
def test_a_warp_of_short_rows_stops_together(tmp_path):
    """The launch covers 400 rows of 32 in blocks of 32 rows (8 lanes each). The emulator runs a warp's lanes
    in step at each shuffle, so a group of lanes that left the row loop while the rest of its warp went on
    would stop the launch (a GPU would hang); the result is exact."""
    body = "q, k, v = x.view(2, 50, 3, 4, -1).permute(2, 0, 3, 1, 4)\n        return F.normalize(q, dim=-1)"
    launches = _tuned_launches(
        task_file(
            tmp_path,
            "norms",
            f"class Model(nn.Module):\n    def forward(self, x):\n        {body}",
            "[torch.randn(2, 50, 384)]",
        )
    )
    norms = [(grid, block) for name, grid, block, _ in launches if name.startswith("kp_div")]
    assert norms and all(
        (*block,)[:1] == (256,) and (*grid,)[:1] == (-(-400 // 32),) for grid, block in norms
    ), norms


def test_f_normalize_over_the_last_dim_is_one_row_op(tmp_path):
    """x / clamp_min(||x||, eps), expanded back: one l2_normalize (one kernel reading the row, where a norm
    and a division each read it); over a dim not the last, the norm and the division as before."""
    from pipeline.generate.expert import capture
    from pipeline.generate.expert.render import prepare

    for dim, ops in ((-1, ["l2_normalize"]), (1, ["linalg_vector_norm", "clamp_min", "div"])):
        body = f"class Model(nn.Module):\n    def forward(self, x):\n        return F.normalize(x, dim={dim}) * 2.0"
        low = prepare(capture(task_file(tmp_path, f"normalize_{dim + 1}", body, "[torch.randn(3, 5, 8)]")))
        got = [n.op for n in low.nodes if n.op not in ("mul", "expand_as", "expand")]
        assert got == ops, (dim, got)


@needs_nvcc
def test_short_row_kernels_compile_for_sm90a_without_spills(tmp_path):
    """A group's guard on its reads once made ptxas spill argmax's accumulator: the cases' tuned kernels build
    for the H200 with no spill. Not the zero rows' F.normalize: its prologue (a where against a broadcast
    column) keeps 24-28 bytes on the stack in the 16-byte form with a warp a row too, lanes or not."""
    names = sorted(set(CASES) - {"normalize_zero_rows"})
    cands = [_first_two(tmp_path, name, *CASES[name][:2])[1][1] for name in names]
    for c, b in zip(
        cands, compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a")), strict=True
    ):
        assert b.status == Status.OK and not b.log, (c.edit, b.log)
        assert all(r.spill_stores == 0 for r in b.resources), [r for r in b.resources if r.spill_stores]
