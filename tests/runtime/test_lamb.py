"""autopar.optim.LAMB: a torch.optim.Optimizer over the fused LAMB step whose per-tensor trust
ratio stays the whole tensor's when autoparallelize hands it shards (tensor parallel, ZeRO).

One process: equal to ``lamb_step_ref`` applied to each tensor on its own. Two gloo ranks (tp=2,
dp=2 + ZeRO-3; ZeRO-1's row views are the same shard groups): parameters after 3 steps equal the same training on one process
within what gradient round-off allows element by element (``_reference``); with the shard groups
withheld (norms of shards) tp=2 does not, so the test can tell."""
from __future__ import annotations

import pytest
import torch

from autopar.optim import LAMB
from autopar.runtime.launch import spawn_ranks
from bodies import EPS32, RTOL_GRAD, RTOL_GRAD_FIRST, STEPS, batches, build
from handplans import hand_plan
from autopar.kernels.optimizers import lamb_step_ref

HP = dict(lr=5e-2, weight_decay=0.01)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((7, 5), (33,), (3, 4, 2), ())]


def test_lamb_equals_the_reference_per_tensor():
    params, ref = _params(), [p.detach().clone() for p in _params()]
    opt = LAMB(params, **HP)
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ref]
    g = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        grads = [torch.randn(p.shape, generator=g) for p in ref]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        opt.step()
        for p, gr, (m, v) in zip(ref, grads, moments):
            flat = [t.reshape(-1) for t in (p, gr, m, v)]
            lamb_step_ref(*flat, [0, p.numel()], step=step, lr=HP["lr"], weight_decay=HP["weight_decay"])
    for got, want in zip(params, ref):
        torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=1e-5)


def test_lamb_refuses_what_it_cannot_do():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="fp32 master weights"):
        LAMB([p]).step()
    with pytest.raises(ValueError, match="min_trust"):
        LAMB(_params(), min_trust=0.0)


class _ShardBlind(LAMB):
    def set_shard_groups(self, groups) -> None:      # norms of the local shards only
        pass


def _train(rank: int, world: int, plan_json: str, blind: bool) -> dict:
    from autopar.api import autoparallelize
    from autopar.plan import Plan

    b = build(False)
    data = batches(b)
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         optimizer=lambda ps: (_ShardBlind if blind else LAMB)(ps, **HP),
                         plan=Plan.from_json(plan_json), timeout_s=30)
    losses = [pm.step(x, y) for x, y in data[:STEPS]]
    sd = pm.full_state_dict()
    return {"losses": losses, "sd": sd if rank == 0 else None}


def _reference() -> tuple[dict, dict]:
    """The same training on one process: the parameters after STEPS steps, and per parameter a
    bound, element by element, on how far round-off alone can move them (below)."""
    b = build(False)
    m = b.module
    hp = dict(LAMB(m.parameters(), **HP).defaults)
    lr, (beta1, beta2), eps = hp["lr"], hp["betas"], hp["eps"]
    opt = LAMB(m.parameters(), **HP)
    named = dict(m.named_parameters(remove_duplicate=False))
    bound = {k: torch.zeros_like(p) for k, p in named.items()}
    for t, (x, y) in enumerate(batches(b)[:STEPS], start=1):
        before = {k: p.detach().clone() for k, p in named.items()}
        opt.zero_grad(set_to_none=True)
        b.loss_fn(m(*x), y).backward()
        opt.step()
        # LAMB moves p by lr * trust * r, r = m_hat / (sqrt(v_hat) + eps) + wd * p. A gradient
        # round-off dg (per entry <= RTOL_GRAD * max|g|, bodies.py) moves m_hat and sqrt(v_hat)
        # by <= dg, so r_i by <= dg * (1 + |m_hat_i| / d_i) / d_i with d_i = sqrt(v_hat_i) + eps:
        # up to dg / eps (1e6 * dg) where v is tiny: the same amplification as Adam, element by
        # element; the trust ratio moves by <= ||dr|| / ||r|| relative; fp32 ulp per update.
        for k, p in named.items():
            st = opt.state[p]
            m_hat, d = st["exp_avg"] / (1 - beta1**t), (st["exp_avg_sq"] / (1 - beta2**t)).sqrt() + eps
            r = m_hat / d + hp["weight_decay"] * before[k]
            step = (before[k] - p.detach()).abs()
            trust = step.norm() / (lr * r.norm()) if r.norm() > 0 else torch.tensor(1.0)
            dg = (RTOL_GRAD_FIRST if t == 1 else RTOL_GRAD) * p.grad.abs().max()
            dr = dg * (1 + m_hat.abs() / d) / d
            bound[k] += lr * trust * (dr + r.abs() * dr.norm() / r.norm().clamp_min(1e-30)) \
                + EPS32 * before[k].abs()
    return {k: v.detach().clone() for k, v in named.items()}, bound


@pytest.mark.slow
@pytest.mark.parametrize("plan,blind,same", [
    (dict(dp=1, tp=2, family="megatron"), False, True),
    (dict(dp=2, tp=1, zero=3), False, True),
    (dict(dp=1, tp=2, family="megatron"), True, False),
])
def test_lamb_under_sharding_equals_one_process(tiny_full, plan, blind, same):
    out = spawn_ranks(_train, 2, (hand_plan(tiny_full, **plan).to_json(), blind), timeout_s=60)
    want, bound = _reference()
    assert set(out[0]["sd"]) == set(want)
    ratio, where = max((((out[0]["sd"][k] - want[k]).abs() / bound[k].clamp_min(1e-30)).max().item(), k)
                        for k in want)
    assert (ratio <= 1.0) is same, f"{plan} blind={blind}: {where} differs by {ratio:.2e} x its round-off bound"
