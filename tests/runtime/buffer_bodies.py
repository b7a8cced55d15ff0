"""Rank jobs and their one-process reference for ``test_buffers_and_targets.py``: a small
conv + linear network with BatchNorm2d / BatchNorm1d (running statistics, ``num_batches_tracked``)
and a hand-written cache buffer, trained with SGD; and dropout / no-dropout models for the
random-ops warning. Module-level: spawned ranks import this file."""
from __future__ import annotations

import os
import warnings

import torch
from torch import nn

BATCH = 8            # divisible by dp=2
STEPS = 3
LR = 0.1
DATA_SEED = 1


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, h):
        return h + torch.relu(self.bn(self.fc(h)))


class BNNet(nn.Module):
    """conv -> BatchNorm2d -> linear -> 2 identical (linear, BatchNorm1d) blocks -> head. The
    blocks are a ModuleList so ``recompute=full`` makes each one a recompute region. ``last``
    is a cache a forward writes (``copy_``), ``calls`` a counter (``+= 1``)."""

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn2d = nn.BatchNorm2d(4)
        self.inp = nn.Linear(4 * 4 * 4, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.head = nn.Linear(width, classes)
        self.register_buffer("last", torch.zeros(width))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = torch.relu(self.bn2d(self.conv(x))).flatten(1)
        h = self.inp(h)
        for b in self.blocks:
            h = b(h)
        if self.training:
            self.last.copy_(h.detach().mean(0))
            self.calls += 1
        return self.head(h)


def build() -> nn.Module:
    torch.manual_seed(0)
    return BNNet()


def data(n: int = STEPS + 1):
    """``n`` global batches (x, y); the last one for the eval-mode forward."""
    g = torch.Generator().manual_seed(DATA_SEED)
    return [(torch.randn(BATCH, 3, 4, 4, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(n)]


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def reference() -> dict:
    """One process: 3 SGD steps on the global batches, then the eval-mode forward."""
    m = build()
    opt = sgd(m.parameters())
    batches = data()
    losses = []
    for x, y in batches[:STEPS]:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    m.eval()
    with torch.no_grad():
        out = m(batches[STEPS][0])
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return {"losses": losses, "state": state, "eval_out": out}


def bn_job(rank: int, world: int, job: dict) -> dict:
    """One autoparallelize run: ``job`` has ``force`` (None: the free plan), ``deferred`` (no
    example_target: built on the first step) and ``engine`` (default "auto")."""
    from autopar.api import autoparallelize

    m = build()
    batches = data()
    x0, y0 = batches[0]
    pm = autoparallelize(m, x0, loss_fn=loss_fn, example_target=None if job.get("deferred") else y0,
                         optimizer=sgd, force=job.get("force"), timeout_s=60, engine=job.get("engine", "auto"))
    res: dict = {}
    if job.get("deferred"):
        try:
            pm(x0)
            res["early_call"] = "no error"
        except RuntimeError as e:
            res["early_call"] = str(e)
    losses = [pm.step(x, y) for x, y in batches[:STEPS]]
    sd = pm.full_state_dict()
    pm.eval()
    out = pm(batches[STEPS][0])
    res.update(losses=losses, state=sd, eval_out=out, recompute=pm.plan.recompute,
               dims=tuple(pm.mesh.shape), regions=len(pm.program.regions), engine=pm.engine, reason=pm.engine_reason)
    return res


# ---- random ops ------------------------------------------------------------------------------

class WithDropout(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def random_warning_job(rank: int, world: int, p: float) -> int:
    """RandomOpsWarnings raised by autoparallelize, 2 steps and a train-mode and an eval-mode
    forward (the forward graphs are traced again) of a model with ``nn.Dropout(p)``."""
    from autopar.api import RandomOpsWarning, autoparallelize

    torch.manual_seed(0)
    m = WithDropout(p)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autoparallelize(m, x, loss_fn=loss_fn, example_target=y, optimizer=sgd, force="dp=2",
                             timeout_s=60)
        pm.step(x, y)
        pm.step(x, y)
        pm(x)
        pm.eval()
        pm(x)
    return sum(issubclass(w.category, RandomOpsWarning) for w in caught)


def _caught(fn, *args):
    """``fn(*args)``, or the error it raised (every rank raises alike in these jobs, so the next
    job still runs; each test then fails on its own job)."""
    try:
        return fn(*args)
    except Exception as e:  # reported to the test, which fails with it
        return {"error": f"{type(e).__name__}: {str(e)[:2000]}"}


def all_jobs(rank: int, world: int, bn: list, dropout_ps: list) -> dict:
    return {"bn": [_caught(bn_job, rank, world, j) for j in bn],
            "warnings": [_caught(random_warning_job, rank, world, p) for p in dropout_ps]}


def plan_outcome_job(rank: int, world: int, spec: str, force: str) -> dict:
    """What ``autoparallelize`` tells the user on this rank: the IdleAxisWarnings it raised, or the
    class of the planning error every rank catches."""
    from autopar.api import IdleAxisWarning, autoparallelize
    from autopar.models import build_model
    from autopar.solver.errors import PlanningError

    b = build_model(spec, device="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                            force=force, model_name=spec, timeout_s=60)
        except PlanningError as e:
            return {"error": type(e).__name__, "message": str(e)}
    idle = [w for w in caught if issubclass(w.category, IdleAxisWarning)]
    return {"idle": [str(w.message) for w in idle], "where": [os.path.basename(w.filename) for w in idle]}
