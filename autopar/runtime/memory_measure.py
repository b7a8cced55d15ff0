"""Measured vs predicted peak memory of one training step, per rank, by category.

Measurement (``measure_step``): one ``pm.step`` runs under ``StorageTracker``, a TorchDispatchMode
that sees every storage the step allocates (op outputs; a DTensor's local tensor) and, through a
``weakref.finalize`` on the storage object (torch keeps one Python object per storage), when it is
freed; or, for a collective's buffer (a tensor a ``c10d`` op was given), when its storage was
emptied (``runtime/collectives.release``: the backend's thread may hold the tensor after that,
which would make the free's place among the events a race). The storages alive when the step starts are registered first: the rank's parameters, the
optimizer state, any gradient. Replaying the alloc/free events gives the peak of the sum of live
storages and which ones made it up, each in one category decided by what the storage turned out
to be (first match):

    params        a stored parameter of this rank (``ParamSlot.local`` / ``opt_param``)
    optimizer     a tensor of ``optimizer.state`` after the step
    grads         a parameter's ``.grad`` / ZeRO-3 ``full_grad`` seen at accumulation, at a
                  bucket's launch, before or after the reduction, or after the step
    activations   saved for backward (a ``saved_tensors_hooks`` pack), or a pipeline stage's
                  output or input held in torch's ``fwd_cache`` for the backward, and not one of
                  the above (ZeRO-3's gathered weights, saved by the matmuls, land here)
    temporaries   everything else: workspaces, gradient buckets and send buffers, p2p buffers

and, apart from the device peak, ``host``: what an offloading plan keeps in host memory
(``runtime/offload.py``: masters, host gradients, the optimizer state, offloaded activations),
whose own peak is ``StepMemory.host_peak_bytes``.

Not counted (the plan does not count them either): the batch, module buffers and constants, and
allocations no aten op returns (gloo's internal buffers, DTensor's transient redistribution
buffers inside one op). On CUDA the allocator's own peak (``torch.cuda.max_memory_allocated``) is
the measured peak and the categories are the tracked storages at the tracked peak.

Prediction: ``runtime/memory_predict.py`` (the plan's configuration evaluated by the solver, the
step's peak with the pipeline schedule replayed).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autopar.runtime.reshard import acyclic

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
_PRECEDENCE = CATEGORIES           # a storage in several roles counts in the first
HOST = "host"                      # offloaded: not device memory (a role before all the others)


@dataclasses.dataclass(frozen=True)
class MemoryByCategory:
    params: int
    grads: int
    optimizer: int
    activations: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.temporaries

    def as_dict(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in CATEGORIES}


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One rank's measured peak of one step: ``peak_bytes`` (the allocator's on CUDA), the
    tracked storages alive at the tracked peak by category (``at_peak``), and each category's own
    largest live total during the step (``category_peaks``: gradients peak after the backward,
    activations before it); ``at_end``: the tracked storages still alive when the step returned
    (parameters, gradients, optimizer state; an activation there outlived its backward)."""
    peak_bytes: int
    at_peak: MemoryByCategory
    category_peaks: MemoryByCategory
    device: str
    host_peak_bytes: int = 0           # offload: the host memory it held, at its own peak
    at_end: MemoryByCategory = MemoryByCategory(0, 0, 0, 0, 0)

    @classmethod
    def from_dict(cls, d: dict) -> "StepMemory":
        end = MemoryByCategory(**d["at_end"]) if "at_end" in d else MemoryByCategory(0, 0, 0, 0, 0)
        return cls(d["peak_bytes"], MemoryByCategory(**d["at_peak"]), MemoryByCategory(**d["category_peaks"]),
                   d["device"], d.get("host_peak_bytes", 0), end)


@dataclasses.dataclass(frozen=True)
class PredictedMemory:
    """A rank's predicted peak (``cost.memory.step_peak_bytes``: not every category peaks at
    once) and each category's predicted size."""
    peak_bytes: int
    by_category: MemoryByCategory
    host_bytes: int = 0                # offload: host memory (``cost/offload.py``)


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """Measured next to predicted, one rank (``--memory``, ``"memory"`` in ``--json``)."""
    rank: int
    measured: StepMemory
    predicted: PredictedMemory

    def to_json(self) -> dict:
        return {"rank": self.rank, "measured_peak_bytes": self.measured.peak_bytes,
                "predicted_peak_bytes": self.predicted.peak_bytes,
                "measured_host_peak_bytes": self.measured.host_peak_bytes,
                "predicted_host_bytes": self.predicted.host_bytes,
                "by_category": {c: {"measured": getattr(self.measured.category_peaks, c),
                                    "at_peak": getattr(self.measured.at_peak, c),
                                    "predicted": getattr(self.predicted.by_category, c)} for c in CATEGORIES}}


def _local(t):
    inner = getattr(t, "_local_tensor", None)          # DTensor
    return inner if isinstance(inner, torch.Tensor) else t


def _storage(t) -> Optional[torch.UntypedStorage]:
    t = _local(t)
    if not isinstance(t, torch.Tensor) or t.is_meta or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class StorageTracker(TorchDispatchMode):
    """Alloc/free events of the storages ops return (see the module docstring). ``roles`` maps a
    storage serial to the categories it was seen in; ``register`` adds a storage that exists
    already (alive from event 0)."""

    def __init__(self) -> None:
        super().__init__()
        self._serial_of: dict[int, int] = {}          # id(storage object) -> serial, while alive
        self._finalizers: list = []
        self.nbytes: dict[int, int] = {}              # serial -> bytes
        self.events: list[tuple[int, bool]] = []      # (serial, allocated?) in order
        self.roles: dict[int, set] = {}
        self.origin: dict[int, str] = {}              # serial -> the op that allocated it
        self._op = "before the step"
        # collective buffers: id(storage) -> (weakref to it, serial), until emptied or freed
        self._watched: dict[int, tuple] = {}
        self._released: set[int] = set()              # serials freed by emptying, before their object

    def _serial(self, st: torch.UntypedStorage, new: bool) -> Optional[int]:
        key = id(st)
        if key in self._serial_of:
            return self._serial_of[key]
        if not new or st.nbytes() == 0:
            return None
        serial = len(self.nbytes)
        self._serial_of[key] = serial
        self.nbytes[serial] = st.nbytes()
        self.origin[serial] = self._op
        self.events.append((serial, True))
        self._finalizers.append(weakref.finalize(st, self._freed, key, serial))
        return serial

    def _freed(self, key: int, serial: int) -> None:
        self._watched.pop(key, None)
        if serial in self._released:                  # counted freed when it was emptied
            return
        self._serial_of.pop(key, None)
        self.events.append((serial, False))

    def _watch(self, args) -> None:
        for st in map(_storage, tree_leaves(args)):
            serial = None if st is None else self._serial_of.get(id(st))
            if serial is not None:
                self._watched[id(st)] = (weakref.ref(st), serial)

    def _poll_released(self) -> None:
        """A watched storage emptied since the last op is freed now (``release``)."""
        for key, (ref, serial) in list(self._watched.items()):
            st = ref()
            if st is not None and st.nbytes() == 0:
                del self._watched[key]
                self._serial_of.pop(key, None)
                self._released.add(serial)
                self.events.append((serial, False))

    def register(self, t, role: Optional[str] = None) -> None:
        st = _storage(t)
        if st is not None:
            serial = self._serial(st, new=True)
            if role is not None and serial is not None:
                self.roles.setdefault(serial, set()).add(role)

    def mark(self, t, role: str) -> None:
        """``t``'s storage, if tracked, plays ``role``."""
        st = _storage(t)
        if st is not None and id(st) in self._serial_of:
            self.roles.setdefault(self._serial_of[id(st)], set()).add(role)

    def _pack(self, t):
        self.mark(t, "activations")
        return acyclic(t, t)

    def saved_tensors(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._watched:
            self._poll_released()
        out = func(*args, **(kwargs or {}))
        self._op = str(func)
        if func.namespace == "c10d":                 # a collective's buffers: may be emptied when done
            self._watch((args, kwargs))
        inputs = {id(st) for st in map(_storage, tree_leaves((args, kwargs))) if st is not None}
        for t in tree_leaves(out):
            st = _storage(t)
            if st is not None and id(st) not in inputs:     # a view or in-place result is no allocation
                self._serial(st, new=True)
        return out

    def settle(self, quiet_s: float = 0.05, limit_s: float = 1.0) -> None:
        """Wait until no tracked storage has been freed for ``quiet_s`` (at most ``limit_s``): a
        backend may release a finished collective's tensors on its own thread just after the
        step returned (gloo's worker drops its Work after ``wait()`` has returned), and what is
        alive at the end should not depend on that race."""
        self._poll_released()
        deadline = time.monotonic() + limit_s
        seen, quiet_since = len(self.events), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(quiet_s / 4)
            if len(self.events) != seen:
                seen, quiet_since = len(self.events), time.monotonic()
            elif time.monotonic() - quiet_since >= quiet_s:
                return

    def close(self) -> None:
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()

    def category(self, serial: int) -> str:
        roles = self.roles.get(serial, ())
        if HOST in roles:
            return HOST
        return next((c for c in _PRECEDENCE if c in roles), "temporaries")

    def _peak_index(self) -> int:
        """Index of the event after which the live device total is largest (-1: nothing was live)."""
        best, at, total = 0, -1, 0
        for i, (serial, alloc) in enumerate(self.events):
            if self.category(serial) == HOST:
                continue
            total += self.nbytes[serial] if alloc else -self.nbytes[serial]
            if total > best:
                best, at = total, i
        return at

    def live_at_peak(self) -> list[tuple[str, int, str]]:
        """(category, bytes, allocating op) of each storage alive at the peak, largest first."""
        live: set[int] = set()
        for serial, alloc in self.events[: self._peak_index() + 1]:
            (live.add if alloc else live.discard)(serial)
        return sorted(((self.category(s), self.nbytes[s], self.origin[s]) for s in live if self.category(s) != HOST),
                      key=lambda x: -x[1])

    def peak(self) -> tuple[int, MemoryByCategory, MemoryByCategory, int, MemoryByCategory]:
        """The largest sum of live tracked device storages, its split by category, each
        category's own largest live sum, the host's (offloaded storages), and what is live after
        the last event, by category."""
        cat = {s: self.category(s) for s in self.nbytes}
        live = dict.fromkeys(CATEGORIES + (HOST,), 0)
        tops, at_peak = dict(live), dict(live)
        last = self._peak_index()
        for i, (serial, alloc) in enumerate(self.events):
            c = cat[serial]
            live[c] += self.nbytes[serial] if alloc else -self.nbytes[serial]
            tops[c] = max(tops[c], live[c])
            if i == last:
                at_peak = dict(live)
        host = tops.pop(HOST)
        at_peak.pop(HOST)
        live.pop(HOST)
        return sum(at_peak.values()), MemoryByCategory(**at_peak), MemoryByCategory(**tops), host, MemoryByCategory(**live)


def _mark_state(tracker: StorageTracker, pm) -> None:
    """Parameters, their gradients (every form the runtime keeps) and the optimizer state."""
    for s in pm.store.slots:
        tracker.mark(s.local, "params")
        tracker.mark(s.opt_param, "params")
        for g in (s.local.grad, s.opt_param.grad, s.full_grad):
            if g is not None:
                tracker.mark(g, "grads")
    for state in pm.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                tracker.mark(v, "optimizer")
    _mark_host(tracker, pm)


def _mark_host(tracker: StorageTracker, pm) -> None:
    host = pm.offload.optimizer
    if host is not None:
        for t in host.host_tensors():
            tracker.mark(t, HOST)


def _register_existing(tracker: StorageTracker, pm) -> None:
    for s in pm.store.slots:
        for t in (s.local, s.opt_param, s.local.grad, s.opt_param.grad, s.full_grad):
            if t is not None:
                tracker.register(t)
    for state in pm.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                tracker.register(v)
    if pm.offload.optimizer is not None:
        for t in pm.offload.optimizer.host_tensors():
            tracker.register(t)
    _mark_state(tracker, pm)


class _Spy:
    """For the measured step: ``obj.name`` (a bound method of this one instance) calls
    ``before()`` and ``after(args, result)`` around the original; restored on exit."""

    def __init__(self, obj, name: str, before=None, after=None) -> None:
        self.obj, self.name, self.before, self.after = obj, name, before, after
        self.inner = getattr(obj, name)

    def __call__(self, *args, **kwargs):
        if self.before is not None:
            self.before()
        out = self.inner(*args, **kwargs)
        if self.after is not None:
            self.after(args, out)
        return out

    def __enter__(self) -> "_Spy":
        setattr(self.obj, self.name, self)
        return self

    def __exit__(self, *exc) -> None:
        delattr(self.obj, self.name)          # back to the class's method


def _spies(tracker: StorageTracker, pm) -> list[_Spy]:
    """Gradients right before and after the reducer runs (ZeRO-3's ``full_grad`` and the
    per-parameter gradients exist only between backward and the reduction); a pipeline stage's
    forward outputs and inputs, which torch's ``fwd_cache`` holds until that micro-batch's backward
    (activations, though no autograd node saved them)."""
    spies = [_Spy(pm.reducer, name, before=lambda: _mark_state(tracker, pm),
                  after=lambda args, out: _mark_state(tracker, pm))
             for name in ("reduce", "end_micro_batch")]
    # a bucket's launch drops the summands it sends: the gradient that completed it too, whose
    # post-accumulate hook (the reducer's, registered before the tracker's) launched it (ZeRO 1/2
    # missed gpt-tiny's tied embedding gradient so, 64 KiB)
    spies.append(_Spy(pm.reducer, "_launch", before=lambda: _mark_state(tracker, pm)))
    acts = pm.offload.activations
    if acts is not None:                         # an offloaded activation's host copy
        spies.append(_Spy(acts, "to_host", after=lambda args, out: tracker.mark(out, HOST)))
        if getattr(acts, "writes", None) is not None:     # nvme_activations: on its way to its file, and back
            spies.append(_Spy(acts.writes, "write", after=lambda args, out: tracker.mark(args[1], HOST)))
            spies.append(_Spy(acts, "from_host", after=lambda args, out: tracker.mark(out, HOST)))
            spies.append(_Spy(acts, "read_next", after=lambda args, out: [tracker.mark(t, HOST) for t in out]))
    host = pm.offload.optimizer
    if host is not None:                         # NVMe: the state read back chunk by chunk in the step
        spies.append(_Spy(host, "_read", after=lambda args, out: [
            tracker.mark(t, HOST) for s in args[0] for _, t in host._tensors(s)]))
        if host.rows is not None:                # nvme_params: a gather's rows read from the files (ahead)
            spies.append(_Spy(host.rows, "rows", after=lambda args, out: tracker.mark(out, HOST)))
            spies.append(_Spy(host.rows, "ahead", after=lambda args, out: [tracker.mark(t, HOST) for t in out]))
        if host.grad_files is not None:          # nvme_grads: a gradient on its way to its file, and back
            spies.append(_Spy(host.grad_files, "put", after=lambda args, out: tracker.mark(args[1], HOST)))
            spies.append(_Spy(host.grad_files, "read", after=lambda args, out: tracker.mark(out[0], HOST)))
    runner = getattr(pm, "_pipeline", None)
    if runner is not None:
        sched = runner.schedule
        for stage in getattr(sched, "_stages", None) or [sched._stage]:
            def held(args, out, stage=stage):
                for t in tree_leaves(stage.fwd_cache.get(args[0], ())):
                    if isinstance(t, torch.Tensor):
                        tracker.mark(t, "activations")
            spies.append(_Spy(stage, "forward_one_chunk", after=held))
    return spies


def measure_step(pm, inputs, targets) -> tuple[float, StepMemory]:
    """Run ``pm.step(inputs, targets)`` and measure its peak (module docstring). Returns the loss
    and the measurement. Run it after a first step, so that the optimizer state exists."""
    device = torch.device(pm.device)
    tracker = StorageTracker()
    _register_existing(tracker, pm)
    hooks = [s.local.register_post_accumulate_grad_hook(lambda p: tracker.mark(p.grad, "grads"))
             for s in pm.store.slots if s.local.requires_grad]
    ctx = pm.store.ctx
    chained = ctx.on_full_grad                # ZeRO-3: each full summand is a gradient from its first
    if ctx.gathers:                           # accumulation (the reducer frees it once its bucket is sent)
        def on_full_grad(slot):
            tracker.mark(slot.full_grad, "grads")
            if chained is not None:
                chained(slot)
        ctx.on_full_grad = on_full_grad
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with contextlib.ExitStack() as stack:
            for spy in _spies(tracker, pm):
                stack.enter_context(spy)
            owner = pm.offload.hooks_owner(pm.store)
            if owner is not None:          # ZeRO-3's / offload's hooks shadow the tracker's: observe through them
                stack.enter_context(owner.observing(tracker._pack))
            with tracker.saved_tensors(), tracker:
                loss = pm.step(inputs, targets)
        tracker.settle()
        _mark_state(tracker, pm)
    finally:
        for h in hooks:
            h.remove()
        ctx.on_full_grad = chained
        tracker.close()
    peak, split, tops, host, end = tracker.peak()
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
    return loss, StepMemory(peak, split, tops, device.type, host, end)


# ---- measured next to predicted (``runtime/memory_predict.py``) ----------------------------------

def compare_ranks(plan, graph, measured: list[dict], param_dtype: str, optimizer: str = "adamw", *,
                  evaluation: Optional[tuple] = None) -> list[RankMemory]:
    """Measured (``measure_step``'s ``StepMemory`` as a dict, one per global rank) next to the
    prediction for that rank's pipeline rank (global rank = pp rank x ranks per stage).
    ``evaluation``: ``memory_predict.plan_evaluation``'s result when the caller has it."""
    from autopar.runtime.memory_predict import plan_evaluation, predict_memory

    ev, summary, profile = evaluation or plan_evaluation(plan, graph)
    per_stage = plan.stage_mesh.size
    rows = []
    for rank, m in enumerate(measured):
        predicted = predict_memory(ev, summary, rank // per_stage, param_dtype, optimizer, profile, m["device"])
        rows.append(RankMemory(rank, StepMemory.from_dict(m), predicted))
    return rows


def traced_for_prediction(model: str, batch: Optional[int] = None, seq_len: Optional[int] = None) -> tuple:
    """(graph, parameter dtype) of a model given by name or spec: traced on the meta device as
    planning traces it (what the predictions are made on)."""
    from autopar.models import build_model
    from autopar.trace import trace_model

    b = build_model(model, batch=batch, seq_len=seq_len, device="meta")
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                        model_name=model)
    return graph, str(next(b.module.parameters()).dtype).removeprefix("torch.")


def compare_model(plan, model: str, measured: list[dict], optimizer: str = "adamw", *,
                  batch: Optional[int] = None, seq_len: Optional[int] = None) -> list[RankMemory]:
    """``compare_ranks`` for a model given by name or spec (``autopar run``), predicted for its
    parameters' dtype."""
    graph, dtype = traced_for_prediction(model, batch, seq_len)
    return compare_ranks(plan, graph, measured, dtype, optimizer)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.3f} MiB"


def _error(measured: int, predicted: int) -> str:
    return f"{(measured - predicted) / predicted * 100:+.1f}%" if predicted else "-"


def memory_table(row: RankMemory):
    """A rich table of one rank: category, measured, predicted, error."""
    from rich.table import Table

    t = Table(title=f"rank {row.rank}: peak memory of the measured step ({row.measured.device})",
              title_justify="left")
    for col in ("category", "at the peak", "measured", "predicted", "error"):
        t.add_column(col, justify="right" if col != "category" else "left")
    for c in CATEGORIES:
        at, m, p = (getattr(x, c) for x in (row.measured.at_peak, row.measured.category_peaks,
                                             row.predicted.by_category))
        t.add_row(c, _mib(at), _mib(m), _mib(p), _error(m, p))
    t.add_row("peak", _mib(row.measured.peak_bytes), _mib(row.measured.peak_bytes), _mib(row.predicted.peak_bytes),
              _error(row.measured.peak_bytes, row.predicted.peak_bytes), style="bold")
    if row.measured.host_peak_bytes or row.predicted.host_bytes:     # offload: apart from the device
        host = row.measured.host_peak_bytes
        t.add_row("host (offloaded)", "-", _mib(host), _mib(row.predicted.host_bytes),
                  _error(host, row.predicted.host_bytes), style="dim")
    return t
