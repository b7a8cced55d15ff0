"""What a rank actually communicated: one frozen ``Collective`` per collective issued.

Two sources feed one ``CollectiveLog``:

- ``CollectiveRecorder``: a ``TorchDispatchMode`` around forward and backward. DTensor lowers every
  redistribution to functional collectives (``torch.ops._c10d_functional.*``); the mode sees those
  ops with their tensor and process-group name, which maps back to a mesh axis. (DTensor's
  ``CommDebugMode`` counts the same ops but keeps neither the axis nor the size.)
- autopar's own gradient reducer and ZeRO gathers call ``CollectiveLog.add`` directly.

``nbytes`` follows ``autopar.cost.collectives``: all_reduce the tensor, all_gather the OUTPUT,
reduce_scatter the INPUT, all_to_all each rank's send buffer.
"""
from __future__ import annotations

import contextlib
from typing import Optional

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


WAIT_EVENT = "autopar::wait:"      # + the collective's kind: a profiler range around waiting for one


def wait_for(work, kind: str) -> None:
    """``work.wait()`` inside a profiler range named ``WAIT_EVENT + kind``: the time an async
    collective keeps a rank waiting is not in any c10d op's self time (the launch returned), and
    ``autopar profile`` counts it as that collective's (``runtime/profiling.op_class``), not as host
    overhead. Outside a profiler the range costs a microsecond or two."""
    import torch

    with torch.profiler.record_function(WAIT_EVENT + kind):
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
    """Records DTensor's functional collectives into ``log`` while active.

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
        out = func(*args, **kwargs)
        ns = getattr(func, "namespace", "")
        if ns in ("_c10d_functional", "_c10d_functional_autograd"):
            name = func._opname
            if name in _COALESCED:
                raise NotImplementedError(f"autopar's collective log does not handle {func}")
            kind = FUNCOL_KINDS.get(name)
            if kind is not None:
                self._record(kind, args, out)
        return out

    def _record(self, kind: str, args, out) -> None:
        axis = self._axis(args[-1])          # every functional collective ends with its group name
        t = args[0]
        if kind == "all_gather":
            nbytes = out.numel() * out.element_size()
        else:
            nbytes = t.numel() * t.element_size()
        self.log.add(kind, axis, nbytes, "dtensor")



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
