"""ZeRO-3's reshard after forward: a gathered parameter is not kept from its forward to its backward.

Under ZeRO-3 each scope that reads a parameter all-gathers its dp rows (``params._UseParam``). The
ops that use it save it for their backward (a matmul saves its weight), so without care autograd
holds every gathered weight of the model from the forward to the backward: the memory of ZeRO-0,
where the plan (``solver/timing.py``) counts a couple of gathered layers. As FSDP does
(``reshard_after_forward``), a ``saved_tensors_hooks`` pair run around the step replaces a saved
tensor that is (a view of) a gathered parameter by a small record (which parameter, which view);
when the backward first needs it, the rows are all-gathered again and the view rebuilt. The
re-gathered tensor is held until that parameter's own backward (``release``: after every
consumer's backward has run) and is shared by all its saved views, so each parameter read in a
scope is gathered once more in backward if, and only if, a consumer saved it
(``codegen/expected.py`` predicts exactly these gathers: ``solver/saved.saves_param_operand``).
A parameter of a gather group (``codegen/gather_groups.py``) is re-gathered with the rest of its
group's saved weights, in one collective, when the backward first needs one of them; that
re-gather then starts the next group's (``_regather``: the backward's prefetch, as FSDP's), so
only each backward's first re-gather is waited for.

Deterministic on every rank: records are found by storage address (DTensor's local views, made
below autograd, have no ``_base``), confirmed by a weak reference to the gathered buffer whose
storage it must still be (a freed buffer's reused address is never taken for a parameter), and the
re-gathers happen in the backward's order, the same on every rank. Recompute regions are left to
``torch.utils.checkpoint`` (its own hooks are innermost there; a region re-gathers in its replay).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Optional

import torch


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of (itself when it is none): the gathered buffer, which its views
    made above autograd keep alive."""
    return t._base if t._base is not None else t


@dataclasses.dataclass(frozen=True)
class _Resharded:
    """A saved view of a gathered parameter, without its data."""
    slot: Any                          # params.ParamSlot
    size: tuple
    stride: tuple
    offset: int
    dtensor: Optional[tuple]           # (mesh, placements, shape, stride) when it was a DTensor


def dtensor_spec(t: torch.Tensor) -> Optional[tuple]:
    """What rebuilds ``t`` from its local tensor after a pack hook took it apart: (mesh, placements,
    shape, stride) for a DTensor, None for a plain tensor (``as_saved``)."""
    from torch.distributed.tensor import DTensor

    return (t.device_mesh, tuple(t.placements), t.shape, t.stride()) if isinstance(t, DTensor) else None


def as_saved(local: torch.Tensor, spec: Optional[tuple]) -> torch.Tensor:
    """A pack hook's saved tensor back from its local tensor and ``dtensor_spec``."""
    if spec is None:
        return local
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = spec
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def acyclic(packed, t: torch.Tensor):
    """What a pack hook that returns ``packed`` for ``t`` should hand autograd: ``t`` detached when
    the hook keeps ``t`` itself. Autograd saves an op's own output without its ``grad_fn`` (no
    cycle), but a pack hook's result is held as it is: ``t`` itself would point back, through its
    ``grad_fn``, at the node saving it, a reference cycle Python's collector cannot see through.
    A backward that runs the node frees its saved tensors and breaks the cycle; a node no backward
    runs keeps its graph alive forever, which is every input-gradient-only node (attention, softmax,
    the loss's log-softmax) under the zero-bubble schedules' split backward (B retains the graph,
    W runs only the weights' branches: ``runtime/pipeline.py``): without this, their activations
    leaked every step. The detached alias shares ``t``'s storage and version counter."""
    return t.detach() if packed is t and t.grad_fn is not None else packed


class Observed:
    """``saved_tensors_hooks`` owners that let an outer observer (``memory_measure``'s, which
    theirs shadow) see the saved tensors: ``_observers`` are called from their pack hook. ``hooks``
    runs a step inside their ``_pack``/``_unpack`` (``_clear`` before and after; what ``_pack``
    keeps as it is goes through ``acyclic``), with an ``inner`` owner's set up too: their pack asks
    ``inner`` first (``_inner_pack``) and unpacks what it packed."""

    _observers: list
    inner: Any = None

    @contextlib.contextmanager
    def hooks(self):
        """Around a step's forward and backward."""
        self._clear()
        outer = self.inner.hooks() if self.inner is not None else contextlib.nullcontext()
        try:
            with outer, torch.autograd.graph.saved_tensors_hooks(lambda t: acyclic(self._pack(t), t), self._unpack):
                yield
        finally:
            self._clear()

    def _clear(self) -> None:
        pass

    def _inner_pack(self, t: torch.Tensor):
        """What ``inner`` packs ``t`` as (``t`` itself when it leaves it)."""
        return self.inner._pack(t) if self.inner is not None else t

    def _inner_unpack(self, saved):
        return self.inner._unpack(saved) if self.inner is not None else saved

    @contextlib.contextmanager
    def observing(self, fn):
        """``fn(t)`` sees the tensors saved for backward inside (those the hooks leave as they are)."""
        self._observers.append(fn)
        try:
            yield
        finally:
            self._observers.remove(fn)


class Reshard(Observed):
    """The hooks of one ``ParamStore`` (module docstring); ``gather(slot)`` all-gathers a slot's rows."""

    def __init__(self, gather) -> None:
        self._gather = gather
        self._gathered: dict[int, tuple] = {}      # storage address -> (slot, weakref to the gathered buffer)
        self._held: dict[str, torch.Tensor] = {}   # re-gathered in this backward, until the slot's backward
        self._observers: list = []                  # see ``observing``
        # gather groups (``runtime/prefetch.GroupGathers``: a group's saved weights in one
        # collective); per group, the slots whose saved views were packed in this step; the groups
        # re-gathered since they were last packed; the re-gather started ahead of the backward
        self.groups = None
        self._packed: dict[int, dict] = {}
        self._done: set[int] = set()
        self._coming: dict[int, Any] = {}
        self.regathered = self.prefetched = self.dropped = 0     # over the run: group re-gathers; of them
                                                                 # prefetched; prefetches never read

    def register(self, slot, full: torch.Tensor) -> None:
        """``full`` is ``slot``'s gathered tensor (called by ``_UseParam`` on every forward gather)."""
        address = full.untyped_storage().data_ptr()
        if address:
            self._gathered[address] = (slot, weakref.ref(_root(full)))

    def release(self, slot) -> None:
        """``slot``'s backward ran: no saved view of it is unpacked any more."""
        self._held.pop(slot.name, None)

    def _clear(self) -> None:
        for flight in self._coming.values():      # started for a backward that did not read it
            self.groups.drop(flight)
            self.dropped += 1
        self._coming.clear()
        self._gathered.clear()
        self._held.clear()
        self._packed.clear()
        self._done.clear()

    def _pack(self, t: torch.Tensor):
        from torch.distributed.tensor import DTensor

        for fn in self._observers:
            fn(t)
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.device.type == "meta" or not self._gathered:
            return t
        address = local.untyped_storage().data_ptr()
        entry = self._gathered.get(address) if address else None
        root = entry[1]() if entry is not None else None
        if root is None or root.untyped_storage().data_ptr() != address:
            return t
        slot = entry[0]
        if self.groups is not None and slot.plan.group >= 0:
            self._packed.setdefault(slot.plan.group, {})[slot.name] = slot
            self._done.discard(slot.plan.group)
        return _Resharded(slot, tuple(local.size()), tuple(local.stride()), local.storage_offset(), dtensor_spec(t))

    def _unpack(self, saved):
        if not isinstance(saved, _Resharded):
            return saved
        full = self._held.get(saved.slot.name)
        if full is None and self.groups is not None and saved.slot.plan.group >= 0:
            self._held.update(self._regather(saved.slot.plan.group))
            full = self._held.get(saved.slot.name)
        if full is None:
            full = self._held[saved.slot.name] = self._gather(saved.slot)
        return as_saved(full.as_strided(saved.size, saved.stride, saved.offset), saved.dtensor)

    def _regather(self, g: int) -> dict:
        """Group ``g``'s saved weights, the first of which this backward needs, each held until its
        own backward (they all follow in this backward): landed from the prefetch, or gathered now in
        one collective. Then the backward's prefetch: the re-gather of the group it needs next (the
        backward runs the forward in reverse: the highest packed group below ``g`` not re-gathered
        since its forward) starts, to arrive while ``g``'s layer runs its backward (as FSDP's
        backward prefetch). Every rank packs and unpacks alike, so all issue the same gathers in
        the same order."""
        flight = self._coming.pop(g, None)
        nxt = self._below(g)
        if flight is None and nxt is not None:       # NVMe rows: the next group's read beside this one's
            self.groups.read_ahead(self._wanted(nxt))
        got = self.groups.land(flight) if flight is not None else self.groups.gather_now(self._wanted(g))
        self._done.add(g)
        self.regathered += 1
        self.prefetched += flight is not None
        wanted = self._wanted(nxt) if nxt is not None else []
        if wanted:
            self._coming[nxt] = self.groups.start(wanted)
            after = self._below(nxt)
            if after is not None:                    # its rows read while this layer runs its backward
                self.groups.read_ahead(self._wanted(after))
        return got

    def _below(self, g: int) -> Optional[int]:
        """The group the backward re-gathers after ``g``: the highest packed below it not re-gathered
        since its forward and not started."""
        return max((h for h in self._packed if h < g and h not in self._done and h not in self._coming), default=None)

    def _wanted(self, g: int) -> list:
        return [s for n, s in self._packed.get(g, {}).items() if n not in self._held]
