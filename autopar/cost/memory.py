"""Memory accounting: ZeRO model states, Korthikanti transformer activations, pipeline in-flight count.

Model states (ZeRO, Rajbhandari et al. 2019, §3.1 and Table 1; reference
``zero_table1_model_state_memory.csv``): mixed-precision Adam keeps per parameter 2 B of fp16/bf16
params, 2 B of grads and K = 12 B of optimizer state (fp32 master copy, momentum, variance):
16 Psi in all. With data-parallel degree Nd, per device:

    stage 0 (plain DP)    (2 + 2 + K) Psi
    stage 1 (P_os)        4 Psi + K Psi / Nd
    stage 2 (P_os+g)      2 Psi + (2 + K) Psi / Nd
    stage 3 (P_os+g+p)    (4 + K) Psi / Nd

Activations per transformer layer (Korthikanti et al. 2022, arXiv 2205.05198; formulas assume
16-bit activations and 1-byte dropout masks; s = sequence, b = micro-batch, h = hidden, a = heads,
t = tensor-parallel degree):

    no TP                 sbh (34 + 5as/h)
    TP                    sbh (10 + 24/t + 5as/(ht))
    TP + SP               sbh (34/t + 5as/(ht))
    selective recompute   drops the 5as/h term (core attention is recomputed)
    full recompute        2sbh: only the layer input (2sbh/t with SP: the input is sequence-sharded)

Pipeline in-flight micro-batches per schedule: ``pipeline_inflight_microbatches``.

One step's peak (checked against measured CPU runs, ``runtime/memory_measure.py``): model states
by the dtype and optimizer actually run (``state_bytes_per_param``: fp32 AdamW is 4 + 4 + 8, not
2 + 2 + 12), the backward's workspace of two largest-output tensors (``backward_workspace_bytes``),
and gradients that replace activations during the backward rather than adding to all of them
(``step_peak_bytes``).
"""
from __future__ import annotations

import bisect
import functools
import itertools
from typing import Optional, Sequence

from autopar.plan import PIPELINE_SCHEDULES

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_MODES = ("none", "selective", "full")
SCHEDULES = PIPELINE_SCHEDULES


def model_state_bytes(num_params: int, dp: int, zero_stage: int, *, param_bytes: float = 2,
                      grad_bytes: float = 2, optimizer_bytes_per_param: float = 12,
                      full_grads: bool = False) -> dict[str, float]:
    """Per-device bytes of "params", "grads" and "optimizer" under ZeRO ``zero_stage`` (0-3) with
    ``dp`` data-parallel ranks (module docstring). Use grad_bytes=4 for fp32 gradient accumulation.
    ``full_grads``: the device holds the full local gradients whatever the stage (a runtime that
    accumulates micro-batches before one reduction: ``solver.overlap.reduces_once_per_step``)."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    params = float(num_params) * param_bytes
    grads = float(num_params) * grad_bytes
    optim = float(num_params) * optimizer_bytes_per_param
    return {
        "params": params / dp if zero_stage >= 3 else params,
        "grads": grads / dp if zero_stage >= 2 and not full_grads else grads,
        "optimizer": optim / dp if zero_stage >= 1 else optim,
    }


def transformer_layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                                       recompute: str = "none", bytes_per_elem: float = 2) -> float:
    """Korthikanti activation bytes stored by one transformer layer on one TP rank (module docstring).

    ``bytes_per_elem`` scales the 16-bit formula linearly (bytes_per_elem / 2; the 1-byte masks
    scale too, which slightly overstates fp32)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if t < 1:
        raise ValueError(f"tensor-parallel degree t must be >= 1, got {t}")
    sbh = float(s) * b * h
    scale = bytes_per_elem / 2.0
    if recompute == "full":
        return 2.0 * sbh / (t if sp else 1) * scale
    attn = 5.0 * a * s / (h * t) if recompute == "none" else 0.0
    if sp:
        per = 34.0 / t + attn
    else:
        per = 10.0 + 24.0 / t + attn
    return sbh * per * scale


def pipeline_inflight_microbatches(pp: int, stage: int, num_micro_batches: int, schedule: str = "1f1b",
                                   virtual_stages: int = 1) -> float:
    """Micro-batches whose activations pipeline rank ``stage`` (0-based) holds at its peak, in units
    of one micro-batch through all of that rank's stages (for v stages per rank: chunk
    activations / v). From the warmup counts of torch 2.13's schedules (p ranks, r = rank, m
    micro-batches, v stages per rank, rounds = max(1, m // p), m_r = m // rounds micro-batches
    per round; the peak is warmup + 1 chunk forwards before the first backward frees one):

        gpipe              m                                  (all forwards before any backward)
        1f1b               min(p - r, m)                      (Schedule1F1B warmup_chunks)
        interleaved_1f1b   min((v-1) m_r + 2(p-1-r) + 1, v m) / v    (_get_warmup_ops, factor 2)
        interleaved_zb     min((v-1) m_r + p, v m) / v        (warmup (v-1) m_r + (p-1-r), + 1, + the
                                                               r weight-gradient steps deferred on rank r)
        zbv                min(2p, m + 1 + r) / 2             (2(p-r)-1 chunk-0 forwards, then r pairs,
                                                               then one more chunk-1 forward)
        dualpipev          min(2p + 1, 2m) / 2                (DualPipe README: "PP+1" chunks; torch's
                                                               OVERLAP_F_B runs F before B)

    Rank 0 of interleaved 1F1B with m = p: p + (p - 1)/v, as Megatron's (1 + 1/v) x the 1F1B
    stash (Narayanan et al. §2.2.2). A chunk waiting for its weight gradient (zero-bubble) is
    counted whole. Every figure equals the peak of forwards minus (full or weight) backwards in
    torch's own action lists (``tests/cost/test_schedule_formulas.py``)."""
    p, r, m, v = pp, stage, num_micro_batches, virtual_stages
    if not 0 <= r < p:
        raise ValueError(f"stage {r} out of range for pp={p}")
    if m < 1 or v < 1:
        raise ValueError(f"num_micro_batches ({m}) and virtual_stages ({v}) must be >= 1")
    if schedule == "1f1b":
        return float(min(p - r, m))
    if schedule == "gpipe":
        return float(m)
    mr = m // max(1, m // p)
    if schedule == "interleaved_1f1b":
        return min((v - 1) * mr + 2 * (p - 1 - r) + 1, v * m) / v
    if schedule == "interleaved_zb":
        return min((v - 1) * mr + p, v * m) / v
    if schedule == "zbv":
        return min(2 * p, m + 1 + r) / 2.0
    if schedule == "dualpipev":
        return min(2 * p + 1, 2 * m) / 2.0
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")


# Bytes per parameter of the model states by the parameters' dtype and the optimizer, as the
# runtime keeps them. 16-bit: the mixed-precision recipe of the module docstring (16-bit params
# and grads, fp32 master + Adam moments: K = 12). fp32 (autopar's CPU runs): fp32 params and
# grads, and AdamW's / LAMB's two moments in the parameters' dtype (torch.optim keeps
# exp_avg / exp_avg_sq like the parameter; no master copy), K = 8. SGD with momentum and LARS:
# one buffer.
_OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "lamb": 2, "lars": 1, "sgd": 1}


def optimizer_moments(optimizer: str) -> int:
    """Per-parameter state tensors the optimizer named keeps (Adam's two moments, LARS's buffer)."""
    if optimizer not in _OPTIMIZER_MOMENTS:
        raise ValueError(f"optimizer {optimizer!r}: expected one of {tuple(_OPTIMIZER_MOMENTS)}")
    return _OPTIMIZER_MOMENTS[optimizer]


def state_bytes_per_param(param_dtype: str, optimizer: str = "adamw") -> dict[str, float]:
    """``{"params", "grads", "optimizer"}`` bytes per parameter for ``model_state_bytes``."""
    from autopar.ir import DTYPE_BYTES

    if param_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"param dtype {param_dtype!r}: expected float32, bfloat16 or float16")
    moments = optimizer_moments(optimizer)
    b = DTYPE_BYTES[param_dtype]
    if b == 2:
        return {"params": 2.0, "grads": 2.0, "optimizer": 4.0 * (moments + 1)}
    return {"params": 4.0, "grads": 4.0, "optimizer": 4.0 * moments}


def backward_workspace_bytes(largest_output_bytes: float) -> float:
    """Transient bytes beside the states and the stored activations: the backward of the op with
    the largest output holds that output's gradient while it writes its input's gradient, two
    tensors of that size at once (the loss at the logits: ``nll_loss_backward``'s gradient of the
    log-probabilities and ``_log_softmax_backward_data``'s gradient of the logits)."""
    return 2.0 * largest_output_bytes


def step_peak_bytes(states_without_grads: float, backward_parts, inflight: float, workspace: float,
                    grads_during_forward: bool, piece_workspace: Optional[Sequence[float]] = None) -> float:
    """Peak bytes of one training step on one rank.

    ``backward_parts``: (activation bytes of one micro-batch, gradient bytes) of each piece of
    the rank's model (a layer, the embedding, the head), in backward order; ``inflight``:
    micro-batches whose activations the rank holds at its peak (``pipeline_inflight_microbatches``,
    1 without a pipeline). Gradients start each step unallocated (``zero_grad(set_to_none=True)``).

    When no forward runs after a backward on this rank in the step (one micro-batch, or a pipeline
    rank that holds all its micro-batches, GPipe), gradients and activations trade places during
    the first backward, counted at the pieces' boundaries: before piece k the later pieces' (in
    backward order) activations and the earlier pieces' gradients are alive, so the peak is
    ``(inflight - 1) A_mb + max_k (sum_{j >= k} a_j + sum_{j < k} g_j)`` (k up to the end: all
    gradients). Inside a piece its ops free their saved inputs as they create their weight
    gradients, one op at a time, so the boundaries miss at most one op's weight gradient. Otherwise
    (``grads_during_forward``: gradient accumulation, 1F1B steady state) the full gradients are
    alive while the stash is refilled to ``inflight`` micro-batches: ``G + inflight A_mb``. The
    workspace (``backward_workspace_bytes``) is added to either: ``workspace`` at every boundary,
    or with ``piece_workspace`` (one per piece) the workspace of the piece whose backward starts
    there (at the end: the last piece's), so a large transient of the head (the loss at the
    logits) is not counted beside the gradients that exist only once the layers ran theirs."""
    acts = [float(a) for a, _ in backward_parts]
    grads = [float(g) for _, g in backward_parts]
    spaces = [float(w) for w in piece_workspace] if piece_workspace is not None else [float(workspace)] * len(acts)
    if len(spaces) != len(acts):
        raise ValueError(f"{len(spaces)} piece workspaces for {len(acts)} pieces")
    a_mb = sum(acts)
    best, left, done = 0.0, a_mb, sum(grads) if grads_during_forward else 0.0
    for a, g, ws in zip(acts, grads, spaces):
        best = max(best, left + done + ws)
        left -= a
        done += 0.0 if grads_during_forward else g
    best = max(best, done + (spaces[-1] if spaces else workspace))
    return states_without_grads + (inflight - 1) * a_mb + best


def reducer_transient_bytes(grad_bytes: float, data: int, zero: int, bucket: float,
                            activation_bytes: float = 0.0, accumulating: bool = False, wire: float = 1.0) -> float:
    """Device bytes the data-parallel gradient reducer (``runtime/reducer.py``) adds to a rank's
    peak beyond the reduced gradients (the 1/data outputs, counted with the gradients), under ZeRO
    2/3 over ``data`` > 1 ranks, for ``G = grad_bytes`` of local gradients in buckets of
    ``B = bucket`` bytes, the rank holding ``activation_bytes`` of activations at its peak. A
    bucket holds its full summands until it is launched, then a send buffer they are copied into
    (each summand dropped once copied); the previous bucket's send buffer stays until the next
    launch:

        during the backward (beside the activations, with more than one bucket):
            min(G - B, B) in flight + B of the open bucket's summands
        at its end (the activations freed): the last bucket's summands and send buffer and the
            previous one's, before the last output (1/data of it) exists:
            2 min(G, B) + min(max(G - B, 0), B) - min(G, B) / data

    and the peak takes the larger of the first and the second less the activations (``accumulating``:
    see ``reducer_end_bytes``). ZeRO 0
    reduces in place, in the buffers the gradients live in: nothing. ZeRO-1 reduce-scatters as
    ZeRO-2 does (``runtime/reducer.py``), but the plan counts its gradients as one whole copy, which
    its summands, send buffers and rows stay under during the backward; at the end its rows (1/data)
    and last send buffers exceed that copy and the freed activations only for small models:

        max(0, reducer_end_bytes + G / data - G - activations)

    ``wire``: a send buffer's bytes per summand byte (mixed precision reduces the buckets in 16
    bits: ``runtime/reducer.py``'s ``reduce_dtype``, 1/2 of fp32 gradients), for every term."""
    if data <= 1 or zero < 1:
        return 0.0
    if zero == 1:
        return max(0.0, reducer_end_bytes(grad_bytes, data, zero, bucket, wire=wire) + grad_bytes / data - grad_bytes
                   - activation_bytes)
    previous = min(max(grad_bytes - bucket, 0.0), bucket)
    during = previous * wire + bucket if grad_bytes > bucket else 0.0
    return max(during, reducer_end_bytes(grad_bytes, data, zero, bucket, accumulating, wire) - activation_bytes)


def reducer_piece_transients(summands: Sequence[float], data: int, zero: int, bucket: float, first: float,
                             rows_kept: bool = True, own: float = 0.0, wire: float = 1.0) -> list[tuple[float, float]]:
    """``_piece_transients`` (below), computed once per distinct argument list: the search asks
    the same rank's pieces again for each schedule and micro-batch count (gpt3-175b's search: 638
    calls, 42 distinct, each walking hundreds of 25 MiB buckets)."""
    return list(_piece_transients(tuple(summands), data, zero, bucket, first, rows_kept, own, wire))


@functools.lru_cache(maxsize=4096)
def _piece_transients(summands: tuple[float, ...], data: int, zero: int, bucket: float, first: float,
                      rows_kept: bool, own: float, wire: float) -> tuple[tuple[float, float], ...]:
    """The reducer's bytes during each piece's backward (ZeRO 2/3 over ``data`` > 1; zeros
    otherwise), ``summands`` being the pieces' full local gradient bytes in backward order: per
    piece (beside its ops' workspace, at a launch). The buckets fill in that order
    (``codegen.buckets``: the first up to ``first``, then ``bucket`` each, b_0, b_1, ...). Between
    launches the open bucket's summands and the previous bucket's send buffer are alive, counted
    beside the piece's workspace: those of its start and the fraction ``own`` of its own summands
    made before its widest op's backward (a layer's MLP output projection comes first: a third of
    a GPT layer's parameters, 4h^2 of 12h^2; 0 where a recomputed layer's replay, its workspace,
    comes first). Counting none put gpt-tiny's ZeRO-3 peak with every class offloaded 10% under
    the measurement; counting all of them 10% to 12% over it (ZeRO-3 over 12 layers; bf16).
    Launching bucket i (from a gradient hook, between ops; ``runtime/reducer._launch`` finishes the
    buckets before i - 1 first) allocates its send buffer while its summands, copied in one by
    one, and bucket i - 1's send buffer are alive:

        (1 + w) b_i + w b_(i-1)    (+ b_(i-1) / data, its output, when the reduced rows leave
                                    the device as each bucket finishes, ``rows_kept`` False:
                                    gradient offload)

    for send buffers of ``w = wire`` bytes per summand byte (``reducer_transient_bytes``).

    Kept, the reduced rows exist from their bucket's launch (its output), where the caller counts
    the rows of every piece before (1/data of their summands, ``step_peak_bytes``): the difference
    is given back (the rows of the open bucket, counted twice otherwise: 8% of a 12-layer GPT's
    ZeRO-3 peak).

    Both beside the piece's activations (its ops free them as they run: an upper bound). The last
    bucket's launch ends the backward: ``reducer_end_bytes``, beside no activation. (Counting
    the largest of these beside every piece's workspace, the backward's first included, put a
    24-layer GPT's ZeRO-3 peak 22% over the measurement.)"""
    if data <= 1 or zero < 2:
        return ((0.0, 0.0),) * len(summands)
    sizes, left, cap = [], float(sum(summands)), min(first, bucket)
    while left > 1e-9:
        sizes.append(min(cap, left))
        left -= sizes[-1]
        cap = bucket
    ends = list(itertools.accumulate(sizes))            # increasing: found by bisection below

    def behind(i: int) -> float:          # bucket i's send buffer in flight (and its output)
        return 0.0 if i < 0 else sizes[i] * (wire if rows_kept else wire + 1.0 / data)

    def rows(made: float) -> float:       # reduced rows of the buckets launched by then (kept ones)
        return made / data if rows_kept else 0.0

    def alive(made: float) -> float:      # the open bucket's summands, the one in flight, the rows out
        last = bisect.bisect_right(ends, made + 1e-9) - 1          # the last bucket launched by then
        out_to = ends[last] if last >= 0 else 0.0
        return made - out_to + behind(last) + rows(out_to)

    out, done = [], 0.0
    for g in summands:
        start, done = done, done + g
        # the buckets (but the last) launched during this piece: start < end <= done
        first, past = bisect.bisect_right(ends, start + 1e-9), min(bisect.bisect_right(ends, done + 1e-9), len(ends) - 1)
        spikes = [(1.0 + wire) * sizes[i] + behind(i - 1) + rows(ends[i - 1] if i else 0.0) for i in range(first, past)]
        # less the rows the caller counts as made by the pieces before (``step_peak_bytes``' gradients)
        out.append((alive(start + own * g) - rows(start), max(spikes) - rows(start) if spikes else 0.0))
    return tuple(out)


def reducer_end_bytes(grad_bytes: float, data: int, zero: int, bucket: float, accumulating: bool = False,
                      wire: float = 1.0) -> float:
    """``reducer_transient_bytes``' term at the end of the reduction (the activations freed): the
    last bucket's summands and send buffer and the previous one's, before the last output exists.
    A pipeline reduces the buckets its stages' last backwards did not launch after its schedule
    (the tied embedding's, at the least): this is its reducer transient there. ZeRO 1-3
    (ZeRO-1 reduce-scatters as ZeRO-2 does). ``accumulating`` (ZeRO 2/3 reducing every one of
    several micro-batches, ``solver.overlap.accumulates_rows``): the rows of the earlier
    micro-batches sit beside the last one's outputs, 1/data of the gradients more. ``wire``: as
    ``reducer_transient_bytes``."""
    if zero < 1 or data <= 1:
        return 0.0
    last, previous = min(grad_bytes, bucket), min(max(grad_bytes - bucket, 0.0), bucket)
    return last * (1 + wire - 1 / data) + previous * wire + (grad_bytes / data if accumulating else 0.0)
