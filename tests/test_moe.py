"""MoE expert projections written as loops over experts (grouped.py) on the CPU: which loops are captured as one
grouped GEMM and which are refused with a reason, the candidates (torch's grouped GEMM and our fused
epilogue, emulated) against the reference loop under skewed, one-expert and idle routings, and the tasks in
tasks/moe/ probed at their real sizes without allocating them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cuda_emulator import build, load_model

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, capture, supports
from pipeline.generate.expert.graph import CaptureError
from pipeline.static_check import check_launcher
from pipeline.tasks import load_module, probe
from pipeline.types import Kind, Status

ROOT = Path(__file__).resolve().parent.parent
HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\nE, K, N = 6, 64, 48\n\n"
COUNTS = "torch.tensor([5, 0, 17, 3, 0, 11])"
INPUTS = f"\n\ndef get_inputs():\n    c = {COUNTS}\n    return [torch.randn(int(c.sum()), K, dtype=DT), c]\n"
INPUTS_OFFS = f"\n\ndef get_inputs():\n    c = {COUNTS}.cumsum(0)\n    return [torch.randn(int(c[-1]), K, dtype=DT), c]\n"
INPUTS_BOUNDS = (
    f"\n\ndef get_inputs():\n    c = torch.cat((torch.zeros(1, dtype=torch.int64), {COUNTS}.cumsum(0)))\n"
    "    return [torch.randn(int(c[-1]), K, dtype=DT), c]\n"
)
INIT = "\n\ndef get_init_inputs():\n    return []\n"


def _model(init: str, forward: str) -> str:
    return f"class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n{init}\n{forward}"


W_KN = "        self.w = nn.Parameter(torch.randn(E, K, N, dtype=DT) * K**-0.5)\n"
W_NK = "        self.w = nn.Parameter(torch.randn(E, N, K, dtype=DT) * K**-0.5)\n"
LOOPS = {  # name -> (weights, forward, inputs): tokens sorted by expert, rows grouped by counts or offsets
    "swiglu_skip_idle": (W_KN, """    def forward(self, x, counts):
        out = x.new_empty(x.shape[0], N // 2)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            gate, up = (x[start : start + n] @ self.w[e]).chunk(2, dim=-1)
            out[start : start + n] = F.silu(gate) * up
            start += n
        return out
""", INPUTS),
    "plain_every_expert": (W_KN, """    def forward(self, x, counts):
        out = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
        start = 0
        for e in range(E):
            n = int(counts[e])
            out[start : start + n] = torch.mm(x[start : start + n], self.w[e])
            start += n
        return out
""", INPUTS),
    "k_major_then_scaled": (W_NK, """    def forward(self, x, counts):
        out = torch.zeros(x.shape[0], N, dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                out[start : start + n] = torch.relu(x[start : start + n] @ self.w[e].t())
            start += n
        return out * 0.5
""", INPUTS),
    "offsets": (W_KN, """    def forward(self, x, offsets):
        out = x.new_empty(x.shape[0], N)
        ends = offsets.tolist()
        for e in range(E):
            s = 0 if e == 0 else ends[e - 1]
            if ends[e] > s:
                out[s : ends[e]] = F.gelu(x[s : ends[e]] @ self.w[e])
        return out
""", INPUTS_OFFS),
    "bounds_from_zero": (W_KN, """    def forward(self, x, bounds):
        out = x.new_empty(x.shape[0], N)
        b = bounds.tolist()
        for e in range(E):
            if b[e + 1] > b[e]:
                out[b[e] : b[e + 1]] = x[b[e] : b[e + 1]] @ self.w[e] + 1
        return out
""", INPUTS_BOUNDS),
}  # fmt: skip
# How the kernel reads expert e's rows from the routing it is given (no cumsum or int32 copy of its own)
READS = {
    "swiglu_skip_idle": "(int)offs[e]",
    "offsets": "(int)(offs[e] - (e ? offs[e - 1] : 0))",
    "bounds_from_zero": "(int)(offs[e + 1] - (e ? offs[e] : 0))",
}
INPUTS_P = INPUTS.replace("dtype=DT), c]", "dtype=DT), c, torch.rand(int(c.sum()), 1, dtype=DT)]")
REFUSED = {  # name -> (forward, inputs, what the reason says)
    "different_ops_per_expert": ("""    def forward(self, x, counts):
        out = x.new_empty(x.shape[0], N)
        start = 0
        for e, n in enumerate(counts.tolist()):
            h = x[start : start + n] @ self.w[e]
            out[start : start + n] = torch.relu(h) if e % 2 else torch.tanh(h)
            start += n
        return out
""", INPUTS, "same row-wise ops"),
    "per_token_weights": ("""    def forward(self, x, counts, p):
        out = x.new_empty(x.shape[0], N)
        start = 0
        for e, n in enumerate(counts.tolist()):
            out[start : start + n] = (x[start : start + n] @ self.w[e]) * p[start : start + n]
            start += n
        return out
""", INPUTS_P, "same row-wise ops"),
    "row_sum_per_expert": ("""    def forward(self, x, counts):
        out = x.new_empty(x.shape[0], N)
        start = 0
        for e, n in enumerate(counts.tolist()):
            h = x[start : start + n] @ self.w[e]
            out[start : start + n] = h - h.mean(0)
            start += n
        return out
""", INPUTS, "not row-wise"),
}  # fmt: skip


def _write(folder: Path, name: str, body: str, inputs: str, dt: str = "bfloat16") -> Path:
    path = folder / f"{name}.py"
    path.write_text(HEADER + f"DT = torch.{dt}\n\n\n" + body + inputs + INIT)
    return path


def _loop(folder: Path, name: str, dt: str = "bfloat16") -> Path:
    w, forward, inputs = LOOPS[name]
    return _write(folder, name, _model(w, forward), inputs, dt)


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_a_loop_over_experts_is_captured_as_one_grouped_gemm(tmp_path, name):
    g = capture(_loop(tmp_path, name))
    ops = [n.op for n in g.nodes]
    slices = 1 if name == "bounds_from_zero" else 0  # the ends after the leading zero; no expert's slice
    assert ops.count("_grouped_mm") == 1 and "mm" not in ops and ops.count("slice") == slices, ops
    assert any("grouped GEMM" in note for note in g.notes)
    assert [s.key for s in g.state] == ["w"]
    ok, why = supports(_loop(tmp_path, name))
    assert ok, why


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_loops_are_refused_with_the_reason(tmp_path, name):
    forward, inputs, reason = REFUSED[name]
    with pytest.raises(CaptureError, match=reason):
        capture(_write(tmp_path, name, _model(W_KN, forward), inputs))


def test_an_fp32_loop_says_grouped_gemms_are_bf16(tmp_path):
    with pytest.raises(CaptureError, match="bf16"):
        capture(_loop(tmp_path, "swiglu_skip_idle", "float32"))


def _routings(total: int) -> list[torch.Tensor]:
    """Skewed with idle experts, all tokens to one expert, and one token to each of two experts."""
    one = torch.zeros(6, dtype=torch.int64)
    one[3] = total
    skew = torch.tensor([0, total // 2, 0, total // 3, 1, 0])
    skew[1] += total - int(skew.sum())
    few = torch.tensor([1, 0, 0, 0, 1, 0])
    return [skew, one, few]


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_emulated_candidates_match_the_loop_under_any_routing(tmp_path, name):
    path = _loop(tmp_path, name)
    module = load_module(path)
    torch.manual_seed(0)
    ref = module.Model()
    t = probe(path)
    props = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)
    cands = [p.candidate for p in props if p.candidate]
    ours = [c for c in cands if "wgmma_grouped" in c.source.splitlines()[0]]
    assert ours and all("torch._grouped_mm(" not in c.launcher for c in ours)  # the tuned plan: our kernel
    for c in ours:  # the routing read as it is given: no torch op left (a cumsum, an int32 copy)
        report = check_launcher(c.launcher)
        assert report.ok and report.kind is Kind.CUSTOM, (report.library_ops, report.violations)
        if name in READS:
            assert f"rows = max({READS[name]}, 0);" in c.source
    library = [c for c in cands if c not in ours]  # WGMMA cannot run on the emulator: the GPU tests run ours
    if name == "plain_every_expert":  # nothing around the grouped GEMM: the plain plan would be torch alone
        assert not library
        return
    assert library, [p.reason for p in props]
    for cand in library:
        assert "torch._grouped_mm(" in cand.launcher
        model = load_model(cand.launcher, build(cand.source, tmp_path))()
        model.load_state_dict(ref.state_dict())
        for counts in _routings(40):
            x = torch.randn(int(counts.sum()), 64, dtype=torch.bfloat16)
            arg = {
                "offsets": counts.cumsum(0),
                "bounds_from_zero": torch.cat((torch.zeros(1, dtype=torch.int64), counts.cumsum(0))),
            }.get(name, counts)
            want, got = ref(x, arg), model(x, arg)
            assert got.shape == want.shape and got.dtype == want.dtype
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=cand.edit)


# one task of each kind and shape (the files of a kind differ only in their sizes)
@pytest.mark.parametrize("task", ["qwen3_fc1.py", "mixtral_fc2.py", "deepseek_fc2_dgrad.py"])
def test_moe_tasks_probe_and_capture_at_full_size(task):
    path = ROOT / "tasks" / "moe" / task
    t = probe(path)
    m, h = t.inputs[0].shape
    w = next(s for s in capture(path).state)
    experts, k, n = w.shape
    assert t.inputs[1].shape == (experts,) and h in (k, n)  # (E, K, N) weights, or read transposed (dgrad)
    assert t.flops == 2 * m * k * n  # every token through one expert: the skew moves work, not its amount


def test_every_moe_task_draws_skewed_routing_with_idle_experts():
    for path in sorted((ROOT / "tasks" / "moe").glob("*_fc*.py")):
        module = load_module(path)
        experts = module.get_init_inputs()[0]
        counts = module.routing(1000, experts)
        assert int(counts.sum()) == 1000 and int((counts == 0).sum()) >= max(1, experts // 4), path.name
        assert int(counts.max()) > 2 * 1000 // experts, path.name  # skewed: some experts take far more


def test_grouped_kernels_compile_for_sm90a_without_spills(tmp_path):
    """Our persistent grouped kernel at a real MoE size (rows MN-major) and on a K-major stack, its stores staged
    in shared memory (the SwiGLU one's of the gate's columns); each with a cluster of two sharing the weight
    tiles (multicast_loads), with stores direct from the accumulators (coalesce_accesses), and the plain one
    with ping-pong consumers (overlap_epilogue)."""
    paths = [ROOT / "tasks" / "moe" / "qwen3_fc1.py", _loop(tmp_path, "k_major_then_scaled")]
    cands = []
    for path in paths:
        t = probe(path)
        (tuned,) = [p.candidate for p in ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)
                    if p.candidate and "wgmma_grouped" in p.candidate.source.splitlines()[0]]  # fmt: skip
        cands.append(tuned)
    assert "GMMA::Major::MN" in cands[0].source and "GMMA::Major::K>" in cands[1].source
    assert '"epilogue":"silu"' in cands[0].source.splitlines()[0]  # SwiGLU on the gate/up pairs
    for t, tuned in zip([probe(p) for p in paths], list(cands), strict=True):
        kids = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=tuned), 30)
        (mc,) = [k.candidate for k in kids if k.candidate and "multicast_loads" in k.edit]
        assert "__cluster_dims__(2, 1, 1)" in mc.source and "SM90_TMA_LOAD_MULTICAST" in mc.source
        (st,) = [k.candidate for k in kids if k.candidate and "coalesce_accesses" in k.edit]
        assert '"staged":false' in st.source.splitlines()[0] and "bar.sync" not in st.source
        assert "bar.sync" in tuned.source and " c[2 * 64 * (64 + 16 / sizeof(" in tuned.source
        cands.append(mc)  # st: the stores of the kernel before staging, compiled for months; CI's time kept
        # ping-pong consumers (overlap_epilogue) on 128 x 128 tiles, turns by named barriers; the SwiGLU one
        # pairs a value's gate and up within a warpgroup's half of the accumulators
        (c,) = pp = [k.candidate for k in kids if k.candidate and "overlap_epilogue" in k.edit]
        assert ("size<0>(acc) / 2, h, 0)" in c.source) == (
            '"epilogue":"silu"' in tuned.source.splitlines()[0]
        )
        for c in pp:
            assert '"pingpong":true' in c.source.splitlines()[0] and '"bn":128' in c.source.splitlines()[0]
            assert "bar.arrive" in c.source and "Layout<Shape<_1, _1, _1>>" in c.source
            # its own moves keep what ping-pong needs: no wider tile, cluster or direct stores
            moves = [
                k.edit for k in ExpertPolicy().propose(Context(task=t, reference=t.source, parent=c), 30)
            ]
            assert "overlap_epilogue(_grouped_mm: pingpong=False)" in moves, moves
            assert not [m for m in moves if "bn=256" in m or "cluster" in m or "staged" in m], moves
        cands += pp
    for b in compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a")):
        assert b.status == Status.OK and not b.log, b.log
        (k,) = [r for r in b.resources if r.name.endswith("_gemm")]
        assert k.spill_stores == 0 and k.spill_loads == 0, k
        # the MMAs pipelined: the tile's sums are not cleared by other instructions (that serialized, C7515)
        assert not k.wgmma_serialized and not k.wgmma_waits_injected, k


GATED = {  # name -> (the write after the chunk, whether our kernel's epilogue takes both halves)
    "swiglu": ("out[start : start + n] = F.silu(gate) * up", True),
    "geglu_scaled": ("out[start : start + n] = F.gelu(gate) * up * 0.5", True),
    "gate_alone": ("out[start : start + n] = F.silu(gate)", False),
}


@pytest.mark.parametrize("name", sorted(GATED))
def test_a_gated_epilogue_is_fused_into_the_grouped_kernel(tmp_path, name):
    write, fused = GATED[name]
    forward = LOOPS["swiglu_skip_idle"][1].replace("out[start : start + n] = F.silu(gate) * up", write)
    t = probe(_write(tmp_path, name, _model(W_KN, forward), INPUTS))
    tuned = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
    plan = tuned.source.splitlines()[0]
    assert "wgmma_grouped" in plan
    assert ("constexpr int TN = 128;" in tuned.source) == fused and ('"epilogue"' in plan) == fused, plan
    if fused:  # the (M, 2I) product is never written: no view of it is left in the launcher
        assert ".split(" not in tuned.launcher and "size(acc) / 2" in tuned.source


BLOCK = ROOT / "tests" / "fixtures" / "moe" / "small_block.py"


def test_a_whole_block_is_captured_with_its_routing_computed_on_the_cpu():
    """Router, top-k, sort and bincount run for real on the CPU; the loop's two products per expert become two
    grouped GEMMs on the routing the block computes (a bincount export can size: a scatter-add into E zeros)."""
    g = capture(BLOCK)
    ops = [n.op for n in g.nodes]
    assert ops.count("_grouped_mm") == 2 and ops.count("mm") == 1, ops  # fc1, fc2; the router's product
    assert "bincount" not in ops and "scatter_add" in ops and "slice" not in ops, ops
    assert any("grouped GEMMs" in note for note in g.notes), g.notes
    assert sorted(s.key for s in g.state) == ["down", "gate_up", "router"]
    ok, why = supports(BLOCK)
    assert ok and "persistent grouped WGMMA kernel" in why, why


def test_emulated_block_candidates_match_the_reference(tmp_path):
    """The plain plan (torch._grouped_mm for both products, our kernels for the router's softmax and the rest)
    against the loop, on three draws of the tokens (three routings); the tuned plan runs our grouped kernel
    on both products with SwiGLU fused into fc1 (WGMMA: the GPU tests run it)."""
    module = load_module(BLOCK)
    torch.manual_seed(0)
    ref = module.Model(*module.get_init_inputs())
    t = probe(BLOCK)
    props = ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 2)
    plain, tuned = (p.candidate for p in props)
    plan = tuned.source.splitlines()[0]
    assert plan.count('"family":"wgmma_grouped"') == 2 and '"epilogue":"silu"' in plan, plan
    # the top-k weights, computed before fc2 now that nothing after the loop waits for them, go on its stores
    fc2 = next(r for r in json.loads(plan.split(": ", 1)[1])["regions"] if r["rid"] == "_grouped_mm_1")
    assert fc2.get("epilogue"), plan
    for b in compile_candidates([tuned], Config(home=tmp_path / "home", arch="sm_90a")):
        assert b.status == Status.OK and not b.log, b.log
        assert all(k.spill_stores == 0 and not k.wgmma_serialized for k in b.resources), b.resources
    assert plain.launcher.count("torch._grouped_mm(") == 2
    model = load_model(plain.launcher, build(plain.source, tmp_path))(*module.get_init_inputs())
    model.load_state_dict(ref.state_dict())
    for seed in range(3):
        torch.manual_seed(seed)
        (x,) = module.get_inputs()
        want, got = ref(x), model(x)
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_qwen3_block_is_probed_and_captured_at_full_size_on_the_cpu():
    """65536 expert rows: the experts' stacks (1.2 GB) stay on meta, so this costs seconds, not minutes."""
    path = ROOT / "tasks" / "moe" / "qwen3_block.py"
    t = probe(path)
    tokens, hidden = t.inputs[0].shape
    rows, experts, inter = tokens * 8, 128, 768
    assert (
        t.flops == 2 * tokens * hidden * experts + 2 * rows * hidden * 2 * inter + 2 * rows * inter * hidden
    )
    ops = [n.op for n in capture(path).nodes]
    assert ops.count("_grouped_mm") == 2, ops


def test_a_routing_read_from_an_expert_stack_is_refused_plainly(tmp_path):
    """Counts taken from the experts' own products cannot be known without computing them: said, not guessed."""
    path = tmp_path / "routed_by_products.py"
    path.write_text(
        HEADER.replace("E, K, N = 6, 64, 48", "E, K, N = 6, 1024, 1024")
        + "\n\nclass Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.w = nn.Parameter(torch.randn(E, K, N, dtype=torch.bfloat16))\n"
        "    def forward(self, x):\n"
        "        counts = torch.bincount((x @ self.w[0]).argmax(-1) % E, minlength=E)\n"
        "        out = torch.empty_like(x)\n        start = 0\n"
        "        for e, n in enumerate(counts.tolist()):\n"
        "            out[start : start + n] = x[start : start + n] @ self.w[e]\n            start += n\n"
        "        return out\n\n\ndef get_inputs():\n    return [torch.randn(64, K, dtype=torch.bfloat16)]\n"
        + INIT
    )
    with pytest.raises(
        CaptureError, match="not a loop over experts either: tracing the forward with real routing"
    ):
        capture(path)


def test_the_benchmarks_library_baselines_compute_what_the_loop_does(tmp_path):
    """bench_moe's torch._grouped_mm baseline (the one the targets are measured against) on the CPU, for an
    MN-major and a K-major stack: the same outputs as the reference loop."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_moe

    for name in ("plain_every_expert", "k_major_then_scaled"):
        module = load_module(_loop(tmp_path, name))
        torch.manual_seed(0)
        model = module.Model()
        x, counts = module.get_inputs()
        fn = bench_moe.libraries(module, model)["torch._grouped_mm"]
        want = model(x, counts)
        got = fn(x, counts)
        if name == "k_major_then_scaled":  # the product alone: the loop's relu and scale follow it
            got = torch.relu(got) * 0.5
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


WGRAD = """    def forward(self, x, dy, counts):
        out = {init}
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                out[e] = x[start : start + n].t() @ dy[start : start + n]
            start += n
        return out
"""
INPUTS_WGRAD = (
    f"\n\ndef get_inputs():\n    c = {COUNTS}\n"
    "    return [torch.randn(int(c.sum()), K, dtype=DT), torch.randn(int(c.sum()), N, dtype=DT), c]\n"
)


def test_a_weight_gradient_loop_is_one_grouped_gemm_split_along_the_tokens(tmp_path):
    """out[e] = x[rows of e]^T @ dy[rows of e]: captured as torch._grouped_mm(x.t(), dy, offs), which computes
    what the loop does under any routing (idle experts' zeros included); the expert says plainly that our
    grouped kernel does not split K yet, and a buffer that does not start as zeros is refused."""
    from pipeline.generate.expert.grouped import NotGrouped, rewrite

    path = _write(tmp_path, "wgrad", _model("", WGRAD.format(init="x.new_zeros(E, K, N)")), INPUTS_WGRAD)
    ops = [n.op for n in capture(path).nodes]
    assert ops.count("_grouped_mm") == 1 and "t" in ops and "mm" not in ops, ops
    module = load_module(path)
    model = module.Model()
    grouped = rewrite(module, model)
    for counts in _routings(40):
        x, dy = torch.randn(40, 64, dtype=torch.bfloat16), torch.randn(40, 48, dtype=torch.bfloat16)
        want, got = model(x, dy, counts), grouped(x, dy, counts)
        got = got[0] if isinstance(got, list | tuple) else got  # the graph module returns its outputs
        assert got.shape == want.shape == (6, 64, 48)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    ok, why = supports(path)
    assert not ok and "split K" in why, why
    junk = _write(tmp_path, "junk", _model("", WGRAD.format(init="x.new_empty(E, K, N)")), INPUTS_WGRAD)
    with pytest.raises(NotGrouped, match="zeros"):
        rewrite(load_module(junk), load_module(junk).Model())


def test_the_benchmarks_weight_gradient_baseline_computes_what_the_loop_does(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_moe

    path = _write(tmp_path, "wgrad", _model("", WGRAD.format(init="x.new_zeros(E, K, N)")), INPUTS_WGRAD)
    module = load_module(path)
    model = module.Model()
    args = module.get_inputs()
    got = bench_moe.libraries(module, model)["torch._grouped_mm"](*args)
    torch.testing.assert_close(got.float(), model(*args).float(), rtol=2e-2, atol=2e-2)
    t = probe(ROOT / "tasks" / "moe" / "qwen3_fc2_wgrad.py")  # the full-size task: (E, I, H) from 65536 rows
    assert t.flops == 2 * 65536 * 768 * 2048


def test_the_anatomy_script_switches_off_each_part_of_every_grouped_kernel():
    """benchmarks/moe_anatomy.py edits the rendered kernel by text: each part's switch is found once in the
    kernels it times (staged stores, the default, and ping-pong among them), or the script stops."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import moe_anatomy

    t = probe(ROOT / "tasks" / "moe" / "qwen3_fc2.py")
    policy = ExpertPolicy()
    tuned = policy.propose(Context(task=t, reference=t.source, parent=None), 2)[1].candidate
    kids = [
        k.candidate
        for k in policy.propose(Context(task=t, reference=t.source, parent=tuned), 30)
        if k.candidate
    ]
    for cand in [tuned, *kids]:
        v = moe_anatomy.variants(cand)
        assert list(v) == ["whole", "no stores", "no MMAs", "loads only"]
        assert v["whole"].source == cand.source and v["whole"].key == cand.key, cand.edit
        assert len({c.source for c in v.values()}) == 4, cand.edit
        assert (
            "if (K != -7) continue;" in v["loads only"].source and "busy && K == -7" in v["loads only"].source
        )
