import numpy
import torch
import torch.nn as nn

THREADS = 256


class ModelNew(nn.Module):
    def __init__(self, scale: float, shift: float):
        super().__init__()
        self.scale = scale
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act_term = torch.empty_like(x)
        res_term = torch.empty_like(x)
        n = x.numel()
        blocks = max(1, min((n + THREADS - 1) // THREADS, 4096))
        kernels.chain_terms(blocks, THREADS, (x, act_term, res_term, numpy.int64(n), numpy.float32(self.scale),
                                              numpy.float32(self.shift)))
        return sum((act_term, res_term))  # builtin sum: 0 + act_term + res_term, two torch add kernels
