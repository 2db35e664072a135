"""An Inception-style join: two branches' feature maps, (32, 96, 56, 56) and (32, 160, 56, 56) fp32,
concatenated along the channels after a ReLU on the first (the ReLU in its own kernel, then the copies).
Floor: read both once, write the result once (about 154 MB)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.relu(a), b], dim=1)


def get_inputs():
    return [torch.randn(32, 96, 56, 56), torch.randn(32, 160, 56, 56)]


def get_init_inputs():
    return []


def get_alt_inputs():
    """Odd channel counts and image sizes (rows no longer 16-byte aligned)."""
    return [[torch.randn(3, 5, 7, 9), torch.randn(3, 2, 7, 9)]]
