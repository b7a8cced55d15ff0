"""A model with a statistic over the batch that does not sum (tests of ``solver/data_axis.py``):
the DATA axis' batch shards cannot compute it, so the planner solves that axis. Also a user-model
spec for the zoo: ``build_model(SPEC)``."""
from __future__ import annotations

import os

import torch
from torch import nn

SPEC = f"{os.path.abspath(__file__)}:batch_max_norm"
LOSS_SPEC = f"{os.path.abspath(__file__)}:batch_max_loss"


class BatchMaxNorm(nn.Module):
    """A hidden layer scaled by its largest magnitude over the batch (per feature)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h / (h.abs().amax(0, keepdim=True) + 1.0))


def batch_max_norm():
    """(module, example inputs, loss, target) at a batch of 8 rows."""
    torch.manual_seed(0)
    return BatchMaxNorm(), (torch.randn(8, 8),), nn.functional.cross_entropy, torch.randint(0, 4, (8,))


def max_over_batch_loss(out, target):
    """A loss of the batch's largest output per class (the target unused): read whole, it is whole
    on every data-parallel rank (no Partial to all-reduce)."""
    return (out.amax(0) - 1.0).pow(2).mean()


def batch_max_loss():
    """(module, example inputs, loss, target): an MLP under :func:`max_over_batch_loss`, 8 rows."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return m, (torch.randn(8, 8),), max_over_batch_loss, torch.randint(0, 4, (8,))


class AttentionBatchMax(nn.Module):
    """Causal self-attention over tokens, then the batch max of :class:`BatchMaxNorm`: a sequence
    model whose sequence context parallelism could split, but whose batch statistic it cannot."""

    def __init__(self, vocab: int = 16, hidden: int = 8) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab)

    def forward(self, ids):
        x = self.emb(ids).unsqueeze(1)
        h = nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True).squeeze(1)
        return self.head(h / (h.abs().amax(0, keepdim=True) + 1.0))


def attention_batch_max():
    """(module, example inputs, loss, target): 4 sequences of 8 tokens."""
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (4, 8))
    return AttentionBatchMax(), (ids,), lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()), ids


class BatchMaxBlock(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)

    def forward(self, h):
        h = self.a(h)
        return h / (h.abs().amax(0, keepdim=True) + 1.0)


class BatchMaxStack(nn.Module):
    """:class:`BatchMaxNorm`'s statistic in each of four repeated blocks (traced once, collapsed)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([BatchMaxBlock() for _ in range(4)])
        self.out = nn.Linear(16, 4)               # the last Linear: the zoo's targets are its classes

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


STACK_SPEC = f"{os.path.abspath(__file__)}:batch_max_stack"


def batch_max_stack():
    """(module, example inputs, loss, target) at a batch of 8 rows."""
    torch.manual_seed(0)
    return BatchMaxStack(), (torch.randn(8, 8),), nn.functional.cross_entropy, torch.randint(0, 4, (8,))
