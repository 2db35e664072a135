import numpy
import torch
import torch.nn as nn

THREADS = 256  # a multiple of 32


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        if x.numel() == 0:
            return out
        cols = x.shape[-1]
        rows = x.numel() // cols
        kernels.softmax_rows_online(rows, THREADS, (x, out, numpy.int64(rows), numpy.int64(cols)))
        return out
