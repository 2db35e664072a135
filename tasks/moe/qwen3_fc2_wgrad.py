"""MoE backward, wgrad of fc2 in a Qwen3-30B-A3B layer: the gradient of each expert's down-projection weight, a grouped
GEMM whose groups split the reduction (the tokens), bf16.

fc2 computed y[rows of e] = h[rows of e] @ down[e] (768 x 2048); its weight gradient is
grad_down[e] = h[rows of e]^T @ grad_y[rows of e]: a sum over expert e's tokens, so the groups run along K
(ragged), and an expert with no token gets zeros. `counts[e]` tokens (drawn skewed, some experts idle) go
to expert e. The reference loops over the experts; torch._grouped_mm(h.t(), grad_y, offs) computes the same.
"""

import torch
import torch.nn as nn

TOKENS, EXPERTS, HIDDEN, INTERMEDIATE = 65536, 128, 2048, 768


class Model(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.experts, self.hidden, self.intermediate = experts, hidden, intermediate

    def forward(self, h: torch.Tensor, grad_y: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        grad_down = h.new_zeros(self.experts, self.intermediate, self.hidden)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            grad_down[e] = h[start : start + n].t() @ grad_y[start : start + n]
            start += n
        return grad_down


def routing(tokens: int, experts: int, idle: int | None = None) -> torch.Tensor:
    """Tokens per expert (int64, sums to tokens), skewed: Zipf-like popularity over a random order of the
    experts, and a quarter of them (at least one) given no token at all."""
    rank = torch.randperm(experts).float()
    idle = max(1, experts // 4) if idle is None else idle
    p = torch.where(rank >= experts - idle, 0.0, 1.0 / (rank + 1.0) ** 1.2)
    expert = torch.multinomial(p, tokens, replacement=True)
    return torch.zeros(experts, dtype=torch.int64).scatter_add_(0, expert, torch.ones_like(expert))


def get_inputs():
    h = torch.randn(TOKENS, INTERMEDIATE, dtype=torch.bfloat16)
    return [h, torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16), routing(TOKENS, EXPERTS)]


def get_init_inputs():
    return [EXPERTS, HIDDEN, INTERMEDIATE]


def get_alt_inputs():
    """Other routings of the same tokens: every token to one expert, and no idle expert."""
    one = torch.zeros(EXPERTS, dtype=torch.int64)
    one[0] = TOKENS
    h = torch.randn(TOKENS, INTERMEDIATE, dtype=torch.bfloat16)
    g = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    return [[h, g, one], [h, g, routing(TOKENS, EXPERTS, idle=0)]]
