"""A SqueezeNet-style fire module at a mid-network size: a 1x1 squeeze of a (16, 128, 56, 56) fp32 map to 16
channels, then two expands (1x1 and 3x3, 64 channels each, bias and ReLU) joined along the channels. The
join is 25.7 MB: written once when the expands write their slices of it, three times when each writes its
own tensor and the cat copies both."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.squeeze = nn.Conv2d(128, 16, 1)
        self.expand1 = nn.Conv2d(16, 64, 1)
        self.expand3 = nn.Conv2d(16, 64, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.squeeze(x))
        return torch.cat([torch.relu(self.expand1(s)), torch.relu(self.expand3(s))], dim=1)


def get_inputs():
    return [torch.randn(16, 128, 56, 56)]


def get_init_inputs():
    return []


def get_alt_inputs():
    """Another batch size (the kernels are built for the image size and channels)."""
    return [[torch.randn(3, 128, 56, 56)]]
