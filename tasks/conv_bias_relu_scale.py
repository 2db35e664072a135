"""3x3 convolution (64 -> 128 channels, 'same' padding), plus an extra per-channel bias, ReLU and a scale.

Eager PyTorch runs the convolution in cuDNN and adds its bias in a separate pass, then one kernel each for
the extra bias, the ReLU and the scale: four full reads and writes of the 256 MB output after the
convolution. The convolution is 2 * 32 * 128 * 128 * 128 * 64 * 9 = 77 GFLOP (about 1.2 ms on fp32 FMA
units, about 0.16 ms on TF32 tensor cores); the bytes moved once (x 128 MB, out 256 MB, weights 0.3 MB)
take about 95 us. Fusing everything after the convolution into one pass saves three of those four passes.
"""

import torch
import torch.nn as nn

BATCH, IN_CHANNELS, OUT_CHANNELS, HEIGHT, WIDTH, KERNEL = 32, 64, 128, 128, 128, 3  # fp32


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, scale: float):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
        self.bias = nn.Parameter(torch.randn(out_channels, 1, 1) * 0.1)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x) + self.bias) * self.scale


def get_inputs():
    return [torch.randn(BATCH, IN_CHANNELS, HEIGHT, WIDTH)]


def get_init_inputs():
    return [IN_CHANNELS, OUT_CHANNELS, KERNEL, 2.0]


def get_alt_inputs():
    """Other shapes with the same channels: odd image sizes (planes not a multiple of 4), one tiny."""
    return [[torch.randn(3, IN_CHANNELS, 37, 53)], [torch.randn(1, IN_CHANNELS, 5, 7)]]
