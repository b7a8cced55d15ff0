"""The GPT-2-style initialization the zoo's models share: weights N(0, std), biases 0."""
from __future__ import annotations

from torch import nn

LINEAR_LIKE = (nn.Linear, nn.Embedding)


def init_normal(module: nn.Module, std: float = 0.02, types: tuple[type, ...] = LINEAR_LIKE) -> None:
    """One module (not its children): if it is one of ``types``, weight ~ N(0, std), bias = 0.
    Models call it over ``self.modules()`` or through ``self.apply``; the order fixes which random
    numbers each weight draws for a given seed, so each model keeps its own."""
    if isinstance(module, types):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
