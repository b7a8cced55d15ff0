"""``autoparallelize``: one call from an nn.Module to a model training on torch.distributed.

    pm = autopar.autoparallelize(model, example_inputs, loss_fn=lambda out, y: ..., example_target=y,
                                 optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4))
    loss = pm.step(inputs, targets)     # one optimizer step on one GLOBAL batch; loss on every rank
    out = pm(inputs)                    # forward only, full output on every rank
    pm.eval(); pm(inputs); pm.train()   # the mode of pm(inputs), as the module's (BatchNorm, dropout)
    (batches keep the example's shapes: the traced graph's shape literals are those of the example)
    pm.plan, pm.full_state_dict(), pm.collectives
    pm.save("ckpt/"); autoparallelize(..., resume="ckpt/")   # checkpoints any plan / world size loads

Every rank calls it with the same module (real weights: autopar shards them; meta device: each
rank generates only its shards, see ``runtime/init.py``) and the same global batches.

Without ``example_target`` (as with DDP / FSDP: a model, inputs and a loss), steps 3-6 run on the
first ``pm.step(inputs, targets)``, with that batch's targets, on every rank alike (``build.setup``
does 1-2 at once, ``build.build`` does 3-7 given a target; ``ParallelModel`` holds the pending build).

Random ops in the traced graph (dropout, rand, randn, bernoulli, ...) draw from each rank's own
generator, so their values differ from one process with the same seed: ``ParallelModel`` says so
once (``RandomOpsWarning``).

The flow (order matters where noted):
  1. join the world (or start a one-process one) with timeouts        runtime/world.py
  2. check --force degrees against the world size (before any work)
  3. trace the FULL graph with the loss                                 autopar.trace
  4. plan: the given Plan / file, or rank 0 solves and broadcasts       autopar/planning.py
  5. every rank: plan fits the world, all ranks agree (one all_gather)  runtime/world.py
  6. mesh (the plan's), program, parameters, reducer, optimizer        codegen/, runtime/
  7. the execution graph is traced at one micro-batch when the plan has several (the step runs
     them in turn, gradients accumulating); with pp > 1 it is cut into the plan's stages, this
     rank's run as torch.distributed.pipelining stages under the plan's schedule
     (codegen/stages.py, runtime/pipeline.py)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.build import IdleAxisWarning  # noqa: F401 (public: autopar.api.IdleAxisWarning)
from autopar.build import Built, OptimizerFactory, as_tuple, batch_rows, build, setup
from autopar.codegen.buckets import DEFAULT_BUCKET_BYTES
from autopar.codegen.edges import edge
from autopar.codegen.executor import GraphExecutor
from autopar.codegen.program import RankProgram, compile_program
from autopar.codegen.stages import cut_pipeline
from autopar.engine import decide, forward_modules, make_runner
from autopar.mesh import CONTEXT, DATA, PIPELINE
from autopar.plan import Plan
from autopar.api_state import TrainingStateAccess
from autopar.runtime.checkpoint import CheckpointInfo, Checkpoints
from autopar.runtime.collectives import Collective, CollectiveRecorder
from autopar.runtime.failures import peer_failures
from autopar.runtime.launch import report_progress
from autopar.runtime.pipeline import PipelineRunner, build_pipeline, forward_through_stages
from autopar.runtime.precision import DynamicLossScale
from autopar.solver.forcing import Force
from autopar.trace.random_ops import random_ops
from autopar.runtime.world import DEFAULT_TIMEOUT_S

log = logging.getLogger("autopar.runtime")


class RandomOpsWarning(UserWarning):
    """The traced graph has random ops: they draw from per-rank streams, not one process's."""


# what ``ParallelModel.close`` lets go: everything that holds the model's tensors
_HOLDS_TENSORS = ("store", "_optimizer", "reducer", "_model", "_buffers", "_train_graph", "_fused", "_forwards",
                  "_made", "_stage_executors", "_modules", "_train", "_pipeline", "offload", "_context",
                  "_recorder", "_checkpoints")


class ParallelModel(TrainingStateAccess):
    """A model running under a Plan on this rank. Build with ``autoparallelize``.

    ``build(target) -> Built`` makes the runtime parts (``autopar/build.py``); with ``example_target`` they are
    made now, else on the first ``step`` from its targets (collectively, every rank alike)."""

    def __init__(self, build: Callable[[torch.Tensor], "Built"], *, timeout_s: float,
                 example_target: Optional[torch.Tensor] = None, record_collectives: bool = True,
                 resume: Optional[str] = None) -> None:
        self.timeout_s = timeout_s
        self._resume = resume
        self.record_collectives = record_collectives
        self._pending: Optional[Callable[[torch.Tensor], Built]] = build
        self._random_warned = False
        if example_target is not None:
            self._install(example_target)

    def _install(self, target: torch.Tensor) -> None:
        parts = self._pending(target)
        self._pending = None
        self.plan = parts.plan
        self.mesh = mesh = parts.mesh
        self.program = parts.program
        self.store = parts.store
        self._optimizer = parts.optimizer
        self.reducer = parts.reducer
        self.device = parts.device
        self._model = parts.model
        self._buffers = parts.buffers
        self._log = parts.collective_log
        self._train_graph = parts.train_graph
        self._fused = parts.fused
        self._loss_scale = parts.loss_scale
        self.precision = parts.precision
        self._context = parts.context                 # cp > 1 (``codegen/context_run.py``)
        self.offload = parts.offload                  # ``runtime/offload.py``
        self.loss_scaler = DynamicLossScale() if parts.precision.loss_scaling else None
        self._forwards: dict[bool, tuple] = {}        # module.training -> (graph, executor)
        self._made: list[GraphExecutor] = []          # every executor, training's first
        self._stage_executors: dict = {}              # forward-only pipeline parts, by (graph, part)
        self.device_mesh = whole = parts.device_mesh   # the whole mesh; ``mesh`` is this rank's stage's
        self._recorder = CollectiveRecorder(self._log, {
            axis: tuple(dist.get_process_group_ranks(whole.get_group(axis))) for axis in whole.mesh_dim_names},
            named={parts.context.group.group_name: CONTEXT} if parts.context is not None else None)
        self._pipeline: Optional[PipelineRunner] = None
        # the engine (``autopar/engine.py``): decided from what every rank has alike, before any step
        self.engine, self.engine_reason, modules = decide(parts.engine, self._train_graph, self.program, parts.cut,
                                                          fused=parts.fused, device=self.device)
        self._modules: dict = {id(self._train_graph): modules}      # graph -> emitted module per part
        if parts.cut is None:
            self._train = self._executor(self._train_graph, self.program)
        else:                    # every rank alike: building the schedule makes process groups
            self._train = None
            self._pipeline = build_pipeline(
                plan=self.plan, cut=parts.cut, graph=self._train_graph, program=self.program,
                device_mesh=whole, stage_mesh=mesh, store=self.store,
                make_executor=lambda part, want: self._executor(self._train_graph, self.program, part, want),
                loss_scale=lambda: self._loss_scale * self._grad_scale(), device=self.device, log=self._log,
                timeout_s=self.timeout_s, reducer=self.reducer)
        self._pp_group = whole.get_group(PIPELINE) if PIPELINE in whole.mesh_dim_names else None
        self.steps_done = 0                           # optimizer steps taken (restored by load)
        self.resumed: Optional[CheckpointInfo] = None
        self._checkpoints = Checkpoints(self.timeout_s)
        if self._resume is not None:
            self.load(self._resume)

    def __getattr__(self, name: str):
        # only reached for attributes not set yet (those ``_install`` sets, before it ran) or let
        # go by ``close``
        if self.__dict__.get("_closed"):
            raise AttributeError(
                f"ParallelModel.{name}: the model was closed (pm.close() released its parameters, "
                "gradients and optimizer state); read what you need before closing it, or build a "
                "new one with autoparallelize")
        if self.__dict__.get("_pending") is not None:
            raise AttributeError(
                f"ParallelModel.{name} does not exist yet: autoparallelize was called without "
                "example_target, so the model is traced, planned and compiled on the first "
                "pm.step(inputs, targets) (on every rank); call it first, or pass example_target=")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- public --------------------------------------------------------------------------------
    @property
    def collectives(self) -> tuple[Collective, ...]:
        """Collectives this rank issued (DTensor's and autopar's own), oldest first."""
        return self._log.records

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's index along each mesh axis, by name (``{"pp": 1, "dp": 0, "tp": 1}``)."""
        return dict(zip(self.device_mesh.mesh_dim_names, self.device_mesh.get_coordinate()))

    def close(self) -> None:
        """Release what outlives a step, now: an NVMe offload's files (``runtime/offload.py``; also
        removed at exit) and the memory the model holds (parameters, gradients, optimizer state,
        the executors and their graphs). An FX graph is a reference cycle, which Python frees only
        on a later full collection: without one here, a second model built in the same process (a
        sweep, a benchmark) found the first one's 6.4 GB still allocated on an H200. Idempotent;
        the model cannot step after it (an error says so); its plan, engine, mesh, collectives and
        step count stay readable."""
        if self.__dict__.get("_closed"):
            return
        if self.__dict__.get("offload") is not None:
            self.offload.close()
        for name in _HOLDS_TENSORS:
            self.__dict__.pop(name, None)
        self.__dict__["_pending"] = None          # never built: it will not be now
        self.__dict__["_closed"] = True
        gc.collect()

    def __enter__(self) -> "ParallelModel":
        return self

    def __exit__(self, *exc) -> None:
        """``with autoparallelize(...) as pm:`` closes the model at the block's end, raised or not."""
        self.close()

    def reset_collectives(self) -> None:
        self._log.clear()

    def train(self, mode: bool = True) -> "ParallelModel":
        """Set the module's mode for ``pm(inputs)`` (as ``nn.Module.train``): BatchNorm uses batch
        statistics and updates its running ones, dropout drops. ``step`` always runs the graph
        traced at setup, in the mode the module had then."""
        self._built_model().train(mode)
        return self

    def eval(self) -> "ParallelModel":
        """``train(False)``: ``pm(inputs)`` with running statistics, no dropout."""
        return self.train(False)

    @property
    def fallbacks(self) -> frozenset[str]:
        """Op targets that ran on local tensors because DTensor has no rule for them."""
        return frozenset(t for ex in self._made for t in ex.fallbacks)

    @property
    def fused_kernels(self) -> tuple[tuple[str, str], ...]:
        """(node key, kernel name) of the nodes that ran through a fused Triton kernel (or its
        reference, see ``autoparallelize(kernels=...)``); filled as nodes run (after a step)."""
        seen: dict = {}
        for ex in self._made:
            for k, v in ex.fused_kernels:
                seen.setdefault(k, v)
        return tuple(seen.items())

    def step(self, inputs, targets) -> float:
        """One optimizer step on one global batch; returns the loss (same float on every rank).
        Without example_target, the first step also traces, plans and compiles (every rank)."""
        if self._pending is not None:
            with peer_failures("autoparallelize (setup, on the first step)", self.timeout_s):
                self._install(targets)
        with peer_failures("a training step", self.timeout_s):
            loss = self._step(inputs, targets)
        self.steps_done += 1
        report_progress(self.steps_done)          # a rank of runtime/launch.spawn_ranks: its progress
        return loss

    def _built_model(self) -> nn.Module:
        if self._pending is not None:
            raise RuntimeError("this ParallelModel is not built yet: autoparallelize was called without "
                               "example_target, so the model is traced, planned and compiled on the "
                               "first pm.step(inputs, targets); call pm.step first, or pass "
                               "example_target= to autoparallelize")
        return self._model

    @property
    def optimizer(self):
        """The optimizer (with offload, on the host masters, once an overlapped step has ended)."""
        if "_optimizer" not in self.__dict__:
            return self.__getattr__("optimizer")          # raises: not built yet, or closed
        self.settle()
        return self._optimizer

    @property
    def host_step(self) -> Optional[str]:
        """The offloaded optimizer's host step: "overlap", "sync", or None (no optimizer offload)."""
        host = self.offload.optimizer
        return None if host is None else ("overlap" if host.overlapped is not None else "sync")

    def settle(self) -> None:
        """Wait for an overlapped host step (``runtime/host_step.py``; parameter reads wait for it)."""
        host = self.offload.optimizer
        if host is not None:
            host.wait()

    def _step(self, inputs, targets) -> float:
        self.store.zero_grad()
        self.reducer.begin_step()
        if self.offload.optimizer is not None:        # an overlapped host step may still run
            self.offload.optimizer.zero_grad()
        else:
            self._optimizer.zero_grad(set_to_none=True)
        inputs = as_tuple(inputs)
        with self.precision.autocast(self.device.type), self.offload.saved_hooks(self.store):
            if self._pipeline is not None:
                self.reducer.arm(False)                   # each stage's last backward arms its own parameters
                self._log.phase = "pipeline"
                with self._recording():
                    loss = self._pipeline.step(self._folded_micro(inputs), self._folded_micro((targets,))[0])
            else:
                loss = self._micro_batches(inputs, targets)
        self._log.phase = "step"
        self.reducer.reduce()
        host = self.offload.optimizer
        if host is not None:                              # the rest of the gradients to the host
            host.take_rest()
        scale = self._grad_scale()
        if self.loss_scaler is None or self._unscaled():
            if host is None:
                self._optimizer.step()
            else:                                         # on the host; the new rows copied up (or
                host.step(self._optimizer.step)           # started, overlapping the next forward)
        if host is not None:
            host.end_step()
        self.reducer.gather_params()
        self.store.weights_changed()
        return float(loss) / scale

    def _grad_scale(self) -> float:
        """fp16's loss scale this step (1 otherwise)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def _unscaled(self) -> bool:
        """fp16: unscale this rank's gradients; whether every rank found them finite (else the step
        is skipped everywhere and the scale lowered, ``runtime/precision.py``)."""
        if self.offload.optimizer is not None:
            grads = self.offload.optimizer.grads()
        else:
            grads = [p.grad for g in self._optimizer.param_groups for p in g["params"] if p.grad is not None]
        stepped = self.loss_scaler.unscale_(grads)
        self.loss_scaler.update(stepped)
        return stepped

    def _micro_batches(self, inputs: tuple, targets) -> torch.Tensor:
        """Forward and backward of the plan's micro-batches in turn (gradients accumulate; the
        reducer's overlap is armed for the last one only, or for each one with ZeRO 2/3, see
        ``GradReducer.each_micro_batch``); the step's loss."""
        m = self.plan.num_micro_batches
        rows = batch_rows(inputs, targets)
        if rows % m:
            raise ValueError(f"the batch of {rows} rows does not split into the plan's {m} micro-batches; pass "
                             f"batches of the example's {self.plan.global_batch} rows")
        xs = list(zip(*(x.chunk(m) for x in inputs))) if m > 1 else [inputs]
        ys = targets.chunk(m) if m > 1 else [targets]
        if self._context is not None:              # each micro-batch's sequences in this rank's chunks
            xs = [self._folded(mb) for mb in xs]
            ys = [self._folded((y,))[0] for y in ys]
        total = torch.zeros(())
        for i, (x, y) in enumerate(zip(xs, ys)):
            last = i == m - 1
            self.reducer.arm(last or self.reducer.each_micro_batch, last)
            self._log.phase = "forward"
            with self._recording():
                outs = self._train.run(x, y)
                loss = self._user_output(self._train_graph, outs)
                loss_local = edge(loss, _replicate(loss)).to_local() * (self._loss_scale * self._grad_scale())
                self._log.phase = "backward"
                loss_local.backward()
            if not last:                           # ZeRO 2/3: this micro-batch's reduce-scatters
                self.reducer.end_micro_batch()
            total = total + loss_local.detach().to(total.dtype)
        return total

    @torch.no_grad()
    def __call__(self, inputs) -> torch.Tensor:
        """Forward only: the model's (primary) output, full, on every rank, in the module's mode
        (``pm.train()`` / ``pm.eval()``; BatchNorm in training mode updates its running statistics,
        as one process does)."""
        model = self._built_model()
        if self._pipeline is not None:
            return self._forward_pipeline(model, as_tuple(inputs))
        if model.training not in self._forwards:
            from autopar.trace import trace_model

            ex = tuple(x.to("cpu") if x.is_meta else x for x in self._folded(as_tuple(inputs)))
            if self.program.local_dp:
                ex = tuple(x[: x.shape[0] // self.program.mesh.size_of(DATA)] for x in ex)
            g = trace_model(model, ex, collapse_repeats=False, model_name=self.plan.model_name)
            keys = frozenset(n.key for n in self.program.nodes if n.dtensor) if self.program.local_dp else None
            self._forwards[model.training] = (g, self._executor(g, compile_program(g, self.plan, local_dp=keys)))
        graph, forward = self._forwards[model.training]
        self._log.phase = "forward"
        with self._recording():
            outs = forward.run(self._folded(as_tuple(inputs)), None)
            out = self._user_output(graph, outs)
            if not isinstance(out, DTensor):             # local-dp mode: this rank's batch rows
                rows = tuple(Shard(0) if a == DATA else Replicate() for a in self.mesh.mesh_dim_names)
                out = DTensor.from_local(out, self.mesh, rows, run_check=False)
            full = out.redistribute(out.device_mesh, _replicate(out)).to_local()
            return full if self._context is None else self._context.unfold(full)

    def _folded(self, inputs: tuple) -> tuple:
        """cp > 1: the inputs' sequences in this rank's chunks (``codegen/context_run.py``)."""
        return inputs if self._context is None else tuple(self._context.fold(x) for x in inputs)

    def _folded_micro(self, inputs: tuple) -> tuple:
        """``_folded`` per micro-batch, concatenated: the pipeline schedule's equal split along the
        rows then hands each stage one folded micro-batch."""
        m = self.plan.num_micro_batches
        if self._context is None:
            return inputs
        return tuple(torch.cat([self._context.fold(c) for c in x.chunk(m)]) for x in inputs)

    def _forward_pipeline(self, model: nn.Module, inputs: tuple) -> torch.Tensor:
        """``pm(inputs)`` with pp > 1: the forward graph cut into the plan's stages, run in order."""
        if model.training not in self._forwards:
            from autopar.trace import trace_model

            ex = tuple(x.to("cpu") if x.is_meta else x for x in self._folded(inputs))
            keys = None
            if self.program.local_dp:                # traced at this rank's rows, as the training graph
                ex = tuple(x[: x.shape[0] // self.program.mesh.size_of(DATA)] for x in ex)
                keys = frozenset(n.key for n in self.program.nodes if n.dtensor)
            g = trace_model(model, ex, collapse_repeats=False, model_name=self.plan.model_name)
            program = dataclasses.replace(compile_program(g, self.plan, local_dp=keys), params=self.program.params)
            self._forwards[model.training] = (g, program, cut_pipeline(g, self.plan))
        graph, program, cut = self._forwards[model.training]
        self._log.phase = "forward"
        with self._recording():
            out = forward_through_stages(
                plan=self.plan, cut=cut, graph=graph, program=program, device_mesh=self.device_mesh,
                stage_mesh=self.mesh, inputs=self._folded(inputs),
                make_executor=lambda part, want: self._stage_executor(graph, program, part, want, cut))
            return out if self._context is None else self._context.unfold(out)

    def _stage_executor(self, graph, program, part, want, cut) -> GraphExecutor:
        key = (id(graph), part)
        if key not in self._stage_executors:
            self._stage_executors[key] = self._executor(graph, program, part, want, cut)
        return self._stage_executors[key]

    # ---- internals -----------------------------------------------------------------------------
    def _recording(self):
        return self._recorder if self.record_collectives else contextlib.nullcontext()

    def _executor(self, graph, program: RankProgram, part: Optional[frozenset] = None,
                  want: tuple = (), cut=None):
        """The runner of ``part`` of ``graph``: its emitted module or a GraphExecutor (``engine.py``)."""
        self._warn_random_ops(graph)
        if id(graph) not in self._modules:    # a forward-only graph (pm(inputs)): emitted where covered
            self._modules[id(graph)] = forward_modules(self.engine, graph, program, cut, fused=self._fused,
                                                       device=self.device)
        ex = make_runner(self, graph, program, part, want, self._modules[id(graph)].pop(part, None))
        self._made.append(ex)
        return ex

    def _warn_random_ops(self, graph) -> None:
        """Once per ParallelModel: the graph has random ops, which differ from one process."""
        if self._random_warned:
            return
        found = random_ops(graph.exported.graph)
        if not found:
            return
        self._random_warned = True
        names = ", ".join(f"{t} x{n}" if n > 1 else t for t, n in sorted(found.items()))
        msg = (f"the model has random ops ({names}): each rank draws them from its own random "
               "stream, so their values (dropout masks, noise) differ from one process with the "
               "same seed and losses differ accordingly; for an exact comparison use "
               "dropout p=0 (or no random ops)")
        log.warning(msg)
        warnings.warn(msg, RandomOpsWarning, stacklevel=3)

    def _user_output(self, graph, outs: list):
        from torch.export.graph_signature import OutputKind

        specs = graph.exported.graph_signature.output_specs
        user = []
        for spec, value in zip(specs, outs):
            if spec.kind == OutputKind.BUFFER_MUTATION:
                name = next(n.param_name for n in graph.nodes if n.kind == "buffer" and n.param_name and
                            spec.target.endswith(n.param_name))
                with torch.no_grad():
                    self._buffers[name].copy_(value.full_tensor() if isinstance(value, DTensor) else value)
            elif spec.kind == OutputKind.USER_OUTPUT:
                user.append(value)
        if len(user) != 1:
            raise NotImplementedError(f"the graph has {len(user)} user outputs; autopar runs one (the loss)")
        return user[0]


def _replicate(t) -> tuple:
    return tuple(Replicate() for _ in t.placements)


def autoparallelize(model: nn.Module, example_inputs: Union[torch.Tensor, Sequence[torch.Tensor]], *,
                    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                    example_target: Optional[torch.Tensor] = None,
                    optimizer: Optional[OptimizerFactory] = None,
                    cluster: Any = None,
                    force: Union[str, dict, Force, None] = None,
                    plan: Union[Plan, str, None] = None,
                    seed: int = 0,
                    timeout_s: float = DEFAULT_TIMEOUT_S,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    model_name: str = "",
                    record_collectives: bool = True,
                    dp_mode: str = "auto",
                    kernels: str = "off",
                    resume: Optional[str] = None,
                    heartbeat_timeout_s: Optional[float] = 30.0,
                    dtype: Union[str, torch.dtype, None] = None,
                    nvme_dir: Optional[str] = None,
                    engine: str = "auto",
                    host_step: str = "auto") -> ParallelModel:
    """Plan (or take ``plan``) and compile ``model`` for the running world; see the module docstring.

    example_inputs / example_target: one GLOBAL batch (shapes fix the plan's batch and sequence).
        Without example_target the model is traced, planned and compiled on the first
        ``pm.step(inputs, targets)`` with its targets (every rank alike); ``pm(inputs)`` and
        ``pm.plan`` etc. need that first step.
    optimizer: ``params -> torch.optim.Optimizer`` (default ``autopar.optim.adamw``: torch AdamW, lr 3e-4, fused); it receives this rank's
        (sharded) parameters. One with a ``set_shard_groups`` method (``autopar.optim.LAMB``) is
        told the process groups each parameter's tensor is split over. cluster: None = the running world (CPU or the detected GPU), else a
        name or TOML path as in ``autopar plan --cluster``. force: as ``autopar plan --force``.
    plan: a Plan, or the path of ``autopar plan --json`` output (then nothing is solved).
    seed: autopar's deterministic init, used when the model is on the meta device.
    timeout_s: every process group's timeout (a dead or stuck rank fails the others in this time).
    heartbeat_timeout_s: under torchrun, a rank whose heartbeat stops this long (stopped, frozen,
        cut off) ends the job with a message naming it, well before ``timeout_s``
        (``runtime/watchdog.py``); None disables it. ``autopar run``'s launcher has its own.
    bucket_bytes: gradient bucket size of the data-parallel reducer.
    dp_mode: "auto" runs a tp == 1 plan whose dp axis only carries the batch on plain local-batch
        tensors (DTensor only for the loss: exact global semantics, DDP's speed); "dtensor" runs
        every op on DTensors over the plan's mesh.
    kernels: fused-kernel substitution (``codegen/fused.py``): "auto" runs the Triton kernels of
        ``autopar/kernels/`` in place of the aten ops and multi-node regions they replace exactly
        (layer_norm, gelu, attention, cross-entropy, residual add + norm, hand-written RMSNorm,
        RoPE, SwiGLU, ...; ``codegen/patterns.py``) on CUDA and nothing on the CPU; "on" substitutes on any device (Triton
        on CUDA or under TRITON_INTERPRET=1, else the plain-torch references: tests); "off" never.
        ``pm.fused_kernels`` lists the substituted nodes. Default "off": the substitution is tested
        against aten on CPU ranks through Triton's interpreter, but has not yet run on a GPU.
    resume: a directory ``pm.save`` wrote: its last checkpoint is loaded once the model is built
        (parameters, optimizer state, buffers, step count, RNG), resharded from whatever plan and
        world size saved it; ``pm.resumed`` says what was restored and ``pm.resumed.extra`` holds
        the saved ``extra``.
    dtype: the compute dtype, "bf16", "fp16" or "fp32" (default: the plan's, else the parameters').
        Lower than fp32 parameters it is mixed precision (``runtime/precision.py``): forward and
        backward under ``torch.autocast``, fp32 master weights, gradients reduced in ``dtype``, and
        for fp16 a dynamic loss scale common to every rank (an overflow anywhere skips the step
        everywhere; ``pm.loss_scaler``). ``pm.precision`` says what runs.
    nvme_dir: a directory on a fast local disk, for a plan with an NVMe tier (``offload`` with ``nvme``,
        ``nvme_params``, ``nvme_grads`` or ``nvme_activations``; ``runtime/offload.py``): each rank
        keeps its files in its own subdirectories, removed at exit.
    engine: what runs the graph (``autopar/engine.py``): "emitted" the generated ``fx.GraphModule``
        per stage (``codegen/emit.py``), "interpreter" the ``GraphExecutor``, "auto" (default) the
        emitted modules where they cover the plan, else the interpreter; ``pm.engine`` and
        ``pm.engine_reason`` say which and why. "emitted" on a plan they do not cover raises.
    host_step: with the optimizer offloaded, "overlap" steps it on a thread, chunk by chunk, beside
        the next forward (``runtime/host_step.py``: the same arithmetic), "sync" before ``pm.step``
        returns, "auto" (default) overlaps on GPUs where nothing communicates beside it (as the
        planner prices it); "overlap" where it cannot raises, naming why.
    record_collectives: log DTensor's collectives into ``pm.collectives`` (a dispatch mode around
        forward and backward: a few microseconds per op; autopar's own reducer/ZeRO collectives are
        always logged).
    """
    with peer_failures("autoparallelize (setup)", timeout_s):
        checked = setup(model, example_inputs, loss_fn, optimizer, cluster, force, plan, seed, timeout_s,
                        bucket_bytes, model_name, dp_mode, kernels, heartbeat_timeout_s, dtype, nvme_dir, engine,
                        host_step)
        return ParallelModel(functools.partial(build, checked), timeout_s=timeout_s,
                             example_target=example_target, record_collectives=record_collectives,
                             resume=resume)
