"""Bilinear upsampling by 2 (align_corners=False, the default of nn.Upsample's bilinear mode): a (8, 64,
128, 128) fp32 map (32 MB) to (8, 64, 256, 256) (128 MB). Each output blends the four inputs around its
source coordinate; the inputs are read from cache, so the floor is the output's write and one read."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x)


def get_inputs():
    return [torch.randn(8, 64, 128, 128)]


def get_init_inputs():
    return []


def get_alt_inputs():
    """Another batch and channel count (the kernel is built for the spatial sizes)."""
    return [[torch.randn(1, 7, 128, 128)]]
