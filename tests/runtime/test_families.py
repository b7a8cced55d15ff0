"""Multi-rank numerics per plan family: over 3 SGD-momentum steps (fp32) the losses, each step's
gradients and the final parameters equal the single-process run within round-off (bounds derived
in bodies.py: step-1 gradients within 2e-5 of each tensor's largest entry; SGD, not Adam, so the
parameters' bound follows from the gradients'), and every rank issued exactly the
collectives the plan predicts (kind, axis, bytes, phase, count).

One launch per world size runs all its families in the same ranks (start-up is the cost)."""
from __future__ import annotations

import dataclasses
import functools

import pytest

from autopar.codegen.expected import expected_collectives
from autopar.runtime.launch import spawn_ranks
from bodies import check_against_reference, full_trace, check_collectives, reference, train_jobs
from handplans import hand_plan

pytestmark = pytest.mark.slow

# name: (world, hand_plan kwargs, job extras)
FAMILIES_2 = {
    "dp": dict(plan=dict(dp=2, tp=1), forward=True),
    "dp_dtensor_mode": dict(plan=dict(dp=2, tp=1, recompute="full"), dp_mode="dtensor", forward=True),
    "zero1_small_buckets": dict(plan=dict(dp=2, tp=1, zero=1), bucket_bytes=64 * 1024),
    "zero2": dict(plan=dict(dp=2, tp=1, zero=2)),
    "zero3_meta_init": dict(plan=dict(dp=2, tp=1, zero=3), meta=True, seed=5),
    "tp": dict(plan=dict(dp=1, tp=2, family="megatron"), forward=True),
    "tp_sp_recompute_full": dict(plan=dict(dp=1, tp=2, family="megatron_sp", recompute="full")),
    "tp_vocab_parallel_loss": dict(plan=dict(dp=1, tp=2, family="megatron_vocab"), forward=True),
    # per-layer recompute (the solver's "partial"): layer 0 of 2 recomputes, layer 1 keeps its activations
    "tp_recompute_first_layer": dict(plan=dict(dp=1, tp=2, family="megatron", recompute="full"), recompute_layers=1),
    # several micro-batches per step: gradients accumulate, the reducer runs once
    "dp_micro_batches_zero2": dict(plan=dict(dp=2, tp=1, zero=2, mbs=1), forward=True),
    "tp_sp_micro_batches_zero0": dict(plan=dict(dp=1, tp=2, family="megatron_sp", mbs=2)),
}
FAMILIES_4 = {
    "dp_x_tp_zero1_recompute_full": dict(plan=dict(dp=2, tp=2, family="megatron", zero=1, recompute="full"),
                                         forward=True),
    "dp_x_tp_sp_zero3_selective_meta": dict(plan=dict(dp=2, tp=2, family="megatron_sp", zero=3,
                                                      recompute="selective"), meta=True, seed=3),
    "dp_x_tp_vocab_parallel_loss": dict(plan=dict(dp=2, tp=2, family="megatron_vocab")),
}


def _jobs(graph, families):
    jobs, plans = [], {}
    for name, spec in families.items():
        plan = hand_plan(graph, **spec["plan"])
        if "recompute_layers" in spec:
            plan = dataclasses.replace(plan, recompute_layers=spec["recompute_layers"])
        plans[name] = plan
        job = {k: v for k, v in spec.items() if k not in ("plan", "recompute_layers")}
        job["plan"] = plan.to_json()
        jobs.append(job)
    return jobs, plans


def _launch(graph, families, world):
    jobs, plans = _jobs(graph, families)
    per_rank = spawn_ranks(train_jobs, world, (jobs,), timeout_s=60)
    return {name: ([per_rank[r][i] for r in range(world)], plans[name], families[name])
            for i, name in enumerate(families)}


@pytest.fixture(scope="module")
def two_ranks(tiny_full):
    return _launch(tiny_full, FAMILIES_2, 2)


@pytest.fixture(scope="module")
def four_ranks(tiny_full):
    return _launch(tiny_full, FAMILIES_4, 4)


@functools.lru_cache(maxsize=None)
def _reference(meta: bool, seed: int):
    return reference(meta, seed)


def _check(name, graph, results, plan, spec):
    check_against_reference(results, _reference(spec.get("meta", False), spec.get("seed", 0)))
    kw = {k: spec[k] for k in ("bucket_bytes", "dp_mode") if k in spec}
    if "recompute_layers" in spec:            # exactly the named layers became recompute regions
        from autopar.codegen.program import compile_program

        regions = compile_program(graph, plan).regions
        by_name = {n.name: n for n in graph.nodes}
        layers = {by_name[m].layer_id for r in regions for m in r.nodes}
        assert layers == set(range(spec["recompute_layers"])), layers
    assert (plan.num_micro_batches > 1) == ("micro_batches" in name), (name, plan.num_micro_batches)
    if plan.num_micro_batches > 1:                 # predicted from one micro-batch's trace
        graph = full_trace(plan.global_batch // plan.num_micro_batches)
    check_collectives(results, lambda tp_rank: expected_collectives(graph, plan, tp_rank=tp_rank, **kw))



@pytest.mark.parametrize("family", list(FAMILIES_2))
def test_two_ranks(family, two_ranks, tiny_full):
    results, plan, spec = two_ranks[family]
    _check(family, tiny_full, results, plan, spec)


@pytest.mark.parametrize("family", list(FAMILIES_4))
def test_four_ranks(family, four_ranks, tiny_full):
    results, plan, spec = four_ranks[family]
    _check(family, tiny_full, results, plan, spec)


def test_families_really_communicate(two_ranks):
    """Guard against a vacuous pass: the dp family reduces over dp, tp over tp, ZeRO-3 gathers."""
    axes = {name: {k[1] for k in res[0][0]["issued"]} for name, res in two_ranks.items()}
    assert axes["dp"] == {"dp"} and axes["dp_dtensor_mode"] == {"dp"} and axes["tp"] == {"tp"}
    kinds = {k[0] for k in two_ranks["zero3_meta_init"][0][0]["issued"]}
    assert {"all_gather", "reduce_scatter"} <= kinds


def test_zero3_gathers_a_layer_per_collective(two_ranks, tiny_full):
    """ZeRO-3's forward gathers one group per collective (``runtime/prefetch.py``): gpt-tiny's 28
    parameter tensors in 5 all-gathers per step -- the position embedding, each of the 2 layers,
    the final norm, and the tied token embedding alone (the embedding and the head both read it) --
    moving what one gather per tensor moves: each tensor's rows padded to 2 equal chunks, fp32."""
    import math

    from bodies import STEPS

    shapes = {n.param_name: n.out.shape for n in tiny_full.nodes if n.kind == "param"}
    assert len(shapes) == 28
    padded = sum(2 * math.ceil(s[0] / 2) * math.prod(s[1:]) * 4 for s in shapes.values())
    for res in two_ranks["zero3_meta_init"][0]:
        fwd = [k for k in res["issued"] if k[:2] == ("all_gather", "dp") and k[3] == "forward"]
        assert len(fwd) == 5 * STEPS, fwd
        assert sum(k[2] for k in fwd) == padded * STEPS


def test_zero3_backward_prefetches_the_next_group(two_ranks):
    """ZeRO-3's backward re-gathers a group's saved weights in one collective and starts the next
    group's before the layer's backward runs (``runtime/reshard.Reshard._regather``): each step's
    first re-gather is waited for, every later one was prefetched, none was started for nothing.
    (The losses and gradients equal one process's: ``test_family``.)"""
    from bodies import STEPS

    for res in two_ranks["zero3_meta_init"][0]:
        regathered, prefetched, dropped = res["regathers"]
        assert regathered > STEPS and prefetched == regathered - STEPS and dropped == 0, res["regathers"]


def test_vocab_parallel_loss_keeps_logits_sharded(two_ranks, four_ranks, tiny_full):
    """The vocab-parallel cross-entropy (loss_parallel) all-reduces one value per row three times
    on tp (row max, sum-exp, target logit) and never gathers the logits; with dp it all-reduces the
    4-byte target count forward instead of DTensor's backward total_weight. The tied embedding
    looks up its vocab rows locally (a Partial output): no weight is ever gathered."""
    from bodies import STEPS

    logits = next(n for n in tiny_full.nodes if n.target == "aten.cross_entropy_loss.default").inputs[0]
    rows, vocab = next(n for n in tiny_full.nodes if n.key == logits.key).out.shape
    for family, dp in (("tp_vocab_parallel_loss", 1), ("dp_x_tp_vocab_parallel_loss", 2)):
        results = (two_ranks if dp == 1 else four_ranks)[family][0]
        assert not results[0]["fallbacks"] or results[0]["fallbacks"] == ["aten.scaled_dot_product_attention.default"]
        for res in results:
            issued = res["issued"]
            assert issued.count(("all_reduce", "tp", rows // dp * 4, "forward")) == 3 * STEPS, family
            gathers = [k for k in issued if k[0] == "all_gather"]      # nothing is gathered
            assert gathers == [], (family, gathers)
            if dp > 1:
                assert issued.count(("all_reduce", "dp", 4, "forward")) == 2 * STEPS, family   # count + the loss
