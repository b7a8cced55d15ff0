"""Ops DTensor has no sharding rule for (e.g. CPU flash attention): run them on local tensors.

``local_placements`` picks, per mesh axis, placements under which running the op on each rank's
local shards is exact; every other axis is made Replicate first. The executor redistributes the
inputs to them (autograd-correct), runs the op on ``to_local()`` tensors and wraps the result with
``DTensor.from_local``. Known ops:

    scaled dot-product attention   batch (dim 0) and heads (dim 1) shards stay local when q, k, v
                                   agree and there is no mask; a query-sequence shard (dim 2 of q,
                                   k and v Replicate) only without mask and without is_causal
                                   (a causal mask is relative to the global position)
    anything else                  Replicate on every axis (always exact, costs a gather)

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


def local_placements(target: str, args: Sequence[Any], kwargs: dict, placements: Sequence[tuple],
                     ndims: Sequence[int]) -> tuple[list[tuple], tuple]:
    """Per tensor argument (in ``placements`` order) the placements to run locally under, and the
    placements of the (single) output. ``placements`` are torch placements per mesh axis."""
    from torch.distributed.tensor import Replicate, Shard

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
    return [rep for _ in placements], rep


def sdpa_output_shape(q_shape: Sequence[int], v_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(q_shape[:-1]) + (v_shape[-1],)


def global_output_shape(target: str, tensor_shapes: Sequence[Sequence[int]], local_shape) -> Optional[tuple]:
    """Global shape of the output when it is not the local shape (sharded fallbacks)."""
    if target in SDPA_TARGETS:
        return sdpa_output_shape(tensor_shapes[0], tensor_shapes[2])
    return tuple(local_shape)
