"""Fuzzed models through plan + run (``tests/fuzz_models.py``): random small models (linears,
norms, residuals, attention, embeddings, convs, activations, odd sizes) under random forced plans
(dp x tp x pp, ZeRO, recompute, micro-batches) on 2 and 4 gloo ranks. Every case must match one
process within ``bodies.py``'s bounds, or stop with a clear error (one autopar raises on purpose,
on every rank); a traceback from torch, a wrong number, a plan that is not the forced one, or an
axis whose traffic contradicts the plan fails. tp plans are made for the free-links cluster
(``fast_links_cluster``) so that tensor parallelism really splits tensors.

The hypothesis tests draw one batch of cases per world size (derandomized: the same cases on every
run) and run them in one launch; ``benchmarks/fuzz.py`` runs more. Below them, the cases the
fuzzer found, each once a bug, now regression tests.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from fuzz_models import case_shape, cases, fast_links_cluster
from fuzz_runs import run_cases

pytestmark = pytest.mark.slow

_FUZZ = settings(max_examples=1, deadline=None, derandomize=True, database=None,
                 phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


def _run_and_check(cs, world):
    """Every case matches one process or gets a clear error, and at least half of them pass."""
    outcomes = run_cases(cs, world)
    bad = [o for o in outcomes if o.status == "fail"]
    assert not bad, f"{len(bad)} of {len(outcomes)} cases on {world} ranks failed:\n" + "\n".join(
        f"{o.line()}\n{o.detail[-3000:]}" for o in bad)
    assert sum(o.status == "pass" for o in outcomes) >= len(cs) // 2, [o.line() for o in outcomes]


@_FUZZ
@given(st.lists(cases(2), min_size=6, max_size=6, unique_by=case_shape))
def test_fuzzed_models_on_two_ranks(cs):
    _run_and_check(cs, 2)


@_FUZZ
@given(st.lists(cases(4), min_size=5, max_size=5, unique_by=case_shape))
def test_fuzzed_models_on_four_ranks(cs):
    _run_and_check(cs, 4)


# ---- regressions: cases the fuzzer found -------------------------------------------------------

def _spec(**kw):
    base = dict(heads=1, ffn=8, layers=2, norm="none", act="relu", causal=False, seq=4, out=3, loss="ce",
                bias=True, batch=4, seed=0)
    base.update(kw)
    return base


def _case(spec, force, cluster="free", forward=False, meta=False):
    return dict(spec=spec, force=force, cluster=cluster, meta=meta, forward=forward)


# A column-parallel convolution (weight Shard(0) on tp): DTensor's conv handler gave the output the
# input's placement (Replicate) over a local tensor of half the channels -> "Expected cond to be True"
# at the next redistribution. Now run on local shards (codegen/fallback.py).
CONV_COLWISE = _case(_spec(kind="conv2d", hidden=4, block=["conv"], norm="rms_hand", act="tanh", channels=1,
                           kernel=3), dict(dp=1, tp=2, pp=1, recompute="full"))
# A Linear over the channels of a conv activation (movedim: non-contiguous) under tp: redistributing
# the non-contiguous value gave a contiguous local tensor under non-contiguous metadata -> "view size
# is not compatible with input tensor's size and stride" in the next linear (codegen/edges.py).
NONCONTIGUOUS_TP = _case(_spec(kind="conv1d", hidden=12, heads=2, ffn=7, layers=3, block=["linear", "conv"],
                               norm="rms_hand", seq=8, channels=3, kernel=3),
                         dict(dp=1, tp=2, pp=1, recompute="none"), forward=True)
# The same in backward, with dp and ZeRO-2 and selective recompute.
NONCONTIGUOUS_DP = _case(_spec(kind="conv2d", hidden=5, ffn=12, layers=3, block=["conv", "linear"], act="silu",
                               channels=1, kernel=1, batch=8),
                         dict(dp=2, tp=1, pp=1, recompute="selective", zero=2), forward=True)
# A pipeline stage ending in a movedim: the send took the non-contiguous tensor -> "input tensor has
# to be contiguous" (runtime/pipeline.py Wire.send).
NONCONTIGUOUS_PP = _case(_spec(kind="conv1d", hidden=3, ffn=5, block=["linear", "conv"], act="silu", seq=3,
                               channels=1, kernel=3, out=12, bias=False), dict(dp=1, tp=1, pp=2, recompute="none"))
# The same backward: the second stage begins with a norm over the channels (movedim), whose input
# gradient is a permuted view, and torch's schedule sent it as it was -> "input tensor has to be
# contiguous" (``benchmarks/fuzz.py --seed 42``; runtime/pipeline._ContiguousGrad).
NONCONTIGUOUS_PP_GRAD = _case(_spec(kind="conv1d", hidden=3, ffn=3, layers=4, block=["conv", "linear"],
                                    norm="layernorm", seq=3, channels=1, kernel=1, bias=False),
                              dict(dp=1, tp=1, pp=2, recompute="none", mbs=2))
# The batch split on both dp and tp ([Shard(0), Shard(0)]) into a convolution: DTensor's conv rule
# raised "Tensor dim 0 is already sharded on mesh dim 0 ... hybrid sharding" (a torch ValueError).
CONV_HYBRID = _case(_spec(kind="conv1d", hidden=3, block=["conv", "conv"], norm="rmsnorm", act="gelu", seq=3,
                          channels=3, kernel=3, out=8, batch=8), dict(dp=2, tp=2, pp=1, recompute="selective", zero=3))
# Non-causal attention split on the query sequence (q Shard(2), k and v Replicate) runs on local
# shards on the CPU; each rank's key/value gradient is only its queries' share, and was taken as
# Replicate -> wrong gradients from step 1 (losses off by 3e-4 at step 2). The plan is the
# solver's with the attention's tp placement edited (the solver picks the batch split here).
SDPA_SEQ = _case(_spec(kind="tokens", hidden=8, heads=2, ffn=8, layers=1, block=["attn"], norm="layernorm",
                       act="gelu", seq=8, out=5, vocab=5, pos=False, tie=False),
                 dict(dp=1, tp=2, pp=1, recompute="none"))


def _sdpa_seq_plan(case, world):
    from dataclasses import replace

    from autopar.placements import Replicate, Shard
    from autopar.plan import NodeStrategy
    from autopar.solver.forcing import parse_force
    from autopar.solver.search import plan_model
    from autopar.trace import trace_model
    from fuzz_models import build

    m, x, lf, y = build(case["spec"])
    g = trace_model(m, x, loss_fn=lf, example_target=y)
    plan = plan_model(g, fast_links_cluster(world), global_batch=x[0].shape[0], seq_len=x[0].shape[1],
                      dtype="float32", force=parse_force(case["force"]))
    R = Replicate()
    edited = tuple(NodeStrategy(s.key, (R, Shard(2)), ((R, Shard(2)), (R, R), (R, R)), "seq")
                   if "scaled_dot_product_attention" in s.key else s for s in plan.strategies)
    return replace(plan, strategies=edited)


# Cases whose collectives differed from codegen/expected.py's prediction (the numbers were right);
# each now issues exactly the predicted collectives, as ``benchmarks/fuzz.py --predictions`` checks.
_SMALL = dict(ffn=3, layers=1, seq=3, bias=False)
_DP2 = dict(dp=2, tp=1, pp=1, recompute="none", zero=0)
PREDICTED = {
    # The batch-split stem convolution runs on local shards (codegen/fallback.py): it all-reduced
    # its weight's and bias' dp gradient on the way back, which the gradient reducer then reduced
    # again (dp traffic doubled, the sum undone by /dp). A norm over the channels (movedim: no
    # planner rule, so Replicate on dp) leaves the executor to gather the moved view, which
    # DTensor kept batch-sharded (GraphExecutor._fix_output); the residual add of that Replicate
    # branch to the sharded stem chunks it, so its gradient comes back sharded: an all_gather,
    # not the Partial all_reduce predicted.
    "conv_channel_norm": _case(_spec(kind="conv1d", hidden=3, block=["conv"], norm="layernorm", channels=1,
                                     kernel=1, **_SMALL), _DP2),
    # A Linear over the channels (movedim) makes the logits Replicate on dp while the target is
    # batch-sharded: DTensor's nll_loss rule gathers the target (forward, and again in its
    # backward), the loss is Replicate (no total_weight all_reduce) and so is the logits' gradient.
    "replicated_logits": _case(_spec(kind="conv1d", hidden=3, block=["linear"], channels=1, kernel=1, **_SMALL),
                               _DP2),
    # mse_loss' broadcast_tensors (no planner rule) has two batch-sharded outputs, both gathered;
    # ZeRO-3 gathers a weight again in backward only where autograd keeps it: not the first
    # Linear's, whose input needs no gradient. Full recompute, two micro-batches.
    "mse_zero3": _case(_spec(kind="features", hidden=3, block=["linear"], features=3, loss="mse", **dict(_SMALL, seq=0)),
                       dict(_DP2, zero=3, recompute="full", mbs=1)),
    # One-row micro-batches whose rows the plan splits over tp=2: an uneven shard, which DTensor
    # pads to equal chunks before all-gathering it (the gather moves two rows, not one).
    "uneven_tp_shard": _case(_spec(kind="conv1d", hidden=4, block=["conv"], norm="rmsnorm", channels=1, kernel=1,
                                   **_SMALL), dict(dp=1, tp=2, pp=1, recompute="none", mbs=1)),
    # The pooling mean over the spatial dim the last residual add is split on (tp Shard(2) ->
    # Partial) gets its gradient Replicate and expands it: the add's output gradient is Replicate
    # (no edge wraps it back into the Shard), so the add hands Replicate to the conv branch's
    # batch-sharded silu, a free chunk -- not the predicted Shard(2) -> Shard(0) move, all-gathered
    # on gloo (codegen/expected_grads.py). ``fuzz.py --seed 6`` found it (the spec's
    # layers=2, ffn=8 and seq=8 only repeat it); full recompute, one-row micro-batches.
    "mean_of_sharded_add": _case(_spec(kind="conv2d", hidden=7, block=["conv"], norm="rms_hand", act="silu",
                                       channels=1, kernel=3, out=12, **dict(_SMALL, seq=4, bias=True)),
                                 dict(dp=1, tp=2, pp=1, recompute="full", mbs=1)),
}


@pytest.fixture(scope="module")
def two_rank_regressions():
    """The two-rank regressions below, in one launch."""
    sdpa = dict(SDPA_SEQ, plan=_sdpa_seq_plan(SDPA_SEQ, 2).to_json())
    named = {"conv_colwise": CONV_COLWISE, "noncontiguous_tp": NONCONTIGUOUS_TP,
             "noncontiguous_dp": NONCONTIGUOUS_DP, "noncontiguous_pp": NONCONTIGUOUS_PP,
             "noncontiguous_pp_grad": NONCONTIGUOUS_PP_GRAD, "sdpa_seq": sdpa,
             **PREDICTED}
    return dict(zip(named, run_cases(list(named.values()), 2, check_prediction=True)))


@pytest.mark.parametrize("name", ["conv_colwise", "noncontiguous_tp", "noncontiguous_dp", "noncontiguous_pp",
                                  "noncontiguous_pp_grad", "sdpa_seq"])
def test_found_cases_on_two_ranks(name, two_rank_regressions):
    o = two_rank_regressions[name]
    assert o.status == "pass", f"{o.line()}\n{o.detail[-3000:]}"
    if name in ("conv_colwise", "noncontiguous_tp", "sdpa_seq"):
        assert o.tp_used and o.traffic.get("tp"), (o.tp_used, o.traffic)      # tp really split tensors
    if name == "sdpa_seq":
        plan = json.loads(o.case["plan"])
        attn = next(s for s in plan["strategies"] if "scaled_dot_product_attention" in s["key"])
        assert attn["name"] == "seq"


@pytest.mark.parametrize("name", list(PREDICTED))
def test_found_cases_issue_the_predicted_collectives(name, two_rank_regressions):
    """Numbers as one process, and every rank issued exactly what codegen/expected.py predicts
    (kind, axis, bytes, phase; ``fuzz_runs._unpredicted``): in particular the stem convolution's
    weight gradient crosses dp once, in the gradient reducer's bucket."""
    o = two_rank_regressions[name]
    assert o.status == "pass", f"{o.line()}\n{o.detail[-3000:]}"
    assert not o.unpredicted, o.unpredicted
    axis = "tp" if name in ("uneven_tp_shard", "mean_of_sharded_add") else "dp"
    assert o.traffic.get(axis), o.traffic


# A tied vocabulary of 4 rows over tp=4: the lookup is masked-Partial, and the plan reduces it twice
# (the RMS norm's reduce-scatters for its square and its scale) and adds it to the residual
# Partial: the second reduction found DTensor's mask released -> AssertionError inside torch
# (``benchmarks/fuzz.py --seed 36``; codegen/edges.unmasked).
TIED_LOOKUP_TWICE = _case(_spec(kind="tokens", hidden=12, heads=4, ffn=12, layers=4, block=["attn", "attn"],
                                norm="rms_hand", act="gelu", seq=8, out=4, vocab=4, tie=True, pos=False),
                          dict(dp=1, tp=4, pp=1, recompute="none", mbs=1))


# An MSE loss, when no rule split it over the batch (the data axis solved, the loss replicated on
# dp), read the head's rows gathered on dp; the tp axis' table, on each rank's pieces, read that
# input as a broadcast and split the loss' broadcast_tensors over the batch from replicated
# inputs, which the run then gathered back in the backward (an all_gather the prediction did not
# have; ``benchmarks/fuzz.py --seed 40``; ``rules.broadcast_protos``, tests/solver/test_rules.py).
# Since, the loss splits over the batch (``rules._pointwise_loss``, run by ``fallback.py``): the
# case checks that path on dp x tp with ZeRO-2 and recompute.
MSE_DATA_GATHER = _case(_spec(kind="features", hidden=12, heads=3, ffn=3, layers=3, block=["linear", "linear"],
                              norm="layernorm", act="silu", causal=True, seq=0, features=8, loss="mse", batch=8,
                              seed=9),
                        dict(dp=2, tp=2, pp=1, recompute="full", zero=2, mbs=2))


# Logits (1, T, V) a rank, split along T on tp, flattened to (T, V) for the loss: the view rule
# read the micro-batch's one row as a size-1 dim and let the split through; DTensor reshapes the
# global (dp rows, T, V) and gathered them, an all-gather per micro-batch the plan did not have
# (``benchmarks/fuzz.py --seed 2026 --wide --predictions``; ``strategies._past_a_batch_of_one``).
BATCH_OF_ONE_VIEW = _case(_spec(kind="tokens", hidden=8, heads=4, ffn=4, layers=3, block=["mlp", "linear"],
                                norm="rms_hand", causal=True, seq=8, out=4, vocab=4, tie=True, pos=False,
                                bias=False, batch=8),
                          dict(dp=2, tp=2, pp=1, recompute="selective", zero=3, mbs=1), meta=True)


@pytest.fixture(scope="module")
def four_rank_regressions():
    """The four-rank regressions below, in one launch."""
    named = {"conv_hybrid": CONV_HYBRID, "tied_lookup_twice": TIED_LOOKUP_TWICE, "mse_data_gather": MSE_DATA_GATHER,
             "batch_of_one_view": BATCH_OF_ONE_VIEW}
    return dict(zip(named, run_cases(list(named.values()), 4, check_prediction=True)))


def test_conv_split_over_both_axes_on_four_ranks(four_rank_regressions):
    o = four_rank_regressions["conv_hybrid"]
    assert o.status == "pass", f"{o.line()}\n{o.detail[-3000:]}"
    assert o.traffic.get("dp") and o.traffic.get("tp"), o.traffic


def test_a_tied_lookup_reduced_twice_on_four_ranks(four_rank_regressions):
    o = four_rank_regressions["tied_lookup_twice"]
    assert o.status == "pass", f"{o.line()}\n{o.detail[-3000:]}"
    assert o.tp_used and o.traffic.get("tp") and not o.unpredicted, (o.traffic, o.unpredicted)


# ---- regressions without ranks ----------------------------------------------------------------

def test_conv_local_placements_follow_the_solver_rule():
    """Each of the conv rule's splits runs locally as it is, with the right gradient placements;
    anything else (or groups > 1 with a channel split) is gathered first."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from autopar.codegen import fallback

    R, P = Replicate(), Partial()
    t = "aten.conv2d.default"
    args = (None, None, None, [1, 1], [1, 1], [1, 1], 1)
    chosen, out = fallback.local_placements(t, args, {}, [(Shard(0), R), (R, Shard(0)), (R, Shard(0))], [4, 4, 1])
    assert chosen == [(Shard(0), R), (R, Shard(0)), (R, Shard(0))] and out == (Shard(0), Shard(1))
    assert fallback.grad_placements(chosen, out) == [(Shard(0), P), (P, Shard(0)), (P, Shard(0))]
    chosen, out = fallback.local_placements(t, args, {}, [(Shard(1),), (Shard(1),), (P,)], [4, 4, 1])
    assert out == (P,) and fallback.grad_placements(chosen, out) == [(Shard(1),), (Shard(1),), (R,)]
    grouped = (None, None, None, [1, 1], [1, 1], [1, 1], 2)
    chosen, out = fallback.local_placements(t, grouped, {}, [(R,), (Shard(0),), (Shard(0),)], [4, 4, 1])
    assert chosen == [(R,), (R,), (R,)] and out == (R,)
    assert fallback.needs_local(t, [(Shard(0), Shard(0)), (R, R), (R, R)])
    assert not fallback.needs_local(t, [(R, R), (R, R)])
    assert not fallback.needs_local("aten.linear.default", [(R,), (Shard(0),)])


def test_tp_refusal_on_a_conv_model_is_not_about_its_spatial_size():
    """A conv model's block input is (B, C, L): its last dim is spatial, not a hidden size, so a
    forced tp=2 with L=3 is planned (the channels split) instead of refused with "hidden size 3";
    a refusal that stays says which tp to use."""
    from autopar.solver.configs import check_force, model_dims
    from autopar.solver.errors import PlanningError
    from autopar.solver.forcing import Force
    from autopar.trace import trace_model
    from fuzz_models import build

    m, x, lf, y = build(_spec(kind="conv1d", hidden=4, block=["conv"], seq=3, channels=1, kernel=3))
    g = trace_model(m, x, loss_fn=lf, example_target=y)
    assert model_dims(g)["hidden"] is None
    check_force(Force(tp=2, dp=1, pp=1), g, 2, 4)
    m, x, lf, y = build(_spec(kind="tokens", hidden=6, heads=3, block=["attn"], vocab=5, out=5, pos=False, tie=False))
    g = trace_model(m, x, loss_fn=lf, example_target=y)
    with pytest.raises(PlanningError, match=r"tp=4 does not divide the 3 attention heads; use tp=1 "):
        check_force(Force(tp=4, dp=1, pp=1), g, 4, 4)


def fallback_output_strides(rank: int, world: int) -> dict:
    """On one rank: the DTensor a local (fallback) run returns for CPU attention and for a
    convolution of a channels-last-strided input, both of whose kernels return non-contiguous
    tensors: is the local tensor laid out as the DTensor's (contiguous) metadata says?"""
    from types import SimpleNamespace

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from autopar.codegen.executor import GraphExecutor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    q = torch.randn(4, 5, 2, 6).transpose(1, 2)                       # (B, H, T, D) as attention gets it
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    args = tuple(DTensor.from_local(t, mesh, (Shard(1),), run_check=False) for t in (q, q, q))
    y = GraphExecutor._run_local(SimpleNamespace(mesh=mesh), SimpleNamespace(target=sdpa),
                                 SimpleNamespace(target="aten.scaled_dot_product_attention.default"), args, {})
    out["sdpa"] = (y.to_local().stride(), y.to_local().is_contiguous())
    x = torch.randn(4, 5, 5, 3).movedim(-1, 1)                          # channels-last strides
    conv = torch.ops.aten.conv2d.default
    args = (DTensor.from_local(x, mesh, (Replicate(),), run_check=False),
            DTensor.from_local(torch.randn(4, 3, 3, 3), mesh, (Shard(0),), run_check=False), None, [1, 1], [1, 1])
    y = GraphExecutor._run_local(SimpleNamespace(mesh=mesh), SimpleNamespace(target=conv),
                                 SimpleNamespace(target="aten.conv2d.default"), args, {})
    out["conv"] = (str(tuple(y.placements)), y.to_local().is_contiguous())
    return out


def test_fallback_outputs_are_laid_out_as_declared():
    """CPU attention returns (B, H, T, D) with (B, T, H, D) strides and a convolution of a
    channels-last input returns channels-last; the local run declares its output contiguous, so
    the local tensor is made contiguous (DTensor's view rules trust the declared strides)."""
    from autopar.runtime.launch import spawn_ranks

    (res,) = spawn_ranks(fallback_output_strides, 1, timeout_s=30)
    assert res["sdpa"][1], res
    assert res["conv"][1], res


def test_grouped_conv_splits_only_the_batch():
    """The solver's conv rule offers an output-channel split only with groups == 1: with groups > 1
    the local run could not be exact (each rank's output channels need their own input groups), so
    the runtime would gather instead of what the plan costed."""
    from autopar.ir import NodeInfo, TensorMeta
    from autopar.placements import Replicate, Shard
    from autopar.solver.rules import find_rule

    def protos(groups):
        x, b = TensorMeta((4, 4, 5), "float32"), TensorMeta((4,), "float32")
        w = TensorMeta((4, 4 // groups, 3), "float32")
        node = NodeInfo(key="conv|aten.conv1d.default|0", name="conv1d", kind="op", target="aten.conv1d.default",
                        args=(None, None, None, (1,), (1,), (1,), groups), kwargs=(), outputs=(x,), flops=0,
                        bytes_moved=0, module_path="conv")
        return {(p.output, p.inputs) for p in find_rule("aten.conv1d.default")(node, [x, w, b], [x])}

    assert (Shard(1), (Replicate(), Shard(0), Shard(0))) in protos(1)
    assert protos(2) == {(Shard(0), (Shard(0), Replicate(), Replicate()))}


def test_a_batch_replicated_loss_issues_the_predicted_collectives(four_rank_regressions):
    o = four_rank_regressions["mse_data_gather"]
    assert o.status == "pass", f"{o.line()}\n{o.detail[-3000:]}"
    assert o.traffic.get("dp") and o.traffic.get("tp") and not o.unpredicted, (o.traffic, o.unpredicted)


def test_a_view_past_a_batch_of_one_issues_the_predicted_collectives(four_rank_regressions):
    o = four_rank_regressions["batch_of_one_view"]
    assert o.status == "pass", f"{o.line()}\n{o.detail[-3000:]}"
    assert o.traffic.get("dp") and o.traffic.get("tp") and not o.unpredicted, (o.traffic, o.unpredicted)
