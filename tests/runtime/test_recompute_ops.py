"""Per-operator recompute (``recompute="ops:attention+mlp_act"``, ``autopar/recompute_ops.py``) on 2
gloo ranks with gpt-tiny (fp32): 3 SGD steps equal the single-process run (bounds of bodies.py) and
issue exactly the predicted collectives (each region's forward collectives again in backward), and
the measured activation memory (``runtime/memory_measure.py``) drops against recompute=none by what
the plan predicts, within 10 %.

One launch runs both: the training jobs (dp=2, tp=2 Megatron) and the memory measurements (dp=2 and
tp=2, recompute none vs ops), so the ranks start once."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.codegen.expected import expected_collectives
from bodies import check_against_reference, check_collectives, reference, train_jobs
from handplans import hand_plan

OPS = "ops:attention+mlp_act"
TRAIN = {"dp": dict(dp=2, tp=1), "tp": dict(dp=1, tp=2, family="megatron")}
MEMORY = {"dp": "dp=2", "tp": "tp=2"}
DROP_TOL = 0.10


def _measure(force: str) -> dict:
    from autopar.api import autoparallelize
    from autopar.models import build_model
    from autopar.runtime.memory_measure import measure_step

    b = build_model("gpt-tiny", device="meta")
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         force=force, seed=0, model_name="gpt-tiny", record_collectives=False)
    x, y = b.make_batch(b.example_inputs[0].shape[0], torch.Generator().manual_seed(0))
    pm.step(x, y)                      # the optimizer state appears
    _, m = measure_step(pm, x, y)
    plan = pm.plan.to_json()
    pm.close()
    return {"plan": plan, "memory": dataclasses.asdict(m)}


def ranks_body(rank: int, world: int, jobs: list, memory: dict) -> dict:
    out = {"train": train_jobs(rank, world, jobs), "memory": {}}
    for name, force in memory.items():
        for rc in ("none", OPS):
            out["memory"][(name, rc)] = _measure(f"{force},recompute={rc}")
    return out


@pytest.fixture(scope="module")
def launched(tiny_full):
    from autopar.runtime.launch import spawn_ranks

    plans = {name: hand_plan(tiny_full, recompute=OPS, **kw) for name, kw in TRAIN.items()}
    jobs = [{"plan": p.to_json()} for p in plans.values()]
    per_rank = spawn_ranks(ranks_body, 2, (jobs, MEMORY), timeout_s=120)
    return plans, per_rank


def test_plan_lists_the_regions(tiny_full):
    """The plan says ops:attention+mlp_act; codegen makes per layer one region of the fused
    attention alone and one of the MLP's up-projection with its gelu, nothing else."""
    from autopar.codegen.program import compile_program

    plan = hand_plan(tiny_full, dp=2, tp=1, recompute=OPS)
    assert plan.recompute == OPS
    regions = compile_program(tiny_full, plan).regions
    by_name = {n.name: n for n in tiny_full.nodes}
    layers = sorted({by_name[r.nodes[0]].layer_id for r in regions})
    assert layers == [0, 1] and len(regions) == 4
    for r in regions:
        targets = [by_name[m].target for m in r.nodes]
        if r.kind == "attention":
            assert targets == ["aten.scaled_dot_product_attention.default"]
        else:
            assert r.kind == "mlp_act" and targets == ["aten.linear.default", "aten.gelu.default"], targets


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAIN))
def test_trains_as_one_process(launched, tiny_full, name):
    plans, per_rank = launched
    i = list(TRAIN).index(name)
    results = [per_rank[r]["train"][i] for r in range(2)]
    check_against_reference(results, reference(False, 0))
    plan = plans[name]
    check_collectives(results, lambda tp_rank: expected_collectives(tiny_full, plan, tp_rank=tp_rank))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMORY))
def test_activation_drop_as_predicted(launched, name):
    from autopar.models import build_model
    from autopar.plan import Plan
    from autopar.runtime.memory_measure import compare_ranks
    from autopar.trace import trace_model

    _, per_rank = launched
    b = build_model("gpt-tiny", device="meta")
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                        model_name="gpt-tiny")
    rows = {}
    for rc in ("none", OPS):
        got = [per_rank[r]["memory"][(name, rc)] for r in range(2)]
        plan = Plan.from_json(got[0]["plan"])
        assert plan.recompute == rc
        rows[rc] = compare_ranks(plan, graph, [g["memory"] for g in got], "float32", "adamw")
    for r in range(2):
        none, ops = rows["none"][r], rows[OPS][r]
        measured = none.measured.category_peaks.activations - ops.measured.category_peaks.activations
        predicted = none.predicted.by_category.activations - ops.predicted.by_category.activations
        assert predicted > 0 and abs(measured - predicted) <= DROP_TOL * predicted, (name, r, measured, predicted)
