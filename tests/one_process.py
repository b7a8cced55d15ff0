"""The single-process reference of the multi-rank tests that train a small model on token batches:
one optimizer step per batch ``t``, ``t`` being both the input and the target."""
from __future__ import annotations

from typing import Callable, Optional

import torch


def one_process_losses(model: torch.nn.Module, batches, loss_fn: Callable, optimizer: Callable,
                       forward: Optional[Callable] = None) -> list[float]:
    """Losses of ``model`` trained on ``batches``; ``forward(model, t)`` defaults to ``model(t)``."""
    opt = optimizer(model.parameters())
    losses = []
    for t in batches:
        opt.zero_grad()
        loss = loss_fn(forward(model, t) if forward is not None else model(t), t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
