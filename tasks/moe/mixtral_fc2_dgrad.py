"""MoE backward, dgrad of fc2 in a Mixtral-like layer: the gradient of each expert's input rows, a grouped GEMM, bf16.

fc2 computed y[rows of e] = h[rows of e] @ down[e] (down[e] is 14336 x 4096); its input gradient is
grad_h[rows of e] = grad_y[rows of e] @ down[e]^T: the same groups, the weights read transposed (K-major).
`counts[e]` tokens (drawn skewed, some experts idle) go to expert e. The reference loops over the experts.
"""

import torch
import torch.nn as nn

TOKENS, EXPERTS, HIDDEN, INTERMEDIATE = 16384, 8, 4096, 14336


class Model(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int):
        super().__init__()
        w = torch.randn(experts, intermediate, hidden, dtype=torch.bfloat16) * intermediate**-0.5
        self.down = nn.Parameter(w)

    def forward(self, grad_y: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        grad_h = grad_y.new_empty(grad_y.shape[0], self.down.shape[1])
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            grad_h[start : start + n] = grad_y[start : start + n] @ self.down[e].t()
            start += n
        return grad_h


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
    one[-1] = TOKENS
    g = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    return [[g, one], [g, routing(TOKENS, EXPERTS, idle=0)]]
