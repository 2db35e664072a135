"""A DenseNet-style join: twelve feature maps of 32 channels each and the block's (8, 64, 28, 28) fp32
input concatenated along the channels, as a dense block's last layer reads them (19.3 MB out). PyTorch's
cat is one kernel; a copy a piece would be thirteen launches."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor, *features: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, *features], dim=1)


def get_inputs():
    return [torch.randn(8, 64, 28, 28)] + [torch.randn(8, 32, 28, 28) for _ in range(12)]


def get_init_inputs():
    return []


def get_alt_inputs():
    """An odd image size and another batch."""
    return [[torch.randn(2, 64, 7, 9)] + [torch.randn(2, 32, 7, 9) for _ in range(12)]]
