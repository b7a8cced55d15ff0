"""Random forced plans (hypothesis): a mesh (dp x tp of 4 ranks), ZeRO stage, recompute, a
tensor-parallel family (or the solver's own choice for the forced degrees), drawn several at a
time and run in one 4-rank launch; each must match the single-process run within round-off
(``bodies.check_against_reference``: losses, each step's gradients, parameters) and issue exactly
the predicted collectives (predicted from one micro-batch's trace where the solver picked several)."""
from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from autopar.codegen.expected import expected_collectives
from autopar.cost.hardware import resolve_cluster
from autopar.solver.forcing import Force
from autopar.runtime.launch import spawn_ranks
from bodies import BATCH, check_against_reference, full_trace, check_collectives, reference, train_jobs
from handplans import hand_plan

pytestmark = pytest.mark.slow
WORLD = 4


@st.composite
def configs(draw):
    dp = draw(st.sampled_from([1, 2, 4]))
    tp = WORLD // dp
    zero = draw(st.integers(0, 3)) if dp > 1 else 0
    recompute = draw(st.sampled_from(["none", "selective", "full"]))
    family = draw(st.sampled_from(["solver", "replicate", "megatron", "megatron_sp"] if tp > 1 else ["solver"]))
    meta = draw(st.booleans())
    return dict(dp=dp, tp=tp, zero=zero, recompute=recompute, family=family, meta=meta)


def _plan(graph, c):
    if c["family"] == "solver":
        from autopar.solver.search import plan_model

        force = Force(dp=c["dp"], tp=c["tp"], pp=1, zero_stage=c["zero"], recompute=c["recompute"])
        return plan_model(graph, resolve_cluster("h100", nodes=1, gpus_per_node=WORLD),
                          global_batch=graph.batch_size, seq_len=None, dtype="float32", force=force)
    return hand_plan(graph, dp=c["dp"], tp=c["tp"], zero=c["zero"], recompute=c["recompute"],
                     family=c["family"])



@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(configs(), min_size=3, max_size=3, unique_by=lambda c: tuple(sorted(c.items()))))
def test_random_forced_plans(cs):
    tiny_full = full_trace(BATCH)
    plans = [_plan(tiny_full, c) for c in cs]
    jobs = [{"plan": p.to_json(), "meta": c["meta"], "seed": 11} for p, c in zip(plans, cs)]
    per_rank = spawn_ranks(train_jobs, WORLD, (jobs,), timeout_s=60)
    for i, (plan, c) in enumerate(zip(plans, cs)):
        results = [per_rank[r][i] for r in range(WORLD)]
        try:
            check_against_reference(results, reference(c["meta"], 11))
            graph = full_trace(BATCH // plan.num_micro_batches)
            check_collectives(results, lambda tp_rank: expected_collectives(graph, plan, tp_rank=tp_rank))
        except AssertionError as e:
            raise AssertionError(f"config {c}: {e}") from e
