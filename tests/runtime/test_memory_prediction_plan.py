"""``--memory`` / ``profile`` predict the placements a plan names (``solver/plan_choice.py``), not
those a fresh solve of its configuration would pick on the default links of its GPU: a hand-made
Megatron plan of gpt-tiny on 2 CPU ranks (which the solver itself would leave replicated: its
tensor-parallel collectives cost more than they save there) is predicted with half of each split
matrix per rank. No ranks are started."""
from __future__ import annotations

import math

import pytest

from autopar.placements import Shard
from handplans import hand_plan


@pytest.fixture(scope="module")
def graph():
    from autopar.models import build_model
    from autopar.trace import trace_model

    b = build_model("gpt-tiny", device="meta")
    return trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                       model_name="gpt-tiny")


def test_the_prediction_is_of_the_plans_own_placements(graph, monkeypatch):
    import autopar.solver.plan_choice as plan_choice
    from autopar.runtime.memory_predict import plan_evaluation

    plan = hand_plan(graph, dp=1, tp=2, family="megatron")
    shapes = {n.key: n.out.shape for n in graph.nodes if n.kind == "param"}
    by_key = {s.key: s for s in plan.strategies}
    want = sum(math.prod(shape) // (2 if isinstance(by_key[k].output[1], Shard) else 1)
               for k, shape in shapes.items() if ".h.*." in k)          # one layer's parameters per rank
    assert want < sum(math.prod(shape) for k, shape in shapes.items() if ".h.*." in k)
    _, own, _ = plan_evaluation(plan, graph)
    assert own.parts["block"].param_numel == want
    monkeypatch.setattr(plan_choice, "own_summary", lambda solution, plan: None)     # the solve's own choice
    _, solved, _ = plan_evaluation(plan, graph)
    assert solved.parts["block"].param_numel > want                     # what was predicted before


def test_a_plan_the_tables_cannot_hold_falls_back_to_the_solve(graph):
    from dataclasses import replace

    from autopar.placements import Replicate
    from autopar.solver.plan_choice import plan_choice
    from autopar.solver.search import solve
    from autopar.cost.hardware import resolve_cluster
    from autopar.solver.forcing import parse_force

    plan = hand_plan(graph, dp=1, tp=2, family="megatron")
    res = solve(graph, resolve_cluster("cpu", nodes=1, gpus_per_node=2), global_batch=plan.global_batch,
                seq_len=None, dtype=plan.dtype, force=parse_force("tp=2,dp=1"))
    strategies = {s.key: s for s in plan.strategies}
    assert plan_choice(res.solution.tables, strategies, 1) is not None
    odd = next(k for k in strategies if "c_fc|aten.linear" in k)
    strategies[odd] = replace(strategies[odd], output=(Replicate(), Shard(0)))   # with its inputs: no strategy
    assert plan_choice(res.solution.tables, strategies, 1) is None
