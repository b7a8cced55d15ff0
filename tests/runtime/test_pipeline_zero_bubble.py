"""The zero-bubble pipeline schedules, executed: interleaved_zb, zbv and dualpipev split each
micro-batch's backward into an input-gradient and a weight-gradient pass (``runtime/pipeline.py``).
Over 3 SGD-momentum steps the losses, each step's gradients and the final parameters equal one
process on the whole batch within round-off (bounds in bodies.py), the forward after training
matches, and every rank issued exactly the collectives ``codegen/expected_pipeline.py`` predicts
(point-to-point sends once per micro-batch and stage boundary, tied-embedding sums, dp reductions):
the split neither drops nor repeats a gradient, a send or a collective. The models tie wte and
lm_head: on the loop layout (interleaved_zb) the first and last stages sit on different pipeline
ranks and their gradients are summed over pp; on the V layout (zbv, dualpipev) one rank holds both
stages and the two summands meet in one leaf (stage 0's full backward, the last stage's weight pass).

Refused: a zero-bubble schedule with recompute regions that issue collectives (each pass replays
the region) -- by the solver when forced, by the runtime on every rank for a given plan.

One launch per world size runs all its cases in the same ranks."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from autopar.plan import EXECUTED_SCHEDULES, Plan, stage_rank
from autopar.runtime.launch import spawn_ranks
from autopar.solver import PlanningError
from bodies import STEPS, bad_input_cases, train_jobs
from test_pipeline import _check, _plan

pytestmark = pytest.mark.slow

GPT_4 = "gpt:hidden=32,layers=4,heads=4,vocab=128,seq=16"       # 2 stages per rank at pp=2
GPT_8 = "gpt:hidden=32,layers=8,heads=4,vocab=128,seq=16"       # 2 stages per rank at pp=4

# name: (model spec, --force, what the plan must be: (pp, schedule, virtual stages, micro-batches))
PLANS_2 = {
    "pp2_zbv": (GPT_4, "pp=2,mbs=1,schedule=zbv", (2, "zbv", 2, 4)),
    "pp2_interleaved_zb": (GPT_4, "pp=2,mbs=1,schedule=interleaved_zb,vpp=2", (2, "interleaved_zb", 2, 4)),
    "pp2_dualpipev": (GPT_4, "pp=2,mbs=1,schedule=dualpipev", (2, "dualpipev", 2, 4)),   # m >= 2 pp
}
PLANS_4 = {
    "pp2_dp2_zero2_zbv": (GPT_4, "pp=2,dp=2,mbs=1,zero=2,schedule=zbv", (2, "zbv", 2, 2)),
    "pp4_interleaved_zb": (GPT_8, "pp=4,mbs=1,schedule=interleaved_zb,vpp=2", (4, "interleaved_zb", 2, 4)),
}
# a plan the runtime must refuse: ZeRO-3 gathers inside recompute regions replayed by both passes
REFUSED_FORCE = "pp=2,dp=2,mbs=1,zero=3,schedule=zbv"
REFUSAL = "replays recompute regions in both its input- and weight-gradient passes"


def _refused_plan_json() -> str:
    return dataclasses.replace(_plan(GPT_4, REFUSED_FORCE, 4), recompute="full").to_json()


def zero_bubble_ranks(rank: int, world: int, jobs: list, refused: list) -> dict:
    """Each training job (``bodies.train_jobs``), then each refused case (``bodies.bad_input_cases``)."""
    return {"trained": train_jobs(rank, world, jobs), "refused": bad_input_cases(rank, world, refused)}


def _launch(plans: dict, world: int, refused: list = ()) -> dict:
    jobs = [{"plan": _plan(spec, force, world).to_json(), "spec": spec, "forward": True}
            for spec, force, _ in plans.values()]
    per_rank = spawn_ranks(zero_bubble_ranks, world, (jobs, list(refused)), timeout_s=90)
    out = {name: [per_rank[r]["trained"][i] for r in range(world)] for i, name in enumerate(plans)}
    out["refused"] = [per_rank[r]["refused"] for r in range(world)]
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return _launch(PLANS_2, 2)


@pytest.fixture(scope="module")
def four_ranks():
    return _launch(PLANS_4, 4, [("zbv_zero3_recompute", [_refused_plan_json()] * 4, None, GPT_4)])


def _check_zero_bubble(name: str, results: list, plans: dict, world: int) -> None:
    _check(name, results, plans, world)      # one process's training, forward, predicted collectives, dp traffic
    spec, force, (pp, schedule, _, _) = plans[name]
    n = len(_plan(spec, force, world).stages)
    tied_across = stage_rank(schedule, pp, 0) != stage_rank(schedule, pp, n - 1)
    sums = Counter((k[0], k[1]) for k in results[0]["issued"])[("all_reduce", "pp")]
    assert sums == (STEPS if tied_across else 0), (name, sums)     # wte + lm_head: one sum a step


@pytest.mark.parametrize("name", list(PLANS_2))
def test_two_ranks(two_ranks, name):
    _check_zero_bubble(name, two_ranks[name], PLANS_2, 2)


@pytest.mark.parametrize("name", list(PLANS_4))
def test_four_ranks(four_ranks, name):
    _check_zero_bubble(name, four_ranks[name], PLANS_4, 4)


def test_runtime_refuses_on_every_rank(four_ranks):
    errors = [r["zbv_zero3_recompute"] for r in four_ranks["refused"]]
    assert all(e.startswith("ValueError: schedule zbv " + REFUSAL) for e in errors), errors
    assert "ZeRO-3" in errors[0] and "--force recompute=none or schedule=1f1b" in errors[0]


@pytest.mark.parametrize("force,what", [
    ("pp=2,dp=2,mbs=1,zero=3,recompute=full,schedule=zbv", "ZeRO-3"),
    ("pp=2,tp=2,mbs=1,recompute=selective,schedule=interleaved_zb,vpp=2", "tp"),
])
def test_solver_refuses_forced(force, what):
    with pytest.raises(PlanningError, match=REFUSAL) as e:
        _plan(GPT_4, force, 4)
    assert f"their {what} collectives" in str(e.value)


def test_solver_leaves_recompute_out():
    """Recompute free: the solver plans none of the refused combinations."""
    from autopar.plan import split_backward_problem

    p = _plan(GPT_4, REFUSED_FORCE, 4)
    assert p.recompute == "none"
    assert split_backward_problem(p.pipeline_schedule, p.recompute, p.tp, p.context_parallel, p.dp,
                                  p.zero_stage, p.offload) is None
    assert p.pipeline_schedule in EXECUTED_SCHEDULES
    Plan.from_json(_refused_plan_json())                    # a valid plan: the runtime refuses it
