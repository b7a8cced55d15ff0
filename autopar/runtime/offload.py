"""Offload on the ranks: what a plan's ``offload`` classes (``autopar.plan.OFFLOAD_CLASSES``) move
off the device, and when it comes back. The plan's cost of each is ``autopar/cost/offload.py``.

optimizer (ZeRO-Offload, Ren et al. 2021)  ``HostOptimizer``
    Each optimizer parameter (the rows this rank updates: ``ParamSlot.opt_param``) gets an fp32
    master copy in host memory (pinned on CUDA), ``ParamSlot.host``, and a host gradient buffer
    (with params offload and no nvme the master IS the stored fp32 rows, already on the host);
    the user's optimizer is built on the masters, so its state lives on the host and its step runs
    on the CPU. After the reduction each bucket's gradients are copied down as the bucket finishes
    (``GradReducer.on_reduced``: during the backward, the reducer's overlap), the optimizer steps on
    the host, and the updated rows are copied back up into the device parameter (ZeRO 1/2 then
    all-gather them as without offload). ``host_step="overlap"`` (on GPUs by default where nothing
    communicates beside it): the step and the copies up run chunk by chunk on a thread beside the
    next step's forward (``runtime/host_step.py``).
grads (with optimizer)
    The device gradients are dropped as soon as they are on the host: bucket by bucket with dp > 1,
    at each parameter's post-accumulate-grad hook with dp == 1 (last micro-batch of the step only:
    earlier ones accumulate on the device).
activations  ``runtime/activation_offload.ActivationOffload``
    Every tensor autograd saves goes to host memory in the forward and back in the backward (that
    module's docstring).
nvme (with optimizer)
    The masters and the optimizer state live in files (``runtime/nvme.py``) between steps; the step
    runs chunk by chunk (chunks of about ``chunk_bytes`` of state; overlapped, of the overlap's
    chunk size if smaller): chunk k + 1 is read while chunk k steps, chunk k is written while k + 1
    steps. A chunk steps alone because torch optimizers skip parameters whose ``.grad`` is None.
    Overlapped with the next forward as without the tier, the chunks on the step's thread.
nvme_grads (with nvme)  ``runtime/nvme_grads.NvmeGrads``
    Each gradient taken down goes to a file at once instead of a host buffer; the step reads each
    chunk's gradients back with its masters and state.
nvme_activations (with activations)  ``runtime/nvme_activations.NvmeActivations``
    Each saved tensor's host copy goes to a file at once; the backward reads it back to bring it up.
nvme_params (with params and nvme)  ``runtime/nvme_rows.NvmeRows``
    ZeRO-3's parameter rows are not kept in host memory: each gather reads them from the masters'
    files, and the step's updated masters, written there, are not copied up.

Gradients go down on that side stream too (during the backward, as the reducer finishes buckets);
the updated rows go up on the compute stream after the host step, and with dp > 1 ZeRO-3's
offloaded rows at each gather (``params.on_device``): those are not overlapped. With one
data-parallel rank the rows go up a group ahead on the side stream (``runtime/prefetch.py``). On a CPU-only machine "device"
and "host" are the same memory, so every transfer is an explicit synchronous copy into a tensor
the offload owns (``host_tensors``): what ``runtime/memory_measure.py`` counts as host memory,
apart from the device peak.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

from autopar.plan import parse_offload
from autopar.runtime.activation_offload import ActivationOffload
from autopar.runtime.copy_stream import Copies, pinned_empty
from autopar.runtime.host_step import (NVME_CHUNK_BYTES, OverlappedStep, as_now, offload_overlap_refusal,
                                       overlap_chunk_bytes, step_chunks)
from autopar.runtime.nvme_grads import NvmeGrads
from autopar.runtime.nvme_rows import NvmeRows, drop_rows



class HostOptimizer:
    """The optimizer on the host (module docstring). ``optimizer`` is the user's, on the masters."""

    def __init__(self, store, factory: Callable, classes: tuple, device: torch.device, *,
                 nvme_dir: Optional[str] = None, rank: int = 0, chunk_bytes: int = NVME_CHUNK_BYTES,
                 host_step: str = "auto", rows_in_files=None) -> None:
        self.store, self.device, self.classes = store, device, classes
        self.copies = Copies(device)
        self.frees_grads = "grads" in classes
        self._grad_bufs: dict[str, torch.Tensor] = {}
        self.nvme = None
        self._shapes: dict[str, tuple] = {}              # NVMe: key -> (shape, dtype) of its file
        self._evicted: set[str] = set()                  # NVMe: the slots whose master and state are in files
        if "nvme" in classes:
            if not nvme_dir:
                raise ValueError("the plan offloads the optimizer state to NVMe: give a directory on a fast "
                                 "local disk (autoparallelize(..., nvme_dir=DIR) or `autopar run --nvme-dir DIR`)")
            if "nvme_params" in classes and not store.ctx.host_params:
                raise ValueError("offload nvme_params keeps ZeRO-3's parameter rows on NVMe: the plan needs params "
                                 "offload and ZeRO-3 (--force zero=3,offload=optimizer+params+nvme+nvme_params)")
            from autopar.runtime.nvme import BoundedWrites, NvmeStore

            # each master to its file as it is made (nvme_params: the rows dropped, the file is the rows;
            # ``nvme_rows.RowsToFiles`` may have written it as the store made them); every write, here
            # and each step's (``_evict``), a chunk in flight at most, not the whole state
            self.nvme = rows_in_files.store if rows_in_files is not None else NvmeStore(nvme_dir, rank=rank)
            self._writes = BoundedWrites(self.nvme, chunk_bytes)
        # ZeRO-3's fp32 rows on the host (params offload) are the masters, stepped in place (not with nvme)
        shares_rows = store.ctx.host_params and "nvme" not in classes
        in_files = rows_in_files.written if rows_in_files is not None else set()
        for s in store.slots:
            if shares_rows and s.opt_param.dtype == torch.float32:
                master = s.opt_param.data
            elif s.name not in in_files:
                master = pinned_empty(s.opt_param.shape, torch.float32, device)
                master.copy_(s.opt_param.detach())
                if self.nvme is not None:
                    self._writes.write(f"{s.name}/master", master)
            if self.nvme is not None:
                self._shapes[f"{s.name}/master"] = (s.opt_param.shape, torch.float32)
                master = torch.empty(0)
                self._evicted.add(s.name)
                if "nvme_params" in classes:
                    drop_rows(s.local)
            s.host = nn.Parameter(master, requires_grad=True)
            if "nvme_grads" not in classes:              # else no gradient waits in host memory
                self._grad_bufs[s.name] = pinned_empty(s.opt_param.shape, torch.float32, device)
        self.optimizer = factory([s.host for s in store.slots])
        if hasattr(self.optimizer, "set_shard_groups") and device.type == "cuda":
            raise NotImplementedError(
                f"{type(self.optimizer).__name__} all-reduces per-tensor norms over the shard groups, which on "
                "GPUs are NCCL groups that cannot take the host tensors of an offloaded optimizer; use AdamW "
                "with optimizer offload, or drop offload (--force offload=none)")
        self._taken: set[str] = set()
        why = offload_overlap_refusal(classes, store.ctx.zero_stage, store.ctx.dp, self.optimizer)
        if host_step == "overlap" and why is not None:
            raise ValueError(f"host_step='overlap': the host step cannot overlap the next forward here: {why}; "
                             "use host_step='sync' or 'auto' (`autopar run --host-step sync`)")
        overlap = host_step == "overlap" or (host_step == "auto" and why is None and device.type == "cuda")
        # overlapped: the forward's first layers wait for a small first chunk
        chunks = step_chunks(store.slots, min(chunk_bytes, overlap_chunk_bytes(store.slots)) if overlap else chunk_bytes)
        self._chunks: list[list] = chunks if self.nvme is not None else []     # NVMe: the step's, in order
        self._chunk_at = {c[0].name: i for i, c in enumerate(self._chunks)}    # ... by their first parameter
        self._reading: list = []                         # NVMe: the reads of the next chunk to step, started
        self.grad_files = None                           # nvme_grads: runtime/nvme_grads.NvmeGrads
        self._chunk_grads: dict[str, torch.Tensor] = {}  # ... the stepping chunks' gradients, read back
        if "nvme_grads" in classes:
            self.grad_files = store.ctx.grad_files = NvmeGrads(self.nvme, device, window=chunk_bytes)
        self.rows = None                                 # nvme_params: the masters' files are the rows
        if "nvme_params" in classes:
            self.rows = store.ctx.nvme_rows = NvmeRows(self.nvme, store.slots, device)
            self.rows.release()
        self.overlapped = None                           # host_step "overlap": runtime/host_step.OverlappedStep
        if overlap:
            self.overlapped = OverlappedStep(chunks)
            store.ctx.host_step = self.overlapped

    # ---- gradients down ------------------------------------------------------------------------
    def attach(self, reducer) -> None:
        """Take each bucket's gradients as the reducer finishes it; with ``grads`` offloaded and
        dp == 1, each parameter's at its post-accumulate-grad hook (last micro-batch)."""
        reducer.on_reduced = self.take
        reducer.on_reduced_frees = self.frees_grads
        self._reducer = reducer
        if self.frees_grads and reducer.dp == 1 and reducer.stage < 3:
            for s in self.store.slots:
                s.local.register_post_accumulate_grad_hook(lambda _p, s=s: self._on_grad(s))

    def _on_grad(self, slot) -> None:
        if self._reducer.armed:
            slot.opt_param.grad = slot.local.grad.view(slot.opt_param.shape)
            self.take([slot])

    def take(self, slots) -> None:
        """Copy ``slots``' reduced gradients into their host buffers (once per step)."""
        self.wait()                              # an overlapped step still on the buffers: done by now
        for s in slots:
            if s.name in self._taken:
                continue
            g = s.reduced if s.reduced is not None else s.opt_param.grad
            if g is None and s.opt_param is s.local:
                g = s.local.grad
            if g is None:                        # no gradient this step: the optimizer skips it
                continue
            buf = self.copies.down(g, out=self._grad_bufs.get(s.name), throttle=self.frees_grads)
            if self.grad_files is not None:      # to its file now (complete first), not kept
                self.copies.synchronize()
                self.grad_files.put(s.name, buf)
            else:
                s.host_grad = buf
            if self.nvme is None and self.overlapped is None:   # else set per chunk (once the master is read back)
                s.host.grad = buf
            self._taken.add(s.name)
            s.reduced = None
            if self.frees_grads:
                s.opt_param.grad = None
                s.local.grad = None
                s.full_grad = None

    def take_rest(self) -> None:
        """After the reduction: every gradient not taken yet (dp == 1 has no buckets)."""
        self.take(self.store.slots)
        self.copies.synchronize()

    # ---- step ----------------------------------------------------------------------------------
    def step(self, run: Callable[[], None]) -> None:
        """Run the optimizer step ``run`` on the host (chunk by chunk with NVMe) and copy the
        updated rows up; overlapped (``runtime/host_step.py``): started on a thread, and returns."""
        if self.nvme is None and self.overlapped is None:
            run()
            self._copy_up(self.store.slots)
            self.copies.synchronize()
            return
        grads = self._step_grads()
        if self.nvme is not None:
            self._reading = self._read(self._chunks[0], grads) if self._chunks else []
        if self.overlapped is not None:
            self.copies.synchronize()            # the gradients are down before the thread reads them
            step = as_now(self.optimizer)
            each = self._step_chunk if self.nvme is None else self._nvme_chunk
            self.overlapped.start(lambda chunk: each(step, chunk, grads))
            return
        for chunk in self._chunks:
            self._nvme_chunk(run, chunk, grads)
        self.copies.synchronize()

    def _step_grads(self) -> dict:
        """name -> this step's host gradient, or with nvme_grads its (shape, dtype) in its file
        (None: no gradient this step). Taken when the step starts: an overlapped step's chunks
        read it while the next step begins (``end_step``, ``ParamStore.zero_grad``)."""
        if self.grad_files is not None:
            return {s.name: self.grad_files.held.get(s.name) for s in self.store.slots}
        return {s.name: s.host_grad if s.name in self._taken else None for s in self.store.slots}

    def _step_chunk(self, run: Callable[[], None], chunk, grads: dict) -> None:
        """One chunk of an overlapped step, on its thread (the optimizer skips gradient-less ones)."""
        for s in chunk:
            s.host.grad = grads[s.name]
        try:     # the rows' copies up on the rank's GPU's default stream, before the reads waiting for them
            with self._on_device():
                run()
                self._copy_up(chunk)
        finally:
            for s in chunk:
                s.host.grad = None

    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def zero_grad(self) -> None:
        """Forget the last step's host gradients (an overlapped step clears each chunk's itself)."""
        if self.overlapped is None:
            self.optimizer.zero_grad(set_to_none=True)

    def wait(self) -> None:
        """An overlapped step, finished (its error raised here)."""
        if self.overlapped is not None:
            self.overlapped.wait()

    def end_step(self) -> None:
        self._taken.clear()

    def grads(self) -> list[torch.Tensor]:
        """The host gradients of this step (what fp16's unscale checks; not with nvme_grads, which
        ``build`` refuses under fp16)."""
        return [self._grad_bufs[name] for name in sorted(self._taken)]

    def _copy_up(self, slots) -> None:
        with torch.no_grad():
            for s in slots:
                if s.host.data_ptr() != s.opt_param.data_ptr():       # not the rows themselves
                    s.opt_param.copy_(s.host.detach().view(s.opt_param.shape), non_blocking=True)

    def reload(self) -> None:
        """The device parameters changed (a checkpoint was loaded, inside ``resident``): refresh
        the masters."""
        self.wait()
        with torch.no_grad():
            for s in self.store.slots:
                if s.host.data_ptr() != s.opt_param.data_ptr():
                    s.host.copy_(s.opt_param.detach())

    @contextlib.contextmanager
    def resident(self):
        """Masters and optimizer state in host memory inside (a checkpoint's save or load)."""
        self.wait()
        if self.nvme is None:
            yield
            return
        self._restore(self.store.slots)
        rows = self.rows.materialized({s.name: s.host for s in self.store.slots}) if self.rows is not None \
            else contextlib.nullcontext()
        try:
            with rows:
                yield
        finally:
            self._evict(self.store.slots)

    # ---- the NVMe tier -------------------------------------------------------------------------
    def _tensors(self, s) -> list[tuple[str, torch.Tensor]]:
        st = self.optimizer.state.get(s.host, {})
        return [(f"{s.name}/master", s.host.data)] + [
            (f"{s.name}/{k}", v) for k, v in sorted(st.items()) if isinstance(v, torch.Tensor) and v.dim()]

    def _evict(self, slots) -> None:
        """Write ``slots``' masters and state to the files and drop them from host memory."""
        for s in slots:
            for key, t in self._tensors(s):
                self._writes.write(key, t)
                self._shapes[key] = (t.shape, t.dtype)
            self._set(s, lambda shape, dtype: torch.empty(0, dtype=dtype))
            self._evicted.add(s.name)

    def _set(self, s, make) -> None:
        st = self.optimizer.state.get(s.host, {})
        s.host.data = make(*self._shapes[f"{s.name}/master"])
        for k, v in list(st.items()):
            key = f"{s.name}/{k}"
            if key in self._shapes and isinstance(v, torch.Tensor):
                st[k] = make(*self._shapes[key])

    def _read(self, slots, grads: Optional[dict] = None) -> list:
        """Start reading ``slots``' tensors back (and with nvme_grads their gradients of this step,
        ``grads``: ``_step_grads``); their futures."""
        futures = []
        for s in slots:
            if self.grad_files is not None and grads and grads[s.name] is not None \
                    and s.name not in self._chunk_grads:
                self._chunk_grads[s.name], fut = self.grad_files.read(s.name, grads[s.name])
                futures.append(fut)
            if s.name not in self._evicted:
                continue
            self._set(s, lambda shape, dtype: pinned_empty(shape, dtype, self.device))
            futures += [self.nvme.read(key, t) for key, t in self._tensors(s)]
            self._evicted.discard(s.name)
        return futures

    def _restore(self, slots) -> None:
        for f in self._read(slots):
            f.result()
        self.nvme.wait()

    def _nvme_chunk(self, run: Callable[[], None], chunk, grads: dict) -> None:
        """Step one chunk of ``self._chunks`` with the NVMe tier, in order (on the rank's thread, or
        an overlapped step's): its reads (started by the chunk before) waited for, the next chunk's
        started, the chunk stepped, its rows copied up and it written back; after the last, every
        write waited for. Only this chunk's parameters carry a gradient while ``run`` steps."""
        i = self._chunk_at[chunk[0].name]
        for f in self._reading:
            f.result()
        self._reading = self._read(self._chunks[i + 1], grads) if i + 1 < len(self._chunks) else []
        for s in chunk:
            s.host.grad = self._chunk_grads.get(s.name) if self.grad_files is not None else grads[s.name]
        try:
            with self._on_device():
                run()
                if self.rows is None:            # nvme_params: the files written below are the rows
                    self._copy_up(chunk)
                    if self.device.type == "cuda":   # the rows are up before their masters leave
                        done = torch.cuda.Event()
                        done.record()
                        done.synchronize()
        finally:
            for s in chunk:
                s.host.grad = None
                self._chunk_grads.pop(s.name, None)
        self._evict(chunk)
        if i + 1 == len(self._chunks):
            self.nvme.wait()

    def host_tensors(self) -> list[torch.Tensor]:
        """The host memory this offload owns now (masters, gradient buffers, optimizer state; the
        parameter rows themselves with parameter offload)."""
        self.wait()
        out = list(self._grad_bufs.values()) + list(self._chunk_grads.values())
        if self.store.ctx.host_params:
            out += [s.local for s in self.store.slots]
        for s in self.store.slots:
            out.append(s.host.data)
            out += [v for v in self.optimizer.state.get(s.host, {}).values() if isinstance(v, torch.Tensor)]
        return out

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.nvme is not None:
                self.nvme.close()


@dataclasses.dataclass
class Offload:
    """A rank's offload parts (None where its class is not offloaded)."""
    classes: tuple
    optimizer: Optional[HostOptimizer] = None
    activations: Optional[ActivationOffload] = None

    def close(self) -> None:
        """An NVMe tier's files removed (``pm.close()``)."""
        for part in (self.optimizer, self.activations):
            if part is not None:
                part.close()

    def saved_hooks(self, store):
        """The ``saved_tensors_hooks`` a step's forward and backward run in."""
        if self.activations is not None:
            return self.activations.hooks()
        return store.saved_hooks()

    def hooks_owner(self, store) -> Any:
        """What a memory measurement observes saved tensors through (None: nothing shadows it)."""
        return self.activations if self.activations is not None else store.ctx.regather


def make_offload(plan_offload: str, store, factory, device: torch.device, *, nvme_dir=None, rank: int = 0,
                 host_step: str = "auto", rows_in_files=None) -> Offload:
    classes = parse_offload(plan_offload)
    out = Offload(classes)
    if "optimizer" in classes:
        out.optimizer = HostOptimizer(store, factory, classes, device, nvme_dir=nvme_dir, rank=rank,
                                      host_step=host_step, rows_in_files=rows_in_files)
    if "activations" in classes:
        storages = lambda: {s.local.untyped_storage().data_ptr() for s in store.slots}   # noqa: E731
        if "nvme_activations" in classes:
            from autopar.runtime.nvme_activations import NvmeActivations

            out.activations = NvmeActivations(device, storages, nvme_dir, rank, inner=store.ctx.regather)
        else:
            out.activations = ActivationOffload(device, storages, inner=store.ctx.regather)
    return out


__all__ = ["HostOptimizer", "ActivationOffload", "Offload", "make_offload"]
