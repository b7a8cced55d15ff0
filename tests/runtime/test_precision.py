"""Mixed precision executed (``runtime/precision.py``): a plan made for bf16 or fp16 of an fp32 model
trains on gloo ranks as ``torch.autocast`` trains it on one process (fp16: with
``torch.amp.GradScaler``), the low dtype really used (gradients cross dp in it; the first loss is
autocast's, not fp32's), and an fp16 overflow on ONE rank skips the step on every rank.

Bounds (u = the low dtype's unit round-off, 2**-8 for bf16, 2**-11 for fp16): a parallel run
rounds differently from the reference in a few places: tensor-parallel partial sums rounded to
the low dtype before their all-reduce (the reference rounds the whole sum once), gradients cast
down for the dp reduction and back. Each is <= u relative per element, and a gradient entry is
moved by at most a few of them: we allow K = 8 roundings, dg <= K * u * max|g| per tensor and
step. SGD with momentum 0.9 over 3 steps moves a parameter by lr * sum_t b_t, each momentum
buffer a sum of 0.9-powers of gradients, so |dp| <= lr * K * u * sum_s max|g_s| * (1 + .9 + .81).
A wrong run (a gradient not reduced, a shard misplaced, a step taken that should be skipped) is
off by O(lr * |g|): 10-100x the bound. The losses: a mean of B*T cross-entropies, each moved by the
same roundings of the logits: |dL| <= K * u * |L| is generous at step 1 and holds later."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from autopar.runtime.launch import spawn_ranks
from bodies import LR, STEPS, batches, build, sgd
from handplans import hand_plan

K_ROUNDINGS = 8
MOMENTUM_SUM = 1 + 0.9 + 0.81
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
OVERFLOW_STEP = 2            # fp16 test: rank 1 (only) sees an inf gradient at this step


def _train(rank: int, world: int, plan_json: str, overflow: str) -> dict:
    from autopar.api import autoparallelize
    from autopar.plan import Plan

    b = build(False)
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         optimizer=sgd, plan=Plan.from_json(plan_json), timeout_s=60)
    step = [0]
    if overflow and rank == 1:             # an inf in one gradient entry of this rank only
        pm.store.by_name[overflow].local.register_hook(   # ... rank 1's first row is a later one
            lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if step[0] == OVERFLOW_STEP else g)
    losses, snaps = [], []
    for x, y in batches(b)[:STEPS]:
        step[0] += 1
        losses.append(pm.step(x, y))
        if step[0] in (OVERFLOW_STEP - 1, OVERFLOW_STEP):       # this rank's own shards around the overflow
            snaps.append([s.local.detach().clone() for s in pm.store.slots])
    held = all(torch.equal(a, c) for a, c in zip(*snaps))
    dp = pm.reducer.dp
    padded = sum(s.layout.chunk_rows(dp) * dp * s.layout.row_numel for s in pm.store.slots)
    return {"losses": losses, "sd": pm.full_state_dict(), "precision": pm.precision.describe(),
            "scale": pm.loss_scaler.state_dict() if pm.loss_scaler else None,
            "held": held, "collectives": [(c.kind, c.axis, c.nbytes, c.source, c.phase) for c in pm.collectives], "padded_numel": padded}


def _reference(dtype: torch.dtype, overflow: str = "") -> dict:
    """One process under torch.autocast (fp16: GradScaler), the same data and SGD; per parameter
    sum_s max|g_s| for the bound."""
    b = build(False)
    m = b.module
    opt = sgd(m.parameters())
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    named = dict(m.named_parameters())
    gsum = {k: 0.0 for k in named}
    step = [0]
    if overflow:
        named[overflow].register_hook(
            lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if step[0] == OVERFLOW_STEP else g)
    losses = []
    for x, y in batches(b)[:STEPS]:
        step[0] += 1
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = b.loss_fn(m(*x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        for k, p in named.items():
            if p.grad is not None and torch.isfinite(p.grad).all():
                gsum[k] += float(p.grad.abs().max())
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "sd": {k: p.detach().clone() for k, p in named.items()}, "gsum": gsum,
            "scale": scaler.get_scale() if scaler else None}


def _check_close(out: dict, want: dict, dtype: torch.dtype) -> None:
    u = UNIT[dtype]
    for t, (got, ref) in enumerate(zip(out["losses"], want["losses"]), start=1):
        assert abs(got - ref) <= K_ROUNDINGS * u * abs(ref), f"step {t}: loss {got} vs autocast's {ref}"
    worst = max((((out["sd"][k] - p).abs().max().item() / (LR * K_ROUNDINGS * u * MOMENTUM_SUM * want["gsum"][k]
                                                           + 1e-30)), k) for k, p in want["sd"].items())
    assert worst[0] <= 1.0, f"{worst[1]} differs from autocast's by {worst[0]:.2f}x its round-off bound"


def _plan(graph, dtype: str, **kw):
    return dataclasses.replace(hand_plan(graph, **kw), dtype=dtype)


@pytest.fixture(scope="module")
def collapsed():
    """gpt-tiny traced with repeats collapsed: what pipeline plans are made on."""
    from autopar.trace import trace_model

    b = build(False)
    return trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                       model_name="gpt-tiny")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(dp=1, tp=2, family="megatron"), dict(dp=1, tp=2, family="megatron_sp"),
                                    dict(dp=2, tp=1, zero=3), dict(dp=2, tp=1, pp=2, mbs=1, zero=2)],
                         ids=["tp2", "tp2-sp", "dp2-zero3", "pp2-dp2"])
def test_bf16_trains_as_autocast_does_on_one_process(tiny_full, collapsed, layout):
    plan = _plan(collapsed if layout.get("pp", 1) > 1 else tiny_full, "bfloat16", **layout)
    out = spawn_ranks(_train, plan.mesh.size, (plan.to_json(), ""), timeout_s=120)
    want = _reference(torch.bfloat16)
    assert out[0]["precision"].startswith("bfloat16 autocast, float32 master weights")
    _check_close(out[0], want, torch.bfloat16)
    # bf16 really carried: the bound above cannot tell fp32 compute from bf16 (they differ by ~u),
    # the bytes on the wire can
    recs = out[0]["collectives"]
    # (backward all-reduces carry what the one-process value's gradient is: fp32 where autocast
    # cast an fp32 tensor down after the redistribution)
    b = build(False)
    rows, seq = b.example_inputs[0].shape
    activation = rows * seq * b.module.transformer.wte.weight.shape[1]
    if layout.get("family") == "megatron":  # forward all-reduces of row-parallel bf16 partial sums
        sizes = {n for kind, axis, n, _, phase in recs
                 if axis == "tp" and kind == "all_reduce" and phase == "forward"}
        assert 2 * activation in sizes and 4 * activation not in sizes, sorted(sizes)
    if layout.get("family") == "megatron_sp":
        # each layer norm's output is cast to bf16 before its gather for the next linear, which
        # saves it: the shard is kept and gathered again in backward (``runtime/regather.py``)
        fwd = Counter(n for kind, axis, n, _, phase in recs if kind == "all_gather" and phase == "forward")
        bwd = Counter(n for kind, axis, n, _, phase in recs if kind == "all_gather" and phase == "backward")
        # backward: those re-gathers, and the bf16 gradients of the row-parallel reduce-scatters
        scatters = sum(1 for kind, axis, n, _, phase in recs if kind == "reduce_scatter" and phase == "forward")
        assert set(fwd) == {2 * activation} and bwd[2 * activation] == fwd[2 * activation] + scatters, (fwd, bwd)
    if layout.get("dp", 1) > 1:            # gradients crossed dp in bf16: 2 bytes per padded element
        scattered = sum(n for kind, _, n, source, _ in recs if kind == "reduce_scatter" and source == "reducer")
        assert scattered == STEPS * 2 * out[0]["padded_numel"]
    if layout.get("pp", 1) > 1:
        assert any(kind == "send" and axis == "pp" for kind, axis, _, _, _ in recs)


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["none", "optimizer+grads"])     # the verdict read on the host's gradients
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tiny_full, offload):
    name = "transformer.wte.weight"        # split over tp (vocab rows): row 0 lives on rank 0 ...
    plan = dataclasses.replace(_plan(tiny_full, "float16", dp=1, tp=2, family="megatron"), offload=offload)
    out = spawn_ranks(_train, 2, (plan.to_json(), name), timeout_s=90)
    want = _reference(torch.float16, overflow=name)
    for r in out:                          # rank 0's own gradients were finite: the verdict was shared
        assert r["scale"] == {"scale": want["scale"], "growth_tracker": 1, "skipped_steps": 1}
    assert want["scale"] == 2.0 ** 15
    _check_close(out[0], want, torch.float16)
    assert all(r["held"] for r in out)      # each rank's own shards unchanged by the skipped step


def test_mixed_precision_is_refused_where_it_cannot_run():
    from autopar.runtime.precision import parse_dtype, precision_for

    with pytest.raises(ValueError, match="choose 'bf16', 'fp16' or 'fp32'"):
        parse_dtype("int8")
    with pytest.raises(ValueError, match="plan for bfloat16"):
        precision_for("float32", torch.bfloat16)
    assert not precision_for("bfloat16", torch.bfloat16).mixed          # a bf16 model runs as it is
    p = precision_for("fp16", torch.float32)
    assert p.mixed and p.loss_scaling and p.reduce_dtype == torch.float16
