"""Mean over the middle dimension of a 64 x 4096 x 512 fp32 tensor (a strided, non-contiguous reduction).

Eager PyTorch runs one reduction kernel. The floor is one read of the 512 MB input (the 128 KB output is
negligible): about 125 us at 4.3 TB/s. One add per element: 0.13 GFLOP, so memory-bound. Threads should
run along the contiguous last dimension and sum down the reduced one, so that loads stay coalesced, and the
reduced dimension must be split across blocks to put enough loads in flight.
"""

import torch
import torch.nn as nn

OUTER, REDUCED, INNER = 64, 4096, 512  # 512 MB of fp32 in, 128 KB out


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mean(x, dim=self.dim)


def get_inputs():
    return [torch.randn(OUTER, REDUCED, INNER)]


def get_init_inputs():
    return [1]


def get_alt_inputs():
    """Other shapes reduced over dimension 1: an odd inner size, and a small 4-d tensor (inner = 7 x 3)."""
    return [[torch.randn(3, 1001, 77)], [torch.randn(5, 33, 7, 3)]]
