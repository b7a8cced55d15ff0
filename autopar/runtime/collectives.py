"""What a rank actually communicated: one frozen ``Collective`` per collective issued.

Two sources feed one ``CollectiveLog``:

- ``CollectiveRecorder``: a ``TorchDispatchMode`` around forward and backward. DTensor lowers every
  redistribution to functional collectives (``torch.ops._c10d_functional.*``); the mode sees those
  ops with their tensor and process-group name, which maps back to a mesh axis. (DTensor's
  ``CommDebugMode`` counts the same ops but keeps neither the axis nor the size.)
- autopar's own gradient reducer and ZeRO gathers call ``CollectiveLog.add`` directly.

Each collective's launch and the wait for it run inside its ``collective_range``, a profiler range
named for its kind, axis and bytes: ``autopar profile`` measures each one's time from them.

``nbytes`` follows ``autopar.cost.collectives``: all_reduce the tensor, all_gather the OUTPUT,
reduce_scatter the INPUT, all_to_all each rank's send buffer.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.codegen.expected import Collective


class CollectiveLog:
    """The records of one rank, appended as they are issued (``records`` is a snapshot tuple)."""

    def __init__(self) -> None:
        self._records: list[Collective] = []
        self.phase = "setup"
        self._paused = 0

    def add(self, kind: str, axis: str, nbytes: int, source: str, phase: Optional[str] = None) -> None:
        if not self._paused:
            self._records.append(Collective(kind, axis, int(nbytes), phase or self.phase, source))

    @contextlib.contextmanager
    def paused(self):
        """Records nothing inside (probes that are not part of the program)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def records(self) -> tuple[Collective, ...]:
        return tuple(self._records)

    def clear(self) -> None:
        self._records.clear()


COLLECTIVE_EVENT = "autopar::collective:"   # + "kind|axis|bytes": a profiler range around one collective


def collective_range(kind: str, axis: str, nbytes: int):
    """A profiler range around one collective's launch or wait, named for its kind, mesh axis and
    bytes (as the log records them): ``autopar profile`` adds the self time of the ops inside to
    that collective's measured time (``runtime/profiling.step_profile``) and classes it as the
    kind's. Outside a profiler it is a no-op (a range costs ~6 us a call even then)."""
    if not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"{COLLECTIVE_EVENT}{kind}|{axis}|{int(nbytes)}")


def parse_collective_event(name: str) -> Optional[tuple[str, str, int]]:
    """``(kind, axis, bytes)`` of a ``collective_range``'s event name, else None."""
    if not name.startswith(COLLECTIVE_EVENT):
        return None
    kind, axis, nbytes = name[len(COLLECTIVE_EVENT):].rsplit("|", 2)
    return kind, axis, int(nbytes)


def wait_for(work, kind: str, axis: str, nbytes: int) -> None:
    """``work.wait()`` inside the collective's ``collective_range``: the time an async collective
    keeps a rank waiting is not in any c10d op's self time (the launch returned), and ``autopar
    profile`` counts it as that collective's, not as host overhead."""
    with collective_range(kind, axis, nbytes):
        work.wait()


def release(*tensors) -> None:
    """Free the storage of each of ``tensors`` now (``untyped_storage().resize_(0)``): a
    collective's buffers once it was waited for and what it produced was copied out. The backend
    may hold the finished Work, and with it these tensors, for a while after ``wait()`` returned
    (gloo's worker thread drops it when it gets to it), so dropping our references alone frees them
    at a time of that thread's choosing, and the step's peak memory with it. (FSDP frees its
    all-gather buffers so.) Only for tensors nothing reads afterwards: every view of the storage
    is emptied with it."""
    for t in tensors:
        if t is not None:
            t.untyped_storage().resize_(0)


FUNCOL_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
_COALESCED = {"all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"}


class CollectiveRecorder(TorchDispatchMode):
    """Records DTensor's functional collectives into ``log`` while active, each launch and the wait
    for it inside the collective's ``collective_range`` (``autopar profile`` times them).

    ``axis_ranks``: mesh axis name -> the global ranks of this rank's group on that axis. A group
    is named by its ranks, not its name: DTensor caches redistribution plans per mesh layout, so a
    second mesh of the same shape may run on the first mesh's (equal) groups."""

    def __init__(self, log: CollectiveLog, axis_ranks: dict[str, tuple[int, ...]],
                 named: Optional[dict[str, str]] = None) -> None:
        super().__init__()
        self.log = log
        self.axis_ranks = {tuple(sorted(r)): a for a, r in axis_ranks.items() if len(r) > 1}
        # process-group name -> axis, before the ranks: a group autopar issues on itself (the cp
        # group of context-parallel attention) may hold the same ranks as a mesh axis' group
        self._names: dict[str, str] = dict(named or {})
        # id of a launch's output -> (a weak reference to it, (kind, axis, bytes)) until its wait
        self._inflight: dict[int, tuple] = {}

    def _axis(self, group_name: str) -> str:
        if group_name not in self._names:
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _resolve_process_group

            ranks = tuple(sorted(dist.get_process_group_ranks(_resolve_process_group(group_name))))
            self._names[group_name] = self.axis_ranks.get(ranks, f"group{list(ranks)}")
        return self._names[group_name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented            # let DTensor lower to plain ops first; we see those
        if getattr(func, "namespace", "") not in ("_c10d_functional", "_c10d_functional_autograd"):
            return func(*args, **kwargs)
        name = func._opname
        if name in _COALESCED:
            raise NotImplementedError(f"autopar's collective log does not handle {func}")
        kind = FUNCOL_KINDS.get(name)
        if kind is not None:
            key = self._key(kind, args)
            with collective_range(*key):
                out = func(*args, **kwargs)
            self.log.add(*key, "dtensor")
            if torch.autograd._profiler_enabled():         # its wait is timed as it (collective_range)
                self._track(out, key)
            return out
        if name == "wait_tensor" and args:
            ref, key = self._inflight.pop(id(args[0]), (None, None))
            if ref is not None and ref() is args[0]:
                with collective_range(*key):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _key(self, kind: str, args) -> tuple[str, str, int]:
        """(kind, axis, bytes) of a functional collective's call: every one ends with its group
        name; all_gather counts its output (input x group size, its second argument)."""
        t = args[0]
        nbytes = t.numel() * t.element_size() * (int(args[1]) if kind == "all_gather" else 1)
        return kind, self._axis(args[-1]), nbytes

    def _track(self, out, key) -> None:
        """Remember ``out``'s collective until its ``wait_tensor``; entries whose tensor is gone
        (never waited for under this mode) are dropped once there are many."""
        import weakref

        if len(self._inflight) > 256:
            self._inflight = {k: v for k, v in self._inflight.items() if v[0]() is not None}
        self._inflight[id(out)] = (weakref.ref(out), key)


def traffic_by_axis(records: "tuple[Collective, ...] | list[Collective]") -> dict[str, dict]:
    """What a rank carried per mesh axis: ``{axis: {"count", "bytes", "kinds": {kind: count}}}``,
    axes in first-seen order (``autopar run --json``'s ``"collectives"``)."""
    out: dict[str, dict] = {}
    for c in records:
        a = out.setdefault(c.axis, {"count": 0, "bytes": 0, "kinds": {}})
        a["count"] += 1
        a["bytes"] += c.nbytes
        a["kinds"][c.kind] = a["kinds"].get(c.kind, 0) + 1
    return out
