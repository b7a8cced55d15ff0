"""Gradients DTensor hands back Replicate where ``expected._grad_placement`` reads the plan's Shard.

A sum or mean over a dim sharded on an axis (the plan's output Partial there) gets its output's
gradient Replicate -- a Partial value's gradient always is (``edges._Edge`` reads Partial as
Replicate) -- and its backward expands that gradient: the input's gradient is Replicate, not the
input's Shard (``torch/distributed/tensor``: ``mean_backward`` / ``sum_backward`` are an expand of
the Replicate gradient). Nothing puts it back into the plan's Shard where the runtime does not
wrap (``edges.edge``): an input edge where nothing moves and no input is Replicate on an axis of
size > 1, and the producer's output pin (``GraphExecutor._fix_output`` / ``emit_runtime.pin``)
where its planned output has no Replicate on an axis of size > 1. An add or sub passes its output's
gradient to its operands as it is (a broadcast operand: summed over the broadcast dims, still
Replicate), so a Replicate gradient that reached one goes on to its inputs; a wrapped edge then
moves Replicate -> the producer's placement (free: a local chunk) instead of the planned
Shard -> Shard(other dim) all_to_all, Shard -> Replicate all_gather or Partial -> Replicate
all_reduce. Every other op's backward with a sharded saved operand makes the gradient that shard
again (DTensor's pointwise rule follows the sharded operand, for free), as the plan has it; a value
whose gradient sums Replicate and Shard parts gets the Shard (the Replicate part chunked, free)."""
from __future__ import annotations

from typing import Callable, Collection, Optional

from autopar.ir import GraphIR
from autopar.placements import Partial, Replicate, Shard
from autopar.solver.rules import base_name, find_rule

REDUCE = frozenset({"sum", "mean"})      # backward: expand the output's gradient
PASS = frozenset({"add", "sub"})         # backward: the output's gradient to each operand as it is


def _norm(p, ndim: int):
    return Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 and ndim else p


def replicate_grads(graph: GraphIR, nplan: dict, out_placement: Callable, sizes: tuple, data_axis: Optional[int],
                    need: dict, keep_partial: Collection[str] = (), runs: Callable = lambda key: True,
                    ) -> dict[tuple[str, int], frozenset[int]]:
    """(consumer key, input index) -> the mesh axes on which that consumer hands back its input's
    gradient Replicate although the plan reads the input Shard or Replicate (module docstring).
    ``nplan``: key -> ``NodePlan``; ``out_placement(node)``: a value's planned placements, as
    ``expected.part_collectives`` reads them; ``need``: which values need a gradient (consumers that
    need none hand back nothing); ``data_axis`` and ``keep_partial``: the DATA axis and the values
    (positional) whose gradient stays Partial there (no guard on that axis), parameters too."""
    users: dict[str, list] = {}
    for n in graph.nodes:
        for i, r in enumerate(n.inputs):
            users.setdefault(r.key, []).append((n, i))

    def wrapped(u, n, i: int) -> bool:
        """Whether the edge u -> input i of n is an ``edges._Edge`` (its backward moves the gradient
        to u's placement)."""
        a, pl = out_placement(u), nplan[n.key].inputs
        b = pl[i] if i < len(pl) else None
        if a is None or b is None or not u.outputs:
            return True
        nd = len(u.outputs[n.inputs[i].index or 0].shape)
        keep = data_axis if (u.kind == "param" or u.key in keep_partial) else None
        for ax, (x, y) in enumerate(zip(a, b)):
            x, y = _norm(x, nd), _norm(y, nd)
            if y is not None and x != y and not (isinstance(x, Partial) and isinstance(y, Partial)):
                return True
            if isinstance(y if y is not None else x, Replicate) and sizes[ax] > 1 and ax != keep:
                return True
        return False

    arrive: dict[str, frozenset[int]] = {}
    hands: dict[tuple[str, int], frozenset[int]] = {}
    for n in reversed(graph.nodes):
        np_ = nplan.get(n.key)
        if n.kind != "op" or np_ is None or not np_.inputs or not runs(n.key) or not n.outputs:
            continue
        out = np_.output
        nd = len(n.out.shape)
        rep = set()
        pinned = out is None or find_rule(n.target) is None or n.target == "getitem" or any(
            isinstance(p, Replicate) and sizes[ax] > 1 and not (n.key in keep_partial and ax == data_axis)
            for ax, p in enumerate(out))
        if not pinned:
            for ax, p in enumerate(out):
                if sizes[ax] == 1 or not isinstance(_norm(p, nd), Shard):
                    continue
                got = [ax in hands.get((c.key, i), ()) and not wrapped(n, c, i) if c.kind == "op" and runs(c.key)
                       and c.key in nplan else False for c, i in users.get(n.key, ())
                       if c.kind != "op" or need.get(c.key, True)]
                if got and all(got):
                    rep.add(ax)
        arrive[n.key] = frozenset(rep)
        name = base_name(n.target)
        for i, b_pl in enumerate(np_.inputs):
            if b_pl is None or i >= len(n.inputs):
                continue
            axes = set()
            for ax, b in enumerate(b_pl):
                if sizes[ax] == 1 or b is None or isinstance(b, Partial):
                    continue
                if name in REDUCE and isinstance(b, Shard) and out is not None and isinstance(out[ax], Partial):
                    axes.add(ax)
                elif name in PASS and ax in arrive[n.key]:
                    axes.add(ax)
            if axes:
                hands[(n.key, i)] = frozenset(axes)
    return hands
