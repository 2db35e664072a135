"""The fp16x3 form of our fp32 GEMM (templates/gemm_f16x3.py): its split kernels emulated against the
arithmetic they promise, its launcher end to end with the WGMMA product stood in for by torch on what its
tensor maps describe, the edit that moves a plan to it and back, and its builds for sm_90a."""

from __future__ import annotations

import re

import numpy
import pytest
import torch
from expert_plans import with_knobs
from test_gemm import PRODUCT, linear, task

from pipeline.compile import _cutlass, compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, capture, plan_of
from pipeline.generate.expert.edits import base_plan, legal_edits
from pipeline.generate.expert.families.gemm_tf32 import Tf32Plan
from pipeline.generate.expert.render import prepare
from pipeline.generate.expert.templates import gemm_f16x3
from pipeline.static_check import check_launcher
from pipeline.tasks import load_module, probe
from pipeline.types import Status

F32 = ".to(torch.float32)"


def split_ref(lines: torch.Tensor, ld: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the split promises for each line (last dim): e with max|x| * 2^-e in [2^14, 2^15) (0 for zeros),
    hi = fp16(x * 2^-e), lo = fp16(x * 2^-e - hi), rows zero-padded to ld."""
    mx = lines.abs().amax(-1)
    _, e = torch.frexp(mx)
    e = torch.where(mx > 0, e - 15, torch.zeros_like(e))
    v = (lines.double() * torch.pow(2.0, -e.double())[..., None]).float()  # exact: a power of two
    hi = v.half()
    lo = (v - hi.float()).half()
    pad = ld - lines.shape[-1]
    return (torch.nn.functional.pad(hi, (0, pad)), torch.nn.functional.pad(lo, (0, pad)), e.to(torch.int32))


def lines_of_every_scale() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 37, generator=g)
    x[1] = 0.0  # a line of zeros: exponent 0
    x[2] *= 1e-42  # subnormal floats: 2^-e is not a float, ldexpf still exact
    x[3] *= 1e30
    x[4, ::5] *= 1e4  # a few large entries: the rest keep their bits below them
    x[5, 7] = -65536.0  # the largest magnitude negative, an exact power of two
    return x


def test_the_split_kernels_cut_each_line_as_the_arithmetic_says(tmp_path):
    from cuda_emulator import build

    k = build(gemm_f16x3.SPLIT.replace("RID", "t"), tmp_path)
    x = lines_of_every_scale()
    ld = 40  # padded to 16 bytes of fp16
    hi, lo = torch.full((6, ld), float("nan")).half(), torch.full((6, ld), float("nan")).half()
    exps = torch.full((6,), -999, dtype=torch.int32)
    k.kp_t_rowsplit((4,), (256,), (x, hi, lo, exps, numpy.int64(6), numpy.int64(37), numpy.int64(ld)))
    want = split_ref(x, ld)
    for got, w in zip((hi, lo, exps), want, strict=True):
        assert torch.equal(got, w), (got, w)
    # lines of a multiple of 4 floats: 16-byte loads, 8-byte stores (the padding written as zeros too)
    x4 = x[:, :36].contiguous()
    h4, l4 = torch.full((6, ld), float("nan")).half(), torch.full((6, ld), float("nan")).half()
    e4 = torch.full((6,), -999, dtype=torch.int32)
    k.kp_t_rowsplit((4,), (256,), (x4, h4, l4, e4, numpy.int64(6), numpy.int64(36), numpy.int64(ld)))
    for got, w in zip((h4, l4, e4), split_ref(x4, ld), strict=True):
        assert torch.equal(got, w), (got, w)
    # hi + lo holds each value to 2^-22 of its line's largest (the dropped lo.lo term is smaller still)
    back = (hi.double() + lo.double())[:, :37] * torch.pow(2.0, exps.double())[:, None]
    assert ((back - x.double()).abs() <= 2.0**-22 * x.double().abs().amax(-1, keepdim=True)).all()

    # columns of a row-major (batch, K, N) B over K, transposed into (batch, N, ld) rows
    b = torch.stack([x.t()[:, :5], x.t()[:, 1:6]])  # (2, 37, 5): the lines are its columns
    hb, lb = torch.full((2, 5, ld), float("nan")).half(), torch.full((2, 5, ld), float("nan")).half()
    eb = torch.full((2, 5), -999, dtype=torch.int32)
    k.kp_t_colsplit((1, 2), (256,), (b, hb, lb, eb, numpy.int64(37), numpy.int64(5), numpy.int64(ld)))
    want = split_ref(b.transpose(1, 2), ld)
    for got, w in zip((hb, lb, eb), want, strict=True):
        assert torch.equal(got, w), (got, w)


class _F16x3Kernels:
    """The launcher's kernels: the splits emulated from the source, the WGMMA product stood in for by torch on
    the tensors its maps describe (a_hi.b_hi + a_hi.b_lo + a_lo.b_hi, unscaled by the exponents)."""

    def __init__(self, emulated):
        self.emulated = emulated
        self.maps: list[tuple] = []
        self.called: list[str] = []

    def tensor_map(self, t, box_rows, box_cols, swizzle=128):
        assert t.dtype == torch.float16 and t.is_contiguous() and t.shape[-1] % 8 == 0, (t.dtype, t.shape)
        self.maps.append((tuple(t.shape), box_rows, box_cols))
        return t

    def __getattr__(self, name):
        self.called.append(name)
        return self._gemm if name.endswith("_gemm") else getattr(self.emulated, name)

    @staticmethod
    def _gemm(grid, block, args, shared_mem=0):
        ah, al, bh, bl, out, ea, eb = args[:7]
        m, n, kp = (int(v) for v in args[-3:])
        assert ah.shape[-2:] == (m, kp) and bh.shape[-2:] == (n, kp)
        ah, al, bh, bl = (t.double() for t in (ah, al, bh, bl))
        prod = ah @ bh.transpose(-1, -2) + ah @ bl.transpose(-1, -2) + al @ bh.transpose(-1, -2)
        scale = torch.pow(2.0, ea.double().reshape(-1, m, 1) + eb.double().reshape(-1, 1, n))
        out.copy_((prod * scale).reshape(out.shape).to(out.dtype))


@pytest.mark.parametrize(
    ("name", "expr", "a", "b"),
    [
        ("mm", "torch.mm(a, b)", (150, 70), (70, 45)),  # B row-major: colsplit, K padded to 72
        ("bmm", "torch.bmm(a, b)", (3, 130, 64), (3, 64, 33)),
        ("linear", "F.linear(a, b)", (2, 80, 70), (33, 70)),  # a (N, K) weight: rowsplit for both
        # transposed views, split in place by the other kernel (no gather): A (K, M) read by columns, B (N, K)
        ("mm_at", "torch.matmul(a.t(), b)", (70, 150), (70, 45)),
        ("mm_bt", "torch.matmul(a, b.t())", (150, 70), (45, 70)),
        ("bmm_both", "torch.bmm(a.transpose(1, 2), b.transpose(1, 2))", (3, 64, 130), (3, 33, 64)),
    ],
)
def test_the_launcher_splits_both_operands_and_unscales_the_product(tmp_path, name, expr, a, b):
    from cuda_emulator import build, load_model

    from pipeline.generate.expert.templates.code import GATHER

    inputs = ", ".join(f"torch.randn{s}{F32}" for s in (a, b))
    path = task(tmp_path, f"f16x3_{name}", PRODUCT.format(expr=expr), inputs)
    t = probe(path)
    tuned = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
    cand = with_knobs(path, tuned, "wgmma_3xtf32", f16=True, persistent=False, splits=1, stages=3)
    assert check_launcher(cand.launcher).ok and "fp16x3 WGMMA kernel" in cand.launcher
    rid = re.search(r"kernels\.kp_(\w+)_rowsplit\(", cand.launcher).group(1)
    fake = _F16x3Kernels(build(gemm_f16x3.SPLIT.replace("RID", rid) + "\n" + GATHER, tmp_path))
    model = load_model(cand.launcher, fake)()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(a, generator=g), torch.randn(b, generator=g)
    x[..., 0, :] *= 1e5  # one row far larger than the others: scales are a row's own
    ref = load_module(path).Model()(x.double(), y.double())
    got = model(x, y)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    rel = ((got.double() - ref).abs() / ref.abs().amax(-1, keepdim=True)).max().item()
    assert rel < 2.0**-20, rel
    assert len(fake.maps) == 4 and all(m[1:] == (128, 64) for m in fake.maps[:2])
    assert not any(c.startswith("kp_gather") for c in fake.called), fake.called  # views read in place
    splits = [c.rsplit("_", 1)[1] for c in fake.called if c.endswith("split")]
    want = {
        "mm": ["rowsplit", "colsplit"],
        "bmm": ["rowsplit", "colsplit"],
        "linear": ["rowsplit"] * 2,
        "mm_at": ["colsplit"] * 2,
        "mm_bt": ["rowsplit"] * 2,
        "bmm_both": ["colsplit", "rowsplit"],
    }[name]
    assert splits == want, splits


class _F16x3PersistentKernels(_F16x3Kernels):
    """The same for the persistent grid: one block an SM (the emulated GPU's 4), at most one a tile, and the
    tile count passed last."""

    def _gemm(self, grid, block, args, shared_mem=0):
        m, n, tiles = (int(v) for v in (args[-4], args[-3], args[-1]))
        bn = self.maps[2][1]  # b_hi's box: the tile's width
        assert tiles == args[0].shape[0] * -(-m // 128) * -(-n // bn) and grid == (min(tiles, 4),), (
            grid,
            tiles,
        )
        _F16x3Kernels._gemm(grid, block, args[:-1], shared_mem)


def test_a_persistent_fp16x3_launch_walks_every_tile_on_one_block_an_sm(tmp_path):
    """persistent_grid on the fp16x3 form (a grid of more than a wave): the launch takes min(tiles, SMs)
    blocks and passes the tile count; the product is the split operands' as on a block a tile."""
    from cuda_emulator import build, load_model

    from pipeline.generate.expert.templates.code import GATHER

    path = task(tmp_path, "f16x3_persist", PRODUCT.format(expr="torch.mm(a, b)"),
                f"torch.randn(300, 70){F32}, torch.randn(70, 520){F32}")  # fmt: skip
    t = probe(path)
    tuned = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
    cand = with_knobs(path, tuned, "wgmma_3xtf32", f16=True, persistent=True, splits=1, stages=3)
    assert check_launcher(cand.launcher).ok and "stages, persistent)" in cand.launcher
    assert "coords((int)blockIdx.x + j * (int)gridDim.x" in cand.source
    rid = re.search(r"kernels\.kp_(\w+)_rowsplit\(", cand.launcher).group(1)
    fake = _F16x3PersistentKernels(build(gemm_f16x3.SPLIT.replace("RID", rid) + "\n" + GATHER, tmp_path))
    model = load_model(cand.launcher, fake)()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, 70, generator=g), torch.randn(70, 520, generator=g)
    ref = x.double() @ y.double()
    got = model(x, y)
    assert ((got.double() - ref).abs() / ref.abs().amax(-1, keepdim=True)).max().item() < 2.0**-20
    assert "kp_" + rid + "_gemm" in fake.called


class _F16x3SplitKernels(_F16x3Kernels):
    """The same, block for block over the split of K (each split's unscaled partial into its workspace slice,
    as the kernel's blocks store them); the sum kernel emulated from the source."""

    def _gemm(self, grid, block, args, shared_mem=0):
        ah, al, bh, bl, ws, ea, eb = args[:7]
        m, n, kp = (int(v) for v in args[-3:])
        splits = grid[1]
        ktiles = -(-kp // gemm_f16x3.BK)
        chunk = -(-ktiles // splits) * gemm_f16x3.BK  # the kernel's share of k tiles a split
        scale = torch.pow(2.0, ea.double().reshape(-1, m, 1) + eb.double().reshape(-1, 1, n))
        for z in range(splits):
            lo, hi = min(kp, z * chunk), min(kp, (z + 1) * chunk)
            a_h, a_l, b_h, b_l = (t[..., lo:hi].double() for t in (ah, al, bh, bl))
            part = a_h @ b_h.transpose(-1, -2) + a_h @ b_l.transpose(-1, -2) + a_l @ b_h.transpose(-1, -2)
            ws[z].copy_((part * scale).reshape(ws.shape[-2:]).to(ws.dtype))
        self.grids.append(grid)

    def __init__(self, emulated):
        super().__init__(emulated)
        self.grids: list[tuple] = []


def test_a_split_fp16x3_product_sums_its_partials_and_computes_the_epilogue_on_the_total(tmp_path):
    """Few tiles over a long K (77 x 200 over 4100, the tuned plan split 8 ways): in the fp16x3 form the split
    stays, each block's partial is unscaled before it is stored, and the sum kernel (emulated) adds them and
    computes the bias, residual and ReLU on the total."""
    from cuda_emulator import build, load_model
    from test_gpu_expert import family_task

    from pipeline.generate.expert.families import gemm_kit
    from pipeline.generate.expert.families import gemm_tf32 as tf32_family
    from pipeline.generate.expert.templates import gemm
    from pipeline.generate.expert.templates import gemm_tf32 as tf32_template
    from pipeline.generate.expert.templates.code import GATHER
    from pipeline.generate.expert.templates.common import PRELUDE

    path = family_task(tmp_path, "linear_f32_split", "(77, 4100); (77, 200)")
    low = prepare(capture(path))
    t = probe(path)
    tuned = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
    (g,) = [rp for rp in plan_of(tuned.source).regions if isinstance(rp, Tf32Plan)]
    assert g.splits == 8 and not g.f16  # the tuned plan keeps 3xTF32 where it splits K
    (f16,) = [
        p for label, p in legal_edits(plan_of(tuned.source), low) if label.startswith("use_tensor_cores")
    ]
    assert f16.get(g.rid).f16 and f16.get(g.rid).splits == 8
    cand = with_knobs(path, tuned, "wgmma_3xtf32", f16=True, stages=gemm_f16x3.max_stages(g.bn))
    assert (
        "SPLITS = 8" in cand.source and "K split 8 ways" in cand.launcher and check_launcher(cand.launcher).ok
    )
    region = next(r for r in low.regions if r.rid == g.rid)
    epi = (tf32_family.SPEC.epilogue_of and tf32_family.SPEC.epilogue_of(region, low)) or gemm_kit.epilogue(
        region, low
    )
    sig = tf32_template._sum_signature(epi, "float32", 8)
    src = "\n".join([PRELUDE, *gemm.epilogue_function(epi, "float32"),
                     tf32_template._split_sum_epilogue(g.rid, epi, "float32", sig)])  # fmt: skip
    fake = _F16x3SplitKernels(
        build(src + "\n" + gemm_f16x3.SPLIT.replace("RID", g.rid) + "\n" + GATHER, tmp_path)
    )
    torch.manual_seed(0)
    ref = load_module(path).Model()
    model = load_model(cand.launcher, fake)()
    model.load_state_dict(ref.state_dict())
    x, y = torch.randn(77, 4100), torch.randn(77, 200)
    with torch.no_grad():
        want = ref.double()(x.double(), y.double())
        got = model(x, y)
    assert ((got.double() - want).abs() / want.abs().max()).max().item() < 2.0**-20
    assert fake.grids == [(7, 8)]


def test_a_long_k_takes_fp16x3_in_the_tuned_plan_hedged_by_3xtf32_and_moved_back_and_forth(tmp_path):
    """K whole and at least F16_MIN_K: the tuned plan's fp16x3 form; the first batch times the 3xTF32 plan
    the tuned rule would give (here a persistent grid: 256 tiles); use_tensor_cores moves between them,
    and no move from fp16x3 makes a plan its template cannot render."""
    path = task(tmp_path, "mm_moves", PRODUCT.format(expr="torch.mm(a, b)"),
                f"torch.randn(2048, 1024){F32}, torch.randn(1024, 2048){F32}")  # fmt: skip
    low = prepare(capture(path))
    tuned = base_plan(low, True)
    (g,) = [rp for rp in tuned.regions if isinstance(rp, Tf32Plan)]
    assert g.f16 and g.splits == 1 and not g.persistent and g.stages == gemm_f16x3.max_stages(g.bn) == 3
    assert "tile=128x128x64" in g.describe() and g.describe().endswith("fp16x3")
    moves = legal_edits(tuned, low)
    label, back = moves[0]  # the hedge first
    b = back.get(g.rid)
    assert label.startswith("use_tensor_cores(") and not b.f16 and b.persistent and b.splits == 1
    forth = [p for lab, p in legal_edits(back, low) if lab.startswith("use_tensor_cores(")]
    assert [p.get(g.rid) for p in forth] == [g]
    for lab, p in moves:
        q = p.get(g.rid)
        if q.f16:  # persistent only by persistent_grid (256 tiles: more than a wave), never staged
            assert q.persistent == lab.startswith("persistent_grid("), lab
            assert not q.staged and q.stages <= gemm_f16x3.max_stages(q.bn)
    assert any(lab.startswith("persistent_grid(") for lab, _ in moves)


@pytest.mark.parametrize(("rows", "k", "n", "f16"), [
    (4096, 4096, 4096, True),
    (394, 512, 1536, True),  # ViT's qkv: under a wave of 128 x 64 tiles, K whole
    (394, 2048, 512, False),  # ViT's fc2: few tiles, K split: 3xTF32 (the fp16x3 form keeps K whole)
    (31360, 96, 384, False),  # Swin's stage-1 MLP: K = 96, a persistent 3xTF32 grid
])  # fmt: skip
def test_which_products_the_tuned_plan_gives_the_fp16x3_form(tmp_path, rows, k, n, f16):
    path = linear(tmp_path, f"t{rows}_{k}_{n}", k=k, n=n, dt="float32")
    path.write_text(path.read_text().replace("torch.randn(77,", f"torch.randn({rows},"))
    (g,) = [rp for rp in base_plan(prepare(capture(path)), True).regions if isinstance(rp, Tf32Plan)]
    assert g.f16 == f16, g


@pytest.mark.skipif(not _cutlass()[0], reason="nvidia-cutlass is not installed")
def test_fp16x3_instantiations_compile_for_sm90a_without_spills(tmp_path):
    """A row-major B (colsplit), a linear layer with its epilogue (a scaled ReLU) fused on the stores, a
    linear layer whose K the tuned plan splits (kept: partials stored, the sum kernel beside), a short-K
    product on a persistent grid, and two products in one source (the split's helpers defined once)."""
    split = linear(tmp_path, "split16c", k=4100, n=200, dt="float32")
    paths = [
        split,
        task(
            tmp_path,
            "mm32",
            PRODUCT.format(expr="torch.mm(a, b)"),
            f"torch.randn(300, 1028){F32}, torch.randn(1028, 1000){F32}",
        ),
        linear(tmp_path, "l32", k=1036, dt="float32", expr="torch.relu(self.linear(x)) * self.s"),
        task(  # level 1's short K: a persistent grid (persistent_grid from the fp16x3 form)
            tmp_path,
            "mm64",
            PRODUCT.format(expr="torch.mm(a, b)"),
            f"torch.randn(4096, 64){F32}, torch.randn(64, 4096){F32}",
        ),
        task(
            tmp_path,
            "two",
            # the ReLU fused on the second's stores: two texts (one product's twice would be one kernel)
            PRODUCT.format(expr="torch.relu(torch.mm(torch.mm(a, b), b.t()))"),
            f"torch.randn(300, 520){F32}, torch.randn(520, 520){F32}",
        ),
    ]
    cands = []
    for path in paths:
        t = probe(path)
        tuned = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
        gs = [rp for rp in plan_of(tuned.source).regions if isinstance(rp, Tf32Plan)]
        if path.stem == "two":  # the tuned plan's own form for both (K = 520)
            assert len(gs) == 2 and all(g.f16 for g in gs), gs
            cands.append(tuned)
            continue
        (g,) = gs
        stages = gemm_f16x3.max_stages(g.bn)
        keep = {} if path == split else {"splits": 1}
        persistent = path.stem == "mm64"
        cands.append(
            with_knobs(path, tuned, "wgmma_3xtf32", f16=True, persistent=persistent, stages=stages, **keep)
        )
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for path, c, b in zip(paths, cands, builds, strict=True):
        assert b.status == Status.OK and not b.log, b.log
        res = {r.name: r for r in b.resources}
        gemms = [r for name, r in res.items() if name.endswith("_gemm")]
        assert len(gemms) == (2 if path.stem == "two" else 1)
        for k in gemms:
            assert k.spill_stores == 0 and k.registers <= 168, k
            assert not k.wgmma_serialized and not k.wgmma_waits_injected, k
        assert all(res[n].spill_stores == 0 for n in res if n.endswith(("_rowsplit", "_colsplit")))
        assert "F32F16F16_SS" in c.source and c.source.count("cute::gemm(mma, ") == 3 * len(gemms), c.edit
    assert "SPLITS = " in cands[0].source and any(r.name.endswith("_splitk") for r in builds[0].resources)
    assert "the block's next tile" in cands[3].source
