"""Swin's shifted windows: a (32, 56, 56, 128) fp32 feature map (51 MB, channels last) rolled by -3 along
height and width, as SwinV2 does before its window attention. Four blocks move, each a run of whole
128-channel rows; the floor is one read and one write."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.roll(x, shifts=(-3, -3), dims=(1, 2))


def get_inputs():
    return [torch.randn(32, 56, 56, 128)]


def get_init_inputs():
    return []


def get_alt_inputs():
    """Windows of odd size and an odd channel count."""
    return [[torch.randn(2, 7, 9, 33)]]
