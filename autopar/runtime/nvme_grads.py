"""The gradients' NVMe tier (offload class ``nvme_grads``): a rank's reduced gradients wait for the
optimizer step in files, not in host memory.

With optimizer offload every gradient the reducer finishes is copied to the host
(``runtime/offload.HostOptimizer.take``), where it waited in a buffer of its own until the step:
4 bytes per optimizer row, the largest host allocation after the state itself once that state is on
NVMe. Here each one is written to ``<name>/grad`` as it arrives (``put``; ``NvmeStore.write`` copies
its bytes at once, so the host copy is dropped right away) and at most ``window`` bytes of writes
are in flight (the oldest waited for beyond that). The step, chunk by chunk as it streams the
masters and state, reads each chunk's gradients back beside them (``HostOptimizer._read``).

``held`` names the gradients of the last backward in the files (what ``ParamStore.full_dict("grad")``
reads back with ``read_now``); the next step's ``ParamStore.zero_grad`` forgets them.
"""
from __future__ import annotations

import torch

from autopar.runtime.copy_stream import pinned_empty
from autopar.runtime.nvme import BoundedWrites


class NvmeGrads:
    """Gradients in ``store``'s files (``runtime/nvme.NvmeStore``); module docstring."""

    def __init__(self, store, device: torch.device, window: int) -> None:
        self.store, self.device = store, device
        self.held: dict[str, tuple] = {}           # name -> (shape, dtype) of this step's gradient in its file
        self._writes = BoundedWrites(store, window)

    @property
    def written(self) -> int:
        """Over the run: gradient bytes written."""
        return self._writes.written

    @staticmethod
    def key(name: str) -> str:
        return f"{name}/grad"

    def put(self, name: str, grad: torch.Tensor) -> None:
        """Write ``grad`` (a CPU contiguous tensor, complete) as ``name``'s gradient of this step."""
        self._writes.write(self.key(name), grad)
        self.held[name] = (tuple(grad.shape), grad.dtype)

    def read(self, name: str, held: tuple):
        """Start reading ``name``'s gradient back: (its buffer, the read's future). ``held``: its
        (shape, dtype) as ``held`` had it when the step began (the next one may have begun since)."""
        shape, dtype = held
        out = pinned_empty(shape, dtype, self.device)
        return out, self.store.read(self.key(name), out)

    def read_now(self, name: str) -> torch.Tensor:
        shape, dtype = self.held[name]
        return self.store.read_now(self.key(name), pinned_empty(shape, dtype, self.device))

    def forget(self) -> None:
        """A new step: the files' gradients are the last step's."""
        self.held.clear()
        self._writes.forget()


__all__ = ["NvmeGrads"]
