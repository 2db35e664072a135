"""Zero padding of 3 on every side of a (32, 64, 112, 112) fp32 batch, as a 7 x 7 convolution's input
would be padded by hand (F.pad, constant mode). The output (118 x 118 images) is filled, then the input
copied into its middle: the floor is one read of the input and one write of the output (about 213 MB)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (3, 3, 3, 3))


def get_inputs():
    return [torch.randn(32, 64, 112, 112)]


def get_init_inputs():
    return []


def get_alt_inputs():
    """An odd size."""
    return [[torch.randn(2, 3, 5, 7)]]
