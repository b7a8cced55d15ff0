"""Single-process checks of plan -> program: regions, strided parameters, plan validation, and
the collective predictor's arithmetic on a known plan."""
from collections import Counter
from dataclasses import replace

import pytest

from autopar.codegen.expected import expected_collectives
from autopar.codegen.program import compile_program
from autopar.placements import Replicate, Shard
from autopar.plan import NodeStrategy
from handplans import hand_plan


def test_recompute_regions(tiny_full):
    g = tiny_full
    full = compile_program(g, hand_plan(g, dp=2, tp=1, recompute="full"))
    assert [r.kind for r in full.regions] == ["layer", "layer"]
    first = {n.name for n in g.nodes if n.layer_id == 0 and n.kind == "op"}
    assert set(full.regions[0].nodes) == first
    sel = compile_program(g, hand_plan(g, dp=2, tp=1, recompute="selective"))
    assert [r.kind for r in sel.regions] == ["attention", "attention"]
    assert all(len(r.nodes) == 1 for r in sel.regions)


def test_megatron_plan_marks_strided_qkv(tiny_full):
    prog = compile_program(tiny_full, hand_plan(tiny_full, dp=1, tp=2))
    params = {p.name: p for p in prog.params}
    assert params["transformer.h.0.attn.c_attn.weight"].strided == 3
    assert params["transformer.h.1.attn.c_attn.bias"].strided == 3
    assert params["transformer.h.0.mlp.c_fc.weight"].strided == 1
    assert params["transformer.h.0.attn.c_proj.weight"].tp == Shard(1)
    assert sum(1 for n in prog.nodes if n.strided == 3) == 2      # one split per layer


def test_single_placement_strategy_is_read_as_tp(tiny_full):
    plan = hand_plan(tiny_full, dp=2, tp=2)
    key = "transformer.h.*.mlp|aten.gelu.default|0"
    strategies = tuple(NodeStrategy(s.key, (Shard(2),), ((Shard(2),),)) if s.key == key else s
                       for s in plan.strategies)
    prog = compile_program(tiny_full, replace(plan, strategies=strategies))
    gelu = next(n for n in prog.nodes if n.key == key)
    assert gelu.output == (None, Shard(2)) and gelu.inputs == ((None, Shard(2)),)


def test_plan_validation_errors(tiny_full):
    plan = hand_plan(tiny_full, dp=2, tp=1)
    with pytest.raises(ValueError, match="1 stages listed for pp=2"):   # a Plan's fields must agree
        replace(plan, pp=2)
    with pytest.raises(ValueError, match="mesh axis dp=4 but dp=2"):
        replace(plan, mesh_shape=(4, 1))
    bad = tuple(NodeStrategy(s.key, (Shard(1), Replicate()), s.inputs) if s.key.endswith("param|0") else s
                for s in plan.strategies)
    with pytest.raises(ValueError, match="parameters are"):
        compile_program(tiny_full, replace(plan, strategies=bad))
    with pytest.raises(ValueError, match=r"params offload needs optimizer offload too; write optimizer\+params"):
        replace(plan, offload="params")
    with pytest.raises(ValueError, match="offloads params, which needs zero_stage 3"):
        replace(plan, offload="optimizer+params")


def test_expected_collectives_megatron_counts(tiny_full):
    """Megatron TP (no SP), tp=2, dp=1: per layer one forward all-reduce after each row-parallel
    linear and one backward all-reduce before each column-parallel one (Megatron's g and f)."""
    g = tiny_full
    exp = Counter((c.kind, c.axis, c.phase) for c in expected_collectives(g, hand_plan(g, dp=1, tp=2)))
    layers = 2
    assert exp == Counter({("all_reduce", "tp", "forward"): 2 * layers,
                           ("all_reduce", "tp", "backward"): 2 * layers})
    sp = Counter((c.kind, c.axis, c.phase) for c in
                 expected_collectives(g, hand_plan(g, dp=1, tp=2, family="megatron_sp")))
    # SP: all-gather before each column-parallel linear (and the LM head), reduce-scatter after
    # each row-parallel one; backward transposes them (the LM head's gather has a replicated
    # gradient: free). The token and position embeddings are scattered to the sequence shard
    # (backward: 2 all-gathers). Layer-norm weights see sequence shards: their gradients are
    # Partial on tp, one all-reduce each (5 norms x weight, bias). Each forward all-gather feeds a
    # linear that saves it: the shard is kept and gathered again in backward (runtime/regather.py).
    assert sp == Counter({("all_gather", "tp", "forward"): 2 * layers + 1,
                          ("reduce_scatter", "tp", "forward"): 2 * layers,
                          ("reduce_scatter", "tp", "backward"): 2 * layers,
                          ("all_gather", "tp", "backward"): (2 * layers + 2) + (2 * layers + 1),
                          ("all_reduce", "tp", "backward"): 2 * (2 * layers + 1)})


def test_zero3_runs_the_local_data_parallel_path(tiny_full):
    """ZeRO-3 stores each parameter as dp rows (Shard(0) on dp in the plan) and gathers it at every
    use, so its consumers read it whole: the plain-tensor path of data parallelism takes the same
    nodes as under ZeRO-1. (Reading the stored rows as the consumers' placement refused the path
    for every model with a position embedding, whose lookup is replicated over dp.)"""
    from autopar.codegen.program import local_dp_nodes
    from autopar.mesh import DATA

    zero3 = hand_plan(tiny_full, dp=2, tp=1, zero=3)
    di = zero3.mesh_axes.index(DATA)
    stored = {s.key: s.output[di] for s in zero3.strategies}
    assert stored["transformer.wpe.weight|param|0"] == Shard(0)     # the rows the plan stores
    nodes = local_dp_nodes(tiny_full, zero3)
    assert nodes is not None and nodes == local_dp_nodes(tiny_full, hand_plan(tiny_full, dp=2, tp=1, zero=1))


def test_values_of_parameters_alone_keep_their_gradient_partial_on_dp(tiny_full):
    """The position embedding (``wpe`` of the positions, no batch in it) keeps its gradient summand
    Partial on dp up to the reducer, as a parameter does: no all-reduce of it in the backward
    (T x H values a micro-batch), and none predicted; one dp rank keeps nothing."""
    g = tiny_full
    wpe = next(n.key for n in g.nodes if n.key.startswith("transformer.wpe|"))
    plan = hand_plan(g, dp=2, tp=2)
    assert wpe in compile_program(g, plan).positional
    assert wpe not in compile_program(g, hand_plan(g, dp=1, tp=2)).positional
    emb = next(n for n in g.nodes if n.key == wpe).out
    grad_bytes = emb.numel * 4
    dp_bwd = [c for c in expected_collectives(g, plan, tp_rank=0) if c.axis == "dp" and c.phase == "backward"]
    assert not any(c.kind == "all_reduce" and c.nbytes == grad_bytes for c in dp_bwd), dp_bwd
