"""Ops DTensor has no sharding rule for (e.g. CPU flash attention), or a wrong one (convolution
with a sharded weight): run them on local tensors.

``local_placements`` picks, per mesh axis, placements under which running the op on each rank's
local shards is exact; every other axis is made Replicate first. The executor redistributes the
inputs to them (autograd-correct), runs the op on ``to_local()`` tensors and wraps the result with
``DTensor.from_local``. Known ops:

    scaled dot-product attention   batch (dim 0) and heads (dim 1) shards stay local when q, k, v
                                   agree and there is no mask; a query-sequence shard (dim 2 of q,
                                   k and v Replicate) only without mask and without is_causal
                                   (a causal mask is relative to the global position)
    convolution (groups 1)         the solver's three splits (``solver/rules.py``): the batch
                                   (x Shard(0), weight and bias Replicate -> Shard(0)), the output
                                   channels (x Replicate, weight and bias Shard(0) -> Shard(1)),
                                   the input channels (x and weight Shard(1), bias Partial ->
                                   Partial); with groups > 1 only the batch
    MSE, smooth L1, Huber loss     input and target split alike on an axis stay local: reduced,
                                   the output is Partial (a mean's share scaled by the rank's
                                   elements over all: DTensor's own run of a split mean has its
                                   gradient off by the rank count), else elementwise
    anything else                  Replicate on every axis (always exact, costs a gather)

DTensor's own convolution handler (``torch/distributed/tensor/_tp_conv.py``) runs the op on the
local arguments as they come and gives the output the input's placements, whatever the weight's:
a column-split weight silently yields a local output with half the channels labelled Replicate.
``needs_local`` sends every convolution with a split operand here.

Gradients (``grad_placements``): on an axis where the output is a Shard, an operand the op read
Replicate gets only this rank's share of its gradient (a query shard's part of the keys' gradient,
a channel shard's part of the input's): Partial, summed by the edge that fed it (the executor's,
into the op), not by the local run's own move to the chosen placements, which on such an axis
moved nothing: a parameter's summand stays Partial on the DATA axis there for the gradient
reducer, which sums it over dp once. A Partial operand (a bias added once per rank) gets the full
gradient: Replicate.

``aten._assert_tensor_metadata`` (torch.export writes it after dtype casts, e.g. in HF's mask
building) is not run at all on shards: ``assert_global_metadata`` checks its size, stride, dtype,
device and layout against the DTensor's global metadata, without communication.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

SDPA_TARGETS = frozenset({
    "aten.scaled_dot_product_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
})


ASSERT_METADATA = "aten._assert_tensor_metadata.default"

# Elementwise losses of (input, target) (``solver/rules.py``'s ``_pointwise_loss``). DTensor runs
# them decomposed, and with the operands split its gradient of a mean is the ranks' count times
# too large (2x on 2 ranks: the mean's Partial(avg) backward takes each rank's mean as the whole);
# a split operand runs them here, on each rank's elements: reduced, a Partial(sum) summand, the
# mean's share scaled by the rank's elements over all (``run_local``).
LOSS_TARGETS = frozenset({"aten.mse_loss.default", "aten.smooth_l1_loss.default", "aten.huber_loss.default"})

CONV_TARGETS = frozenset({
    "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.convolution.default",
    "aten.conv1d.padding", "aten.conv2d.padding", "aten.conv3d.padding",
})
# the ops with a local run of their own (``local_placements``), which DTensor runs where
# ``needs_local`` does not send them here: no probe of whether DTensor can
OWN_LOCAL_TARGETS = SDPA_TARGETS | CONV_TARGETS | LOSS_TARGETS


def _conv_groups(target: str, args: Sequence[Any], kwargs: dict) -> int:
    general = target == "aten.convolution.default"
    if general and _arg(args, kwargs, 6, "transposed", False):
        return 0                                      # transposed: no split is exact here
    return int(_arg(args, kwargs, 8 if general else 6, "groups", 1))


def needs_local(target: str, placements: Sequence[tuple]) -> bool:
    """True when ``target`` runs here rather than through DTensor's own handler under these
    placements (torch placements per tensor argument): a convolution with any operand split.
    DTensor's handler is right only for a batch split on one mesh axis; it ignores a split weight
    (module docstring) and refuses a batch split on two axes (``[Shard(0), Shard(0)]``: "DTensor
    operator implementation does not support things like hybrid sharding strategies yet")."""
    from torch.distributed.tensor import Replicate

    if target not in CONV_TARGETS and target not in LOSS_TARGETS:
        return False
    return any(not isinstance(p, Replicate) for pl in placements for p in pl)


def assert_global_metadata(a, size=None, stride=None, dtype=None, *, device=None, layout=None) -> None:
    """``aten._assert_tensor_metadata`` against DTensor ``a``'s global metadata (what the traced
    graph saw), through the aten op itself on a meta stand-in; the device is compared here."""
    import torch

    stand_in = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    torch.ops.aten._assert_tensor_metadata(stand_in, size, stride, dtype, layout=layout)
    if device is not None and torch.device(device) != a.device:
        raise RuntimeError(f"Tensor device mismatch! Expected: {device}, Got: {a.device}")


def _arg(args: Sequence[Any], kwargs: dict, i: int, name: str, default=None):
    return args[i] if i < len(args) else kwargs.get(name, default)


def _reduction(args: Sequence[Any], kwargs: dict) -> int:
    """A ``LOSS_TARGETS`` op's reduction: 0 none, 1 mean (the default), 2 sum."""
    return _arg(args, kwargs, 2, "reduction", 1)


def local_placements(target: str, args: Sequence[Any], kwargs: dict, placements: Sequence[tuple],
                     ndims: Sequence[int]) -> tuple[list[tuple], tuple]:
    """Per tensor argument (in ``placements`` order) the placements to run locally under, and the
    placements of the (single) output. ``placements`` are torch placements per mesh axis."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    n_axes = len(placements[0]) if placements else 0
    rep = tuple(Replicate() for _ in range(n_axes))
    if target in SDPA_TARGETS and len(placements) == 3:
        mask = _arg(args, kwargs, 3, "attn_mask")
        causal = bool(_arg(args, kwargs, 5, "is_causal", False))
        q, k, v = placements
        ins: list[list] = [[], [], []]
        out: list = []
        for a in range(n_axes):
            pq, pk, pv = q[a], k[a], v[a]
            dim = pq.dim % 4 if isinstance(pq, Shard) else None
            if mask is None and dim in (0, 1) and pk == pq and pv == pq:
                choice = (pq, pq, pq)
                o = pq
            elif (mask is None and not causal and dim == 2 and isinstance(pk, Replicate)
                  and isinstance(pv, Replicate)):
                choice = (pq, pk, pv)
                o = pq
            else:
                choice = (Replicate(),) * 3
                o = Replicate()
            for i in range(3):
                ins[i].append(choice[i])
            out.append(o)
        return [tuple(p) for p in ins], tuple(out)
    if target in CONV_TARGETS and 2 <= len(placements) <= 3 and len(ndims) >= 2 and ndims[0] == ndims[1]:
        return _conv_placements(placements, _conv_groups(target, args, kwargs))
    if target in LOSS_TARGETS and len(placements) == 2 and ndims[0] == ndims[1]:
        reduced = _reduction(args, kwargs) != 0
        ins = [[], []]
        out = []
        for px, pt in zip(*placements):
            keep = isinstance(px, Shard) and px == pt
            ins[0].append(px if keep else Replicate())
            ins[1].append(pt if keep else Replicate())
            out.append((Partial() if reduced else px) if keep else Replicate())
        return [tuple(p) for p in ins], tuple(out)
    return [rep for _ in placements], rep


def _conv_placements(placements: Sequence[tuple], groups: int) -> tuple[list[tuple], tuple]:
    """Per axis, the split of ``solver/rules.py``'s conv rule the operands are in, else Replicate."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    n = len(placements)
    ins: list[list] = [[] for _ in range(n)]
    out: list = []
    for a in range(len(placements[0])):
        px, pw = placements[0][a], placements[1][a]
        pb = placements[2][a] if n > 2 else None
        rep = lambda p: isinstance(p, Replicate)            # noqa: E731
        shard = lambda p, d: isinstance(p, Shard) and p.dim == d   # noqa: E731
        if groups >= 1 and shard(px, 0) and rep(pw) and (pb is None or rep(pb)):
            o = Shard(0)
        elif groups == 1 and rep(px) and shard(pw, 0) and (pb is None or shard(pb, 0)):
            o = Shard(1)
        elif groups == 1 and shard(px, 1) and shard(pw, 1) and (pb is None or isinstance(pb, Partial)):
            o = Partial()
        else:
            px, pw, pb, o = Replicate(), Replicate(), Replicate(), Replicate()
        for i, p in enumerate((px, pw, pb)[:n]):
            ins[i].append(p)
        out.append(o)
    return [tuple(p) for p in ins], tuple(out)


def grad_placements(chosen: Sequence[tuple], out: tuple) -> list[tuple]:
    """The placements of each operand's local gradient after a local run under ``chosen`` with
    output placements ``out`` (module docstring): Partial where the operand was Replicate and the
    output a Shard, Replicate where the operand was Partial, else the operand's own."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    def one(p, o):
        if isinstance(p, Replicate) and isinstance(o, Shard):
            return Partial()
        if p.is_partial():
            return Replicate()
        return p

    return [tuple(one(p, o) for p, o in zip(pl, out)) for pl in chosen]


def sdpa_output_shape(q_shape: Sequence[int], v_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(q_shape[:-1]) + (v_shape[-1],)


def global_output_shape(target: str, tensor_shapes: Sequence[Sequence[int]], local_shape) -> Optional[tuple]:
    """Global shape of the output when it is not the local shape (sharded fallbacks)."""
    if target in SDPA_TARGETS:
        return sdpa_output_shape(tensor_shapes[0], tensor_shapes[2])
    if target in LOSS_TARGETS:
        return tuple(tensor_shapes[0]) if len(local_shape) else ()
    if target in CONV_TARGETS and len(tensor_shapes) >= 2 and len(tensor_shapes[0]) == len(local_shape):
        # batch from the input, channels from the weight; spatial dims are never split
        return (tensor_shapes[0][0], tensor_shapes[1][0]) + tuple(local_shape[2:])
    return tuple(local_shape)


def run_local(op, target: str, args, kwargs: dict, mesh):
    """``op`` on this rank's local shards, each DTensor operand first brought to the placement
    ``local_placements`` chooses (autograd-correct, with the gradient placements
    ``grad_placements`` gives); the result a DTensor with the output placement and the global
    shape. Declared contiguous, so its local tensor is made contiguous (a kernel may return another
    layout: a convolution of a channels-last-strided input, CPU flash attention). Shared by the
    executor and the emitted modules (``emit.local_op``)."""
    import torch
    import torch.fx as fx
    from torch.distributed.tensor import DTensor

    from autopar.codegen.edges import edge
    from autopar.codegen.shards import contiguous_stride

    flat: list = []              # in the order map_aggregate visits them below
    fx.node.map_aggregate((args, kwargs), lambda a: flat.append(a) if isinstance(a, DTensor) else None)
    chosen, out_pl = local_placements(target, args, kwargs, [t.placements for t in flat], [t.ndim for t in flat])
    shapes = [tuple(t.shape) for t in flat]
    it = iter(zip(flat, chosen, grad_placements(chosen, out_pl)))
    pieces: list = []

    def local(a):
        if isinstance(a, DTensor):
            t, pl, grad_pl = next(it)
            # where the operand already has the chosen placement its (Partial) gradient goes back
            # as it is: the edge that fed the operand reduces it, or keeps it Partial on DATA for
            # the gradient reducer (a parameter's summand) -- reducing it here too would sum a
            # parameter's gradient over dp twice
            keep = tuple(i for i, (have, want) in enumerate(zip(t.placements, pl)) if have == want)
            pieces.append(edge(t, tuple(pl), keep).to_local(grad_placements=grad_pl))
            return pieces[-1]
        return a
    out = op(*fx.node.map_aggregate(args, local), **fx.node.map_aggregate(kwargs, local))
    if not isinstance(out, torch.Tensor):
        raise NotImplementedError(f"local fallback for the multi-output op {target}")
    if target in LOSS_TARGETS and _reduction(args, kwargs) == 1 and any(o.is_partial() for o in out_pl):
        out = out * (pieces[0].numel() / flat[0].numel())       # the mean's share: this rank's elements of all
    split = any(o.is_shard() for o in out_pl)
    shape = global_output_shape(target, shapes, out.shape) if split else tuple(out.shape)
    return DTensor.from_local(out.contiguous(), mesh, out_pl, run_check=False, shape=torch.Size(shape),
                              stride=contiguous_stride(shape))
