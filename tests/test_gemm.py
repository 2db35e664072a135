"""The expert's own Hopper GEMM (templates/gemm.py) on the CPU: building blocks found in the installed CUTLASS
headers, which linear layers it takes, its plans and edits, and real nvcc compiles for sm_90a. Its results
on the GPU are in tests/test_gpu_expert.py (the linear_* families and the matmul task)."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

import pytest
import torch

from pipeline.candidates import make_candidate
from pipeline.compile import _cutlass, compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context, Outcome, ProposalStatus
from pipeline.generate.expert import ExpertPolicy, atoms, capture, plan_of
from pipeline.generate.expert.edits import base_plan, legal_edits, safer
from pipeline.generate.expert.families import gemm16, gemm_tf32
from pipeline.generate.expert.families.gemm16 import GemmPlan
from pipeline.generate.expert.families.gemm_kit import FEW_TILES
from pipeline.generate.expert.families.gemm_tf32 import Tf32Plan
from pipeline.generate.expert.regions import RegionKind
from pipeline.generate.expert.render import nvcc_flags, prepare, render, uses_cute
from pipeline.generate.expert.templates import gemm, gemm_f16x3
from pipeline.generate.expert.templates import gemm_tf32 as tf32_template
from pipeline.generate.expert.templates.code import CUTE_FLAGS
from pipeline.static_check import check_launcher
from pipeline.tasks import load_module, probe
from pipeline.types import Kind, Status

ROOT = Path(__file__).resolve().parent.parent
HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"


def task(folder: Path, name: str, body: str, inputs: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(
        HEADER + textwrap.dedent(body).strip() + f"\n\n\ndef get_inputs():\n    return [{inputs}]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    return path


LINEAR = """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear({k}, {n}, bias={bias}, dtype=torch.{dt})
        self.s = nn.Parameter(torch.rand({n}, dtype=torch.{dt}))
    def forward(self, x):
        return {expr}
"""


def linear(folder: Path, name: str, k=1032, n=1001, bias=True, dt="bfloat16", expr="self.linear(x)") -> Path:
    body = LINEAR.format(k=k, n=n, bias=bias, dt=dt, expr=expr)
    return task(folder, name, body, f"torch.randn(77, {k}, dtype=torch.{dt})")


PRODUCT = """
class Model(nn.Module):
    def forward(self, a, b, *c):
        return {expr}
"""


def product(folder: Path, name: str, a: tuple, b: tuple, expr="torch.matmul(a, b)", c: tuple = ()) -> Path:
    """A bf16 task multiplying two inputs (matmul, mm or bmm, B row-major (K, N)), with more inputs `c`."""
    inputs = ", ".join(f"torch.randn{s}.to(torch.bfloat16)" for s in (a, b, *c))
    return task(folder, name, PRODUCT.format(expr=expr), inputs)


# ------------------------------------------------------------------------------------------- atoms


@pytest.mark.parametrize(
    ("n", "dtype", "ptx"), [(256, "bfloat16", "bf16"), (128, "float16", "f16"), (64, "bfloat16", "bf16")]
)
def test_the_mma_atom_is_the_one_that_wraps_the_instruction(n, dtype, ptx):
    a = atoms.find(atoms.gmma(n, dtype))
    assert a.via == "headers" and a.header.startswith("cute/arch/mma_sm90_gmma")
    assert a.name.endswith(f"64x{n}x16_F32{ptx.upper()}{ptx.upper()}_SS")
    text = (Path(_cutlass()[0][0]) / a.header).read_text().splitlines()
    body = "\n".join(text[a.line - 1 : a.line + 80])
    assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx}" in body
    assert "desc_a" in body and "desc_b" in body  # both operands from shared-memory descriptors (SS, not RS)


def test_copy_barrier_and_layout_blocks_are_found_with_their_namespaces():
    found = {k: atoms.find(v) for k, v in
             (("tma", atoms.TMA_LOAD_3D), ("full", atoms.TX_BARRIER), ("empty", atoms.ARRIVE_BARRIER),
              ("smem", atoms.SW128_K), ("smem_mn", atoms.SW128_MN))}  # fmt: skip
    assert found["tma"].name == "SM90_TMA_LOAD_3D"
    assert found["smem_mn"].name.endswith("GMMA::Layout_MN_SW128_Atom")
    assert found["full"].name == "cutlass::arch::ClusterTransactionBarrier"
    assert found["empty"].name == "cutlass::arch::ClusterBarrier"
    assert found["smem"].name.endswith("GMMA::Layout_K_SW128_Atom")


def test_an_instruction_no_header_has_is_a_clear_error():
    need = atoms.Need(
        "an MMA that does not exist", "wgmma.mma_async.sync.aligned.m64n7k16", ("cute/arch/*.hpp",)
    )
    with pytest.raises(atoms.AtomNotFound, match="m64n7k16"):
        atoms.find(need)


def test_the_scanner_skips_braces_in_strings_and_comments():
    text = textwrap.dedent(
        """
        namespace outer { namespace inner {
        // struct Commented { "not a definition" };
        struct First {
          void f() { asm volatile("op {%0, %1};" : : "r"(x)); }  /* { unbalanced in a comment */
        };
        }  // inner
        struct Second { int x; };
        }
        """
    )
    defs = atoms._scan(text, "x.hpp", "struct")
    assert [(d.qualified, d.line) for d in defs] == [("outer::inner::First", 4), ("outer::Second", 8)]
    assert "op {%0, %1};" in defs[0].body


# ------------------------------------------------------------------------------------ what it takes


def test_which_linear_layers_the_template_takes(tmp_path):
    cases = {
        "bf16": (linear(tmp_path, "bf16"), ""),
        "fp32": (linear(tmp_path, "fp32", dt="float32"), "bf16 or fp16"),
        "odd_k": (linear(tmp_path, "odd_k", k=1001), ""),  # rows copied 16 bytes apart for TMA
    }
    for name, (path, why) in cases.items():
        low = prepare(capture(path))
        (lib,) = [r for r in low.regions if r.kind is RegionKind.LIBRARY]
        reason = gemm16.eligible(lib, low)
        assert (why in reason and reason) if why else reason == "", (name, reason)


def test_which_products_the_template_takes_and_how_their_operands_lie(tmp_path):
    K, MN = gemm.Form("K", False), gemm.Form("MN", False)
    cases = {
        "matmul": ((5, 3, 64), (64, 24), "torch.matmul(a, b)", MN),  # leading dims of A are rows
        "mm": ((5, 64), (64, 24), "torch.mm(a, b)", MN),
        "bmm": ((4, 5, 64), (4, 64, 24), "torch.bmm(a, b)", gemm.Form("MN", True)),
        "batched4d": ((2, 3, 5, 64), (2, 3, 64, 24), "a @ b", gemm.Form("MN", True)),
        "linear": ((5, 64), (24, 64), "F.linear(a, b)", K),
        "odd_n": ((5, 64), (64, 25), "torch.mm(a, b)", gemm.Form("MN", False, pad_rows=True)),
        "odd_k": ((4, 5, 60), (4, 60, 24), "torch.bmm(a, b)", gemm.Form("MN", True, pad_rows=True)),
        "odd_k_linear": ((5, 60), (24, 60), "F.linear(a, b)", gemm.Form("K", False, pad_rows=True)),
        "odd_n_linear": ((5, 64), (25, 64), "F.linear(a, b)", K),  # N of a K-major B: rows are K long
        # batch dims that broadcast: one bmm of the expanded operands (regions._broadcast_matmul)
        "broadcast": ((5, 64), (4, 64, 24), "torch.matmul(a, b)", gemm.Form("MN", True)),
    }
    for name, (a, b, expr, want) in cases.items():
        low = prepare(capture(product(tmp_path, name, a, b, expr)))
        (lib,) = [r for r in low.regions if r.kind is RegionKind.LIBRARY]
        got = gemm16.form(lib, low)
        assert got == want if isinstance(want, gemm.Form) else want in got, (name, got)
    # a matrix-vector product is no GEMM: a row-wise dot product (regions._gemv)
    low = prepare(capture(product(tmp_path, "vector", (5, 64), (64,), "torch.matmul(a, b)")))
    assert not [r for r in low.regions if r.kind is RegionKind.LIBRARY]
    assert [r.node.shape for r in low.regions if r.kind is RegionKind.REDUCE] == [(5,)]


def test_the_epilogue_indexes_bias_scale_and_scalars(tmp_path):
    path = linear(tmp_path, "epi", expr="torch.relu(self.linear(x)) * self.s + 0.5")
    low = prepare(capture(path))
    (lib,) = [r for r in low.regions if r.kind is RegionKind.LIBRARY]
    epi = gemm16.epilogue(lib, low)
    assert epi is not None and epi.out_dtype == "bfloat16"
    assert sorted(cls for _, _, cls in epi.operands) == ["col", "col"]  # the bias and the per-feature scale


def test_a_16_bit_epilogue_takes_the_hardware_tanh_and_an_fp32_one_the_exact_tanh(tmp_path):
    for expr, out_dt, mufu in (("torch.tanh(self.linear(x)) * self.s", "bfloat16", True),
                               ("torch.tanh(self.linear(x)).float()", "float32", False)):  # fmt: skip
        low = prepare(capture(linear(tmp_path, f"tanh_{out_dt}", expr=expr)))
        (lib,) = [r for r in low.regions if r.kind is RegionKind.LIBRARY]
        epi = gemm16.epilogue(lib, low)
        assert epi is not None and epi.out_dtype == out_dt
        source, _ = render(low, base_plan(low, True))
        chain = source[source.index("void kp_linear_f(") :]
        assert ("kp_tanh_mufu(" in chain) == mufu and ("tanhf(" in chain) != mufu, chain[:400]


def test_plans_edits_and_repairs(tmp_path):
    low = prepare(capture(ROOT / "tasks" / "matmul_bias_gelu.py"))
    plain, tuned = base_plan(low, False), base_plan(low, True)
    assert not uses_cute(plain) and uses_cute(tuned)  # cuBLAS first, then our kernel
    g = next(rp for rp in tuned.regions if isinstance(rp, GemmPlan))
    assert (g.bn, g.stages, g.epilogue) == (256, gemm.max_stages(256), "linear")
    labels = [label for label, _ in legal_edits(tuned, low)]
    assert "more_parallelism(linear_mm: bn=128, stages=4)" in labels
    assert any(lbl.startswith("pipeline_loads(linear_mm:") for lbl in labels)
    assert "use_wgmma(linear_mm: bn=256, stages=4)" in [lbl for lbl, _ in legal_edits(plain, low)]
    assert not uses_cute(safer(tuned, None))  # a failed GEMM goes back to cuBLAS, its epilogue unfused
    source, launcher = render(low, tuned)
    assert plan_of(source) == tuned
    report = check_launcher(launcher)
    assert report.ok and report.kind == Kind.CUSTOM and "tensor_map" not in report.kernels_used


def test_a_lone_linear_layer_is_ours_and_cites_its_building_blocks(tmp_path):
    path = linear(tmp_path, "lone", bias=False, dt="float16", k=1024, n=1000)
    t = probe(path)
    props = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)
    assert all(p.status == ProposalStatus.OK for p in props)
    for p in props:
        c = p.candidate
        assert uses_cute(plan_of(c.source)) and c.flags == CUTE_FLAGS
        assert any("MMA_64x" in b and "F16F16_SS" in b for b in c.blocks)
        assert re.search(r"// building block: SM90_TMA_LOAD_3D \(cute/arch/copy_sm90_tma.hpp:\d+\)", c.source)
        assert (
            "Layout_MN" not in c.source and "Major::K, GMMA::Major::K>" in c.source
        )  # the weight is K-major


def test_a_batched_product_reads_b_row_major_and_fuses_its_epilogue(tmp_path):
    path = product(
        tmp_path, "bmm", (4, 300, 256), (4, 256, 136), "torch.relu(torch.bmm(a, b)) * 2 + c[0]", [(4, 300, 1)]
    )
    t = probe(path)
    props = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)
    tuned = props[1].candidate
    assert props[1].status == ProposalStatus.OK and uses_cute(plan_of(tuned.source))
    assert "Layout_MN_SW128_Atom<T>{}" in tuned.source and "Step<_2, _1, _3>" in tuned.source
    assert "Major::K, GMMA::Major::MN>" in tuned.source
    assert "kernels.tensor_map(b, 64, 64)" in tuned.launcher and "reshape(batch, k, n)" in tuned.launcher
    # the relu, scale and per-row term run on the accumulators, in one kernel
    assert "kp_relu_f(acc(i + 0), kp::ld(e0[r])" in tuned.source and "_r_relu" not in tuned.launcher


# -------------------------------------------------------------------------------------------- nvcc


@pytest.mark.skipif(not _cutlass()[0], reason="nvidia-cutlass is not installed")
def test_gemm_instantiations_compile_for_sm90a_without_spills(tmp_path):
    paths = [
        ROOT / "tasks" / "matmul_bias_gelu.py",
        linear(tmp_path, "odd", expr="torch.relu(self.linear(x)) * self.s + 0.5"),
        linear(tmp_path, "lone16", bias=False, dt="float16", k=1024, n=1000),
        product(
            tmp_path,
            "bmm",
            (4, 300, 256),
            (4, 256, 136),
            "torch.relu(torch.bmm(a, b)) * 2 + c[0]",
            [(4, 300, 1)],
        ),
    ]
    cands = []
    for path in paths:
        t = probe(path)
        policy = ExpertPolicy()
        first = policy.propose(Context(task=t, reference=t.source, parent=None), 2)
        tuned = first[1].candidate  # the tuned plan: 128 x 256 tiles
        kids = policy.propose(Context(task=t, reference=t.source, parent=tuned), 8)
        cands += [tuned, *(k.candidate for k in kids if "bn=128" in k.edit)][:2]
    assert len(cands) == 8
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status == Status.OK, (c.edit, b.log)
        (k,) = [r for r in b.resources if r.name.endswith("_gemm")]
        assert k.spill_stores == 0 and k.registers <= 168, (c.edit, k)
        # ptxas neither serialized the MMAs nor drained them with waits of its own (C7518, C7517)
        assert not k.wgmma_serialized and not k.wgmma_waits_injected, (c.edit, k)


def test_a_failed_gemm_is_repaired_back_to_cublas():
    t = probe(ROOT / "tasks" / "matmul_bias_gelu.py")
    policy = ExpertPolicy()
    tuned = policy.propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
    assert uses_cute(plan_of(tuned.source))
    fixed = policy.repair(
        Context(task=t, reference=t.source, parent=None), tuned, Outcome(tuned.key, "mismatch")
    )
    assert fixed.status == ProposalStatus.OK, fixed.reason
    assert (
        fixed.edit == "repair: plain parameters for linear, linear_mm after mismatch"
    )  # the GEMM left the plan
    plan = plan_of(fixed.candidate.source)
    assert not uses_cute(plan) and fixed.candidate.flags == () and "torch.matmul(" in fixed.candidate.launcher


def test_before_hopper_the_linear_layer_stays_in_cublas():
    t = probe(ROOT / "tasks" / "matmul_bias_gelu.py")
    props = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None, arch="sm_80"), 4)
    assert props and all(p.status == ProposalStatus.OK for p in props)
    assert not any(uses_cute(plan_of(p.candidate.source)) for p in props)
    assert any("vec=8" in p.reason for p in props)  # the tuned epilogue pass is still offered
    notes = {n for p in props for n in p.notes}  # and the notes say where the GEMM runs on that GPU
    assert not any("WGMMA" in n for n in notes) and any(n.startswith("left to cuBLAS") for n in notes), notes


def test_a_tensor_map_needs_a_gpu_tensor():
    import torch

    from pipeline.runtime import KernelArgumentError, TensorMap

    cache: dict = {}
    with pytest.raises(KernelArgumentError, match="5-D GPU tensor"):
        TensorMap(torch.zeros(4, 64, dtype=torch.bfloat16), 128, 64, cache=cache)
    assert not cache  # nothing kept of a refused tensor


def test_a_raw_launch_passes_each_scalar_as_its_own_bytes():
    """The raw launch's argument values (runtime.c_value): the scalar's bytes, for every C type it takes."""
    import ctypes

    import numpy

    from pipeline.runtime import _C_OF, c_value

    values = {numpy.float16: (1.1, -0.0, 65504.0), numpy.float32: (1.1, -3.4e38), numpy.float64: (1 / 3,),
              numpy.int8: (-3,), numpy.int16: (-300,), numpy.int32: (-(2**31),), numpy.int64: (-(2**63),),
              numpy.uint8: (255,), numpy.uint16: (65535,), numpy.uint32: (2**32 - 1,),
              numpy.uint64: (2**64 - 1,), numpy.bool_: (True, False)}  # fmt: skip
    assert set(map(numpy.dtype, values)) == set(_C_OF)
    for kind, xs in values.items():
        for x in xs:
            a = kind(x)
            assert bytes(c_value(a)) == a.tobytes() and isinstance(c_value(a), ctypes._SimpleCData), (kind, x)


def test_a_tensor_map_is_kept_by_everything_it_encodes():
    """The cache key: the same address and geometry share a descriptor; any other view, dtype, box or
    swizzle has its own."""
    import torch

    from pipeline.runtime import map_key

    buf = torch.zeros(64 * 64)
    t = buf.view(64, 64)
    key = map_key(t, 128, 32, 128)
    assert map_key(buf.view(64, 64), 128, 32, 128) == key  # another tensor object over the same block
    others = [
        map_key(buf.view(32, 128), 128, 32, 128),  # same address, other shape
        map_key(t.t(), 128, 32, 128),  # other strides
        map_key(buf[64:].view(63, 64), 128, 32, 128),  # other address
        map_key(buf.view(torch.int32).view(64, 64), 128, 32, 128),  # other dtype
        map_key(t, 64, 32, 128),  # other box
        map_key(t, 128, 32, 64),  # other swizzle
    ]
    assert len({key, *others}) == 1 + len(others)


# ------------------------------------------------------------------------------------ fp32: 3xTF32


def test_fp32_products_go_to_the_3xtf32_template_and_16_bit_ones_do_not(tmp_path):
    K, MN = gemm.Form("K", False), gemm.Form("MN", False)
    f32 = ".to(torch.float32)"
    cases = {
        "linear": (linear(tmp_path, "l32", k=1036, dt="float32"), K),
        "mm": (
            task(
                tmp_path,
                "mm32",
                PRODUCT.format(expr="torch.mm(a, b)"),
                f"torch.randn(5, 1028){f32}, torch.randn(1028, 12){f32}",
            ),
            MN,
        ),
        "odd_k": (linear(tmp_path, "k1030", k=1030, dt="float32"), gemm.Form("K", False, pad_rows=True)),
        "bf16": (linear(tmp_path, "l16"), "takes fp32 operands, not bfloat16"),
    }
    for name, (path, want) in cases.items():
        low = prepare(capture(path))
        (lib,) = [r for r in low.regions if r.kind is RegionKind.LIBRARY]
        got = gemm_tf32.form(lib, low)
        assert got == want if isinstance(want, gemm.Form) else want in got, (name, got)


def test_each_3xtf32_tile_has_a_ring_that_fits_shared_memory(tmp_path):
    assert tf32_template.TILE_N[-1] == 128  # 256 spills once the promoted sums double the accumulators
    # a raw stage is 32 KB at 128 (A and B), the lo ring two more: five deep (three when lo sat beside each)
    assert tf32_template.max_stages(128) == 5 and tf32_template.LO_STAGES == 3
    for bn in tf32_template.TILE_N:
        top = tf32_template.max_stages(bn)
        assert top >= 2 and tf32_template.smem_bytes(bn, top) <= gemm.SMEM_LIMIT
        assert tf32_template.smem_bytes(bn, top + 1) > gemm.SMEM_LIMIT
    f32 = linear(tmp_path, "l32t", k=1036, dt="float32")
    low = prepare(capture(f32))
    (lib,) = [r for r in low.regions if r.kind is RegionKind.LIBRARY]
    assert gemm_tf32.SPEC.tiles(gemm_tf32.form(lib, low)) == tf32_template.TILE_N  # what the family offers


def test_an_fp32_linear_layer_takes_our_3xtf32_kernel_with_its_epilogue_in_the_tuned_plan(tmp_path):
    path = linear(tmp_path, "l32e", k=1036, dt="float32", expr="torch.relu(self.linear(x)) * self.s")
    low = prepare(capture(path))
    plain, tuned = base_plan(low, False), base_plan(low, True)
    assert not uses_cute(plain) and uses_cute(tuned)  # cuBLAS's fp32 path first, then ours
    (g,) = [rp for rp in tuned.regions if isinstance(rp, Tf32Plan)]
    # a 77 x 1001 output is 8 tiles of 128 x 128 (16 blocks with K = 1036 split in two): the tuned plan takes
    # the narrow tile (32 tiles), its deepest ring, and the split; the wider tiles are edits, a step each
    assert (g.bn, g.stages, g.epilogue, g.splits) == (32, tf32_template.max_stages(32), "linear", 2)
    labels = [label for label, _ in legal_edits(tuned, low)]
    assert not any("bn=256" in label for label in labels)
    assert any("coarsen_threads(linear_mm: bn=64" in label for label in labels), labels
    source, launcher = render(low, tuned)
    assert "F32TF32TF32_RS_TN" in source and "fence_view_async_shared" in source
    assert "PROMOTE = 4" in source and "sum(i) += acc(i);" in source  # chunk sums added on the CUDA cores
    assert "kernels.tensor_map(a, 128, 32)" in launcher and "kernels.tensor_map(b, 32, 32)" in launcher
    assert "kp_linear_f(" in source.split("kp_linear_mm_splitk(")[1]  # the epilogue in the sum kernel
    assert check_launcher(launcher).ok
    assert not uses_cute(safer(tuned, None))  # a failed fp32 GEMM goes back to cuBLAS


@pytest.mark.parametrize(
    ("rows", "k", "n", "want"),
    [
        (394, 512, 1536, (64, 1)),  # ViT's qkv: 48 wide tiles leave 84 SMs idle, 192 narrow ones take 2 waves
        (394, 2048, 512, (64, 4)),  # ViT's fc2: few tiles, a long K split
        (394, 512, 512, (32, 1)),  # its output projection: 64 narrow tiles, K too short to split
        (4096, 4096, 4096, (128, 1)),  # thousands of tiles: the widest
        (256, 262144, 256, (128, 32)),  # level 1's long K: 4 wide tiles, split 32 ways
    ],
)
def test_the_3xtf32_cost_model_picks_tiles_for_the_grid(tmp_path, rows, k, n, want):
    """The tuned plan's tile width and split: waves of blocks x k tiles a block x a k tile's time."""
    assert set(gemm_tf32.KTILE_US) == set(tf32_template.TILE_N)  # a measured time for every width
    path = task(tmp_path, f"g{rows}_{k}_{n}", LINEAR.format(k=k, n=n, bias=True, dt="float32", expr="self.linear(x)"),
                f"torch.randn({rows}, {k})")  # fmt: skip
    low = prepare(capture(path))
    (lib,) = [r for r in low.regions if r.kind is RegionKind.LIBRARY]
    assert gemm_tf32.wave_plan(lib, low) == want
    (g,) = [rp for rp in base_plan(low, True).regions if isinstance(rp, Tf32Plan)]
    shallower = (
        gemm_tf32.PERSIST_SHALLOWER if g.persistent else 0
    )  # a persistent ring a stage under the deepest
    # K whole and long: the fp16x3 form at the same tile (tests/test_gemm_f16x3.py), its own deepest ring
    f16 = want[1] == 1 and k >= gemm_tf32.F16_MIN_K
    top = gemm_f16x3.max_stages(want[0]) if f16 else tf32_template.max_stages(want[0]) - shallower
    assert (g.bn, g.splits, g.f16) == (*want, f16) and g.stages == top
    # narrower and wider: a step along the tiles, not a jump to the ends
    moved = {label.split("(")[0]: p.get(lib.rid).bn for label, p in legal_edits(base_plan(low, True), low)
             if "bn=" in label}  # fmt: skip
    tiles = tf32_template.TILE_N
    at = tiles.index(want[0])
    assert moved.get("coarsen_threads") == (tiles[at + 1] if at + 1 < len(tiles) else None)
    # narrower only for a grid of few tiles: on level 1's large GEMMs it lost every time
    few = gemm_tf32.SPEC.grid_tiles(lib, low, None, want[0]) < FEW_TILES
    assert few == (rows != 4096)
    narrower = moved.get("more_parallelism", moved.get("resize_grid", moved.get("reduce_registers")))
    assert narrower in ((tiles[at - 1],) if at and few else (None,))
    splits = [label for label, _ in legal_edits(base_plan(low, True), low)
              if "splits=" in label and not label.startswith("use_tensor_cores")]  # fmt: skip
    shares = k >= 2 * gemm_tf32.MIN_SHARE * tf32_template.BK  # two splits keep their k tiles each
    assert bool(splits) == (few and shares), splits  # a split of K only for a grid of few tiles


@pytest.mark.parametrize(("rows", "k", "n", "persistent"), [
    (31360, 96, 384, True),  # Swin's stage-1 MLP: 245 x 3 tiles over 3 k tiles, about 6 waves
    (4096, 384, 4096, True),  # 1024 tiles over a K too short for the fp16x3 form
    (31360, 384, 96, True),  # Swin's stage-1 fc2: 245 tiles, under two waves but more than one
    (394, 384, 1536, False),  # 96 tiles of 128 x 64, under a wave
    (256, 262144, 256, False),  # K split: the blocks of a tile keep their own share
])  # fmt: skip
def test_a_grid_of_several_waves_walks_its_tiles_with_a_persistent_grid_and_hedges_it(
    tmp_path, rows, k, n, persistent
):
    """The tuned plan's persistent bet from more than a wave of tiles (K whole), the launcher's grid at most an SM's
    block each, the tile count passed; its undoing is the first edit of an unprofiled plan, and no split of K
    keeps it."""
    path = task(tmp_path, f"p{rows}_{k}_{n}", LINEAR.format(k=k, n=n, bias=True, dt="float32", expr="self.linear(x)"),
                f"torch.randn({rows}, {k})")  # fmt: skip
    low = prepare(capture(path))
    tuned = base_plan(low, True)
    (g,) = [rp for rp in tuned.regions if isinstance(rp, Tf32Plan)]
    assert g.persistent == persistent and ("persistent" in g.describe()) == persistent
    top = tf32_template.max_stages(g.bn)
    assert g.stages == (top - gemm_tf32.PERSIST_SHALLOWER if persistent else top)
    source, launcher = render(low, tuned)
    assert ("min(grid, sms)" in launcher and "numpy.int32(grid)" in launcher) == persistent
    assert ("int TILES" in source and "for (int j = 0, base = 0; j < mine;" in source) == persistent
    assert check_launcher(launcher).ok
    # the next k tile's A loaded under this tile's MMAs, before a promotion drains them (one-tile and persistent)
    step = source[source.index("auto step = ") :]
    assert (
        step.index("load(kt + 1, ph, pl);")
        < step.index("warpgroup_wait<0>();")
        < step.index("sum(i) += acc(i)")
    )
    edits = legal_edits(tuned, low)
    if persistent:
        label, undone = edits[0]  # the bet timed against a block a tile first
        assert label.startswith("persistent_grid(") and not undone.get(g.rid).persistent
        assert "sum(i) += acc(i);" in source and "acc(i) = sum(i)" not in source  # the stores read the sums
    assert all(p.get(g.rid).splits == 1 or not p.get(g.rid).persistent for _, p in edits)


@pytest.mark.skipif(not _cutlass()[0], reason="nvidia-cutlass is not installed")
def test_3xtf32_instantiations_compile_for_sm90a_without_spills(tmp_path):
    f32 = ".to(torch.float32)"
    paths = [
        linear(tmp_path, "l32", k=1036, dt="float32", expr="torch.relu(self.linear(x)) * self.s"),
        task(
            tmp_path,
            "mm32",
            PRODUCT.format(expr="torch.mm(a, b)"),
            f"torch.randn(300, 1028){f32}, torch.randn(1028, 1000){f32}",
        ),
        task(
            tmp_path,
            "bmm32",
            PRODUCT.format(expr="torch.relu(torch.bmm(a, b)) - c[0]"),
            f"torch.randn(3, 257, 516){f32}, torch.randn(3, 516, 388){f32}, torch.randn(3, 257, 1){f32}",
        ),
        task(  # a persistent grid (several waves of tiles over a short K), its bias and GELU on the sums
            tmp_path,
            "swin32",
            LINEAR.format(k=96, n=384, bias=True, dt="float32", expr="F.gelu(self.linear(x))"),
            "torch.randn(10, 3136, 96)",
        ),
    ]
    cands = []
    for path in paths:
        t = probe(path)
        policy = ExpertPolicy()
        tuned = policy.propose(Context(task=t, reference=t.source, parent=None), 2)[-1].candidate
        kids = policy.propose(Context(task=t, reference=t.source, parent=tuned), 8)
        moved = [k.candidate for k in kids if "bn=" in k.edit or "stages=" in k.edit]
        # the 3xTF32 forms (a tuned plan in the fp16x3 form: its hedge back, tests/test_gemm_f16x3.py)
        tf32 = [
            c for c in (tuned, *moved) if not any(getattr(p, "f16", False) for p in plan_of(c.source).regions)
        ]
        cands += tf32[:2]
    # K-major B read in place; a row-major one gathered K-major by our kernel first (tf32 reads K-major only)
    assert any(p.persistent for c in cands for p in plan_of(c.source).regions if isinstance(p, Tf32Plan))
    gathered = {"transposed(w)" in c.launcher for c in cands}
    assert gathered == {False, True} and all("GMMA::Major" not in c.source for c in cands)
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status == Status.OK, (c.edit, b.log)
        (k,) = [r for r in b.resources if r.name.endswith("_gemm")]
        assert k.spill_stores == 0 and k.registers <= 168, (c.edit, k)
        # ptxas neither serialized the MMAs nor drained them with waits of its own (C7518, C7517)
        assert not k.wgmma_serialized and not k.wgmma_waits_injected, (c.edit, k)


@pytest.mark.skipif(not _cutlass()[0], reason="nvidia-cutlass is not installed")
def test_3xtf32_staged_stores_are_offered_and_compile_for_sm90a_without_spills(tmp_path):
    """coalesce_accesses stages the stores through shared memory (whole 16-byte row pieces): offered on a
    128-wide tile (the ring made shallow enough for the staging), never on a 32-wide one, a split, or a
    persistent grid with a fused epilogue (it spilled); the persistent form stores its sums; built for sm_90a
    with a fused GELU and with a bf16 output's cast, persistent or not, without spills or ptxas's WGMMA
    waits."""
    paths = [
        task(  # Swin's stage-1 fc1: K = 96, 245 tiles (persistent), its bias and GELU fused
            tmp_path,
            "swin32",
            LINEAR.format(k=96, n=384, bias=True, dt="float32", expr="F.gelu(self.linear(x))"),
            "torch.randn(10, 3136, 96)",
        ),
        task(  # level 1's small-K product's shape, smaller: 33 x 9 tiles (persistent), nothing fused
            tmp_path,
            "small_k",
            PRODUCT.format(expr="torch.mm(a, b)"),
            "torch.randn(4100, 64), torch.randn(64, 1030)",
        ),
    ]
    cands = []
    for path in paths:
        low = prepare(capture(path))
        tuned = base_plan(low, True)
        (g,) = [rp for rp in tuned.regions if isinstance(rp, Tf32Plan)]
        assert g.persistent, g
        moves = [(label, p) for label, p in legal_edits(tuned, low) if label.startswith("coalesce_accesses(")]
        plans = [p for _, p in moves]
        if g.epilogue:  # not on the persistent grid: from its block-a-tile form
            assert not moves, moves
            plain = tuned.replace(dataclasses.replace(g, persistent=False))
            plans = [p for label, p in legal_edits(plain, low) if label.startswith("coalesce_accesses(")]
        else:
            plans.append(plans[0].replace(dataclasses.replace(plans[0].get(g.rid), persistent=False)))
        assert len(plans) == (1 if g.epilogue else 2), plans
        for plan in plans:
            staged = plan.get(g.rid)
            assert staged.staged and "staged stores" in staged.describe()
            assert staged.stages <= tf32_template.max_stages(g.bn, gemm.staging_bytes("float32"))
            source, launcher = render(low, plan)
            assert "TN = BN" in source and "s.c + (wg - 1) * 64 * CP" in source and "pairs" not in source
            if staged.persistent:  # the staged stores read the sums
                assert "sum(i + 0)" in source and "acc(i + 0)" not in source
            cands.append(make_candidate(probe(path).id, source, launcher, nvcc_flags(plan), parent=None,
                                        edit=f"{path.stem} persistent={staged.persistent}"))  # fmt: skip
        assert tf32_template.why_unstaged(dataclasses.replace(g, bn=32), "float32").startswith(
            "a 32-wide tile"
        )
        split = dataclasses.replace(g, splits=2, persistent=False)
        assert tf32_template.why_unstaged(split, "float32") == "a split's partials are stored directly"
    assert len(cands) == 3
    builds = compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a"))
    for c, b in zip(cands, builds, strict=True):
        assert b.status == Status.OK and not b.log, (c.edit, b.log)
        (k,) = [r for r in b.resources if r.name.endswith("_gemm")]
        assert k.spill_stores == 0 and k.registers <= 168, (c.edit, k)
        assert not k.wgmma_serialized and not k.wgmma_waits_injected, (c.edit, k)


class _PaddedRowsKernels:
    """The launcher's kernels with the WGMMA product stood in for by torch on what its tensor maps describe:
    our pad and gather kernels emulated, each tensor map checked to be one TMA can encode."""

    def __init__(self, emulated):
        self.emulated = emulated
        self.padded = 0

    def tensor_map(self, t, box_rows, box_cols, swizzle=128):
        assert t.stride(-1) == 1 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]), t.stride()
        return t  # TMA reads the view: its width, zeros past it

    def __getattr__(self, name):
        if name.endswith("_gemm"):
            return self._gemm
        self.padded += name.endswith("_pad")
        return getattr(self.emulated, name)

    @staticmethod
    def _gemm(grid, block, args, shared_mem=0):
        a, b, out = args[:3]
        m, n, k = (int(v) for v in args[-3:])
        assert a.shape[-2:] == (m, k), (a.shape, m, k)
        prod = a.double() @ (b.double().transpose(-1, -2) if b.shape[-2:] == (n, k) else b.double())
        out.copy_(prod.reshape(out.shape).to(out.dtype))


@pytest.mark.parametrize(
    ("name", "a", "b", "expr", "dt"),
    [
        ("bmm_odd_k", (4, 5, 60), (4, 60, 24), "torch.bmm(a, b)", "bfloat16"),
        ("mm_odd_n", (5, 64), (64, 25), "torch.mm(a, b)", "bfloat16"),
        ("linear_odd_k", (7, 3, 1001), (40, 1001), "F.linear(a, b)", "bfloat16"),
        ("tf32_odd_k_and_n", (9, 30), (30, 13), "torch.mm(a, b)", "float32"),
    ],
)
def test_rows_tma_cannot_read_are_copied_wider_by_our_kernel(tmp_path, name, a, b, expr, dt):
    """K (or N of a row-major B) not a 16-byte multiple: the launcher copies the operand into wider rows with
    our kernel and hands TMA a view of the true width; still our kernels alone, and the product right."""
    inputs = ", ".join(f"torch.randn{s}.to(torch.{dt})" for s in (a, b))
    body = f"class Model(nn.Module):\n    def forward(self, a, b):\n        return {expr}\n"
    path = task(tmp_path, name, body, inputs)
    t = probe(path)
    (ours,) = [
        p.candidate
        for p in ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)
        if p.candidate and uses_cute(plan_of(p.candidate.source))
    ][:1]
    report = check_launcher(ours.launcher)
    assert report.ok and report.kind.value == "custom", report.library_ops
    rid = re.search(r"kernels\.kp_(\w+)_pad\(", ours.launcher).group(1)
    from cuda_emulator import build, load_model

    from pipeline.generate.expert.templates.code import GATHER

    transpose = tf32_template.TRANSPOSE.replace("RID", rid) if dt == "float32" else ""
    fake = _PaddedRowsKernels(
        build("\n".join(gemm.pad_kernel(rid, dt)) + "\n" + GATHER + transpose, tmp_path)
    )
    model = load_model(ours.launcher, fake)()
    x, y = (torch.randn(s).to(getattr(torch, dt)) for s in (a, b))
    want = load_module(path).Model()(x, y)
    got = model(x, y)
    assert fake.padded >= 1
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    if (
        name == "tf32_odd_k_and_n"
    ):  # the source with its pad kernel builds for the H200 (one case: nvcc's time)
        (build_,) = compile_candidates([ours], Config(home=tmp_path / "home", arch="sm_90a"))
        assert build_.status.value == "ok" and f"kp_{rid}_pad" in {r.name for r in build_.resources}, (
            build_.log
        )


# ------------------------------------------------------------------------------- fp32: split-K


class _SplitKernels:
    """The 3xTF32 GEMM stood in for by torch, block for block over its split of K (each split's partial into
    its workspace slice, as the kernel does); the sum kernel run by the CUDA emulator from the source."""

    def __init__(self, emulated):
        self.emulated = emulated
        self.grids: list[tuple] = []

    def tensor_map(self, t, box_rows, box_cols, swizzle=128):
        return t

    def __getattr__(self, name):
        return self._gemm if name.endswith("_gemm") else getattr(self.emulated, name)

    def _gemm(self, grid, block, args, shared_mem=0):
        a, b, ws = args[:3]
        k = int(args[-1])
        self.grids.append(grid)
        splits = grid[1] if len(grid) > 1 else 1
        kall = -(-k // tf32_template.BK)
        chunk = -(-kall // splits) * tf32_template.BK
        for z in range(splits):
            lo, hi = min(k, z * chunk), min(k, (z + 1) * chunk)
            part = a[..., lo:hi].double() @ b[..., lo:hi].double().transpose(-1, -2)  # B is K-major (n, k)
            (ws[z] if splits > 1 else ws).copy_(part.reshape(ws.shape[-2:]).to(ws.dtype))


def test_a_product_with_few_tiles_and_a_long_k_splits_k_and_sums_the_partials_in_order(tmp_path):
    """200 x 200 outputs (4 tiles of 128 x 128) over K = 4096: the tuned plan takes the 128 x 32 tile (14
    tiles) and splits K 8 ways (14 x 8 blocks, each with 16 k tiles), the edits offer 4 and none; the
    launcher's sum kernel (emulated) adds the slices into the product, and the split kernel builds for
    sm_90a without spills."""
    body = "class Model(nn.Module):\n    def forward(self, a, b):\n        return torch.mm(a, b)\n"
    path = task(tmp_path, "mm_split", body, "torch.randn(200, 4096), torch.randn(4096, 200)")
    low = prepare(capture(path))
    tuned = base_plan(low, True)
    (g,) = [rp for rp in tuned.regions if isinstance(rp, Tf32Plan)]
    assert (g.bn, g.splits, g.epilogue) == (32, 8, "") and "split-K=8" in g.describe()
    moves = {label: p for label, p in legal_edits(tuned, low)}
    splits = sorted(p.get(g.rid).splits for label, p in moves.items()
                    if "splits=" in label and not label.startswith("use_tensor_cores"))  # fmt: skip
    assert splits == [1, 4]
    assert not any(label.startswith("fuse_epilogue") for label in moves)
    t = probe(path)
    ours = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[-1].candidate
    assert plan_of(ours.source) == tuned and "SPLITS = 8" in ours.source
    assert check_launcher(ours.launcher).ok and "K split 8 ways" in ours.launcher
    from cuda_emulator import build, load_model

    from pipeline.generate.expert.templates.code import GATHER

    rid = g.rid
    emulated = tf32_template.SPLIT_SUM + tf32_template.TRANSPOSE
    fake = _SplitKernels(build(emulated.replace("RID", rid) + "\n" + GATHER, tmp_path))
    model = load_model(ours.launcher, fake)()
    x, y = torch.randn(200, 4096), torch.randn(4096, 200)
    torch.testing.assert_close(model(x, y).double(), x.double() @ y.double(), rtol=1e-5, atol=1e-4)
    assert fake.grids == [(14, 8)]
    if _cutlass()[0]:
        (b,) = compile_candidates([ours], Config(home=tmp_path / "home", arch="sm_90a"))
        assert b.status == Status.OK, b.log
        res = {r.name: r for r in b.resources}
        assert res[f"kp_{rid}_gemm"].spill_stores == 0 and f"kp_{rid}_splitk" in res
        assert res[f"kp_{rid}_transpose"].spill_stores == 0


def test_a_row_major_b_is_made_k_major_by_the_tiled_transpose(tmp_path):
    """The 3xTF32 kernel reads B K-major: a row-major (..., K, N) B goes through our 32 x 32 tiled transpose
    (emulated here on edge tiles and a batch), not the generic gather that reads B column by column."""
    import numpy
    from cuda_emulator import build

    k = build(tf32_template.TRANSPOSE.replace("RID", "t"), tmp_path)
    src = torch.randn(3, 37, 45)
    dst = torch.full((3, 45, 37), float("nan"))
    k.kp_t_transpose((2, 2, 3), (32, 8), (src, dst, numpy.int64(37), numpy.int64(45)))
    assert torch.equal(dst, src.transpose(-1, -2))


def test_a_product_that_fills_the_gpu_does_not_split(tmp_path):
    body = "class Model(nn.Module):\n    def forward(self, a, b):\n        return torch.mm(a, b)\n"
    path = task(tmp_path, "mm_big", body, "torch.randn(2048, 1024), torch.randn(1024, 2048)")
    low = prepare(capture(path))
    (g,) = [rp for rp in base_plan(low, True).regions if isinstance(rp, Tf32Plan)]
    assert g.splits == 1  # 256 tiles: two waves already
    fused = prepare(
        capture(linear(tmp_path, "l32f", k=4096, n=200, dt="float32", expr="torch.relu(self.linear(x))"))
    )
    (h,) = [rp for rp in base_plan(fused, True).regions if isinstance(rp, Tf32Plan)]
    assert (h.bn, h.splits, h.epilogue) == (32, 8, "linear")  # 77 x 200: 7 narrow tiles, K split, fused


def test_a_split_product_computes_its_fused_epilogue_in_the_sum_kernel(tmp_path):
    """A linear layer with a bias, a residual (a full operand) and a ReLU over few tiles and a long K: split
    8 ways with the epilogue kept; the GEMM kernel takes no epilogue operands and stores raw partials, the
    sum kernel (emulated) adds them in order and computes the chain on the total, on 2-D and 3-D inputs."""
    body = """
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4096, 200)
        def forward(self, x, y):
            return torch.relu(self.linear(x) + y * 0.5)
    """
    path = task(tmp_path, "l32split", body, "torch.randn(77, 4096), torch.randn(77, 200)")
    low = prepare(capture(path))
    tuned = base_plan(low, True)
    (g,) = [rp for rp in tuned.regions if isinstance(rp, Tf32Plan)]
    assert (g.bn, g.splits) == (32, 8) and g.epilogue
    t = probe(path)
    ours = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[-1].candidate
    assert plan_of(ours.source) == tuned and "K split 8 ways" in ours.launcher
    gemm_decl = re.search(rf"kp_{g.rid}_gemm\(([^)]*)\)", ours.source).group(1)
    assert "e0" not in gemm_decl and "kp_linear_f(" in ours.source
    region = next(r for r in low.regions if r.rid == g.rid)
    epi = gemm_tf32.SPEC.epilogue_of(region, low) if gemm_tf32.SPEC.epilogue_of else None
    from pipeline.generate.expert.families import gemm_kit
    from pipeline.generate.expert.templates.common import PRELUDE

    epi = epi or gemm_kit.epilogue(region, low)
    sig = tf32_template._sum_signature(epi, "float32", 8)
    src = "\n".join([PRELUDE, *gemm.epilogue_function(epi, "float32"),
                     tf32_template._split_sum_epilogue(g.rid, epi, "float32", sig)])  # fmt: skip
    from cuda_emulator import build, load_model

    from pipeline.generate.expert.templates.code import GATHER

    fake = _SplitKernels(build(src + "\n" + GATHER, tmp_path))
    module = load_module(path)
    torch.manual_seed(0)
    ref = module.Model()
    model = load_model(ours.launcher, fake)()
    model.load_state_dict(ref.state_dict())
    for lead in ((77,), (3, 5)):
        x, y = torch.randn(*lead, 4096), torch.randn(*lead, 200)
        with torch.no_grad():
            want = ref.double()(x.double(), y.double())
            ref.float()
            got = model(x, y)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert fake.grids[0] == (7, 8)
    if _cutlass()[0]:
        (b,) = compile_candidates([ours], Config(home=tmp_path / "home", arch="sm_90a"))
        assert b.status == Status.OK, b.log
        res = {r.name: r for r in b.resources}
        assert res[f"kp_{g.rid}_gemm"].spill_stores == 0 and f"kp_{g.rid}_splitk" in res
