"""Closed-form FLOP counts for GPT-style transformers and pipeline timing (hand checks, MFU).

Megatron (Narayanan et al., SC21, §5.1): a GPT layer's forward is 24Bsh^2 + 4Bs^2h FLOPs and the
logit layer 2BshV. Training = forward + backward (2x forward) = 3x forward:

    model FLOPs     F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
    with full recompute (one more forward of every layer, not of the logit layer) -- the paper's eq. (3):
    hardware FLOPs  F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))

(both give 6BshV for the logit layer). Model FLOPs are what MFU divides by.

Pipeline schedules (p ranks, m micro-batches, v stages per rank; t = forward + backward time of
the slowest rank on one micro-batch over all its stages). Step time = m t + bubble, bubble in
units of t (``pipeline_bubble_units``):

    gpipe, 1f1b          p - 1                         Megatron §2.2.1: (p - 1)/m of the ideal m t
    interleaved_1f1b     (p - 1) / v                   Megatron §2.2.2 (chunks of t / v)
    interleaved_zb       (p - 1) / (3 v)               ZB1P: (p - 1)(F + B - 2W) per chunk (DualPipe README)
    zbv, dualpipev       (p - 1 + max(0, 2p-1-m)) / 6  v = 2: (p - 1) chunk forwards of t / 6

Assumption on the W/B split (zero-bubble schedules): the traced backward is 2x the forward
(``compute.backward_factor``), split evenly into input gradient B and weight gradient W, so
F = B = W = t / (3 v) per chunk: the case the ZB paper's table and torch's ScheduleZBVZeroBubble
docstring assume. With it, ZB1P's (p - 1)(F + B - 2W) = (p - 1) F = a third of 1F1B's (p - 1)(F + B).
These are the makespans of the action lists torch 2.13 generates, replayed with F = B_input = W
(full backward 2F) and unit-time dependencies (``tests/cost/test_schedule_formulas.py``):
exactly (p-1)/(vm) and (p-1)/(3vm) for the interleaved schedules; for ZBV the first rank
has (p - 1) chunk forwards of idle when m >= 2p - 1, and 2p - 1 - m more below that (torch pads
ZBV to max(2p - 1, m) micro-batches); DualPipeV's ``OVERLAP_F_B`` runs F then B on one stream in
torch 2.13 (no real overlap), which gives ZBV's figure. The ZB paper's "zero" bubble for ZB-V needs
the optimizer post-validation that lets steps overlap; torch has no such overlap, so the fill of
(p - 1) chunk forwards stays. These are the bubbles only: what splitting the backward costs besides
(host time per weight-pass group, recompute regions replayed per pass, the gradients held from B
to W) is ``cost.split_backward``, which the step model adds to each rank.
"""
from __future__ import annotations

from typing import Optional

from autopar.plan import PIPELINE_SCHEDULES


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


def _check_pipeline(pp: int, num_micro_batches: int, schedule: str, virtual_stages: int) -> None:
    if pp < 1 or num_micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"pp ({pp}), num_micro_batches ({num_micro_batches}) and virtual_stages "
                         f"({virtual_stages}) must be >= 1")
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(PIPELINE_SCHEDULES)}")


def pipeline_bubble_units(pp: int, num_micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Idle time of the slowest pipeline rank per step, in units of that rank's forward + backward
    time on one micro-batch (``t``, all its stages). Step time = (m + units) * t (module docstring)."""
    _check_pipeline(pp, num_micro_batches, schedule, virtual_stages)
    p, m, v = pp, num_micro_batches, virtual_stages
    if schedule in ("gpipe", "1f1b"):
        return float(p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / v
    if schedule == "interleaved_zb":
        return (p - 1) / (3.0 * v)
    return (p - 1 + max(0, 2 * p - 1 - m)) / 6.0           # zbv, dualpipev (v = 2)


def pipeline_bubble_fraction(pp: int, num_micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Bubble relative to the ideal time m * t (module docstring): GPipe / 1F1B (p - 1) / m
    (Megatron §2.2.1); interleaved 1F1B (p - 1) / (v m); interleaved zero bubble (ZB1P)
    (p - 1) / (3 v m); ZBV / DualPipeV (p - 1 + max(0, 2p - 1 - m)) / (6 m)."""
    return pipeline_bubble_units(pp, num_micro_batches, schedule, virtual_stages) / num_micro_batches


def pipeline_step_time_s(t_stage_mb_s: float, pp: int, num_micro_batches: int, schedule: str = "1f1b",
                         virtual_stages: int = 1) -> float:
    """Pipeline time of one step: (m + bubble units) * t, t = fwd + bwd time of the slowest pp rank
    on one micro-batch (all its stages). GPipe/1F1B: (m + p - 1) t."""
    return (num_micro_batches + pipeline_bubble_units(pp, num_micro_batches, schedule, virtual_stages)) * t_stage_mb_s


def pipeline_schedule_problem(schedule: str, pp: int, virtual_stages: int, num_micro_batches: int,
                              layers: int) -> Optional[str]:
    """Why ``schedule`` with ``virtual_stages`` stages per rank cannot run ``num_micro_batches``
    micro-batches of a model with ``layers`` repeated layers on ``pp`` ranks (None: it can).

    torch 2.13's checks: Schedule1F1B needs m >= number of stages; ScheduleInterleaved1F1B and
    ScheduleInterleavedZeroBubble need m % max(1, m // pp) == 0 (no longer Megatron's m % pp == 0);
    ScheduleZBVZeroBubble and ScheduleDualPipeV need exactly 2 stages per rank; DualPipeV needs
    m >= number of stages (2 pp). GPipe and ZBV accept any m. The planner also asks every schedule
    for m >= pp (the bubble formulas assume a filled pipeline) and every stage for >= 1 layer."""
    p, v, m = pp, virtual_stages, num_micro_batches
    if schedule not in PIPELINE_SCHEDULES:
        return f"unknown schedule {schedule!r}; choose one of {', '.join(PIPELINE_SCHEDULES)}"
    if p == 1:
        return None if (schedule == "1f1b" and v == 1) else \
            f"schedule={schedule}, vpp={v} needs a pipeline (pp > 1); with pp=1 drop schedule/vpp"
    if schedule in ("gpipe", "1f1b") and v != 1:
        return f"schedule={schedule} runs one stage per rank (vpp=1), not vpp={v}; use interleaved_1f1b for vpp > 1"
    if schedule in ("zbv", "dualpipev") and v != 2:
        return f"schedule={schedule} runs exactly 2 stages per rank (vpp=2), not vpp={v}"
    if schedule.startswith("interleaved") and v < 2:
        return f"schedule={schedule} needs vpp >= 2 stages per rank; use 1f1b for one"
    if p * v > layers:
        return (f"schedule={schedule} with pp={p} x vpp={v} needs {p * v} stages of >= 1 layer but the model has "
                f"{layers} layers; use a smaller pp or vpp")
    if m < p:
        return f"{m} micro-batches cannot fill pp={p} stages; use >= {p} micro-batches (a smaller mbs)"
    if schedule.startswith("interleaved") and m % max(1, m // p):
        return (f"schedule={schedule} needs the {m} micro-batches to be a multiple of the rounds "
                f"max(1, m // pp) = {max(1, m // p)} (torch); use a multiple of pp={p}")
    if schedule == "dualpipev" and m < 2 * p:
        return f"schedule=dualpipev needs >= 2 * pp = {2 * p} micro-batches (one per stage), not {m}"
    return None
