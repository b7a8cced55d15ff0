"""Gradient buckets and ZeRO chunks: pure arithmetic shared by the reducer and the predictor.

Data-parallel traffic is bucketed: parameters (in reverse graph order, roughly the order their
gradients are ready) are packed into buckets of at most ``bucket_bytes`` of gradient (a larger
parameter gets a bucket of its own), one dtype per bucket, one collective per bucket. The first
bucket is capped at ``first_bucket_bytes`` (1 MB, as DDP) so the first reduction starts early in
backward.

ZeRO shards each parameter's tp-local tensor by rows (dim 0; a 0-d tensor is one row) over the
dp ranks, like ``Shard(0)``: ``chunk_rows = ceil(rows / dp)``, rank r owns rows
``[r * chunk_rows, min((r + 1) * chunk_rows, rows))``. Collectives move padded chunks, so a
bucket's reduce-scatter input / all-gather output is ``dp * sum(chunk_rows * row_numel)`` elements.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from autopar.ir import DTYPE_BYTES

DEFAULT_BUCKET_BYTES = 25 * 2**20
DEFAULT_FIRST_BUCKET_BYTES = 2**20


@dataclass(frozen=True)
class ParamLayout:
    name: str
    local_shape: tuple[int, ...]   # this rank's tp-local shape (the tensor dp ranks share)
    dtype: str

    @property
    def rows(self) -> int:
        return self.local_shape[0] if self.local_shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.local_shape[1:]) if self.local_shape else 1

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def chunk_rows(self, dp: int) -> int:
        return math.ceil(self.rows / dp)

    def row_range(self, dp: int, r: int) -> tuple[int, int]:
        c = self.chunk_rows(dp)
        a = min(r * c, self.rows)
        return a, min(a + c, self.rows)

    def padded_numel(self, dp: int) -> int:
        """Elements of ALL dp chunks, padded (what reduce-scatter / all-gather move)."""
        return dp * self.chunk_rows(dp) * self.row_numel


def plan_buckets(params: Sequence[ParamLayout], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES) -> tuple[tuple[int, ...], ...]:
    """Indices into ``params``, grouped into buckets (reverse order, greedy, one dtype per bucket)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    dtype = None
    for i in reversed(range(len(params))):
        p = params[i]
        cap = min(bucket_bytes, first_bucket_bytes) if not buckets else bucket_bytes
        if current and (size + p.nbytes > cap or p.dtype != dtype):
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(i)
        size += p.nbytes
        dtype = p.dtype
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


def bucket_comm_bytes(params: Sequence[ParamLayout], bucket: Sequence[int], dp: int, kind: str) -> int:
    """nbytes (``autopar.cost`` convention) of one bucket collective of ``kind``."""
    esize = DTYPE_BYTES[params[bucket[0]].dtype]
    if kind == "all_reduce":
        return sum(params[i].numel for i in bucket) * esize
    if kind in ("reduce_scatter", "all_gather"):
        return sum(params[i].padded_numel(dp) for i in bucket) * esize
    raise ValueError(f"no bucket collective {kind!r}")
