"""The roofline floor's bytes (Task.min_bytes): an input read twice only where no kernel can read it once."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.forced_reads import ON_CHIP_BYTES
from pipeline.tasks import probe

ROOT = Path(__file__).resolve().parent.parent
KERNELBENCH = ROOT.parent / "shared" / "kernelbench" / "level1"

TASK = """import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def forward(self, x):
        {body}


def get_inputs():
    return [torch.rand({shape})]


def get_init_inputs():
    return []
"""
BIG = "2, 256, 1024, 1024"  # 2 GiB of fp32: far more than any chip holds
SMALL = "64, 1024, 1024"  # 256 MiB, exactly what the floor lets stay on chip


def _bytes(tmp_path: Path, body: str, shape: str) -> tuple[int, int]:
    """(min_bytes, each input and output once) of a task returning `body`."""
    path = tmp_path / f"t{len(list(tmp_path.iterdir()))}.py"
    path.write_text(TASK.format(body=body, shape=shape))
    t = probe(path)
    once = sum(4 * _numel(s.shape) for s in (*t.inputs, *t.outputs))
    return t.min_bytes, once


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("body", [
    "return x / torch.norm(x, p='fro')",  # level 1's Frobenius norm
    "return x - x.mean()",
    "s = (x * x).sum()\n        return x * torch.rsqrt(s)",  # the reduction of a product of the input
    "return F.softmax(x.view(2, -1), dim=-1)",  # one row a GiB
])  # fmt: skip
def test_an_input_reduced_whole_then_read_beside_its_reduction_is_counted_twice(tmp_path, body):
    got, once = _bytes(tmp_path, body, BIG)
    x = 2 * 256 * 1024 * 1024 * 4
    slices = 2 if "softmax" in body else 1  # each row reduced apart, each keeps the chip's worth
    assert got == once + x - slices * ON_CHIP_BYTES


@pytest.mark.parametrize("body", [
    "return x * 2.0, x.sum()",  # one pass computes both
    "s = (x * 2.0).sum()\n        return s + 1.0",  # the sum read again, not x
    "return F.softmax(x, dim=-1)",  # rows of 4 KB: a kernel keeps each on chip
    "return F.group_norm(x, 8)",  # groups of 128 MiB
    "return x / x.amax(dim=(2, 3), keepdim=True)",  # slices of 4 MiB
])  # fmt: skip
def test_reductions_one_pass_or_slices_on_chip_can_serve_count_each_input_once(tmp_path, body):
    got, once = _bytes(tmp_path, body, BIG)
    assert got == once


def test_an_input_the_chip_holds_is_read_once(tmp_path):
    got, once = _bytes(tmp_path, "return x / torch.norm(x)", SMALL)
    assert got == once


@pytest.mark.skipif(not KERNELBENCH.is_dir(), reason="../shared/kernelbench is not beside the repository")
def test_kernelbench_frobenius_norm_floor_counts_its_second_read_and_group_norm_does_not():
    fro, gn = probe(KERNELBENCH / "37_FrobeniusNorm_.py"), probe(KERNELBENCH / "35_GroupNorm_.py")
    x = 112 * 64 * 512 * 512 * 4
    assert fro.min_bytes == 2 * x + (x - ON_CHIP_BYTES)
    assert gn.min_bytes == 2 * x + gn.param_bytes


def test_an_op_the_follower_cannot_read_leaves_the_forward_running_and_each_input_counted_once(monkeypatch):
    import torch
    import torch.nn.functional as F

    from pipeline import forced_reads

    x = torch.empty(2, 2**28, device="meta")
    with forced_reads.ForcedReads([x]) as reads:
        y = x / x.norm()
    assert reads.bytes == x.numel() * 4 - ON_CHIP_BYTES and y.shape == x.shape
    monkeypatch.setitem(forced_reads.SELF_NORMALISING, "_softmax", lambda a, o: o[7].numel())  # IndexError
    with forced_reads.ForcedReads([x]) as reads:
        y = F.softmax(x, dim=-1) + x / x.norm()  # the forward runs on; nothing after the softmax is counted
    assert reads.lost and reads.bytes == 0 and y.shape == x.shape
