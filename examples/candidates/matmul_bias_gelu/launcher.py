import numpy
import torch
import torch.nn as nn

THREADS = 256
MAX_ROW_BLOCKS = 65535  # grid.y limit; the kernel loops over rows beyond this


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int, scale: float):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, dtype=torch.bfloat16)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The GEMM stays in cuBLAS, without its bias: our kernel adds it with GELU and the scale in one pass.
        y = torch.matmul(x, self.linear.weight.t()).contiguous()
        if y.numel() == 0:
            return y
        bias = self.linear.bias.contiguous()
        cols = y.shape[-1]
        rows = y.numel() // cols
        vec = cols % 8 == 0 and y.data_ptr() % 16 == 0 and bias.data_ptr() % 16 == 0
        width = 8 if vec else 1
        grid = (-(-cols // (width * THREADS)), min(rows, MAX_ROW_BLOCKS))
        args = (y, bias, numpy.int64(rows), numpy.int32(cols), numpy.float32(self.scale))
        if vec:  # `kernels` is provided by the runtime
            kernels.bias_gelu_scale_v8(grid, (THREADS,), args)  # noqa: F821
        else:
            kernels.bias_gelu_scale_v1(grid, (THREADS,), args)  # noqa: F821
        return y
