"""Steps 1-7 of ``autoparallelize`` (``autopar/api.py``'s docstring): ``setup`` checks the arguments,
joins the world and checks ``force``; ``build`` traces, plans (or takes the plan), and compiles one
rank's runtime parts (``Built``) for a target. ``ParallelModel`` runs them."""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import warnings
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from autopar.codegen.context_run import ContextRun
from autopar.codegen.fused import FusedKernels, fused_kernels
from autopar.codegen.program import RankProgram, compile_program, local_dp_nodes
from autopar.codegen.stages import PipelineCut, cut_pipeline, loss_reduction
from autopar.mesh import DATA, PIPELINE
from autopar.optim import adamw as autopar_adamw
from autopar.plan import Plan, parse_offload
from autopar.planning import solve_on_rank0
from autopar.runtime.buffers import module_buffers
from autopar.runtime.collectives import CollectiveLog
from autopar.runtime.host_memory import give_back_freed_host_memory
from autopar.runtime.host_step import HOST_STEPS, NVME_CHUNK_BYTES
from autopar.runtime.nvme_rows import RowsToFiles
from autopar.runtime.init import init_rules
from autopar.runtime.offload import Offload, make_offload
from autopar.runtime.params import ParamStore
from autopar.runtime.pipeline import local_stages
from autopar.runtime.precision import Precision, dtype_name, parse_dtype, precision_for
from autopar.runtime.reducer import GradReducer
from autopar.runtime.world import (PlanMismatchError, build_mesh, check_agreement, context_group, init_world,
                                   runtime_mesh, start_watchdog, world_size_message)
from autopar.solver.forcing import Force, check_world, parse_force
from autopar.trace.errors import TraceError

log = logging.getLogger("autopar.runtime")

OptimizerFactory = Callable[[list], torch.optim.Optimizer]


def _caller_level() -> int:
    """``warnings.warn``'s stacklevel, from the function that calls this one, of the first frame
    outside the autopar package: the user's ``autoparallelize`` (or first ``step``) line, however
    deep the build ran."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(pkg + os.sep):
        frame, level = frame.f_back, level + 1
    return level


class IdleAxisWarning(UserWarning):
    """A mesh axis of size > 1 that the plan splits nothing on (e.g. a forced tp on a model too
    small to gain from it): its ranks compute the same thing."""


def as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def batch_rows(inputs: tuple, target: torch.Tensor) -> int:
    """The batch size (leading dim) every input and the target share."""
    rows = {x.shape[0] for x in inputs if x.dim()} | ({target.shape[0]} if target.dim() else set())
    if len(rows) != 1:
        raise ValueError(f"the inputs and the target disagree on the batch size (leading dims {sorted(rows)}); "
                         "give every input and the target the same leading (batch) dim")
    return rows.pop()


@dataclasses.dataclass(frozen=True)
class Setup:
    """autoparallelize's checked arguments, in the joined world: all but the target."""
    model: nn.Module
    inputs: tuple
    loss_fn: Callable
    optimizer: OptimizerFactory
    cluster: Any
    force: Force
    plan: Union[Plan, str, None]
    seed: int
    timeout_s: float
    bucket_bytes: int
    model_name: str
    dp_mode: str
    kernels: str
    fused: Optional[FusedKernels]
    device_type: str
    device: torch.device
    rank: int
    world: int
    watchdog: Any = None          # runtime/watchdog.Watchdog, under torchrun
    dtype: Optional[torch.dtype] = None   # the compute dtype asked for (None: the plan's / the parameters')
    nvme_dir: Optional[str] = None        # where an NVMe-offloading plan keeps its files
    engine: str = "auto"                  # "auto" | "emitted" | "interpreter" (``autopar/engine.py``)
    host_step: str = "auto"               # "auto" | "overlap" | "sync" (``runtime/host_step.py``)


def setup(model, example_inputs, loss_fn, optimizer, cluster, force, plan, seed, timeout_s, bucket_bytes,
           model_name, dp_mode, kernels, heartbeat_timeout_s: Optional[float] = None, dtype=None,
           nvme_dir: Optional[str] = None, engine: str = "auto", host_step: str = "auto") -> Setup:
    """Steps 1-2 of the module docstring: check the arguments, join the world, check --force."""
    from autopar.engine import ENGINES

    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: choose one of {', '.join(repr(e) for e in ENGINES)}")
    if host_step not in HOST_STEPS:
        raise ValueError(f"host_step={host_step!r}: choose one of {', '.join(repr(h) for h in HOST_STEPS)}")
    if dp_mode not in ("auto", "dtensor"):
        raise ValueError(f"dp_mode={dp_mode!r}: choose 'auto' or 'dtensor'")
    if kernels not in ("auto", "on", "off"):
        raise ValueError(f"kernels={kernels!r}: choose 'auto', 'on' or 'off'")
    dtype = parse_dtype(dtype) if dtype is not None else None
    meta = is_meta(model)
    device_type = "cuda" if torch.cuda.is_available() and (meta or next(model.parameters()).is_cuda) else "cpu"
    if heartbeat_timeout_s is not None and not heartbeat_timeout_s > 0:
        raise ValueError(f"heartbeat_timeout_s={heartbeat_timeout_s!r}: give a positive number of seconds, or None")
    rank, world = init_world(timeout_s, device_type)
    watchdog = start_watchdog(heartbeat_timeout_s)
    fused = fused_kernels(kernels, device_type)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    force_ = parse_force(force)
    check_world(force_, world)
    return Setup(model, as_tuple(example_inputs), loss_fn,
                  optimizer or autopar_adamw, cluster, force_, plan,
                  seed, timeout_s, bucket_bytes, model_name, dp_mode, kernels, fused, device_type, device, rank,
                  world, watchdog, dtype, nvme_dir, engine, host_step)


@dataclasses.dataclass(frozen=True)
class Built:
    """What ``build`` makes for one target: the parts a ParallelModel runs."""
    model: nn.Module
    plan: Plan
    train_graph: Any
    mesh: Any
    program: RankProgram
    store: ParamStore
    optimizer: torch.optim.Optimizer
    reducer: GradReducer
    buffers: dict
    collective_log: CollectiveLog
    device: torch.device
    fused: Optional[FusedKernels]
    device_mesh: Any = None            # the whole mesh (pipeline axis included); ``mesh`` is a stage's
    cut: Optional[PipelineCut] = None  # pp > 1: which nodes each stage runs
    loss_scale: float = 1.0            # each micro-batch's loss times this (1/m for a mean loss)
    precision: Precision = Precision(torch.float32, torch.float32)
    context: Optional[ContextRun] = None   # cp > 1: this rank's chunk of every sequence
    offload: Offload = dataclasses.field(default_factory=lambda: Offload(()))   # ``runtime/offload.py``
    engine: str = "auto"               # the engine asked for (``autopar/engine.py``)


def build(s: Setup, example_target: torch.Tensor) -> Built:
    """Steps 3-6 of the module docstring for one global batch's target: ParallelModel's parts."""
    from autopar.trace import trace_model

    if not isinstance(example_target, torch.Tensor):
        raise TypeError(f"the target must be a tensor, got {type(example_target).__name__}")
    model, inputs, loss_fn, model_name = s.model, s.inputs, s.loss_fn, s.model_name
    graph = trace_model(model, inputs, loss_fn=loss_fn, example_target=example_target,
                        collapse_repeats=False, model_name=model_name)
    if s.plan is None:
        plan_ = solve_on_rank0(model, inputs, loss_fn, example_target, s.cluster, s.force, s.device_type,
                                model_name, dtype_name(s.dtype) if s.dtype is not None else None)
    else:
        plan_ = Plan.load(s.plan) if isinstance(s.plan, str) else s.plan
        if s.dtype is not None and parse_dtype(plan_.dtype) != s.dtype:
            raise PlanMismatchError(f"the plan was made for {plan_.dtype} compute, but dtype={dtype_name(s.dtype)} "
                                    "was asked for: re-plan with that dtype, or leave dtype out to run the plan's")
    precision = precision_for(plan_.dtype, next(model.parameters()).dtype)
    if precision.compute == torch.float16 and "nvme_grads" in parse_offload(plan_.offload):
        raise ValueError("offload nvme_grads keeps the gradients in files, where fp16's loss scaling cannot "
                         "check them for overflow before the step: use --dtype bf16, or drop nvme_grads from "
                         "the offload classes")
    whole = runtime_mesh(plan_)
    if whole.size != s.world:
        raise PlanMismatchError(world_size_message(plan_.mesh, s.world))
    check_agreement(plan_, graph.fingerprint)                 # raises on every rank alike
    device_mesh = build_mesh(whole, s.device_type, s.timeout_s)
    context = _context(plan_, s)
    if context is not None:                   # the graph runs on the folded batch (``context_run.py``)
        inputs, example_target = tuple(context.fold(x) for x in inputs), context.fold(example_target)
    stage = plan_.stage_mesh
    mesh = device_mesh[tuple(stage.axes)] if plan_.pp > 1 else device_mesh
    dp, m = stage.size_of(DATA), plan_.num_micro_batches
    local_keys = local_dp_nodes(graph, plan_, single=plan_.pp > 1) if s.dp_mode == "auto" else None
    local_dp = local_keys is not None
    loss_scale = 1.0
    if m > 1:
        loss_scale = 1.0 / m if loss_reduction(graph) == "mean" else 1.0
    rows = batch_rows(inputs, example_target)
    split = m * (dp if local_dp else 1)      # the traced graph's batch: a micro-batch (this rank's, local-dp)
    if split > 1 or context is not None:
        if rows % split:
            raise PlanMismatchError(f"the batch of {rows} rows does not split into {m} micro-batches"
                                    + (f" of {dp} data-parallel shards" if local_dp else "")
                                    + "; re-plan for this batch")
        n = rows // split
        try:
            graph = trace_model(model, tuple(x[:n] for x in inputs), loss_fn=loss_fn,
                                example_target=example_target[:n], collapse_repeats=False, model_name=model_name)
        except TraceError as e:
            if context is None:
                raise
            raise _chunk_trace_error(e, context) from e
    program = compile_program(graph, plan_, local_dp=local_keys)
    cut = None
    if plan_.pp > 1:
        cut = cut_pipeline(graph, plan_)
        pp_rank = device_mesh.get_local_rank(PIPELINE)
        mine = local_stages(pp_rank, plan_.pp, len(cut.stages), plan_.pipeline_schedule)
        needed = cut.params_of(graph, mine)
        program = dataclasses.replace(program, params=tuple(p for p in program.params if p.name in needed))
    clog = CollectiveLog()
    classes = parse_offload(plan_.offload)
    if classes:                  # what the plan's host budget holds, freed back (``runtime/host_memory.py``)
        give_back_freed_host_memory()
    host_params = "params" in classes
    # ZeRO-Infinity's parameter tier: each rank's rows go to the files as they are made, never all in
    # host memory (``runtime/nvme_rows.RowsToFiles``)
    rows_sink = RowsToFiles(s.nvme_dir, s.rank, NVME_CHUNK_BYTES) if (
        {"optimizer", "nvme", "nvme_params"} <= set(classes) and host_params and plan_.zero_stage == 3 and s.nvme_dir) \
        else None
    if is_meta(model):
        store = ParamStore.from_init(program.params, mesh, plan_.zero_stage, clog, s.device, model,
                                     init_rules(model), s.seed, local_dp, host_params, sink=rows_sink)
    else:
        store = ParamStore.from_module(program.params, mesh, plan_.zero_stage, clog, s.device, model, local_dp,
                                       host_params, sink=rows_sink)
    buffers = module_buffers(model, s.device)
    offload = make_offload(plan_.offload, store, s.optimizer, s.device, nvme_dir=s.nvme_dir, rank=s.rank,
                           host_step=s.host_step, rows_in_files=rows_sink)
    opt = offload.optimizer.optimizer if offload.optimizer is not None else s.optimizer(store.optimizer_params())
    if hasattr(opt, "set_shard_groups"):          # per-tensor norms over shards (optim.LAMB)
        opt.set_shard_groups(store.shard_groups())
    reducer = GradReducer(store, s.bucket_bytes, reduce_dtype=precision.reduce_dtype, pipelined=cut is not None)
    if offload.optimizer is not None:
        offload.optimizer.attach(reducer)
    if s.rank == 0:
        from autopar.report import idle_axis_notes

        for note in idle_axis_notes(plan_):
            warnings.warn(note, IdleAxisWarning, stacklevel=_caller_level())
    log.info("rank %d: plan %s zero=%d recompute=%s sp=%s", s.rank, whole.describe(),
             plan_.zero_stage, plan_.recompute, plan_.sequence_parallel)
    return Built(model=model, plan=plan_, train_graph=graph, mesh=mesh, program=program, store=store,
                  optimizer=opt, reducer=reducer, buffers=buffers, collective_log=clog, device=s.device,
                  fused=s.fused, device_mesh=device_mesh, cut=cut, loss_scale=loss_scale,
                  precision=precision, context=context, offload=offload, engine=s.engine)


def _chunk_trace_error(e: TraceError, context: ContextRun) -> TraceError:
    """The model traced on the whole sequence but not on a cp rank's chunk of it (``context_run``)."""
    first = str(e).splitlines()[0].split(": ", 1)[-1]        # less "could not trace <model>: "
    return TraceError(
        f"context parallelism (cp={context.n}) runs the model on {context.local_len} of each sequence's "
        f"{context.seq_len} tokens per rank, and forward() fails at that length: {first}",
        source=e.source,
        hint="a tensor sized to the whole sequence (a positional table or mask added whole) cannot follow the "
             "chunks. Derive positions from torch.arange(T), or index the table with position ids "
             "(`table[torch.arange(T)]`, an nn.Embedding of them): autopar gives each rank its chunk's global "
             "positions there. Or plan with cp=1.")


def _context(plan: Plan, s: Setup) -> Optional[ContextRun]:
    """cp > 1: this rank's cp group, coordinate and chunk positions (every rank creates the groups)."""
    if plan.context_parallel == 1:
        return None
    group, coord = context_group(plan, s.timeout_s)
    return ContextRun.make(group, coord, plan.context_parallel, plan.context_parallel_mode, plan.seq_len,
                           plan.dp, s.device)

