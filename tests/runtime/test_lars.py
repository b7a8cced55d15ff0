"""autopar.optim.LARS: a torch.optim.Optimizer over the fused LARS step whose per-tensor local rate
stays the whole tensor's when autoparallelize hands it shards (tensor parallel and ZeRO at once).

One process: equal to ``lars_step_ref`` applied to each tensor on its own. Four gloo ranks, dp=2 x
tp=2 (Megatron) with ZeRO-3: a tp-sharded weight is split over both axes (its squared norms go
through two all-reduces), every other tensor over dp. Losses and parameters after 3 steps equal
the same training on one process within what gradient round-off allows element by element
(``_reference``); with the shard groups withheld (norms of shards) they do not, so the test can
tell. Both runs share one launch of the ranks (starting four ranks is most of the time)."""
from __future__ import annotations

import math

import pytest
import torch

from autopar.optim import LARS
from autopar.runtime.launch import spawn_ranks
from bodies import EPS32, RTOL_GRAD, RTOL_GRAD_FIRST, RTOL_LOSS, STEPS, batches, build
from handplans import hand_plan
from autopar.kernels.optimizers import lars_step_ref

# lr * trust_coefficient = 2e-2: each step moves a tensor by ~2% of its norm (more as the momentum
# builds up), so 3 steps change the losses visibly and a wrong local rate shows.
HP = dict(lr=1.0, momentum=0.9, weight_decay=1e-2, trust_coefficient=2e-2)
PLAN = dict(dp=2, tp=2, zero=3, family="megatron")


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((7, 5), (33,), (3, 4, 2), (), (6,))]
    ps[-1].data.zero_()                      # ||p|| = 0: rate 1 by rule
    return ps


@pytest.mark.parametrize("hp", [HP, dict(HP, nesterov=True, trust_clip=True),
                                dict(HP, weight_decay=0.0)])      # wd 0: plain momentum SGD
def test_lars_equals_the_reference_per_tensor(hp):
    params, ref = _params(), [p.detach().clone() for p in _params()]
    opt = LARS(params, **hp)
    bufs = [torch.zeros_like(p) for p in ref]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in ref]
        grads[0].zero_()                     # ||g|| = 0: rate 1 by rule
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        opt.step()
        for p, gr, b in zip(ref, grads, bufs):
            lars_step_ref(*(t.reshape(-1) for t in (p, gr, b)), [0, p.numel()], **hp)
    # the same fp32 operations per element; only the norms' sums run in another order (1e-6)
    for got, want in zip(params, ref):
        torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (dict(lr=-1.0), "lr=-1.0: use a finite rate >= 0"),
    (dict(momentum=1.0), "momentum=1.0: use a value in"),
    (dict(weight_decay=-1e-4), "weight_decay=-0.0001: use a finite value >= 0"),
    (dict(trust_coefficient=0.0), "trust_coefficient=0.0: use a finite value > 0"),
    (dict(eps=float("nan")), "eps=nan"),
    (dict(momentum=0.0, nesterov=True), "nesterov=True needs momentum > 0"),
    (dict(lr=0.0, trust_clip=True), "trust_clip=True divides the local rate by lr"),
])
def test_lars_refuses_bad_hyper_parameters(bad, match):
    with pytest.raises(ValueError, match=match):
        LARS(_params(), **bad)
    with pytest.raises(ValueError, match=match):     # a param group's override is checked too
        LARS(_params()[:1], **HP).add_param_group({"params": _params()[1:], **bad})


def test_lars_refuses_what_it_cannot_do():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="LARS: parameters and gradients must be fp32"):
        LARS([p]).step()


def test_autopar_run_offers_lars():
    from autopar.cli import _parser
    from autopar.cli_run import OPTIMIZERS, make_optimizer

    assert "lars" in OPTIMIZERS
    assert _parser().parse_args(["run", "gpt-tiny", "--optimizer", "lars"]).optimizer == "lars"
    assert type(make_optimizer("lars", _params())) is LARS


class _Recording(LARS):
    """LARS that keeps, per parameter, the ranks of each process group it was told of."""

    def set_shard_groups(self, groups) -> None:
        import torch.distributed as dist

        self.shard_ranks = [[tuple(dist.get_process_group_ranks(g)) for g in gs] for gs in groups.values()]
        super().set_shard_groups(groups)


class _ShardBlind(_Recording):
    def set_shard_groups(self, groups) -> None:      # recorded, then norms of the local shards only
        super().set_shard_groups(groups)
        LARS.set_shard_groups(self, {})


def _train(rank: int, world: int, plan_json: str) -> dict:
    from autopar.api import autoparallelize
    from autopar.plan import Plan

    out = {}
    for name, cls in (("lars", _Recording), ("blind", _ShardBlind)):
        b = build(False)
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             optimizer=lambda ps, cls=cls: cls(ps, **HP), plan=Plan.from_json(plan_json),
                             timeout_s=30)
        losses = [pm.step(x, y) for x, y in batches(b)[:STEPS]]
        sd = pm.full_state_dict()
        out[name] = {"losses": losses, "sd": sd if rank == 0 else None, "groups": pm.optimizer.shard_ranks}
    return out


def _reference() -> dict:
    """The same training on one process: losses, the parameters after STEPS steps, and bounds,
    element by element, on how far round-off alone can move them (below)."""
    b = build(False)
    m = b.module
    opt = LARS(m.parameters(), **HP)
    hp = opt.defaults
    lr, mu, wd, tc, eps = (hp[k] for k in ("lr", "momentum", "weight_decay", "trust_coefficient", "eps"))
    named = dict(m.named_parameters(remove_duplicate=False))
    bound = {k: torch.zeros_like(p) for k, p in named.items()}      # on |p_ranks - p_ref|
    buf_bound = {k: torch.zeros_like(p) for k, p in named.items()}  # on the momentum buffers'
    losses, loss_bound = [], []
    for t, (x, y) in enumerate(batches(b)[:STEPS], start=1):
        before = {k: p.detach().clone() for k, p in named.items()}
        opt.zero_grad(set_to_none=True)
        loss = b.loss_fn(m(*x), y)
        loss.backward()
        # reordered sums (RTOL_LOSS, bodies.py) and, to first order, g . dp for the parameters
        # that already differ (dp ~1e-6 here: the second-order term is ~1e-12)
        loss_bound.append(RTOL_LOSS * abs(loss.item())
                          + sum((p.grad * bound[k]).abs().sum().item() for k, p in m.named_parameters()))
        losses.append(loss.item())
        opt.step()
        # LARS moves p by lr * b, b = mu * b + d, d = r (g + wd p), r = tc W / (G + wd W + eps),
        # W = ||p||, G = ||g||. A gradient round-off dg (per entry <= RTOL_GRAD * max|g|,
        # bodies.py) and the parameters' difference dp move d by <= r (dg + wd dp) + |d| dr / r,
        # dr / r <= (sqrt(n) dg + wd ||dp||) / (G + wd W) + ||dp|| / W + n EPS32: the last term
        # bounds both norms' fp32 sums of n squares taken in another order (each <= n EPS32 / 2
        # relative, halved again by the sqrt; a factor 2 to spare). No division by tiny
        # denominators per element (unlike Adam): LARS is linear in g at a fixed rate. Plus an
        # ulp of b and of p per rounded update.
        for k, p in named.items():
            g, w, n = p.grad, before[k], p.numel()
            W, G = w.norm().item(), g.norm().item()
            dg = (RTOL_GRAD_FIRST if t == 1 else RTOL_GRAD) * g.abs().max().item()
            u = g + wd * w
            dp = bound[k]
            if W > 0 and G > 0:
                r = tc * W / (G + wd * W + eps)
                rel = (math.sqrt(n) * dg + wd * dp.norm().item()) / (G + wd * W) + dp.norm().item() / W + n * EPS32
            else:
                r, rel = 1.0, 0.0
            buf = opt.state[p]["momentum_buffer"]
            buf_bound[k] = mu * buf_bound[k] + r * (dg + wd * dp) + r * u.abs() * rel + EPS32 * buf.abs()
            bound[k] = dp + lr * buf_bound[k] + EPS32 * w.abs()
    return {"losses": losses, "loss_bound": loss_bound,
            "sd": {k: v.detach().clone() for k, v in named.items()}, "bound": bound}


def _worst(run: dict, want: dict) -> tuple[float, str]:
    """The largest difference / bound over the losses and every parameter entry, and where."""
    worst = [(abs(a - e) / bd, f"loss {t + 1}: {a!r} vs {e!r}")
             for t, (a, e, bd) in enumerate(zip(run["losses"], want["losses"], want["loss_bound"]))]
    worst += [(((run["sd"][k] - want["sd"][k]).abs() / want["bound"][k].clamp_min(1e-30)).max().item(), k)
              for k in want["sd"]]
    return max(worst)


@pytest.mark.slow
def test_lars_under_tp_and_zero3_equals_one_process(tiny_full):
    out = spawn_ranks(_train, 4, (hand_plan(tiny_full, **PLAN).to_json(),), timeout_s=60)
    want = _reference()
    for rank, res in enumerate(out):
        groups = res["lars"]["groups"]
        # ZeRO-3 over dp=2: every tensor is split over its dp pair; Megatron: the attention and
        # MLP weights also over the tp pair (two groups). Both axes really split parameters.
        assert groups and all(len(gs) >= 1 for gs in groups), f"rank {rank}: a parameter without dp group"
        assert sum(len(gs) == 2 for gs in groups) >= 4, f"rank {rank}: no tensor split over tp: {groups}"
        assert {len(set(r)) for gs in groups for r in gs} == {2}, groups
        assert res["blind"]["groups"] == groups
        assert len(res["lars"]["losses"]) == STEPS
    assert set(out[0]["lars"]["sd"]) == set(want["sd"])
    ratio, where = _worst(out[0]["lars"], want)
    assert ratio <= 1.0, f"{where} differs by {ratio:.2e} x its round-off bound"
    for rank, res in enumerate(out[1:], start=1):       # every rank saw the same losses
        assert res["lars"]["losses"] == out[0]["lars"]["losses"], rank
    blind, where = _worst(out[0]["blind"], want)
    assert blind > 1.0, f"norms of shards passed as whole-tensor norms (worst {where}: {blind:.2e})"
