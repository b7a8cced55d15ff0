"""ZeRO-Infinity's parameter tier (offload class ``nvme_params``): a rank's ZeRO-3 parameter rows
live only in the NVMe tier's files, none in host memory.

The runtime's parameters are the optimizer's masters (``runtime/precision.py``: a 16-bit plan runs
under autocast over fp32 parameters), and under ZeRO-3 the rows a rank stores are the rows its
optimizer updates (``ParamSlot.opt_param is ParamSlot.local``). With ``nvme`` the masters already
live in files (``runtime/offload.HostOptimizer``, key ``<name>/master``), so the rows need no file
of their own: ``NvmeRows`` drops the stored rows from host memory (``ParamSlot.local`` keeps its
autograd identity and its shape over a storage of 0 bytes, as FSDP2 frees a gathered parameter;
nothing may read its data then) and
``rows(slot)`` reads them back from the master's file whenever a gather needs them
(``params.stored_rows``: ZeRO-3's gathers in the forward, the backward's re-gathers, a full tensor
for a checkpoint or a comparison). The optimizer step then writes the updated masters to the files
and copies nothing up: the files are the rows.

The reads run on the rank's thread, before the gather that needs them (not overlapped: the cost
model charges them in full, ``cost/offload.py``); the gather itself is prefetched as without
offload. ``materialized()`` puts the rows back in host memory for a block that writes them (loading
a checkpoint; ``HostOptimizer.resident``) and drops them after.
"""
from __future__ import annotations

import contextlib

import torch

from autopar.runtime.copy_stream import pinned_empty


class NvmeRows:
    """The rows of ``slots`` read from ``store``'s files (``runtime/nvme.NvmeStore``); module docstring."""

    def __init__(self, store, slots, device: torch.device) -> None:
        self.store, self.slots, self.device = store, list(slots), device
        self._shapes = {s.name: (tuple(s.local.shape), s.local.dtype) for s in self.slots}
        self._resident = True
        self.reads = 0                     # over the run: rows read from the files, and their bytes
        self.read_bytes = 0

    def release(self) -> None:
        """Drop the stored rows from host memory (the files hold them)."""
        for s in self.slots:
            shape, dtype = self._shapes[s.name]
            empty = torch.empty(shape, dtype=dtype)
            empty.untyped_storage().resize_(0)       # the shape stays (what reducers and checks read)
            s.local.data = empty
        self._resident = False

    def rows(self, slot) -> torch.Tensor:
        """``slot``'s stored rows: read from its master's file (cast to the parameter's dtype), or
        the parameter itself inside ``materialized``."""
        if self._resident:
            return slot.local.detach()
        shape, dtype = self._shapes[slot.name]
        buf = pinned_empty(shape, torch.float32, self.device)
        self.store.read_now(f"{slot.name}/master", buf)
        self.reads += 1
        self.read_bytes += buf.numel() * buf.element_size()
        return buf if dtype == torch.float32 else buf.to(dtype)

    @contextlib.contextmanager
    def materialized(self, masters=None):
        """The stored rows in host memory inside (``masters``: name -> the host master, when it is in
        host memory already, else read from the file); dropped again after."""
        if self._resident:
            yield
            return
        for s in self.slots:
            shape, dtype = self._shapes[s.name]
            src = masters[s.name] if masters is not None else self.rows(s)
            s.local.data = src.detach().to(dtype, copy=True).view(shape)
        self._resident = True
        try:
            yield
        finally:
            self.release()


__all__ = ["NvmeRows"]
