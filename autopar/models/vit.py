"""Vision Transformer (Dosovitskiy et al. 2021) for image classification.

Patch embedding = Conv2d(3, C, kernel=patch, stride=patch); a learned [CLS] token and position
embedding; pre-LayerNorm blocks (fused QKV, ``F.scaled_dot_product_attention``, GELU MLP); final
LayerNorm; linear head on the [CLS] token. ViT-H/14 at 224 px: 32 layers, 1280 hidden, 16 heads,
MLP 5120, 16 x 16 = 256 patches + 1 = 257 tokens, 632M parameters with a 1000-class head.
Init: N(0, 0.02) for Linear/Conv weights, class token and position embedding; biases 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.init import init_normal


@dataclass(frozen=True)
class ViTConfig:
    image: int = 224
    patch: int = 14
    channels: int = 3
    layers: int = 32
    hidden: int = 1280
    heads: int = 16
    mlp: int = 5120
    classes: int = 1000

    @property
    def tokens(self) -> int:
        return (self.image // self.patch) ** 2 + 1


class ViTBlock(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.norm2 = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.fc1 = nn.Linear(cfg.hidden, cfg.mlp)
        self.fc2 = nn.Linear(cfg.mlp, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape                                                   # (B, T, C)
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=2)                  # 3 x (B, T, C)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)      # (B, nh, T, hs)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)      # (B, nh, T, hs)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)      # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v)                        # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))    # (B, T, C)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))               # (B, T, C)


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.hidden, kernel_size=cfg.patch,
                                     stride=cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden))
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.tokens, cfg.hidden))
        self.blocks = nn.ModuleList([ViTBlock(cfg) for _ in range(cfg.layers)])
        self.norm = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.head = nn.Linear(cfg.hidden, cfg.classes)
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            init_normal(m, types=(nn.Linear, nn.Conv2d))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        B = images.shape[0]                                                 # (B, 3, H, W)
        x = self.patch_embed(images).flatten(2).transpose(1, 2)            # (B, N, C)
        x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)        # (B, N+1, C)
        x = x + self.pos_embed                                              # (B, T, C)
        for block in self.blocks:
            x = block(x)                                                    # (B, T, C)
        return self.head(self.norm(x)[:, 0])                                # (B, classes)
