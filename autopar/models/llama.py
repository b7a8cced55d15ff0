"""LLaMA-3 style decoder, written like Meta's reference ``model.py``: RMSNorm, rotary position
embeddings (RoPE, theta 500000), grouped-query attention (``kv_heads`` key/value heads repeated to
``heads``), SwiGLU MLP ``w2(silu(w1 x) * w3 x)``, untied output head.

Parameters: per layer 2*h*h + 2*h*(kv_heads*head_dim) (wq, wo, wk, wv) + 3*h*ffn + 2h (norms);
plus 2*V*h (embedding and head, untied) + h.
RoPE cos/sin tables are non-persistent buffers of shape (seq, head_dim) computed at build time.
Init: Linear and Embedding weights N(0, 0.02); RMSNorm weights 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.init import init_normal


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 128256
    seq: int = 8192             # RoPE table length (the training context)
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336            # SwiGLU hidden width
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie: bool = False           # LLaMA-3 8B/70B/405B: untied

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads "
                             f"({self.kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, 1)
        return x * rms * self.weight                                   # (B, T, C)


def rope_tables(seq: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq, head_dim): angle t * theta^(-2i/head_dim), halves repeated."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)  # (seq, hd/2)
    angles = torch.cat([angles, angles], dim=-1)                            # (seq, hd)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin                              # (B, nh, T, hd)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape                                                        # (B, T, C)
        q = self.wq(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)     # (B, nh, T, hd)
        k = self.wk(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.heads // self.kv_heads                   # grouped-query: repeat k/v heads
        k = k[:, :, None].expand(B, self.kv_heads, rep, T, self.head_dim).reshape(
            B, self.heads, T, self.head_dim)                                     # (B, nh, T, hd)
        v = v[:, :, None].expand(B, self.kv_heads, rep, T, self.head_dim).reshape(
            B, self.heads, T, self.head_dim)                                     # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)              # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                         # (B, T, C)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)  # gate
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))       # (B, T, C)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, C)
        return x + self.feed_forward(self.ffn_norm(x))            # (B, T, C)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.seq, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)   # (seq, hd)
        self.register_buffer("rope_sin", sin, persistent=False)   # (seq, hd)
        for m in self.modules():
            init_normal(m)                                      # its linears have no bias

    def init_buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The RoPE tables on ``device`` (autoparallelize regenerates meta-built buffers so)."""
        with torch.device("cpu"):
            cos, sin = rope_tables(self.cfg.seq, self.cfg.head_dim, self.cfg.rope_theta)
        return {"rope_cos": cos.to(device), "rope_sin": sin.to(device)}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape                                  # (B, T) token ids
        x = self.tok_embeddings(tokens)                      # (B, T, C)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]      # (T, hd)
        for layer in self.layers:
            x = layer(x, cos, sin)                           # (B, T, C)
        return self.output(self.norm(x))                     # (B, T, V) logits
