"""autopar.optim.LAMB: a torch.optim.Optimizer over the fused LAMB step whose per-tensor trust
ratio stays the whole tensor's when autoparallelize hands it shards (tensor parallel, ZeRO).

One process: equal to ``lamb_step_ref`` applied to each tensor on its own. Two gloo ranks (tp=2,
dp=2 + ZeRO-1, dp=2 + ZeRO-3): parameters after 3 steps equal the same training on one process;
with the shard groups withheld (norms of shards) tp=2 does not, so the test can tell."""
from __future__ import annotations

import pytest
import torch

from autopar.optim import LAMB
from autopar.runtime.launch import spawn_ranks
from bodies import STEPS, batches, build, max_diff
from handplans import hand_plan
from kernels.optimizers import lamb_step_ref

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


def _reference() -> dict:
    b = build(False)
    m = b.module
    opt = LAMB(m.parameters(), **HP)
    for x, y in batches(b)[:STEPS]:
        opt.zero_grad(set_to_none=True)
        b.loss_fn(m(*x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in m.named_parameters(remove_duplicate=False)}


@pytest.mark.slow
@pytest.mark.parametrize("plan,blind,same", [
    (dict(dp=1, tp=2, family="megatron"), False, True),
    (dict(dp=2, tp=1, zero=1), False, True),
    (dict(dp=2, tp=1, zero=3), False, True),
    (dict(dp=1, tp=2, family="megatron"), True, False),
])
def test_lamb_under_sharding_equals_one_process(tiny_full, plan, blind, same):
    out = spawn_ranks(_train, 2, (hand_plan(tiny_full, **plan).to_json(), blind), timeout_s=60)
    diff, where = max_diff(out[0]["sd"], _reference())
    assert (diff <= 1e-5) is same, f"{plan} blind={blind}: {where} differs by {diff:.2e}"
