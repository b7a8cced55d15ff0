"""The solver's pipeline choices: schedule, virtual stages and uneven stage cuts (golden cases),
the bubble it predicts against the hand formula, forced schedules and their errors."""
import json

import pytest

from autopar.cost import make_cluster
from autopar.cost.flops import pipeline_bubble_fraction
from autopar.plan import EXECUTED_SCHEDULES, Plan, stage_rank
from autopar.report import render
from autopar.solver import PlanningError, plan_model

from solver_helpers import traced

MODEL = "gpt:hidden=1024,layers=16,heads=16,vocab=8192,seq=1024"
CLUSTER = make_cluster("h100", 1)
PIN = "tp=1,pp=4,dp=2,mbs=1,zero=1,recompute=none"          # m = 8 / 2 / 1 = 4 micro-batches = pp


def _plan(force=PIN, batch=8, budget=None, model=MODEL):
    g, _ = traced(model)
    return plan_model(g, CLUSTER, global_batch=batch, seq_len=1024, force=force, memory_budget_bytes=budget)


def _rank_times(plan):
    times = {}
    for s in plan.stages:
        r = stage_rank(plan.pipeline_schedule, plan.pp, s.index)
        times[r] = times.get(r, 0.0) + s.time_per_microbatch_s
    return times


def test_interleaving_wins_with_few_micro_batches_and_ample_memory():
    # free: the zero-bubble interleaved schedule (its split backward costs nothing on an
    # uncalibrated GPU, whose per-node host overhead is 0: tests/solver/test_zero_bubble_choice.py)
    plan = _plan()
    assert plan.num_micro_batches == plan.pp == 4
    assert plan.pipeline_schedule == "interleaved_zb" and plan.virtual_stages > 1
    assert plan.pipeline_schedule in EXECUTED_SCHEDULES       # a free plan is one the runtime runs
    assert len(plan.stages) == plan.pp * plan.virtual_stages
    inter = _plan(PIN + ",schedule=interleaved_1f1b")
    assert inter.virtual_stages > 1
    one = _plan(PIN + ",schedule=1f1b")
    assert plan.step_time.total_s < inter.step_time.total_s < one.step_time.total_s
    assert plan.step_time.bubble_s < inter.step_time.bubble_s < one.step_time.bubble_s


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b", "interleaved_zb", "zbv"])
def test_predicted_bubble_is_the_hand_formula(schedule):
    plan = _plan(PIN + f",schedule={schedule}")
    assert plan.pipeline_schedule == schedule
    t_max = max(_rank_times(plan).values())                 # the slowest rank, all its stages
    m, p, v = plan.num_micro_batches, plan.pp, plan.virtual_stages
    hand = {"1f1b": (p - 1) / m, "gpipe": (p - 1) / m, "interleaved_1f1b": (p - 1) / (v * m),
            "interleaved_zb": (p - 1) / (3 * v * m), "zbv": (p - 1 + max(0, 2 * p - 1 - m)) / (6 * m)}[schedule]
    assert pipeline_bubble_fraction(p, m, schedule, v) == pytest.approx(hand)
    assert plan.step_time.bubble_s == pytest.approx(hand * m * t_max, rel=1e-9)


def test_one_f_one_b_wins_when_memory_binds():
    ample = _plan()
    budget = 1.4e9           # bf16 under autocast: fp32 states and residual stream, 16-bit matmul copies
    assert ample.memory.total_bytes > budget
    plan = _plan(budget=budget)
    assert plan.pipeline_schedule == "1f1b" and plan.virtual_stages == 1
    assert plan.memory.total_bytes <= budget
    for schedule in ("interleaved_1f1b", "interleaved_zb", "zbv"):      # none of these fits (without offload)
        with pytest.raises(Exception, match="needs >="):
            _plan(PIN + f",schedule={schedule},offload=none", budget=budget)
    # the memory-aware cut: rank 0 holds 4 micro-batches and the embedding, so fewer layers than rank 2
    n = [s.last_layer - s.first_layer for s in plan.stages]
    assert sum(n) == 16 and n[0] < n[2]


def test_heavy_head_gets_fewer_layers():
    """A 128k vocabulary: the head's logits and loss outweigh several layers, so its stage holds fewer."""
    plan = _plan("tp=1,pp=4,dp=2,mbs=1,zero=1,recompute=none,schedule=1f1b", batch=16,
                 model="gpt:hidden=1024,layers=16,heads=16,vocab=131072,seq=1024")
    n = [s.last_layer - s.first_layer for s in plan.stages]
    assert sum(n) == 16 and min(n) >= 1
    assert n[-1] < n[1] and n[-1] < n[2]
    assert [s.first_layer for s in plan.stages[1:]] == [s.last_layer for s in plan.stages[:-1]]


@pytest.mark.parametrize("force,schedule,v", [
    ("schedule=interleaved_1f1b,vpp=4", "interleaved_1f1b", 4),
    ("schedule=interleaved_zb,vpp=2", "interleaved_zb", 2),
    ("schedule=zbv", "zbv", 2),
    ("schedule=gpipe", "gpipe", 1),
])
def test_forced_schedules_are_honoured(force, schedule, v):
    plan = _plan(PIN + "," + force)
    assert (plan.pipeline_schedule, plan.virtual_stages) == (schedule, v)
    assert len(plan.stages) == 4 * v and dict(plan.forced)["schedule"] == schedule
    ranks = [stage_rank(schedule, 4, s.index) for s in plan.stages]
    assert sorted(ranks) == sorted(list(range(4)) * v)
    if schedule == "zbv":
        assert ranks == [0, 1, 2, 3, 3, 2, 1, 0]
    back = Plan.from_json(plan.to_json())                      # the new fields round-trip
    assert back == plan and back.summary()["pipeline_schedule"] == schedule


def test_dualpipev_forced():
    plan = _plan(PIN + ",schedule=dualpipev", batch=16)          # m = 8 = 2 pp
    assert (plan.pipeline_schedule, plan.virtual_stages, len(plan.stages)) == ("dualpipev", 2, 8)


@pytest.mark.parametrize("force,words", [
    ("tp=1,pp=1,dp=8,schedule=zbv", "needs a pipeline (pp > 1)"),
    (PIN + ",schedule=1f1b,vpp=2", "one stage per rank"),
    (PIN + ",schedule=zbv,vpp=4", "exactly 2 stages per rank"),
    (PIN + ",schedule=interleaved_1f1b,vpp=1", "vpp >= 2"),
    (PIN + ",schedule=interleaved_1f1b,vpp=8", "needs 32 stages of >= 1 layer but the model has 16 layers"),
    (PIN + ",schedule=dualpipev", "needs >= 2 * pp = 8 micro-batches"),
    ("tp=1,pp=32", "pp=32 needs >= 32 layers"),
])
def test_bad_forced_schedules_say_what_to_change(force, words):
    g, _ = traced(MODEL)
    cluster = make_cluster("h100", 4) if "pp=32" in force else CLUSTER
    with pytest.raises((PlanningError, ValueError)) as e:
        plan_model(g, cluster, global_batch=64 if "pp=32" in force else 8, seq_len=1024, force=force)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bad_schedule_name():
    with pytest.raises(ValueError, match="choose one of gpipe, 1f1b"):
        _plan(PIN + ",schedule=zb2p")


@pytest.mark.parametrize("edit,words", [
    (lambda d: d.update(pipeline_schedule="zb2p"), "pipeline_schedule='zb2p' is not one of"),
    (lambda d: d.update(virtual_stages=4), "8 stages listed for pp=4 x virtual_stages=4 = 16"),
    (lambda d: d.update(pipeline_schedule="zbv", virtual_stages=4), "exactly 2 stages per rank"),
    (lambda d: d["stages"][1].update(first_layer=d["stages"][1]["first_layer"] + 1), "contiguously"),
    (lambda d: d["stages"][0].update(has_head=True), "the embedding is on stages"),
    (lambda d: d["summary"].update(pipeline_schedule="1f1b"), "summary disagrees with its fields on pipeline_schedule"),
])
def test_plan_file_pipeline_fields_checked(edit, words):
    d = json.loads(_plan(PIN + ",schedule=interleaved_zb,vpp=2").to_json())
    edit(d)
    with pytest.raises(ValueError) as e:
        Plan.from_dict(d)
    assert words in str(e.value)


def test_old_plan_files_without_the_fields_load():
    d = json.loads(_plan("tp=1,pp=1,dp=8").to_json())
    for k in ("pipeline_schedule", "virtual_stages"):
        d.pop(k)
        d["summary"].pop(k)
    p = Plan.from_dict(d)
    assert (p.pipeline_schedule, p.virtual_stages) == ("1f1b", 1)


def test_report_shows_schedule_and_stage_ranks():
    from rich.console import Console
    plan = _plan(PIN + ",schedule=zbv")
    con = Console(record=True, width=200)
    render(plan, con)
    text = con.export_text()
    assert "zbv" in text and "pp rank" in text and "Pipeline stages (zbv, 2 per rank)" in text
