"""Test-only Plans with hand-assigned tensor parallelism for gpt-tiny-like GPTs.

``hand_plan(graph, dp=2, tp=2, family="megatron")`` asks the solver for a plan with the mesh,
ZeRO stage and recompute forced (it fills every field and the dp placements), then overwrites
the tp placement of every node from a table:

- "replicate": nothing sharded on tp (whatever the solver chose is replaced by R).
- "megatron": column/row-parallel attention (fused QKV, strided split, heads-sharded attention)
  and MLP; the residual stream Replicate; row-parallel outputs Partial, all-reduced at the add.
- "megatron_sp": the same with sequence parallelism: the residual stream and layer norms
  Shard(1) (sequence); all-gather before each column-parallel linear, reduce-scatter after each
  row-parallel one.
- "megatron_vocab": "megatron" plus a vocab-parallel head: the tied embedding/lm_head weight
  stored Shard(0) (vocab rows), lm_head column-parallel, and cross-entropy on class-sharded logits
  (``loss_parallel``). The token embedding looks up its vocab rows locally (masked lookup,
  Partial output, all-reduced where the residual stream needs it replicated).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from autopar.cost.hardware import resolve_cluster
from autopar.solver.forcing import Force
from autopar.ir import GraphIR
from autopar.placements import Partial, Replicate, Shard
from autopar.plan import NodeStrategy, Plan

R, P = Replicate(), Partial()
S = Shard

_ATTN = {   # tp (output, inputs) by (target, k) inside the attention module
    ("aten.split.Tensor", 0): (S(2), (S(2),)),
    ("getitem", 0): (S(2), (S(2),)), ("getitem", 1): (S(2), (S(2),)), ("getitem", 2): (S(2), (S(2),)),
    ("aten.view.default", 0): (S(2), (S(2),)), ("aten.view.default", 1): (S(2), (S(2),)),
    ("aten.view.default", 2): (S(2), (S(2),)), ("aten.view.default", 3): (S(2), (S(2),)),
    ("aten.transpose.int", 0): (S(1), (S(2),)), ("aten.transpose.int", 1): (S(1), (S(2),)),
    ("aten.transpose.int", 2): (S(1), (S(2),)), ("aten.transpose.int", 3): (S(2), (S(1),)),
    ("aten.scaled_dot_product_attention.default", 0): (S(1), (S(1), S(1), S(1))),
    ("aten.contiguous.default", 0): (S(2), (S(2),)),
}


_VOCAB = {  # tp (output, inputs) of the vocab-parallel head ("megatron_vocab")
    ("transformer.wte.weight", "param", 0): (S(0), ()),
    ("lm_head.weight", "param", 0): (S(0), ()),
    ("transformer.wte", "aten.embedding.default", 0): (P, (S(0), R)),  # masked lookup on vocab rows
    ("lm_head", "aten.linear.default", 0): (S(2), (R, S(0))),
    ("", "aten.reshape.default", 0): (S(1), (S(2),)),
    ("", "aten.cross_entropy_loss.default", 0): (R, (S(1), R)),
}


def _tp_table(family: str, key: str, n_inputs: int) -> Optional[tuple]:
    """(tp output, tp inputs) for a node key of the (collapsed) graph, or None for all-R."""
    if family == "replicate":
        return None
    sp = family == "megatron_sp"
    act = S(1) if sp else R                       # the residual stream / layer-norm placement
    path, target, k = key.split("|")
    k = int(k)
    if family == "megatron_vocab" and (path, target, k) in _VOCAB:
        return _VOCAB[(path, target, k)]
    if key.endswith("param|0"):
        if path.endswith(("c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias")):
            return S(0), ()
        if path.endswith("c_proj.weight"):
            return S(1), ()
        return R, ()
    if target == "aten.linear.default":
        if path.endswith(("c_attn", "c_fc")):
            return S(2), (R, S(0), S(0))[:n_inputs]
        if path.endswith("c_proj"):
            return P, (S(2), S(1), P)[:n_inputs]
        if path == "lm_head":
            return R, (R, R)
    if path.endswith(".attn") and (target, k) in _ATTN:
        return _ATTN[(target, k)]
    if target == "aten.gelu.default":
        return S(2), (S(2),)
    if target == "aten.layer_norm.default" and path != "transformer.ln_f":
        return act, (act, R, R)
    if target == "aten.layer_norm.default":
        return act, (act, R, R)
    if path == "transformer.h.*" and target == "aten.add.Tensor":
        return act, (act, act)
    if path == "" and target == "aten.add.Tensor":                  # token + position embeddings
        return act, (act, S(0) if sp else R)
    return None


def _name(family: str, s: NodeStrategy, t) -> str:
    if "split" in s.key and t:
        return "strided"
    if family == "megatron_vocab" and "cross_entropy" in s.key:
        return "vocab"
    return s.name


def hand_plan(graph: GraphIR, *, dp: int, tp: int, family: str = "megatron", zero: int = 0,
              recompute: str = "none", sp: Optional[bool] = None, pp: int = 1, mbs: Optional[int] = None,
              schedule: Optional[str] = None, cp: int = 1, cp_mode: str = "ring") -> Plan:
    """``mbs``: the micro-batch size (default: the whole per-replica batch, one micro-batch);
    ``cp`` > 1: each sequence (the input's dim 1) split over cp ranks, attention by ``cp_mode``."""
    from autopar.solver.search import plan_model

    sp = (family == "megatron_sp") if sp is None else sp
    force = Force(dp=dp, tp=tp, pp=pp, zero_stage=zero, recompute=recompute,
                  sequence_parallel=sp if tp > 1 else None,
                  micro_batch_size=mbs if mbs is not None else graph.batch_size // dp, schedule=schedule,
                  context_parallel=cp if cp > 1 else None, context_parallel_mode=cp_mode if cp > 1 else None)
    seq = next(n.out.shape[1] for n in graph.nodes if n.kind == "input") if cp > 1 else None
    base = plan_model(graph, resolve_cluster("cpu", nodes=1, gpus_per_node=dp * tp * pp * cp),
                      global_batch=graph.batch_size, seq_len=seq, dtype="float32", force=force)
    if tp == 1:
        return base
    strategies = []
    for s in base.strategies:
        if "@" in s.key:                     # copies of layer 0 in a full trace: layer 0 decides
            continue
        t = _tp_table(family, s.key, len(s.inputs))
        out_tp, ins_tp = (R, tuple(R for _ in s.inputs)) if t is None else t
        if len(ins_tp) != len(s.inputs):
            raise AssertionError(f"hand table for {s.key}: {len(ins_tp)} inputs, plan has {len(s.inputs)}")
        strategies.append(NodeStrategy(s.key, (s.output[0], out_tp),
                                       tuple((i[0], p) for i, p in zip(s.inputs, ins_tp)),
                                       _name(family, s, t)))
    return replace(base, strategies=tuple(strategies), sequence_parallel=family == "megatron_sp")


def _outer_storage(shape: tuple, inner) -> object:
    """A parameter's storage on an outer tensor axis: Shard along the first dim ``inner`` (its
    placement on "tp") does not shard; Replicate when there is none."""
    taken = inner.dim % len(shape) if isinstance(inner, Shard) and shape else None
    free = [d for d in range(len(shape)) if d != taken]
    return S(free[0]) if free else R


def tensor_2d_plan(graph: GraphIR, *, outer: int = 2, inner: int = 2, family: str = "megatron", dp: int = 1,
                   zero: int = 0) -> Plan:
    """A hand plan on the stage mesh ("tp2", "tp") = (outer, inner) (with dp > 1: ("dp", "tp2", "tp")):
    on "tp" the placements of ``hand_plan(graph, dp=1, tp=inner, family=family)``; on "tp2" (and
    on "dp") those a dp=outer plan puts on its data axis (activations split over the batch, the
    loss Partial), except that every parameter is STORED Shard on "tp2" along a dim "tp" does not
    shard (``_outer_storage``) and read Replicate there: the runtime all-gathers it on "tp2" at
    each use, DTensor's backward reduce-scatters its gradient. ``Plan.tp`` is the total tensor
    degree, outer * inner; ``zero``: the ZeRO stage over dp."""
    from autopar.mesh import DATA, TENSOR, TENSOR2

    batch, tensor = hand_plan(graph, dp=outer, tp=1), hand_plan(graph, dp=1, tp=inner, family=family)
    di = batch.mesh_axes.index(DATA)
    ti = tensor.mesh_axes.index(TENSOR) if TENSOR in tensor.mesh_axes else None
    by_key = {s.key: s for s in batch.strategies}
    shapes = {n.key: n.out.shape for n in graph.nodes if n.kind == "param"}
    lead = 1 if dp > 1 else 0                # the dp axis' placements: the batch plan's, as tp2's

    def tp(pl):
        return R if ti is None else pl[ti]

    strategies = []
    for s in tensor.strategies:
        if "@" in s.key:
            continue
        b = by_key[s.key]
        o2 = _outer_storage(shapes[s.key], tp(s.output)) if s.key in shapes else b.output[di]
        out = (b.output[di],) * lead + (o2, tp(s.output))
        ins = tuple((x[di],) * lead + (x[di], tp(y)) for x, y in zip(b.inputs, s.inputs))
        strategies.append(NodeStrategy(s.key, out, ins, s.name))
    world = dp * outer * inner
    return replace(tensor, mesh_axes=(DATA,) * lead + (TENSOR2, TENSOR), mesh_shape=(dp,) * lead + (outer, inner),
                   dp=dp, tp=outer * inner, zero_stage=zero, micro_batch_size=graph.batch_size // dp,
                   strategies=tuple(strategies), cluster=replace(tensor.cluster, gpus_per_node=world))
