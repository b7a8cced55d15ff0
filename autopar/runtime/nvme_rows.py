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

The reads are started a group ahead (``ahead``, ZeRO-Infinity's prefetch from NVMe): while a
group's gather runs and its layer computes, the store's threads read the rows of the group the
next gather needs (``runtime/prefetch.GroupGathers``: the group after the one being prefetched,
in the forward; ``runtime/reshard.py``: the next re-gather's, in the backward), and ``rows`` waits
for that read instead of making it. A pass's first group is read on the spot; so is a parameter
gathered alone (a tied weight) and a read outside the passes (checkpoints). The optimizer step
rewrites the masters, so reads started ahead and not used are dropped at each step's start and end
(``drop_ahead``, with the gathers not read). ``materialized()`` puts the rows back in host memory
for a block that writes them (loading a checkpoint; ``HostOptimizer.resident``) and drops them
after.
"""
from __future__ import annotations

import contextlib
import time

import torch

from autopar.runtime.copy_stream import pinned_empty


def drop_rows(local: torch.Tensor) -> None:
    """``local``'s storage freed, its shape and dtype kept (what reducers and checks read)."""
    empty = torch.empty(local.shape, dtype=local.dtype)
    empty.untyped_storage().resize_(0)
    local.data = empty


class RowsToFiles:
    """The rows in the files from the start: ``ParamStore.build`` hands each parameter here as it
    makes its rows (``sink``), which go to its master's file at once (fp32, as the master is made
    of them) and leave host memory, at most ``window`` bytes of writes in flight; so a rank's rows
    are never all in host memory, which the plan does not count them in. ``HostOptimizer`` then
    takes this tier's store (``store``) and finds the masters of ``written`` in their files."""

    def __init__(self, nvme_dir: str, rank: int, window: int) -> None:
        from autopar.runtime.nvme import BoundedWrites, NvmeStore

        self.store = NvmeStore(nvme_dir, rank=rank)
        self._writes = BoundedWrites(self.store, window)
        self.written: set[str] = set()

    def __call__(self, slot) -> None:
        self._writes.write(f"{slot.name}/master", slot.local.detach().to(torch.float32).contiguous())
        drop_rows(slot.local)
        self.written.add(slot.name)


class NvmeRows:
    """The rows of ``slots`` read from ``store``'s files (``runtime/nvme.NvmeStore``); module docstring."""

    def __init__(self, store, slots, device: torch.device) -> None:
        self.store, self.slots, self.device = store, list(slots), device
        self._shapes = {s.name: (tuple(s.local.shape), s.local.dtype) for s in self.slots}
        self._resident = True
        self._ahead: dict[str, tuple] = {}  # name -> (buffer, future): reads started ahead of their gather
        self.ahead_enabled = True          # False: every read on the spot (benchmarks/nvme_read_ahead.py)
        # over the run: rows read from the files, their bytes, the reads started ahead (waited for
        # when needed), and the seconds the rank's thread waited for reads
        self.reads = self.read_bytes = self.read_ahead = 0
        self.wait_s = 0.0

    def release(self) -> None:
        """Drop the stored rows from host memory (the files hold them)."""
        for s in self.slots:
            drop_rows(s.local)
        self._resident = False

    def ahead(self, slots) -> list[torch.Tensor]:
        """Start reading ``slots``' rows (those not resident and not started yet) on the store's
        threads, for a gather to come; the buffers being read into."""
        if self._resident or not self.ahead_enabled:
            return []
        out = []
        for s in slots:
            if s.name not in self._ahead:
                buf = pinned_empty(self._shapes[s.name][0], torch.float32, self.device)
                self._ahead[s.name] = (buf, self.store.read(f"{s.name}/master", buf))
                out.append(buf)
        return out

    def drop_ahead(self) -> None:
        """Forget the reads started ahead and not used (after they finished: the rows change at
        the step)."""
        ahead, self._ahead = self._ahead, {}
        for name, (_, fut) in ahead.items():
            self.store.finish(f"{name}/master", fut)

    def rows(self, slot) -> torch.Tensor:
        """``slot``'s stored rows: read from its master's file (cast to the parameter's dtype), or
        the parameter itself inside ``materialized``; a read started ahead is waited for."""
        if self._resident:
            return slot.local.detach()
        shape, dtype = self._shapes[slot.name]
        key = f"{slot.name}/master"
        started = self._ahead.pop(slot.name, None)
        t0 = time.perf_counter()
        if started is not None:
            buf = started[0]
            self.store.finish(key, started[1])
            self.read_ahead += 1
        else:
            buf = self.store.read_now(key, pinned_empty(shape, torch.float32, self.device))
        self.wait_s += time.perf_counter() - t0
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
        self.drop_ahead()                  # the block writes the rows
        for s in self.slots:
            shape, dtype = self._shapes[s.name]
            src = masters[s.name] if masters is not None else self.rows(s)
            s.local.data = src.detach().to(dtype, copy=True).view(shape)
        self._resident = True
        try:
            yield
        finally:
            self.release()


__all__ = ["NvmeRows", "RowsToFiles", "drop_rows"]
