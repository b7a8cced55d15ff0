"""The saved activations' NVMe tier (offload class ``nvme_activations``, with ``activations``): each
tensor activation offload sends to the host (``runtime/activation_offload.ActivationOffload``) waits for the
backward in a file instead of host memory.

``to_host`` copies the saved tensor down as activation offload does, writes the copy to
``act/<index>`` (its place in this step's packing order) and waits for the write (``window`` 0 of
``nvme.BoundedWrites``: the host then holds one saved tensor at a time, plus the store's aligned
staging copy of it while it is written, which the memory measurement, counting torch storages,
does not see), and hands ``_pack`` a meta tensor of its shape and dtype, which costs no memory. The
backward's ``from_host`` reads the file back into host memory before the copy up, as the prefetch
does for tensors it brings back ahead. The reads run ahead of the backward on the store's threads:
each unpack starts reading the latest-packed tensors not unpacked nor read yet (the next the
backward needs, as ``ActivationOffload._prefetch`` picks them), up to the bytes of the largest
tensor sent down (one at least), so the host holds at most the tensor being brought back and
that window. A read started for a tensor the backward passed by is dropped. A tensor saved by
several nodes is written once (``ActivationOffload``'s per-step copies). Keys are reused from one
step to the next: a write of a key waits for the reads before it (``NvmeStore``). The store's
directory goes at ``close`` and at exit, as the optimizer's does.
"""
from __future__ import annotations

import torch

from autopar.runtime.copy_stream import pinned_empty
from autopar.runtime.nvme import BoundedWrites, NvmeStore
from autopar.runtime.activation_offload import ActivationOffload


class NvmeActivations(ActivationOffload):
    """Activation offload through files under ``nvme_dir`` (module docstring)."""

    def __init__(self, device: torch.device, param_storages, nvme_dir, rank: int, inner=None,
                 window: int = 0) -> None:
        if not nvme_dir:
            raise ValueError("the plan offloads the saved activations to NVMe (nvme_activations): give a directory "
                             "on a fast local disk (autoparallelize(..., nvme_dir=DIR) or `autopar run --nvme-dir DIR`)")
        super().__init__(device, param_storages, inner=inner)
        self.nvme = NvmeStore(nvme_dir, rank=rank)
        self.writes = BoundedWrites(self.nvme, window)   # memory_measure spies it
        self._reads: dict[int, tuple] = {}       # index -> (buffer, future): reads started ahead
        self.read_bytes = 0                      # over the run: bytes read back; reads started ahead
        self.read_ahead = 0

    @staticmethod
    def key(index: int) -> str:
        return f"act/{index}"

    @property
    def written_bytes(self) -> int:
        return self.writes.written

    def to_host(self, local: torch.Tensor) -> torch.Tensor:
        host = self.copies.down(local)
        self.copies.synchronize()                # its bytes are there before the write copies them
        self.writes.write(self.key(len(self._order)), host)     # ``_pack`` appends it at this index
        return torch.empty(host.shape, dtype=host.dtype, device="meta")

    def from_host(self, index: int, host: torch.Tensor) -> torch.Tensor:
        started = self._reads.pop(index, None)
        if started is not None:
            buf = started[0]
            self.nvme.finish(self.key(index), started[1])
            self.read_ahead += 1
        else:
            buf = self.nvme.read_now(self.key(index), pinned_empty(host.shape, host.dtype, self.device))
        self.read_bytes += buf.numel() * buf.element_size()
        return buf

    def _unpack(self, saved):
        out = super()._unpack(saved)
        self.read_next()
        return out

    def read_next(self) -> list[torch.Tensor]:
        """Start reading the tensors the backward needs next (module docstring); the buffers."""
        want = set(self.coming(self.copies.largest))
        for j in [j for j in self._reads if j not in want]:       # passed by: dropped
            self.nvme.finish(self.key(j), self._reads.pop(j)[1])
        out = []
        for j in want - set(self._reads) - set(self._ahead):
            host = self._host(j)
            if host is None:
                continue
            buf = pinned_empty(host.shape, host.dtype, self.device)
            self._reads[j] = (buf, self.nvme.read(self.key(j), buf))
            out.append(buf)
        return out

    def _clear(self) -> None:
        for j, (_, fut) in self._reads.items():
            self.nvme.finish(self.key(j), fut)
        self._reads.clear()
        super()._clear()

    def close(self) -> None:
        self.nvme.close()


__all__ = ["NvmeActivations"]
