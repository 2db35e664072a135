import numpy
import torch
import torch.nn as nn

THREADS = 256


class ModelNew(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        c = torch.matmul(a, b)  # cuBLAS fp32, exactly what eager runs
        out = torch.empty_like(c)
        n = c.numel()
        blocks = max(1, min((n + THREADS - 1) // THREADS, 132 * 32))
        kernels.relu(blocks, THREADS, (c, out, numpy.int64(n)))
        return out
