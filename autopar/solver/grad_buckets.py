"""When each gradient bucket's collective can start, and how much of the reduction the backward
hides: the overlap limit of a bucketed data-parallel reduction.

A runtime that reduces gradients in buckets (autopar's ``runtime/reducer.py`` and DDP: 25 MiB, the
first 1 MiB; Megatron-Core: max(40M, 1M x dp) parameters, ``megatron/core/distributed/
distributed_data_parallel_config.py``) launches a bucket's collective once every gradient in it is
complete, one collective after the other. The rank's gradients come out of its backward piece by
piece, in reverse graph order: the head's (``post``), each layer's from the last to the first,
then the embedding's (``pre``). A piece's bytes are ready at the pace of its backward compute
(fluid within a piece); an ``atomic`` piece (the embedding: one tensor) is ready at its end and
is a bucket of its own when it does not fit the open one. Then, with the backward ``W`` seconds
long and collectives of ``c(bytes)`` seconds (``cost.collectives``: each pays its latency),

    start_i = max(ready_i, end_{i-1}),  end_i = start_i + c(bytes_i),
    exposed = max(0, end_last - W),  total = sum_i c(bytes_i),  hidden = total - exposed

The last bucket cannot start before the backward ends, so its collective is always exposed: a
model of one 25 MiB bucket hides nothing, where ``min(total, W)`` hid all of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class GradPiece:
    """Gradient bytes that one stretch of the backward produces (in backward order)."""
    nbytes: float
    seconds: float
    atomic: bool = False


def bucket_launches(pieces: Sequence[GradPiece], cap: float, first_cap: float) -> list[tuple[float, float]]:
    """(ready time, bytes) of each bucket, in launch order: buckets filled greedily up to ``cap``
    bytes (the first up to ``min(cap, first_cap)``), as ``codegen/buckets.plan_buckets`` packs
    tensors, over the ``pieces``' bytes."""
    if cap <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap}")
    out: list[tuple[float, float]] = []
    t, size = 0.0, 0.0

    def limit() -> float:
        return min(cap, first_cap) if not out and first_cap > 0 else cap

    for p in pieces:
        if p.atomic:
            if size > 0 and size + p.nbytes > limit():
                out.append((t, size))
                size = 0.0
            t += p.seconds
            size += p.nbytes
            if size >= limit():
                out.append((t, size))
                size = 0.0
            continue
        left, rate = p.nbytes, (p.seconds / p.nbytes if p.nbytes > 0 else 0.0)
        while left > 0:
            take = min(left, limit() - size)
            t += take * rate
            size += take
            left -= take
            if size >= limit():
                out.append((t, size))
                size = 0.0
        if p.nbytes <= 0:
            t += p.seconds
    if size > 0:
        out.append((t, size))
    return out


def bucketed_overlap(pieces: Sequence[GradPiece], cap: float, first_cap: float,
                     collective: Callable[[float], float]) -> tuple[float, float, float]:
    """(total collective seconds, hidden seconds, the backward's seconds) of the bucketed
    reduction of ``pieces`` (module docstring): the schedule of ``bucket_launches``' buckets,
    folded in closed form over each run of equal buckets (k buckets of ``cap`` bytes ready every
    ``d`` seconds from ``r``: ``end = max(end + k c, r + k c, r + (k - 1) d + c)``, the recurrence
    being a maximum of terms linear in the bucket's index), so that a rank of 100 layers and 1,000
    buckets costs a few operations, not a loop over them."""
    if cap <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap}")
    window = sum(p.seconds for p in pieces)
    state = {"end": 0.0, "total": 0.0, "buckets": 0}
    full = collective(cap)

    def launch(ready: float, nbytes: float) -> None:
        c = full if nbytes == cap else collective(nbytes)
        state["end"] = max(ready, state["end"]) + c
        state["total"] += c
        state["buckets"] += 1

    def limit() -> float:
        return min(cap, first_cap) if state["buckets"] == 0 and first_cap > 0 else cap

    t, size = 0.0, 0.0
    for p in pieces:
        if p.atomic or p.nbytes <= 0:
            if p.nbytes > 0 and size > 0 and size + p.nbytes > limit():
                launch(t, size)
                size = 0.0
            t += p.seconds
            size += max(0.0, p.nbytes)
            if size > 0 and size >= limit():
                launch(t, size)
                size = 0.0
            continue
        rate, left = p.seconds / p.nbytes, p.nbytes
        while left > 0 and (size > 0 or limit() < cap):      # the open bucket, and the first one
            take = min(left, limit() - size)
            t, size, left = t + take * rate, size + take, left - take
            if size >= limit():
                launch(t, size)
                size = 0.0
        k = int(left // cap)
        if k > 0:                  # k full buckets, ready at t + d, ..., t + k d
            d = cap * rate
            state["end"] = max(state["end"] + k * full, t + d + k * full, t + k * d + full)
            state["total"] += k * full
            state["buckets"] += k
            t, left = t + k * d, left - k * cap
        if left > 0:
            t, size = t + left * rate, size + left
    if size > 0:
        launch(t, size)
    exposed = min(state["total"], max(0.0, state["end"] - window))
    return state["total"], state["total"] - exposed, window
