"""The peak memory of one training step on one pipeline rank, by moments: what the plan reports and
the search fits to the budget (``timing._rank_memory``, without a pipeline) and what ``autopar run
--memory`` prints next to the measurement (``runtime/memory_predict.py``, every rank).

Not every category peaks at once; the step's peak is the largest of these moments:

- the forward and backward: without a pipeline ``cost.memory.step_peak_bytes`` (the backward's
  trade of activations for gradients, piece by piece); with one, the rank's schedule replayed
  action by action over its local stages (``cost/schedule_memory.py``: the zero-bubble schedules'
  input passes keep activations and add join-node gradients, their weight passes trade);
- without a pipeline under ZeRO-3, a layer's gather landing in the forward (``_forward_gather_peak``:
  the landed layer, the next one's buffers, a tied parameter gathered whole), which the backward's
  workspace then leaves out where only the forward gathers (autocast without recompute:
  ``layer_memory.workspace_bytes(forward_apart=True)``);
- after it, ZeRO 1/2 over data > 1: the gradients' shards, and the all-gather of the updated rows of one
  bucket (``GradReducer.gather_params``: its send buffer and its output, in the optimizer's
  parameter dtype).

Adding each category's own peak (what the plan did before) over-counts by what has been freed by
the time the next category peaks: 10-34% on the CPU GPT families without recompute (ZeRO-3 over
two ranks, 24 layers: 251 MiB added against 214 by moments and 214 measured).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from autopar.codegen.buckets import DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES
from autopar.cost.memory import (backward_workspace_bytes, model_state_bytes, reducer_end_bytes,
                                 reducer_piece_transients, reducer_transient_bytes, step_peak_bytes)
from autopar.cost.offload import FP32, chunk_share, offload_memory, optimizer_rows, resident_saved_bytes
from autopar.cost.schedule_memory import Chunk, activations_only, rank_actions, replay_peak_bytes
from autopar.cost.split_backward import chunk_held_bytes, is_split, rank_held_bytes
from autopar.recompute_ops import is_per_op
from autopar.solver.layer_memory import (activation_bytes_per_layer, forward_gather_bytes, largest_group_numel,
                                         recast_per_microbatch, rematerialized_bytes, replay_landing_bytes,
                                         replays_every_layer, workspace_bytes)
from autopar.solver.outer_config import OuterConfig
from autopar.solver.overlap import accumulates_rows, reduces_once_per_step
from autopar.solver.problem import AxisSummary


@dataclass(frozen=True)
class RankShape:
    """What one pipeline rank holds: its layers (over its local stages), the embedding and the
    head, the micro-batches it keeps in flight, its parameters, and its activations as the step
    model counts them (the category; the peak rebuilds them piece by piece)."""
    pp_rank: int
    layers: float
    has_pre: bool
    has_post: bool
    inflight: float
    param_numel: float
    activations_bytes: float
    cuts: tuple = ()              # layers per pipeline rank (a pipeline's local stages)


@dataclass(frozen=True)
class RankPeak:
    """A rank's peak and each category's own peak, bytes (``host``: offloaded to host memory)."""
    peak: float
    params: float
    grads: float
    optimizer: float
    activations: float
    workspace: float
    host: float


def rank_peak(summary: AxisSummary, cfg: OuterConfig, rank: RankShape, parts: Sequence, per: Mapping[str, float],
              *, autocast: bool, moments: int, prefetch: bool, wire: float = 1.0) -> RankPeak:
    """``rank``'s peak (its ``parts``: ``layer_memory.rank_parts``) for model states of ``per`` bytes per parameter ("params", "grads",
    "optimizer": ``cost.memory.state_bytes_per_param``) and an optimizer of ``moments`` states,
    under ``autocast``; ``prefetch``: activation offload brings saved tensors back ahead on a side
    stream (``cost.offload.resident_saved_bytes``); ``wire``: the reducer's send buffers' bytes per
    gradient byte (``cost.memory.reducer_transient_bytes``). Module docstring for the moments."""
    classes = cfg.classes

    def states(numel: float) -> dict:
        return model_state_bytes(int(numel), cfg.data, cfg.zero, param_bytes=per["params"], grad_bytes=per["grads"],
                                 optimizer_bytes_per_param=per["optimizer"], full_grads=reduces_once_per_step(cfg))

    total = states(rank.param_numel)
    largest = max(p.max_out_bytes for p, _, _ in parts)
    # the solver's workspace: the largest output's backward, a re-materialized layer under
    # recompute, ZeRO-3's prefetched layers (the reducer's transient and a split backward's held
    # join-node gradients below)
    workspace = workspace_bytes(summary, cfg, backward_workspace_bytes(largest), rank.layers,
                                param_bytes=per["params"], autocast=autocast, forward_apart=cfg.pp == 1)
    act_off = "activations" in classes

    def back(largest_out: float) -> float:
        """Saved bytes activation offload has back on the device at once (0 without it)."""
        return resident_saved_bytes(largest_out, prefetch) if act_off else 0.0

    def piece_workspace(name: str, prefetching: bool = True) -> tuple[float, float]:
        """A piece's backward workspace: (what it adds to the piece's activations at the boundary
        where its backward starts, its temporaries alone). The op with the piece's largest output
        holds that output's gradient while it writes its input's; offloaded, it also holds its
        saved input brought back from the host. A layer's also carries the residual stream's
        gradient and the branch's gradient added to it (two layer inputs), and by the time its
        largest op runs backward, the consumer of that output has run its own and freed its saved
        copy: counted among the activations at the boundary, it is given back there (resident
        activations, or a replayed layer's, counted with the workspace). ZeRO-3's gathers beside
        it, and in a layer its re-materialized activations under recompute
        (``layer_memory.workspace_bytes``; ``prefetching`` False: the first layer's, whose backward
        gathers no next layer). A replayed layer brings nothing back from the host but its
        checkpoint (a layer input): its saved tensors are made again on the device; under
        autocast its replay's gather landing may come first (``layer_memory.replay_landing_bytes``)."""
        part = summary.parts[name]
        replayed = name == "block" and replays_every_layer(cfg, rank.layers)
        brought = 0.0 if replayed else back(part.max_out_bytes)
        if name == "block" and is_per_op(cfg.recompute):
            # the widest op's saved input either comes back from the host or is made again by its
            # region's replay (counted with the layer's re-materialized bytes), never both
            brought = max(0.0, brought - rematerialized_bytes(summary, cfg, rank.layers))
        own = backward_workspace_bytes(part.max_out_bytes) + brought
        freed = 0.0
        if name == "block":
            own += 2.0 * summary.layer_input_bytes
            freed = part.max_out_bytes if replayed or not act_off else 0.0
        alone = workspace_bytes(summary, cfg, own, rank.layers, param_bytes=per["params"], autocast=autocast,
                                in_layer=name == "block", forward_apart=cfg.pp == 1, prefetching=prefetching)
        landing = replay_landing_bytes(summary, cfg, per["params"], autocast, rank.layers) if name == "block" else 0.0
        return max(alone - freed, landing), max(alone, landing)

    spaces = {name: piece_workspace(name) for name in ("pre", "block", "post")}
    spaces["first"] = piece_workspace("block", prefetching=False)
    split = is_split(cfg.schedule) if cfg.pp > 1 else False
    chunks = _chunks(summary, cfg, rank, lambda numel: states(numel)["grads"], split,
                     {name: w for name, (w, _) in spaces.items()})
    alone = max(spaces[name][1] for name, has in (("pre", rank.has_pre), ("block", rank.layers > 0),
                                                   ("post", rank.has_post)) if has)
    if cfg.data > 1 and cfg.zero == 0:
        chunks = _bucketed(chunks)
    host, act_kept, grad_kept = 0.0, 1.0, 1.0
    rows_leave = "grads" in classes and cfg.m == 1 and cfg.data > 1 and cfg.zero >= 2
    counted = chunks                             # the gradients as counted, before offload scales them
    per_mb = sum(c.activations for c in chunks.values())
    if classes:                  # ``cost/offload.py``, for these state bytes and optimizer
        off = offload_memory(classes, rows=optimizer_rows(rank.param_numel, cfg.data, cfg.zero),
                             params_bytes=total["params"], grads_bytes=total["grads"],
                             optimizer_bytes=total["optimizer"], activations_bytes=rank.inflight * per_mb,
                             resident_saved_bytes=largest, inflight=rank.inflight,
                             saved_bytes_per_microbatch=per_mb - recast_per_microbatch(summary, cfg, parts, rank.layers),
                             microbatches=cfg.m, moments=moments,
                             group_bytes=FP32 * largest_group_numel(summary, parts, rank.has_pre or rank.has_post) / cfg.data,
                             share=chunk_share(cfg.tp, cfg.data, cfg.zero), saved_window=largest)
        host = off["host"]
        if act_off:                    # on the host; the backward brings one node's back at a time, at
            act_kept = 0.0             # most the largest output (the log-probabilities at the loss),
            workspace += back(largest)     # and as much again prefetched on a side stream
        grad_kept = off["grads"] / total["grads"] if total["grads"] else 1.0   # grads offload: the buckets kept
        if rows_leave:           # ZeRO 2/3: each bucket's rows go down as it finishes (in the reducer's transients)
            grad_kept = 0.0
        chunks = {g: _scaled(c, act_kept, grad_kept) for g, c in chunks.items()}
        total = {"params": off["params"], "grads": off["grads"], "optimizer": off["optimizer"]}
    fixed = total["params"] + total["optimizer"]
    local_grads = rank.param_numel * per["grads"]
    end = reducer_end_bytes(local_grads, cfg.data, cfg.zero, DEFAULT_BUCKET_BYTES, accumulates_rows(cfg), wire)
    actions = rank_actions(cfg.schedule, cfg.pp, rank.pp_rank, cfg.m, cfg.v) if cfg.pp > 1 else None
    if cfg.pp > 1:               # the replay holds the join-node gradients; what the stages did not launch
        # is reduced after the schedule, beside no activation; a forward replays no layer and brings
        # nothing back from the host
        forward = workspace_bytes(summary, replace(cfg, recompute="none"), backward_workspace_bytes(largest), rank.layers,
                                  param_bytes=per["params"], autocast=autocast, forward_apart=False)
        peak = fixed + replay_peak_bytes(actions, chunks, workspace, min(forward, workspace))
        workspace = max(max(workspace, alone) + rank_held_bytes(cfg, summary, rank.pp_rank, rank.layers), end)
    else:
        transient = reducer_transient_bytes(local_grads, cfg.data, cfg.zero, DEFAULT_BUCKET_BYTES,
                                            rank.inflight * per_mb * act_kept + workspace, accumulates_rows(cfg), wire)
        (chunk,) = chunks.values()
        # ZeRO 2/3: the reducer's buffers piece by piece (``cost.memory.reducer_piece_transients``),
        # at least the end's term less the activations (``reducer_transient_bytes``)
        spaces = [w + transient for w in chunk.workspace]
        if cfg.zero >= 2 and cfg.data > 1:
            floor = max(0.0, end - (rank.inflight * per_mb * act_kept + workspace))
            spaces = [max(w + max(t, floor), standing + spike) + held for w, standing, (t, spike), held in zip(
                chunk.workspace, _standing(summary, cfg, rank, per["params"], autocast), reducer_piece_transients(
                    _summands(summary, cfg, rank, counted[0], states), cfg.data, cfg.zero, DEFAULT_BUCKET_BYTES,
                    DEFAULT_FIRST_BUCKET_BYTES, rows_kept=not rows_leave,
                    own=0.0 if cfg.recompute == "full" else 1 / 3, wire=wire),
                _tied_held(summary, cfg, rank, len(chunk.workspace), states(summary.shared_param_numel)["grads"],
                           grad_kept))]
        workspace = max(max(workspace, alone) + transient, max(spaces))
        peak = step_peak_bytes(fixed, chunk.pieces, rank.inflight, workspace, grads_during_forward=rank.inflight < cfg.m,
                               piece_workspace=spaces)
        peak = max(peak, fixed + _forward_gather_peak(summary, cfg, chunk.pieces, rank, per["params"]))
    if end:                      # ZeRO 1-3: the end of the reduction, beside the reduced outputs (1/data);
        # offloaded gradients leave the device as each bucket is reduced (``runtime/offload.py``)
        peak = max(peak, fixed + (0.0 if "grads" in classes else local_grads / cfg.data) + end)
    if cfg.data > 1 and cfg.zero in (1, 2):
        # the optimizer's parameters (fp32 masters under 16-bit; offloaded, the updated rows copied
        # up into the parameters' dtype) all-gathered bucket by bucket beside the gradients' shards
        # where they stay on the device (``GradReducer.gather_params``: a send buffer and an output)
        master = per["params"] if "optimizer" in classes else max(per["params"], 4.0)
        bucket = min(rank.param_numel * per["params"], DEFAULT_BUCKET_BYTES) / per["params"]
        shards = 0.0 if "grads" in classes else local_grads / cfg.data
        peak = max(peak, fixed + shards + bucket * master * (1 + 1 / cfg.data))
    grads = total["grads"]
    if cfg.zero >= 1 and cfg.data > 1 and "grads" not in classes and (cfg.m == 1 or accumulates_rows(cfg)):
        # ZeRO 1-3 reduce-scatter each micro-batch's summands bucket by bucket (ZeRO-1 as ZeRO-2 does:
        # ``runtime/reducer.py``): the full summands of a bucket not yet reduce-scattered are
        # gradients too (``measure_step`` marks them), the largest bucket's (``codegen/buckets.py``)
        # beside the others' reduced rows, or beside all rows when earlier micro-batches made them.
        # Several micro-batches of ZeRO-1 or of a pipeline's ZeRO 2/3 accumulate the full summands,
        # as ``states`` counts.
        largest_bucket = max(min(local_grads, DEFAULT_FIRST_BUCKET_BYTES),
                             min(local_grads - DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_BYTES))
        grads = local_grads / cfg.data + largest_bucket * (1.0 if accumulates_rows(cfg) else 1 - 1 / cfg.data)
    activations = rank.activations_bytes * act_kept
    if cfg.pp > 1:               # the replay's own: each stage's in-flight count, not the rank's average
        activations = replay_peak_bytes(actions, {g: activations_only(c) for g, c in chunks.items()})
    return RankPeak(peak, total["params"], grads, total["optimizer"], activations, workspace, host)


def _summands(summary: AxisSummary, cfg: OuterConfig, rank: RankShape, chunk: Chunk,
              states: Callable[[float], dict]) -> list[float]:
    """Without a pipeline under ZeRO 2/3, each piece's full local gradient summands (``chunk``'s
    counted gradients are the 1/data rows), in backward order. A tied weight's summand is made
    once both reads' gradients are in: after the embedding's backward, the last."""
    summands = [grad * cfg.data for _, grad in chunk.pieces]
    if rank.has_pre and rank.has_post:
        tied = states(summary.shared_param_numel)["grads"] * cfg.data
        summands[0] -= tied
        summands[-1] += tied
    return summands


def _tied_held(summary: AxisSummary, cfg: OuterConfig, rank: RankShape, pieces: int, rows: float,
               kept: float) -> list[float]:
    """Under ZeRO 2/3, per piece (head, layers, embedding): a tied weight's gradient from the head,
    held by autograd until the embedding's adds to it (the reducer's summand only then,
    ``_summands``), less its ``rows`` the caller counts from the head's piece (``kept`` of them:
    0 where offloaded gradients leave the device). Measured at gpt-tiny's ZeRO-3 peak with every
    class offloaded, bf16: the head's fp32 gradient of the embedding beside a layer's replay."""
    if not (rank.has_pre and rank.has_post and summary.shared_param_numel):
        return [0.0] * pieces
    return [0.0] + [rows * (cfg.data - kept)] * (pieces - 1)


def _standing(summary: AxisSummary, cfg: OuterConfig, rank: RankShape, param_bytes: float,
              autocast: bool) -> list[float]:
    """What stays beside a bucket's launch in each piece's backward (``_chunks``' order: head,
    layers, embedding): a layer's gathers and replay, not its ops' workspace (the launch runs in a
    gradient hook, between ops); the first layer's backward prefetches no next layer."""
    def standing(prefetching: bool) -> float:
        return workspace_bytes(summary, cfg, 0.0, rank.layers, param_bytes=param_bytes, autocast=autocast,
                               forward_apart=True, prefetching=prefetching)
    n = int(rank.layers)
    return ([0.0] * rank.has_post + [standing(True)] * (n - 1) + [standing(False)] * min(n, 1)
            + [0.0] * rank.has_pre)


def _forward_gather_peak(summary: AxisSummary, cfg: OuterConfig, pieces: Sequence, rank: RankShape,
                         param_bytes: float) -> float:
    """Without a pipeline, ZeRO-3's peak in the forward, beyond the states: at the last layer's
    gather landing (``layer_memory.forward_gather_bytes``), the activations of every piece before it
    (``pieces`` in backward order: the head's and that layer's are not made yet), its first op's
    temporaries (the layer's input, its norm's output and the op's output, at most the layer's
    largest), and the gradients of earlier micro-batches when they accumulate. 0 without gathers.
    (Measured at the peak of ``dp=2, zero=3`` with every class offloaded, bf16: the next layer's
    send and output buffers, this layer's copies, the tied embedding whole, then layer input, norm
    output, the weight's 16-bit copy and the matmul's output: ``tests/runtime/test_memory_measure.py``.)"""
    gathered = forward_gather_bytes(summary, cfg, param_bytes)
    if not gathered:
        return 0.0
    before = sum(a for a, _ in pieces[(1 if rank.has_post else 0) + int(min(rank.layers, 1)):])
    grads = sum(g for _, g in pieces) if rank.inflight < cfg.m else 0.0
    temps = 2.0 * summary.layer_input_bytes + summary.parts["block"].max_out_bytes
    return before + gathered + temps + grads


def _chunks(summary: AxisSummary, cfg: OuterConfig, rank: RankShape, grads_of: Callable[[float], float],
            split: bool, workspace: Mapping[str, float]) -> dict:
    """``rank``'s local stages as ``schedule_memory.Chunk``s by global stage index (one, index 0,
    without a pipeline): pieces in backward order (head, layers, embedding), each layer's
    activations by the recompute choice ("partial": the rank's first ``recompute_layers`` layers in
    model order), the gradients of tied parameters with the head when the rank holds it; ``held``:
    a split stage's join-node gradients (stage 0 runs a full backward); ``workspace``: each piece's
    backward workspace by part name ("pre", "block", "post"; "first": the first layer's)."""
    from autopar.solver.plan_parts import stage_layers

    blk, pre, post = (summary.parts[k] for k in ("block", "pre", "post"))
    if cfg.pp > 1:
        local, layers = stage_layers(cfg, rank.cuts)
        last = cfg.pp * cfg.v - 1
        mine = [(g, layers[g], g == 0, g == last) for g in sorted(local[rank.pp_rank])]
    else:
        mine = [(0, int(rank.layers), rank.has_pre, rank.has_post)]
    k = int(min(cfg.recompute_layers or 0, rank.layers)) if cfg.recompute == "partial" else 0
    shared = summary.shared_param_numel if (rank.has_pre or rank.has_post) else 0.0
    grads = grads_of(blk.param_numel)
    out, seen = {}, 0
    for g, n, has_pre, has_post in mine:                   # model order: the rank's first layers first
        if cfg.recompute == "partial":
            acts = [activation_bytes_per_layer(blk, summary, "full" if seen + j < k else "none") for j in range(n)]
        else:
            acts = [activation_bytes_per_layer(blk, summary, cfg.recompute)] * n
        seen += n
        pieces = [(a, grads) for a in reversed(acts)]
        spaces = [workspace["block"]] * (n - 1) + [workspace["first"]] * min(n, 1)   # backward order
        if has_post:
            pieces.insert(0, (post.saved_bytes, grads_of(post.param_numel + shared)))
            spaces.insert(0, workspace["post"])
        if has_pre:
            pieces.append((pre.saved_bytes, grads_of(pre.param_numel + (0.0 if rank.has_post else shared))))
            spaces.append(workspace["pre"])
        held = 0.0
        if split and g != 0:
            held = chunk_held_bytes(n, blk.param_tensors, summary.layer_input_bytes,
                                    post.max_out_bytes if has_post else 0.0)
        # the last stage's output, the logits the loss reads, stays in torch's fwd_cache from the
        # forward to the backward (input pass): ``layer_memory.held_loss_input_bytes``
        output = summary.loss_input_bytes if (has_post and cfg.pp > 1) else 0.0
        out[g] = Chunk(tuple(pieces), held, output=output, workspace=tuple(spaces))
    return out


def _scaled(chunk: Chunk, act: float, grad: float) -> Chunk:
    return replace(chunk, pieces=tuple((a * act, g * grad) for a, g in chunk.pieces))


def _bucketed(chunks: dict) -> dict:
    """ZeRO-0 over dp > 1: gradients live in bucket buffers (``runtime/reducer.py``), each
    allocated whole when its first gradient arrives. Buckets fill in backward order (the first up
    to ``DEFAULT_FIRST_BUCKET_BYTES``, the others ``DEFAULT_BUCKET_BYTES``, ``codegen/buckets.py``;
    a rank's later stage's first backward comes before its earlier's): each piece's gradient bytes
    become what is allocated when it runs."""
    order = sorted(chunks, reverse=True)
    left = sum(g for c in chunks.values() for _, g in c.pieces)     # not yet allocated
    room, cap, out = 0.0, float(DEFAULT_FIRST_BUCKET_BYTES), {}
    for s in order:
        pieces = []
        for a, g in chunks[s].pieces:
            alloc = 0.0
            while g > room and left > 0:            # a new bucket, allocated whole
                g -= room
                room = min(cap, left)
                alloc += room
                left -= room
                cap = float(DEFAULT_BUCKET_BYTES)
            room -= min(g, room)
            pieces.append((a, alloc))
        out[s] = replace(chunks[s], pieces=tuple(pieces), bucketed=True)
    return out
