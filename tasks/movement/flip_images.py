"""Images flipped left-right and upside down: torch.flip over the last two dims of a (32, 64, 128, 128) fp32
batch (128 MB). Pure data movement: the floor is one read and one write, 256 MB, about 60 us at 4.3 TB/s.
Along the last dim the reads run backwards."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flip(x, dims=(2, 3))


def get_inputs():
    return [torch.randn(32, 64, 128, 128)]


def get_init_inputs():
    return []


def get_alt_inputs():
    """An odd image size, and a single image."""
    return [[torch.randn(3, 5, 33, 65)], [torch.randn(1, 1, 7, 9)]]
