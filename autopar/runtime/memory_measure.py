"""Measured vs predicted peak memory of one training step, per rank, by category.

Measurement (``measure_step``): one ``pm.step`` runs under ``StorageTracker``, a TorchDispatchMode
that sees every storage the step allocates (op outputs; a DTensor's local tensor) and, through a
``weakref.finalize`` on the storage object (torch keeps one Python object per storage), when it is
freed. The storages alive when the step starts are registered first: the rank's parameters, the
optimizer state, any gradient. Replaying the alloc/free events gives the peak of the sum of live
storages and which ones made it up, each in one category decided by what the storage turned out
to be (first match):

    params        a stored parameter of this rank (``ParamSlot.local`` / ``opt_param``)
    optimizer     a tensor of ``optimizer.state`` after the step
    grads         a parameter's ``.grad`` / ZeRO-3 ``full_grad`` seen at accumulation, before or
                  after the reduction, or after the step
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

Prediction (``predict_memory``): the solver's evaluation of the plan's configuration for every
pipeline rank (``solver.timing.evaluate``: activations of the ops' saved outputs in the plan dtype,
in-flight micro-batches, workspace), with the model states recomputed for the dtype the parameters
actually have and the optimizer actually run (``cost.memory.state_bytes_per_param``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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
    activations before it)."""
    peak_bytes: int
    at_peak: MemoryByCategory
    category_peaks: MemoryByCategory
    device: str
    host_peak_bytes: int = 0           # offload: the host memory it held, at its own peak

    @classmethod
    def from_dict(cls, d: dict) -> "StepMemory":
        return cls(d["peak_bytes"], MemoryByCategory(**d["at_peak"]), MemoryByCategory(**d["category_peaks"]),
                   d["device"], d.get("host_peak_bytes", 0))


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
        self._serial_of.pop(key, None)
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
        return t

    def saved_tensors(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._op = str(func)
        inputs = {id(st) for st in map(_storage, tree_leaves((args, kwargs))) if st is not None}
        for t in tree_leaves(out):
            st = _storage(t)
            if st is not None and id(st) not in inputs:     # a view or in-place result is no allocation
                self._serial(st, new=True)
        return out

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

    def peak(self) -> tuple[int, MemoryByCategory, MemoryByCategory]:
        """The largest sum of live tracked device storages, its split by category, and each
        category's own largest live sum (``host`` among them: offloaded storages)."""
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
        return sum(at_peak.values()), MemoryByCategory(**at_peak), MemoryByCategory(**tops), host


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
    spies = [_Spy(pm.reducer, "reduce", before=lambda: _mark_state(tracker, pm),
                  after=lambda args, out: _mark_state(tracker, pm))]
    if pm.offload.activations is not None:       # an offloaded activation's host copy
        spies.append(_Spy(pm.offload.activations, "to_host", after=lambda args, out: tracker.mark(out, HOST)))
    host = pm.offload.optimizer
    if host is not None:                         # NVMe: the state read back chunk by chunk in the step
        spies.append(_Spy(host, "_read", after=lambda args, out: [
            tracker.mark(t, HOST) for s in args[0] for _, t in host._tensors(s)]))
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
        _mark_state(tracker, pm)
    finally:
        for h in hooks:
            h.remove()
        ctx.on_full_grad = chained
        tracker.close()
    peak, split, tops, host = tracker.peak()
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
    return loss, StepMemory(peak, split, tops, device.type, host)


# ---- prediction ---------------------------------------------------------------------------------

def plan_evaluation(plan, graph, cluster=None):
    """The solver's evaluation of ``plan``'s configuration on ``graph`` (every pipeline rank) and
    its tp-axis summary: the plan's choices forced, the same cluster and budget, and the plan's own
    per-operator placements (``solver/plan_choice.py``; the solve's where the tables lack one). ``graph``: the
    model traced with its loss at the plan's global batch (repeated blocks collapsed, as planning
    traces it)."""
    from autopar.cost.hardware import resolve_cluster
    from autopar.solver.forcing import Force
    from autopar.solver.plan_choice import own_summary
    from autopar.solver.search import solve
    from autopar.solver.timing import evaluate

    if cluster is None:
        cluster = resolve_cluster(plan.cluster.gpu, nodes=plan.cluster.nodes,
                                  gpus_per_node=plan.cluster.gpus_per_node)
    force = Force(tp=plan.tp, pp=plan.pp, dp=plan.dp, micro_batch_size=plan.micro_batch_size,
                  num_micro_batches=plan.num_micro_batches, zero_stage=plan.zero_stage,
                  recompute=plan.recompute, sequence_parallel=plan.sequence_parallel,
                  schedule=plan.pipeline_schedule if plan.pp > 1 else None,
                  virtual_stages=plan.virtual_stages if plan.pp > 1 else None,
                  context_parallel=plan.context_parallel,
                  context_parallel_mode=plan.context_parallel_mode if plan.context_parallel > 1 else None,
                  offload=plan.offload, tensor_parallel_mode=plan.summary()["tensor_parallel_mode"])
    res = solve(graph, cluster, global_batch=plan.global_batch, seq_len=plan.seq_len, dtype=plan.dtype,
                memory_budget_bytes=plan.cluster.memory_budget_bytes, force=force)
    cfg = res.evaluation.config
    if plan.recompute_layers is not None:       # per-layer recompute: the plan's layers, not every one
        from dataclasses import replace

        cfg = replace(cfg, recompute="partial", recompute_layers=plan.recompute_layers)
    summary = own_summary(res.solution, plan) or res.solution.summary     # the plan's own placements
    ev = evaluate(summary, cfg, res.cluster, res.profile, res.budget_bytes, all_stages=True)
    return ev, summary, res.profile


def predict_memory(evaluation, summary, pp_rank: int, param_dtype: str, optimizer: str = "adamw",
                   profile=None) -> PredictedMemory:
    """Pipeline rank ``pp_rank``'s predicted peak and its categories: model states for
    ``param_dtype`` and ``optimizer`` (``cost.memory.state_bytes_per_param``), activations as the
    solver's evaluation has them, temporaries = the backward workspace
    (``cost.memory.backward_workspace_bytes``) plus the evaluation's recompute / ZeRO-3 gather
    buffers (at the run's parameter bytes), and the peak by ``cost.memory.step_peak_bytes``."""
    from autopar.cost.memory import (backward_workspace_bytes, model_state_bytes, reducer_transient_bytes,
                                     state_bytes_per_param, step_peak_bytes)
    from autopar.solver.runtime_profile import AUTOPAR_RUNTIME
    from autopar.solver.timing import ZERO3_PREFETCH_LAYERS, accumulates_full_grads, activation_bytes_per_layer, rank_parts

    profile = profile or AUTOPAR_RUNTIME           # what the evaluation was made with

    cfg = evaluation.config
    st = next(s for s in evaluation.stages if s.index == pp_rank)
    per = state_bytes_per_param(param_dtype, optimizer)
    classes = cfg.classes

    def states(numel: float) -> dict:
        return model_state_bytes(int(numel), cfg.dp, cfg.zero, param_bytes=per["params"], grad_bytes=per["grads"],
                                 optimizer_bytes_per_param=per["optimizer"], full_grads=accumulates_full_grads(cfg))

    total = states(st.param_numel)
    parts = rank_parts(summary, st.layers, st.has_pre, st.has_post)
    largest = max(p.max_out_bytes for p, _, _ in parts)
    gathered = 0.0               # ZeRO-3's gathered layers (the solver counts them at its param_bytes)
    if cfg.zero == 3 and "params" in classes:
        gathered = ZERO3_PREFETCH_LAYERS * summary.parts["block"].param_numel
    elif cfg.zero == 3 and cfg.dp > 1:
        gathered = ZERO3_PREFETCH_LAYERS * summary.parts["block"].param_numel * (1 - 1 / cfg.dp)
    workspace = (backward_workspace_bytes(largest) + st.memory.other_bytes - largest
                 + gathered * (per["params"] - profile.param_bytes))
    shared = summary.shared_param_numel if (st.has_pre or st.has_post) else 0.0
    pieces = []                  # backward order: head, layers, embedding
    if st.has_post:
        post = summary.parts["post"]
        pieces.append((post.saved_bytes, states(post.param_numel + shared)["grads"]))
        shared = 0.0
    blk = summary.parts["block"]
    grads = states(blk.param_numel)["grads"]
    if cfg.recompute == "partial":            # backward order: the later layers keep theirs, the first k recompute
        k = int(min(cfg.recompute_layers or 0, st.layers))
        pieces += [(activation_bytes_per_layer(blk, summary, "none"), grads)] * (st.layers - k)
        pieces += [(activation_bytes_per_layer(blk, summary, "full"), grads)] * k
    else:
        pieces += [(activation_bytes_per_layer(blk, summary, cfg.recompute), grads)] * st.layers
    if st.has_pre:
        pre = summary.parts["pre"]
        pieces.append((pre.saved_bytes, states(pre.param_numel + shared)["grads"]))
    if cfg.dp > 1 and cfg.zero in (0, 1):
        pieces = _bucketed(pieces)
    host, act_kept = 0.0, 1.0
    if classes:                  # ``cost/offload.py``, for the dtype and optimizer run
        from autopar.cost.memory import optimizer_moments
        from autopar.cost.offload import offload_memory, optimizer_rows

        per_mb = sum(a for a, _ in pieces)
        off = offload_memory(classes, rows=optimizer_rows(st.param_numel, cfg.dp, cfg.zero),
                             params_bytes=total["params"], grads_bytes=total["grads"],
                             optimizer_bytes=total["optimizer"], activations_bytes=st.inflight * per_mb,
                             resident_saved_bytes=largest, saved_bytes_per_microbatch=per_mb, inflight=st.inflight,
                             microbatches=cfg.m, moments=optimizer_moments(optimizer))
        host = off["host"]
        if "activations" in classes:   # on the host; the backward brings one node's back at a time, at
            act_kept = 0.0             # most the largest output (the log-probabilities at the loss)
            workspace += largest
        grad_kept = off["grads"] / total["grads"] if total["grads"] else 1.0   # grads offload: the buckets kept
        pieces = [(a * act_kept, g * grad_kept) for a, g in pieces]
        total = {"params": off["params"], "grads": off["grads"], "optimizer": off["optimizer"]}
    # the solver's other bytes hold its reducer transient at its gradient bytes: the run's instead
    from autopar.codegen.buckets import DEFAULT_BUCKET_BYTES

    solver_transient = reducer_transient_bytes(st.param_numel * profile.grad_bytes, cfg.dp, cfg.zero,
                                               DEFAULT_BUCKET_BYTES, st.memory.activations_bytes + st.memory.other_bytes)
    workspace -= solver_transient
    acts = st.inflight * sum(a for a, _ in pieces)
    workspace += reducer_transient_bytes(st.param_numel * per["grads"], cfg.dp, cfg.zero, DEFAULT_BUCKET_BYTES,
                                         acts + workspace)
    peak = step_peak_bytes(total["params"] + total["optimizer"], pieces, st.inflight, workspace,
                           grads_during_forward=st.inflight < cfg.m)
    cats = MemoryByCategory(int(total["params"]), int(total["grads"]), int(total["optimizer"]),
                            int(st.memory.activations_bytes * act_kept), int(workspace))
    return PredictedMemory(int(peak), cats, int(host))


def _bucketed(pieces: list) -> list:
    """ZeRO 0/1 over dp > 1: gradients live in bucket buffers (``runtime/reducer.py``), each
    allocated whole when its first gradient arrives. Buckets fill in backward order (the first up
    to ``DEFAULT_FIRST_BUCKET_BYTES``, the others ``DEFAULT_BUCKET_BYTES``, ``codegen/buckets.py``):
    each piece's gradient bytes become what is allocated when it runs."""
    from autopar.codegen.buckets import DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES

    left = sum(g for _, g in pieces)            # not yet allocated
    room, cap, out = 0.0, float(DEFAULT_FIRST_BUCKET_BYTES), []
    for a, g in pieces:
        alloc = 0.0
        while g > room and left > 0:            # a new bucket, allocated whole
            g -= room
            room = min(cap, left)
            alloc += room
            left -= room
            cap = float(DEFAULT_BUCKET_BYTES)
        room -= min(g, room)
        out.append((a, alloc))
    return out


def compare_ranks(plan, graph, measured: list[dict], param_dtype: str, optimizer: str = "adamw") -> list[RankMemory]:
    """Measured (``measure_step``'s ``StepMemory`` as a dict, one per global rank) next to the
    prediction for that rank's pipeline rank (global rank = pp rank x ranks per stage)."""
    ev, summary, profile = plan_evaluation(plan, graph)
    per_stage = plan.stage_mesh.size
    rows = []
    for rank, m in enumerate(measured):
        predicted = predict_memory(ev, summary, rank // per_stage, param_dtype, optimizer, profile)
        rows.append(RankMemory(rank, StepMemory.from_dict(m), predicted))
    return rows


def compare_model(plan, model: str, measured: list[dict], optimizer: str = "adamw", *,
                  batch: Optional[int] = None, seq_len: Optional[int] = None) -> list[RankMemory]:
    """``compare_ranks`` for a model given by name or spec (``autopar run`` / ``autopar profile``):
    traced on the meta device as planning traces it, predicted for its parameters' dtype."""
    from autopar.models import build_model
    from autopar.trace import trace_model

    b = build_model(model, batch=batch, seq_len=seq_len, device="meta")
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                        model_name=model)
    dtype = str(next(b.module.parameters()).dtype).removeprefix("torch.")
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
