"""Preloaded only into ``spawn_ranks``' forkserver (``launch._PRELOAD``), after the modules a rank
needs: trace a tiny model once, so the ranks forked from the forkserver start with what
``torch.export`` builds lazily on its first trace (decomposition tables, fake-tensor and dispatch
caches; ~0.5 s of CPU a rank, every launch). Nothing is kept but those caches; a failure here only
costs the ranks that time again, so it is logged and ignored.
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

log = logging.getLogger(__name__)


class _Tiny(nn.Module):
    """The op kinds of a transformer layer: embedding, norm, causal attention, GELU MLP, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.proj = nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x))[:, None]
        a = F.scaled_dot_product_attention(h, h, h, is_causal=True)
        return self.proj(F.gelu((h + a)[:, 0]))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def warm() -> None:
    """One trace; the global RNG (the tiny model's init draws from it) is left as it was, so ranks
    start from the state they would have started from without the warm-up."""
    from autopar.trace import trace_model

    with torch.random.fork_rng(devices=[]):
        x = torch.zeros(2, 4, dtype=torch.long)
        trace_model(_Tiny(), (x,), loss_fn=_loss, example_target=x, collapse_repeats=False)


try:
    warm()
except Exception:  # noqa: BLE001 - a warm-up only: the ranks trace for themselves regardless
    log.debug("forkserver warm-up trace failed", exc_info=True)
