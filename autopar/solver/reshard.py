"""Resharding on one mesh axis: the collective that turns one placement into another, and its time.

Forward, a producer's output placement ``src`` must become the consumer's input placement ``dst``:

    src \\ dst   R               S(b)                 P
    R           -               slice (free)         local 1/t scaling (free; used for a bias
                                                     added after a row-parallel matmul)
    S(a)        all_gather      a == b: -            via R: all_gather
                                a != b: all_to_all
    P           all_reduce      reduce_scatter       -

Backward (DTensor semantics): the consumer produces the gradient of its input in the placement
its strategy implies (``Strategy.input_grads``: the input placement itself, Partial when a
replicated input meets split work, Replicate for a Partial input), and that gradient is resharded
to the placement of the producer's output gradient: the output placement itself, or Replicate when
the output is Partial (the gradient of a sum of summands is the same on every rank). So the
transposes come out as:

    forward                  backward (gradient, consumer -> producer)
    S(d) -> R  all_gather    P -> S(d) reduce_scatter   (grad is Partial: split work after the gather)
                             R -> S(d) free slice        (grad is Replicate: replicated work)
    P -> R     all_reduce    R -> R    free
    P -> S(d)  reduce_scatter  S(d) -> R all_gather
    R -> S(d)  free slice    S(d) -> R all_gather
    R (col)    free          P -> R    all_reduce        (Megatron's "f" operator)

The last row is why this is costed on the edge and not inside the op: with sequence parallelism
the producer holds S(seq) and the same Partial gradient needs a reduce_scatter, not an
all_reduce. Times come from ``cost.collective_s`` on the axis link.
"""
from __future__ import annotations

from autopar.cost.collectives import collective_s
from autopar.cost.hardware import LinkSpec
from autopar.placements import Partial, Placement, Replicate, reshard_kind


def reshard_s(src: Placement, dst: Placement, nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds to reshard a tensor of ``nbytes`` (its full, unsharded size) from ``src`` to ``dst``
    on an axis of ``n`` ranks whose groups cross ``link``."""
    kind = reshard_kind(src, dst)
    if kind is None or n == 1:
        return 0.0
    if kind == "all_to_all":
        return collective_s(kind, nbytes / n, n, link)      # each rank sends its shard
    return collective_s(kind, nbytes, n, link)               # AG: output; AR, RS: input = full


def grad_target(producer_output: Placement) -> Placement:
    """Placement the producer needs its output's gradient in (Partial outputs take a Replicate grad)."""
    return Replicate() if isinstance(producer_output, Partial) else producer_output
