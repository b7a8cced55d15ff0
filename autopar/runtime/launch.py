"""Launching N CPU ranks (gloo) and ``autopar run``'s backend.

``spawn_ranks(fn, nproc, args)`` starts ``nproc`` processes (forkserver with torch preloaded, so a
rank starts in a fraction of a second), joins them into one gloo world on a free local port with
``timeout_s``, runs ``fn(rank, world, *args)`` and returns every rank's result. If any rank raises,
the others are terminated at once and ``RankFailure`` carries every rank's error; if the whole
run exceeds ``timeout_s`` plus a grace period, every rank is killed. Nothing is left running.

``run_command`` trains a model from the zoo on N ranks and on one process with the same data:

    from autopar.runtime.launch import run_command
    run_command("gpt-tiny", nproc=2, steps=3, force="dp=2")
"""
from __future__ import annotations

import datetime
import io
import json
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from typing import Any, Callable, Optional, Sequence

DEFAULT_RUN_TIMEOUT_S = 300.0


class RankFailure(RuntimeError):
    """One or more ranks failed. The message holds every rank's error and traceback; ``errors``
    maps each failed rank to its exception as ``"Type: message"`` (no traceback)."""

    def __init__(self, message: str, errors: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})

    def summary(self) -> str:
        """Each distinct error once, with the ranks that raised it (their first lines are what
        the user must read; the tracebacks stay in ``str(self)``)."""
        if not self.errors:
            return str(self)
        by_msg: dict[str, list[int]] = {}
        for r, msg in sorted(self.errors.items()):
            by_msg.setdefault(msg, []).append(r)
        return "\n".join(f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: {msg}"
                         for msg, rs in by_msg.items())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world: int, port: int, timeout_s: float, args: tuple, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        out = fn(rank, world, *args)
        buf = io.BytesIO()                   # tensors by value: the rank exits before the parent reads
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # reported to the parent, which raises RankFailure
        results.put((rank, "error", (f"{type(e).__name__}: {e}", traceback.format_exc())))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "autopar.api"])
    return ctx


def spawn_ranks(fn: Callable, nproc: int, args: Sequence[Any] = (), *, timeout_s: float = 60.0,
                grace_s: float = 30.0) -> list:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` gloo ranks; results in rank order.

    ``fn`` must be importable (a module-level function). ``timeout_s`` is the process-group
    timeout; the whole run is killed after ``timeout_s + grace_s``."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, nproc, port, timeout_s, tuple(args), results),
                         daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s + grace_s
    try:
        while len(got) < nproc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailure(f"ranks {sorted(set(range(nproc)) - set(got))} did not finish within "
                                  f"{timeout_s + grace_s:.0f} s; all ranks killed")
            try:
                rank, status, payload = results.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got and p.exitcode]
                if dead:
                    time.sleep(0.5)                 # a result may still be in the pipe
                    if results.empty():
                        raise RankFailure(f"ranks {dead} exited with codes "
                                          f"{[procs[r].exitcode for r in dead]} without a result")
                continue
            got[rank] = (status, payload)
            if status == "error":
                _collect_errors(results, got, procs, wait_s=min(5.0, timeout_s))
                errors = {r: p for r, (s, p) in sorted(got.items()) if s == "error"}
                raise RankFailure("rank failure(s):\n" + "\n".join(f"--- rank {r} ---\n{msg}\n{tb}"
                                                                  for r, (msg, tb) in errors.items()),
                                  {r: msg for r, (msg, _) in errors.items()})
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    import torch

    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(nproc)]


def _collect_errors(results, got: dict, procs, wait_s: float) -> None:
    """After a first error, give the other ranks a moment to report theirs (same error on every
    rank is what plan checks promise), then stop waiting."""
    end = time.monotonic() + wait_s
    while len(got) < len(procs) and time.monotonic() < end:
        try:
            rank, status, payload = results.get(timeout=0.2)
            got[rank] = (status, payload)
        except queue_mod.Empty:
            if all(not p.is_alive() for r, p in enumerate(procs) if r not in got):
                return


# ---- autopar run ------------------------------------------------------------------------------

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
