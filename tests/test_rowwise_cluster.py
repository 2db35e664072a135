"""Two-pass row ops whose rows are too long for one block's shared memory (over 160 KB of fp32) but fit a
thread-block cluster's: each row spread over the cluster's blocks, each block's segment cached in its shared
memory and the statistics merged through distributed shared memory (templates/rowwise.py). Emulated against
PyTorch on the CPU (tests/cuda_emulator.py runs a cluster's blocks at once), with the cluster path checked to
be the one that ran; compiled for sm_90a by nvcc."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cuda_emulator import build, load_model
from expert_plans import tuned, tuned_with_edit

from pipeline.compile import compile_candidates
from pipeline.config import Config
from pipeline.profile.collect import dump_sass, parse_sass
from pipeline.static_check import check_launcher
from pipeline.tasks import load_module
from pipeline.types import Kind, Status

# name -> (module, what forward returns of y, input shape, blocks a cluster): rows of 176-400 KB
CASES = {
    "log_softmax_odd": ("nn.LogSoftmax(dim=-1)", "y", "2, 45001", 2),  # rows start unaligned
    "softmax_scaled": ("nn.Softmax(dim=-1)", "y * 2", "2, 100000", 4),
    "layer_norm_affine": ("nn.LayerNorm(50000)", "torch.relu(y)", "2, 50000", 2),
    "rms_norm": ("nn.RMSNorm(41000)", "y", "3, 41000", 2),
    "instance_norm": ("nn.InstanceNorm2d(3, affine=True)", "y", "2, 3, 210, 210", 2),
    "group_norm_spanning": ("nn.GroupNorm(2, 6)", "y", "2, 6, 121, 121", 2),  # segments cross channels
    # 16-bit rows: 8 elements a vector, half the vectors in flight (all of them spilled at 1024 threads)
    "layer_norm_bf16": ("nn.LayerNorm(60000).to(torch.bfloat16)", "y", "2, 60000", 2, "bfloat16"),
    # two cluster regions in one source: the cluster helpers are emitted once
    "two_regions": (
        "nn.InstanceNorm2d(3)",
        "y, torch.log_softmax(x.flatten(2), dim=-1)",
        "2, 3, 150, 301",
        2,
    ),
}


def _task(folder: Path, name: str) -> Path:
    mod, ret, shape, _, *dtype = CASES[name]
    path = folder / f"{name}.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n"
        f"        super().__init__()\n        self.op = {mod}\n\n    def forward(self, x):\n"
        f"        y = self.op(x)\n        return {ret}\n\n\n"
        f"def get_inputs():\n    return [(torch.randn({shape}) * 3 + 2).to(torch.{dtype[0] if dtype else 'float32'})]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_long_rows_are_spread_over_a_cluster_and_match_pytorch(tmp_path, name):
    path = _task(tmp_path, name)
    module = load_module(path)
    torch.manual_seed(0)
    ref = module.Model()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
    x = module.get_inputs()[0]
    with torch.no_grad():
        want = ref(x)
    cand = tuned(path)
    assert f'"cluster":{CASES[name][3]}' in cand.source.splitlines()[0]
    u = 4 if len(CASES[name]) > 4 else 8  # vectors in flight a thread: fewer of 16-bit ones
    assert f'"unroll":{u}' in cand.source.splitlines()[0] and f"t_[{u}]" in cand.source  # batched loads
    report = check_launcher(cand.launcher)
    assert report.ok and report.kind == Kind.CUSTOM, (report.library_ops, report.violations)
    kernels = build(cand.source, tmp_path)
    model = load_model(cand.launcher, kernels, sms=4)()
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():
        got = model(x)
    names = [launch[0] for launch in kernels.launches]
    assert names and all("_cluster_" in n for n in names), names
    grids = {launch[1][0] for launch in kernels.launches}
    assert all(g % CASES[name][3] == 0 for g in grids), grids  # whole clusters
    tol = 2e-2 if len(CASES[name]) > 4 else 1e-4  # a bf16 output: one rounding of 2^-8 relative
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.slow
def test_cluster_softmax_statistics_keep_minus_infinity_and_nan_as_pytorch_does(tmp_path):
    """Softmax's max and sum are taken a batch of loads at a time: a block whose whole segment is -inf (its
    running max stays -inf), -inf scattered through a row, and NaN, which spreads over its row."""
    path = _task(tmp_path, "log_softmax_odd")
    x = load_module(path).get_inputs()[0]
    x[0, :30000] = float("-inf")  # over the first block's whole segment
    x[1, 100:20000:7] = float("-inf")
    x[1, 40000] = float("nan")
    want = torch.log_softmax(x, dim=-1)
    cand = tuned(path)
    got = load_model(cand.launcher, build(cand.source, tmp_path), sms=4)()(x)
    assert got[1].isnan().all() and not got[0].isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


def test_a_row_one_block_can_cache_takes_no_cluster(tmp_path):
    """Below 160 KB a row keeps its block (registers or shared memory); a cluster only costs barriers."""
    path = tmp_path / "short.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
        "        return torch.log_softmax(x, dim=-1)\n\n\ndef get_inputs():\n    return [torch.randn(4, 40000)]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    assert '"cluster"' not in tuned(path).source.splitlines()[0]
    assert '"smem_row":true' in tuned_with_edit(path, "tile_shared_memory").source.splitlines()[0]


def test_cluster_kernels_compile_for_sm90a_without_spills(tmp_path):
    cands = [tuned(_task(tmp_path, name)) for name in sorted(CASES)]
    for name, b in zip(sorted(CASES), compile_candidates(cands, Config(home=tmp_path / "home", arch="sm_90a")),
                       strict=True):  # fmt: skip
        assert b.status == Status.OK and not b.log, b.log
        cluster = [r for r in b.resources if "_cluster_" in r.name]
        assert len(cluster) >= 2 and all(r.spill_stores == 0 for r in cluster), cluster
        # the fp32 vector kernels cache each loaded vector with one 16-byte shared store (NVVM split the
        # float4 store into STS.64 pairs until it went through PTX), 8 of them in flight a thread
        sass = parse_sass(dump_sass(b.cubin_path) or "")
        if len(CASES[name]) == 4 and name != "two_regions":
            (vec,) = [k for k in sass if k.endswith("_cluster_v4")]
            assert sass[vec].opcodes.get("STS.128", 0) >= 8, (name, sass[vec].opcodes)


def test_the_search_can_leave_the_cluster_for_a_block_per_row(tmp_path):
    """increase_occupancy on a cluster plan drops the cluster: a block per row, several an SM, whose
    launcher then takes no cluster kernel (on the H200 the cluster lost to it on LogSoftmax's 1.5 MB rows)."""
    path = _task(tmp_path, "log_softmax_odd")
    left = tuned_with_edit(path, "increase_occupancy")
    assert '"cluster"' in tuned(path).source.splitlines()[0]
    assert '"cluster"' not in left.source.splitlines()[0] and "_cluster_v" not in left.launcher
