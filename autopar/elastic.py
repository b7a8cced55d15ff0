"""Elastic training under torchrun: re-planned and resharded whenever the world changes.

    torchrun --nnodes=1:4 --nproc-per-node=8 --max-restarts=3 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29400 -m autopar.elastic llama3-8b --steps 1000 \\
             --checkpoint-dir /shared/ckpt --checkpoint-every 50

torchrun restarts every worker when a node dies, leaves or joins (within ``--nnodes MIN:MAX`` and
``--max-restarts``). Each start of this module: plan for the world it finds (the running world),
load the last checkpoint in ``--checkpoint-dir`` if there is one (saved under whatever plan and
world size, resharded on load; ``runtime/checkpoint.py``), print on rank 0 what changed (old plan
-> new plan, steps lost), then train on generated batches up to ``--steps``, saving every
``--checkpoint-every`` steps and at the end. The checkpoint directory must be on a filesystem
every node sees.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m autopar.elastic",
                                 description="elastic training under torchrun (re-plans when the world changes)")
    ap.add_argument("model", help="built-in name or spec (see `autopar models`)")
    ap.add_argument("--steps", type=int, required=True, help="train up to this step")
    ap.add_argument("--checkpoint-dir", required=True, help="shared directory for checkpoints")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="save every K steps (default 10)")
    ap.add_argument("--force", default=None, help="pin choices as `autopar plan --force`")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer", choices=("adamw", "lamb"), default="adamw")
    ap.add_argument("--timeout", type=float, default=60.0, help="collective timeout in seconds")
    ap.add_argument("--heartbeat-timeout", type=float, default=30.0,
                    help="a rank whose heartbeat stops this long ends the job, naming it (seconds)")
    ap.add_argument("--json", dest="json_path", default=None,
                    help="rank 0 writes this start's losses, first step and plan here")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    import torch.distributed as dist

    from autopar.api import autoparallelize
    from autopar.cli_run import CheckpointArgs, make_optimizer, train_steps
    from autopar.models import build_model
    from autopar.runtime.checkpoint import latest_checkpoint

    b = build_model(args.model, batch=args.batch, seq_len=args.seq_len, device="meta")
    if b.loss_fn is None:
        print(f"error: {args.model} has no loss; elastic training needs (module, inputs, loss_fn, target)",
              file=sys.stderr)
        return 2
    resume = args.checkpoint_dir if latest_checkpoint(args.checkpoint_dir) else None
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         force=args.force, seed=args.seed, timeout_s=args.timeout, model_name=args.model,
                         heartbeat_timeout_s=args.heartbeat_timeout,
                         optimizer=lambda p: make_optimizer(args.optimizer, p), resume=resume)
    rank = dist.get_rank()
    if rank == 0:
        line = pm.resumed.change_line(pm.plan) if pm.resumed else "starting from step 0"
        print(f"autopar.elastic: world {dist.get_world_size()}: {line}", flush=True)
    first = pm.steps_done + 1
    losses = train_steps(pm, b, args.steps, args.seed,
                         CheckpointArgs(args.checkpoint_dir, args.checkpoint_every, resume is not None))
    if rank == 0:
        for i, l in enumerate(losses):
            print(f"step {first + i}: loss {l:.6f}")
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump({"first_step": first, "losses": losses, "world_size": dist.get_world_size(),
                           "summary": pm.plan.summary(),
                           "resumed": pm.resumed.change_line(pm.plan) if pm.resumed else None}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
