"""What the zero-bubble schedules' split backward adds to a pipeline rank (``interleaved_zb``,
``zbv``, ``dualpipev``), beyond their smaller bubble (``cost.flops``). Pure functions; the step
time and memory model (``solver/timing.py``) adds their results to each rank.

What the runtime does (``runtime/pipeline.py``, torch 2.13 ``pipelining/_backward.py``): every
stage but stage 0 runs each micro-batch's backward in two autograd passes. B
(``stage_backward_input``) walks the stage's autograd graph in Python (``construct_reverse_graph``,
``get_param_groups``), hooks the nodes where a parameter's branch joins the input's ("join nodes";
torch's param group ``intermediates``) and runs ``autograd.grad`` to the stage inputs with
``retain_graph=True``; W (``_weight_pass``) later runs one ``autograd.grad`` PER PARAM GROUP from
the gradients B saved at the join nodes down the parameters' branches. Stage 0 runs one full
backward in its W slot (its inputs need no gradient): nothing of the below applies to it.

1. Host time (``split_host_s``). Per micro-batch and split stage, each param group costs one more
   ``autograd.grad`` call, its Python (edges, hooks, accumulation) and a second dispatch of its join
   node (the node runs in B for the input gradient and again in W for the weights'), and B's graph
   walks touch every node once more. Priced as ``HOST_NODES_PER_PARAM_TENSOR`` node host costs
   (``GPUSpec.node_overhead_s``: plain, or DTensor's when tp > 1, as ``solver/problem.py``)
   per parameter tensor the stage reads. Measured on this repository's CPU (torch 2.13, eager
   GPT blocks of hidden 16, one thread): a fused backward's layer took about 0.3 ms of host time,
   the split added 0.55-0.95 ms per layer, i.e. 45-80 us per parameter tensor (6 groups of weight
   + bias per layer), about one node's per-step cost of autopar's executor (60 us plain in
   ``cost/hardware.py``'s example). With that 60 us the planner predicts, on the README's pp=2 CPU
   runs, zbv / 1F1B step windows of 1.11 / 1.19 at m = 2 / 4 for hidden 64 (measured 1.1-1.7x)
   and 0.97 / 1.03 for hidden 256 (measured 0.86 / 0.98). On GPUs the uncalibrated overhead is 0
   (host work hides behind large kernels) and the term vanishes.

2. Work done twice (``split_recompute_replays``). GEMMs are not repeated: autograd computes only
   the outputs a pass needs (``should_compute_output``), so a join node's input gradient runs in B
   and its weight gradient in W (counted on two Linears: 2 mm in B + 2 in W, the 4 of one backward).
   Fused norm backwards run in both passes (memory-bound, not priced). But a recompute region
   (``torch.utils.checkpoint``, non-reentrant, early stop off: ``codegen/executor.py``) replays its
   whole forward once per autograd call that unpacks one of its saved tensors: once in B, and once
   per W group whose join node sits inside it (counted: a LayerNorm + Linear + GELU + Linear
   region with 3 groups replayed its forward 1 + 3 times, against once in a fused backward). So the
   extra replays per layer and micro-batch are the param groups inside the layer's regions:
   "full" (the whole layer one region): all of them, bounded by the layer's parameter tensors (a
   Linear's or a norm's weight and bias share one group, so GPT's 12 tensors make 6: an
   over-estimate there, exact without biases); per-operator sets: none for the attention core
   (no parameter inside: "selective"), ``PARAM_GROUPS_PER_OP_REGION`` for the classes that hold
   projections (``mlp_act``: the up-projection(s) the activation reads; ``norm``: the norm and the
   projection its output feeds). Their collectives would repeat too: the runtime refuses those
   combinations (``plan.split_backward_problem``), so only the compute is priced here.

3. Memory held from B to W (``split_held_bytes``). B keeps the graph (``retain_graph``): the chunk's
   saved activations stay until W, which ``cost.memory.pipeline_inflight_microbatches`` already
   counts (a chunk waiting for its W counted whole). What B adds is the gradient it saves at each
   join node (the join node's output gradient, kept in the param group until W): estimated as one
   ``layer_input_bytes`` per parameter tensor of a layer (GPT: the outputs of ln_1, c_attn, c_proj,
   ln_2, c_fc, c_proj are 11 h per token against 12 tensors; under tp the row-parallel outputs are
   Partial, full size, so it is low there: 4.25 h against 3 h at tp = 4 with sp) and, on the
   rank holding the last stage, the head's largest output (the logits' gradient). Chunks pending
   their W at a rank's peak (``pending_weight_chunks``, not counting stage 0's): the maxima over
   torch 2.13's action lists (replayed as in ``tests/cost/test_schedule_formulas.py``):

       interleaved_zb   r + 1                         (every p, v, m tried)
       zbv              min(2 r + 1, 2 (m - p) + 1)   (exact for m >= 2p - 1; an upper bound below)
       dualpipev        r + 1

   each chunk 1/v of the rank's layers. Adding this maximum to the activation peak is an upper
   bound on the joint peak: exact for interleaved_zb (the two coincide), within about 4% on zbv's
   heaviest rank r = p - 1 (join gradients 0.7 of a chunk's activations; looser on lower ranks),
   loose for dualpipev (nothing is pending at its activation peak).

4. Point-to-point traffic: none added. B sends the input gradient once, W sends nothing
   (``tests/runtime/test_pipeline_zero_bubble.py`` counts one send per micro-batch and stage
   boundary). (torch copies between the two V stages on one rank locally; the step model still
   charges the 2 v sends of every schedule.)
"""
from __future__ import annotations

import math

from autopar.plan import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from autopar.recompute_ops import recompute_classes

HOST_NODES_PER_PARAM_TENSOR = 1.0     # node host costs per parameter tensor of a split stage (1.)
PARAM_GROUPS_PER_OP_REGION = 2        # W groups inside a per-operator region holding parameters (2.)
_PARAMETER_FREE_CLASSES = ("attention",)


def is_split(schedule: str) -> bool:
    """Whether ``schedule`` splits the backward into input and weight passes."""
    return schedule in ZERO_BUBBLE_SCHEDULES


def split_layers(schedule: str, rank: int, layers: float, v: int) -> float:
    """Layers of pipeline ``rank``'s ``layers`` whose backward is split: all, but on rank 0 the
    share of stage 0 (``solver/plan_parts.plan_stages`` gives it ``layers // v``), which runs one
    full backward."""
    if not is_split(schedule):
        return 0.0
    if rank != 0:
        return float(layers)
    return float(layers) - (layers // v if float(layers).is_integer() else layers / v)


def split_host_s(param_tensors: float, overhead_s: float) -> float:
    """Host seconds per micro-batch that splitting adds to a stage part reading ``param_tensors``
    parameter tensors, at ``overhead_s`` per graph node (module docstring, 1.)."""
    return HOST_NODES_PER_PARAM_TENSOR * param_tensors * overhead_s


def split_recompute_replays(recompute: str, layer_param_tensors: float) -> float:
    """Extra forward replays of a recomputed layer's regions per micro-batch under a split backward,
    in units of the layer's recompute forward (module docstring, 2.): "full" / "partial" (per
    recomputed layer) one per weight-pass group, at most ``layer_param_tensors``; per-operator sets
    ``PARAM_GROUPS_PER_OP_REGION`` unless all their classes are parameter-free; "none": 0."""
    classes = recompute_classes(recompute)
    if classes is None:                               # "full", "partial": the layer is one region
        return float(layer_param_tensors)
    if all(c in _PARAMETER_FREE_CLASSES for c in classes):
        return 0.0
    return float(PARAM_GROUPS_PER_OP_REGION)


def pending_weight_chunks(schedule: str, pp: int, rank: int, num_micro_batches: int) -> float:
    """Chunks (1/v of a rank's layers each) whose input pass is done and weight pass pending on
    pipeline ``rank`` at most, stage 0 excluded (module docstring, 3.); 0 for other schedules."""
    p, r, m = pp, rank, num_micro_batches
    if schedule in ("interleaved_zb", "dualpipev"):
        return float(r + 1)
    if schedule == "zbv":
        return float(min(2 * r + 1, max(1, 2 * (m - p) + 1)))
    return 0.0


def split_held_bytes(schedule: str, pp: int, rank: int, num_micro_batches: int, v: int, layers: float,
                     layer_param_tensors: float, layer_input_bytes: float, head_out_bytes: float = 0.0) -> float:
    """Bytes of join-node gradients pipeline ``rank`` holds from B to W at most (module docstring,
    3.): pending chunks x (layers / v) x one ``layer_input_bytes`` per parameter tensor, plus, when
    the rank holds the last stage (``head_out_bytes`` > 0), the head's output gradient for each of
    ceil(pending / v) last-stage chunks."""
    n = pending_weight_chunks(schedule, pp, rank, num_micro_batches)
    if n <= 0:
        return 0.0
    return n * chunk_held_bytes(layers / v, layer_param_tensors, layer_input_bytes) + math.ceil(n / v) * head_out_bytes


def chunk_held_bytes(layers: float, layer_param_tensors: float, layer_input_bytes: float,
                     head_out_bytes: float = 0.0) -> float:
    """Join-node gradient bytes one micro-batch's input pass keeps until its weight pass, on a
    split stage of ``layers`` layers (with the head: ``head_out_bytes``, its output's gradient):
    one ``layer_input_bytes`` per parameter tensor of a layer (module docstring, 3.)."""
    return layers * layer_param_tensors * layer_input_bytes + head_out_bytes


# ---- the solver's rank model (``solver/timing.py``): duck-typed OuterConfig / AxisSummary / GPUSpec ----

def _holds_last(cfg, rank: int) -> bool:
    return rank == (0 if cfg.schedule in V_SCHEDULES else cfg.pp - 1)        # plan.stage_rank


def rank_split_times(cfg, summary, gpu, rank: int, layers: float, compute_s: float,
                     recompute_s: float) -> tuple[float, float]:
    """(compute, recompute) seconds per micro-batch of pipeline ``rank`` (``layers`` layers of the
    block; ``recompute_s`` its recompute forward) with the split's host time added to the compute
    and its extra region replays to the recompute (module docstring, 1. and 2.)."""
    if not is_split(cfg.schedule) or layers <= 0:
        return compute_s, recompute_s
    n = split_layers(cfg.schedule, rank, layers, cfg.v)
    blk = summary.parts["block"]
    tensors = n * blk.param_tensors
    if _holds_last(cfg, rank):                   # the head's parameters (stage 0's are never split)
        tensors += summary.parts["post"].param_tensors + summary.shared_param_tensors
    overhead = gpu.node_overhead_s(cfg.tp > 1, cfg.dtensor_mesh_axes)
    replays = split_recompute_replays(cfg.recompute, blk.param_tensors) if cfg.recompute != "none" else 0.0
    return compute_s + split_host_s(tensors, overhead), recompute_s * (1.0 + replays * n / layers)


def rank_held_bytes(cfg, summary, rank: int, layers: float) -> float:
    """``split_held_bytes`` of pipeline ``rank`` holding ``layers`` layers of the block."""
    if not is_split(cfg.schedule):
        return 0.0
    head = summary.parts["post"].max_out_bytes if _holds_last(cfg, rank) else 0.0
    return split_held_bytes(cfg.schedule, cfg.pp, rank, cfg.m, cfg.v, layers, summary.parts["block"].param_tensors,
                            summary.layer_input_bytes, head)


def rank_held_affine(cfg, summary, rank: int) -> tuple[float, float]:
    """``rank_held_bytes`` as (per layer, constant)."""
    const = rank_held_bytes(cfg, summary, rank, 0.0)
    return rank_held_bytes(cfg, summary, rank, 1.0) - const, const
