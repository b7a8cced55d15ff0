"""Rank bodies of the checkpoint tests (importable by spawned ranks): train a built-in model under
a forced plan through ``autopar.cli_run.train_steps``, saving / resuming as ``autopar run`` does."""
from __future__ import annotations

import os
import signal
from typing import Optional


def train(rank: int, world: int, model: str, force: Optional[str], steps: int, ckpt: Optional[str],
          every: Optional[int] = None, resume: bool = False, optimizer: str = "adamw",
          die_at: Optional[tuple[int, int]] = None, resave: Optional[str] = None,
          schedule: bool = False, nvme_dir: Optional[str] = None) -> dict:
    """Losses of the steps run, the first step's number and (rank 0) the full state at the end.
    ``die_at=(rank, step)``: that rank SIGKILLs itself once ``step`` steps are done and their checkpoint committed.
    ``resave``: right after resuming, save again into that directory (under this run's plan).
    ``schedule``: an LR schedule (lr halves every step), saved and restored with the checkpoint."""
    import torch

    from autopar.api import autoparallelize
    from autopar.cli_run import CheckpointArgs, make_optimizer, train_steps
    from autopar.models import build_model

    b = build_model(model, device="meta")
    ck = CheckpointArgs(ckpt, every, resume) if ckpt else None
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         force=force, optimizer=lambda p: make_optimizer(optimizer, p), model_name=model,
                         resume=ckpt if resume else None, timeout_s=60, nvme_dir=nvme_dir)
    def die(step: int) -> None:
        if die_at == (rank, step):
            pm.wait_for_save()                    # this step's checkpoint is committed
            os.kill(os.getpid(), signal.SIGKILL)

    if resave:
        pm.save(resave)
    first = pm.steps_done + 1
    sched = torch.optim.lr_scheduler.StepLR(pm.optimizer, step_size=1, gamma=0.5) if schedule else None
    losses = train_steps(pm, b, steps, 0, ck, after_step=die, scheduler=sched)
    state = pm.full_state_dict()
    lr = pm.optimizer.param_groups[0]["lr"]
    pm.close()
    return {"losses": losses, "lr": lr, "first_step": first, "plan": pm.plan.summary(),
            "state": state if rank == 0 else None,
            "resumed": pm.resumed.change_line(pm.plan) if pm.resumed else None}
