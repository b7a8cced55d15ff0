"""Loss functions and synthetic training batches for the model zoo (real CPU tensors).

The batches are learnable, so a few optimizer steps visibly lower the loss:

- language models: each row is an arithmetic progression of token ids, ``x_t = (a + b*t) mod V``
  with random start ``a`` and stride ``b`` per row; inputs are ``x[:, :-1]``, targets ``x[:, 1:]``
  (the next token is predictable from the previous two).
- masked LM (BERT): the same rows; 15% of input positions replaced by the [MASK] id, targets are
  the unmasked rows (cross-entropy over every position).
- MLP: ``x ~ N(0, 1)`` of shape (B, width), label = ``argmax(x[:, :classes])``.
- images (ViT): ``N(0, 1)`` pixels; label = which of the first ``classes`` rows of channel 0 has
  the largest mean (learnable) when ``classes <= image``, uniform random otherwise (ViT-H's 1000
  classes at 224 px).

Every ``*_batch`` takes ``(batch, generator)`` after its keyword configuration is bound with
``functools.partial`` (picklable, so bundles can cross process boundaries).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), target (B, T) int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def classification_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy: logits (B, classes), target (B,) int64."""
    return F.cross_entropy(logits, target)


def _progressions(batch: int, length: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, max(2, min(vocab, 17)), (batch, 1), generator=generator)
    return (start + stride * torch.arange(length)) % vocab                  # (B, length) int64


def lm_batch(batch: int, generator: torch.Generator, *, vocab: int, seq: int):
    tokens = _progressions(batch, seq + 1, vocab, generator)                 # (B, T+1)
    return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()


def mlm_batch(batch: int, generator: torch.Generator, *, vocab: int, seq: int, mask_id: int):
    target = _progressions(batch, seq, vocab, generator)                     # (B, T)
    masked = torch.rand(batch, seq, generator=generator) < 0.15
    return (target.masked_fill(masked, mask_id),), target


def mlp_batch(batch: int, generator: torch.Generator, *, width: int, classes: int,
              dtype: torch.dtype = torch.float32):
    x = torch.randn(batch, width, generator=generator)                       # (B, width)
    return (x.to(dtype),), x[:, :classes].argmax(dim=1)


def image_batch(batch: int, generator: torch.Generator, *, image: int, channels: int,
                classes: int, dtype: torch.dtype = torch.float32):
    x = torch.randn(batch, channels, image, image, generator=generator)      # (B, 3, H, W)
    if classes <= image:
        label = x[:, 0, :classes, :].mean(dim=2).argmax(dim=1)               # brightest row
    else:
        label = torch.randint(0, classes, (batch,), generator=generator)
    return (x.to(dtype),), label
