"""Linear layer (8192 -> 8192, bf16) followed by GELU (tanh form) and a constant scale.

Eager PyTorch runs the GEMM in cuBLAS (bias fused into its epilogue), then one kernel for GELU and one
for the scale, each a full read and write of the 128 MB bf16 output. The floor is compute: 2 * 8192^3 =
1.1 TFLOP, about 1.4 ms at ~790 TFLOP/s of dense bf16; the bytes moved once (x, W, out: 3 x 128 MB) take
only about 90 us. Fusing bias, GELU and scale into one pass saves about a read and write of the output.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, IN_FEATURES, OUT_FEATURES = 8192, 8192, 8192  # bf16: x, W and out 128 MB each


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int, scale: float):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, dtype=torch.bfloat16)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x), approximate="tanh") * self.scale


def get_inputs():
    return [torch.randn(BATCH, IN_FEATURES, dtype=torch.bfloat16)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES, 0.5]


def get_alt_inputs():
    """Other batch shapes with the same feature sizes: an odd row count, and a small 3-d batch."""
    return [
        [torch.randn(999, IN_FEATURES, dtype=torch.bfloat16)],
        [torch.randn(3, 7, IN_FEATURES, dtype=torch.bfloat16)],
    ]
