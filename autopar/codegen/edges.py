"""Edges: a value moved from its producer's placements to a consumer's, autograd-correct.

``edge(x, target)`` redistributes forward; backward redistributes the gradient to the producer's
output placement (Partial read as Replicate), the solver's cost model (``solver/reshard.py``).
Edges into a Replicate input are wrapped even when nothing moves forward, because the consumer may
hand back a Partial gradient (Megatron's "f"): the all-reduce then happens on that edge.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Partial as TPartial, Replicate as TReplicate, Shard as TShard

from autopar.codegen.program import Placements
from autopar.codegen.shards import chunk_range, contiguous_stride
from autopar.placements import Partial, Replicate, Shard, gathers_only, redistribute_steps, to_torch


def _grad_placements(placements) -> tuple:
    return tuple(TReplicate() if p.is_partial() else p for p in placements)


class _Edge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, keep_partial_axes):
        ctx.back = _grad_placements(x.placements)
        ctx.keep = keep_partial_axes
        # a Partial value goes to its consumer contiguous (``_partial_contiguous``): a copy then
        ctx.passes_through = tuple(x.placements) == tuple(target) and not _needs_copy(x, target)
        if ctx.passes_through:
            return x.view_as(x)         # a view: ``activation_offload.cast_of_resident``
        return _partial_contiguous(redistribute(x, target))

    @staticmethod
    def backward(ctx, g):
        for i in ctx.keep:
            if g.placements[i].is_shard() and ctx.back[i] == TReplicate():
                g = _summand(g, i)
        back = tuple(have if i in ctx.keep and have.is_partial() else want
                     for i, (have, want) in enumerate(zip(g.placements, ctx.back)))
        if tuple(g.placements) != back:
            g = redistribute(g, back)
        return g, None, None


def _summand(g: DTensor, axis: int) -> DTensor:
    """``g``, sharded on mesh axis ``axis`` (a kept one: the gradient of a value replicated there
    whose consumers read rows of it, such as ViT's class token broadcast to the batch), as a
    Partial summand there: this rank's rows in place, zeros elsewhere (their sum over the axis is
    the whole gradient). No communication, where redistributing to Replicate all-gathers; the
    reducer sums the parameter's summands. As it is where another axis shards the same dim."""
    d = g.placements[axis].dim
    if any(p.is_shard(d) for i, p in enumerate(g.placements) if i != axis):
        return g
    size = g.shape[d]
    start, _ = chunk_range(size, g.device_mesh.size(axis), g.device_mesh.get_local_rank(axis))
    local = g.to_local()
    pad = [0, 0] * (local.dim() - d - 1) + [start, size - start - local.shape[d]]
    placements = tuple(TPartial() if i == axis else p for i, p in enumerate(g.placements))
    return DTensor.from_local(torch.nn.functional.pad(local, pad), g.device_mesh, placements, run_check=False,
                              shape=g.shape, stride=contiguous_stride(g.shape))


def _contiguous(x: DTensor) -> DTensor:
    """``x`` with contiguous strides before DTensor moves it. A collective returns a contiguous
    local tensor, but ``DTensor.redistribute`` keeps the input's strides in the result's metadata:
    a non-contiguous value (after ``movedim``, or an op on one) would come out with metadata that
    its local tensor does not match, and the next ``view`` fails ("view size is not compatible
    with input tensor's size and stride"). Made contiguous locally, its placements kept: DTensor's
    own ``contiguous`` propagates a strategy, which over three mesh axes may move a Partial value
    (seen: (P, R, S(2)) came out (S(1), ...), a reduce-scatter the plan did not have)."""
    if x.is_contiguous():
        return x
    return DTensor.from_local(x.to_local().contiguous(), x.device_mesh, x.placements, run_check=False,
                              shape=x.shape, stride=contiguous_stride(x.shape))


def _needs_copy(x: DTensor, target) -> bool:
    return not x.is_contiguous() and any(p.is_partial() for p in target)


def _partial_contiguous(x: DTensor) -> DTensor:
    """``x`` contiguous where it is Partial on some mesh axis. An op that copies a non-contiguous
    input runs ``aten.clone`` (``linear`` and ``matmul`` reshape theirs: a channels-last view after
    ``movedim``), and DTensor's clone strategy takes Partial to Replicate: an all-reduce of the
    activation that the plan does not have, and the op then runs replicated (its weight's gradient
    comes out Replicate, not the Partial the plan reduces). Made contiguous here, locally, the op
    reads it as a view and keeps the Partial (``tests/runtime/test_edges.py``)."""
    return _contiguous(x) if _needs_copy(x, x.placements) else x


def _held_mask(p):
    """The mask a masked-Partial placement (DTensor's vocab-sharded lookup) holds, None if none."""
    buf = getattr(p, "mask_buffer", None)
    return buf if buf is not None and buf.data is not None else None


class _Unmask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        local = x.to_local().clone()
        placements = []
        for p in x.placements:
            buf = _held_mask(p)
            if buf is not None:
                buf.apply_mask(local)
                buf.release_mask()
                p = TPartial(p.reduce_op)
            placements.append(p)
        return DTensor.from_local(local, x.device_mesh, tuple(placements), run_check=False,
                                  shape=x.shape, stride=x.stride())

    @staticmethod
    def backward(ctx, g):
        return g            # the lookup's own backward masks its rows (as after DTensor's reduction)


def unmasked(x):
    """``x`` with a masked Partial (DTensor's vocab-sharded embedding lookup: the rows of indices
    outside this rank's vocabulary slice are masked when the value is reduced, and the mask is
    then released) made a plain Partial(sum), the mask applied now on a copy. The plan may reduce
    the value more than once (a lookup read by a norm's reduce-scatter and by the residual add: the
    second reduction found the mask released, an AssertionError in torch; ``benchmarks/fuzz.py
    --seed 36``). Anything else as it is."""
    if isinstance(x, DTensor) and any(_held_mask(p) is not None for p in x.placements):
        return _Unmask.apply(x)
    return x


def release_masks(out) -> None:
    """A probe's output is thrown away unreduced, so release the mask a masked-Partial placement
    (the vocab-sharded embedding lookup) materialized; otherwise the next call with other indices
    finds it still held ("MaskBuffer has been materialized with conflicting data")."""
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, DTensor):
            for p in t.placements:
                buf = _held_mask(p)
                if buf is not None:
                    buf.release_mask()


def redistribute(x: DTensor, target: tuple) -> DTensor:
    """``x`` in torch placements ``target``, one mesh axis at a time in the order
    ``placements.redistribute_steps`` gives (the one ``expected.py`` counts and the planner prices
    axis by axis; DTensor's own multi-axis redistribution may all-reduce where a reduce-scatter
    is planned, or gather on one axis a tensor still whole on another). A Replicate made
    Partial(sum) is local: each rank keeps 1/n of the value (a bias added after a row-parallel
    matmul), which DTensor keeps internal. Nested shards of one dim move in DTensor's own order
    (``placements._nested_steps``), one axis at a time too."""
    mesh = x.device_mesh
    planned = _plan_placements(target, x.ndim)
    for ax, p in _steps(_plan_placements(x.placements, x.ndim), planned):
        have = tuple(x.placements)
        want = target[ax] if p == planned[ax] else TReplicate()     # else the Replicate on the way
        nxt = have[:ax] + (want,) + have[ax + 1:]
        if want.is_partial() and not have[ax].is_partial():
            x = DTensor.from_local(x.to_local() / mesh.size(ax), mesh, nxt, run_check=False,
                                   shape=x.shape, stride=x.stride())
        else:
            x = _contiguous(x).redistribute(mesh, nxt)
    # two Partials count as one placement in the steps: another reduce op is DTensor's to convert
    return x if tuple(x.placements) == tuple(target) else _contiguous(x).redistribute(mesh, target)


@functools.lru_cache(maxsize=None)
def _steps(have: tuple, want: tuple) -> tuple:
    """``redistribute_steps``, once per pair of placements (every edge of every step asks)."""
    return tuple(redistribute_steps(have, want))


def _plan_placements(pl, ndim: int) -> tuple:
    """Torch placements as autopar's (Shard dims made >= 0; every Partial one Partial)."""
    return tuple(Shard(p.dim % max(ndim, 1)) if p.is_shard() else Partial() if p.is_partial() else Replicate()
                 for p in pl)


def resolve(x: DTensor, want: Optional[Placements]) -> tuple:
    """The torch placements ``want`` asks of ``x`` (None entries keep x's; a plan Partial accepts
    any Partial x already has)."""
    return resolve_placements(tuple(x.placements), x.ndim, want)


def resolve_placements(have: tuple, ndim: int, want: Optional[Placements]) -> tuple:
    """``resolve`` for a value of ``ndim`` dims that has torch placements ``have``."""
    if want is None:
        return have
    out = []
    for h, w in zip(have, want):
        if w is None or (isinstance(w, Partial) and h.is_partial()):
            out.append(h)
        elif isinstance(w, Shard) and w.dim < 0:
            out.append(TShard(w.dim + ndim))
        else:
            out.append(to_torch(w))
    return tuple(out)


def edge(x: DTensor, target: tuple, keep_partial_axes: tuple[int, ...] = (), regather=None) -> DTensor:
    """``x`` in ``target`` placements; see the module docstring for the backward. A gradient that
    is Partial on an axis of ``keep_partial_axes`` stays Partial (a parameter's summand on dp is
    reduced by the bucketed reducer, not here). ``regather``: a ``runtime/regather.Regather`` to
    register the result with when the edge only all-gathers (its consumer saves it: the shard is
    kept for backward instead)."""
    same = tuple(x.placements) == target
    if not (x.requires_grad and torch.is_grad_enabled()):
        out = _partial_contiguous(x if same else redistribute(x, target))
    else:
        mesh = x.device_mesh
        guard = any(isinstance(p, TReplicate) and mesh.size(i) > 1 and i not in keep_partial_axes
                    for i, p in enumerate(target))
        passes = same and not guard and not _needs_copy(x, target)
        out = x if passes else _Edge.apply(x, target, keep_partial_axes)
    if regather is not None and not same and torch.is_grad_enabled() and _gathers_only(
            _plan_placements(x.placements, x.ndim), _plan_placements(target, x.ndim)):
        regather.register(x, target, out)
    return out


_gathers_only = functools.lru_cache(maxsize=None)(gathers_only)     # per pair of placements, once

