"""Offload's host <-> device copies beside the compute (``runtime/offload.py``).

On CUDA the copies run on a side stream of their own, so the copy engines move bytes while the SMs
compute (ZeRO-Offload's and ZeRO-Infinity's overlap):

- ``down(t)``: the side stream waits for what the compute stream has queued (``t`` is written by
  then), copies ``t`` into pinned host memory, and ``t.record_stream`` keeps its device block from
  being reused before that copy ran, however early the caller drops ``t``;
- ``up(host, stride)``: a device tensor allocated and filled on the side stream, handed out by
  ``Upload.get()``, which makes the compute stream wait for the copy (an event: the host thread
  does not block) and records the tensor's use there.

The host copy is always contiguous, whatever ``t``'s layout: torch copies a non-contiguous tensor
between devices through a contiguous temporary made like the destination, and for a strided
pinned destination that temporary is pageable memory (a synchronous copy, then a host-side copy).
Measured on an H200: attention's q, k, v (67 MB each, views of the fused projection, heads
transposed) went down that way in 33-41 ms each (about 2 GB/s), 0.4-0.5 s of a 0.8-0.9 s step. A contiguous destination makes
the device gather ``t`` first (one kernel) and the copy a pinned DMA at ~55 GB/s. ``up`` gives the
tensor back with ``stride`` (``dense_stride(t)``: ``t``'s own when it is dense, else the dense
layout in its dimension order, as ``torch.empty_like`` makes).

Copies down and up share the one side stream, so an upload of what was copied down is ordered after
that copy. The copies down are throttled: a forward makes activations far faster than PCIe takes
them (a 4-layer hidden-4096 GPT on an H200: 7.4 GB a step, whose whole compute took 80 ms,
against 55 GB/s of pinned copies), and a
tensor's device block is only reusable once its copy ran, so unthrottled the device could hold
much of what the offload was meant to move. Once more than ``2 x`` the largest tensor sent so far
is in flight, the host thread waits for the oldest copy: the device holds about two tensors in
flight (measured on that GPT: the step's peak 706 MiB above the memory at rest, 546 with the copies
on the compute stream, 3,812 without offload), and the forward
runs at the copy rate with its compute hidden under the copies, which is what the planner's
``max(0, copy - window)`` prices. Gradients going down are throttled only where the offload then
frees them (``grads``): kept on the device anyway, waiting would only delay the next bucket. ``synchronize`` waits for every copy issued (before the host
reads what came down). ``AUTOPAR_OFFLOAD_STREAM=0`` puts them back on the compute stream (what ran before; the A/B of
``benchmarks/offload_overlap.py``). On a CPU "device" both memories are the same and every copy is
synchronous: there is nothing to overlap.
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import torch

STREAM_ENV = "AUTOPAR_OFFLOAD_STREAM"


def side_stream_enabled(device: torch.device) -> bool:
    """Whether offload's copies on ``device`` run on a side stream: on CUDA, unless
    ``AUTOPAR_OFFLOAD_STREAM=0``."""
    flag = os.environ.get(STREAM_ENV, "1").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"{STREAM_ENV}={flag!r}: use 1 (side stream, the default on CUDA) or 0 (compute stream)")
    return device.type == "cuda" and flag == "1"


def pinned_empty(shape, dtype, device: torch.device) -> torch.Tensor:
    """An empty contiguous host tensor, pinned when ``device`` is a GPU (asynchronous copies)."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.device(device).type == "cuda")


@dataclass
class Upload:
    """A device copy of a host tensor, maybe still in flight on the side stream."""
    tensor: torch.Tensor
    event: Any = None              # torch.cuda.Event recorded after the copy (None: already there)

    def get(self) -> torch.Tensor:
        """The tensor, the compute stream ordered after its copy."""
        if self.event is not None:
            current = torch.cuda.current_stream(self.tensor.device)
            current.wait_event(self.event)
            self.tensor.record_stream(current)
            self.event = None
        return self.tensor


class Copies:
    """One rank's offload copies (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream: Optional[torch.cuda.Stream] = (
            torch.cuda.Stream(self.device) if side_stream_enabled(self.device) else None)
        self._in_flight: deque = deque()     # (event after a copy down, its bytes), oldest first
        self.largest = 0                     # bytes of the largest tensor sent down (the throttle's unit)

    @property
    def overlapped(self) -> bool:
        return self.stream is not None

    def down(self, t: torch.Tensor, out: Optional[torch.Tensor] = None, throttle: bool = True) -> torch.Tensor:
        """``t`` copied into contiguous host memory (``out`` or a new tensor); on the side stream,
        asynchronous, throttled (module docstring) unless ``throttle`` is False: a caller that keeps
        ``t`` on the device anyway gains no memory by waiting."""
        host = pinned_empty(t.shape, t.dtype, self.device) if out is None else out
        src = t.detach().reshape(host.shape)
        self.largest = max(self.largest, host.nbytes)
        if self.stream is None:
            host.copy_(src, non_blocking=host.is_pinned())
            return host
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        src.record_stream(self.stream)       # t's block (src is t or a view of it, or a copy)
        if throttle:
            self._throttle(done, host.nbytes)
        return host

    def _throttle(self, done, nbytes: int) -> None:
        """Wait for the oldest copies down while more than twice the largest is in flight."""
        self.largest = max(self.largest, nbytes)
        while self._in_flight and self._in_flight[0][0].query():      # already copied
            self._in_flight.popleft()
        self._in_flight.append((done, nbytes))
        pending = sum(b for _, b in self._in_flight)
        while len(self._in_flight) > 1 and pending > 2 * self.largest:
            event, b = self._in_flight.popleft()
            event.synchronize()
            pending -= b

    def up(self, host: torch.Tensor, stride: Optional[tuple] = None) -> Upload:
        """``host`` copied to the device, laid out with ``stride`` (default contiguous): started now
        (on the side stream), taken by ``get()``."""
        stride = host.stride() if stride is None else stride
        if self.stream is None:
            local = torch.empty_strided(host.shape, stride, dtype=host.dtype, device=self.device)
            local.copy_(host, non_blocking=host.is_pinned())
            return Upload(local)
        with torch.cuda.stream(self.stream):
            local = torch.empty_strided(host.shape, stride, dtype=host.dtype, device=self.device)
            local.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return Upload(local, event)

    @staticmethod
    def dense_stride(t: torch.Tensor) -> tuple:
        """The strides ``torch.empty_like(t)`` gives (``t``'s own when it is dense; computed on the
        meta device, nothing allocated)."""
        return torch.empty_like(t, device="meta").stride()

    def synchronize(self) -> None:
        """Wait for every copy issued, on either stream (the host is about to read what came down)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            if self.stream is not None:
                self.stream.synchronize()
        self._in_flight.clear()


__all__ = ["Copies", "Upload", "pinned_empty", "side_stream_enabled", "STREAM_ENV"]
