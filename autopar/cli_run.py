"""``autopar run MODEL --nproc N --steps K``: train on N CPU ranks and on one process, compare.

The command line's job (not the runtime's): plan or load a plan, start the ranks
(``runtime/launch.spawn_ranks``), train through ``autoparallelize`` on generated batches, train the
same model on one process with the same initial weights and batches, print both loss curves, rank
0's traffic per mesh axis and any idle axis.

    from autopar.cli_run import run_command
    run_command("gpt-tiny", nproc=2, steps=3, force="dp=2")
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings
from typing import Callable, Optional

from autopar.runtime.launch import DEFAULT_RUN_TIMEOUT_S, RankFailure, spawn_ranks

OPTIMIZERS = ("adamw", "lamb", "lars")


def make_optimizer(name: str, params):
    """``autopar run``'s optimizers: AdamW (lr 3e-4, ``autopar.optim.adamw``: fused), autopar's LAMB
    (lr 2e-3) or autopar's LARS (lr 1.0, momentum 0.9, weight decay 1e-4, trust coefficient 1e-3:
    its defaults)."""
    if name == "adamw":
        from autopar.optim import adamw

        return adamw(params, lr=3e-4)
    if name == "lamb":
        from autopar.optim import LAMB

        return LAMB(params, lr=2e-3)
    if name == "lars":
        from autopar.optim import LARS

        return LARS(params, lr=1.0)
    raise ValueError(f"optimizer {name!r}: choose one of {OPTIMIZERS}")


def _train_rank(rank: int, world: int, model: str, steps: int, plan_json: Optional[str], force,
                batch: Optional[int], seq_len: Optional[int], seed: int, timeout_s: float,
                optimizer: str, checkpoint: Optional["CheckpointArgs"] = None, memory: bool = False,
                dtype: Optional[str] = None, nvme_dir: Optional[str] = None, engine: str = "auto",
                host_step: str = "auto") -> dict:
    from autopar.api import IdleAxisWarning, autoparallelize
    from autopar.models import build_model
    from autopar.plan import Plan

    b = build_model(model, batch=batch, seq_len=seq_len, device="meta")
    plan = Plan.from_json(plan_json) if plan_json else None
    with warnings.catch_warnings():        # the command prints the idle-axis notes itself, once
        warnings.simplefilter("ignore", IdleAxisWarning)
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn,
                             example_target=b.example_target, plan=plan, force=force, seed=seed,
                             timeout_s=timeout_s, model_name=model,
                             optimizer=lambda params: make_optimizer(optimizer, params),
                             resume=checkpoint.directory if checkpoint is not None and checkpoint.resume else None,
                             dtype=dtype, nvme_dir=nvme_dir, engine=engine, host_step=host_step)
    measured: list = []
    step = None
    if memory:                    # the last step runs measured (``runtime/memory_measure.py``)
        from autopar.runtime.memory_measure import measure_step

        def step(inputs, target):
            if pm.steps_done + 1 < steps:
                return pm.step(inputs, target)
            loss, m = measure_step(pm, inputs, target)
            measured.append(dataclasses.asdict(m))
            return loss

    try:
        losses = train_steps(pm, b, steps, seed, checkpoint, step=step)    # pm.step reports progress
    finally:
        pm.close()                   # an NVMe offload's files go now
    out = {"losses": losses, "first_step": pm.steps_done - len(losses) + 1, "engine": pm.engine,
           "engine_reason": pm.engine_reason}
    if measured:
        out["memory"] = measured[-1]
    if pm.resumed is not None:
        out["resumed"] = pm.resumed.change_line(pm.plan)
    if rank:
        return out
    from autopar.runtime.collectives import traffic_by_axis

    return {**out, "plan": pm.plan.to_json(), "collectives": traffic_by_axis(pm.collectives)}


@dataclasses.dataclass(frozen=True)
class CheckpointArgs:
    """``autopar run --checkpoint-dir D [--checkpoint-every K] [--resume]``."""
    directory: str
    every: Optional[int] = None       # also save after every K-th step (the last step always saves)
    resume: bool = False              # continue from D's last checkpoint
    keep: Optional[int] = 3           # committed steps kept in D (None: all)


def train_steps(pm, b, steps: int, seed: int, checkpoint: Optional[CheckpointArgs] = None,
                after_step: Optional[Callable[[int], None]] = None, scheduler=None,
                step: Optional[Callable] = None) -> list[float]:
    """Train ``pm`` on ``b``'s generated batches up to step ``steps`` (from ``pm.steps_done``, the
    step a resumed checkpoint ended at, with the batch generator where it was); save into
    ``checkpoint`` every K steps and at the end (written in the background while the next steps
    run; the last one waited for); ``after_step(step)`` after each step (and its
    save); ``scheduler``: an LR scheduler stepped after each step, saved and restored with the
    checkpoint; ``step(inputs, target) -> loss`` in place of ``pm.step``. The losses of the steps run."""
    import torch

    from autopar.runtime.checkpoint import record_progress

    gen = torch.Generator().manual_seed(seed)
    if pm.resumed is not None:
        if "data_rng" in pm.resumed.extra:
            gen.set_state(torch.tensor(pm.resumed.extra["data_rng"], dtype=torch.uint8))
        if scheduler is not None:
            scheduler.load_state_dict(pm.resumed.extra["lr_scheduler"])
    losses = []
    while pm.steps_done < steps:
        inputs, target = b.make_batch(b.example_inputs[0].shape[0], gen)
        losses.append(pm.step(inputs, target) if step is None else step(inputs, target))
        if scheduler is not None:
            scheduler.step()
        if checkpoint is not None:
            record_progress(checkpoint.directory, pm.steps_done)
        if checkpoint is not None and (pm.steps_done == steps or (
                checkpoint.every and pm.steps_done % checkpoint.every == 0)):
            extra = {"data_rng": gen.get_state().tolist()}
            if scheduler is not None:
                extra["lr_scheduler"] = scheduler
            pm.save(checkpoint.directory, extra=extra, keep=checkpoint.keep, asynchronous=True)
        if after_step is not None:
            after_step(pm.steps_done)
    pm.wait_for_save()
    return losses


def reference_losses(model: str, steps: int, *, batch: Optional[int], seq_len: Optional[int],
                     seed: int, optimizer: str = "adamw", dtype: Optional[str] = None) -> list[float]:
    """The same training on one process: autopar's init (``materialize``), same batches, same
    optimizer; ``dtype`` bf16/fp16: under ``torch.autocast`` (fp16 with ``torch.amp.GradScaler``),
    the policy ``runtime/precision.py`` runs."""
    import contextlib

    import torch

    from autopar.models import build_model
    from autopar.runtime.init import materialize
    from autopar.runtime.precision import parse_dtype

    b = build_model(model, batch=batch, seq_len=seq_len, device="meta")
    m = materialize(b.module, seed)
    opt = make_optimizer(optimizer, m.parameters())
    low = parse_dtype(dtype) if dtype else torch.float32
    mixed = low != torch.float32
    scaler = torch.amp.GradScaler("cpu") if low == torch.float16 else None
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        inputs, target = b.make_batch(b.example_inputs[0].shape[0], gen)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=low) if mixed else contextlib.nullcontext():
            loss = b.loss_fn(m(*inputs), target)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(float(loss.detach()))
    return losses


def _print_plan(plan) -> None:
    from autopar.report import degrees_table, make_console, strategies_table

    console = make_console()
    console.print(degrees_table(plan))
    console.print(strategies_table(plan))


def _memory_report(plan, model: str, batch: Optional[int], seq_len: Optional[int], optimizer: str, outs):
    """Print each rank's measured peak by category next to the plan's prediction (for the dtype
    the parameters have); the rows."""
    from autopar.report import make_console
    from autopar.runtime.memory_measure import compare_model, memory_table

    rows = compare_model(plan, model, [o["memory"] for o in outs], optimizer, batch=batch, seq_len=seq_len)
    console = make_console()
    for row in rows:
        console.print(memory_table(row))
    return rows


def _checkpoint_args(directory: Optional[str], every: Optional[int], resume: bool, steps: int):
    """--checkpoint-dir / --checkpoint-every / --resume, checked before any rank starts."""
    if directory is None:
        if every is not None or resume:
            raise ValueError("--checkpoint-every and --resume need --checkpoint-dir DIR")
        return None
    if resume:
        from autopar.runtime.checkpoint import read_meta, resolve

        saved = read_meta(resolve(directory))["step"]
        if saved >= steps:
            raise ValueError(f"the checkpoint in {directory} is at step {saved}, so --steps {steps} leaves "
                             f"nothing to run; give --steps > {saved}")
    return CheckpointArgs(directory, every, resume)


def check_plan_dtype(plan_path: Optional[str], plan_json: Optional[str], dtype: Optional[str]) -> None:
    """``--plan FILE`` with ``--dtype``: the plan must have been made for that compute dtype."""
    if not plan_path or dtype is None:
        return
    from autopar.plan import Plan
    from autopar.runtime.precision import dtype_name, parse_dtype

    planned = Plan.from_json(plan_json).dtype
    if parse_dtype(planned) != parse_dtype(dtype):
        raise ValueError(f"--dtype {dtype}: the plan {plan_path} was made for {planned} compute; re-plan with "
                         f"`autopar plan ... --dtype {dtype}`, or drop --dtype to run the plan's "
                         f"({dtype_name(parse_dtype(planned))})")


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
                timeout_s: float = DEFAULT_RUN_TIMEOUT_S, optimizer: str = "adamw",
                checkpoint_dir: Optional[str] = None, checkpoint_every: Optional[int] = None,
                resume: bool = False, memory: bool = False, dtype: Optional[str] = None,
                nvme_dir: Optional[str] = None, engine: str = "auto", host_step: str = "auto") -> dict:
    """``autopar run MODEL --nproc N --steps K``: train on N CPU ranks (planned by the solver for a
    "cpu" cluster of N, or ``plan_path``), then on one process; print and return the losses.
    ``optimizer``: "adamw", "lamb" or "lars" (``autopar.optim.LAMB`` / ``LARS``, per-tensor norms
    exact under tp and ZeRO shards).
    ``timeout_s`` (``--timeout``): every collective's timeout; the ranks report each step, and the
    run is stopped when no rank finishes one for ``timeout_s`` + 30 s (``runtime/launch.py``: a
    dead rank stops it at once, a stuck one after 30 s without heartbeat).
    ``checkpoint_dir``: save there at the end and every ``checkpoint_every`` steps; ``resume``:
    continue from its last checkpoint up to step ``steps`` (the losses are those of the steps run,
    ``"first_step"`` the first one's number; the reference trains from step 1 and is compared on
    the same steps). ``memory`` (``--memory``): the last step runs measured; each rank's peak by
    category is printed next to the plan's prediction and returned as ``"memory"``
    (``runtime/memory_measure.py``). ``dtype`` (``--dtype``): "bf16"/"fp16" plan and run mixed
    precision (``runtime/precision.py``), the reference under ``torch.autocast``. ``nvme_dir``
    (``--nvme-dir``): where a plan that offloads to NVMe keeps its files (removed at the end).
    ``engine`` (``--engine``): "auto", "emitted" or "interpreter" (``autopar/engine.py``).
    ``host_step`` (``--host-step``): "auto", "overlap" or "sync": an offloaded optimizer's CPU step
    beside the next forward or not (``runtime/host_step.py``)."""
    from autopar.plan import Plan

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {optimizer!r}: choose one of {OPTIMIZERS}")
    from autopar.engine import ENGINES

    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    from autopar.runtime.host_step import HOST_STEPS

    if host_step not in HOST_STEPS:
        raise ValueError(f"--host-step {host_step!r}: choose one of {', '.join(HOST_STEPS)}")
    _check_trainable(model, batch, seq_len)
    checkpoint = _checkpoint_args(checkpoint_dir, checkpoint_every, resume, steps)
    plan_json = Plan.load(plan_path).to_json() if plan_path else None
    check_plan_dtype(plan_path, plan_json, dtype)
    t0 = time.monotonic()
    try:
        outs = spawn_ranks(_train_rank, nproc, (model, steps, plan_json, force, batch, seq_len, seed,
                                               timeout_s, optimizer, checkpoint, memory, dtype, nvme_dir,
                                               engine, host_step),
                           timeout_s=timeout_s)
    except RankFailure as e:
        print(f"autopar run {model} on {nproc} ranks failed; every rank was stopped.\n" + e.summary(),
              file=sys.stderr)
        raise
    wall = time.monotonic() - t0
    plan = Plan.from_json(outs[0]["plan"])
    _print_plan(plan)
    losses, first = outs[0]["losses"], outs[0]["first_step"]
    if "resumed" in outs[0]:
        print(outs[0]["resumed"])
    for i, l in enumerate(losses):
        print(f"step {first + i}: loss {l:.6f}")
    ref = reference_losses(model, steps, batch=batch, seq_len=seq_len, seed=seed, optimizer=optimizer,
                           dtype=dtype)[first - 1:]
    diff = max((abs(a - b) for a, b in zip(losses, ref)), default=0.0)
    print("reference (1 process): " + ", ".join(f"{l:.6f}" for l in ref))
    print(f"max |loss - reference| = {diff:.3e}   ({nproc} ranks, {wall:.1f} s)")
    print(f"engine: {outs[0]['engine']} ({outs[0]['engine_reason']})")
    from autopar.report import idle_axis_notes

    traffic = outs[0]["collectives"]
    print(f"rank 0 communicated over {len(losses)} steps (setup included): " + (", ".join(
        f"{axis}: {t['count']} collectives, {t['bytes'] / 1e6:.3f} MB" for axis, t in traffic.items()) or "nothing"))
    for note in idle_axis_notes(plan):
        print(f"note: {note}")
    result = {"losses": losses, "first_step": first, "engine": outs[0]["engine"], "reference_losses": ref, "max_abs_diff": diff, "summary": plan.summary(),
              "collectives": traffic, "plan": plan.to_dict()}
    if memory:
        result["memory"] = [r.to_json() for r in _memory_report(plan, model, batch, seq_len, optimizer, outs)]
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result
