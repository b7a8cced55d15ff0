"""The plan's peak memory by moments (``solver/step_memory.py``): the figure ``autopar plan`` reports
and the search fits to the budget is the one ``autopar run --memory`` predicts for the same dtype and
optimizer (which ``tests/runtime/test_memory_measure.py`` holds within 10% of the measured peak);
the categories' sum (the plan's figure before) over-counts what the backward has freed."""
from __future__ import annotations

import dataclasses

import pytest

from autopar.solver import plan_model, solve
from autopar.solver.forcing import parse_force

from solver_helpers import traced

MiB = 2**20
SPEC = "gpt:hidden=256,layers=24,heads=4,vocab=512,seq=64"
FAMILIES = ("dp=2,zero=0,recompute=none", "dp=2,zero=1,recompute=none", "dp=2,zero=2,recompute=none",
            "dp=2,zero=3,recompute=none", "dp=2,zero=3,recompute=full", "tp=2,recompute=none",
            "dp=2,zero=3,offload=optimizer+grads+params", "dp=2,zero=0,mbs=1,recompute=none")


@pytest.fixture(scope="module")
def setup():
    from autopar.cost.hardware import resolve_cluster

    g, _ = traced(SPEC, batch=4)
    return g, dataclasses.replace(resolve_cluster("cpu", nodes=1, gpus_per_node=2), host_memory_bytes=6e9)


def _solve(setup, force: str, budget_mib: float = 4096):
    g, cluster = setup
    return solve(g, cluster, global_batch=4, seq_len=64, dtype="float32", memory_budget_bytes=budget_mib * MiB,
                 force=parse_force(force))


@pytest.mark.parametrize("force", FAMILIES)
def test_the_plan_reports_the_peak_the_run_predicts(setup, force):
    from autopar.runtime.memory_predict import plan_evaluation, predict_memory

    g, cluster = setup
    plan = _solve(setup, force).plan
    ev, summary, profile = plan_evaluation(plan, g, cluster)
    run = predict_memory(ev, summary, 0, "float32", "adamw", profile, "cpu")
    assert plan.memory.total_bytes == run.peak_bytes
    assert plan.memory.total_bytes <= plan.memory.categories_bytes
    if "recompute=none" in force and "mbs=1" not in force:
        # one micro-batch: the gradients grow as the backward frees the activations
        assert plan.memory.total_bytes < 0.95 * plan.memory.categories_bytes


def test_a_budget_the_peak_fits_needs_no_recompute(setup):
    """Between the no-recompute plan's peak and its categories' sum, nothing needs recomputing
    (adding the categories, the search recomputed)."""
    g, cluster = setup
    none = _solve(setup, "dp=2,zero=3,recompute=none").plan
    budget = (none.memory.total_bytes + none.memory.categories_bytes) / 2
    plan = plan_model(g, cluster, global_batch=4, seq_len=64, dtype="float32", memory_budget_bytes=budget,
                      force="dp=2,zero=3,mbs=2")
    assert plan.recompute == "none" and plan.memory.total_bytes <= budget < plan.memory.categories_bytes


@pytest.mark.parametrize("force", ["dp=2,zero=3,recompute=none", "tp=2,recompute=none", "tp=2,recompute=selective"])
def test_the_memory_constraint_at_the_unconstrained_choice(setup, force):
    """The memory-constrained ILP's linear constraint, at the choice it starts from, is the
    evaluated peak (``by_moments``: the room the moments leave) or the categories' sum."""
    from autopar.solver.memory_constraints import memory_constraints

    res = _solve(setup, force)
    ev, sol = res.evaluation, res.solution
    for by_moments, want in ((True, ev.memory.total_bytes), (False, ev.memory.categories_bytes)):
        (c,) = memory_constraints(sol.tables, ev.config, ev, res.profile, 0.0, sol.summary.layer_input_bytes,
                                  by_moments)
        lhs = sum(co[sol.choice[k]] for co, k in zip(c.coeffs, sol.tables.keys))
        assert lhs - c.rhs == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("collapsed", [True, False])
def test_the_memory_bound_of_a_zero3_configuration_is_by_moments_too(setup, collapsed):
    """The search's memory bound (``timing.memory_lower_bound``: layer counts as floats, 0.0 for a
    graph traced without collapsing its layers, whose tied embedding ZeRO-3 still gathers) takes the
    same moments, ZeRO-3's forward gathers among them, and stays under the evaluated peak."""
    from autopar.models import build_model
    from autopar.solver.problem import lower_bound_summary
    from autopar.solver.timing import memory_lower_bound
    from autopar.trace import trace_model

    g, cluster = setup
    if not collapsed:
        b = build_model("gpt-tiny", device="meta")
        g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                        collapse_repeats=False, model_name="gpt-tiny")
    res = solve(g, cluster, global_batch=4, seq_len=None, dtype="float32", memory_budget_bytes=4096 * MiB,
                force=parse_force("dp=2,zero=3,recompute=none"))
    lb = memory_lower_bound(lower_bound_summary(res.solution.tables), res.evaluation.config, res.profile)
    exact = memory_lower_bound(res.solution.summary, res.evaluation.config, res.profile)
    assert exact.total_bytes == res.evaluation.memory.total_bytes
    assert 0 < lb.total_bytes <= exact.total_bytes


# a pipeline whose rank 0 peaks above its categories added (interleaved 1F1B over 7 layers): its
# schedule's replay is the model the measurements hold, the sum is what the search compares
PIPE = "gpt:hidden=64,layers=7,heads=4,vocab=512,seq=64"
PIPE_FORCE = "pp=2,mbs=1,schedule=interleaved_1f1b,vpp=2"


@pytest.mark.parametrize("force", [PIPE_FORCE])
def test_a_pipelined_plan_reports_and_fits_its_schedule_replay(force):
    from autopar.cost.hardware import resolve_cluster
    from autopar.runtime.memory_predict import plan_evaluation, predict_memory
    from autopar.solver.errors import PlanningError

    g, _ = traced(PIPE, batch=8)
    cluster = resolve_cluster("cpu", nodes=1, gpus_per_node=2)
    plan = plan_model(g, cluster, global_batch=8, seq_len=None, dtype="float32", force=force)
    ev, summary, profile = plan_evaluation(plan, g, cluster)
    replays = [predict_memory(ev, summary, r, "float32", "adamw", profile, "cpu").peak_bytes for r in range(2)]
    assert plan.memory.total_bytes == max(replays) > plan.memory.categories_bytes
    # a budget the categories' sum fits and the replay does not: the plan found (if any) fits the replay
    budget = (plan.memory.total_bytes + plan.memory.categories_bytes) / 2
    try:
        tight = plan_model(g, cluster, global_batch=8, seq_len=None, dtype="float32", force=force,
                           memory_budget_bytes=budget)
    except PlanningError:
        return
    assert tight.memory.total_bytes <= budget


@pytest.mark.parametrize("schedule, local_first, local_second", [("interleaved_zb", 5, 6), ("zbv", 5, 6)])
def test_a_ranks_remainder_layers_go_to_its_later_local_stage(schedule, local_first, local_second):
    """Its first local stage holds the most micro-batches at the activation peak (the warm-up's
    forwards): the larger share goes to the later one (``plan_parts.stage_layers``)."""
    from types import SimpleNamespace

    from autopar.solver.plan_parts import stage_layers

    cfg = SimpleNamespace(pp=4, v=2, schedule=schedule)
    local, layers = stage_layers(cfg, (11, 11, 11, 11))
    first, second = local[1]                         # rank 1: neither the embedding nor the head
    assert (layers[first], layers[second]) == (local_first, local_second)


def test_the_report_shows_the_peak_and_the_categories_added(setup):
    from rich.console import Console

    from autopar.report import memory_table

    plan = _solve(setup, "dp=2,zero=3,recompute=none").plan
    console = Console(width=100, record=True)
    console.print(memory_table(plan))
    text = console.export_text()
    peak, added = (f"{b / 1e9:.2f} GB" for b in (plan.memory.total_bytes, plan.memory.categories_bytes))
    assert "peak" in text and peak in text and "(the categories added)" in text and added in text


def test_a_pipeline_only_its_replay_rules_out_says_what_it_needs():
    """Everything forced, a budget between its categories' sum and its replay: no plan, and the
    error names the replayed need (the lower bound alone, the sum, is under the budget)."""
    from autopar.cost.hardware import resolve_cluster
    from autopar.solver import InfeasibleError

    g, _ = traced(PIPE, batch=8)
    cluster = resolve_cluster("cpu", nodes=1, gpus_per_node=2)
    force = PIPE_FORCE + ",recompute=none,zero=0,offload=none"
    plan = plan_model(g, cluster, global_batch=8, seq_len=None, dtype="float32", force=force)
    budget = (plan.memory.total_bytes + plan.memory.categories_bytes) / 2
    with pytest.raises(InfeasibleError, match="the leanest plan evaluated in full needs"):
        plan_model(g, cluster, global_batch=8, seq_len=None, dtype="float32", force=force, memory_budget_bytes=budget)
