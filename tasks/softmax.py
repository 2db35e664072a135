"""Softmax over the last dimension of a 16384 x 4096 fp32 matrix.

Eager PyTorch runs one fused softmax kernel, a block per row, which reads each row more than once (a max
pass, a sum pass and the write pass; the later passes mostly from cache). The floor is one read and one
write: 2 x 256 MB = 512 MB, about 125 us at 4.3 TB/s. About 5 FLOPs per element (max, subtract, exp, sum,
scale): 0.34 GFLOP, far below any compute ceiling, so the task is memory-bound.
"""

import torch
import torch.nn as nn

ROWS, COLS = 16384, 4096  # 256 MB of fp32 in, 256 MB out


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def get_inputs():
    return [torch.randn(ROWS, COLS)]


def get_init_inputs():
    return []


def get_alt_inputs():
    """Other shapes: an odd row length, and rows longer than one block keeps in registers."""
    return [[torch.randn(999, 777)], [torch.randn(3, 7, 20001)]]
