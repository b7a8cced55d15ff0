"""What one layer keeps and needs beside it, per micro-batch: the activations it saves under each
recompute choice, the workspace of a backward (the largest output's gradients, a re-materialized
layer, ZeRO-3's gathered layers) and what the last pipeline stage holds for the loss. Shared by the
step model (``timing._rank_memory``), the search's memory-constrained ILP and the peak by moments
(``solver/step_memory.py``, which the plan reports and ``runtime/memory_predict.py`` prints).
"""
from __future__ import annotations

from typing import Optional

from autopar.recompute_ops import is_per_op
from autopar.solver.op_classes import RcCost
from autopar.solver.outer_config import OuterConfig
from autopar.solver.problem import AxisSummary, PartCost

ZERO3_PREFETCH_LAYERS = 2            # gathered layers resident at once under ZeRO-3 (current + prefetch)


def rank_parts(summary: AxisSummary, layers: float, has_pre: bool, has_post: bool) -> list[tuple[PartCost, float, str]]:
    """A rank's parts as (cost, count, name): its ``layers`` blocks, the embedding and the head where it holds them."""
    parts = [(summary.parts["block"], float(layers), "block")]
    if has_pre:
        parts.append((summary.parts["pre"], 1.0, "pre"))
    if has_post:
        parts.append((summary.parts["post"], 1.0, "post"))
    return parts


def gather_group_count(summary: AxisSummary, parts, shared: bool) -> float:
    """A rank's ZeRO-3 gather groups among its ``parts`` (``codegen/gather_groups.py``: one per layer
    and per part with parameters; a tied parameter, ``shared``, is gathered alone)."""
    return sum(c for p, c, _ in parts if p.param_tensors) + (summary.shared_param_tensors if shared else 0.0)


def largest_group_numel(summary: AxisSummary, parts, shared: bool) -> float:
    """Elements (tp-local, whole over dp) of a rank's largest ZeRO-3 gather group among its ``parts``
    (``codegen/gather_groups.py``: one per layer and per part with parameters; a tied parameter,
    ``shared``, is gathered alone)."""
    out = max((p.param_numel for p, c, _ in parts if c and p.param_tensors), default=0.0)
    return max(out, summary.shared_param_numel if shared else 0.0)


def recomputed_layers(cfg: OuterConfig, lps: float, for_memory: bool) -> float:
    """Layers of a rank's ``lps`` that recompute in full. "partial" with ``recompute_layers`` unset
    (a configuration not yet fitted): all of them for memory, none for time, so that both stay
    lower bounds of any choice."""
    if cfg.recompute == "full":
        return lps
    if cfg.recompute != "partial":
        return 0.0
    if cfg.recompute_layers is None:
        return lps if for_memory else 0.0
    return min(float(cfg.recompute_layers), lps)


def replays_every_layer(cfg: OuterConfig, lps: Optional[float]) -> bool:
    """Whether every layer of a rank's ``lps`` re-materializes its activations in the backward
    ("full", or "partial" over all of them; ``lps`` or the count unknown: as "full")."""
    return cfg.recompute == "full" or (cfg.recompute == "partial" and (
        cfg.recompute_layers is None or lps is None or cfg.recompute_layers >= lps))


def activation_bytes_per_layer(blk: PartCost, summary: AxisSummary, recompute: str) -> float:
    """Saved bytes of one layer per micro-batch (``recompute`` "partial": the recomputed layers'
    figure, the least; ``_rank_memory`` mixes them)."""
    if recompute in ("full", "partial"):
        return summary.layer_input_bytes
    if is_per_op(recompute):
        rc = rc_of(blk, recompute)
        return blk.saved_bytes - blk.core_saved_bytes if rc is None else rc.kept_bytes
    return blk.saved_bytes


def rematerialized_bytes(summary: AxisSummary, cfg: OuterConfig, lps: Optional[float]) -> float:
    """A layer's activations its backward makes again (``workspace_bytes``): the whole layer where
    every layer replays, the recomputed regions' under per-operator recompute, else none."""
    blk = summary.parts["block"]
    if replays_every_layer(cfg, lps):
        return blk.saved_bytes
    if is_per_op(cfg.recompute):
        rc = rc_of(blk, cfg.recompute)
        return blk.core_saved_bytes if rc is None else rc.workspace_bytes
    return 0.0


def workspace_bytes(summary: AxisSummary, cfg: OuterConfig, backward_bytes: float, lps: Optional[float] = None, *,
                    param_bytes: int, autocast: bool = False, in_layer: bool = True,
                    forward_apart: bool = False, prefetching: bool = True) -> float:
    """Workspace at the peak: the largest output's backward (``backward_bytes``), one layer
    re-materialized under recompute, ZeRO-3's gathers inside a layer's backward: the layer in use
    and the next one prefetched, its collective's output and send buffers (2 + 1/dp layers, each a
    whole copy beside the rank's own rows; measured so at the peak, the storage tracker's live
    list: the layer's copies, a layer-sized output buffer, a half-layer send buffer over dp=2). "partial"
    recomputes a rank's FIRST layers, whose backward comes last, when the later layers' activations
    are freed: a re-materialized layer adds to the peak only when every layer recomputes (``lps``
    unknown: as "full", the least memory). ZeRO-3 gathers a layer again in the backward only for
    the ops that saved its gathered weight (``runtime/reshard.py``); under ``autocast`` the
    matmuls saved 16-bit copies instead (counted as activations, or with the re-materialized
    layer), so the gathers peak in the (re-run) forward, not beside the backward's workspace: the
    larger of the two counts (the fp32 norms' weights, re-gathered, are left out); a re-run forward
    is inside the backward, which does not prefetch: one layer of gathers beside it. ``in_layer``
    False: the workspace of the embedding's or the head's backward (``step_memory``'s per-piece
    workspace), beside which no layer is re-materialized or gathered (a layer's re-gather starts
    with its own backward). ``forward_apart``: the caller counts the
    forward's gathers at their own peak (``forward_gather_bytes``; ``solver/step_memory.py``), so
    gathers that happen only in the forward (autocast without recompute) are left out here.
    ``prefetching`` False: the backward of a rank's (or stage's) first layer, the last to run,
    prefetches no next layer: its own gathered copy only."""
    blk = summary.parts["block"]
    every_layer = replays_every_layer(cfg, lps)
    other = rematerialized_bytes(summary, cfg, lps) if in_layer else 0.0
    gathered = ZERO3_PREFETCH_LAYERS if prefetching else 1
    if autocast and in_layer and every_layer:
        # the re-materialized layer's replay runs inside the backward, which gathers without
        # prefetch (``runtime/params.py``): one layer's rows, each cast to the 16-bit copy its
        # matmul saves (the copies are counted with the layer), beside the layer it rebuilds. The
        # forward's prefetched gathers sit beside the layers' inputs only. (Per-op recompute keeps
        # most activations through the forward, beside which the forward's two layers may peak.)
        gathered = 1
    gathers = 0.0
    if zero3_gathers(cfg) and in_layer:
        layers = gathered + (1.0 / cfg.data if gathered > 1 and cfg.data > 1 else 0.0)
        gathers = layers * blk.param_numel * param_bytes
    if autocast:
        if forward_apart and cfg.recompute == "none":
            return other + backward_bytes
        return other + max(backward_bytes, gathers)
    return backward_bytes + other + gathers


def replay_landing_bytes(summary: AxisSummary, cfg: OuterConfig, param_bytes: int, autocast: bool,
                         lps: Optional[float]) -> float:
    """Under ZeRO-3 over data > 1 with every layer replayed, under ``autocast``: a layer's backward
    at its replay's gather landing, before any of the layer it rebuilds exists (the layer's
    other moments are ``workspace_bytes``): the collective's output and send buffers beside the
    copies made out of them (2 + 1/dp layers, as ``forward_gather_bytes``), the residual stream's
    gradient and the checkpoint the replay starts from. Measured so at gpt-tiny's ZeRO-3 peak with
    every class offloaded, bf16 (fp32: the backward's ops, beside the fp32 gathered layer, peak
    higher). 0 otherwise."""
    if not (autocast and zero3_gathers(cfg) and cfg.data > 1 and replays_every_layer(cfg, lps)):
        return 0.0
    rows = summary.parts["block"].param_numel * param_bytes
    return (2.0 + 1.0 / cfg.data) * rows + 2.0 * summary.layer_input_bytes


def forward_gather_bytes(summary: AxisSummary, cfg: OuterConfig, param_bytes: int) -> float:
    """ZeRO-3's gathered bytes alive at once in the forward (``runtime/prefetch.py``), beyond the
    rank's own rows: a layer's group lands in its collective's output buffer beside its send
    buffer and is copied out into one tensor per parameter; then the next layer's gather is issued
    (its send and output buffers) while the landed layer's tensors wait for their readers: (2 +
    1/dp) layers of rows at each landing. One data-parallel rank with host rows copies a layer up
    instead (the copies are the tensors): two layers. A parameter read by the embedding and the
    head (tied) is gathered alone and held by the forward's scope to its last reader, the head:
    whole beside every landing. 0 without gather groups."""
    if not zero3_gathers(cfg):
        return 0.0
    layers = 2.0 if cfg.data == 1 else 2.0 + 1.0 / cfg.data
    return (layers * summary.parts["block"].param_numel + summary.shared_param_numel) * param_bytes


def rc_of(blk: PartCost, recompute: str) -> Optional[RcCost]:
    """The block's ``op_classes.RcCost`` under per-op ``recompute``. A set without regions in the
    graph recomputes nothing; a summary without op sets (None) makes "selective" fall back to the
    attention-core totals (``PartCost.core_*``)."""
    if blk.rc is None:
        return None
    rc = blk.rc.get(recompute)
    return rc if rc is not None else RcCost(0.0, {}, blk.saved_bytes, 0.0)


def saved_per_microbatch(summary: AxisSummary, cfg: OuterConfig, parts, lps: float) -> float:
    """Activation bytes a rank saves per micro-batch (recomputed layers: their inputs only)."""
    blk = summary.parts["block"]
    k = recomputed_layers(cfg, lps, for_memory=True)
    per_mb = k * activation_bytes_per_layer(blk, summary, cfg.recompute) \
        + (lps - k) * activation_bytes_per_layer(blk, summary, "none" if cfg.recompute == "partial" else cfg.recompute)
    return per_mb + sum(p.saved_bytes for p, _, name in parts if name != "block")


def zero3_gathers(cfg: OuterConfig) -> bool:
    """ZeRO-3 gathers parameters before use: over dp > 1 ranks, or from the host (parameter
    offload); the planner's ``runtime/params.ParamContext.gathers``."""
    return cfg.zero == 3 and (cfg.data > 1 or "params" in cfg.classes)


def recast_per_microbatch(summary: AxisSummary, cfg: OuterConfig, parts, lps: float) -> float:
    """Of ``saved_per_microbatch``: the bytes of autocast's low copies of resident parameters, which
    activation offload makes again from the parameter in the backward instead of sending them to
    the host and back (``runtime/activation_offload.cast_of_resident``): those of the layers that save in full
    (a recomputed layer saves only its input; per-op recompute re-runs no matmul) and of the
    embedding's and head's parts. None under ZeRO-3 with gathers (dp > 1 or parameters on the host):
    a gathered copy is not resident, it is offloaded."""
    if zero3_gathers(cfg):
        return 0.0
    k = recomputed_layers(cfg, lps, for_memory=True)
    return (lps - k) * summary.parts["block"].weight_copy_bytes + \
        sum(p.weight_copy_bytes for p, _, name in parts if name != "block")


def held_loss_input_bytes(summary: AxisSummary, cfg: OuterConfig) -> float:
    """What the rank holding the last pipeline stage keeps of what the loss reads (the logits):
    that stage's output, which torch's fwd_cache holds until the micro-batch's backward (without a
    pipeline it is freed once the loss has its own saved copy). The last stage runs each
    micro-batch's backward right after its forward in every schedule but GPipe, which holds all
    m: one micro-batch's, whatever the rank's other stages hold (``schedule_memory.rank_actions``
    replays it so)."""
    return summary.loss_input_bytes * last_stage_outputs_held(cfg)


def last_stage_outputs_held(cfg: OuterConfig) -> int:
    """Micro-batches whose last-stage output torch's fwd_cache holds at once (``held_loss_input_bytes``)."""
    if cfg.pp == 1:
        return 0
    return cfg.m if cfg.schedule == "gpipe" else 1
