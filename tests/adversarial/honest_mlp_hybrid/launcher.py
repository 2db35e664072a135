import numpy
import torch
import torch.nn as nn
import torch.nn.functional as F

THREADS = 256


class ModelNew(nn.Module):
    def __init__(self, d_in: int, d_hidden: int, d_out: int):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.fc1.weight, self.fc1.bias)
        r = torch.empty_like(h)
        n = h.numel()
        kernels.relu(max(1, min((n + THREADS - 1) // THREADS, 4224)), THREADS, (h, r, numpy.int64(n)))
        return F.linear(r, self.fc2.weight, self.fc2.bias)
