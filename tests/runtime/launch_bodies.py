"""Rank bodies of ``test_launch.py`` (importable by the ranks): steady progress, a rank that kills or
stops itself mid-run, a rank alive without progress, ranks that report their pids."""
from __future__ import annotations

import json
import multiprocessing
import os
import time

import torch
import torch.distributed as dist

from autopar.runtime.launch import report_progress


def steady(rank: int, world: int, seconds: float, period: float) -> dict:
    """All-reduce every ``period`` s for ``seconds`` s (rank 0 decides when to stop), reporting each step."""
    t0, step = time.monotonic(), 0
    while True:
        go = torch.tensor([float(rank != 0 or time.monotonic() - t0 < seconds)])
        dist.all_reduce(go, op=dist.ReduceOp.MIN)
        if not go.item():
            return {"steps": step, "elapsed": time.monotonic() - t0}
        step += 1
        report_progress(step)
        time.sleep(period)


def signals_itself(rank: int, world: int, victim: int, at_step: int, sig: int, stamp: str) -> int:
    """Steps of one all-reduce; rank ``victim`` sends itself ``sig`` at ``at_step`` (writing its pid
    and the time to ``stamp`` first); the others carry on into the next all-reduce."""
    for step in range(1, 10_000):
        if rank == victim and step == at_step:
            with open(stamp, "w") as f:
                json.dump({"pid": os.getpid(), "t": time.monotonic()}, f)
            os.kill(os.getpid(), sig)
        x = torch.ones(4)
        dist.all_reduce(x)
        report_progress(step)
        time.sleep(0.05)
    return step


def spins(rank: int, world: int) -> str:
    """Alive (heartbeating) but never reporting progress: a loop outside collectives."""
    while True:
        time.sleep(0.1)


def returns(rank: int, world: int, what: str):
    """A result of kind ``what``: "plain" (what ranks may return) or "object" (refused)."""
    if what == "object":
        return {"when": multiprocessing.Event}          # a class: not loadable with weights_only=True
    return {"rank": rank, "t": torch.arange(3) * rank, "f": 0.5, "s": "x", "l": [1, (2, None)]}


def reports_pids(rank: int, world: int, directory: str) -> None:
    """Write this rank's pid, parent (the forkserver) and the launcher's temp dir, then work forever."""
    info = {"pid": os.getpid(), "ppid": os.getppid(),
            "tempdir": multiprocessing.current_process()._config.get("tempdir")}
    with open(os.path.join(directory, f"rank{rank}.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(directory, f"rank{rank}.tmp"), os.path.join(directory, f"rank{rank}.json"))
    step = 0
    while True:
        step += 1
        report_progress(step)
        time.sleep(0.2)

