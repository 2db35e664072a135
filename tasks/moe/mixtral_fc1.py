"""MoE expert projection fc1 of a Mixtral-like layer: a grouped GEMM with SwiGLU, bf16.

Tokens arrive sorted by expert; `counts[e]` tokens (an input, drawn skewed, some experts idle) go to
expert e. Each expert multiplies its rows of x (16384 x 4096) by its gate/up weight (4096 x 28672) and
applies SwiGLU: silu(gate) * up, 14336 columns out. The reference loops over the experts, as MoE code
without a grouped kernel does; torch._grouped_mm computes the same products in one call.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS, EXPERTS, HIDDEN, INTERMEDIATE = 16384, 8, 4096, 14336


class Model(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        w = torch.randn(experts, hidden, 2 * intermediate, dtype=torch.bfloat16) * hidden**-0.5
        self.gate_up = nn.Parameter(w)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self.intermediate)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            gate, up = (x[start : start + n] @ self.gate_up[e]).chunk(2, dim=-1)
            out[start : start + n] = F.silu(gate) * up
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
    return [torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16), routing(TOKENS, EXPERTS)]


def get_init_inputs():
    return [EXPERTS, HIDDEN, INTERMEDIATE]


def get_alt_inputs():
    """Other routings of the same tokens: every token to one expert, and no idle expert."""
    one = torch.zeros(EXPERTS, dtype=torch.int64)
    one[EXPERTS // 2] = TOKENS
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    return [[x, one], [x, routing(TOKENS, EXPERTS, idle=0)]]
