"""``overlap_slowdown``, measured: how much compute slows while a collective runs beside it.

Every rank, over the group the collectives are timed on (NCCL on GPUs, gloo on CPUs), runs each
trial as: a GEMM loop alone (``G`` seconds), an all-reduce loop alone (``C``), then both at once
(``B``): every all-reduce of the loop issued with ``async_op=True``, the same GEMM loop run while
they are in flight, then the handles waited for (and the device synchronised). Each time is the
slowest rank's. The loops are sized from a first call of each so that G and C are both about
``target_s`` (the collective then has a full window to hide in, and hides in it only if nothing
is shared). ``fit_overlap_slowdown`` fits the step model's own formula (``solver/overlap.py``):
a collective of C beside G seconds of compute costs

    B = max(G, C) + s * min(G, C)      so      s = (B - max(G, C)) / min(G, C), at least 0

and the file gets the median over the trials. s = 0: the two ran fully side by side; s = 1: they
took as long as one after the other (e.g. gloo's thread and the GEMM sharing one core).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

TRIALS = 5
TARGET_S = 0.1                   # each loop's length alone, seconds
CPU_SETUP = dict(gemm_n=256, gemm_dtype="float32", comm_bytes=4 << 20)
GPU_SETUP = dict(gemm_n=8192, gemm_dtype="bfloat16", comm_bytes=256 << 20)


@dataclass(frozen=True)
class OverlapFigures:
    gemm_s: float            # the GEMM loop alone (median trial, slowest rank)
    comm_s: float            # the all-reduce loop alone
    both_s: float            # both at once
    slowdown: float          # fitted s, median over the trials
    trials: int
    setup: str               # "GEMM 256^2 float32 x 40, all_reduce 4 MiB x 12"


def fit_overlap_slowdown(gemm_s: float, comm_s: float, both_s: float) -> float:
    """s of ``both = max(gemm, comm) + s * min(gemm, comm)``, at least 0 (a concurrent run faster
    than the longer loop alone is timing noise, not negative contention)."""
    for what, v in (("gemm_s", gemm_s), ("comm_s", comm_s), ("both_s", both_s)):
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{what} = {v!r}: need a positive finite time")
    lo, hi = min(gemm_s, comm_s), max(gemm_s, comm_s)
    return max(0.0, (both_s - hi) / lo)


def measure_overlap(device, group, setup: dict, target_s: float = TARGET_S, trials: int = TRIALS) -> dict:
    """One rank's part (every rank calls it at the same point): plain numbers for ``spawn_ranks``.
    Times are the slowest rank's (a MAX all-reduce over the default group)."""
    import torch
    import torch.distributed as dist

    from autopar.runtime.precision import parse_dtype

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    n = setup["gemm_n"]
    a = torch.randn(n, n, dtype=parse_dtype(setup["gemm_dtype"]), device=device)
    b = torch.randn(n, n, dtype=a.dtype, device=device)
    buf = torch.ones(setup["comm_bytes"] // 4, device=device)

    def gemms(reps: int) -> None:
        for _ in range(reps):
            torch.mm(a, b)

    def comms(reps: int, async_op: bool):
        return [dist.all_reduce(buf, group=group, async_op=async_op) for _ in range(reps)]

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    def per_call(fn) -> float:
        """Seconds per call, from loops doubled until one lasts target_s / 5 on the slowest rank
        (every rank decides alike: the collective loops must match)."""
        reps = 1
        while True:
            t = torch.tensor([timed(lambda: fn(reps))], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if float(t) >= target_s / 5 or reps >= 1 << 16:
                return float(t) / reps
            reps *= 2

    gemms(1), comms(1, False), sync()                               # warm-up
    reps_g = max(1, round(target_s / max(per_call(gemms), 1e-9)))
    reps_c = max(1, round(target_s / max(per_call(lambda r: comms(r, False)), 1e-9)))

    def both() -> None:
        handles = comms(reps_c, True)
        gemms(reps_g)
        for h in handles:
            h.wait()

    rows = []
    for _ in range(trials):
        t = torch.tensor([timed(lambda: gemms(reps_g)), timed(lambda: comms(reps_c, False)), timed(both)],
                         dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append([float(x) for x in t])
    fits = [fit_overlap_slowdown(*r) for r in rows]
    mid = sorted(range(trials), key=lambda i: fits[i])[trials // 2]
    return {"gemm_s": rows[mid][0], "comm_s": rows[mid][1], "both_s": rows[mid][2],
            "slowdown": statistics.median(fits), "trials": trials,
            "setup": f"GEMM {n}^2 {setup['gemm_dtype']} x {reps_g}, all_reduce {setup['comm_bytes'] >> 20} MiB x {reps_c}"}


def overlap_figures(d: dict) -> OverlapFigures:
    return OverlapFigures(float(d["gemm_s"]), float(d["comm_s"]), float(d["both_s"]), float(d["slowdown"]),
                          int(d["trials"]), str(d["setup"]))
