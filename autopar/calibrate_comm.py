"""Collectives timed over a real process group, and the fit of the link the cost model uses.

``collective_op(kind, nbytes, ...)`` builds one collective of ``autopar.cost.collectives``'
``COLLECTIVE_KINDS`` on float32 buffers, with ``nbytes`` meaning what that module says (all_reduce
the tensor, all_gather the OUTPUT, reduce_scatter the INPUT, all_to_all each rank's send buffer,
p2p the message), through the calls autopar's runtime makes (``dist.all_reduce``,
``all_gather_single`` / ``reduce_scatter_single`` where torch has them, ``all_to_all_single``,
``batch_isend_irecv``). p2p is timed as the runtime uses it: every rank sends its message to the
next rank of a ring and receives the previous one's, all at once (context parallelism's ring
rotations, a pipeline's sends in both directions), one message per call; a ping-pong between two
ranks while the others idle measured gloo's send/recv at 2.9-3.8x its all-reduce busbw on this
2-core machine, faster than a ring's concurrent messages run.
``time_collective`` times batches after barriers; a batch's time is its slowest rank's, and the
median batch is the collective's time.

``time_collective_in_situ`` times a collective as a training step issues it on CPU ranks: each
call after a block of compute, batches of ``compute(); collective()`` alternating with batches of
``compute()`` alone, the difference of their medians per call. Back to back, a gloo collective
finds its peers' threads awake and its buffers in cache; after compute each call pays the wake-ups
and the traffic through a cache the GEMM refilled. Measured on this 2-core machine with a
256 x 256 x 768 fp32 GEMM pair (1.3 ms on 2 ranks, 2.3-2.8 ms on 4) before each all_reduce:
2 ranks, 1 KiB 0.81 ms back to back against 1.27 in situ, 1 MiB 1.75 against 3.53, 4 MiB 3.4
against 4.4, 16 MiB 14.0 against 14.6; 4 ranks, 16 KiB 6.0 against 8.8, 4 MiB 8.5 against 14.2,
16 MiB 30.4 against 30.2 (large messages: the same). In a tensor-parallel step on 2 ranks, a
1 MiB all_reduce took 0.7-9 ms (most 3-5) where the back-to-back fit predicted 1.09 ms.

``fit_link(points)`` fits a call latency, a per-step latency and a bus bandwidth to the measured
times, with the cost model's own formula (``collectives.collective_s``): for each point the
prediction is ``call_latency + steps(kind, n) * latency + bus_factor(kind, n) * nbytes / busbw``,
linear in (call_latency, latency, 1/busbw); the two latencies are told apart by points of two group
sizes (``autopar calibrate`` times all-reduces over pairs of ranks beside those over all ranks: on
this 2-core machine with 4 ranks, in situ, those of 1 KiB to 1 MiB took 2.2-5.5 ms over pairs and
6.7-11.0 over all four, where one per-step latency fitted to the four priced a pair's at a third of
the four's);
an all-reduce's steps are a tree's on GPUs (NCCL: ``all_reduce_tree``, as the link it writes then
prices them) and a ring's on CPU ranks (gloo).
The fit minimises the RELATIVE error (each point weighted by 1/time), so 1 KB messages (latency)
and 256 MB ones (bandwidth) count alike; the latencies are kept >= 0.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from autopar.cost.collectives import COLLECTIVE_KINDS, collective_s
from autopar.cost.hardware import LinkSpec

_FLOAT_BYTES = 4


@dataclass(frozen=True)
class CollectivePoint:
    kind: str          # one of COLLECTIVE_KINDS
    ranks: int
    nbytes: int        # as autopar.cost.collectives means it for ``kind``
    seconds: float     # one collective, the slowest rank (in situ on CPU ranks: module docstring)
    back_to_back_s: float = 0.0   # the same timed back to back, where ``seconds`` is in situ (else 0)


@dataclass(frozen=True)
class LinkFit:
    latency_s: float   # per ring step, as LinkSpec.latency_s
    busbw_Bps: float   # as LinkSpec.busbw_Bps
    rel_rms: float     # root-mean-square relative error of the fitted times
    max_rel: float     # largest relative error
    points: int
    all_reduce_tree: bool = False   # the all-reduce steps the fit counted (``collectives.all_reduce_s``)
    call_latency_s: float = 0.0     # per collective, as LinkSpec.call_latency_s

    def link(self, name: str, source: str) -> LinkSpec:
        return LinkSpec(name=name, busbw_Bps=self.busbw_Bps, latency_s=self.latency_s, source=source,
                        all_reduce_tree=self.all_reduce_tree, call_latency_s=self.call_latency_s)


def collective_op(kind: str, nbytes: int, rank: int, world: int, device: torch.device,
                  group=None) -> tuple[Callable[[], None], int, float]:
    """(fn, actual nbytes, seconds-per-call factor) of one ``kind`` on ``world`` ranks (ranks of
    ``group``, which spans the world in order); the factor turns the time of ``fn`` into the time
    of one collective."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
    numel = max(world, nbytes // _FLOAT_BYTES // world * world)
    full = torch.ones(numel, device=device)
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(full, group=group)), numel * _FLOAT_BYTES, 1.0
    shard = torch.ones(numel // world, device=device)
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        return (lambda: gather(full, shard, group=group)), numel * _FLOAT_BYTES, 1.0
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        return (lambda: scatter(shard, full, group=group)), numel * _FLOAT_BYTES, 1.0
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(out, full, group=group)), numel * _FLOAT_BYTES, 1.0
    if world < 2:
        raise ValueError("p2p needs at least 2 ranks")

    received = torch.empty_like(full)

    def ring() -> None:
        ops = [dist.P2POp(dist.isend, full, (rank + 1) % world, group=group),
               dist.P2POp(dist.irecv, received, (rank - 1) % world, group=group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return ring, numel * _FLOAT_BYTES, 1.0


def time_collective(fn: Callable[[], None], reps: int, device: torch.device, batches: int = 1) -> float:
    """Seconds per call of ``fn``: ``batches`` batches of ``reps`` calls, each started after a
    barrier and timed as its slowest rank's; the median batch (a shared, busy machine preempts
    ranks now and then: the median is the typical time, the mean would carry the outliers). The
    default group (gloo, CPU tensors) carries barriers and times."""
    per_batch = []
    for _ in range(batches):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        per_batch.append((time.perf_counter() - t0) / reps)
    t = torch.tensor(per_batch, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def time_collective_in_situ(fn: Callable[[], None], compute: Callable[[], object], reps: int,
                            device: torch.device, batches: int = 1) -> float:
    """Seconds ``fn`` adds to a step when each call follows ``compute()`` (module docstring): the
    median batch of ``compute(); fn()`` less the median batch of ``compute()``, alternating, each
    batch timed as ``time_collective`` times one."""
    both, alone = [], []
    for _ in range(batches):
        both.append(time_collective(lambda: (compute(), fn()), reps, device))
        alone.append(time_collective(compute, reps, device))
    return statistics.median(both) - statistics.median(alone)


def _design(p: CollectivePoint, tree: bool) -> tuple[float, float, float]:
    """(call latency, latency, 1/busbw coefficients) of ``p``'s predicted time, read off the cost model."""
    def at(call: float, lat: float, bw: float) -> float:
        link = LinkSpec("", bw, lat, "", all_reduce_tree=tree, call_latency_s=call)
        return collective_s(p.kind, p.nbytes, p.ranks, link)
    return at(1.0, 0.0, math.inf), at(0.0, 1.0, math.inf), at(0.0, 0.0, 1.0)


# which of (call latency, per-step latency) a fit may use, in order of preference at equal error
_TERMS = ((False, True), (True, True), (True, False), (False, False))


def _solve(rows: list[tuple[float, ...]], cols: list[int]) -> Optional[list[float]]:
    """Least squares of ``sum(x[j] * row[j] for j in cols) = 1`` over ``rows``; None if singular."""
    k = len(cols)
    a = [[sum(r[i] * r[j] for r in rows) for j in cols] for i in cols]
    b = [sum(r[i] for r in rows) for i in cols]
    for c in range(k):                               # Gauss-Jordan with partial pivoting
        piv = max(range(c, k), key=lambda i: abs(a[i][c]))
        if abs(a[piv][c]) <= 1e-12 * max(1.0, max(abs(a[i][i]) for i in range(k))):
            return None
        a[c], a[piv], b[c], b[piv] = a[piv], a[c], b[piv], b[c]
        for i in range(k):
            if i != c:
                f = a[i][c] / a[c][c]
                a[i] = [x - f * y for x, y in zip(a[i], a[c])]
                b[i] -= f * b[c]
    return [b[i] / a[i][i] for i in range(k)]


def fit_link(points: Iterable[CollectivePoint], all_reduce_tree: bool = False) -> LinkFit:
    """Call latency, per-step latency and busbw minimising the relative error of ``collective_s``
    over ``points``, on a link whose all-reduces take trees (NCCL) or rings (gloo) as
    ``all_reduce_tree`` says. The latencies are kept >= 0 (the best of the fits that leave out one
    or both, where the full one would make either negative); a call latency needs points of two
    group sizes (one group size cannot tell it from the steps' latency: it is 0 then)."""
    pts = [p for p in points if p.ranks > 1]
    if len(pts) < 2:
        raise ValueError(f"fitting a link needs at least 2 timed collectives on >= 2 ranks, got {len(pts)}")
    for p in pts:
        if not (p.seconds > 0 and math.isfinite(p.seconds)):
            raise ValueError(f"{p.kind} of {p.nbytes} bytes took {p.seconds} s: not a positive finite time")
    rows = [tuple(x / p.seconds for x in _design(p, all_reduce_tree)) for p in pts]
    best = None
    for call, lat in _TERMS:
        cols = [j for j, on in enumerate((call, lat, True)) if on]
        sol = _solve(rows, cols)
        if sol is None or any(x < 0 for x in sol[:-1]):
            continue
        if not sol[-1] > 0:                       # latency explains the times: they do not grow
            best = None
            break
        x = [0.0, 0.0, 0.0]
        for j, v in zip(cols, sol):
            x[j] = v
        errs = [sum(c * r for c, r in zip(x, row)) - 1.0 for row in rows]
        sse = sum(e * e for e in errs)
        if best is None or sse < best[0] - 1e-12 * len(rows):      # a tie keeps the earlier terms
            best = (sse, x, errs)
    if best is None:
        sizes = sorted({p.nbytes for p in pts})
        raise ValueError(f"the times do not grow with the message size (sizes {sizes[0]}..{sizes[-1]} bytes), "
                         f"so no bandwidth can be fitted; measure larger messages (raise --budget-s)")
    _, (call, lat, inv_bw), errs = best
    return LinkFit(latency_s=lat, busbw_Bps=1.0 / inv_bw,
                   rel_rms=math.sqrt(sum(e * e for e in errs) / len(errs)), max_rel=max(abs(e) for e in errs),
                   points=len(pts), all_reduce_tree=all_reduce_tree, call_latency_s=call)
