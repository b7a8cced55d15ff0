"""One rank's training steps measured under ``torch.profiler`` (``autopar profile``'s rank side).

``profile_steps`` runs warm-up steps, then K timed steps (wall time, no profiler: its per-op records
cost host time of their own), then K steps inside ``torch.profiler.profile`` (CPU activity, plus
CUDA on GPUs), and returns a ``RankProfile``: the wall time of each timed step, the profiler's
self time per operator class (``op_class``) averaged per step (on a GPU the device time of the
kernels each op launched: ``step_classes``), the collectives autopar logged in
the profiled steps (kind, mesh axis, bytes), the time measured inside each one's
``collectives.collective_range`` (``step_profile``) and, optionally, a Chrome/TensorBoard trace file.

Operator classes of profiler events (self time, so nested events are not counted twice):
``matmul``, ``attention``, ``memory`` (elementwise, norms, reductions) and ``free`` (views) as the
cost model classifies aten ops (``cost/compute.op_kind``); ``collective:<kind>`` for c10d's
collectives (on gloo their self time includes waiting for the slowest rank) and for the waits on
autopar's async ones (gradient buckets, ZeRO-3 prefetches: ``collectives.wait_for``), and for
DTensor's functional collectives: the launch (``_c10d_functional::all_reduce``, ...) and the
``_c10d_functional::wait_tensor`` that waits for it (on gloo most of the collective's time), the
wait taken as the oldest unwaited launch's of its thread; ``optimizer`` for the
optimizer step: its own code and every operator it runs (``step_classes``: the fused or foreach
kernels of AdamW are elementwise aten ops, which alone would count as ``memory``), collectives
inside it excepted (LAMB's norms over shards); what a matmul or attention op runs inside it (the
bias ``addmm`` copies into its output before the GEMM, a decomposed attention's pieces) is that
op's; ``runtime`` for everything else (Python dispatch of
DTensor and autopar's executor, autograd bookkeeping).
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Callable, Iterable, Optional

import torch

from autopar.cost.compute import op_kind
from autopar.runtime.collectives import FUNCOL_KINDS, parse_collective_event

_C10D = {"allreduce": "all_reduce", "allgather": "all_gather", "_allgather_base": "all_gather",
         "allgather_into_tensor_coalesced": "all_gather", "reduce_scatter": "reduce_scatter",
         "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
         "alltoall": "all_to_all", "alltoall_base": "all_to_all", "broadcast": "broadcast",
         "send": "p2p", "recv": "p2p", "recv_any_source": "p2p", "barrier": "barrier"}


def op_class(event_name: str) -> str:
    """The class a profiler event's self time counts under (module docstring)."""
    if event_name.startswith("c10d::"):
        base = event_name[len("c10d::"):].rstrip("_")
        return "collective:" + _C10D.get(base, base)
    key = parse_collective_event(event_name)       # a ``collectives.collective_range``: the wait for
    if key is not None:                            # an async one, or what a launch spends outside c10d
        return "collective:" + key[0]
    if event_name.startswith(_FUNCOL):               # DTensor's functional collectives' launches
        kind = FUNCOL_KINDS.get(event_name[len(_FUNCOL):].removesuffix("_coalesced"))
        if kind is not None:
            return "collective:" + kind
    if event_name.startswith("Optimizer.step#"):
        return "optimizer"
    if event_name.startswith("aten::"):
        return op_kind(event_name)
    return "runtime"


_OWNING = ("matmul", "attention")      # classes whose ops' nested aten ops are their work


def step_classes(events, steps: int, device: bool = False) -> Counter:
    """Self time per step by class of the profiler's ``events`` (``prof.events()``: each knows its
    parent), over ``steps`` steps: ``op_class``, but what runs inside an optimizer step is the
    optimizer's, what runs inside a matmul or attention op is that op's, and a functional
    collective's ``wait_tensor`` is that collective's (module docstring).

    ``device``: count the GPU time of the kernels each host op launched (its self device time)
    instead of the op's host time; the kernels' own events, already counted through the op that
    launched them, are skipped. On a GPU the host's time is mostly launching, and the step waits
    for the kernels: measured there by host self time, a GEMM-bound step read as 20 ms of matmul
    and 491 ms of "host" (the first lent H200)."""
    return step_profile(events, steps, device)[0]


def step_profile(events, steps: int, device: bool = False) -> tuple[Counter, Counter]:
    """``(step_classes, per collective)``: the second, the part of each ``collective:<kind>`` class'
    time spent inside one collective's ``collectives.collective_range`` (its launch or the wait for
    it), per step, keyed ``(kind, axis, bytes)``."""
    by_class: Counter = Counter()
    by_collective: Counter = Counter()
    waits = _functional_waits(events)
    for e in events:
        if device and _on_device(e):
            continue
        cls = waits.get(id(e)) or op_class(e.name)
        if not cls.startswith("collective:") and cls != "optimizer":
            cls = _owner(e) or cls
        t = (e.self_device_time_total if device else e.self_cpu_time_total) * 1e-6 / steps
        by_class[cls] += t
        if cls.startswith("collective:"):
            key = _collective_of(e)
            if key is not None and cls == "collective:" + key[0]:
                by_collective[key] += t
    return by_class, by_collective


def _collective_of(event) -> Optional[tuple[str, str, int]]:
    """(kind, axis, bytes) of the innermost ``collective_range`` around ``event`` (or itself)."""
    while event is not None:
        key = parse_collective_event(event.name)
        if key is not None:
            return key
        event = event.cpu_parent
    return None


def _on_device(event) -> bool:
    """A kernel's (or memcpy's) own profiler event, not a host op's."""
    return event.device_type != torch.autograd.DeviceType.CPU


_FUNCOL = "_c10d_functional::"
_WAIT_TENSOR = _FUNCOL + "wait_tensor"


def _functional_waits(events) -> dict[int, str]:
    """id(event) -> class of each ``wait_tensor``: the collective of the oldest launch on its thread
    not waited for yet (DTensor waits for what it issued, in order)."""
    by_thread: dict = {}
    for e in events:
        if e.name.startswith(_FUNCOL):
            by_thread.setdefault(e.thread, []).append(e)
    out: dict[int, str] = {}
    for evs in by_thread.values():
        pending: list[str] = []
        for e in sorted(evs, key=lambda x: x.time_range.start):
            cls = op_class(e.name)
            if e.name == _WAIT_TENSOR:
                if pending:
                    out[id(e)] = pending.pop(0)
            elif cls.startswith("collective:"):
                pending.append(cls)
    return out


def _owner(event) -> Optional[str]:
    """"optimizer" inside an optimizer step, else the class of the innermost matmul or attention
    op ``event`` runs inside, else None."""
    owner = None
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("Optimizer.step#"):
            return "optimizer"
        if owner is None and parent.name.startswith("aten::") and op_class(parent.name) in _OWNING:
            owner = op_class(parent.name)
        parent = parent.cpu_parent
    return owner


@dataclasses.dataclass(frozen=True)
class RankProfile:
    """What one rank measured over ``steps`` profiled steps (times in seconds)."""
    rank: int
    coordinates: dict              # mesh axis -> this rank's index
    steps: int
    step_times_s: tuple[float, ...]
    by_class_s: dict               # op class -> self time per step
    collectives: tuple[tuple[str, str, int, int], ...]   # (kind, axis, bytes per call, calls per step)
    trace_path: Optional[str] = None
    collective_s: tuple[tuple[str, str, int, float], ...] = ()   # (kind, axis, bytes, self time per step)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def profile_steps(pm, batches: Iterable, *, warmup: int, steps: int, trace_path: Optional[str] = None,
                  step: Optional[Callable] = None) -> RankProfile:
    """Run ``warmup`` steps, ``steps`` timed ones, then ``steps`` under the profiler, of ``pm`` on
    ``batches`` (an iterator of (inputs, target)); ``step(inputs, target)`` in place of ``pm.step``."""
    from torch.profiler import ProfilerActivity, profile

    if warmup < 0 or steps < 1:
        raise ValueError(f"profile: need warmup >= 0 and steps >= 1, got {warmup} and {steps}")
    run = step or pm.step
    batches = iter(batches)
    for _ in range(warmup):
        run(*next(batches))
    times = []                    # timed without the profiler, whose per-op records cost host time
    for _ in range(steps):
        inputs, target = next(batches)
        if pm.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(inputs, target)
        if pm.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    pm.reset_collectives()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if pm.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run(*next(batches))
    by_class, by_collective = step_profile(prof.events(), steps, device=pm.device.type == "cuda")
    calls = Counter((c.kind, c.axis, c.nbytes) for c in pm.collectives if c.phase != "setup")
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return RankProfile(rank=torch.distributed.get_rank(), coordinates=pm.coordinates, steps=steps,
                       step_times_s=tuple(times), by_class_s=dict(by_class),
                       collectives=tuple(sorted((k, a, b, n // steps) for (k, a, b), n in calls.items())),
                       trace_path=trace_path, collective_s=tuple(sorted((*k, v) for k, v in by_collective.items())))
