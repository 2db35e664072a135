"""The harness on a real GPU (run by `make test-gpu` on the H200): honest candidates, crash recovery,
baselines, energy, calibration and the standalone export. Statuses and correctness only: no timed asserts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import calibrate, reasons, stages
from pipeline.config import load
from pipeline.types import Kind, Status

_torch = pytest.importorskip("torch")
# Every test here needs a CUDA device: on a machine without one, `make test-gpu` skips them and says why.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _torch.cuda.is_available(), reason="no CUDA device visible"),
]
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "candidates"
CRASH = ROOT / "tests" / "fixtures" / "crash"
HYBRID = {"matmul_bias_gelu", "conv_bias_relu_scale"}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-home")


@pytest.fixture(scope="module")
def pool(home):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cfg = load(home=home, baselines=("eager",), energy=False, job_timeout_s=120)
    with stages.open_pool(cfg) as p:
        yield p


def cfg_for(home, **kw):
    base = dict(home=home, baselines=("eager",), energy=False, job_timeout_s=120)
    base.update(kw)
    return load(**base)


def test_calibrate_gives_plausible_ceilings(pool, home):
    c = stages.ceilings(pool, cfg_for(home), force=True)
    if c is None:  # another process kept the GPU busy (pytest workers sharing it): refused, not cached
        assert any("busy with another process" in why for why, _ in stages.REFUSED.values())
        assert not any((home / "calibration").glob("*.json"))
        return
    assert c.busy_percent is None or c.busy_percent <= calibrate.BUSY_LIMIT
    assert 1e12 < c.copy_bytes_per_s < 1e13
    assert c.bf16_flops > c.tf32_flops > c.fp32_flops > 1e13
    assert (home / "calibration").is_dir()


def test_baselines_are_cached_per_task_and_reused_with_a_note(pool, home):
    cfg = cfg_for(home)
    task = ROOT / "tasks" / "softmax.py"
    _, first = stages.run_baselines(task, cfg, pool=pool, cached=True)
    assert not any("from the cache" in n for n in first.notes)
    assert list((home / "baselines" / "cache").glob("*.json"))
    _, again = stages.run_baselines(task, cfg, pool=pool, cached=True)
    assert again.timings == first.timings and again.floor_ms == first.floor_ms
    assert any("from the cache" in n for n in again.notes)
    _, fresh = stages.run_baselines(task, cfg, pool=pool)  # not asked for: measured anew
    assert not any("from the cache" in n for n in fresh.notes) and fresh.timings != first.timings


@pytest.mark.parametrize("task_id", sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()))
def test_honest_example_verifies_and_is_timed(pool, home, task_id):
    (r,) = stages.evaluate_candidates(
        ROOT / "tasks" / f"{task_id}.py", [EXAMPLES / task_id], cfg_for(home), pool=pool
    )
    assert r.build is not None and r.build.status == Status.OK, r.build and r.build.log
    assert r.verdict.status == Status.OK, r.verdict.reasons
    assert r.verdict.trials_passed == r.verdict.trials == 3
    assert r.verdict.kind == (Kind.HYBRID if task_id in HYBRID else Kind.CUSTOM)
    m = r.measurement
    assert m is not None and m.timing is not None and m.timing.median_ms > 0
    assert "eager" in m.baselines
    if m.floor_ms is None:  # the calibration was refused: GPU workers shared the card (make test-gpu -n)
        assert any("busy with another process" in why for why, _ in stages.REFUSED.values())
    else:
        assert m.floor_ms > 0
    assert m.environment.get("gpu")
    assert {"verify", "timing", "eager", "profile_check"} <= set(m.seconds) and all(
        v >= 0 for v in m.seconds.values()
    )
    # the kernels the profiler check saw: ours among them, with their GPU time (a hybrid's library ones too)
    ours = {k.name for k in r.build.resources}
    assert m.kernels and ours & set(m.kernels) and sum(m.kernels.values()) > 0, m.kernels
    if task_id in HYBRID:
        assert r.verdict.library_ops
        assert set(m.kernels) - ours, m.kernels


@pytest.mark.parametrize(
    ("case", "status", "code"),
    [
        ("illegal_address", Status.CRASH, "crash"),
        ("infinite_loop", Status.TIMEOUT, "timeout"),
        ("out_of_memory", Status.LAUNCH_ERROR, "out_of_memory"),
        ("bad_launch", Status.LAUNCH_ERROR, "launch_error"),
    ],
)
def test_crash_recovery(pool, home, case, status, code):
    task = ROOT / "tasks" / "elementwise_chain.py"
    cfg = cfg_for(home, job_timeout_s=30)
    (bad,) = stages.evaluate_candidates(task, [CRASH / case], cfg, pool=pool)
    assert bad.verdict.status == status, bad.verdict.reasons
    assert any(reasons.code_of(r) == code for r in bad.verdict.reasons), bad.verdict.reasons
    # the worker is back (restarted if it had to be) and evaluates an honest candidate correctly
    (good,) = stages.evaluate_candidates(task, [EXAMPLES / "elementwise_chain"], cfg_for(home), pool=pool)
    assert good.verdict.status == Status.OK, good.verdict.reasons


def test_baselines_eager_and_compile(pool, home):
    cfg = cfg_for(home, baselines=("eager", "compile"))
    _task, base = stages.run_baselines(ROOT / "tasks" / "softmax.py", cfg, pool=pool)
    assert set(base.timings) == {"eager", "compile"}
    assert base.compile_s["compile"] > 0
    assert all(t.median_ms > 0 and t.trials >= 10 for t in base.timings.values())
    assert base.floor_ms and base.floor_ms > 0 and base.environment["gpu"]


def test_energy_per_call(pool, home):
    cfg = cfg_for(home, energy=True, energy_window_s=1.0, energy_repeats=3)
    (r,) = stages.evaluate_candidates(
        ROOT / "tasks" / "elementwise_chain.py", [EXAMPLES / "elementwise_chain"], cfg, pool=pool
    )
    assert r.verdict.status == Status.OK, r.verdict.reasons
    e = r.measurement.energy
    # The repeat rule: at least energy_repeats windows, more until the spread is under energy_spread, at most
    # energy_max_repeats (a spread above the bound after the most windows is reported, not hidden).
    assert e is not None and cfg.energy_repeats <= e.repeats <= cfg.energy_max_repeats and e.window_s >= 0.9
    assert e.spread is not None and (e.spread <= cfg.energy_spread or e.repeats == cfg.energy_max_repeats)
    assert e.joules_per_call > 0 and 50 < e.avg_power_w < 1000


def test_export_runs_standalone(home, tmp_path):
    out = tmp_path / "model_new.py"
    cli = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "export",
        "--task",
        str(ROOT / "tasks" / "softmax.py"),
        "--candidate",
        str(EXAMPLES / "softmax"),
        "-o",
        str(out),
        "--home",
        str(home),
    ]
    subprocess.run(cli, check=True, cwd=ROOT)
    check = f"""
import importlib.util, sys, torch
sys.path.insert(0, {str(ROOT / "tasks")!r})
spec = importlib.util.spec_from_file_location("exported", {str(out)!r})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
import softmax
x = torch.randn(1000, 777, device="cuda")
got = m.ModelNew()(x)
ref = softmax.Model()(x)
assert (got - ref).abs().max().item() < 1e-5, "export disagrees with the reference"
print("EXPORT_OK")
"""
    # a clean interpreter outside the project: the file must need nothing of kernelpro
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert "EXPORT_OK" in r.stdout, r.stderr[-2000:]


def test_a_7_5_gb_input_verifies_within_memory(pool, home):
    """The protocol must fit wherever eager fits: the task's own reference, submitted as a candidate, is OK
    on a 7.5 GB fp32 input, and its timed outputs were checked."""
    from pipeline.selfcheck import reference_candidate

    task = ROOT / "tests" / "fixtures" / "tasks" / "huge_rmsnorm.py"
    cfg = cfg_for(home, timing_budget_s=0.5, job_timeout_s=600)
    (r,) = stages.evaluate_candidates(task, [reference_candidate(task)], cfg, pool=pool)
    assert r.verdict.status == Status.OK, r.verdict.reasons
    assert r.verdict.kind == Kind.HYBRID
    assert r.measurement is not None and r.measurement.timing.checked_calls >= 5
    assert r.measurement.timing.fresh_inputs
    parts = r.measurement.timing.seconds  # where the timing loop's host time went
    assert set(parts) == {"inputs", "flush", "calls", "checks"} and parts["checks"] > 0 and parts["calls"] > 0


def test_a_huge_tasks_baselines_with_energy_fit_after_its_candidate(pool, home):
    """A bench's workers outlive its tasks: the candidate worker must leave no cached memory behind, and the
    eager energy loop keeps no output it does not check. Before both, KernelBench's L2Norm (8.6 GB in and
    out) ran the reference worker out of memory after L1Norm's candidates (80 GB of kept outputs beside the
    candidate worker's 57 GB cache)."""
    from pipeline.selfcheck import reference_candidate

    task = ROOT / "tests" / "fixtures" / "tasks" / "huge_rmsnorm.py"
    cfg = cfg_for(home, timing_budget_s=0.5, job_timeout_s=600, energy=True, energy_window_s=0.5,
                  energy_repeats=2)  # fmt: skip
    (r,) = stages.evaluate_candidates(task, [reference_candidate(task)], cfg, pool=pool)
    assert r.verdict.status == Status.OK, r.verdict.reasons
    _task, base = stages.run_baselines(task, cfg, pool=pool)
    assert base.timings["eager"].median_ms > 0
    assert base.energy_eager is not None and base.energy_eager.joules_per_call > 0, base.notes


@pytest.mark.parametrize("o_dtype", ["float32", "float16", "bfloat16", "float64"])
def test_the_one_pass_comparison_gives_the_torch_forms_figures(o_dtype):
    """The timed calls' checks compare through one kernel (pipeline/fused_stats.py): its 13 figures against
    the torch form's (the CPU path) on outputs with NaN, infinities and errors, against a reference of the
    same dtype and of float64; counts and maxima equal, sums to float64 rounding."""
    torch = _torch
    from pipeline import fused_stats, tolerance

    gen = torch.Generator(device="cpu").manual_seed(7)
    n = 3 * 2**20 + 5  # not a multiple of the block's 256 threads
    ref64 = torch.randn(n, generator=gen, dtype=torch.float64) * 3
    dtype = getattr(torch, o_dtype)
    out = (ref64 + 1e-3 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)
    out[::9973] = float("nan")
    out[5::10007] = float("inf")
    ref64[7::20011] = float("-inf")
    out[7::40022] = float("-inf")  # half of the reference's infinities matched
    for ref in (ref64, ref64.to(dtype)):
        want, got = tolerance.OutputStats(), tolerance.OutputStats()
        want.add(out, ref, 1e-4, 1e-3)  # on the CPU: the torch form
        got.add(out.cuda(), ref.cuda(), 1e-4, 1e-3)
        assert fused_stats.figures(out.cuda(), ref.cuda(), 1e-4, 1e-3) is not None, "the kernel was not used"
        w, g = want._settle(), got._settle()
        for key in w:
            if key in ("diff_sq", "ref_sq", "out_sum", "out_sq", "ref_sum"):
                assert g[key] == pytest.approx(w[key], rel=1e-12, abs=1e-9), key
            else:
                assert g[key] == w[key], key
        assert w["unwritten"] > 0 and w["bad_special"] > 0 and w["over_base"] > 0

    class Sub(torch.Tensor):
        pass

    g = out.cuda()  # what the kernel refuses goes to the torch form: it reads raw device pointers
    assert not fused_stats.usable(g.as_subclass(Sub), g)  # data_ptr() could name memory it does not own
    assert not fused_stats.usable(g[: n - 5].view(-1, 2).t(), g[: n - 5].view(-1, 2).t())  # strided
    assert not fused_stats.usable(g[:4], g)  # sizes differ


CLUSTER_16 = r"""
extern "C" __global__ void __launch_bounds__(128) __cluster_dims__(16, 1, 1) ranks(int* out) {
    __shared__ int mine;
    unsigned rank, next;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    if (threadIdx.x == 0) mine = (int)rank;
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    const unsigned peer = (rank + 1) % 16;  // read the next block's shared memory: the cluster is real
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(next) : "r"((unsigned)__cvta_generic_to_shared(&mine)), "r"(peer));
    int theirs;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(theirs) : "r"(next));
    if (threadIdx.x == 0) out[blockIdx.x] = (int)rank * 100 + theirs;
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
"""


def _cubin_kernels(tmp_path, home, source: str, name: str):
    """`source` (one kernel, `name`) compiled for sm_90a with the project's nvcc, loaded by the runtime."""
    from pipeline import compile as comp
    from pipeline import runtime

    src, cubin = tmp_path / f"{name}.cu", tmp_path / f"{name}.cubin"
    src.write_text(source)
    subprocess.run(
        [comp.find_nvcc(cfg_for(home)), "-arch=sm_90a", "-cubin", "-o", str(cubin), str(src)], check=True
    )
    return runtime.Kernels.from_file(str(cubin), (name,))


def test_the_runtime_opts_in_to_a_cluster_of_16_and_says_how_many_fit(tmp_path, home):
    """A kernel compiled for clusters of 16 blocks (beyond the portable 8): the runtime reads its width,
    opts in, answers active_clusters (the launchers' guard before a wide cluster) and launches it; each
    block reads its neighbour's rank through distributed shared memory."""
    torch = _torch
    kernels = _cubin_kernels(tmp_path, home, CLUSTER_16, "ranks")
    room = kernels.active_clusters("ranks", (128,))
    assert room > 0, "this GPU has no room for a cluster of 16: the launchers fall back to a block per row"
    out = torch.full((64,), -1, dtype=torch.int32, device="cuda")
    kernels.ranks((64,), (128,), (out,))
    torch.cuda.synchronize()
    rank = torch.arange(64, device="cuda", dtype=torch.int32) % 16
    assert torch.equal(out, rank * 100 + (rank + 1) % 16)
    print(f"clusters of 16 at once: {room}")


GRID_WAIT = r"""
extern "C" __global__ void __launch_bounds__(256) all_arrive(int* count, int* seen) {
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1);
        int n;
        do {
            asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(n) : "l"(count) : "memory");
        } while (n < (int)gridDim.x);
        seen[blockIdx.x] = n;
    }
}
"""


def test_the_runtime_launches_a_cooperative_grid_of_every_resident_block(tmp_path, home):
    """active_blocks (blocks an SM holds) sizes a grid whose blocks all wait on each other: launched
    cooperatively it completes (every block resident at once), as the long rows' tiles rely on."""
    torch = _torch
    kernels = _cubin_kernels(tmp_path, home, GRID_WAIT, "all_arrive")
    per_sm = kernels.active_blocks("all_arrive", (256,))
    assert per_sm >= 2, per_sm
    blocks = torch.cuda.get_device_properties(0).multi_processor_count * per_sm
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    seen = torch.zeros(blocks, dtype=torch.int32, device="cuda")
    kernels.all_arrive((blocks,), (256,), (count, seen), cooperative=True)
    torch.cuda.synchronize()
    assert count.item() == blocks and bool((seen == blocks).all())
    with pytest.raises(RuntimeError, match="cuLaunchCooperativeKernel"):  # more than fit: refused, not hung
        kernels.all_arrive((blocks * 64,), (256,), (count, seen), cooperative=True)


AXPB = r"""
extern "C" __global__ void axpb(const float* x, const float* w, float* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    // rounded after the product and after the sum, as eager's mul and add: a fused multiply-add would differ in
    // the last bit, which twenty tanh layers can grow past any tolerance
    if (i < n) out[i] = __fadd_rn(__fmul_rn(x[i], w[i % 64]), 0.5f);
}
"""


def test_a_forward_replayed_from_a_cuda_graph_computes_what_it_computes_eagerly(tmp_path, home):
    """runtime.Graphs: the second call of a form captures, later ones replay; each call's inputs are its own
    (fresh values each time), outputs are not overwritten by the next call, a weight changed in place is
    read, a weight whose storage moved drops the graphs, and a forward a capture cannot hold (it
    synchronises) runs eagerly with the reason kept."""
    import numpy

    torch = _torch
    from pipeline import runtime

    kernels = _cubin_kernels(tmp_path, home, AXPB, "axpb")

    class Deep(torch.nn.Module):
        def __init__(self, sync: bool = False):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, device="cuda"))
            self.sync = sync

        def forward(self, x, scale):
            return kernels.graphed(self, self.body, (x, scale))

        def body(self, x, scale):
            for _ in range(20):  # twenty launches and a library op between them
                out = torch.empty_like(x)
                kernels.axpb(((x.numel() + 255) // 256,), (256,), (x, self.w, out, numpy.int64(x.numel())))
                x = torch.tanh(out) * scale
                if self.sync:
                    torch.cuda.synchronize()
            return x, x.sum()

        def eager(self, x, scale):
            with torch.no_grad():
                for _ in range(20):
                    x = torch.tanh(x * self.w.repeat(x.numel() // 64).view(x.shape) + 0.5) * scale
            return x, x.sum()

    model = Deep()
    graphs = lambda m: runtime._GRAPHS[m]  # noqa: E731
    with torch.no_grad():
        outs = []
        for call in range(4):
            x = torch.randn(1000, 64, device="cuda")
            got = model(x, 0.9)
            want = model.eager(x, 0.9)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-3)
            outs.append((got[0], want[0]))
            (form,) = graphs(model).forms.values()
            assert (form.graph is not None) == (call >= 1) and form.failed is None, form.failed
        for got, want in outs:  # none overwritten by a later replay
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        x = torch.randn(1000, 64, device="cuda")
        model.w.mul_(-1.5)  # in place: the graph reads it
        torch.testing.assert_close(model(x, 0.9)[0], model.eager(x, 0.9)[0], rtol=1e-5, atol=1e-5)
        for move in (
            "data",
            "replace",
        ):  # the storage moved, or the parameter replaced (load_state_dict's assign)
            if move == "data":
                model.w.data = torch.randn(64, device="cuda")
            else:
                model.w = torch.nn.Parameter(torch.randn(64, device="cuda"))
            for _ in range(3):  # the graphs go; the next calls capture again, each right
                torch.testing.assert_close(model(x, 0.9)[0], model.eager(x, 0.9)[0], rtol=1e-5, atol=1e-5)
            assert next(iter(graphs(model).forms.values())).graph is not None
        y = torch.randn(3, 640, device="cuda")  # another form, another graph; the scale is part of it
        for _ in range(2):
            torch.testing.assert_close(model(y, 1.1)[0], model.eager(y, 1.1)[0], rtol=1e-5, atol=1e-5)
        assert len(graphs(model).forms) == 2
    # with gradients on (the weight requires them) forward runs eagerly: no new form
    torch.testing.assert_close(model(y, 0.7)[0].detach(), model.eager(y, 0.7)[0], rtol=1e-5, atol=1e-5)
    assert len(graphs(model).forms) == 2

    syncing = Deep(sync=True)
    with torch.no_grad():
        for _ in range(3):  # random inputs after the failed capture: PyTorch's generator left usable
            x = torch.randn(1000, 64, device="cuda")
            torch.testing.assert_close(syncing(x, 0.9)[0], syncing.eager(x, 0.9)[0], rtol=1e-5, atol=1e-5)
    (form,) = graphs(syncing).forms.values()
    assert form.graph is None and form.failed, "a synchronising forward was captured"
    assert runtime.graph_notes(model) == ["forward replayed from a CUDA graph (2 argument form(s))"]
    assert runtime.graph_notes(syncing)[0].startswith("a CUDA graph capture failed, forward ran eagerly")
    print(f"capture refused, as it should be: {form.failed}")


def test_a_tensor_map_is_encoded_once_per_geometry_and_equals_a_fresh_encoding():
    """The runtime's descriptor cache (runtime.map_key): the same tensor again, or another over the same block,
    gets the cached bytes, which equal a fresh encoding; another view of the same address gets its own."""
    from pipeline import runtime

    torch = _torch
    cache: dict = {}
    a = torch.randn(300, 64, device="cuda")
    first = runtime.TensorMap(a, 128, 32, cache=cache)
    again = runtime.TensorMap(a.view(300, 64), 128, 32, cache=cache)
    assert again.raw is first.raw and again.tensor is not first.tensor and len(cache) == 1
    assert bytes(first.raw) == bytes(runtime.TensorMap(a, 128, 32).raw)  # uncached: the same descriptor
    other = runtime.TensorMap(a.view(600, 32), 128, 32, cache=cache)
    assert other.raw is not first.raw and bytes(other.raw) != bytes(first.raw) and len(cache) == 2


_FLUSH_PROBE = r"""
import sys
import cupy, torch
from pipeline import timing

dev = torch.device("cuda")
n = 8 * 2**20  # 32 MB of fp32: inside the L2, so a flush that misses it leaves it there
x = torch.rand(n, device=dev)
out = torch.zeros(1024, device=dev)
probe = cupy.RawKernel(r'''extern "C" __global__ void kp_l2_probe(const float4* x, float* out, long long n) {
    float s = 0.f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float4 v = x[i]; s += v.x + v.y + v.z + v.w;
    }
    atomicAdd(out + blockIdx.x, s);
}''', "kp_l2_probe")
flush = {"none": lambda: None, "writes": timing.L2Flusher(dev, "writes"), "clean": timing.L2Flusher(dev, "clean")}
for mode in sys.argv[1:]:
    x.mul_(1.0)  # x written: dirty and cached
    torch.cuda.synchronize()
    flush[mode]()
    torch.cuda.synchronize()
    probe((1024,), (256,), (cupy.from_dlpack(x), cupy.from_dlpack(out), cupy.int64(n // 4)))
    torch.cuda.synchronize()
"""


def test_the_clean_flush_leaves_the_l2_empty_of_the_call_and_of_dirty_lines(tmp_path):
    """What a timed call starts from (timing.L2Flusher), read by ncu's counters on the kernel that follows
    the flush, with ncu's own cache control off: with no flush the probe's 32 MB are L2 hits (the control);
    after either flush they are misses; after the writes flush the probe writes back the flush's dirty lines
    it evicts, after the clean one nothing."""
    from pipeline.profile.collect import find_ncu, parse_ncu_csv

    pytest.importorskip("cupy")
    ncu = find_ncu()
    if ncu is None:
        pytest.skip("no ncu")
    script = tmp_path / "flush_probe.py"
    script.write_text(_FLUSH_PROBE)
    modes = ("none", "writes", "clean")
    metrics = "lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum"
    # application replay: every counter pass reruns the script, so no pass sees a cache an earlier one warmed
    r = subprocess.run(
        [ncu, "--cache-control", "none", "--replay-mode", "application", "--kernel-name", "kp_l2_probe",
         "--csv", "--page", "raw", "--print-units", "base", "--metrics", metrics,
         sys.executable, str(script), *modes],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), os.environ.get("PYTHONPATH", "")))},
    )  # fmt: skip
    rows = parse_ncu_csv(r.stdout)
    assert len(rows) == len(modes), (r.stdout[-3000:], r.stderr[-3000:])
    got = {mode: row.metrics for mode, row in zip(modes, rows, strict=True)}
    print({m: {k: g.get(k) for k in metrics.split(",")} for m, g in got.items()})
    size = 32 * 2**20
    hit = got["none"]["lts__t_sector_hit_rate.pct"]
    assert hit > 60 and got["none"]["dram__bytes_read.sum"] < 0.2 * size, "the control: unflushed data hits"
    for mode in ("writes", "clean"):  # a cold stream still hits on some sectors (~20% on the H100)
        assert got[mode]["lts__t_sector_hit_rate.pct"] < hit / 2, f"{mode} flush left the call's data in L2"
        assert got[mode]["dram__bytes_read.sum"] > 0.9 * size, f"{mode} flush left the call's data in L2"
    # the writes flush's dirty lines, written back as the probe evicts them (10.9 MB on the H100: the L2 had
    # cleaned some while idle); after the clean flush, nearly none
    wrote = {mode: got[mode]["dram__bytes_write.sum"] for mode in modes}
    assert wrote["writes"] > 0.1 * size and wrote["clean"] < wrote["writes"] / 4, wrote
