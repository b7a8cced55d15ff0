"""Fused-kernel substitution (autopar/codegen/fused.py).

(a) One process: every adapter, through the Triton kernel (TRITON_INTERPRET=1, which the root
    conftest sets) and through the reference, equals the aten op it replaces, forward and backward;
    calls outside an adapter's conditions are left to aten.
(b) Two gloo ranks, one SGD-momentum step (fp32), kernels="on" (Triton interpreter) equal
    kernels="off" within round-off (losses, each step's gradients, parameters: the bounds and why
    SGD rather than Adam are in bodies.py), and ``pm.fused_kernels`` lists what ran fused:
    gpt-tiny with dp=2 (local-dp mode), tp=2 (hand Megatron plan) and tp=2 with
    sequence parallelism (the residual stream Shard(1) through add + LayerNorm): every
    layer_norm (add_layer_norm where a residual add feeds it), gelu, attention and the
    cross-entropy; a tiny LLaMA with dp=2 (local-dp and DTensor modes: the kernels on batch-sharded
    DTensors; gpt-tiny's under tp run on DTensors too) and tp=2 replicated: its multi-node regions
    (hand-written RMSNorm, add + RMSNorm, RoPE, SwiGLU, codegen/patterns.py) too. A declined
    region runs its members one by one with the same result. kernels="auto" substitutes nothing
    on the CPU (the default is "off").
"""
from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from autopar.codegen.fused import ADAPTERS, FusedKernels, fused_kernels

aten = torch.ops.aten
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
IMPLS = ["reference"] + (["triton"] if INTERPRET or torch.cuda.is_available() else [])


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(True)


def _op(target: str):
    _, name, overload = target.split(".")
    return getattr(getattr(aten, name), overload)


def _cases():
    """(name, aten target, args builder, kwargs as the traced graph writes them)."""
    tgt = torch.tensor([3, -100, 0, 36, 5, 5, -100, 1, 2, 9])
    ln, rms, sdpa, ce = ("aten.layer_norm.default", "aten.rms_norm.default",
                         "aten.scaled_dot_product_attention.default", "aten.cross_entropy_loss.default")
    return [
        ("layer_norm", ln, lambda: (_rand(3, 5, 48), [48], _rand(48, seed=1), _rand(48, seed=2), 1e-5, False), {}),
        ("layer_norm_no_affine", ln, lambda: (_rand(7, 33), [33], None, None, 1e-6, False), {}),
        ("rms_norm", rms, lambda: (_rand(3, 5, 48), [48], _rand(48, seed=1), 1e-6), {}),
        ("rms_norm_eps_none", rms, lambda: (_rand(4, 40), [40], _rand(40, seed=1), None), {}),
        ("gelu", "aten.gelu.default", lambda: (_rand(3, 5, 70),), {}),
        ("gelu_tanh", "aten.gelu.default", lambda: (_rand(3, 70),), {"approximate": "tanh"}),
        ("softmax", "aten.softmax.int", lambda: (_rand(3, 5, 37), -1), {}),
        ("sdpa", sdpa, lambda: (_rand(2, 3, 20, 16), _rand(2, 3, 24, 16, seed=1), _rand(2, 3, 24, 16, seed=2)), {}),
        ("sdpa_gqa_causal", sdpa, lambda: (_rand(2, 4, 19, 16), _rand(2, 2, 19, 16, seed=1),
                                          _rand(2, 2, 19, 16, seed=2), None, 0.0, True),
         {"enable_gqa": True}),
        ("sdpa_causal_scale", sdpa, lambda: (_rand(1, 2, 19, 32), _rand(1, 2, 19, 32, seed=1),
                                            _rand(1, 2, 19, 32, seed=2), None, 0.0, True), {"scale": 0.3}),
        ("cross_entropy_mean", ce, lambda: (_rand(10, 37), tgt, None, 1, -100, 0.0), {}),
        ("cross_entropy_sum", ce, lambda: (_rand(10, 37), tgt, None, 2, -100, 0.0), {}),
        ("cross_entropy_none", ce, lambda: (_rand(10, 37), tgt), {"reduction": 0}),
    ]


def _fwd_bwd(fn, args):
    out = fn(*args)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    grads = torch.autograd.grad((out * g).sum(), leaves)
    return out.detach(), grads


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_adapter_matches_aten(case, impl):
    name, target, build, kw = case
    fk = FusedKernels(impl)
    want, want_g = _fwd_bwd(lambda *a: _op(target)(*a, **kw), build())
    got, got_g = _fwd_bwd(lambda *a: fk.run(f"k|{name}", target, a, kw), build())
    assert fk.used == {f"k|{name}": ADAPTERS[target].kernel}
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert len(got_g) == len(want_g)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("target,args,kwargs,why", [
    ("aten.scaled_dot_product_attention.default",
     (torch.ones(1, 2, 8, 16),) * 3 + (torch.ones(8, 8, dtype=torch.bool),), {}, "attn_mask"),
    ("aten.scaled_dot_product_attention.default", (torch.ones(1, 2, 8, 16),) * 3 + (None, 0.1), {}, "dropout"),
    ("aten.scaled_dot_product_attention.default", (torch.ones(1, 2, 8, 24),) * 3, {}, "head dim 24"),
    ("aten.scaled_dot_product_attention.default", (torch.ones(1, 6, 8, 16), torch.ones(1, 4, 8, 16),
                                                   torch.ones(1, 4, 8, 16)), {"enable_gqa": True},
     "6 query heads over 4 key heads"),
    ("aten.scaled_dot_product_attention.default", (torch.ones(1, 4, 8, 16), torch.ones(1, 2, 8, 16),
                                                   torch.ones(1, 2, 8, 16)), {}, "GQA shapes without enable_gqa"),
    ("aten.layer_norm.default", (torch.ones(2, 4, 8), [4, 8], None, None, 1e-5, False), {}, "normalized_shape"),
    ("aten.layer_norm.default", (torch.ones(2, 8, dtype=torch.float64), [8]), {}, "dtype"),
    ("aten.cross_entropy_loss.default", (torch.ones(4, 5), torch.zeros(4, dtype=torch.long), torch.ones(5)),
     {}, "class weight"),
    ("aten.cross_entropy_loss.default", (torch.ones(4, 5), torch.zeros(4, dtype=torch.long), None, 1, -100, 0.1),
     {}, "label_smoothing"),
    ("aten.cross_entropy_loss.default", (torch.ones(2, 5, 3), torch.zeros(2, 3, dtype=torch.long)), {}, "(N, C)"),
    ("aten.softmax.int", (torch.ones(3, 4), 0), {}, "last dim"),
    ("aten.add.Tensor", (torch.ones(3), torch.ones(3)), {}, "no adapter"),
])
def test_adapter_declines(target, args, kwargs, why):
    fk = FusedKernels("reference")
    assert fk.run("k", target, args, kwargs) is None, why
    assert fk.used == {}


def test_modes():
    assert fused_kernels("off", "cuda") is None
    assert fused_kernels("auto", "cpu") is None                 # even with TRITON_INTERPRET=1
    fk = fused_kernels("on", "cpu")
    assert fk.implementation == ("triton" if INTERPRET else "reference")
    with pytest.raises(ValueError, match="choose one of"):
        fused_kernels("yes", "cpu")


# ---- two ranks ---------------------------------------------------------------------------------

STEPS = 1                        # a step: forward, backward (the kernels) and the update they feed
FAMILIES = {     # name: (model, hand_plan kwargs, job extras)
    "dp": ("gpt-tiny", dict(dp=2, tp=1), {}),
    "tp": ("gpt-tiny", dict(dp=1, tp=2, family="megatron"), {}),
    "tp_sp": ("gpt-tiny", dict(dp=1, tp=2, family="megatron_sp"), {}),
    "llama_dp": ("llama", dict(dp=2, tp=1), {}),
    "llama_dp_dtensor_mode": ("llama", dict(dp=2, tp=1), {"dp_mode": "dtensor"}),
    "llama_tp_replicate": ("llama", dict(dp=1, tp=2, family="replicate"), {}),
}
GPT = [f for f, (model, _, _) in FAMILIES.items() if model == "gpt-tiny"]
LLAMA = [f for f in FAMILIES if f not in GPT]


@pytest.fixture(scope="module")
def llama_full():
    from autopar.models import build_model
    from autopar.trace import trace_model
    from bodies import BATCH, LLAMA_TINY

    torch.manual_seed(0)
    b = build_model(LLAMA_TINY, device="cpu", batch=BATCH)
    return trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                       collapse_repeats=False, model_name="llama-tiny")


@pytest.fixture(scope="module")
def fused_runs(tiny_full, llama_full):
    from autopar.runtime.launch import spawn_ranks
    from bodies import LLAMA_TINY, fused_jobs
    from handplans import hand_plan

    jobs, index = [], {}
    for name, (model, plan_kw, extra) in FAMILIES.items():
        graph, spec = (tiny_full, "gpt-tiny") if model == "gpt-tiny" else (llama_full, LLAMA_TINY)
        plan = hand_plan(graph, **plan_kw).to_json()
        for mode in ("on", "off"):
            index[(name, mode)] = len(jobs)
            jobs.append(dict(plan=plan, kernels=mode, steps=STEPS, model=spec, **extra))
    index["plans"] = {name: jobs[index[(name, "on")]]["plan"] for name in FAMILIES}
    index[("llama_dp", "declined")] = len(jobs)
    jobs.append(dict(jobs[index[("llama_dp", "on")]], decline=("add_rms_norm", "rope")))
    index[("dp", "auto")] = len(jobs)
    jobs.append(dict(plan=jobs[index[("dp", "off")]]["plan"], kernels="auto", steps=1))
    per_rank = spawn_ranks(fused_jobs, 2, (jobs,), timeout_s=180)
    plans = index.pop("plans")
    return {"plans": plans} | {k: [per_rank[r][i] for r in range(2)] for k, i in index.items()}


def _check_collectives(graph, plan_json: str, family: str, res: list, extra: dict) -> None:
    """Each rank issued STEPS times what ``expected_collectives`` predicts for the plan with the
    fused nodes it reported."""
    from autopar.codegen.expected import expected_collectives
    from autopar.plan import Plan

    plan = Plan.from_json(plan_json)
    for r, rank_res in enumerate(res):
        fused = {k for k, _ in rank_res["fused"]}
        want = Counter()
        for c in expected_collectives(graph, plan, tp_rank=rank_res["coord"][1], fused=fused, **extra):
            want[c.key()] += STEPS
        got = Counter(rank_res["issued"])
        assert got == want, (f"{family} rank {r}: issued-but-not-predicted {dict(got - want)}, "
                             f"predicted-but-not-issued {dict(want - got)}")


def _check_equal(family: str, on: list, off: list) -> None:
    """Losses of every rank, each step's gradients and the final parameters (rank 0) of ``on``
    against ``off`` within the round-off bounds of ``bodies.training_ratios``."""
    from bodies import RTOL_LOSS, check_training

    for r in range(2):
        for a, b in zip(on[r]["losses"], off[r]["losses"], strict=True):
            assert abs(a - b) <= RTOL_LOSS * abs(b), (family, r, on[r]["losses"], off[r]["losses"])
        assert off[r]["fused"] == []
    check_training(on[0], off[0], f"{family}: ")


@pytest.mark.slow
@pytest.mark.parametrize("family", GPT)
def test_two_ranks_kernels_equal_aten(family, fused_runs, tiny_full):
    on, off = fused_runs[(family, "on")], fused_runs[(family, "off")]
    _check_equal(family, on, off)
    extra = FAMILIES[family][2]
    for mode, res in (("on", on), ("off", off)):
        _check_collectives(tiny_full, fused_runs["plans"][family], f"{family} {mode}", res, extra)
    want = {}
    for n in tiny_full.nodes:
        if n.target in ADAPTERS:
            want[n.key] = ADAPTERS[n.target].kernel
    for key in want:             # every LayerNorm but the first reads a residual add: one kernel
        if "layer_norm" in key and key != "transformer.h.*.ln_1|aten.layer_norm.default|0":
            want[key] = "add_layer_norm"
    for r in range(2):
        assert dict(on[r]["fused"]) == want, (family, r, on[r]["fused"])
    assert sorted(want.values()).count("add_layer_norm") == 4
    assert sorted(set(want.values())) == ["add_layer_norm", "attention", "cross_entropy", "gelu", "layer_norm"]


@pytest.mark.slow
@pytest.mark.parametrize("family", LLAMA)
def test_two_ranks_llama_regions_equal_aten(family, fused_runs, llama_full):
    """LLaMA's hand-written RMSNorm, its residual add + RMSNorm, rotate-half RoPE and SwiGLU are
    multi-node regions (codegen/patterns.py): 2 layers give 1 rms_norm (the first norm reads the
    embedding), 4 add_rms_norm (the other three norms and the final one), 4 rope (q and k), 2
    swiglu, and the single-node attention and cross-entropy."""
    on, off = fused_runs[(family, "on")], fused_runs[(family, "off")]
    _check_equal(family, on, off)
    for mode, res in (("on", on), ("off", off)):
        _check_collectives(llama_full, fused_runs["plans"][family], f"{family} {mode}", res, FAMILIES[family][2])
    want = {"rms_norm": 1, "add_rms_norm": 4, "rope": 4, "swiglu": 2, "attention": 2, "cross_entropy": 1}
    for r in range(2):
        assert Counter(k for _, k in on[r]["fused"]) == want, (family, r, on[r]["fused"])


@pytest.mark.slow
def test_declined_regions_run_their_members(fused_runs):
    """A region the adapter declines runs node by node at its anchor (its inputs kept alive until
    then): the same numbers, and those kernels are absent from the fused list."""
    got, off = fused_runs[("llama_dp", "declined")], fused_runs[("llama_dp", "off")]
    _check_equal("llama_dp declined", got, off)
    want = {"rms_norm": 1, "swiglu": 2, "attention": 2, "cross_entropy": 1}
    assert Counter(k for _, k in got[0]["fused"]) == want


@pytest.mark.slow
def test_auto_substitutes_nothing_on_cpu(fused_runs):
    assert all(res["fused"] == [] for res in fused_runs[("dp", "auto")])

