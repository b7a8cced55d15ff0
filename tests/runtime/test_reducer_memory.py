"""The data-parallel gradient path (``runtime/reducer.py``) keeps what the plan's memory model says,
with many buckets (small ``bucket_bytes``), so that buckets are launched during the backward.

- Numerics: ZeRO-3 with full recompute (every layer's parameters are read in a recompute region,
  which replays in the backward; the tied embedding / head is read twice) and ZeRO 0/1 with
  several micro-batches equal the one-process run, and issue the predicted collectives.
- Memory, measured by ``memory_measure.measure_step`` on 2 gloo ranks (ZeRO-3's full summands
  count as gradients from their first accumulation):
  ZeRO-0 keeps one copy of the gradients, every ``.grad`` a view of its bucket's buffer; ZeRO-1
  reduce-scatters as ZeRO-2 (one copy at most, rows after the step); ZeRO-3 launches its buckets in
  the backward and keeps near grads / dp; ZeRO 2/3 with several micro-batches reduce-scatter each
  one's gradients and stay near grads / dp (not one full copy accumulated over the micro-batches).
"""
from __future__ import annotations

import contextlib

import pytest

from autopar.codegen.expected import expected_collectives
from autopar.runtime.launch import spawn_ranks
from bodies import (BATCH, batches, build, check_against_reference, check_collectives, full_trace, reference, sgd,
                    train_jobs)
from handplans import hand_plan

pytestmark = pytest.mark.slow

SMALL = 16 * 1024                 # bytes per bucket: gpt-tiny's 0.45 MiB of gradients in ~30 buckets

NUMERICS = {
    "zero3_recompute_full": dict(plan=dict(dp=2, tp=1, zero=3, recompute="full")),
    "zero0_micro_batches": dict(plan=dict(dp=2, tp=1, zero=0, mbs=1)),
    "zero1_micro_batches_recompute": dict(plan=dict(dp=2, tp=1, zero=1, mbs=1, recompute="full"),
                                          dp_mode="dtensor"),
    "zero2_micro_batches": dict(plan=dict(dp=2, tp=1, zero=2, mbs=1)),
    "zero3_micro_batches": dict(plan=dict(dp=2, tp=1, zero=3, mbs=1)),
}
MEMORY = {
    "zero0": dict(dp=2, tp=1, zero=0),
    "zero1_micro_batches": dict(dp=2, tp=1, zero=1, mbs=1),
    "zero3_recompute_full": dict(dp=2, tp=1, zero=3, recompute="full"),
    "zero2_micro_batches": dict(dp=2, tp=1, zero=2, mbs=1),
    "zero3_micro_batches": dict(dp=2, tp=1, zero=3, mbs=1),
}


@contextlib.contextmanager
def launches(pm):
    """Yields a one-element list: the most buckets the reducer had launched when a gradient
    arrived (after the reducer's own hook; ZeRO-3: after its ``on_full_grad``), i.e. the buckets
    launched while the backward still ran. Hooks removed on exit."""
    reducer, ctx = pm.reducer, pm.store.ctx
    launched = [0]

    def seen(*_):
        launched[0] = max(launched[0], reducer._next)

    hooks = [s.local.register_post_accumulate_grad_hook(seen) for s in pm.store.slots]
    chained = ctx.on_full_grad
    if chained is not None:
        ctx.on_full_grad = lambda slot: (chained(slot), seen())
    try:
        yield launched
    finally:
        ctx.on_full_grad = chained
        for h in hooks:
            h.remove()


def measure_grads(pm, x, y) -> dict:
    """``memory_measure.measure_step`` of one step, ZeRO-3's summands counted as gradients from
    their first accumulation; the gradients' largest live total and how the reducer ran."""
    from autopar.runtime.memory_measure import measure_step

    slots = pm.store.slots
    with launches(pm) as launched:
        _, m = measure_step(pm, x, y)
    grads = [s.local.grad for s in slots if s.local.grad is not None]
    return {"grads_peak": m.category_peaks.grads, "grad_bytes": sum(s.layout.nbytes for s in slots),
            "largest": max(s.layout.nbytes for s in slots), "buckets": len(pm.reducer.buckets),
            "launched_in_backward": launched[0],
            "grad_storages": len({g.untyped_storage().data_ptr() for g in grads})}


def memory_jobs(rank: int, world: int, plans: dict) -> dict:
    from autopar.api import autoparallelize
    from autopar.plan import Plan

    out = {}
    for name, plan in plans.items():
        b = build(False)
        data = batches(b, 2)
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             optimizer=sgd, plan=Plan.from_json(plan), bucket_bytes=SMALL, timeout_s=30,
                             record_collectives=False)
        pm.step(*data[0])
        out[name] = measure_grads(pm, *data[1])
    return out


@pytest.fixture(scope="module")
def numerics(tiny_full):
    plans, jobs = {}, []
    for name, spec in NUMERICS.items():
        plans[name] = hand_plan(tiny_full, **spec["plan"])
        jobs.append({**{k: v for k, v in spec.items() if k != "plan"}, "plan": plans[name].to_json(),
                     "bucket_bytes": SMALL})
    per_rank = spawn_ranks(train_jobs, 2, (jobs,), timeout_s=60)
    return {name: ([per_rank[r][i] for r in range(2)], plans[name]) for i, name in enumerate(NUMERICS)}


@pytest.fixture(scope="module")
def memory(tiny_full):
    plans = {name: hand_plan(tiny_full, **spec).to_json() for name, spec in MEMORY.items()}
    return spawn_ranks(memory_jobs, 2, (plans,), timeout_s=60)


@pytest.mark.parametrize("family", list(NUMERICS))
def test_numerics_with_early_launches(family, numerics, tiny_full):
    results, plan = numerics[family]
    check_against_reference(results, reference(False, 0))
    graph = tiny_full if plan.num_micro_batches == 1 else full_trace(plan.global_batch // plan.num_micro_batches)
    kw = {"bucket_bytes": SMALL, **({"dp_mode": "dtensor"} if "dp_mode" in NUMERICS[family] else {})}
    check_collectives(results, lambda tp_rank: expected_collectives(graph, plan, tp_rank=tp_rank, **kw))


def test_zero0_gradients_live_in_buckets(memory):
    """One copy of the gradients: each bucket's buffer holds its parameters' ``.grad`` (views),
    reduced in place; every bucket was launched during the (last) backward."""
    for rank, m in enumerate(memory):
        got = m["zero0"]
        assert got["grad_storages"] == got["buckets"] > 10, (rank, got)
        assert got["launched_in_backward"] == got["buckets"], (rank, got)
        assert got["grads_peak"] <= 1.01 * got["grad_bytes"], (rank, got)


def test_zero1_reduce_scatters(memory):
    """ZeRO-1 reduce-scatters its buckets as ZeRO-2 does (each rank's optimizer needs its rows
    only): every bucket launched during the last backward, at most one copy of the gradients (each
    summand dropped once copied into its bucket's send buffer), and after the step no rank holds a
    full gradient, only its rows."""
    for rank, m in enumerate(memory):
        got = m["zero1_micro_batches"]
        assert got["launched_in_backward"] == got["buckets"] > 10, (rank, got)
        assert got["grads_peak"] <= 1.01 * got["grad_bytes"], (rank, got)
        assert got["grad_storages"] == 0, (rank, got)


def test_zero3_reduces_during_backward(memory):
    """ZeRO-3 reduce-scatters each bucket as its summands complete (every parameter of gpt-tiny is
    complete before the backward ends, recompute regions and the tied embedding included): the
    gradients stay near grads / dp, plus the summands of the buckets under way (measured: grads /
    dp + 64 KiB, one embedding-sized parameter; before, grads / dp + every full summand)."""
    for rank, m in enumerate(memory):
        got = m["zero3_recompute_full"]
        assert got["launched_in_backward"] == got["buckets"] > 10, (rank, got)
        assert got["grads_peak"] <= got["grad_bytes"] / 2 + 2 * got["largest"], (rank, got)


@pytest.mark.parametrize("family", ["zero2_micro_batches", "zero3_micro_batches"])
def test_zero23_stay_sharded_over_micro_batches(family, memory):
    """ZeRO 2/3 with m > 1 reduce-scatter every micro-batch's buckets during its backward and add
    the rows to each rank's 1/dp gradient: the gradients never reach a full copy (the runtime
    accumulated one before, over the micro-batches: measured 0.64 x grad_bytes here, grads / dp +
    65 KiB), and after the step no ZeRO-2 rank holds a full one (ZeRO-3's parameters are the rows)."""
    for rank, m in enumerate(memory):
        got = m[family]
        assert got["launched_in_backward"] == got["buckets"] > 10, (rank, got)
        assert got["grads_peak"] <= got["grad_bytes"] / 2 + 2 * got["largest"], (rank, got)
        if family.startswith("zero2"):
            assert got["grad_storages"] == 0, (rank, got)


GPT_4 = "gpt:hidden=64,layers=4,heads=4,vocab=256,seq=32"      # 4 layers: ZBV's 2 stages per rank fit


def pipeline_launch_jobs(rank: int, world: int, plans: dict) -> dict:
    """Per plan: the buckets launched while gradients still arrived (the stages' last backwards)
    and the buckets in all, on this rank."""
    from autopar.api import autoparallelize
    from autopar.plan import Plan

    out = {}
    for name, plan in plans.items():
        b = build(False, GPT_4)
        data = batches(b, 2)
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             optimizer=sgd, plan=Plan.from_json(plan), bucket_bytes=SMALL, timeout_s=30,
                             record_collectives=False)
        losses = []
        with launches(pm) as launched:
            for x, y in data[:2]:
                launched[0] = 0
                losses.append(pm.step(x, y))
        out[name] = {"launched_in_backward": launched[0], "buckets": len(pm.reducer.buckets), "losses": losses}
    return out


PIPELINE_CASES = (("1f1b", 0), ("1f1b", 3), ("zbv", 1), ("zbv", 3))


@pytest.fixture(scope="module")
def pipeline_launches():
    """ZeRO 0 and 3 under 1F1B, ZeRO 1 and 3 under ZBV (its weight pass runs the gradient
    hooks; ZeRO 0 and 1 share them) on pp=2 x dp=2 (4 ranks, one spawn)."""
    from autopar.trace import trace_model

    b = build(False, GPT_4, BATCH)
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                        model_name=GPT_4)
    plans = {(schedule, z): hand_plan(graph, dp=2, tp=1, pp=2, mbs=1, zero=z, schedule=schedule).to_json()
             for schedule, z in PIPELINE_CASES}
    names = list(plans)
    per_rank = spawn_ranks(pipeline_launch_jobs, 4, ({str(i): plans[k] for i, k in enumerate(names)},),
                           timeout_s=180)
    return [{names[int(i)]: g for i, g in got.items()} for got in per_rank]


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipeline_stages_reduce_during_their_last_backward(schedule, pipeline_launches):
    """Under a pipeline each stage's last backward (ZBV: its last weight pass) launches the buckets
    of the parameters only it reads (ZeRO-3: once every micro-batch's scopes ran their backward),
    beside the backwards still to run, as the plan prices the gradient reduction
    (``solver/overlap.dp_sync``: overlapped with the last micro-batch's backward); only the buckets
    from the first one holding the tied embedding (summed over pp after the schedule) on wait for
    the reduction after it. Numerics and collectives of pipelined dp: ``test_pipeline.py``."""
    for rank, got in enumerate(pipeline_launches):
        cases = [c for c in PIPELINE_CASES if c[0] == schedule]
        for case in cases:
            g = got[case]
            assert g["buckets"] > 4 and g["launched_in_backward"] >= g["buckets"] - 2, (case, rank, g)
            # the second step's loss follows the first update: the early reductions fed the step
            # (each ZeRO stage updates the same model; fp32 sums in other orders: round-off only)
            assert g["losses"] == pytest.approx(got[cases[0]]["losses"], rel=1e-5), (case, rank)
