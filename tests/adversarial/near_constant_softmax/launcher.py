import numpy
import torch
import torch.nn as nn

THREADS = 256


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        cols = x.shape[-1]
        rows = x.numel() // cols
        kernels.softmax_rows(rows, THREADS, (x, out, numpy.int64(rows), numpy.int64(cols)))
        return out
