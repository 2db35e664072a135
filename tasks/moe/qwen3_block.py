"""A whole MoE block of a Qwen3-30B-A3B layer, bf16: router, top-8 of 128 experts, tokens permuted by expert,
fc1 with SwiGLU and fc2 per expert, and the results combined back per token with the top-k weights.

8192 tokens of 2048 features, each sent to 8 experts: 65536 expert rows, the rows of qwen3_fc1.py and
qwen3_fc2.py. The router's weights are drawn skewed (some experts popular, some rarely chosen), so the
groups are uneven. The reference loops over the experts, as MoE code without a grouped kernel does.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS, EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8192, 128, 2048, 768, 8


class Model(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        skew = torch.linspace(2.0, 0.0, experts).unsqueeze(1)  # a popularity bias per expert
        self.router = nn.Parameter((torch.randn(experts, hidden) * hidden**-0.5 + skew * 0.05).bfloat16())
        self.gate_up = nn.Parameter(
            torch.randn(experts, hidden, 2 * intermediate, dtype=torch.bfloat16) * hidden**-0.5
        )
        self.down = nn.Parameter(
            torch.randn(experts, intermediate, hidden, dtype=torch.bfloat16) * intermediate**-0.5
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax((x @ self.router.t()).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0])
        xs = x[token]
        y = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            gate, up = (xs[start : start + n] @ self.gate_up[e]).chunk(2, dim=-1)
            y[start : start + n] = (F.silu(gate) * up) @ self.down[e]
            start += n
        y = y * weights.flatten()[order].unsqueeze(1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)


def get_inputs():
    return [torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)]


def get_init_inputs():
    return [EXPERTS, HIDDEN, INTERMEDIATE, TOP_K]
