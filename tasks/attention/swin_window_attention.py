"""Swin V2's shifted-window attention at its first stage: 10 images of 56 x 56 tokens in 64 windows of 7 x 7
(49 keys), 3 heads of 32. Cosine scores (F.normalize of q and k), a learned scale a head, a bias a head, and
the shifted windows' mask, one per window, added through a view that splits the batch into (images, windows);
the softmax and the product with v. The projections are left out: the attention alone."""

import torch
import torch.nn as nn
import torch.nn.functional as F

IMAGES, WINDOWS, HEADS, TOKENS, HEAD_DIM = 10, 64, 3, 49, 32


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(HEADS, 1, 1)))
        self.bias = nn.Parameter(torch.randn(HEADS, TOKENS, TOKENS))
        # the shifted windows' regions: a token may attend only to tokens of its own region (-100 elsewhere)
        region = torch.randint(0, 4, (WINDOWS, TOKENS))
        mask = (region.unsqueeze(1) - region.unsqueeze(2) != 0).float() * -100.0
        self.register_buffer("mask", mask)

    def forward(self, q, k, v):
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        scale = torch.clamp(self.logit_scale, max=torch.log(torch.tensor(100.0))).exp()
        attn = attn * scale + 16 * torch.sigmoid(self.bias).unsqueeze(0)
        attn = attn.view(IMAGES, WINDOWS, HEADS, TOKENS, TOKENS) + self.mask.unsqueeze(1).unsqueeze(0)
        attn = F.softmax(attn.view(-1, HEADS, TOKENS, TOKENS), dim=-1)
        return attn @ v


def get_inputs():
    shape = (IMAGES * WINDOWS, HEADS, TOKENS, HEAD_DIM)
    return [torch.randn(shape), torch.randn(shape), torch.randn(shape)]


def get_init_inputs():
    return []
