"""Launching N CPU ranks (gloo), failing fast.

``spawn_ranks(fn, nproc, args)`` starts ``nproc`` processes (forkserver with torch preloaded, so a
rank starts in a fraction of a second), joins them into one gloo world on a free local port with
``timeout_s``, runs ``fn(rank, world, *args)`` and returns every rank's result. If any rank raises,
the others are terminated at once and ``RankFailure`` carries every rank's error; if the whole
run exceeds ``timeout_s`` plus a grace period, every rank is killed. Nothing is left running.

``autopar run`` (``autopar/cli_run.py``) is built on it.
"""
from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue as queue_mod
import socket
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
