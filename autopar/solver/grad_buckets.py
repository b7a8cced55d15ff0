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
from typing import Callable, Iterator, Sequence


@dataclass(frozen=True)
class GradPiece:
    """Gradient bytes that one stretch of the backward produces (in backward order)."""
    nbytes: float
    seconds: float
    atomic: bool = False


def bucket_runs(pieces: Sequence[GradPiece], cap: float, first_cap: float) -> Iterator[tuple[float, float, int, float]]:
    """The buckets, in launch order, as runs ``(ready time of the first, seconds between two,
    count, bytes of each)``: buckets filled greedily up to ``cap`` bytes (the first up to
    ``min(cap, first_cap)``), as ``codegen/buckets.plan_buckets`` packs tensors, over the
    ``pieces``' bytes. Full buckets inside one piece come out as one run (ready ``d`` apart)."""
    if cap <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap}")
    t, size, launched = 0.0, 0.0, 0

    def limit() -> float:
        return min(cap, first_cap) if launched == 0 and first_cap > 0 else cap

    for p in pieces:
        if p.atomic or p.nbytes <= 0:
            if p.nbytes > 0 and size > 0 and size + p.nbytes > limit():
                yield t, 0.0, 1, size
                launched, size = launched + 1, 0.0
            t += p.seconds
            size += max(0.0, p.nbytes)
            if size > 0 and size >= limit():
                yield t, 0.0, 1, size
                launched, size = launched + 1, 0.0
            continue
        rate, left = p.seconds / p.nbytes, p.nbytes
        while left > 0 and (size > 0 or limit() < cap):      # the open bucket, and the first one
            take = min(left, limit() - size)
            t, size, left = t + take * rate, size + take, left - take
            if size >= limit():
                yield t, 0.0, 1, size
                launched, size = launched + 1, 0.0
        k = int(left // cap)
        if k > 0:                  # k full buckets, ready at t + d, ..., t + k d
            d = cap * rate
            yield t + d, d, k, cap
            launched, t, left = launched + k, t + k * d, left - k * cap
        if left > 0:
            t, size = t + left * rate, size + left
    if size > 0:
        yield t, 0.0, 1, size


def bucket_launches(pieces: Sequence[GradPiece], cap: float, first_cap: float) -> list[tuple[float, float]]:
    """(ready time, bytes) of each bucket, in launch order (``bucket_runs`` one by one)."""
    return [(r + i * d, nbytes) for r, d, k, nbytes in bucket_runs(pieces, cap, first_cap) for i in range(k)]


def bucketed_overlap(pieces: Sequence[GradPiece], cap: float, first_cap: float,
                     collective: Callable[[float], float]) -> tuple[float, float, float]:
    """(total collective seconds, hidden seconds, the backward's seconds) of the bucketed
    reduction of ``pieces`` (module docstring), folded in closed form over each run of
    ``bucket_runs`` (k buckets of c seconds ready at r, r + d, ...: ``end = max(end + k c,
    r + k c, r + (k - 1) d + c)``, the recurrence being a maximum of terms linear in the bucket's
    index), so that a rank of 100 layers and 1,000 buckets costs a few operations."""
    end = total = 0.0
    for r, d, k, nbytes in bucket_runs(pieces, cap, first_cap):
        c = collective(nbytes)
        end = max(end + k * c, r + k * c, r + (k - 1) * d + c)
        total += k * c
    window = sum(p.seconds for p in pieces)
    exposed = min(total, max(0.0, end - window))
    return total, total - exposed, window
