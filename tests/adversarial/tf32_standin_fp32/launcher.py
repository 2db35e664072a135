import numpy
import torch
import torch.nn as nn

THREADS = 256


def grid(n):
    return max(1, min((n + THREADS - 1) // THREADS, 132 * 32))


class ModelNew(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a32 = torch.empty_like(a)
        b32 = torch.empty_like(b)
        kernels.to_tf32(grid(a.numel()), THREADS, (a, a32, numpy.int64(a.numel())))
        kernels.to_tf32(grid(b.numel()), THREADS, (b, b32, numpy.int64(b.numel())))
        c = torch.matmul(a32, b32)
        out = torch.empty_like(c)
        kernels.relu(grid(c.numel()), THREADS, (c, out, numpy.int64(c.numel())))
        return out
