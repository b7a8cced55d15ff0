"""GPT (GPT-2 / GPT-3 shapes), written the nanoGPT way: pre-LayerNorm blocks, fused QKV projection,
``F.scaled_dot_product_attention(is_causal=True)``, GELU MLP of width ``ffn`` (4 * hidden), learned
position embeddings, LM head tied to the token embedding.

Parameters: 12*l*h^2 + 13*l*h (blocks) + (V + T)*h + 2h (embeddings, final LayerNorm) with ffn=4h.
Init (nanoGPT): weights N(0, 0.02), residual projections N(0, 0.02/sqrt(2*layers)), biases 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.init import init_normal


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50257      # token vocabulary (GPT-2: 50257; GPT-3 padded to 51200)
    seq: int = 1024         # context length = rows of the position table
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    ffn: int = 0            # MLP width; 0 means 4 * hidden
    bias: bool = True       # biases in Linear and LayerNorm (GPT-2: yes)
    tie: bool = True        # LM head shares the token-embedding matrix (GPT-2/3: yes)
    dropout: float = 0.0    # 0 keeps multi-rank numerics deterministic

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)  # q, k, v fused
        self.c_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape                                              # (B, T, C)
        q, k, v = self.c_attn(x).split(C, dim=2)                       # 3 x (B, T, C)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)               # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden, cfg.ffn_width, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.ffn_width, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))                       # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))                                # (B, T, C)
        return x + self.mlp(self.ln_2(x))                              # (B, T, C)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab, cfg.hidden),
            wpe=nn.Embedding(cfg.seq, cfg.hidden),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.layers)]),
            ln_f=nn.LayerNorm(cfg.hidden, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(init_normal)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape                                               # (B, T) token ids
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)      # (B, T, C)
        for block in self.transformer.h:
            x = block(x)                                               # (B, T, C)
        x = self.transformer.ln_f(x)                                   # (B, T, C)
        return self.lm_head(x)                                         # (B, T, V) logits
