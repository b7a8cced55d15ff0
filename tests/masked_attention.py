"""A one-layer attention model whose mask is built in forward, as HF builds them (shared by the
causal-mask tests and, on gloo ranks, the emitted engine's gap test: ``tests/`` is on every
rank's path)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

T = 8


class MaskedAttention(nn.Module):
    """One attention layer whose mask ``kind`` is built in forward, as HF does."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(16, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 32)

    def mask(self, tokens):
        i = torch.arange(T, device=tokens.device)
        keep = i[None, :] <= i[:, None]                                   # causal
        if self.kind == "sliding":
            keep = keep & (i[:, None] - i[None, :] < 3)
        if self.kind == "padding":                                       # depends on the input
            keep = keep & (tokens != 0)[:, None, None, :]
        if self.kind == "additive":
            return torch.zeros(T, T, device=tokens.device).masked_fill(~keep, float("-inf"))
        return keep[None, None].expand(tokens.shape[0], 1, T, T) if keep.dim() == 2 else keep

    def forward(self, tokens):
        x = self.emb(tokens)
        q, k, v = self.qkv(x).view(tokens.shape[0], T, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(tokens))
        return self.out(y.transpose(1, 2).reshape(tokens.shape[0], T, 16))


def loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())
