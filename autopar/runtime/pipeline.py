"""Pipeline execution on ``torch.distributed.pipelining``: the plan's stages as ``PipelineStage``s,
its schedule, its micro-batches.

A stage is a ``StageModule``: an ``nn.Module`` whose ``forward`` takes what the previous stage sent
(the model inputs on stage 0), runs that stage's share of the traced graph (``codegen/stages.py``)
through a ``GraphExecutor`` on the stage's (dp, tp, ...) mesh, and returns the values the next stage
needs as plain local tensors. Between stages a value travels as this rank's shard of it: every
pipeline group links ranks of equal (dp, tp, ...) coordinates, so shards line up, and each side
knows the placement from the plan (``wire_placements``: the plan's output placement, Replicate
where the plan leaves it to DTensor or the value is Partial). The target reaches only the schedule's
``loss_fn``, which runs the loss part of the graph on the last stage.

Gradients: the schedule runs forward and backward of each micro-batch; parameters accumulate their
gradient summands over micro-batches in this rank's ``ParamStore``; the loss of each micro-batch
is divided by the number of micro-batches (the traced loss is a mean over its micro-batch, so the
sum of the scaled losses is the mean over the step's batch: gradients equal one process's on the
whole batch). Each stage's last backward of the step (its last weight pass under a zero-bubble
schedule) runs inside the gradient reducer's ``last_backward`` scope: the parameters only that
stage reads start their buckets' data-parallel reduction as they complete, beside the backwards
still to run (``runtime/reducer.py``). After the schedule: parameters two stages share (tied
embeddings) have their gradients summed over the ranks holding them, then the reduction of what is
left and the optimizer step run as without a pipeline.

Schedules: the plan's ``pipeline_schedule`` name -> torch's class (``SCHEDULES``, the plan's
``EXECUTED_SCHEDULES``). The zero-bubble ones (``interleaved_zb``, ``zbv``, ``dualpipev``) split each
micro-batch's backward into an input pass (B: the gradient sent to the previous stage) and a later
weight pass (W). torch finds the split through ``submod.parameters()``: a ``StageModule`` yields the
``ParamStore`` leaves its graph part reads (``ParamSlot.local``, each behind a ``_UseParam`` node),
so B (torch's ``stage_backward_input``) runs only the nodes between the stage's outputs and inputs
and saves the gradient at each node where a parameter's branch joins them; W (``_weight_pass``,
torch's ``stage_backward_weight`` adapted) runs from those gradients down the parameters' branches,
``_UseParam.backward`` included: each parameter gets the same summand as in one backward (ZeRO-3:
into ``full_grad``, the leaf gets none), accumulated over micro-batches, and runs the parameter's
post-accumulate-grad hooks as autograd would (the reducer's). Stage 0 runs one full
backward in its W slot (torch: its inputs need no gradient). A node where a parameter joins runs in
both passes, each computing its own gradients, and a recompute region (``torch.utils.checkpoint``)
is replayed once per pass (each autograd call recomputes): exact, but its collectives would run
twice, so a zero-bubble schedule with recompute and tp, cp or ZeRO-3 gathers is refused
(``plan.split_backward_problem``, at build time on every rank; the solver does not plan it).

Stages are declared with static metadata (``input_args`` / ``output_args`` and their gradients, as
this rank's shard shapes): torch's dynamic inference would run each stage once more on the first
micro-batch, which updates BatchNorm statistics twice and costs a forward.
"""
from __future__ import annotations

import collections
import contextlib
import functools
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.codegen.shards import local_ranges
from autopar.codegen.stages import wire_placements
from autopar.placements import to_torch
from autopar.plan import ZERO_BUBBLE_SCHEDULES, split_backward_problem, stage_rank
from autopar.runtime.collectives import collective_range

# plan.EXECUTED_SCHEDULES -> torch's class (tests/runtime/test_pipeline.py checks they agree)
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


class Wire:
    """DTensor <-> the local tensor sent between stages, for one boundary value. ``plain``: the
    stage runs on plain tensors (local-dp mode: ``shape`` is already this rank's) and the value
    crosses as it is."""

    def __init__(self, mesh, placements: tuple, shape: tuple[int, ...], dtype: torch.dtype,
                 plain: bool = False) -> None:
        self.mesh = mesh
        self.plain = plain
        self.placements = tuple(to_torch(p) for p in placements)
        self.shape = torch.Size(shape)
        self.stride = tuple(torch.empty(shape, device="meta").stride())
        local = shape if plain else tuple(
            b - a for a, b in local_ranges(shape, placements, tuple(mesh.shape), tuple(mesh.get_coordinate())))
        # what torch's PipelineStage is told it sends / receives (static metadata: no inference run)
        self.example = torch.empty(local, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

    def send(self, v) -> torch.Tensor:
        """This rank's piece of ``v``, contiguous (a point-to-point send takes only a contiguous
        buffer; a stage may end in a view such as ``movedim``)."""
        if v.dtype != self.example.dtype:      # autocast: a low-precision value sent at the traced dtype
            v = v.to(self.example.dtype)
        if self.plain and not isinstance(v, DTensor):
            return v.contiguous()
        if not isinstance(v, DTensor):
            raise TypeError(f"a stage boundary value is {type(v).__name__}, expected a DTensor")
        if tuple(v.placements) != self.placements:
            v = v.redistribute(self.mesh, self.placements)
        return v.to_local().contiguous()

    def recv(self, local: torch.Tensor):
        if self.plain:
            return local
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)


class StageModule(nn.Module):
    """One pipeline stage: ``forward(*received) -> tuple(sent)``; see the module docstring.

    ``run(inputs, seed) -> list`` runs the stage's graph part: ``inputs`` are the model inputs
    (stage 0; empty elsewhere), ``seed`` maps received node names to DTensors; it returns the
    values of ``send`` in order. ``wires[name]`` (a ``Wire``) converts a boundary value."""

    def __init__(self, index: int, run: Callable[[Sequence, dict], list], recv: Sequence[str],
                 send: Sequence[str], wires: dict, last: int,
                 on_send: Optional[Callable[[int, str], None]] = None, leaves: Sequence = (),
                 split_backward: bool = False) -> None:
        super().__init__()
        self._leaves = tuple(leaves)
        self._split_backward = split_backward    # a zero-bubble schedule: input and weight passes
        self.index = index
        self._last = last                 # the last stage's index: its ``send`` goes to the loss, not P2P
        self._run = run
        self.recv = tuple(recv)
        self.send = tuple(send)
        self._wires = wires
        self._on_send = on_send

    def forward(self, *args):
        if self.recv:
            # each received activation's gradient goes back by a point-to-point send, which takes
            # only a contiguous buffer: the stage's first op may be a view (``movedim``), whose
            # input gradient is a permuted view (``_ContiguousGrad``; a fresh view forward: torch
            # reuses its receive buffers from step to step, and the byte count hooks on it)
            args = tuple(_ContiguousGrad.apply(a) if a.requires_grad else a for a in args)
            if self._on_send is not None:
                for a in args:
                    if a.requires_grad:
                        a.register_hook(self._sent_back)
            seed = {name: self._wires[name].recv(a) for name, a in zip(self.recv, args)}
            outs = self._run((), seed)
        else:
            outs = self._run(args, {})
        sent = tuple(self._wires[name].send(v) for name, v in zip(self.send, outs))
        if self._split_backward:     # its input pass detaches the outputs in place, which a view refuses
            sent = tuple(_NotView.apply(t) if t._is_view() else t for t in sent)
        if self._on_send is not None and self.index < self._last:
            self._on_send(sum(t.numel() * t.element_size() for t in sent), "forward")
        return sent

    def parameters(self, recurse: bool = True):
        """The ``ParamStore`` leaves this stage's graph part reads (the loss part's too on the last
        stage): what torch's zero-bubble schedules split the backward over. Not registered as
        ``nn.Parameter``s of the module (torch's ``submod.to(device)`` would move host-held ZeRO-3
        rows)."""
        return iter(self._leaves)

    def _sent_back(self, grad: torch.Tensor) -> None:
        self._on_send(grad.numel() * grad.element_size(), "backward")


class _ContiguousGrad(torch.autograd.Function):
    """``t`` (a fresh view of it) whose gradient comes back contiguous."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


class _NotView(torch.autograd.Function):
    """``t`` as a tensor that is not a view, without a copy (same storage); gradient unchanged."""

    @staticmethod
    def forward(ctx, t):
        return t.detach()

    @staticmethod
    def backward(ctx, g):
        return g


def _weight_pass(weights: Sequence[torch.Tensor], param_groups: list) -> None:
    """torch's ``stage_backward_weight`` (``pipelining/_backward.py``: the weight gradients of one
    micro-batch from the gradients its input pass saved at the nodes where a parameter's branch
    joins the input's), with two changes: a parameter whose gradient leaves no ``.grad`` is allowed
    (ZeRO-3 over dp: ``_UseParam.backward`` adds it to ``ParamSlot.full_grad`` and returns None),
    and the first gradient of a step is copied rather than kept (it may share memory with a gradient
    autograd passed on elsewhere, the next micro-batch accumulates into it in place). As autograd's
    ``AccumulateGrad`` does, each update runs the parameter's post-accumulate-grad hooks: the
    reducer's moves the gradient into its bucket view (ZeRO 0/1 over dp), so the weight passes'
    gradients are not kept beside the buckets the full backwards (stage 0's) allocate."""
    from torch.autograd.graph import GradientEdge
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

    by_node = {_get_grad_fn_or_grad_acc(w): w for w in weights}
    for group in param_groups:
        edges, grads = [], []
        if group.get("grads") is None:            # no gradient reached the group in the input pass
            group["grads"] = [()] * len(group["intermediates"])
        for saved, node in zip(group["grads"], group["intermediates"]):
            for i, g in enumerate(saved):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        handles = []
        try:
            if len(group["intermediates"]) > 1:           # as torch: no double count through descendants
                for saved, node in zip(group["grads"], group["intermediates"]):
                    handles.append(node.register_prehook(lambda _, sg=saved: sg))
            del group["intermediates"]
            if not edges:
                continue
            nodes = tuple(group["params"])
            dws = torch.autograd.grad(edges, tuple(GradientEdge(n, 0) for n in nodes), grad_outputs=grads,
                                      allow_unused=True)
            del group["grads"]
            for node, dw in zip(nodes, dws):
                if dw is None:
                    continue
                w = by_node[node]
                if w.grad is None:
                    w.grad = dw.clone(memory_format=torch.contiguous_format)
                else:
                    w.grad += dw
                for hook in tuple((w._post_accumulate_grad_hooks or {}).values()):
                    hook(w)
        finally:
            for h in handles:
                h.remove()


@functools.lru_cache(maxsize=None)
def _stage_class():
    """torch's ``PipelineStage`` with ``_weight_pass`` as its weight pass, running the stage's
    last backward (or weight pass) of the step inside ``last_backward()`` (a context manager: the
    gradient reducer's, which launches the stage's buckets as they fill)."""
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        def __init__(self, *args, last_backward: Callable = contextlib.nullcontext, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._last_backward = last_backward

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
            with self._last_backward() if last_backward else contextlib.nullcontext():
                if backward_type == "weight":
                    _weight_pass(tuple(self.submod.parameters()), bwd_kwargs["param_groups"])
                    return (), None
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    return Stage


def make_schedule(name: str, stages: list, n_microbatches: int, loss_fn: Callable):
    """torch's schedule object for the plan's schedule ``name`` over this rank's ``stages``
    (``PipelineStage``s). Gradient scaling is autopar's (``loss_fn`` divides), not torch's."""
    from torch.distributed.pipelining import schedules

    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    cls = getattr(schedules, SCHEDULES[name])
    if issubclass(cls, schedules.PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"schedule {name!r} runs one stage per rank; this rank holds {len(stages)}")
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def local_stages(pp_rank: int, pp: int, n_stages: int, schedule: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs (``plan.stage_rank``'s layout)."""
    return [s for s in range(n_stages) if stage_rank(schedule, pp, s) == pp_rank]


def tied_groups(params_by_stage: dict[int, frozenset[str]], pp: int, schedule: str) -> dict[str, tuple[int, ...]]:
    """Parameter name -> the pipeline ranks (sorted) that hold it, for parameters on more than one."""
    holders: dict[str, set[int]] = {}
    for stage, names in params_by_stage.items():
        for n in names:
            holders.setdefault(n, set()).add(stage_rank(schedule, pp, stage))
    return {n: tuple(sorted(r)) for n, r in holders.items() if len(r) > 1}


class PipelineRunner:
    """This rank's share of a pipelined step: its stages under the plan's schedule, the loss part
    on the last stage, tied-parameter gradient sums. Built by ``build_pipeline``."""

    def __init__(self, schedule, holds_first: bool, holds_last: bool, pp_group, last_pp_rank: int,
                 tied: list, store, log, buffer_owner: dict[str, int]) -> None:
        self.schedule = schedule
        self.holds_first = holds_first
        self.holds_last = holds_last
        self.pp_group = pp_group
        self.last_pp_rank = last_pp_rank          # global rank of this pipeline's last stage
        self.tied = tied                          # [(process group, [slot names])]
        self.store = store
        self.log = log
        self.buffer_owner = buffer_owner          # buffer name -> the pipeline rank whose stage updates it

    def step(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the step's loss (0-dim, on every rank
        of the pipeline). Gradients are left summed in the parameter store."""
        import torch.distributed as dist

        losses: list = []
        kwargs = {"target": targets, "losses": losses} if self.holds_last else {}
        # the losses are collected by loss_fn; torch would otherwise keep every micro-batch's output
        # (the logits) until the step ends, memory the plan does not have
        self.schedule.step(*(inputs if self.holds_first else ()), **kwargs, return_outputs=False)
        loss = (torch.stack([x.detach() for x in losses]).sum() if self.holds_last
                else torch.zeros((), dtype=torch.float32))
        loss = loss.to(torch.float32).reshape(())
        nbytes = loss.numel() * loss.element_size()
        with collective_range("broadcast", "pp", nbytes):
            dist.broadcast(loss, src=self.last_pp_rank, group=self.pp_group)
        self.log.add("broadcast", "pp", nbytes, "pipeline")
        self._sum_tied_grads()
        return loss

    def _sum_tied_grads(self) -> None:
        """A parameter held by two pipeline ranks (tied embedding and head) gets the sum of both
        gradients on both, as one module would (Megatron's embedding group)."""
        import torch.distributed as dist

        by_name = self.store.by_name
        for group, names in self.tied:
            for name in names:
                s = by_name[name]
                zero3 = self.store.ctx.gathers            # the summand is in full_grad
                g = s.full_grad if zero3 else s.local.grad
                if g is None:
                    g = torch.zeros(s.layout.local_shape, dtype=s.local.dtype,
                                    device=self.store.ctx.device or s.local.device)
                nbytes = g.numel() * g.element_size()
                with collective_range("all_reduce", "pp", nbytes):
                    dist.all_reduce(g, group=group)
                self.log.add("all_reduce", "pp", nbytes, "tied")
                if zero3:
                    s.full_grad = g
                else:
                    s.local.grad = g


def build_pipeline(*, plan, cut, graph, program, device_mesh, stage_mesh, store, make_executor,
                   loss_scale: Callable[[], float], device, log, timeout_s: float,
                   reducer=None) -> PipelineRunner:
    """The stages of ``cut`` this rank runs (``plan.pipeline_schedule``'s layout) as
    ``PipelineStage``s under the schedule; ``make_executor(part, want)`` runs a part of
    ``graph``; ``loss_scale()`` multiplies each micro-batch's loss (1/m for a mean, times fp16's
    loss scale); ``reducer`` (a ``GradReducer``): each stage's last backward reduces the parameters
    only it reads (``GradReducer.last_backward``)."""
    import datetime

    import torch.distributed as dist
    from autopar.mesh import PIPELINE

    PipelineStage = _stage_class()
    pp, schedule = plan.pp, plan.pipeline_schedule
    why = split_backward_problem(schedule, plan.recompute, plan.tp, plan.context_parallel, plan.dp,
                                 plan.zero_stage, plan.offload)
    if why:                                # every rank alike, before any process group is made
        raise ValueError(why)
    n_stages = len(cut.stages)
    pp_rank = device_mesh.get_local_rank(PIPELINE)
    pp_group = device_mesh.get_group(PIPELINE)
    pp_ranks = dist.get_process_group_ranks(pp_group)
    mine = local_stages(pp_rank, pp, n_stages, schedule)
    metas = {n.name: n.out for n in graph.nodes if n.outputs}
    wire = _wires(graph, program, stage_mesh)

    def example(name: str) -> torch.Tensor:               # a model input: the whole micro-batch
        meta = metas[name]
        return torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device="meta")

    def on_send(nbytes: int, phase: str) -> None:
        log.add("send", PIPELINE, nbytes, "p2p", phase)

    params_by_stage = {s: cut.params_of(graph, [s]) for s in range(n_stages)}
    readers = collections.Counter(n for names in params_by_stage.values() for n in names)

    def last_backward(s: int) -> Callable:
        """Stage ``s``'s scope for its last backward: its parameters no other stage reads."""
        if reducer is None:
            return contextlib.nullcontext
        own = frozenset(reducer.index_of[n] for n in params_by_stage[s] if readers[n] == 1 and n in reducer.index_of)
        return functools.partial(reducer.last_backward, own)

    stages = []
    loss_ex = make_executor(frozenset(cut.loss), (cut.loss_output,)) if n_stages - 1 in mine else None
    for s in mine:
        sc = cut.stages[s]
        ex = make_executor(frozenset(sc.nodes), sc.send)
        wires = {name: wire(name) for name in sc.recv + sc.send}
        module = StageModule(s, lambda inputs, seed, ex=ex: ex.run(inputs, None, seed), sc.recv, sc.send,
                             wires, n_stages - 1, on_send,
                             leaves=[store.by_name[n].local for n in sorted(cut.params_of(graph, [s]))
                                     if n in store.by_name], split_backward=schedule in ZERO_BUBBLE_SCHEDULES)
        # static metadata (input_args / output_args): torch's dynamic inference would run the stage
        # once more on the first micro-batch, updating BatchNorm statistics a second time
        ins = tuple(wires[n].example for n in sc.recv) if s else tuple(example(n) for n in cut.inputs)
        outs = tuple(wires[n].example for n in sc.send)
        stages.append(PipelineStage(module, s, n_stages, device, input_args=ins, output_args=outs,
                                    input_grads=ins if s else None, output_grads=outs if s < n_stages - 1 else None,
                                    group=pp_group, last_backward=last_backward(s)))
    last_wires = {name: wire(name) for name in cut.stages[-1].send}

    def loss_fn(output, target):
        from torch.distributed.tensor import Replicate as TReplicate

        output = output if isinstance(output, tuple) else (output,)
        seed = {name: last_wires[name].recv(t) for name, t in zip(cut.stages[-1].send, output)}
        (loss,) = loss_ex.run((), target, seed)
        if isinstance(loss, DTensor):
            loss = loss.redistribute(loss.device_mesh, tuple(TReplicate() for _ in loss.placements)).to_local()
        return loss * loss_scale()

    sched = make_schedule(schedule, stages, plan.num_micro_batches, loss_fn)
    # tied parameters: one group per set of pipeline ranks holding a parameter, made by every rank
    # in the same order (a new_group requirement), for every pipeline (each dp/tp coordinate)
    tied_sets = tied_groups(params_by_stage, pp, schedule)
    tied = []
    timeout = datetime.timedelta(seconds=timeout_s)
    me = dist.get_rank()
    for holders in sorted(set(tied_sets.values())):
        names = sorted(n for n, h in tied_sets.items() if h == holders and n in store.by_name)
        for group_ranks in plan.mesh.groups(PIPELINE):      # the DeviceMesh's layout (build_mesh)
            ranks = [group_ranks[h] for h in holders]
            g = dist.new_group(ranks=ranks, timeout=timeout)
            if me in ranks:
                tied.append((g, names))
    last_rank = pp_ranks[stage_rank(schedule, pp, n_stages - 1)]
    # a buffer's value is the one of the first stage that reads it (a stage that mutates it, BatchNorm)
    owner: dict[str, int] = {}
    parts = [frozenset(sc.nodes) for sc in cut.stages]
    for n in graph.nodes:
        if n.kind == "buffer" and n.param_name is not None:
            readers = [s for s in range(n_stages) if n.name in parts[s]]
            if readers:
                owner.setdefault(n.param_name, stage_rank(schedule, pp, readers[0]))
    return PipelineRunner(sched, 0 in mine, n_stages - 1 in mine, pp_group, last_rank, tied, store, log,
                          owner)


def _wires(graph, program, stage_mesh) -> Callable[[str], Wire]:
    """``wire(name)``: the ``Wire`` of a boundary value of ``graph`` under ``program``."""
    metas = {n.name: n.out for n in graph.nodes if n.outputs}
    plans = {n.name: n for n in program.nodes}

    def wire(name: str) -> Wire:
        meta, p = metas[name], plans[name]
        return Wire(stage_mesh, wire_placements(p.output, stage_mesh.ndim), meta.shape, getattr(torch, meta.dtype),
                    plain=program.local_dp and not p.dtensor)
    return wire


@torch.no_grad()
def forward_through_stages(*, plan, cut, graph, program, device_mesh, stage_mesh, make_executor,
                           inputs: tuple) -> torch.Tensor:
    """Forward only (``pm(inputs)``): the stages of ``cut`` (a forward-only graph) one after another,
    each rank running its own and passing the boundary values on with plain point-to-point sends;
    the model output, full, on every rank of the pipeline."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate as TReplicate, Shard as TShard

    from autopar.mesh import DATA, PIPELINE

    pp, schedule = plan.pp, plan.pipeline_schedule
    pp_group = device_mesh.get_group(PIPELINE)
    pp_ranks = dist.get_process_group_ranks(pp_group)
    me = device_mesh.get_local_rank(PIPELINE)
    metas = {n.name: n.out for n in graph.nodes if n.outputs}
    wire = _wires(graph, program, stage_mesh)
    carried: list = []                              # what the previous stage sent, as local tensors
    result = None
    for sc in cut.stages:
        holder = stage_rank(schedule, pp, sc.index)
        prev = stage_rank(schedule, pp, sc.index - 1) if sc.index else None
        if holder == me:
            wires = {n: wire(n) for n in sc.recv + sc.send}
            if sc.index and prev != me:
                carried = [torch.empty(wires[n].example.shape, dtype=wires[n].example.dtype) for n in sc.recv]
                for t in carried:
                    dist.recv(t, src=pp_ranks[prev], group=pp_group)
            ex = make_executor(frozenset(sc.nodes), sc.send)
            seed = {n: wires[n].recv(t) for n, t in zip(sc.recv, carried)}
            outs = ex.run(inputs if sc.index == 0 else (), None, seed)
            carried = [wires[n].send(v) for n, v in zip(sc.send, outs)]
            nxt = stage_rank(schedule, pp, sc.index + 1) if sc.index + 1 < len(cut.stages) else None
            if nxt is not None and nxt != me:
                for t in carried:
                    dist.send(t.contiguous(), dst=pp_ranks[nxt], group=pp_group)
            if nxt is None:
                (value,) = outs
                if not isinstance(value, DTensor):    # plain: this rank's batch rows
                    value = DTensor.from_local(value, stage_mesh, tuple(
                        TShard(0) if a == DATA else TReplicate() for a in stage_mesh.mesh_dim_names), run_check=False)
                result = value.redistribute(value.device_mesh, tuple(TReplicate() for _ in value.placements)).to_local()
    meta = metas[cut.loss_output]
    shape = list(meta.shape)
    if program.local_dp and shape:                  # traced at this rank's rows: the full batch
        shape[0] *= program.mesh.size_of(DATA)
    out = result if result is not None else torch.empty(shape, dtype=getattr(torch, meta.dtype))
    dist.broadcast(out, src=pp_ranks[stage_rank(schedule, pp, len(cut.stages) - 1)], group=pp_group)
    return out
