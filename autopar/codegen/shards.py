"""Shard arithmetic: which slice of a full tensor a rank holds, in DTensor's chunking.

``Shard(d)`` on an axis of ``n`` ranks splits dim ``d`` like ``torch.chunk``: pieces of
``ceil(size / n)``, the last ones shorter or empty. Two axes sharding the same dim nest in mesh
order (axis 0 first, then axis 1 splits axis 0's piece), as DTensor does. Pure functions of
shapes and coordinates -- no torch.distributed.
"""
from __future__ import annotations

import math
from typing import Sequence

from autopar.placements import Partial, Placement, Shard


def chunk_range(size: int, n: int, i: int) -> tuple[int, int]:
    """[start, end) of piece ``i`` of ``n`` when ``size`` is split like ``torch.chunk``."""
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"chunk {i} of {n} is out of range")
    c = math.ceil(size / n) if size else 0
    start = min(i * c, size)
    return start, min(start + c, size)


def local_ranges(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
                 coord: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Per tensor dim, the [start, end) this mesh coordinate holds of a full tensor ``shape``."""
    if not (len(placements) == len(mesh_shape) == len(coord)):
        raise ValueError(f"placements {placements}, mesh {tuple(mesh_shape)} and coordinate "
                         f"{tuple(coord)} must have one entry per mesh axis")
    ranges = [(0, s) for s in shape]
    for p, n, c in zip(placements, mesh_shape, coord):
        if isinstance(p, Partial):
            raise ValueError("a Partial placement has no slice of the full tensor")
        if isinstance(p, Shard):
            d = p.dim + len(shape) if p.dim < 0 else p.dim
            if not 0 <= d < len(shape):
                raise ValueError(f"Shard({p.dim}) on a tensor of shape {tuple(shape)}")
            lo, hi = ranges[d]
            a, b = chunk_range(hi - lo, n, c)
            ranges[d] = (lo + a, lo + b)
    return tuple(ranges)


def local_shape(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
                coord: Sequence[int]) -> tuple[int, ...]:
    return tuple(b - a for a, b in local_ranges(shape, placements, mesh_shape, coord))


def slice_of(t, ranges: Sequence[tuple[int, int]]):
    """``t[ranges]`` as a view."""
    return t[tuple(slice(a, b) for a, b in ranges)]


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))
