"""BERT encoder with a masked-LM head (post-LayerNorm blocks, as in Devlin et al. 2019).

Embeddings: token + learned position + token-type (all type 0) -> LayerNorm. Each layer:
``x = LN(x + proj(attn(x)))``, ``x = LN(x + fc2(gelu(fc1(x))))``; bidirectional attention through
``F.scaled_dot_product_attention`` (no mask: every sequence is full length). MLM head:
dense -> GELU -> LayerNorm -> decoder tied to the token embedding (+ bias). BERT-large
(24 layers, 1024 hidden, 16 heads, vocab 30522): 335M parameters with the MLM head.
The loss is cross-entropy over every position (inputs are the targets with 15% of positions
replaced by [MASK], see ``autopar.models.data``). Init: N(0, 0.02), biases 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.init import init_normal


@dataclass(frozen=True)
class BertConfig:
    vocab: int = 30522
    seq: int = 512          # position table rows
    layers: int = 24
    hidden: int = 1024
    heads: int = 16
    ffn: int = 4096
    type_vocab: int = 2
    norm_eps: float = 1e-12


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_out = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)
        self.out_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape                                                   # (B, T, C)
        hs = C // self.heads
        q = self.query(x).view(B, T, self.heads, hs).transpose(1, 2)       # (B, nh, T, hs)
        k = self.key(x).view(B, T, self.heads, hs).transpose(1, 2)         # (B, nh, T, hs)
        v = self.value(x).view(B, T, self.heads, hs).transpose(1, 2)       # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v)                        # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                   # (B, T, C)
        x = self.attn_norm(x + self.attn_out(y))                           # (B, T, C)
        return self.out_norm(x + self.fc2(F.gelu(self.fc1(x))))           # (B, T, C)


class BertForMaskedLM(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.position_embeddings = nn.Embedding(cfg.seq, cfg.hidden)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab, cfg.hidden)
        self.embed_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.layers = nn.ModuleList([BertLayer(cfg) for _ in range(cfg.layers)])
        self.head_dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.head_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab)
        self.decoder.weight = self.word_embeddings.weight          # tied, as in BERT
        for m in self.modules():
            init_normal(m)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape                                                 # (B, T) token ids
        pos = torch.arange(T, device=tokens.device)                         # (T,)
        types = torch.zeros_like(tokens)                                    # (B, T) all type 0
        x = (self.word_embeddings(tokens) + self.position_embeddings(pos)
             + self.token_type_embeddings(types))                          # (B, T, C)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x)                                                    # (B, T, C)
        x = self.head_norm(F.gelu(self.head_dense(x)))                      # (B, T, C)
        return self.decoder(x)                                              # (B, T, V) logits
