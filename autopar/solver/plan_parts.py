"""From the search's winning evaluation to a Plan's fields: the model FLOPs per step (the MFU
numerator), the recompute fields and the pipeline stages (``search._build_plan`` assembles the
Plan; the DATA axis' placements: ``data_axis.py``)."""
from __future__ import annotations

from autopar.cost.compute import op_kind
from autopar.ir import GraphIR
from autopar.plan import V_SCHEDULES, Stage
from autopar.solver.timing import Evaluation


def model_flops(graph: GraphIR, global_batch: int) -> float:
    """3 x forward FLOPs of matmul/attention ops, whole model, at the global batch."""
    total = 0.0
    for n in graph.nodes:
        if n.kind == "op" and op_kind(n.target) in ("matmul", "attention"):
            total += n.flops * graph.multiplicity(n)
    return 3.0 * total * global_batch / graph.batch_size


def _recompute_fields(ev: Evaluation) -> dict:
    """The plan's ``recompute`` and ``recompute_layers``: "partial" becomes "full" on the first K
    layers of each pipeline rank (all of a rank's layers: plain "full"; none: "none")."""
    cfg = ev.config
    if cfg.recompute != "partial":
        return {"recompute": cfg.recompute}
    k = cfg.recompute_layers or 0
    if k == 0:
        return {"recompute": "none"}
    if k >= max(st.layers for st in ev.stages):
        return {"recompute": "full"}
    return {"recompute": "full", "recompute_layers": k}


def stage_layers(cfg, cuts) -> tuple[dict[int, list[int]], list[int]]:
    """(rank -> its global stages, layers of each of the pp * v stages): rank r's layers
    ``cuts[r]`` split over its v stages as evenly as possible; ``stage_rank``'s layout. The
    remainder goes to the rank's later local stages: its first one runs the warm-up's forwards and
    holds the most micro-batches at the activation peak (interleaved_zb, p=8, m=64: 16 of rank 2's
    first stage, none of its second), so a larger first stage would make the rank's peak more than
    its layers times the schedule's average in-flight count, which the step model charges
    (``cost.memory.pipeline_inflight_microbatches``). A stage with the embedding or the head takes
    the smaller share."""
    p, v, n_st = cfg.pp, cfg.v, cfg.pp * cfg.v
    if cfg.schedule in V_SCHEDULES:
        local = {r: [r, 2 * p - 1 - r] for r in range(p)}
    else:
        local = {r: [j * p + r for j in range(v)] for r in range(p)}
    layers = [0] * n_st
    for r, idx in local.items():
        q, extra = divmod(cuts[r], v)
        order = sorted(idx, key=lambda g: (g in (0, n_st - 1), -idx.index(g)))   # later plain stages: the remainder
        for j, g in enumerate(order):
            layers[g] = q + (1 if j < extra else 0)
    return local, layers


def plan_stages(ev: Evaluation, summary) -> tuple[Stage, ...]:
    """The pp * v stages of an evaluation (every rank evaluated), ``stage_layers``' split laid out
    in model order; ``stage_rank`` gives the rank of each stage."""
    cfg = ev.config
    v, n_st = cfg.v, cfg.pp * cfg.v
    local, layers = stage_layers(cfg, ev.cuts)
    by_rank = {st.index: st for st in ev.stages}
    blk, pre, post = summary.parts["block"], summary.parts["pre"], summary.parts["post"]

    def work(g: int) -> float:
        w = layers[g] * (blk.fwd_compute_s + blk.bwd_compute_s)
        return w + (pre.fwd_compute_s + pre.bwd_compute_s if g == 0 else 0.0) \
            + (post.fwd_compute_s + post.bwd_compute_s if g == n_st - 1 else 0.0)

    out, at = [], 0
    for g in range(n_st):
        r = next(rr for rr, idx in local.items() if g in idx)
        st = by_rank[r]
        rank_work = sum(work(x) for x in local[r])
        share = work(g) / rank_work if rank_work > 0 else 1.0 / v
        out.append(Stage(index=g, first_layer=at, last_layer=at + layers[g], has_embedding=g == 0,
                         has_head=g == n_st - 1, time_per_microbatch_s=st.time_per_microbatch_s * share,
                         memory_bytes=st.memory.total_bytes))
        at += layers[g]
    return tuple(out)
