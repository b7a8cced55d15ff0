"""How fast ``spawn_ranks`` (``autopar run``'s launcher) notices a failed rank, with its defaults.

    python benchmarks/failure_detection.py                          # 4 ranks training gpt-tiny (dp=4)
    python benchmarks/failure_detection.py --work allreduce --nproc 2 --repeat 3

Each trial starts N ranks under ``autopar run``'s settings (collective timeout 300 s, so a progress
timeout of 330 s; heartbeat timeout 30 s) that train gpt-tiny through ``autoparallelize`` (``--force
dp=N``) or run a loop of all-reduces, reporting progress after every step. At step ``--at-step`` rank
``--victim`` stamps the time and sends itself SIGKILL (a dead rank) or SIGSTOP (a stuck one). The
table gives the time from that signal to ``spawn_ranks`` raising ``RankFailure`` and the failure's
first line (it must name the victim and the signal). Before the trials: the time ``spawn_ranks``
takes to start N ranks that return at once, cold (the forkserver starts and imports torch) and
warm.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time


def noop(rank: int, world: int) -> int:
    import torch.distributed as dist

    dist.barrier()          # no rank leaves (closing its sockets) while another is still connecting
    return rank


def trial(rank: int, world: int, work: str, victim: int, at_step: int, sig: int, stamp: str) -> int:
    """Train (or all-reduce) step after step; the victim signals itself at ``at_step``."""
    import torch
    import torch.distributed as dist

    from autopar.runtime.launch import DEFAULT_RUN_TIMEOUT_S, report_progress

    if work == "gpt-tiny":
        from autopar.api import autoparallelize
        from autopar.models import build_model

        b = build_model("gpt-tiny", batch=2 * world, device="meta")
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             force=f"dp={world}", timeout_s=DEFAULT_RUN_TIMEOUT_S)
        gen = torch.Generator().manual_seed(0)

        def step() -> None:
            pm.step(*b.make_batch(b.example_inputs[0].shape[0], gen))
    else:
        def step() -> None:
            dist.all_reduce(torch.ones(1024))
            time.sleep(0.05)
    for i in range(1, 1_000_000):
        if rank == victim and i == at_step:
            with open(stamp, "w") as f:
                json.dump({"t": time.monotonic()}, f)
            os.kill(os.getpid(), sig)
        step()
        report_progress(i)
    return i


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", choices=("gpt-tiny", "allreduce"), default="gpt-tiny")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--victim", type=int, default=2)
    ap.add_argument("--at-step", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--signals", default="SIGKILL,SIGSTOP")
    args = ap.parse_args()
    if not 0 <= args.victim < args.nproc:
        ap.error(f"--victim {args.victim} is not a rank of --nproc {args.nproc}")

    from autopar.runtime.launch import DEFAULT_RUN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, RankFailure, spawn_ranks

    starts = []
    for _ in range(3):
        t0 = time.monotonic()
        spawn_ranks(noop, args.nproc)
        starts.append(time.monotonic() - t0)
    print(f"start {args.nproc} ranks that return at once: cold {starts[0]:.2f} s (forkserver starts), "
          f"warm {statistics.median(starts[1:]):.2f} s")
    print(f"defaults: collective timeout {DEFAULT_RUN_TIMEOUT_S:g} s, progress timeout "
          f"{DEFAULT_RUN_TIMEOUT_S + 30:g} s, heartbeat timeout {HEARTBEAT_TIMEOUT_S:g} s; work: {args.work}, "
          f"{args.nproc} ranks, rank {args.victim} signals itself at step {args.at_step}")
    rows = []
    for name in args.signals.split(","):
        sig = signal.Signals[name]
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as d:
                stamp = os.path.join(d, "stamp.json")
                t0 = time.monotonic()
                try:
                    spawn_ranks(trial, args.nproc, (args.work, args.victim, args.at_step, int(sig), stamp),
                                timeout_s=DEFAULT_RUN_TIMEOUT_S)
                    rows.append((name, float("nan"), time.monotonic() - t0, "no failure reported!"))
                    continue
                except RankFailure as e:
                    now = time.monotonic()
                    with open(stamp) as f:
                        t_sig = json.load(f)["t"]
                    rows.append((name, now - t_sig, now - t0, e.summary().splitlines()[0]))
    print(f"{'failure':<9}{'detected in s':>14}{'run s':>8}  first line of the report")
    for name, detect, total, line in rows:
        print(f"{name:<9}{detect:>14.2f}{total:>8.1f}  {line[:150]}")


if __name__ == "__main__":
    main()
