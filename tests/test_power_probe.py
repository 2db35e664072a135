"""benchmarks/power_probe.py's kernels (issue 19's energy probe) build for sm_90 with the real nvcc: its inline PTX
(mbarriers, cp.async.bulk in both directions, streaming loads and stores) assembles, and each variant the script
launches is in the cubin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.compile import find_nvcc
from pipeline.config import load

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_the_probe_kernels_build_for_sm90(tmp_path):
    pytest.importorskip("cupy")
    import power_probe

    src = tmp_path / "probe.cu"
    src.write_text(power_probe.SRC)
    nvcc = find_nvcc(load(home=tmp_path / "home"))
    ptx = tmp_path / "probe.ptx"
    r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-ptx", str(src), "-o", str(ptx)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    text = ptx.read_text()
    for name in ("lsu", "lsu_cs", "lsu_cs_u4", "tma_copy", "tma_copy_big", "tma_axpb", "tma_in"):
        assert f".entry {name}(" in text, name
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in text
    assert "cp.async.bulk.global.shared::cta.bulk_group" in text
    cubin = tmp_path / "probe.cubin"
    r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-cubin", str(src), "-o", str(cubin)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and cubin.stat().st_size > 0, r.stderr
