"""Training on the emitted modules (``engine="emitted"``, ``autopar/engine.py``, ``codegen/emit.py``):
over 3 SGD-momentum steps the losses, each step's gradients and the final parameters equal one
process within the bounds of ``bodies.py``, and every rank issued exactly the collectives the plan
predicts (``codegen/expected.py``, ``expected_pipeline.py``), as the interpreter does
(``test_families.py``, ``test_pipeline.py``). Each case asserts that the emitted modules really ran
(``pm.engine``, the runners' type): a silent fallback would prove nothing. A plan the emitted code
does not cover (fused kernels, decided per node at run time) falls back under "auto" with the
reason, and raises a one-line error under "emitted" on every rank.

One launch per world size runs all its cases."""
from __future__ import annotations

import functools

import pytest

from autopar.codegen.expected import expected_collectives
from autopar.runtime.launch import spawn_ranks
from bodies import (LLAMA_TINY, check_against_reference, check_collectives, check_collectives_per_rank,
                    check_training, full_trace, reference)
from handplans import hand_plan

pytestmark = pytest.mark.slow

# name: (plan maker (graph -> Plan), job extras, dp_mode for the prediction)
CASES_2 = {
    "tp2_megatron_sp_recompute_full": (lambda g: hand_plan(g, dp=1, tp=2, family="megatron_sp",
                                                           recompute="full"), dict(forward=True), None),
    "dp2_zero3_local_dp": (lambda g: hand_plan(g, dp=2, tp=1, zero=3), dict(meta=True, seed=5), None),
    "tp2_vocab_parallel_loss": (lambda g: hand_plan(g, dp=1, tp=2, family="megatron_vocab"), {}, None),
}
LLAMA_FORCE = "dp=2,zero=1,recompute=full"
PIPELINE_FORCE = "pp=2,dp=2,mbs=1,zero=2,schedule=1f1b"


@functools.lru_cache(maxsize=None)
def _llama_plan():
    from test_pipeline import _plan

    return _plan(LLAMA_TINY, LLAMA_FORCE, 2)


@pytest.fixture(scope="module")
def two_ranks(tiny_full):
    plans = {name: make(tiny_full) for name, (make, _, _) in CASES_2.items()}
    jobs = [dict(plan=plans[name].to_json(), engine="emitted", **extra) for name, (_, extra, _) in CASES_2.items()]
    jobs.append(dict(plan=_llama_plan().to_json(), engine="emitted", spec=LLAMA_TINY, dp_mode="dtensor"))
    from emit_bodies import two_rank_cases

    out = spawn_ranks(two_rank_cases, 2, (jobs,), timeout_s=120)
    names = list(CASES_2) + ["llama_dp2_dtensor_zero1_recompute_full"]
    runs = {name: [out[r]["jobs"][i] for r in range(2)] for i, name in enumerate(names)}
    return runs, plans, [o["gap"] for o in out]


@pytest.fixture(scope="module")
def pipeline_ranks():
    from emit_bodies import engine_jobs
    from test_pipeline import _plan

    plan = _plan("gpt-tiny", PIPELINE_FORCE, 4)
    out = spawn_ranks(engine_jobs, 4, ([dict(plan=plan.to_json(), engine="emitted", forward=True)],),
                      timeout_s=120)
    return [o[0] for o in out], plan


def _assert_emitted(results: list, name: str) -> None:
    for r, res in enumerate(results):
        assert res["engine"] == "emitted" and res["runners"] == ["EmittedRunner"], (name, r, res["engine"],
                                                                                    res["reason"], res["runners"])


@pytest.mark.parametrize("name", list(CASES_2))
def test_emitted_training_two_ranks(two_ranks, tiny_full, name):
    runs, plans, _ = two_ranks
    results, plan = runs[name], plans[name]
    _assert_emitted(results, name)
    extra = CASES_2[name][1]
    check_against_reference(results, reference(extra.get("meta", False), extra.get("seed", 0)))
    check_collectives(results, lambda tp_rank: expected_collectives(tiny_full, plan, tp_rank=tp_rank))


def test_emitted_training_llama(two_ranks):
    from bodies import STEPS

    results = two_ranks[0]["llama_dp2_dtensor_zero1_recompute_full"]
    _assert_emitted(results, "llama")
    plan = _llama_plan()
    assert (plan.dp, plan.tp, plan.zero_stage, plan.recompute) == (2, 1, 1, "full")
    ref = reference(False, 0, LLAMA_TINY)
    check_training(results[0], ref, "llama: ")
    graph = full_trace(plan.global_batch, LLAMA_TINY)
    check_collectives(results, lambda tp_rank: expected_collectives(graph, plan, tp_rank=0, dp_mode="dtensor"))
    assert any(k[1] == "dp" and k[3] == "forward" for k in results[0]["issued"]), "DTensor mode: the loss"
    assert len(results[0]["losses"]) == STEPS


def test_emitted_training_pipeline(pipeline_ranks):
    """pp=2 x dp=2, 1F1B over 4 micro-batches: the stages' and the loss part's emitted modules."""
    from test_pipeline import _predicted

    results, plan = pipeline_ranks
    assert (plan.pp, plan.dp, plan.pipeline_schedule, plan.num_micro_batches) == (2, 2, "1f1b", 2)
    _assert_emitted(results, "pipeline")
    check_against_reference(results[:1], reference(False))
    for res in results:
        assert res["losses"] == results[0]["losses"]
    check_collectives_per_rank(results, functools.partial(_predicted, "gpt-tiny", plan), "pipeline: ")
    assert any(k[0] == "send" for k in results[0]["issued"])


def test_auto_falls_back_and_emitted_refuses(two_ranks):
    """Fused kernels on: "auto" runs the interpreter and says why; "emitted" raises the same
    one-line error on every rank, naming the gap and the way out. (BatchNorm's in-place statistics
    and constant attention masks were gaps until the twentieth session: they run on the emitted
    modules now, ``test_buffers_and_targets.py``, ``tests/trace/test_causal_masks.py``.)"""
    gaps = two_ranks[2]
    for g in gaps:
        assert g["engine"] == "interpreter" and g["runners"] == ["GraphExecutor"], g
        assert "fused kernels" in g["reason"], g["reason"]
        err = g["error"]
        assert err.startswith("EngineError: engine='emitted' cannot run this plan"), err
        assert "fused kernels" in err and "engine='interpreter'" in err and "engine='auto'" in err
        assert "\n" not in err
    assert gaps[0]["error"] == gaps[1]["error"]
