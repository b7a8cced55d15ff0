"""Pipeline parallelism and micro-batches, executed: plans with pp > 1 run on
``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B) and plans with several
micro-batches accumulate gradients over them; over 3 SGD-momentum steps the losses, each step's
gradients and the final parameters equal one process on the whole batch within round-off (bounds
in bodies.py), and each rank carried what the plan says: activations sent on the pp axis once per
micro-batch and stage boundary, tied embeddings summed over pp, dp reductions -- exactly the
collectives ``codegen/expected_pipeline.py`` predicts (pp > 1) or ``codegen/expected.py`` (pp = 1).

One launch per world size runs all its plans in the same ranks."""
from __future__ import annotations

import functools
from collections import Counter

import pytest

from autopar.codegen.expected import expected_collectives
from autopar.codegen.expected_pipeline import expected_pipeline_collectives
from autopar.codegen.program import axis_index
from autopar.cost.hardware import resolve_cluster
from autopar.mesh import TENSOR
from autopar.models import build_model
from autopar.runtime.launch import spawn_ranks
from autopar.solver import plan_model
from autopar.trace import trace_model
from bodies import (BATCH, LLAMA_TINY, full_trace, RTOL_OUT, STEPS, _amax, check_collectives_per_rank,
                    check_training, reference, train_jobs)
from handplans import hand_plan

pytestmark = pytest.mark.slow

GPT_4 = "gpt:hidden=32,layers=4,heads=4,vocab=128,seq=16"       # 4 layers: 2 stages per rank fit

# name: (world, model spec, --force, what the plan must be: (pp, schedule, virtual stages, micro-batches))
PLANS_2 = {
    "pp2_1f1b_tied": ("gpt-tiny", "pp=2,mbs=1,schedule=1f1b", (2, "1f1b", 1, 4)),
    "pp2_gpipe_recompute": ("gpt-tiny", "pp=2,mbs=2,schedule=gpipe,recompute=full", (2, "gpipe", 1, 2)),
    "pp2_interleaved": (GPT_4, "pp=2,mbs=1,schedule=interleaved_1f1b,vpp=2", (2, "interleaved_1f1b", 2, 4)),
    "pp2_llama": (LLAMA_TINY, "pp=2,mbs=2,schedule=1f1b", (2, "1f1b", 1, 2)),
    "pp1_dp2_microbatches": ("gpt-tiny", "pp=1,dp=2,mbs=1,zero=1", (1, "1f1b", 1, 2)),
    "pp1_microbatches_dtensor": ("gpt-tiny", "pp=1,tp=2,mbs=1,recompute=selective", (1, "1f1b", 1, 4)),
}
PLANS_4 = {
    "pp4_1f1b": (GPT_4, "pp=4,mbs=1,schedule=1f1b", (4, "1f1b", 1, 4)),
    "pp4_gpipe_recompute": (GPT_4, "pp=4,mbs=1,schedule=gpipe,recompute=selective", (4, "gpipe", 1, 4)),
    "pp2_dp2_zero2": ("gpt-tiny", "pp=2,dp=2,mbs=1,zero=2", (2, "1f1b", 1, 2)),
    "pp2_dp2_zero3_selective": ("gpt-tiny", "pp=2,dp=2,mbs=1,zero=3,recompute=selective", (2, "1f1b", 1, 2)),
}


# Megatron tensor parallelism inside pipeline stages (hand plans: the solver replicates a model
# this small on the "cpu" cluster, which would leave tp unused): name -> (world, hand_plan kwargs)
MEGATRON = {
    "pp2_tp2_megatron_sp": (4, dict(pp=2, dp=1, tp=2, family="megatron_sp", mbs=2, zero=0)),
    "pp2_dp2_tp2_megatron_zero1": (8, dict(pp=2, dp=2, tp=2, family="megatron", mbs=1, zero=1,
                                           recompute="full")),
}


@functools.lru_cache(maxsize=None)
def _plan(spec: str, force: str, world: int):
    b = build_model(spec, device="cpu", batch=BATCH)
    g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    return plan_model(g, resolve_cluster("cpu", nodes=1, gpus_per_node=world), global_batch=BATCH, seq_len=None,
                      dtype="float32", force=force)


def _launch(plans: dict, world: int) -> dict:
    jobs = [{"plan": _plan(spec, force, world).to_json(), "spec": spec, "forward": True}
            for spec, force, _ in plans.values()]
    per_rank = spawn_ranks(train_jobs, world, (jobs,), timeout_s=90)
    return {name: [per_rank[r][i] for r in range(world)] for i, name in enumerate(plans)}


@pytest.fixture(scope="module")
def two_ranks():
    return _launch(PLANS_2, 2)


@pytest.fixture(scope="module")
def four_ranks():
    return _launch(PLANS_4, 4)


@functools.lru_cache(maxsize=None)
def _reference(spec: str):
    return reference(False, 0, spec)


def _check(name: str, results: list, plans: dict, world: int) -> None:
    spec, force, (pp, schedule, v, m) = plans[name]
    plan = _plan(spec, force, world)
    assert (plan.pp, plan.pipeline_schedule, plan.virtual_stages, plan.num_micro_batches) == (pp, schedule, v, m)
    ref = _reference(spec)
    check_training(results[0], ref, f"{name}: ")
    # pm(inputs) after training: the stages forward one after another (no schedule), full output
    d, bound = _amax(results[0]["out"] - ref["out"]), RTOL_OUT * _amax(ref["out"])
    assert d <= bound, f"{name}: forward output differs by {d:.3e}, bound {bound:.3e}"
    for r, res in enumerate(results):                       # every rank returns the same loss
        assert res["losses"] == results[0]["losses"], (r, res["losses"], results[0]["losses"])
    # every rank issued exactly the predicted collectives: its stages' DTensor edges, ZeRO and the
    # reducer for the parameters they hold, point-to-point sends, tied-parameter sums
    check_collectives_per_rank(results, functools.partial(_predicted, spec, plan), f"{name}: ")
    sent = Counter((k[0], k[1]) for k in results[0]["issued"])
    if pp > 1:
        assert sent[("send", "pp")] > 0
        if spec == "gpt-tiny":                              # tied wte / lm_head: summed over pp each step
            assert sent[("all_reduce", "pp")] == STEPS, sent
    else:
        assert sent[("send", "pp")] == 0
    if plan.dp > 1:                                         # the data-parallel axis carried gradients
        assert Counter(k[1] for k in results[0]["issued"])["dp"] > 0, name


def _predicted(spec: str, plan, res: dict) -> list:
    """What the rank that returned ``res`` should issue per step (``graph``: one micro-batch's trace)."""
    graph = full_trace(BATCH // plan.num_micro_batches, spec)
    if plan.pp == 1:
        ti = axis_index(plan.stage_mesh, TENSOR)
        return expected_collectives(graph, plan, tp_rank=res["coord"][ti] if ti is not None else 0)
    return expected_pipeline_collectives(graph, plan, pp_rank=res["pp_rank"], coord=res["coord"])


@pytest.mark.parametrize("name", list(PLANS_2))
def test_two_ranks(two_ranks, name):
    _check(name, two_ranks[name], PLANS_2, 2)


@pytest.mark.parametrize("name", list(PLANS_4))
def test_four_ranks(four_ranks, name):
    _check(name, four_ranks[name], PLANS_4, 4)


def test_runtime_schedules_are_the_plans_executed_ones():
    from torch.distributed.pipelining import schedules

    from autopar.plan import EXECUTED_SCHEDULES
    from autopar.runtime.pipeline import SCHEDULES

    assert tuple(SCHEDULES) == EXECUTED_SCHEDULES
    assert all(hasattr(schedules, cls) for cls in SCHEDULES.values())


@pytest.mark.parametrize("name", list(MEGATRON))
def test_megatron_inside_pipeline_stages(tiny_bundle, name):
    """pp x tp (x dp): the stages' layers are column/row parallel; each axis carries traffic."""
    world, kw = MEGATRON[name]
    b = tiny_bundle               # planned on the collapsed trace, as autoparallelize does
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                        model_name="gpt-tiny")
    plan = hand_plan(graph, **kw)
    assert (plan.pp, plan.tp, plan.dp) == (kw["pp"], kw["tp"], kw["dp"])
    results = spawn_ranks(train_jobs, world, ([{"plan": plan.to_json()}],), timeout_s=120)
    results = [r[0] for r in results]
    check_training(results[0], _reference("gpt-tiny"), f"{name}: ")
    check_collectives_per_rank(results, functools.partial(_predicted, "gpt-tiny", plan), f"{name}: ")
    sent = Counter(k[1] for k in results[0]["issued"])
    assert sent["pp"] > 0 and sent["tp"] > 0, sent
    if kw["dp"] > 1:
        assert sent["dp"] > 0, sent


# ---- hypothesis-drawn forced plans over pp x dp x tp (4 ranks) -------------------------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@st.composite
def _configs(draw):
    pp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2] if pp == 2 else [1, 2, 4]))
    tp = 4 // (pp * dp)
    per_replica = BATCH // dp
    mbs = draw(st.sampled_from([m for m in (1, 2, 4) if per_replica % m == 0 and per_replica // m >= pp]))
    zero = draw(st.integers(0, 3)) if dp > 1 else 0
    recompute = draw(st.sampled_from(["none", "selective", "full"]))
    family = draw(st.sampled_from(["replicate", "megatron", "megatron_sp"] if tp > 1 else ["megatron"]))
    schedule = draw(st.sampled_from(["gpipe", "1f1b"])) if pp > 1 else None
    return dict(pp=pp, dp=dp, tp=tp, mbs=mbs, zero=zero, recompute=recompute, family=family, schedule=schedule)


@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_configs(), min_size=4, max_size=4, unique_by=lambda c: tuple(sorted(c.items()))))
def test_random_3d_plans(cs):
    """Drawn (pp, dp, tp, micro-batches, ZeRO, recompute, tp family, schedule) on 4 ranks, run in one
    launch: each equals one process (bounds in bodies.py), uses every axis of size > 1 and issues
    exactly the predicted collectives."""
    import torch

    torch.manual_seed(0)
    b = build_model("gpt-tiny", device="cpu", batch=BATCH)
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                        model_name="gpt-tiny")
    plans = [hand_plan(graph, **c) for c in cs]
    per_rank = spawn_ranks(train_jobs, 4, ([{"plan": p.to_json()} for p in plans],), timeout_s=120)
    for i, c in enumerate(cs):
        results = [per_rank[r][i] for r in range(4)]
        try:
            check_training(results[0], _reference("gpt-tiny"))
            check_collectives_per_rank(results, functools.partial(_predicted, "gpt-tiny", plans[i]))
            used = Counter(k[1] for r in results for k in r["issued"])
            for axis in ("pp", "dp") + (("tp",) if c["family"] != "replicate" else ()):
                if c[axis] > 1:
                    assert used[axis] > 0, (axis, used)
        except AssertionError as e:
            raise AssertionError(f"config {c}: {e}") from e
