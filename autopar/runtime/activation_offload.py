"""Activation offload (offload class ``activations``, ``runtime/offload.make_offload``): every
saved tensor to host memory in the forward, back in the backward.

A ``saved_tensors_hooks`` pair: every tensor autograd saves (at least ``min_bytes``, not a
parameter) is copied to host memory in the forward and back to the device when the backward
unpacks it; the device copy lives only while its node's backward runs. On CUDA the copies run
on a side stream (``runtime/copy_stream.py``) and the backward prefetches: each unpack starts
bringing back the latest-packed tensors not unpacked yet (the next the backward needs, as it
runs the forward in reverse), up to the bytes of the largest saved tensor, so their copies up
overlap other nodes' backward and at most that much waits on the device beside the node's own.
A host copy lives as long as a node that saved it has not run its backward (the packed
objects autograd holds own it; the offload's step bookkeeping only points at it), so a
pipeline schedule's host holds the micro-batches in flight, not every one of the step's.
DTensors keep their mesh and placements. Under ZeRO-3 the reshard hooks (``runtime/reshard.py``) go first: a saved
gathered weight is re-gathered, not offloaded. Under autocast a matmul saves the 16-bit copy
autocast made of its weight: where the weight is the stored parameter (not gathered, not on the
host) that copy is made again from it in the backward (``cast_of_resident``: one cast kernel,
the same bits) instead of crossing PCIe twice: a fifth of the bytes a 4-layer hidden-4096
GPT saves (1.68 of 7.39 GB a step, from the weights' shapes).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Optional

import torch
from torch import nn

from autopar.runtime.copy_stream import Copies
from autopar.runtime.reshard import Observed, as_saved, dtensor_spec

ACTIVATION_MIN_BYTES = 1024          # smaller saved tensors stay on the device (not worth a copy)


@dataclasses.dataclass(frozen=True)
class _Offloaded:
    """A saved tensor's host copy (and, for a DTensor, what rebuilds it)."""
    host: torch.Tensor
    dtensor: Optional[tuple]           # (mesh, placements, shape, stride)
    index: int                         # the host copy's place in this step's packing order
    stride: tuple                      # the device tensor's layout (``Copies.dense_stride``)


@dataclasses.dataclass(frozen=True)
class _Recast:
    """A saved low-precision copy of a resident parameter (autocast's cast of a weight, maybe seen
    through views), made again in the backward from the parameter instead of offloaded."""
    source: torch.Tensor               # the stored parameter (the use's ``ctx.resident``)
    version: int                       # its version counter when the copy was saved
    dtype: torch.dtype
    geometry: tuple                    # (shape, stride, storage offset) of the saved view of the copy
    dtensor: Optional[tuple]           # (mesh, placements, shape, stride)


# autograd nodes of ops that only view their input: a saved tensor behind them shares the storage of
# the tensor before them (so does an edge whose placements already were the target's: its node says
# ``passes_through``, ``codegen/edges._Edge``)
_VIEW_NODES = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
                         "UnsafeViewBackward0", "AliasBackward0", "ExpandBackward0", "SliceBackward0",
                         "SelectBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1"})


def cast_of_resident(t: torch.Tensor, local: torch.Tensor) -> Optional[_Recast]:
    """``t`` (``local``: its local tensor) as a ``_Recast`` when it is a view of a cast of a
    resident parameter: its autograd history is views, one ``_to_copy`` and a parameter use whose
    node holds the stored tensor (``params.resident_source``), and ``local`` lies in the storage
    of that cast (contiguous, as ``_to_copy`` lays out a contiguous source). Else None."""
    fn = t.grad_fn
    while fn is not None and (type(fn).__name__ in _VIEW_NODES or getattr(fn, "passes_through", False)):
        fn = fn.next_functions[0][0] if fn.next_functions else None
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return None
    use = fn.next_functions[0][0]
    while use is not None and getattr(use, "passes_through", False):    # the same tensor, as it came
        use = use.next_functions[0][0] if use.next_functions else None
    source = getattr(use, "resident", None)
    if (not isinstance(source, torch.Tensor) or not source.is_contiguous() or source.dtype == local.dtype
            or not local.dtype.is_floating_point
            or local.untyped_storage().nbytes() != source.numel() * local.element_size()):
        return None
    return _Recast(source, source._version, local.dtype, (tuple(local.shape), local.stride(), local.storage_offset()),
                   dtensor_spec(t))


def recast(saved: _Recast) -> torch.Tensor:
    """The saved copy made again (the same rounding of the same values: bit for bit)."""
    if saved.source._version != saved.version:
        raise RuntimeError(
            "activation offload: a parameter changed between the forward and the backward that read "
            "its low-precision copy (an in-place update of a parameter inside the step); update "
            "parameters only after the backward, or run without offload=activations")
    with torch.no_grad():
        local = saved.source.to(saved.dtype).as_strided(*saved.geometry)
    return as_saved(local, saved.dtensor)


class ActivationOffload(Observed):
    """Saved tensors to the host in the forward, back in the backward (module docstring); an
    observer sees the saved tensors that stay on the device.
    ``inner``: hooks that see each tensor first (``regather.Regather``, over ZeRO-3's ``Reshard``):
    what it replaces stays so."""

    def __init__(self, device: torch.device, param_storages, inner=None, min_bytes: int = ACTIVATION_MIN_BYTES) -> None:
        self.device, self.inner, self.min_bytes = device, inner, min_bytes
        self._params = param_storages      # () -> data pointers of the parameters' storages
        self._observers: list = []
        self._skip: frozenset = frozenset()
        # this step's host copies by (storage, offset, size, stride, version): a tensor saved by
        # several nodes (an activation feeding two matmuls) is copied down once
        self._copies: dict[tuple, tuple] = {}    # key -> (weakref to the storage, its index)
        self.copies = Copies(device)
        # in packing order: (weak reference to the host copy, the device stride, its bytes); the
        # packed objects autograd holds own the copies, so one is freed once its last saver ran
        self._order: list[tuple] = []
        self._unpacked: set[int] = set()         # their indices brought back at least once
        self._next = -1                          # the latest-packed index that may not be unpacked yet
        self._ahead: dict[int, Any] = {}         # index -> copy_stream.Upload started by the prefetch
        self.unpacked = self.prefetched = 0      # over the run: saved tensors brought back (each once); prefetched
        self.recast = 0                          # over the run: saved weight copies made again, not offloaded

    @contextlib.contextmanager
    def hooks(self):
        self._skip = frozenset(self._params())
        with super().hooks():
            yield

    def _clear(self) -> None:
        self._copies.clear()
        self._order.clear()
        self._unpacked.clear()
        self._ahead.clear()
        self._next = -1

    def _pack(self, t: torch.Tensor):
        from torch.distributed.tensor import DTensor

        packed = self._inner_pack(t)
        if packed is not t:
            return packed
        local = t._local_tensor if isinstance(t, DTensor) else t
        if (local.device.type == "meta" or isinstance(local, nn.Parameter)
                or local.numel() * local.element_size() < self.min_bytes
                or local.untyped_storage().data_ptr() in self._skip):
            for fn in self._observers:
                fn(t)
            return t
        again = cast_of_resident(t, local)
        if again is not None:
            self.recast += 1
            return again
        storage = local.untyped_storage()
        key = (storage.data_ptr(), local.storage_offset(), tuple(local.shape), local.stride(), local._version,
               local.dtype)
        seen = self._copies.get(key)
        # the same storage still (torch keeps one Python object per storage while it lives): a
        # freed one's address reused by a new tensor is not taken for it
        host = self._host(seen[1]) if seen is not None and seen[0]() is storage else None
        if host is None:                         # (a copy whose savers all ran is made again)
            index = self._next = len(self._order)
            host = self.to_host(local)
            self._order.append((weakref.ref(host), self.copies.dense_stride(local), host.nbytes))
            self._copies[key] = (weakref.ref(storage), index)
        else:
            index = seen[1]
        return _Offloaded(host, dtensor_spec(t), index, self._order[index][1])

    def _host(self, index: int) -> Optional[torch.Tensor]:
        """The ``index``-th host copy, None once every node that saved it ran its backward."""
        return self._order[index][0]()

    def to_host(self, local: torch.Tensor) -> torch.Tensor:
        """``local``'s host copy (asynchronous on CUDA's side stream; ``memory_measure`` spies it), or
        what stands for it (``from_host`` gives the copy back): the next index of ``_order``'s."""
        return self.copies.down(local)

    def from_host(self, index: int, host: torch.Tensor) -> torch.Tensor:
        """The host copy of the ``index``-th tensor packed, which ``to_host`` gave ``host``."""
        return host

    def close(self) -> None:
        """Release what outlives a step (nothing here; the NVMe tier's files)."""

    def _unpack(self, saved):
        if isinstance(saved, _Recast):
            return recast(saved)
        if not isinstance(saved, _Offloaded):
            return self._inner_unpack(saved)
        upload = self._ahead.pop(saved.index, None)
        self.unpacked += saved.index not in self._unpacked
        self.prefetched += upload is not None
        upload = upload or self.copies.up(self.from_host(saved.index, saved.host), saved.stride)
        self._unpacked.add(saved.index)
        if self.copies.overlapped:
            self._prefetch()
        return as_saved(upload.get(), saved.dtensor)

    def coming(self, window: int) -> list[int]:
        """The indices of the latest-packed tensors not unpacked yet, the next the backward needs,
        as many as fit in ``window`` bytes (one at least)."""
        while self._next >= 0 and self._next in self._unpacked:
            self._next -= 1
        want, size = [], 0
        for j in range(self._next, -1, -1):
            if j in self._unpacked or self._host(j) is None:
                continue
            nbytes = self._order[j][2]
            if want and size + nbytes > window:
                break
            want.append(j)
            size += nbytes
        return want

    def _prefetch(self) -> None:
        """Bring back, ahead of the backward, the latest-packed tensors not unpacked yet (module
        docstring): as many as fit in the bytes of the largest tensor sent down (``Copies.largest``;
        one at least), so a node that saved several (attention's q, k, v and output) finds all of them
        there. A prefetch the backward passed by is dropped. Under a pipeline schedule, whose
        micro-batches' forwards pack between another's backward (1F1B), the latest packed may be
        the next micro-batch's: then at most this window waits on the device until that backward,
        and this one's tensors come back unprefetched (tensors before the one just unpacked would
        not do better: a node unpacks its several saved tensors lowest first, and would drop the
        rest of its own tensors prefetched for it)."""
        want = self.coming(self.copies.largest)
        for k in [k for k in self._ahead if k not in want]:
            del self._ahead[k]
        for j in want:
            host = self._host(j)
            if j not in self._ahead and host is not None:
                self._ahead[j] = self.copies.up(self.from_host(j, host), self._order[j][1])


__all__ = ["ActivationOffload", "cast_of_resident", "recast", "ACTIVATION_MIN_BYTES"]
