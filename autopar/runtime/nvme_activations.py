"""The saved activations' NVMe tier (offload class ``nvme_activations``, with ``activations``): each
tensor activation offload sends to the host (``runtime/offload.ActivationOffload``) waits for the
backward in a file instead of host memory.

``to_host`` copies the saved tensor down as activation offload does, writes the copy to
``act/<index>`` (its place in this step's packing order) and waits for the write (``window`` 0 of
``nvme.BoundedWrites``: the host then holds one saved tensor at a time, plus the store's aligned
staging copy of it while it is written, which the memory measurement, counting torch storages,
does not see), and hands ``_pack`` a meta tensor of its shape and dtype, which costs no memory. The backward's ``from_host`` reads the file back into host memory before the copy up, as the
prefetch does for tensors it brings back ahead. A tensor saved by several nodes is written once
(``ActivationOffload``'s per-step copies). Keys are reused from one step to the next: a write of a
key waits for the reads before it (``NvmeStore``). The store's directory goes at ``close`` and at
exit, as the optimizer's does.
"""
from __future__ import annotations

import torch

from autopar.runtime.copy_stream import pinned_empty
from autopar.runtime.nvme import BoundedWrites, NvmeStore
from autopar.runtime.offload import ActivationOffload


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
        self.read_bytes = 0                      # over the run: bytes read back

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
        buf = pinned_empty(host.shape, host.dtype, self.device)
        self.read_bytes += buf.numel() * buf.element_size()
        return self.nvme.read_now(self.key(index), buf)

    def close(self) -> None:
        self.nvme.close()


__all__ = ["NvmeActivations"]
