"""``autopar run MODEL --nproc N --steps K``: train on N CPU ranks and on one process, compare.

The command line's job (not the runtime's): plan or load a plan, start the ranks
(``runtime/launch.spawn_ranks``), train through ``autoparallelize`` on generated batches, train the
same model on one process with the same initial weights and batches, print both loss curves, rank
0's traffic per mesh axis and any idle axis.

    from autopar.cli_run import run_command
    run_command("gpt-tiny", nproc=2, steps=3, force="dp=2")
"""
from __future__ import annotations

import json
import sys
import time
from typing import Optional

from autopar.runtime.launch import DEFAULT_RUN_TIMEOUT_S, RankFailure, spawn_ranks

OPTIMIZERS = ("adamw", "lamb")


def make_optimizer(name: str, params):
    """``autopar run``'s optimizers: AdamW (lr 3e-4) or autopar's LAMB (lr 2e-3)."""
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=3e-4)
    if name == "lamb":
        from autopar.optim import LAMB

        return LAMB(params, lr=2e-3)
    raise ValueError(f"optimizer {name!r}: choose one of {OPTIMIZERS}")


def _train_rank(rank: int, world: int, model: str, steps: int, plan_json: Optional[str], force,
                batch: Optional[int], seq_len: Optional[int], seed: int, timeout_s: float,
                optimizer: str) -> dict:
    import torch

    from autopar.api import autoparallelize
    from autopar.models import build_model
    from autopar.plan import Plan

    b = build_model(model, batch=batch, seq_len=seq_len, device="meta")
    plan = Plan.from_json(plan_json) if plan_json else None
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn,
                         example_target=b.example_target, plan=plan, force=force, seed=seed,
                         timeout_s=timeout_s, model_name=model,
                         optimizer=lambda params: make_optimizer(optimizer, params))
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        inputs, target = b.make_batch(b.example_inputs[0].shape[0], gen)
        losses.append(pm.step(inputs, target))
    if rank:
        return {"losses": losses}
    from autopar.runtime.collectives import traffic_by_axis

    return {"losses": losses, "plan": pm.plan.to_json(), "collectives": traffic_by_axis(pm.collectives)}


def reference_losses(model: str, steps: int, *, batch: Optional[int], seq_len: Optional[int],
                     seed: int, optimizer: str = "adamw") -> list[float]:
    """The same training on one process: autopar's init (``materialize``), same batches, same
    optimizer."""
    import torch

    from autopar.models import build_model
    from autopar.runtime.init import materialize

    b = build_model(model, batch=batch, seq_len=seq_len, device="meta")
    m = materialize(b.module, seed)
    opt = make_optimizer(optimizer, m.parameters())
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        inputs, target = b.make_batch(b.example_inputs[0].shape[0], gen)
        opt.zero_grad(set_to_none=True)
        loss = b.loss_fn(m(*inputs), target)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _print_plan(plan) -> None:
    from autopar.report import degrees_table, make_console, strategies_table

    console = make_console()
    console.print(degrees_table(plan))
    console.print(strategies_table(plan))


def _check_trainable(model: str, batch: Optional[int], seq_len: Optional[int]) -> None:
    """Errors in the model spec (and a model without a loss) surface here, once, before any rank
    starts."""
    from autopar.models import build_model

    b = build_model(model, batch=batch, seq_len=seq_len, device="meta")
    if b.loss_fn is None:
        raise ValueError(f"{model} returns (module, example_inputs) without a loss; `autopar run` trains, "
                         "so return (module, example_inputs, loss_fn, example_target) (or a dict with "
                         "'loss_fn' and 'example_target'); `autopar plan` accepts the model as it is")


def run_command(model: str, nproc: int, steps: int, plan_path: Optional[str] = None, force=None,
                json_path: Optional[str] = None, batch: Optional[int] = None,
                seq_len: Optional[int] = None, seed: int = 0,
                timeout_s: float = DEFAULT_RUN_TIMEOUT_S, optimizer: str = "adamw") -> dict:
    """``autopar run MODEL --nproc N --steps K``: train on N CPU ranks (planned by the solver for a
    "cpu" cluster of N, or ``plan_path``), then on one process; print and return the losses.
    ``optimizer``: "adamw" or "lamb" (``autopar.optim.LAMB``, exact under tp and ZeRO shards)."""
    from autopar.plan import Plan

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {optimizer!r}: choose one of {OPTIMIZERS}")
    _check_trainable(model, batch, seq_len)
    plan_json = Plan.load(plan_path).to_json() if plan_path else None
    t0 = time.monotonic()
    try:
        outs = spawn_ranks(_train_rank, nproc, (model, steps, plan_json, force, batch, seq_len, seed,
                                               timeout_s, optimizer), timeout_s=timeout_s)
    except RankFailure as e:
        print(f"autopar run {model} on {nproc} ranks failed; every rank was stopped.\n" + e.summary(),
              file=sys.stderr)
        raise
    wall = time.monotonic() - t0
    plan = Plan.from_json(outs[0]["plan"])
    _print_plan(plan)
    losses = outs[0]["losses"]
    for i, l in enumerate(losses):
        print(f"step {i + 1}: loss {l:.6f}")
    ref = reference_losses(model, steps, batch=batch, seq_len=seq_len, seed=seed, optimizer=optimizer)
    diff = max((abs(a - b) for a, b in zip(losses, ref)), default=0.0)
    print("reference (1 process): " + ", ".join(f"{l:.6f}" for l in ref))
    print(f"max |loss - reference| = {diff:.3e}   ({nproc} ranks, {wall:.1f} s)")
    from autopar.report import idle_axis_notes

    traffic = outs[0]["collectives"]
    print(f"rank 0 communicated over {steps} steps (setup included): " + (", ".join(
        f"{axis}: {t['count']} collectives, {t['bytes'] / 1e6:.3f} MB" for axis, t in traffic.items()) or "nothing"))
    for note in idle_axis_notes(plan):
        print(f"note: {note}")
    result = {"losses": losses, "reference_losses": ref, "max_abs_diff": diff, "summary": plan.summary(),
              "collectives": traffic, "plan": plan.to_dict()}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result
