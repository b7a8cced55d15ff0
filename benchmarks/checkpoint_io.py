"""Checkpoint save / load time and size on CPU ranks (gloo), and the reshard matrix.

    python benchmarks/checkpoint_io.py            # gpt-tiny and a 0.97B GPT
    python benchmarks/checkpoint_io.py --quick    # gpt-tiny only

Per model: build it under a plan, make its AdamW state (one optimizer step on zero gradients: the
state's size is a step's, without a training step's memory), ``pm.save`` (timed, the slowest
rank), then a fresh world under ANOTHER plan builds the model and ``pm.load`` reads it (timed),
and the size on disk. The 0.97B GPT runs in bf16 (parameters and AdamW state): in fp32 its 16 GB of
state, plus the canonical copy a save holds of each rank's share, leaves no room on a 24 GB machine.
Then the reshard matrix on gpt-tiny: saved under each plan, loaded under each other one, saved
again: ``equal`` when every tensor of the re-saved checkpoint is bit-identical to the original. Times on a shared CPU machine swing with load: read them as orders
of magnitude.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BIG = "gpt:hidden=2048,layers=18,heads=16,vocab=32000,seq=128"     # 0.97 B parameters, run in bf16
LABELS = {BIG: "GPT 0.97B (bf16)"}


def _rank(rank: int, world: int, model: str, force: str, batch: int, directory: str, mode: str) -> dict:
    import torch
    import torch.distributed as dist

    from autopar.api import autoparallelize
    from autopar.models import build_model

    b = build_model(model, batch=batch, device="meta")
    module = b.module.to(torch.bfloat16) if model == BIG else b.module
    pm = autoparallelize(module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         force=force, model_name=model, timeout_s=600)
    out = {}
    if mode == "save":
        # the optimizer state a step makes, without a step's memory: AdamW on zero gradients
        params = [p for g in pm.optimizer.param_groups for p in g["params"]]
        for p in params:
            p.grad = torch.zeros_like(p)
        pm.optimizer.step()
        for p in params:
            p.grad = None
        dist.barrier()
        t = time.perf_counter()
        pm.save(directory)
        out["save_s"] = time.perf_counter() - t
    elif mode == "load":
        dist.barrier()
        t = time.perf_counter()
        pm.load(directory)
        out["load_s"] = time.perf_counter() - t
    else:                                             # "resave": load, then save again elsewhere
        pm.load(directory)
        pm.save(mode)
    return out


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def io_rows(models) -> list[tuple]:
    from autopar.runtime.launch import spawn_ranks

    rows = []
    for model, batch, (world_a, force_a), (world_b, force_b) in models:
        d = tempfile.mkdtemp(prefix="autopar-ckpt-")
        try:
            saved = spawn_ranks(_rank, world_a, (model, force_a, batch, d, "save"), timeout_s=1800)
            loaded = spawn_ranks(_rank, world_b, (model, force_b, batch, d, "load"), timeout_s=1800)
            rows.append((LABELS.get(model, model), f"{force_a} ({world_a})", f"{force_b} ({world_b})",
                         max(o["save_s"] for o in saved), max(o["load_s"] for o in loaded), _size(d) / 1e9))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return rows


def matrix(plans) -> list[tuple]:
    import torch

    from autopar.runtime.checkpoint import read_checkpoint
    from autopar.runtime.launch import spawn_ranks

    rows = []
    for world_a, force_a in plans:
        d = tempfile.mkdtemp(prefix="autopar-ckpt-")
        try:
            spawn_ranks(_rank, world_a, ("gpt-tiny", force_a, 8, d, "save"), timeout_s=120)
            original = read_checkpoint(d)
            for world_b, force_b in plans:
                again = os.path.join(d, f"again-{world_b}-{force_b}")
                spawn_ranks(_rank, world_b, ("gpt-tiny", force_b, 8, d, again), timeout_s=120)
                other = read_checkpoint(again)
                same = sorted(original) == sorted(other) and all(torch.equal(original[k], other[k]) for k in original)
                rows.append((f"{force_a} ({world_a})", f"{force_b} ({world_b})", "equal" if same else "DIFFERENT"))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="gpt-tiny only, and a 3-plan matrix")
    ap.add_argument("--no-matrix", action="store_true", help="only the save / load table")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    models = [("gpt-tiny", 8, (4, "dp=2,tp=2,zero=2"), (2, "dp=2,zero=0"))]
    if not args.quick:
        models.append((BIG, 2, (2, "dp=2,zero=3"), (2, "tp=2")))
    t = Table(title="checkpoint save / load (CPU, gloo)")
    for c in ("model", "saved under (ranks)", "loaded under (ranks)", "save s", "load s", "size GB"):
        t.add_column(c)
    for r in io_rows(models):
        t.add_row(r[0], r[1], r[2], f"{r[3]:.2f}", f"{r[4]:.2f}", f"{r[5]:.3f}")
    console = Console()
    console.print(t)
    if args.no_matrix:
        return 0
    plans = [(4, "dp=2,tp=2,zero=2"), (2, "pp=2"), (1, "dp=1")]
    if not args.quick:
        plans += [(4, "pp=2,tp=2"), (2, "tp=2,zero=3")]
    m = Table(title="reshard matrix (gpt-tiny): saved -> loaded -> saved again, bit-identical?")
    for c in ("saved under", "loaded under", "result"):
        m.add_column(c)
    rows = matrix(plans)
    for r in rows:
        m.add_row(*r)
    console.print(m)
    return 0 if all(r[2] == "equal" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
