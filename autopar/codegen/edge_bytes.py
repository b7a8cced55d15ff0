"""The bytes of moving a tensor between placements on a mesh, as DTensor and autopar's runtime move it.

``edge_moves``: one collective per mesh axis that changes, in the order ``edges.redistribute``
runs them (``placements.redistribute_steps``), each of the piece a rank holds at that point (the
tensor divided by its shard counts on the other axes, an uneven shard padded to equal chunks as
DTensor pads it). ``nbytes`` as ``autopar.cost.collectives``: all_reduce the tensor, all_gather
the OUTPUT, reduce_scatter the INPUT, all_to_all each rank's send buffer (gloo: an all_gather).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from autopar import placements
from autopar.codegen.shards import chunk_range
from autopar.ir import DTYPE_BYTES, TensorMeta
from autopar.placements import Placement, Shard


def norm(p: Placement, ndim: int) -> Placement:
    return Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 else p


def piece_bytes(meta: TensorMeta, pl: Sequence[Placement], sizes: Sequence[int], axis: int, kind: str,
                src: Optional[Placement] = None, dst: Optional[Placement] = None) -> int:
    """Bytes a collective on ``axis`` moves for a tensor with placements ``pl`` elsewhere, moving
    it from ``src`` to ``dst`` on ``axis`` (``kind``: ``placements.reshard_kind``'s). A shard that
    does not divide evenly is padded to equal chunks first, as DTensor does: an all_gather's output
    and a reduce_scatter's input hold n x ceil(d / n) along the sharded dim (n ranks), an
    all_to_all pads the old shard dim to ceil(d / n) and the new one to n x ceil(d / n) (gloo:
    all-gathered, n x that)."""
    shape = list(meta.shape)
    for b, p in enumerate(pl):
        if b != axis and isinstance(p, Shard) and shape:
            d = p.dim % len(shape)
            a, e = chunk_range(shape[d], sizes[b], 0)
            shape[d] = e - a
    n = sizes[axis]

    def padded(p: Optional[Placement], chunks: int) -> None:     # dim of shard p: ``chunks`` padded chunks
        if isinstance(p, Shard) and shape:
            d = p.dim % len(shape)
            shape[d] = -(-shape[d] // n) * chunks

    if kind == "all_gather":
        padded(src, n)
    elif kind == "reduce_scatter":
        padded(dst, n)
    elif kind in ("all_to_all", "all_to_all_gloo"):
        padded(src, 1 if kind == "all_to_all" else n)
        padded(dst, n)
    return math.prod(shape) * DTYPE_BYTES[meta.dtype]


def moved(meta: TensorMeta, pl: Sequence[Placement], sizes: Sequence[int], axis: int, src: Placement,
          dst: Placement, backend: str) -> Optional[tuple[str, int]]:
    """(kind as logged, bytes) of moving a tensor with placements ``pl`` elsewhere from ``src`` to
    ``dst`` on ``axis``; None when nothing moves."""
    k = placements.reshard_kind(src, dst)
    if k is None:
        return None
    if k == "all_to_all" and backend == "gloo":
        return "all_gather", piece_bytes(meta, pl, sizes, axis, "all_to_all_gloo", src, dst)
    return k, piece_bytes(meta, pl, sizes, axis, k, src, dst)


def edge_moves(meta: TensorMeta, src: tuple, dst: tuple, sizes: Sequence[int],
               backend: str) -> list[tuple[str, int, int]]:
    """(kind as logged, axis index, bytes) of each collective that moves a tensor from placements
    ``src`` to ``dst`` (normalized dims), one axis at a time as ``edges.redistribute`` runs them
    (``placements.redistribute_steps``; nested shards of one dim in DTensor's order)."""
    cur, out = list(src), []
    for ax, p in placements.redistribute_steps(src, dst):
        k = moved(meta, cur, sizes, ax, cur[ax], p, backend) if sizes[ax] > 1 else None
        cur[ax] = p
        if k is not None:
            out.append((k[0], ax, k[1]))
    return out
