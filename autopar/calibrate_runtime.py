"""The host's cost per graph node of an autopar training step, measured for ``autopar calibrate``.

A step runs each node of the traced graph through autopar's executor (forward), autograd
(backward) and the bookkeeping around them; on a CPU that host time is serial with the compute
and, for small models, larger than it. It is measured as a slope, so that what does not grow with
the graph (the loss all-reduce, the gradient bucket's collective, the optimizer's launch) cancels:
the same narrow GPT (hidden 16, 2 heads, vocabulary 64, 8 tokens: its arithmetic is negligible,
its op mix a transformer's) is trained at two depths under the running world's data parallelism,
and

    overhead per node = (step time(deep) - step time(shallow)) / (graph nodes(deep) - graph nodes(shallow))
    overhead per step = step time(shallow) - overhead per node x graph nodes(shallow)

once with plain tensors (``dp_mode="auto"``: what plans without tensor parallelism run), once
with every op on DTensors (``dp_mode="dtensor"``: what tp > 1 runs) and, on 4 ranks or more, once
more on DTensors over a 2-D mesh (``dp=world/2, tp=2``): DTensor's sharding propagation enumerates
strategies over every mesh axis, and a tp x dp plan runs there (measured 1.7-1.9x the 1-D cost per
node on 4 CPU ranks). The cost model adds it to every node (``GPUSpec.op_overhead_s`` /
``dtensor_op_overhead_s`` in ``solver/problem.py``'s tables; ``dtensor_2d_op_overhead_s`` less the
1-D figure in ``solver/timing.py``'s rank time, where the stage's mesh has two axes or more). The
steps run as ``autoparallelize``'s defaults do, the collective recorder included (a Python
dispatch mode around every op: ``runtime/collectives.py``; about 30 us per op on this machine).

On a shared machine a step's time swings 2x from one step to the next (other processes, ranks
waiting on each other), more than the depth adds: the two depths' steps alternate (a slow spell
hits both) and each depth's fastest step is taken (load only adds time). A slope that still comes
out at or below 0 is noise, not a free node: the deep model's whole step per node is taken instead
(an upper bound, fixed costs included), and said so (``runtime_overheads``' ``*_slope`` flags).

Ring attention (on an even world): the same fit under ``cp=2, cpmode=ring`` (dp = world / 2, plain
tensors: the graph runs in local data-parallel mode, the attention node runs the ring,
``codegen/context_attention.py``). What its slope adds to the plain one, times the nodes of a layer,
is the host's cost of one layer's ring attention per micro-batch (its blocks, merges and rotations
issued from Python); the calibration takes out the rotations' link latency (``autopar.calibrate``),
which the cost model prices on the link, and the planner adds the rest per ring attention node
(``GPUSpec.ring_attention_overhead_s``, ``solver/problem.py``).

ZeRO-3 (2 ranks or more): the same fit under ``dp=world, zero=3``. What its slope adds to the plain
one, times the nodes of a layer, is the host's cost of one layer's gather group per micro-batch
(``runtime/prefetch.py``: the forward's gather and its prefetch, the backward's re-gather, the
gradients' reduce-scatter, the buffers' bookkeeping, issued from Python); the calibration takes
out those three collectives' link latency (``autopar.calibrate``), which the cost model prices on
the link, and the planner adds the rest per gather group per micro-batch
(``GPUSpec.zero3_group_overhead_s``, ``solver/timing.py``). Measured here beyond the latencies:
4.9-8.0 ms a group and micro-batch on 4 ranks sharing 2 cores, 1.5 ms on 2 ranks.

The per-step figure (plain tensors: ``GPUSpec.step_overhead_s``, added once per step by
``solver/timing.py``) is what a step costs beside its nodes: the step's Python, zeroing the
gradients, the optimizer's launch. The intercept also holds the loss's one-value all-reduces
(``LOSS_ALL_REDUCES``, one micro-batch of 2 rows a rank), which the cost model prices apart
(``overlap.loss_scalars_s``): the calibration takes their link latency out (``autopar.calibrate``;
on 4 ranks sharing 2 cores they were most of it: a 13-21 ms intercept against 2 x 6.6-8.4 ms). It
still includes this tiny model's own gradient all-reduce (a few KB) and optimizer step (SGD on
~30K parameters), which the cost model also prices for a real model: counted twice.
"""
from __future__ import annotations

import time
import warnings

SHALLOW, DEEP = 1, 6            # transformer layers (about 23 graph nodes each)
RING_CP = 2                     # cp of the ring attention run
RING_ROTATIONS = 3 * RING_CP - 2  # its rotations per attention per micro-batch: cp - 1 forward, 2 cp - 1 backward
ZERO3_COLLECTIVES = (("all_gather", 2), ("reduce_scatter", 1))   # a gather group's per micro-batch
MODEL = "gpt:hidden=16,layers={layers},heads=2,vocab=64,seq=8"
LOSS_ALL_REDUCES = 2            # its mean cross-entropy's value and count (strategies._scalar_loss)
WARMUP, TIMED = 2, 8            # steps per model; the timed ones alternate between the depths


def _model(depth: int, world: int, dp_mode: str, force: str):
    import torch

    from autopar.api import IdleAxisWarning, autoparallelize
    from autopar.models import build_model

    b = build_model(MODEL.format(layers=depth), batch=2 * world, device="meta")
    with warnings.catch_warnings():          # tp forced on a model too small for it: on purpose here
        warnings.simplefilter("ignore", IdleAxisWarning)
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             force=force, dp_mode=dp_mode, timeout_s=120,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), model_name=f"calibrate-gpt{depth}")
    batch = b.make_batch(2 * world, torch.Generator().manual_seed(0))
    for _ in range(WARMUP):
        pm.step(*batch)
    nodes = sum(1 for n in pm._train_graph.nodes if n.kind == "op" and n.outputs)
    return pm, batch, nodes


def _timed(pm, batch) -> float:
    t0 = time.perf_counter()
    pm.step(*batch)
    return time.perf_counter() - t0


def per_node_s(world: int, dp_mode: str, force: str = "") -> tuple[float, bool, float, float]:
    """(seconds per graph node per step, whether it is the slope, seconds per step beside the nodes,
    graph nodes per layer per micro-batch) for ``dp_mode`` under ``force`` (default: data parallel
    over the world; module docstring; the per-step figure is 0 where the slope is not measured)."""
    force = force or f"dp={world}"
    shallow, deep = _model(SHALLOW, world, dp_mode, force), _model(DEEP, world, dp_mode, force)
    best = [float("inf"), float("inf")]
    for _ in range(TIMED):                     # every rank alternates alike (the steps are collective)
        for i, (pm, batch, _) in enumerate((shallow, deep)):
            best[i] = min(best[i], _timed(pm, batch))
    slope = (best[1] - best[0]) / (deep[2] - shallow[2])
    per_layer = (deep[2] - shallow[2]) / (DEEP - SHALLOW) / deep[0].plan.num_micro_batches
    if slope > 0:
        return slope, True, max(0.0, best[0] - slope * shallow[2]), per_layer
    return best[1] / deep[2], False, 0.0, per_layer


def runtime_overheads(world: int) -> dict[str, float]:
    """{"plain": s, "dtensor": s} per graph node per step, on the running world, with
    {"plain_slope": bool, "dtensor_slope": bool}, "step": s per step beside the nodes (plain
    tensors), "dtensor_2d" / "dtensor_2d_slope" on an even world of 4 ranks or more,
    "ring_attention" (s per ring attention node per micro-batch) on an even world and
    "zero3_group" (s per ZeRO-3 gather group per micro-batch) on 2 ranks or more (module
    docstring; both with their link latencies in)."""
    out = {}
    runs = [("plain", "auto", ""), ("dtensor", "dtensor", "")]
    if world >= 4 and world % 2 == 0:
        runs.append(("dtensor_2d", "dtensor", f"dp={world // 2},tp=2"))
    for name, mode, force in runs:
        out[name], out[f"{name}_slope"], step, _ = per_node_s(world, mode, force)
        if name == "plain":
            out["step"] = step
    if world % 2 == 0:          # per ring attention node (the GPT has one per layer) per micro-batch
        ring, ok, _, per_layer = per_node_s(world, "auto", f"cp={RING_CP},cpmode=ring,dp={world // RING_CP}")
        out["ring_attention"] = max(0.0, ring - out["plain"]) * per_layer if ok and out["plain_slope"] else 0.0
    if world >= 2:              # per gather group (the GPT has one per layer) per micro-batch
        zero3, ok, _, per_layer = per_node_s(world, "auto", f"dp={world},zero=3")
        out["zero3_group"] = max(0.0, zero3 - out["plain"]) * per_layer if ok and out["plain_slope"] else 0.0
    return out
