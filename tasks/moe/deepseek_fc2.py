"""MoE expert projection fc2 of a DeepSeek-V3-like layer: a grouped GEMM, bf16.

Tokens arrive sorted by expert; `counts[e]` tokens (an input, drawn skewed, some experts idle) go to
expert e. Each expert multiplies its rows of h (32768 x 2048, the SwiGLU output of fc1) by its down
weight (2048 x 7168). The reference loops over the experts; torch._grouped_mm computes the same in one call.
"""

import torch
import torch.nn as nn

TOKENS, EXPERTS, HIDDEN, INTERMEDIATE = 32768, 256, 7168, 2048


class Model(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int):
        super().__init__()
        w = torch.randn(experts, intermediate, hidden, dtype=torch.bfloat16) * intermediate**-0.5
        self.down = nn.Parameter(w)

    def forward(self, h: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = h.new_empty(h.shape[0], self.down.shape[-1])
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            out[start : start + n] = h[start : start + n] @ self.down[e]
            start += n
        return out


def routing(tokens: int, experts: int, idle: int | None = None) -> torch.Tensor:
    """Tokens per expert (int64, sums to tokens), skewed: Zipf-like popularity over a random order of the
    experts, and a quarter of them (at least one) given no token at all."""
    rank = torch.randperm(experts).float()
    idle = max(1, experts // 4) if idle is None else idle
    p = torch.where(rank >= experts - idle, 0.0, 1.0 / (rank + 1.0) ** 1.2)
    expert = torch.multinomial(p, tokens, replacement=True)
    return torch.zeros(experts, dtype=torch.int64).scatter_add_(0, expert, torch.ones_like(expert))


def get_inputs():
    return [torch.randn(TOKENS, INTERMEDIATE, dtype=torch.bfloat16), routing(TOKENS, EXPERTS)]


def get_init_inputs():
    return [EXPERTS, HIDDEN, INTERMEDIATE]


def get_alt_inputs():
    """Other routings of the same tokens: every token to one expert, and no idle expert."""
    one = torch.zeros(EXPERTS, dtype=torch.int64)
    one[0] = TOKENS
    h = torch.randn(TOKENS, INTERMEDIATE, dtype=torch.bfloat16)
    return [[h, one], [h, routing(TOKENS, EXPERTS, idle=0)]]
