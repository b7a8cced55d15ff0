"""Regression models trained with elementwise losses (tests of ``solver/rules.py``'s
``_pointwise_loss`` and ``codegen/fallback.py``'s ``LOSS_TARGETS``): user-model specs for the zoo,
``build_model(MSE)``."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

_HERE = os.path.abspath(__file__)
MSE, SMOOTH_L1_SUM, HUBER_NONE = (f"{_HERE}:{fn}" for fn in ("mse", "smooth_l1_sum", "huber_none_mean"))


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


def _bundle(loss):
    """(module, example inputs, loss, target) at a batch of 8 rows."""
    torch.manual_seed(0)
    return Regressor(), (torch.randn(8, 8),), loss, torch.randn(8, 4)


def mse():
    return _bundle(F.mse_loss)


def smooth_l1_sum():
    return _bundle(lambda out, y: F.smooth_l1_loss(out, y, reduction="sum", beta=0.5))


def huber_none_mean():
    return _bundle(lambda out, y: F.huber_loss(out, y, reduction="none", delta=0.5).mean())
