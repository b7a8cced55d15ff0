"""A gathered activation saved for backward is kept as its shard and gathered again there.

Under sequence parallelism a layer norm's output is sharded along the sequence and all-gathered
for the next matmul, which saves its input for the weight's gradient: autograd would hold the
gathered tensor, tp times the shard, from the forward to the backward. Megatron keeps the shard
and all-gathers it again in backward; so does this, as ``reshard.py`` does for ZeRO-3's gathered
parameters:

- an edge into an input the plan marks (``NodePlan.regather``: ops that save that input as they
  got it, ``solver/saved.regathered_operand``) whose moves are all-gathers only registers its
  output: the storage it made, the shard it came from and the placements it went to;
- the ``saved_tensors_hooks`` pack replaces a saved tensor (or a view of it) on such a storage by a
  record holding the shard; the unpack gathers the shard again (the same one-axis-at-a-time moves,
  ``codegen/edges.redistribute``) and rebuilds the view. The gathered tensor is shared by every
  record of that edge (an op may save several views of one input) and freed with them,
  after the last of those ops' backward: one gather per edge, as ``codegen/expected.py`` counts
  and ``solver/problem.py`` prices.

Under ``torch.autocast`` a matmul would save its own low-precision copy of the gathered input,
which no shard stands for: ``cast_for`` casts the shard first (the same values; the gather moves
half the bytes). Not marked (``codegen/program.py``): operands inside recompute regions, a
parameter's views under ZeRO-3 (the shard kept would be ZeRO-3's gathered rows) and everything
when activations are offloaded (saved tensors go to the host as they are).

The planner counts the shard in the activation memory (``solver/saved.py``). Deterministic on
every rank: the backward's order is, and a storage is confirmed by a weak reference (a freed
buffer's address reused is never taken for a registered one). Recompute regions are left to
``torch.utils.checkpoint``, whose own hooks are innermost there.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Optional

import torch

from autopar.runtime.reshard import Observed, as_saved, dtensor_spec
from autopar.solver.rules import base_name
from autopar.solver.saved import AUTOCAST_LOW


class _Gathered:
    """One registered edge output: the shard it came from, where it went, and its gathered local
    tensor once the backward asks for it again (shared by every saved view of it)."""

    def __init__(self, local: torch.Tensor, shard, target: tuple, on_free) -> None:
        # the edge output's local tensor, to confirm an address (a storage has no one Python object
        # to hold a weak reference to); it lives while the consumer that saves it runs, and its
        # end drops a registration no saved view took (``on_free``)
        self.local_ref = weakref.ref(local, on_free)
        self.shard = shard.detach()       # the producer may free its value before the consumer runs
        self.target = target
        self.full: Optional[torch.Tensor] = None

    def gathered(self) -> torch.Tensor:
        """The local gathered tensor, gathered again on the first call."""
        if self.full is None:
            from autopar.codegen.edges import redistribute

            with torch.no_grad():
                self.full = redistribute(self.shard, self.target).to_local()
        return self.full


@dataclasses.dataclass(frozen=True)
class _Saved:
    """A saved view of a registered edge output, without its data."""
    source: _Gathered
    size: tuple
    stride: tuple
    offset: int
    dtensor: tuple                     # (mesh, placements, shape, stride) of the saved DTensor


class Regather(Observed):
    """The hooks (module docstring). ``inner``: hooks that see each tensor first (ZeRO-3's
    ``Reshard``): what it replaces stays so."""

    def __init__(self, inner=None) -> None:
        self.inner = inner
        # storage address -> registration: not saved yet (weak references only), and saved (held
        # by the saved views alone, so the shard and the gathered tensor go with the last of them)
        self._fresh: dict[int, _Gathered] = {}
        self._held: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._observers: list = []

    @staticmethod
    def cast_for(x, target_op: str):
        """``x`` as a matmul of ``target_op`` under ``torch.autocast`` reads it: cast to the autocast
        dtype before its edge gathers it (autocast would cast the gathered tensor and save that
        copy, which no shard stands for; the values are the same, the gather moves half the
        bytes). Anything else as it is."""
        device = x.device.type
        if (base_name(target_op) not in AUTOCAST_LOW or not torch.is_autocast_enabled(device)
                or x.dtype != torch.float32):
            return x
        return x.to(torch.get_autocast_dtype(device))

    def register(self, shard, target: tuple, out) -> None:
        """``out`` (a DTensor) is ``shard`` all-gathered to ``target`` by an edge into an input that
        is saved as it is."""
        local = out._local_tensor
        address = local.untyped_storage().data_ptr()
        if not address:
            return
        fresh = self._fresh

        def on_free(_ref) -> None:
            if fresh.get(address) is entry:
                del fresh[address]

        entry = fresh[address] = _Gathered(local, shard, target, on_free)

    def _clear(self) -> None:
        self._fresh.clear()
        self._held.clear()

    def _source(self, t) -> Optional[_Gathered]:
        """The registration of ``t``'s storage (None: not a registered output), from now on held by
        the saved views only."""
        address = t._local_tensor.untyped_storage().data_ptr()
        for known in (self._held, self._fresh):
            source = known.get(address)
            local = source.local_ref() if source is not None else None
            if local is not None and local.untyped_storage().data_ptr() == address:
                self._held[address] = source
                self._fresh.pop(address, None)
                return source
        return None

    def _pack(self, t: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor

        packed = self._inner_pack(t)
        if packed is not t:
            return packed
        source = self._source(t) if isinstance(t, DTensor) and (self._fresh or self._held) else None
        if source is None:
            for fn in self._observers:
                fn(t)
            return t
        for fn in self._observers:
            fn(source.shard)
        local = t._local_tensor
        return _Saved(source, tuple(local.size()), tuple(local.stride()), local.storage_offset(), dtensor_spec(t))

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return self._inner_unpack(saved)
        return as_saved(saved.source.gathered().as_strided(saved.size, saved.stride, saved.offset), saved.dtensor)
