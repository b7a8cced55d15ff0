"""Per-layer recompute: the solver's "partial" recompute picks, for a configuration, the fewest
layers per pipeline rank that fit the memory budget (brute force over every count agrees), the
plan says which, and the runtime recomputes exactly those (tests/runtime/test_families.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.cost import make_cluster
from autopar.plan import Plan
from autopar.solver import plan_model, solve
from autopar.solver.forcing import parse_force
from autopar.solver.timing import evaluate, fit_partial

from solver_helpers import traced

FORCE = "dp=8,tp=1,pp=1,mbs=8,zero=1"          # none: does not fit 30 GB; full: fits with room


@pytest.fixture(scope="module")
def gpt13():
    g, _ = traced("gpt3-1.3b", batch=64)
    return g


def _solved(g, recompute: str, budget_gb: float = 30.0):
    cluster = make_cluster("a100-40g", 1, 8)
    return solve(g, cluster, global_batch=64, seq_len=2048, dtype="bfloat16", memory_budget_bytes=int(budget_gb * 1e9),
                 force=parse_force(f"{FORCE},recompute={recompute}"))


def test_the_fewest_layers_that_fit_is_what_brute_force_finds(gpt13):
    res = _solved(gpt13, "full")
    ev, sol = res.evaluation, res.solution
    env = (res.cluster, res.profile, res.budget_bytes)
    cfg = replace(ev.config, recompute="partial", recompute_layers=None)
    fitted = fit_partial(sol.summary, cfg, *env)
    every = [evaluate(sol.summary, replace(cfg, recompute_layers=k), *env) for k in range(sol.summary.count + 1)]
    fits = [k for k, e in enumerate(every) if e.fits]
    assert fits and fitted.config.recompute_layers == fits[0]
    assert 0 < fits[0] < sol.summary.count                          # a real partial choice here
    # memory falls and time grows with each recomputed layer (all of them: "full", one layer's
    # re-materialization on top)
    assert all(a.memory.total_bytes >= b.memory.total_bytes for a, b in zip(every[:-1], every[1:-1]))
    assert all(a.step.total_s <= b.step.total_s for a, b in zip(every, every[1:]))
    assert fitted.step.total_s < ev.step.total_s                    # faster than recomputing every layer


def test_the_plan_names_the_layers_and_round_trips(gpt13):
    cluster = make_cluster("a100-40g", 1, 8)
    plan = plan_model(gpt13, cluster, global_batch=64, seq_len=2048, dtype="bfloat16",
                      memory_budget_bytes=int(30e9), force=parse_force(f"{FORCE},recompute=partial"))
    k = plan.recompute_layers
    assert plan.recompute == "full" and k is not None and 0 < k < 24
    assert plan.recomputed_layers() == frozenset(range(k))          # pp=1: the model's first k layers
    assert Plan.from_json(plan.to_json()) == plan and plan.summary()["recompute_layers"] == k
    with pytest.raises(ValueError, match="recompute_layers"):
        replace(plan, recompute="none")


def test_first_layers_of_each_pipeline_rank():
    g, _ = traced("gpt:hidden=64,layers=8,heads=4,vocab=128,seq=16", batch=8)
    plan = plan_model(g, make_cluster("h100", 1, 2), global_batch=8, seq_len=16, dtype="bfloat16",
                      force=parse_force("pp=2,dp=1,tp=1,mbs=1,schedule=1f1b,recompute=full"))
    assert [(s.first_layer, s.last_layer) for s in plan.stages] == [(0, 4), (4, 8)]
    assert replace(plan, recompute_layers=2).recomputed_layers() == frozenset({0, 1, 4, 5})
