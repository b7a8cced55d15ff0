"""What the fused-kernel adapters share: placement conditions (each ``why_*`` returns why a kernel
cannot run on a value, None when it can) and the hop between DTensors and the local tensors the
kernels run on (``to_local`` in, ``wrap_local`` out). Values are DTensors or plain tensors
(local-dp mode: the local batch, no placements)."""
from __future__ import annotations

from typing import Any, Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NORM_MAX_N = 65536                 # autopar/kernels/norms.py MAX_N: one row fits one block


# ---- placements of a DTensor or plain tensor -------------------------------------------------

def is_dt(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def placements_of(t) -> tuple:
    return tuple(t.placements) if is_dt(t) else ()


def shard_dim(p, ndim: int) -> Optional[int]:
    from torch.distributed.tensor import Shard

    return p.dim % ndim if isinstance(p, Shard) else None


def why_partial(pl: tuple, what: str) -> Optional[str]:
    return f"{what} is Partial" if any(p.is_partial() for p in pl) else None


def why_sharded(pl: tuple, ndim: int, dims: tuple[int, ...], what: str) -> Optional[str]:
    """Why ``pl`` (placements of an ``ndim``-dim value) is not local along ``dims`` (negative ok)."""
    why = why_partial(pl, what)
    if why:
        return why
    local = {d % ndim for d in dims}
    hit = sorted({shard_dim(p, ndim) for p in pl} & local)
    return f"{what} is sharded on dim {hit[0]}" if hit else None


def why_not_replicated(pl: tuple, what: str) -> Optional[str]:
    if not all(p.is_replicate() for p in pl):
        return f"{what} is not Replicate on every axis ({pl})"
    return None


def no_partial(t, what: str) -> Optional[str]:
    return why_partial(placements_of(t), what)


def last_dim_local(t, what: str) -> Optional[str]:
    why = why_sharded(placements_of(t), t.ndim, (-1,), what)
    return why.replace(f"dim {t.ndim - 1}", "its last (normalized) dim") if why else None


def replicated(t, what: str) -> Optional[str]:
    if t is None or not is_dt(t):
        return None
    return why_not_replicated(tuple(t.placements), what)


def why_not_float(t, what: str) -> Optional[str]:
    if not isinstance(t, torch.Tensor):
        return f"{what} is not a tensor"
    if t.dtype not in FLOAT_DTYPES:
        return f"{what} dtype {t.dtype} is not one of fp32/bf16/fp16"
    return None


def first_reason(*reasons) -> Optional[str]:
    return next((r for r in reasons if r), None)


# ---- local tensors in, DTensor out -----------------------------------------------------------

def to_local(t, grad_placements=None):
    if t is None or not is_dt(t):
        return t
    return t.to_local(grad_placements=grad_placements)


def param_grad_placements(x) -> Optional[tuple]:
    """A Replicate parameter used with data ``x``: its local gradient is a partial sum on each axis
    that shards x (each rank saw its rows), complete on the others."""
    from torch.distributed.tensor import Partial, Replicate

    if not is_dt(x):
        return None
    return tuple(Partial() if shard_dim(p, x.ndim) is not None else Replicate() for p in x.placements)


def wrap_local(y: torch.Tensor, like, placements: tuple, shape) -> Any:
    """``y`` (local) as a DTensor on ``like``'s mesh with ``placements`` and global ``shape``;
    plain ``y`` when ``like`` is plain."""
    if not is_dt(like):
        return y
    from torch.distributed.tensor import DTensor

    from autopar.codegen.shards import contiguous_stride

    shape = torch.Size(shape)
    return DTensor.from_local(y, like.device_mesh, placements, run_check=False, shape=shape,
                              stride=contiguous_stride(tuple(shape)))


def call_arg(args, kwargs, i: int, name: str, default=None):
    return args[i] if i < len(args) else kwargs.get(name, default)
