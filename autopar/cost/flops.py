"""Closed-form FLOP counts for GPT-style transformers and pipeline timing (hand checks, MFU).

Megatron (Narayanan et al., SC21, §5.1): a GPT layer's forward is 24Bsh^2 + 4Bs^2h FLOPs and the
logit layer 2BshV. Training = forward + backward (2x forward) = 3x forward:

    model FLOPs     F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
    with full recompute (one more forward of every layer, not of the logit layer) -- the paper's eq. (3):
    hardware FLOPs  F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))

(both give 6BshV for the logit layer). Model FLOPs are what MFU divides by.
"""
from __future__ import annotations


def megatron_model_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one training iteration (fwd + bwd, no recompute): 72Bslh^2(1 + s/(6h) + V/(12lh))."""
    B, s, l, h, V = map(float, (batch, seq, layers, hidden, vocab))
    return 72.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (12.0 * l * h))


def megatron_hardware_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                            recompute: bool = True) -> float:
    """FLOPs actually executed: with full activation recompute 96Bslh^2(1 + s/(6h) + V/(16lh))
    (Narayanan et al. eq. 3); without recompute this equals ``megatron_model_flops``."""
    if not recompute:
        return megatron_model_flops(batch, seq, layers, hidden, vocab)
    B, s, l, h, V = map(float, (batch, seq, layers, hidden, vocab))
    return 96.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h))


def pipeline_bubble_fraction(pp: int, num_micro_batches: int) -> float:
    """GPipe / 1F1B bubble relative to the ideal time: (p - 1) / m (Megatron §2.2.1)."""
    if pp < 1 or num_micro_batches < 1:
        raise ValueError(f"pp ({pp}) and num_micro_batches ({num_micro_batches}) must be >= 1")
    return (pp - 1) / num_micro_batches


def pipeline_step_time_s(t_stage_mb_s: float, pp: int, num_micro_batches: int) -> float:
    """Step time of a balanced GPipe/1F1B pipeline: (m + p - 1) * (fwd+bwd time of one stage on one
    micro-batch)."""
    if pp < 1 or num_micro_batches < 1:
        raise ValueError(f"pp ({pp}) and num_micro_batches ({num_micro_batches}) must be >= 1")
    return (num_micro_batches + pp - 1) * t_stage_mb_s
