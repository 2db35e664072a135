"""Strided views read in place by the elementwise family: a flat chain's operands that are rows of evenly
spaced contiguous runs (a chunk of the last dim, a slice, a selected component) are read at their own row
stride, where each was first gathered into a contiguous copy by its own kernel (a read and a write of the
operand before the chain's). Exact in the CPU emulator (which checks every vector access's alignment)."""

from __future__ import annotations

import pytest
from test_expert import _emulate, task_file
from test_expert_decompose import needs_gxx

from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy
from pipeline.tasks import probe

torch = pytest.importorskip("torch")

# name -> (forward's body over x, input shape, the tuned plan's kernels: gathers, the vector variant)
CASES = {
    # SwiGLU's halves of one projection: rows of 1024 at a stride of 2048, 16 bytes a thread
    "swiglu_chunk": ("a, b = x.chunk(2, dim=-1)\n        return F.silu(a) * b", "(3, 5, 2048)", 0, True),
    # odd halves: rows of 1027 at a stride of 2054, in place but by the element
    "odd_chunk": (
        "a, b = x.chunk(2, dim=-1)\n        return a * torch.sigmoid(b) + 1.0",
        "(6, 2054)",
        0,
        False,
    ),
    # a slice of the middle dim: each image's rows 8..40, a run of 32 rows of 64
    "middle_slice": ("return torch.relu(x[:, 8:40]) * x[:, :32]", "(4, 48, 64)", 0, True),
    # a transpose is no rows of runs: gathered, as before
    "transposed": ("return x.mT * 2.0 + x", "(4, 600, 600)", 1, True),
    # short rows (a component of (6, 3, 40)): runs of 40 at a stride of 120, several rows to a block
    "short_rows": ("return x[:, 0] * x[:, 1] - x[:, 2]", "(6, 3, 40)", 0, True),
    # runs shorter than two sectors: gathered into one flat row
    "shortest_rows": ("return x[:, 0] * x[:, 1] - x[:, 2]", "(6, 3, 12)", 3, True),
    # q, k and v of a permuted projection: rows of a head's 32 whose starts are batch, head and token, three
    # runs of row dims none of which steps evenly after another
    "heads": (
        "q, k, v = x.view(2, 7, 3, 4, 32).permute(2, 0, 3, 1, 4)\n        return q * 2.0 + k * v",
        "(2, 7, 384)",
        0,
        True,
    ),
    # a window partition keeping channels last: runs of 24 (a window row's 3 x 8), rows in three runs
    "window_rows": (
        "w = x.view(2, 4, 3, 4, 3, 8).permute(0, 1, 3, 2, 4, 5)\n        return w * 2.0 + 1.0",
        "(2, 12, 12, 8)",
        0,
        True,
    ),
    # windows transposed within: runs of 16 channels, rows in five runs of dims, more than the kernel's three
    "windows_transposed": (
        "w = x.view(2, 4, 3, 4, 3, 16).permute(0, 3, 1, 4, 2, 5)\n        return w * 2.0 + 1.0",
        "(2, 12, 12, 16)",
        1,
        True,
    ),
}


def _first_two(tmp_path, name: str, body: str, shape: str):
    """A task whose forward over x (torch.randn of `shape`) is `body`, and the expert's plain and tuned
    candidates of it."""
    path = task_file(tmp_path, name, f"class Model(nn.Module):\n    def forward(self, x):\n        {body}",
                     f"[torch.randn{shape}]")  # fmt: skip
    task = probe(path)
    return path, [
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    ]


@needs_gxx
@pytest.mark.parametrize("name", sorted(CASES))
def test_strided_operands_are_read_in_place(tmp_path, name):
    body, shape, gathers, vector = CASES[name]
    path, (plain, tuned) = _first_two(tmp_path, name, body, shape)
    launched = _emulate(path, [tuned], 1e-6)
    assert sum(k.startswith("kp_gather") for k in launched) == gathers, launched
    chains = [k for k in launched if not k.startswith("kp_gather")]
    assert len(chains) == 1 and chains[0].endswith("_v1") != vector, launched
    _emulate(path, [plain], 1e-6)  # the plain plan (one element a thread) reads them in place too


@needs_gxx
def test_a_copied_view_is_gathered_once_and_an_expanded_operand_read_by_broadcast(tmp_path):
    """x.permute(...).contiguous(): the launcher's gather is the copy (no second copy kernel after it); an
    expand feeding an elementwise op (F.normalize's divisor) is read at its own shape, not gathered."""
    body = (
        "w = x.view(2, 3, 4, 5, 6).permute(0, 2, 1, 4, 3).contiguous()\n"
        "        return w, x / x.abs().sum(-1, keepdim=True).expand_as(x)"
    )
    path, cands = _first_two(tmp_path, "copied", body, "(2, 12, 30)")
    launched = _emulate(path, cands, 1e-6)
    assert sum(k.startswith("kp_gather") for k in launched) == len(cands), launched  # the permuted view's
    assert not any("contiguous" in k for k in launched), launched


@needs_gxx
def test_an_op_of_expands_alone_keeps_one_so_its_shape_stays(tmp_path):
    """Two operands both expanded from (N, 1) to (N, C): reading both at (N, 1) would give an (N, 1) result,
    so one stays expanded (gathered); x + expand(y) + expand(y) reads y by broadcast twice."""
    body = (
        "a = x[:, :1].expand(-1, 30)\n        b = (x[:, 1:2] * 2.0).expand(-1, 30)\n"
        "        c = x[:, 2:3].expand_as(x)\n        return a + b, x + c + c"
    )
    path, cands = _first_two(tmp_path, "expands", body, "(7, 30)")
    _emulate(path, cands, 1e-6)


def test_rows_of_runs_are_found_at_the_first_split_that_fits_every_operand():
    """The launcher's helpers: _run_split picks the longest rows every operand holds as runs whose starts
    three row strides reach (none shorter than asked), _rows_in_place reads each in place or gathers it."""
    import math

    import numpy

    from pipeline.generate.expert.templates.code import LAUNCHER_HELPERS, ROWS_HELPERS

    scope = {"torch": torch, "math": math, "numpy": numpy}
    exec(LAUNCHER_HELPERS + ROWS_HELPERS, scope)
    run_split, in_place = scope["_run_split"], scope["_rows_in_place"]
    x = torch.randn(4, 6, 10)
    half = x[..., :5]  # rows of 5 at a stride of 10, from the first split of the last dim
    assert run_split((x[..., 5:], half), (4, 6, 5), 1) == 2 and run_split((half,), (4, 6, 5), 8) == 0
    assert run_split((x[:, 1:4],), (4, 3, 10), 1) == 1  # a slice of the middle dim: runs of 30 a stride of 60
    assert run_split((x, x + 1), (4, 6, 10), 1) == 0  # contiguous: one flat row
    assert run_split((x.mT,), (4, 10, 6), 2) == 0  # a transpose: runs of one element, gathered
    assert run_split((x[:1],), (4, 6, 10), 1) == 1  # broadcast along the batch: a row stride of 0
    (t,), rn1, rn2, ((lf, le, ld),) = in_place((x[:, 1:4],), (4, 3, 10), 1)
    assert (rn1, rn2, ld) == (1, 4, 60) and t.data_ptr() == x[:, 1].data_ptr()
    (t,), rn1, rn2, ((lf, le, ld),) = in_place((x[:1],), (4, 6, 10), 1)
    assert ld == 0 and t.shape == (4, 6, 10)
    # heads of a permuted projection: rows (batch, head, token) at strides (2688, 32, 384), each row's start
    # reached from its index as the kernel computes it
    q = torch.randn(2, 7, 3, 4, 32).permute(2, 0, 3, 1, 4)[1]
    assert run_split((q,), tuple(q.shape), 16) == 3 and run_split((q,), tuple(q.shape), 33) == 0
    (t,), rn1, rn2, ((lf, le, ld),) = in_place((q,), tuple(q.shape), 3)
    assert t.data_ptr() == q.data_ptr() and (rn1, rn2) == (4, 7)
    base = q.storage_offset()
    for r in range(2 * 4 * 7):
        i2, i1, i0 = r % rn2, (r // rn2) % rn1, r // rn2 // rn1
        assert base + i0 * lf + i1 * le + i2 * ld == q[i0, i1, i2].storage_offset()
    # two operands whose row dims merge differently: each keeps its own strides over the shared split
    y = torch.randn(8, 7, 32)
    (a, b), rn1, rn2, (sa, sb) = in_place((q, y.view(2, 4, 7, 32)), tuple(q.shape), 3)
    assert a.data_ptr() == q.data_ptr() and b.data_ptr() == y.data_ptr() and sb == (896, 224, 32), (sa, sb)
    # an empty view: no rows to read, whatever its strides (a contiguous (4, 0, 3) may have stride 12 in dim 1)
    e = torch.empty(0, 3, 4).permute(2, 0, 1).contiguous()
    assert in_place((e,), (4, 0, 3), 1)[1:3] == (1, 1)
    # five runs of row dims: none (the launcher gathers it: the emulated case windows_transposed)
    w = torch.randn(2, 4, 3, 4, 3, 16).permute(0, 3, 1, 4, 2, 5)
    assert scope["_row_groups"]((w,), tuple(w.shape), 5) is None and run_split((w,), tuple(w.shape), 16) == 0


def test_a_chain_of_fresh_operands_takes_no_row_strides(tmp_path):
    """Only a chain reading a strided view gets the row strides: others keep their kernels and launchers
    (and with them the candidate keys GPU recordings are replayed by)."""
    for name, expr in (
        ("fresh", "torch.relu(x) * 2.0 + torch.sigmoid(x)"),
        ("sorted", "torch.sort(x, 1).values * 2.0 + 1.0"),  # a getitem of a tuple-valued op: a fresh tensor
    ):
        body = f"class Model(nn.Module):\n    def forward(self, x):\n        return {expr}"
        task = probe(task_file(tmp_path, name, body, "[torch.randn(64, 2048)]"))
        for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2):
            assert "ld0" not in p.candidate.source and "_rows_in_place(" not in p.candidate.launcher, (
                name,
                p.candidate.edit,
            )
            assert "_row_stride" not in p.candidate.launcher


@needs_gxx
def test_short_rows_share_a_block(tmp_path):
    """A chain writing its slice of a cat along the last dim (rows of 64 at a stride of 128) or reading a
    chunk of short rows: a block takes several rows (blockDim.y), where a block a row of 16 vectors left
    15 of 16 threads idle."""
    body = (
        "class Model(nn.Module):\n    def forward(self, x, y):\n"
        "        return torch.cat([torch.relu(x), y * 2.0], -1)"
    )
    path = task_file(tmp_path, "heads", body, "[torch.randn(2, 300, 64), torch.randn(2, 300, 64)]")
    launches = _tuned_launches(path)
    chains = [(name, grid, block) for name, grid, block, _ in launches if not name.startswith("kp_gather")]
    assert len(chains) == 2, launches  # both sunk: no copy
    for name, grid, block in chains:
        assert name.endswith("_v4") and tuple(block)[:2] == (16, 16) and tuple(grid)[1] == -(-600 // 16), (
            chains
        )


@needs_gxx
def test_a_row_operand_over_short_rows_shares_a_block(tmp_path):
    """Each head's maximum subtracted over heads of 32: the maximum, one value a row, is read by broadcast, so
    the chain is rows of 32 split at that operand; a block takes 256 / 8 = 32 of them (blockDim.y), where a
    block a row left 248 of 256 threads idle. (F.normalize was this test's case until it became one row op.)"""
    body = (
        "class Model(nn.Module):\n    def forward(self, x):\n"
        "        h = x.view(2, 50, 4, 32).transpose(1, 2)\n"
        "        return (h - h.amax(dim=-1, keepdim=True)) * 3.0"
    )
    launches = _tuned_launches(task_file(tmp_path, "heads_norm", body, "[torch.randn(2, 50, 128)]"))
    rowed = [(name, block) for name, _, block, _ in launches if len(tuple(block)) > 1 and block[1] > 1]
    assert rowed and all(tuple(block)[:2] == (8, 32) for _, block in rowed), launches


def _tuned_launches(path):
    """The tuned candidate checked against eager in the emulator, then run once more: its launches, each
    (kernel, grid, block, args)."""
    from cuda_emulator import build, load_model
    from fuzz_expert import reference

    task = probe(path)
    tuned = ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)[1].candidate
    _emulate(path, [tuned], 1e-6)
    r = reference(path, None)
    kernels = build(tuned.source)
    model = load_model(tuned.launcher, kernels, sms=64)(*r.module.get_init_inputs())
    with torch.no_grad():
        model(*r.inputs)
    return kernels.launches


@needs_gxx
@pytest.mark.parametrize(
    ("body", "shape", "gathers"),
    [
        # F.normalize of q and k of a permuted projection (heads of 32, and of 33 off the vector alignment):
        # the norms' rows read where they lie, as the division's
        (
            "q, k, v = x.view(2, 7, 3, 4, -1).permute(2, 0, 3, 1, 4)\n"
            "        return F.normalize(q, dim=-1) * 2.0, F.normalize(k, dim=-1)",
            "(2, 7, 384)",
            0,
        ),
        (
            "q, k, v = x.view(3, 5, 3, 4, -1).permute(2, 0, 3, 1, 4)\n        return F.normalize(k, dim=-1)",
            "(3, 5, 396)",
            0,
        ),
        # a transposed view's rows are no runs: gathered, as before
        ("return torch.linalg.vector_norm(x.mT, dim=-1)", "(3, 40, 24)", 1),
    ],
)
def test_a_reduction_of_a_strided_view_reads_its_rows_in_place(tmp_path, body, shape, gathers):
    path, cands = _first_two(tmp_path, "norms", body, shape)
    for c in cands:
        launched = _emulate(path, [c], 1e-5)
        assert sum(k.startswith("kp_gather") for k in launched) == gathers, launched


@needs_gxx
def test_an_operand_broadcast_along_no_run_of_dims_is_read_in_place(tmp_path):
    """A window mask (windows, N, N) added to scores (batch, windows, heads, N, N): broadcast over batch and
    heads, its rows of N x N are runs at strides (0, N * N, 0), read in place where it was expanded to the
    scores' size and gathered first."""
    body = (
        "s = x.view(2, 4, 3, 5, 20)\n"
        "        m = torch.tanh(x[:4])\n"
        "        return torch.softmax(s + m.unsqueeze(1), dim=-1)"
    )
    path, cands = _first_two(tmp_path, "mask", body, "(24, 5, 20)")
    for c in cands:
        launched = _emulate(path, [c], 1e-6)
        assert not any(k.startswith("kp_gather") for k in launched), launched


@needs_gxx
def test_empty_strided_views_launch_nothing(tmp_path):
    """No tokens: q, k and v of a permuted projection are empty views whose strides are no runs; the
    launchers return empty results without a launch (the row strides' helper raised on them)."""
    body = (
        "q, k, v = x.view(2, 0, 3, 4, 32).permute(2, 0, 3, 1, 4)\n"
        "        return q * 2.0 + k * v, F.normalize(q, dim=-1)"
    )
    path, cands = _first_two(tmp_path, "empty", body, "(2, 0, 384)")
    for c in cands:
        assert _emulate(path, [c], 1e-6) == []
