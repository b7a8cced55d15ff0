"""One long sequence over more ranks: context parallelism measured on CPU ranks, side by side.

    python benchmarks/context_parallel.py [--seq 1024] [--steps 3] [--modes 1,ring2,ulysses2,ring4]
                                          [--engine auto|emitted|interpreter]

Two long sequences over more ranks than sequences: data parallelism could use two ranks at most,
context parallelism splits the tokens of each. Each configuration trains a CPU-sized GPT (``MODEL``, causal attention) for ``--steps`` SGD steps
on gloo ranks (``autoparallelize`` with ``--force cp=N,cpmode=...``; ``1``: one rank, no
parallelism), checks every loss against one process, and measures on each rank the peak of one
step by category (``runtime/memory_measure.measure_step``) and the step's wall time. Prints per
configuration the largest rank's activation peak and whole peak, their ratio to one rank, the
planner's predicted activation bytes, the step time ratio to one rank, and the cp traffic one rank
issued per step. Times swing with the machine's load and ranks share its cores (4 ranks on 2
cores wait on each other at every exchange): read the memory columns as the result, the time
column as this machine's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH = 2            # sequences per step (a one-sequence trace cannot show the batch dim: ``solver/context.py``)
MODES = {"1": (1, None), "ring2": (2, "ring"), "ulysses2": (2, "ulysses"), "ring4": (4, "ring")}


def model_spec(seq: int) -> str:
    return f"gpt:hidden=128,layers=2,heads=4,vocab=512,seq={seq}"


def _run(rank: int, world: int, seq: int, mode: str, steps: int, engine: str = "auto") -> dict:
    import torch

    from autopar.api import autoparallelize
    from autopar.models import build_model
    from autopar.runtime.memory_measure import measure_step

    cp, kind = MODES[mode]
    torch.manual_seed(0)
    b = build_model(model_spec(seq), device="cpu", batch=BATCH)
    force = f"cp={cp},cpmode={kind},tp=1,pp=1" if cp > 1 else "tp=1,pp=1"
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1), force=force, timeout_s=120,
                         engine=engine)
    gen = torch.Generator().manual_seed(1)
    data = [b.make_batch(BATCH, gen) for _ in range(steps)]
    losses, times = [], []
    for i, (x, y) in enumerate(data):
        pm.reset_collectives()
        t0 = time.perf_counter()
        if i == 1:                              # after the first step: the optimizer state exists
            loss, mem = measure_step(pm, x, y)
        else:
            loss = pm.step(x, y)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if i == 1:
            cp_bytes = sum(c.nbytes for c in pm.collectives if c.axis == "cp")
    return {"losses": losses, "times": times[1:], "activations": mem.category_peaks.activations,
            "peak": mem.peak_bytes, "cp_bytes": cp_bytes,
            "predicted_activations": pm.plan.memory.activations_bytes, "engine": pm.engine}


def _reference(seq: int, steps: int) -> list[float]:
    import torch

    from autopar.models import build_model

    torch.manual_seed(0)
    b = build_model(model_spec(seq), device="cpu", batch=BATCH)
    opt = torch.optim.SGD(b.module.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    out = []
    for x, y in [b.make_batch(BATCH, gen) for _ in range(steps)]:
        opt.zero_grad()
        loss = b.loss_fn(b.module(*x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def main(argv=None) -> int:
    from rich.console import Console
    from rich.table import Table

    from autopar.runtime.launch import spawn_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help="which of: " + ", ".join(MODES))
    ap.add_argument("--engine", default="auto", choices=("auto", "emitted", "interpreter"),
                    help="the engine every configuration trains on (autoparallelize's engine=)")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or args.steps < 2:
        ap.error(f"--modes takes {', '.join(MODES)} (got {unknown}); --steps must be >= 2")
    ref = _reference(args.seq, args.steps)
    rows = {}
    for mode in modes:
        cp = MODES[mode][0]
        res = spawn_ranks(_run, cp, (args.seq, mode, args.steps, args.engine), timeout_s=300)
        worst = max(abs(a - b) / abs(b) for r in res for a, b in zip(r["losses"], ref))
        if worst > 1e-5:
            raise SystemExit(f"{mode}: losses {res[0]['losses']} differ from one process {ref} ({worst:.1e} relative)")
        rows[mode] = {"activations": max(r["activations"] for r in res), "peak": max(r["peak"] for r in res),
                      "time": statistics.median(max(r["times"][i] for r in res) for i in range(args.steps - 1)),
                      "cp_bytes": res[0]["cp_bytes"], "predicted": res[0]["predicted_activations"],
                      "loss_err": worst, "engine": res[0]["engine"]}
    base = rows.get("1") or next(iter(rows.values()))
    t = Table(title=f"{model_spec(args.seq)}, batch {BATCH}, {args.steps} SGD steps; largest rank (measured)")
    for col in ("config", "engine", "activations MiB", "vs 1 rank", "predicted MiB", "peak MiB", "vs 1 rank",
                "step time vs 1 rank", "cp bytes/step/rank", "max rel. loss error"):
        t.add_column(col, justify="right")
    mib = 1 << 20
    for mode, r in rows.items():
        t.add_row(mode, r["engine"], f"{r['activations'] / mib:.2f}", f"{r['activations'] / base['activations']:.2f}",
                  f"{r['predicted'] / mib:.2f}", f"{r['peak'] / mib:.2f}", f"{r['peak'] / base['peak']:.2f}",
                  f"{r['time'] / base['time']:.2f}", f"{r['cp_bytes']:,}", f"{r['loss_err']:.1e}")
    Console(width=160).print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
