"""flip, roll, cat, stack, repeat, Tensor.unfold, padding (constant, reflect, replicate, circular), takes
and gathers as our own strided copies
(families/movement.py): written where they were left to PyTorch (a lone flip or roll was refused: fuzz
seeds 10349 and 10350), exact in the CPU emulator on strided, transposed, empty and 16-bit inputs, 16 bytes
at a time where the rows align, and compiled for sm_90a."""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzz_expert import check_task
from test_expert import _emulate, needs_nvcc, task_file
from test_expert_decompose import needs_gxx

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, supports
from pipeline.static_check import check_launcher
from pipeline.tasks import probe
from pipeline.types import Status

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent

# name -> (forward's body, inputs)
CASES = {
    "flips": (
        "return torch.flip(x, dims=(0, -1)), torch.flip(x.transpose(1, 2), dims=(1,)) * 2",
        "[torch.randn(5, 33, 17)]",
    ),
    "flip_bf16": ("return torch.flip(x, dims=(-1,))", "[torch.randn(7, 129, dtype=torch.bfloat16)]"),
    "rolls": (
        "return torch.roll(x, shifts=(3, -40), dims=(2, 0)), torch.roll(x, 1, 1), torch.roll(x.mT, 7)",
        "[torch.randn(6, 5, 33)]",
    ),
    "cats": (
        "return torch.cat([x, torch.relu(x), x.flip(1)], dim=1), torch.cat([x.transpose(1, 2), x.mT], -1)",
        "[torch.randn(4, 64, 64)]",
    ),
    "cat_f16_empty": (
        "return torch.cat([x, x.new_zeros(0), x * 2], 0)",  # the legacy empty 1-D input is skipped
        "[torch.randn(3, 40, dtype=torch.float16)]",
    ),
    "stacks": (
        "return torch.stack([x, x * 0.5, x], -1).sum(-1), torch.stack([x, x.t().t()], 0)",
        "[torch.randn(9, 10)]",
    ),
    "repeats": (
        "return x.repeat(2, 1, 3), torch.tile(x.mT, (2,)), x[0].repeat(3, 1, 1, 2) + 1",
        "[torch.randn(3, 5, 8)]",
    ),
    "unfolds": (
        "return x.unfold(2, 4, 3), x.unfold(1, 2, 2).unfold(2, 8, 8).reshape(2, -1), x.mT.unfold(-1, 5, 1)",
        "[torch.randn(2, 6, 32)]",
    ),
    "pads": (
        "return (F.pad(x, (1, 2, 0, -1)), F.pad(x, (3, 5), value=-1.5), F.pad(x.mT, (2, 0, 1, 1, 1, 0)),"
        " F.pad(x, (0, 0, 0, 0, -1, -1)), F.pad(x, (2, 2), value=float('-inf')))",
        "[torch.randn(4, 6, 32)]",
    ),
    "pads_typed": (  # the fill as the dtype's bits: bf16 (rounded), bool, int64; a padded batch of images
        "return (F.pad(x, (3, 3, 3, 3), value=-1.7), F.pad(x > 0, (1, 2), value=True), F.pad(x.long(), (0, 0, 2, 1),"
        " value=-7), F.pad(x[:, :1], (1, 1, 0, 0, 1, 0)))",
        "[torch.randn(3, 4, 5, 7, dtype=torch.bfloat16)]",
    ),
    "edge_pads": (  # reflect, replicate and circular: each padded dim three ranges, the edges copied in place
        "return (F.pad(x, (2, 3), mode='reflect'), F.pad(x, (1, 0, 2, 2), mode='replicate') * 2,"
        " F.pad(x.mT, (3, 1, 0, 4), mode='circular'), F.pad(x[None], (1, 1, 2, 0, 1, 2), mode='reflect'),"
        " F.pad(x[None], (0, 2, 1, 1, 3, 0), mode='circular'), F.pad(x[:, :, :2], (5, 6), mode='replicate'))",
        "[torch.randn(4, 6, 9)]",
    ),
    "im2col": (  # F.unfold: a piece a kernel tap, the padding the zero-filled rest; 3-D input too
        "return (F.unfold(x, 3, padding=1), F.unfold(x, (2, 3), dilation=(1, 2), stride=2), F.unfold(x[0], 2, stride=2),"
        " F.unfold(x.mT, (3, 2), padding=(2, 1), stride=(2, 3)))",
        "[torch.randn(2, 3, 7, 9)]",
    ),
    "takes": (  # rows picked by an index tensor: an embedding, index_select along a middle dim, x[:, i]
        "return F.embedding(x[0].long() % 50, w) * 2, torch.index_select(w.view(10, 5, 64), 1, x[1, :7].long()"
        " % 5), w[:, x[2, :9].long() % 64], w[x[3, :3].long() % 50 - 50], w.t()[x[:2, :3].long() % 64]",
        "[torch.randint(0, 1000, (4, 16)).float(), torch.randn(50, 64)]",
    ),
    "gathers": (  # torch.gather along the last dim, the first (of a transposed input), a middle one of 3-D
        "return torch.gather(w, 1, x[:, :5].long() % 64), torch.gather(w.t(), 0, x[:3, :7].long() % 64) * 2,"
        " torch.gather(w.view(10, 5, 64), 1, (x[:, None, :6].long() % 5).expand(4, 3, 6)),"
        " torch.gather(w[0], 0, x[0].long() % 64)",
        "[torch.randint(0, 1000, (4, 16)).float(), torch.randn(50, 64)]",
    ),
    "indices": (
        "i = x.argmax(1)\n        return torch.cat([i, i.flip(0)]), torch.stack([x > 0, x < 0])",
        "[torch.randn(9, 10)]",
    ),
}


def _path(tmp_path, name: str):
    body, inputs = CASES[name]
    args = "x, w" if name in ("takes", "gathers") else "x"
    return task_file(
        tmp_path, name, f"class Model(nn.Module):\n    def forward(self, {args}):\n        {body}", inputs
    )


@pytest.mark.parametrize(
    "expr",
    [
        "torch.flip(x, dims=(0,))",
        "torch.roll(x, 5, 1)",
        "torch.cat([x, x], 0)",
        "torch.stack([x, x])",
        "x.repeat(2, 2)",
        "x.unfold(1, 3, 2)",
        "F.pad(x, (1, 1))",
        "F.pad(x, (2, 1), mode='reflect')",
        "F.pad(x, (0, 3), mode='replicate')",
        "F.pad(x, (4, 4), mode='circular')",
    ],
)
def test_a_lone_data_movement_op_is_written_as_our_copies(tmp_path, expr):
    path = task_file(tmp_path, "lone", f"class Model(nn.Module):\n    def forward(self, x):\n        return {expr}",
                     "[torch.randn(37, 130)]")  # fmt: skip
    ok, why = supports(path)
    assert ok and "(move)" in why and "left to PyTorch" not in why, why


@pytest.mark.parametrize(
    ("expr", "left"),
    [
        (
            "torch.cat([x, x.half()], 0) * 2",
            "aten.cat.default",
        ),  # promotes: bytes cannot be copied as they are
    ],
)
def test_promoting_concatenations_stay_with_pytorch(tmp_path, expr, left):
    body = f"class Model(nn.Module):\n    def forward(self, x):\n        return {expr}"
    ok, why = supports(task_file(tmp_path, "kept", body, "[torch.randn(4, 8)]"))
    assert ok and f"{left} left to PyTorch (move: an input of another dtype" in why, why


@needs_gxx
def test_rows_picked_by_an_index_input_are_our_copies_16_bytes_a_row_piece(tmp_path):
    """An embedding of bf16 rows (16-byte pieces), and index_select by a one-element index (the indexed dim
    of size 1 is kept, not dropped as a unit dim)."""
    body = (
        "class Model(nn.Module):\n    def forward(self, i, w):\n"
        "        return F.embedding(i, w), torch.index_select(w.view(5, 10, 64), 1, i[0, :1]) * 2"
    )
    inputs = "[torch.randint(0, 10, (3, 7)), torch.randn(50, 64, dtype=torch.bfloat16)]"
    path = task_file(tmp_path, "embedding", body, inputs)
    ok, why = supports(path)
    assert ok and "move" in why and "left to PyTorch" not in why, why
    task = probe(path)
    tuned = ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)[1].candidate
    launched = _emulate(path, [tuned], 1e-12)
    assert any(k.endswith("_take16") for k in launched), launched


@needs_gxx
@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_copies_match_pytorch_exactly(tmp_path, name):
    result = check_task(_path(tmp_path, name), 1e-12, edits=2)
    assert result["outcome"] == "ok" and "move" in result["why"], result


@needs_gxx
def test_aligned_rows_move_16_bytes_a_thread_and_others_an_element(tmp_path):
    path = _path(tmp_path, "cats")
    task = probe(path)
    plain, tuned = (
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    )
    assert "_move16" not in plain.source and "_move16" in tuned.source
    launched = _emulate(path, [tuned], 1e-12)
    # the first cat's pieces are whole rows of 64 floats: 16 bytes; the transposed ones go by the element
    assert any(k.endswith("_move16") for k in launched) and any(k.endswith("_move") for k in launched), (
        launched
    )


@needs_gxx
@pytest.mark.parametrize(
    ("expr", "shape", "kernel"),
    [
        # Swin's shifted windows, channels last: one launch, 16 bytes a unit (the run wraps at 16 bytes)
        ("torch.roll(x, shifts=(-3, -3), dims=(1, 2))", "(2, 7, 9, 32)", "_place16"),
        ("torch.roll(x, 5, -1)", "(2, 7, 9, 32)", "_place"),  # a shift of 5 floats: by the element
        ("F.pad(x, (3, 3, 3, 3))", "(2, 7, 9, 32)", "_place"),  # rows of 38: by the element
        ("F.pad(x, (0, 0, 0, 0, 1, 2), value=2.5)", "(2, 7, 9, 32)", "_place16"),  # whole planes of 288
    ],
)
def test_pads_and_rolls_are_one_launch_over_the_output(tmp_path, expr, shape, kernel):
    """Each output element written once by one kernel, where padding was a copy of the middle and a band a
    side (9 launches, rows of 3 for an image) and a roll a copy a block it moves."""
    body = f"class Model(nn.Module):\n    def forward(self, x):\n        return {expr}"
    path = task_file(tmp_path, "placed", body, f"[torch.randn{shape}]")
    task = probe(path)
    tuned = ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)[1].candidate
    launched = _emulate(path, [tuned], 1e-12)
    assert len(launched) == 1 and launched[0].endswith(kernel), launched


@needs_nvcc
def test_copy_kernels_compile_for_sm90a_without_spills(tmp_path):
    cands = []
    for name in (
        "flips",
        "rolls",
        "cat_f16_empty",
        "indices",
        "repeats",
        "pads",
        "edge_pads",
        "im2col",
        "takes",
        "gathers",
    ):
        task = probe(_path(tmp_path, name))
        cands += [
            p.candidate
            for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
        ]
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status == Status.OK and not b.log, (c.edit, b.log)
        assert all(r.spill_stores == 0 for r in b.resources), (c.edit, b.resources)


def test_the_movement_suite_is_written_as_our_copies_alone():
    """tasks/movement (the suite a GPU bench times against eager and torch.compile): every task ours."""
    paths = sorted((ROOT / "tasks" / "movement").glob("*.py"))
    assert len(paths) == 5
    for path in paths:
        ok, why = supports(path)
        assert ok and "move" in why and "left to PyTorch" not in why, (path.name, why)


@needs_gxx
def test_mT_swapaxes_and_movedim_are_views_not_pytorch_calls(tmp_path):
    """They reached the launcher as aten calls left to PyTorch; they are transposes and permutes."""
    body = (
        "class Model(nn.Module):\n    def forward(self, x):\n"
        "        return x.mT * 2, x.swapaxes(0, 2) + 1, torch.movedim(x, (0, 2), (2, 1)).relu(), x.movedim(-1, 0)"
    )
    path = task_file(tmp_path, "views", body, "[torch.randn(3, 5, 7)]")
    ok, why = supports(path)
    assert ok and "left to PyTorch" not in why, why
    task = probe(path)
    cands = [
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    ]
    _emulate(path, cands, 1e-6)


@pytest.mark.parametrize("name", ["im2col", "edge_pads", "gathers"])
def test_copy_launchers_leave_nothing_to_pytorch(tmp_path, name):
    """Every call in the launcher is plumbing or our kernel (an im2col's `(torch.zeros if p else torch.empty)(...)`
    was an unresolved call to the check, so the candidate counted as hybrid)."""
    task = probe(_path(tmp_path, name))
    for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2):
        report = check_launcher(p.candidate.launcher)
        assert report.ok and not [o for o in report.library_ops if "aten" not in o], (
            p.candidate.edit,
            report,
        )


# Elementwise producers of a cat or stack, sunk (the tuned plan, and fuse_kernels on the plain one): each
# writes into its slice of the output. name -> (forward's body over x and y, inputs, the values sunk).
SUNK = {
    "channels": (  # an Inception-style join along dim 1, rows 16-byte aligned: the vector path
        "return torch.cat([torch.relu(x), y * 0.5 + 1.0, x], dim=1)",
        "[torch.randn(3, 8, 4, 6), torch.randn(3, 4, 4, 6)]",
        2,
    ),
    "odd_last_dim": (  # along the last dim, odd widths: scalar rows of 5 at a stride of 12
        "return torch.cat([x, torch.tanh(y), torch.exp(-x)], -1)",
        "[torch.randn(2, 7, 5), torch.randn(2, 7, 2)]",
        2,
    ),
    "dim0_bf16": (  # along dim 0: each slot one contiguous block; bf16 stores
        "return torch.cat([x * 2, y.relu()], 0)",
        "[torch.randn(3, 40, dtype=torch.bfloat16), torch.randn(5, 40, dtype=torch.bfloat16)]",
        2,
    ),
    "stack_and_repeat": (  # a stack's select slot; a value read twice by the cat is copied, not sunk
        "a = torch.relu(y[:, 1:])\n        return torch.stack([x * 3, y[:, :8], x], 1), torch.cat([a, a], 1)",
        "[torch.randn(6, 8), torch.randn(6, 9)]",
        1,
    ),
    "broadcast": (  # an operand broadcast to the whole (expanded first) and a one-element one: sunk; a
        # column operand (a bias along the last dims) fixes the kernel's rows: its producer is copied
        "return torch.cat([x, x + y[0, :1], x * z], 2), torch.cat([x + y, x], 1)",
        "[torch.randn(2, 3, 4), torch.randn(3, 1), torch.randn(2, 1, 4)]",
        2,
    ),
}


def _sunk_path(tmp_path, name: str):
    body, inputs, _ = SUNK[name]
    args = "x, y, z" if inputs.count("randn") == 3 else "x, y"
    return task_file(
        tmp_path, name, f"class Model(nn.Module):\n    def forward(self, {args}):\n        {body}", inputs
    )


@needs_gxx
@pytest.mark.parametrize("name", sorted(SUNK))
def test_elementwise_producers_write_into_their_slice_of_a_cat(tmp_path, name):
    """The tuned plan sinks: the producer's launcher is called with out= its slice (a _Slot stands in for its
    result until the cat has allocated), and only the other inputs are copied; exact against eager."""
    path = _sunk_path(tmp_path, name)
    task = probe(path)
    plain, tuned = (
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    )
    assert "_Slot(" not in plain.launcher
    assert tuned.launcher.count("= _Slot(") == SUNK[name][2], tuned.launcher
    assert tuned.launcher.count(", out=s_") == SUNK[name][2]
    report = check_launcher(tuned.launcher)
    assert report.ok and not report.library_ops, report
    _emulate(path, [plain, tuned], 1e-6)  # fp32 functions against float64 (bf16: against eager)
    result = check_task(path, 1e-6, edits=3)  # the plain plan's fuse_kernels(sink) among the edits
    assert result["outcome"] == "ok", result


@needs_gxx
def test_a_sunk_producer_copies_nothing_of_its_own(tmp_path):
    """channels: three inputs, two sunk: the cat launches one copy (x's, by the joined copy), the relu and
    the affine map writing their own slices, where the plain plan copies all three."""
    from cuda_emulator import build, load_model
    from fuzz_expert import reference

    path = _sunk_path(tmp_path, "channels")
    task = probe(path)
    plain, tuned = (
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    )
    r = reference(path, None)
    copies = []
    for cand in (plain, tuned):
        kernels = build(cand.source)
        model = load_model(cand.launcher, kernels, sms=8)()
        with torch.no_grad():
            model(*r.inputs)
        copies.append(sum(k.startswith(("kp_cat_move", "kp_cat_join")) for k, *_ in kernels.launches))
        launched = [k for k, *_ in kernels.launches]
    assert copies == [3, 1], copies
    assert "kp_relu_v4" in launched, launched  # rows of 192 floats at a stride of 384: 16-byte stores


@needs_gxx
def test_a_slot_that_is_not_rows_of_runs_is_refused_not_miswritten():
    """_out_rows on a view whose rows are not evenly spaced contiguous runs raises (the call fails loudly)."""
    import math

    from pipeline.generate.expert.templates.code import LAUNCHER_HELPERS, ROWS_HELPERS, SINK_HELPERS

    scope = {"torch": torch, "math": math}
    exec(LAUNCHER_HELPERS + ROWS_HELPERS + SINK_HELPERS, scope)
    out = torch.empty(4, 6, 5)
    assert scope["_out_rows"](out.narrow(1, 2, 3), (4, 3, 5), torch.float32) == (1, 30)
    assert scope["_out_rows"](out.narrow(0, 1, 2), (2, 6, 5), torch.float32) == (0, 60)
    assert scope["_out_rows"](out.narrow(2, 1, 2), (4, 6, 2), torch.float32) == (2, 5)
    with pytest.raises(ValueError, match="not rows of contiguous runs"):
        scope["_out_rows"](out.transpose(0, 1), (6, 4, 5), torch.float32)
    with pytest.raises(ValueError, match="not"):
        scope["_out_rows"](out.narrow(1, 0, 3), (4, 3, 5), torch.float16)


FIRE = """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.squeeze = nn.Conv2d(6, 4, 1)
        self.expand1 = nn.Conv2d(4, 5, 1)
        self.expand3 = nn.Conv2d(4, 3, 3, padding=1)
        self.dw = nn.Conv2d(6, 6, 3, padding=1, groups=6)

    def forward(self, x):
        s = torch.relu(self.squeeze(x))
        return torch.cat([torch.relu(self.expand1(s)), torch.relu(self.expand3(s)), self.dw(x)], 1)
"""


@needs_gxx
def test_convolutions_write_into_their_slice_of_a_channel_cat(tmp_path):
    """A SqueezeNet fire module (and a depthwise branch): our direct convolutions, their bias and ReLU fused,
    write their outputs straight into the cat's channel slices at its batch stride; nothing is copied."""
    from cuda_emulator import build, load_model
    from fuzz_expert import reference

    path = task_file(tmp_path, "fire", FIRE, "[torch.randn(2, 6, 9, 7)]")
    task = probe(path)
    plain, tuned = (
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    )
    assert tuned.launcher.count("= _Slot(") == 3 and tuned.launcher.count(", out=s_cat[") == 3, tuned.launcher
    assert check_launcher(tuned.launcher).ok
    _emulate(path, [plain, tuned], 1e-6)
    r = reference(path, None)
    kernels = build(tuned.source)
    model = load_model(tuned.launcher, kernels, sms=8)()
    model.load_state_dict(r.state, strict=False)
    with torch.no_grad():
        model(*r.inputs)
    launched = [k for k, *_ in kernels.launches]
    assert not [k for k in launched if "_move" in k] and sum(k.endswith("_dconv") for k in launched) == 4, (
        launched
    )


INCEPTION = """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(64, 64, 1)
        self.b = nn.Conv2d(64, 32, 3, padding=1)

    def forward(self, x):
        return torch.cat([self.a(x), torch.relu(self.b(x)), x], 1)
"""


@needs_nvcc
def test_implicit_gemm_convolutions_take_their_slice_and_compile(tmp_path):
    """The tuned plan's WGMMA convolutions (not emulated: the GPU test `conv_cat_sink` runs them) are handed
    their channel slices of the cat (out=, the image stride as `ldo`); the plain plan's cuDNN calls and
    their bias-and-ReLU chains (a per-channel operand fixes the chain's rows) are copied. Both compile."""
    path = task_file(tmp_path, "inception", INCEPTION, "[torch.randn(2, 64, 12, 12)]")
    task = probe(path)
    plain, tuned = (
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    )
    assert "_Slot(" not in plain.launcher
    assert tuned.launcher.count(", out=s_cat[") == 2 and "ldo = _batch_stride(out" in tuned.launcher
    assert "long long ldo" in tuned.source and check_launcher(tuned.launcher).ok
    builds = compile_candidates([plain, tuned], Config(home=tmp_path / "home", arch="sm_90a"))
    assert all(b.status == Status.OK for b in builds), [b.log[:500] for b in builds]


@needs_gxx
@pytest.mark.parametrize(
    ("dtype", "width"), [("float32", 16), ("bfloat16", 24), ("int8", 32), ("int64", 6), ("bool", 48)]
)
def test_a_flip_of_the_last_dim_reads_backwards_16_bytes_at_a_time(tmp_path, dtype, width):
    """Rows whose width is a whole number of 16-byte units move a unit a thread read backwards, its lanes
    reversed (4 floats, 8 halves, 16 bytes, 2 int64), also flipped along an outer dim; exact."""
    make = (
        f"torch.randn(3, 5, {width}).to(torch.{dtype})"
        if dtype != "int8"
        else f"torch.randint(-100, 100, (3, 5, {width}), dtype=torch.int8)"
    )
    if dtype == "bool":
        make = f"torch.randn(3, 5, {width}) > 0"
    body = "class Model(nn.Module):\n    def forward(self, x):\n        return torch.flip(x, dims=(-1,)), x.flip(0, 2)"
    path = task_file(tmp_path, f"flip_{dtype}", body, f"[{make}]")
    task = probe(path)
    tuned = ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)[1].candidate
    launched = _emulate(path, [tuned], 1e-12)
    assert sum(k.endswith("_move16r") for k in launched) == 2, launched


@needs_gxx
@pytest.mark.parametrize(("dim", "sunk"), [(0, 2), (2, 0), (-1, 0)])
def test_a_convolution_sinks_only_into_whole_images(tmp_path, dim, sunk):
    """A convolution writes each image as one block at a batch stride: it sinks into a join along the
    batch or the channels, and is copied into one along the height or width (its slice's rows are apart)."""
    body = FIRE.replace(
        "return torch.cat([torch.relu(self.expand1(s)), torch.relu(self.expand3(s)), self.dw(x)], 1)",
        f"return torch.cat([torch.relu(self.expand1(s)), torch.relu(self.expand1(s) * 2)], {dim})",
    )
    path = task_file(tmp_path, f"join{dim % 4}", body, "[torch.randn(2, 6, 9, 7)]")
    task = probe(path)
    plain, tuned = (
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    )
    assert tuned.launcher.count("= _Slot(") == sunk, tuned.launcher
    _emulate(path, [plain, tuned], 1e-6)


@needs_gxx
def test_a_pieces_launch_is_planned_once_a_geometry(tmp_path):
    """The second call of a cat with the same shapes takes each piece's launch from the plan cache (no dims
    merged, no grid sized again) and launches the same kernels with the same arguments; a new shape plans
    anew."""
    from cuda_emulator import build, load_model

    path = _path(tmp_path, "cats")
    task = probe(path)
    tuned = ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)[1].candidate
    kernels = build(tuned.source)
    model = load_model(tuned.launcher, kernels, sms=8)()
    plans = model.forward.__globals__["_plans_cat_1"]  # the cat of two transposed views: a piece each
    x = torch.randn(4, 64, 64)
    with torch.no_grad():
        first = model(x)
        n, launched = len(plans), list(kernels.launches)
        second = model(x)
        assert len(plans) == n == 2 and [k for k, *_ in kernels.launches[len(launched) :]] == [
            k for k, *_ in launched
        ]
        model(torch.randn(2, 64, 8))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert len(plans) == 4  # the two views' pieces, at the new shape too


@needs_gxx
@pytest.mark.parametrize(
    ("chans", "height", "width", "dtype"),
    [(16, 2, 8, "float32"), (5, 1, 7, "float32"), (16, 2, 16, "bfloat16")],
)
def test_a_cats_contiguous_inputs_are_copied_by_one_launch_a_sixteen(tmp_path, chans, height, width, dtype):
    """A DenseNet-style join of 20 inputs: the 18 contiguous ones go by the joined copy, 16 a launch (two
    launches), 16 bytes a thread where every run and place allows (runs of 35 floats: no); a transposed
    input still goes by its own piece and a ReLU writes its own slice; exact."""
    body = (
        "class Model(nn.Module):\n    def forward(self, x, y):\n"
        "        return torch.cat([x] * 18 + [y.mT, torch.relu(y.mT)], 1)"
    )
    x = f"torch.randn(3, {chans}, {height}, {width}).to(torch.{dtype})"
    path = task_file(
        tmp_path, f"join{width}", body, f"[{x}, torch.randn(3, 4, {width}, {height}).to(torch.{dtype})]"
    )
    task = probe(path)
    tuned = ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)[1].candidate
    launched = _emulate(path, [tuned], 1e-12)
    joins = [k for k in launched if "_join" in k]
    assert len(joins) == 2 and all(k.endswith("join16") == (width != 7) for k in joins), launched


@needs_gxx
def test_the_joins_suite_sinks_and_joins(tmp_path):
    """tasks/joins (a GPU bench's suite): the fire module's expands write their slices of the cat (tuned),
    the dense join copies its 13 inputs by one joined launch; both emulated on their alternative inputs."""
    from pipeline.tasks import load_module

    fire, dense = ROOT / "tasks" / "joins" / "fire_module.py", ROOT / "tasks" / "joins" / "dense_join.py"
    for path, slots in ((fire, 2), (dense, 0)):
        task = probe(path)
        plain, tuned = (
            p.candidate
            for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
        )
        assert tuned.launcher.count("= _Slot(") == slots, tuned.launcher
        if path == dense:
            launched = _emulate(path, [plain, tuned], 1e-12, inputs=load_module(path).get_alt_inputs()[0])
            joins = [k for k in launched if k.startswith("kp_cat_join")]
            assert len(joins) == 1 and launched.count("kp_cat_move") == 13, launched  # plain: a piece each


@needs_gxx
def test_a_convolution_with_a_fused_residual_is_copied_not_sunk(tmp_path):
    """A chain fused on a direct convolution's stores that reads an operand at the output's own offsets (a
    residual) cannot write at the cat's batch stride: that branch is copied, the plain one sunk; exact."""
    body = FIRE.replace(
        "return torch.cat([torch.relu(self.expand1(s)), torch.relu(self.expand3(s)), self.dw(x)], 1)",
        "return torch.cat([torch.relu(self.expand1(s) + r), torch.relu(self.expand3(s))], 1)",
    ).replace("def forward(self, x):", "def forward(self, x, r):")
    path = task_file(tmp_path, "residual", body, "[torch.randn(2, 6, 9, 7), torch.randn(2, 5, 9, 7)]")
    task = probe(path)
    plain, tuned = (
        p.candidate for p in ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    )
    assert tuned.launcher.count("= _Slot(") == 1, tuned.launcher
    _emulate(path, [plain, tuned], 1e-6)


def test_a_pads_fill_is_the_dtypes_bits_repeated_to_64():
    """The placement kernel takes the fill as bits: any unit (an element, 16 bytes) is made of its copies.
    A value the dtype cannot hold is refused at render, as eager's fill refuses it."""
    from pipeline.generate.expert.families.base import RenderError
    from pipeline.generate.expert.templates.movement import fill_bits

    assert fill_bits(-0.0, "float32") == 0x80000000_80000000  # the sign of zero kept
    assert fill_bits(1.5, "bfloat16") == 0x3FC0_3FC0_3FC0_3FC0
    assert fill_bits(1 / 3, "bfloat16") == 0x3EAB_3EAB_3EAB_3EAB  # rounded to nearest, as torch rounds
    assert fill_bits(True, "bool") == 0x01010101_01010101 and fill_bits(-7, "int64") == 2**64 - 7
    with pytest.raises(RenderError, match="cannot hold"):
        fill_bits(300, "uint8")


def test_kernels_left_unbounded_are_bounded_where_a_block_would_not_launch():
    """The reversing copy and the placement kernel run unbounded at up to 512 threads a block (64 to 80
    registers: bounded at 256 the reversing copy spilled); resize_grid may ask 1024, where 80 registers a
    thread would not launch: bounded there."""
    from pipeline.generate.expert.templates.movement import _bounds

    assert _bounds(256) == "" and _bounds(512) == ""
    assert _bounds(1024).strip() == "__launch_bounds__(1024)"
