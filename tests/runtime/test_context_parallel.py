"""Context parallelism executed (``codegen/context_run.py``, ``codegen/context_attention.py``):
plans that split every sequence over cp ranks train on gloo ranks as one process trains the same
model -- losses, each step's gradients and the final parameters within the fp32 round-off bounds
of ``bodies.py`` (3 SGD-momentum steps), the forward output reassembled -- and every rank issued
exactly the predicted collectives, ring or Ulysses traffic on the "cp" axis included.

Every case trains on the emitted modules (``codegen/emit.py``), ring cp=2 on the interpreter too.
Cases: ring cp=2 and cp=4 (gpt-tiny, causal, learned positions: ``arange`` replaced by each rank's
zig-zag positions), ring cp=2 with zig-zag pieces of 3 tokens, ring cp=2 with every layer recomputed (the ring re-runs in the backward),
Ulysses cp=2 (LLaMA: RoPE tables sliced by the rank's positions), ring cp=2 x Megatron tp=2 (the
ring carries each rank's heads), Ulysses cp=2 x Megatron tp=2 with sequence parallelism, dp=2 x ring cp=2 with ZeRO-1 (gradients reduced over the
four dp x cp ranks), and pipelines: pp=2 x cp=2, dp=2 x cp=2 x pp=2 (stages fold their micro-
batches; the first stage replaces the positions). One launch per world size."""
from __future__ import annotations

import functools

import pytest
import torch

from autopar.codegen.expected import expected_collectives
from autopar.codegen.expected_pipeline import expected_pipeline_collectives
from autopar.runtime.launch import spawn_ranks
from bodies import (BATCH, LLAMA_TINY, build, check_against_reference, check_collectives,
                    check_collectives_per_rank, reference, train_jobs)
from handplans import hand_plan

pytestmark = pytest.mark.slow

GPT_ODD = "gpt:hidden=32,layers=2,heads=4,vocab=128,seq=12"

# name: (world, hand_plan kwargs, job extras)
CASES_2 = {
    "ring": dict(plan=dict(dp=1, tp=1, cp=2, cp_mode="ring"), forward=True),
    # the emitted modules run every case (``emit.py``: ``context_attention`` / ``context_positions``);
    # the interpreter's ContextRun path once
    "ring_interpreter": dict(plan=dict(dp=1, tp=1, cp=2, cp_mode="ring"), forward=True, engine="interpreter"),
    "ring_recompute_full": dict(plan=dict(dp=1, tp=1, cp=2, cp_mode="ring", recompute="full")),
    "ulysses_llama_rope": dict(plan=dict(dp=1, tp=1, cp=2, cp_mode="ulysses"), spec=LLAMA_TINY, forward=True),
    # odd pieces: 12 tokens in 4 zig-zag pieces of 3 (bidirectional attention is the engine tests':
    # a BERT's key-bias gradient is zero in exact arithmetic, so any run differs from another by
    # pure round-off there, which the per-tensor relative bounds cannot take)
    "ring_odd_pieces": dict(plan=dict(dp=1, tp=1, cp=2, cp_mode="ring"), spec=GPT_ODD, forward=True),
}
CASES_4 = {
    "ring_cp4": dict(plan=dict(dp=1, tp=1, cp=4, cp_mode="ring"), forward=True),
    "pp2_x_ring": dict(plan=dict(dp=1, tp=1, pp=2, cp=2, cp_mode="ring", mbs=1), forward=True),
    "ring_x_tp_megatron": dict(plan=dict(dp=1, tp=2, cp=2, cp_mode="ring", family="megatron"), forward=True),
    # sequence parallel on tp splits each rank's chunk once more between attention blocks
    "ulysses_x_tp_megatron_sp": dict(plan=dict(dp=1, tp=2, cp=2, cp_mode="ulysses", family="megatron_sp")),
    "dp_x_ring_zero1": dict(plan=dict(dp=2, tp=1, cp=2, cp_mode="ring", zero=1)),
}
# the composition: data x context x pipeline parallel (8 ranks)
CASES_8 = {
    "dp2_x_ring_x_pp2": dict(plan=dict(dp=2, tp=1, pp=2, cp=2, cp_mode="ring", mbs=1)),
}


@functools.lru_cache(maxsize=None)
def _trace(spec: str, folded_by: tuple = (), rows: int = BATCH, collapse: bool = False):
    """``spec`` traced at ``rows`` (every layer, or each repeated block once: ``collapse``, how
    plans are made); ``folded_by`` (dp, cp): at the folded batch the runtime runs (each
    sequence's zig-zag chunks as rows)."""
    from autopar.codegen.context_attention import fold
    from autopar.trace import trace_model

    b = build(False, spec, rows)
    xs, y = b.example_inputs, b.example_target
    if folded_by:
        dp, cp = folded_by
        xs = tuple(fold(x, dp=dp, n=cp, seq_dim=1, order="zigzag") for x in xs)
        y = fold(y, dp=dp, n=cp, seq_dim=1, order="zigzag")
    return trace_model(b.module, xs, loss_fn=b.loss_fn, example_target=y, collapse_repeats=collapse,
                       model_name=spec)


def _launch(cases: dict, world: int) -> dict:
    jobs, plans = [], {}
    for name, spec in cases.items():
        plans[name] = hand_plan(_trace(spec.get("spec", "gpt-tiny"), collapse=True), **spec["plan"])
        job = {k: v for k, v in spec.items() if k != "plan"}
        job["plan"] = plans[name].to_json()
        jobs.append(job)
    per_rank = spawn_ranks(train_jobs, world, (jobs,), timeout_s=90)
    return {name: ([per_rank[r][i] for r in range(world)], plans[name], cases[name])
            for i, name in enumerate(cases)}


@pytest.fixture(scope="module")
def two_ranks():
    return _launch(CASES_2, 2)


@pytest.fixture(scope="module")
def four_ranks():
    return _launch(CASES_4, 4)


@pytest.fixture(scope="module")
def eight_ranks():
    return _launch(CASES_8, 8)


@functools.lru_cache(maxsize=None)
def _reference(spec: str):
    return reference(False, 0, spec)


def _check(results, plan, spec):
    model = spec.get("spec", "gpt-tiny")
    assert plan.context_parallel > 1 and plan.mesh.size_of("cp") == plan.context_parallel
    check_against_reference(results, _reference(model))
    folded = _trace(model, (plan.dp, plan.context_parallel), BATCH // plan.num_micro_batches)
    if plan.pp == 1:
        check_collectives(results, lambda tp_rank: expected_collectives(folded, plan, tp_rank=tp_rank))
    else:
        check_collectives_per_rank(results, lambda res: expected_pipeline_collectives(
            folded, plan, pp_rank=res["pp_rank"], coord=res["coord"]))
    for res in results:                # the cp axis really carried attention's exchange
        assert any(k[1] == "cp" and k[0] == "all_to_all" for k in res["issued"]), res["issued"][:5]
        assert res["engine"] == spec.get("engine", "emitted"), (res["engine"], res["reason"])


@pytest.mark.parametrize("case", list(CASES_2))
def test_two_ranks(case, two_ranks):
    _check(*two_ranks[case])


@pytest.mark.parametrize("case", list(CASES_4))
def test_four_ranks(case, four_ranks):
    _check(*four_ranks[case])


@pytest.mark.parametrize("case", list(CASES_8))
def test_eight_ranks(case, eight_ranks):
    _check(*eight_ranks[case])


def test_axes_carry_their_traffic(two_ranks, four_ranks):
    """Ring sends K|V blocks (all_to_all, one per rotation); Ulysses trades heads (two
    all_to_alls forward); tp all-reduces its row-parallel outputs; dp x cp reduces gradients."""
    from bodies import STEPS

    ring = [k for k in two_ranks["ring"][0][0]["issued"] if k[1] == "cp"]
    layers = 2
    # per layer and step: 1 rotation forward (cp - 1), 3 backward (K|V once, dK|dV twice)
    assert sum(k[3] == "forward" for k in ring) == layers * STEPS
    assert sum(k[3] == "backward" for k in ring) == 3 * layers * STEPS
    uly = [k for k in two_ranks["ulysses_llama_rope"][0][0]["issued"] if k[1] == "cp"]
    assert sum(k[3] == "forward" for k in uly) == 2 * layers * STEPS
    axes = {k[1] for k in four_ranks["ring_x_tp_megatron"][0][0]["issued"]}
    assert {"cp", "tp"} <= axes
    dp = [k for k in four_ranks["dp_x_ring_zero1"][0][0]["issued"] if k[1] == "dp"]
    assert {k[0] for k in dp if k[3] == "step"} == {"reduce_scatter", "all_gather"}  # ZeRO-1: buckets, then params


def _hf_train(rank: int, world: int, force: str) -> dict:
    from autopar.api import autoparallelize
    from autopar.models.data import lm_loss
    import test_hf_models as hf

    out = {}
    for which in ("llama", "gpt2"):
        torch.manual_seed(0)
        data = hf._batches()
        pm = autoparallelize(hf.BUILDERS[which](), (data[0],), loss_fn=lm_loss, example_target=data[0],
                             force=force, optimizer=hf._sgd, kernels="off", timeout_s=60)
        out[which] = {"losses": [pm.step((t,), t) for t in data],
                      "axes": sorted({(c.kind, c.axis) for c in pm.collectives})}
    return out


def test_huggingface_models_split_their_sequences():
    """HF LLaMA (rotary positions from ``arange``, its causal mask folded to is_causal) and HF GPT-2
    (learned positions; Conv1D flattens batch x sequence and back) plan and train with ring cp=2
    as one process trains them."""
    hf = pytest.importorskip("test_hf_models")
    from autopar.models.data import lm_loss
    from bodies import RTOL_LOSS
    from one_process import one_process_losses

    res = spawn_ranks(_hf_train, 2, ("cp=2,cpmode=ring,tp=1,pp=1",), timeout_s=120)
    for which in ("llama", "gpt2"):
        torch.manual_seed(0)
        ref = one_process_losses(hf.BUILDERS[which](), hf._batches(), lm_loss, hf._sgd,
                                 forward=lambda m, t: m(t).logits)
        for r in res:
            got = r[which]["losses"]
            assert all(abs(a - b) <= RTOL_LOSS * abs(b) for a, b in zip(got, ref)), (which, got, ref)
            assert ("all_to_all", "cp") in {tuple(k) for k in r[which]["axes"]}
