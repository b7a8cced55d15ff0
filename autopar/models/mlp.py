"""A plain MLP classifier: ``depth`` hidden layers Linear(width, width) + GELU (in an
``nn.ModuleList``, so they form a repeated block), then a Linear(width, classes) head. Inputs (B, width) float.
Init: PyTorch's default Linear init (Kaiming-uniform), deterministic under ``torch.manual_seed``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    width: int = 1024
    depth: int = 4
    classes: int = 10


class MLPLayer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))                                # (B, width)


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([MLPLayer(cfg.width) for _ in range(cfg.depth)])
        self.head = nn.Linear(cfg.width, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)                                         # (B, width)
        return self.head(x)                                      # (B, classes) logits
