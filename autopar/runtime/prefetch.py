"""ZeRO-3's gathers by group, the next group prefetched (``codegen/gather_groups.py``): in the
forward here, in the backward's re-gathers by ``runtime/reshard.py`` (``start`` / ``land`` / ``drop``).

``GroupGathers.take(slot)`` is what ``ParamStore.use`` asks first for a parameter of a group: the
gathered tensor (this rank's tp-local part, whole over dp). On the first read of a group it
all-gathers every parameter of the group in ONE collective (their dp row chunks, each padded as
``params.gather_rows`` pads it, concatenated), copies each out into a tensor of its own (so
``runtime/reshard.py`` still finds a saved weight by its storage), and starts gathering the next
group of this rank asynchronously; the next read of that group waits for it. Each tensor is handed
out once; the group's collective is the only one its parameters cost in that forward.

One data-parallel rank with its rows in host memory (ZeRO-3 with parameter offload on one GPU,
ZeRO-Infinity's case): nothing to gather, a group's rows are copied up instead, on offload's side
stream on CUDA (``copy_stream.Copies.up``; the compute stream waits for them only at the read), so
the next group's copy runs beside this group's compute, in the forward and, through
``runtime/reshard.py``, in the backward. On CPU ranks the copies are synchronous.

Collective order: every dp rank runs the same program, so each issues the same gathers, prefetches
included, at the same points; gloo and NCCL match concurrent collectives of a group by issue order.

With the rows on NVMe (``nvme_params``), each rank reads them from the files a group ahead of its
gather (``read_ahead``: the group after the one being prefetched), so the reads run beside the
compute too.

Lifetime: a gathered tensor lives from its group's gather to its one read (then the scope holds it,
as before); a prefetched group until its first read. ``invalidate`` (the step's start and end: the
optimizer changes the rows) waits for a gather in flight and drops what was not read, so a forward
never sees rows of an earlier step. A collective's send and output buffers are freed as soon as it
is waited for and copied out (``collectives.release``), not when the backend drops its Work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from autopar.mesh import DATA
from autopar.runtime.collectives import collective_range, release, wait_for
from autopar.runtime.copy_stream import Copies
from autopar.runtime.params import chunk_numel, on_device, padded_rows, stored_rows, unpadded


@dataclass
class _Flight:
    """One group's all-gather (or, one data-parallel rank with host rows, its uploads), issued."""
    slots: tuple                  # params.ParamSlot, in the order of the send buffer
    out: Optional[torch.Tensor]   # dp x (sum of the padded chunk sizes)
    work: Any                     # the async work handle (None: already complete)
    send: Optional[torch.Tensor] = None     # freed at the landing (``collectives.release``)
    uploads: Optional[dict] = None          # name -> copy_stream.Upload (no collective)


class GroupGathers:
    def __init__(self, slots, ctx) -> None:
        self.ctx = ctx
        # one data-parallel rank with its rows in host memory (ZeRO-Infinity on one GPU): a group is
        # copied up, not gathered, on offload's side stream on CUDA (``copy_stream.Copies``), so the
        # next group's copy runs beside this one's compute
        self._copies = Copies(ctx.device) if ctx.dp == 1 else None
        self.started_ahead = 0            # over the run: groups fetched ahead of their first read
        groups: dict[int, list] = {}
        for s in slots:
            if s.plan.group >= 0:
                groups.setdefault(s.plan.group, []).append(s)
        self.groups = {g: tuple(groups[g]) for g in sorted(groups)}
        order = list(self.groups)
        self.next = dict(zip(order, order[1:]))
        self._ready: dict[str, torch.Tensor] = {}
        self._flights: dict[int, _Flight] = {}

    def take(self, slot, prefetch: bool = True) -> Optional[torch.Tensor]:
        """``slot``'s gathered tensor, or None when it is not gathered by group (the caller gathers
        it alone). ``prefetch``: start gathering the next group (in the forward; a recompute
        region's replay in the backward reads its group alone)."""
        g = slot.plan.group
        if g not in self.groups:
            return None
        if slot.name not in self._ready:
            nxt = self.next.get(g) if prefetch else None
            if g not in self._flights:
                if any(s.name in self._ready for s in self.groups[g]):
                    return None                      # read again while its group is half read
                if nxt is not None:                  # its rows read while this group's are (NVMe)
                    self.read_ahead(self.groups[nxt])
                self._flights[g] = self._issue(self.groups[g], async_op=False)
            self._ready.update(self._land(self._flights.pop(g)))
            if nxt is not None and nxt not in self._flights and \
                    not any(s.name in self._ready for s in self.groups[nxt]):
                self._flights[nxt] = self._issue(self.groups[nxt], async_op=True)
                self.started_ahead += 1
                if self.next.get(nxt) is not None:   # the gather after: its rows read during this layer
                    self.read_ahead(self.groups[self.next[nxt]])
        return self._ready.pop(slot.name, None)

    def read_ahead(self, slots) -> None:
        """With the rows on NVMe (``runtime/nvme_rows.py``), start reading ``slots``' rows for a
        gather to come: those an overlapped host step has written already (``runtime/host_step.py``;
        the others are read on the spot, after their gather waited for their chunk)."""
        ctx = self.ctx
        if ctx.nvme_rows is not None:
            ctx.nvme_rows.ahead([s for s in slots if ctx.host_step is None or ctx.host_step.stepped(s.name)])

    def invalidate(self) -> None:
        """Drop every gathered tensor not read yet (after waiting for the gathers in flight), and
        the rows read ahead for gathers not issued."""
        for f in self._flights.values():
            self.drop(f)
        self._flights.clear()
        self._ready.clear()
        if self.ctx.nvme_rows is not None:
            self.ctx.nvme_rows.drop_ahead()

    def gather_now(self, slots) -> dict[str, torch.Tensor]:
        """``slots`` gathered in one collective, now: name -> gathered tensor (the backward's
        re-gather of a group's saved weights, ``runtime/reshard.py``)."""
        return self._land(self._issue(tuple(slots), async_op=False))

    def start(self, slots) -> _Flight:
        """``slots``' gather in one collective, started (the backward's prefetch of the next
        group's saved weights, ``runtime/reshard.py``): ``land`` it, or ``drop`` it unread."""
        return self._issue(tuple(slots), async_op=True)

    def land(self, flight: _Flight) -> dict[str, torch.Tensor]:
        """What ``start`` gathers, once it arrived: name -> gathered tensor."""
        return self._land(flight)

    @staticmethod
    def drop(flight: _Flight) -> None:
        """A started gather no one reads: waited for (every rank issued it; an upload, before the
        optimizer writes the host rows it reads), its buffers freed."""
        if flight.work is not None:
            wait_for(flight.work, "all_gather", DATA, flight.out.numel() * flight.out.element_size())
        for up in (flight.uploads or {}).values():
            if up.event is not None:
                up.event.synchronize()
        release(flight.send, flight.out)

    def _issue(self, slots: tuple, async_op: bool) -> _Flight:
        ctx = self.ctx
        if ctx.host_step is not None:       # the rows read below, stepped on the host (``runtime/host_step.py``)
            for s in slots:
                ctx.host_step.ready(s.name)
        if self._copies is not None:
            return _Flight(slots, None, None, uploads={s.name: self._copies.up(stored_rows(s, ctx)) for s in slots})
        send = torch.cat([padded_rows(s, on_device(stored_rows(s, ctx), ctx), ctx.dp) for s in slots])
        out = torch.empty(ctx.dp * send.numel(), dtype=send.dtype, device=send.device)
        nbytes = out.numel() * out.element_size()
        with collective_range("all_gather", DATA, nbytes):
            work = dist.all_gather_single(out, send, group=ctx.dp_group, async_op=async_op)
        ctx.log.add("all_gather", DATA, nbytes, "zero")
        return _Flight(slots, out, work if async_op else None, send)

    def _land(self, f: _Flight) -> dict[str, torch.Tensor]:
        if f.uploads is not None:
            return {s.name: f.uploads[s.name].get().view(s.layout.local_shape) for s in f.slots}
        if f.work is not None:
            wait_for(f.work, "all_gather", DATA, f.out.numel() * f.out.element_size())
        rows = f.out.view(self.ctx.dp, -1)
        out, off = {}, 0
        for s in f.slots:
            size = chunk_numel(s, self.ctx.dp)
            out[s.name] = unpadded(s, rows[:, off:off + size].clone(memory_format=torch.contiguous_format).view(-1))   # its own storage
            off += size
        release(f.send, f.out)
        return out
