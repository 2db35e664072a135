import numpy
import torch
import torch.nn as nn
import torch.nn.functional as F

THREADS = 256
MAX_BLOCKS = 65535  # the kernel loops over planes beyond this


class ModelNew(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, scale: float):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
        self.bias = nn.Parameter(torch.randn(out_channels, 1, 1) * 0.1)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The convolution stays in cuDNN, without its bias; our kernel adds both biases, applies the ReLU and
        # the scale in one pass, in place on the convolution's fresh output (NCHW, so one plane per channel).
        conv = self.conv
        y = F.conv2d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups).contiguous()
        if y.numel() == 0:
            return y
        channels = y.shape[1]
        hw = y.shape[2] * y.shape[3]
        planes = y.shape[0] * channels
        args = (
            y,
            conv.bias.contiguous(),
            self.bias.contiguous(),
            numpy.int64(planes),
            numpy.int32(channels),
            numpy.int64(hw),
            numpy.float32(self.scale),
        )
        kernels.bias_relu_scale((min(planes, MAX_BLOCKS),), (THREADS,), args)  # noqa: F821
        return y
