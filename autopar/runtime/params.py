"""Parameters on the ranks: storage, use as DTensors, ZeRO sharding, full state dicts.

How data parallelism and ZeRO are realized (the design in one place):

- The graph runs on DTensors over the plan's mesh. Below, dp is its DATA axis and tp its
  tensor axes (``autopar.mesh.TENSOR_AXES``: "tp", and "tp2"/"tp3" of 2-D/3-D tensor parallelism;
  looked up by name in the DeviceMesh, a missing one has size 1; any other axis holds parameters
  Replicate). The "tp-local" tensor is the part of the full tensor a rank's coordinates on all
  tensor axes select (``ParamPlan.storage``, nested in mesh order as DTensor does). Activations
  carry the batch as Shard(0) on dp, so
  every shape literal baked into the exported graph stays global and any loss reduction is exact
  (a mean over the batch is Partial on dp, then reduced).
- A parameter is stored as a PLAIN tensor: its tp-local shard (the plan's storage), full over
  dp for ZeRO 0-2, only this dp rank's rows of it for ZeRO-3 (``codegen/buckets.py`` chunking).
- Each graph scope that reads a parameter calls ``_UseParam``: forward wraps the tp-local tensor as
  a DTensor (its storage placement on each tensor axis, Replicate elsewhere) (ZeRO-3: all-gathers
  the rows over dp first); backward receives the gradient DTensor, brings its placement on every
  tensor axis back to the storage placement (e.g. a
  layer-norm weight under sequence parallelism gets a Partial-on-tp gradient: all-reduce on tp)
  and keeps it Partial on dp -- the per-rank summand. DTensor thus never reduces over dp; the
  ``GradReducer`` does, bucketed: all-reduce (ZeRO 0/1) or reduce-scatter into row chunks (ZeRO
  2/3). A gradient that arrives Replicate on dp (the parameter only met replicated data) is
  divided by dp so the bucketed sum stays exact.
- The optimizer (the user's factory) gets: ZeRO-0 the tp-local parameters; ZeRO-1/2 views of this
  rank's rows of them (optimizer state sharded; after the step the rows are all-gathered back,
  bucketed); ZeRO-3 the row shards themselves (nothing to gather after the step).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from autopar.codegen.buckets import ParamLayout
from autopar.codegen.program import ParamPlan
from autopar.codegen.shards import chunk_range, contiguous_stride, local_ranges, slice_of
from autopar.mesh import DATA, TENSOR, axis_position, tensor_axes
from autopar.placements import Shard, to_torch
from autopar.runtime.collectives import CollectiveLog, collective_range
from autopar.runtime.init import InitRule, generate
from autopar.runtime.regather import Regather


@dataclass
class ParamSlot:
    """One parameter on this rank (mutable runtime holder)."""
    plan: ParamPlan
    layout: ParamLayout            # tp-local shape
    tp_ranges: tuple               # ranges of the full tensor this rank's tensor coordinates select
    rows: tuple[int, int]          # this dp rank's rows of the tp-local tensor (ZeRO chunks)
    local: nn.Parameter            # ZeRO 0-2: the tp-local tensor; ZeRO-3: its rows ``rows``
    opt_param: nn.Parameter        # what the optimizer updates
    full_grad: Optional[torch.Tensor] = None   # ZeRO-3: the tp-local gradient summand of this step
    # ZeRO-3 (dp > 1): graph scopes that read this parameter in the current micro-batch's forward
    # whose ``_UseParam.backward`` has not run yet; 0 after one did = its summand is complete
    open_scopes: int = 0
    # optimizer offload (``runtime/offload.py``): the fp32 master of ``opt_param`` on the host,
    # which the optimizer steps instead
    host: Optional[nn.Parameter] = None
    host_grad: Optional[torch.Tensor] = None   # ... and this step's reduced gradient of it, on the host
    # ZeRO-3 with parameter offload: the reduced gradient of ``opt_param`` (in host memory, so the
    # device tensor cannot be its ``.grad``) until the offload copies it down
    reduced: Optional[torch.Tensor] = None

    def give_grad(self, g: torch.Tensor, accumulate: bool = False) -> None:
        """``g`` is ``opt_param``'s reduced gradient of this step (``accumulate``: of one of its
        micro-batches, added to the ones before)."""
        on_device = g.device == self.opt_param.device
        held = self.opt_param.grad if on_device else self.reduced
        if accumulate and held is not None:
            held.add_(g)
        elif on_device:
            self.opt_param.grad = g
        else:
            self.reduced = g

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def stepped(self) -> nn.Parameter:
        """The tensor the optimizer steps (its state is keyed by it): the host master when the
        optimizer is offloaded, else ``opt_param``."""
        return self.host if self.host is not None else self.opt_param


def mesh_axis(mesh, role: str) -> Optional[int]:
    """Position of the axis named ``role`` in a DeviceMesh (None: it has no such axis)."""
    return axis_position(mesh.mesh_dim_names, role)


@dataclass
class ParamContext:
    """What ``_UseParam`` needs at forward and backward time."""
    mesh: object
    dp: int
    zero_stage: int
    log: CollectiveLog
    dp_group: object               # the DATA axis' group (None: the mesh has no DATA axis)
    storage: dict = field(default_factory=dict)   # name -> torch placements per mesh axis (DATA: Replicate)
    local_dp: bool = False         # plain tensors (local-dp mode), no DTensor
    data_axis: Optional[int] = None     # positions of the DATA and TENSOR axes in ``mesh``
    tensor_axis: Optional[int] = None
    tp: int = 1                    # the TENSOR axis' size
    tp_group: object = None        # its group, when tp > 1
    tensor_groups: dict = field(default_factory=dict)   # every tensor axis of size > 1 -> its group
    reshard: Any = None            # ZeRO-3 with dp > 1: runtime/reshard.Reshard (gathered weights not kept)
    regather: Any = None           # runtime/regather.Regather (gathered activations kept as shards), over reshard
    on_full_grad: Any = None       # ZeRO-3 with dp > 1: called with the slot after each scope's summand
                                   # (the reducer's overlap: ``GradReducer._on_full_grad``)
    device: Any = None             # where the graph runs (torch.device)
    host_params: bool = False      # ZeRO-3 with parameter offload: the rows live in host memory
    groups: Any = None             # ZeRO-3 with gathers: runtime/prefetch.GroupGathers (gathers by group)
    nvme_rows: Any = None          # offload nvme_params: runtime/nvme_rows.NvmeRows (the rows in files)
    grad_files: Any = None         # offload nvme_grads: runtime/nvme_grads.NvmeGrads (host gradients in files)
    host_step: Any = None          # an overlapped host step: runtime/host_step.OverlappedStep (reads wait for it)

    @property
    def gathers(self) -> bool:
        """Whether each use fetches the parameter (ZeRO-3 over dp > 1, or rows in host memory):
        its gradient then goes to ``ParamSlot.full_grad``, not to the stored tensor."""
        return self.zero_stage == 3 and (self.dp > 1 or self.host_params)

    def placements(self, name: str, on_dp=None) -> tuple:
        """Torch placements of parameter ``name`` per mesh axis: its storage placement on each
        tensor axis, ``on_dp`` (default Replicate) on dp, Replicate on any other axis."""
        out = self.storage[name]
        if self.data_axis is not None and on_dp is not None:
            out = out[:self.data_axis] + (on_dp,) + out[self.data_axis + 1:]
        return out


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def on_device(chunk: torch.Tensor, ctx: ParamContext) -> torch.Tensor:
    """``chunk`` where the graph runs (rows in host memory, parameter offload, are copied up)."""
    if ctx.host_params or (ctx.device is not None and chunk.device != ctx.device):
        chunk = torch.empty(chunk.shape, dtype=chunk.dtype, device=ctx.device).copy_(chunk, non_blocking=True)
    return chunk


def stored_rows(slot: ParamSlot, ctx: ParamContext) -> torch.Tensor:
    """This rank's stored rows of ``slot``: the parameter, or with the rows on NVMe (offload
    nvme_params, ``runtime/nvme_rows.py``) read from its file."""
    return ctx.nvme_rows.rows(slot) if ctx.nvme_rows is not None else slot.local.detach()


def chunk_numel(slot: ParamSlot, dp: int) -> int:
    """Elements of the equal (padded) row chunk every dp rank holds of ``slot``."""
    return slot.layout.chunk_rows(dp) * slot.layout.row_numel


def padded_rows(slot: ParamSlot, chunk: torch.Tensor, dp: int) -> torch.Tensor:
    """This rank's row chunk of ``slot``, flat, padded to the equal chunk every dp rank sends."""
    size = chunk_numel(slot, dp)
    send = chunk.reshape(-1)
    if send.numel() != size:
        padded = torch.zeros(size, dtype=chunk.dtype, device=chunk.device)
        padded[: send.numel()] = send
        send = padded
    return send.contiguous()


def unpadded(slot: ParamSlot, gathered: torch.Tensor) -> torch.Tensor:
    """The tp-local tensor of ``slot`` from its gathered, padded dp chunks (flat, rank order)."""
    return gathered[: slot.layout.numel].view(slot.layout.local_shape)


def gather_rows(slot: ParamSlot, chunk: torch.Tensor, ctx: ParamContext, record: bool = True) -> torch.Tensor:
    """All-gather the dp row chunks of ``slot`` into its tp-local tensor (ZeRO-3); rows in host
    memory (parameter offload) are copied up first."""
    chunk = on_device(chunk, ctx)
    if ctx.dp == 1:
        return chunk.view(slot.layout.local_shape)
    send = padded_rows(slot, chunk, ctx.dp)
    out = torch.empty(ctx.dp * send.numel(), dtype=chunk.dtype, device=chunk.device)
    nbytes = out.numel() * out.element_size()
    with collective_range("all_gather", DATA, nbytes):
        dist.all_gather_single(out, send, group=ctx.dp_group)
    if record:
        ctx.log.add("all_gather", DATA, nbytes, "zero")
    return unpadded(slot, out)


def resident_source(local: torch.Tensor, pctx: ParamContext) -> Optional[torch.Tensor]:
    """What a use of a parameter is made of when it is the stored tensor itself (not gathered, not
    copied up from the host: ``pctx.gathers`` covers both), for ``runtime/offload.py``: a
    low-precision copy autocast made of the use is recast from it in the backward instead of sent
    to the host and back. Kept on the use's autograd node (``ctx.resident``); None otherwise."""
    return None if pctx.gathers else local


class _UseParam(torch.autograd.Function):
    """Stored parameter -> DTensor (its storage placement on each tensor axis, Replicate elsewhere);
    see the module docstring."""

    @staticmethod
    def forward(ctx, local, slot: ParamSlot, pctx: ParamContext, gathered=None):
        from torch.distributed.tensor import DTensor

        ctx.slot, ctx.pctx = slot, pctx
        ctx.resident = resident_source(local, pctx)
        if gathered is not None:                 # by its group (``runtime/prefetch.py``)
            full = gathered
        else:
            full = gather_rows(slot, stored_rows(slot, pctx), pctx) if pctx.gathers else local.view_as(local)
        if pctx.reshard is not None:
            pctx.reshard.register(slot, full)
        return DTensor.from_local(full, pctx.mesh, pctx.placements(slot.name),
                                  run_check=False, shape=torch.Size(slot.plan.shape),
                                  stride=contiguous_stride(slot.plan.shape))

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import Partial as TPartial, Replicate as TReplicate

        slot, pctx = ctx.slot, ctx.pctx
        dp_pl = grad.placements[pctx.data_axis] if pctx.data_axis is not None else TReplicate()
        keep_partial = isinstance(dp_pl, TPartial) and dp_pl.reduce_op in ("sum", "avg")
        want = pctx.placements(slot.name, dp_pl if keep_partial else None)
        if tuple(grad.placements) != want:
            grad = grad.redistribute(grad.device_mesh, want)
        g = grad.to_local()
        if pctx.dp > 1 and (not keep_partial or dp_pl.reduce_op == "avg"):
            g = g / pctx.dp          # the reducer sums over dp
        g = g.contiguous()
        if pctx.gathers:
            _add_summand(slot, pctx, g)
            return None, None, None, None
        return g, None, None, None


def _add_summand(slot: ParamSlot, pctx: ParamContext, g: torch.Tensor) -> None:
    """ZeRO-3 (dp > 1): one scope's gradient of ``slot`` is added to its summand of this step
    (the reducer reduce-scatters it); the scope is closed and the reducer told."""
    pctx.reshard.release(slot)
    slot.full_grad = g if slot.full_grad is None else slot.full_grad + g
    slot.open_scopes -= 1
    if pctx.on_full_grad is not None:
        pctx.on_full_grad(slot)


def _in_backward() -> bool:
    """Whether an autograd backward is running on this thread (a recompute region's replay)."""
    return torch._C._current_graph_task_id() != -1


class _UseParamLocal(torch.autograd.Function):
    """Local-dp mode (tp == 1): the stored parameter as a plain tensor; ZeRO-3 gathers its rows.
    Its gradient is this rank's summand (the loss is the global one, computed under DTensor)."""

    @staticmethod
    def forward(ctx, local, slot: ParamSlot, pctx: ParamContext, gathered=None):
        ctx.slot, ctx.pctx = slot, pctx
        ctx.resident = resident_source(local, pctx)
        if pctx.gathers:
            full = gathered if gathered is not None else gather_rows(slot, stored_rows(slot, pctx), pctx)
            pctx.reshard.register(slot, full)
            return full
        return local.view_as(local)

    @staticmethod
    def backward(ctx, g):
        slot, pctx = ctx.slot, ctx.pctx
        g = g.contiguous()
        if pctx.gathers:
            _add_summand(slot, pctx, g)
            return None, None, None, None
        return g, None, None, None


class ParamStore:
    """All parameters of one rank. Build with ``from_module`` (real weights, every rank passes the
    same module) or ``from_init`` (meta module: rows generated by ``runtime.init``)."""

    def __init__(self, slots: list[ParamSlot], ctx: ParamContext, aliases: dict[str, str]) -> None:
        self.slots = slots
        self.by_name = {s.name: s for s in slots}
        self.ctx = ctx
        self.aliases = aliases        # every parameter name of the module -> canonical name

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def build(cls, plans, mesh, zero_stage: int, log: CollectiveLog, device, aliases: dict[str, str],
              values, local_dp: bool = False, host_params: bool = False,
              sink: Optional[Callable] = None) -> "ParamStore":
        """``values(plan, row_runs, col_ranges) -> tensor``: rows (runs of [start, end) along dim 0,
        concatenated) and columns of the full tensor (any device). ``host_params`` (ZeRO-3): the
        rows are kept in host memory (pinned on a GPU) and copied up at each use. ``sink``: given
        each slot as it is made (``nvme_rows.RowsToFiles``: its rows to the NVMe tier at once)."""
        if host_params and zero_stage != 3:
            raise ValueError(f"parameter offload needs ZeRO-3 (the plan has zero_stage {zero_stage})")
        di, ti = mesh_axis(mesh, DATA), mesh_axis(mesh, TENSOR)
        coord, sizes = tuple(mesh.get_coordinate()), tuple(mesh.shape)
        dp, dp_rank = (sizes[di], coord[di]) if di is not None else (1, 0)
        tp, tp_rank = (sizes[ti], coord[ti]) if ti is not None else (1, 0)
        axes = tuple(mesh.mesh_dim_names)
        ctx = ParamContext(mesh=mesh, dp=dp, zero_stage=zero_stage, log=log,
                           dp_group=mesh.get_group(DATA) if di is not None else None, local_dp=local_dp,
                           data_axis=di, tensor_axis=ti, tp=tp,
                           tp_group=mesh.get_group(TENSOR) if tp > 1 else None,
                           tensor_groups={a: mesh.get_group(a) for a in tensor_axes(axes)
                                          if sizes[axes.index(a)] > 1},
                           device=torch.device(device), host_params=host_params)
        if ctx.gathers:
            from autopar.runtime.reshard import Reshard

            ctx.reshard = Reshard(lambda slot: gather_rows(slot, stored_rows(slot, ctx), ctx))
        ctx.regather = Regather(inner=ctx.reshard)
        slots = []
        for p in plans:
            storage = p.placements(axes)
            ctx.storage[p.name] = tuple(to_torch(q) for q in storage)
            tp_ranges = local_ranges(p.shape, storage, sizes, coord)
            rows = held_rows(p, tp_ranges, tp, tp_rank)
            layout = ParamLayout(p.name, ((len(rows),) + tuple(b - a for a, b in tp_ranges[1:]))
                                 if p.shape else (), p.dtype)
            mine = layout.row_range(dp, dp_rank) if zero_stage >= 1 else (0, layout.rows)
            if not p.shape:
                t = values(p, None, ())
                if zero_stage == 3:
                    t = t.reshape(1)[mine[0]:mine[1]]
            else:
                stored = rows[mine[0]:mine[1]] if zero_stage == 3 else rows
                t = values(p, row_runs(stored), tuple(tp_ranges[1:]))
            if host_params:
                stored_t = torch.empty(t.shape, dtype=_dtype(p.dtype), pin_memory=torch.device(device).type == "cuda")
                stored_t.copy_(t)
            else:
                stored_t = t.to(device=device, dtype=_dtype(p.dtype)).detach().clone().contiguous()
            local = nn.Parameter(stored_t, requires_grad=True)
            if zero_stage in (1, 2):
                opt = nn.Parameter(local.data.view(layout.rows, layout.row_numel)[mine[0]:mine[1]],
                                   requires_grad=True)
            else:
                opt = local
            slots.append(ParamSlot(p, layout, tp_ranges, mine, local, opt))
            if sink is not None:
                sink(slots[-1])
        if ctx.gathers:
            from autopar.runtime.prefetch import GroupGathers

            ctx.groups = GroupGathers(slots, ctx)
            ctx.reshard.groups = ctx.groups
        return cls(slots, ctx, aliases)

    @classmethod
    def from_module(cls, plans, mesh, zero_stage, log, device, model: nn.Module,
                    local_dp: bool = False, host_params: bool = False, sink: Optional[Callable] = None) -> "ParamStore":
        full = dict(model.named_parameters())
        aliases = _aliases(model)

        def values(p: ParamPlan, runs, cols):
            t = full[p.name].detach()
            if not t.dim():
                return t
            return torch.cat([slice_of(t, ((a, b),) + tuple(cols)) for a, b in runs])
        return cls.build(plans, mesh, zero_stage, log, device, aliases, values, local_dp, host_params, sink)

    @classmethod
    def from_init(cls, plans, mesh, zero_stage, log, device, model: nn.Module, rules: dict[str, InitRule],
                  seed: int, local_dp: bool = False, host_params: bool = False,
                  sink: Optional[Callable] = None) -> "ParamStore":
        aliases = _aliases(model)

        def values(p: ParamPlan, runs, cols):
            if not p.shape:
                return generate(p.name, rules[p.name], p.shape, None, seed, dtype=_dtype(p.dtype))
            return torch.cat([generate(p.name, rules[p.name], p.shape, ((a, b),) + tuple(cols), seed,
                                       dtype=_dtype(p.dtype)) for a, b in runs])
        return cls.build(plans, mesh, zero_stage, log, device, aliases, values, local_dp, host_params, sink)

    # ---- training ----------------------------------------------------------------------------
    def use(self, name: str):
        slot = self.by_name[self.aliases.get(name, name)]
        ctx = self.ctx
        if ctx.host_step is not None:       # its rows stepped on the host (``runtime/host_step.py``)
            ctx.host_step.ready(slot.name)
        if ctx.gathers and torch.is_grad_enabled() and not _in_backward():
            # a scope whose backward will add to the summand (``_add_summand``). A recompute
            # region's replay runs inside the backward and is not one: non-reentrant checkpoint
            # backpropagates through the forward's nodes, the replay only refills their saved tensors
            slot.open_scopes += 1
        gathered = None
        if ctx.groups is not None:          # a recompute region's replay (in backward): no prefetch
            gathered = ctx.groups.take(slot, prefetch=not _in_backward())
        fn = _UseParamLocal if ctx.local_dp else _UseParam
        return fn.apply(slot.local, slot, ctx, gathered)

    def optimizer_params(self) -> list[nn.Parameter]:
        return [s.stepped for s in self.slots]

    def shard_groups(self) -> dict[nn.Parameter, tuple]:
        """Per optimizer parameter, the process groups whose ranks hold the rest of its tensor:
        each tensor axis where its storage placement is a Shard, dp under ZeRO 1-3 (the optimizer
        sees rows). An optimizer with per-tensor norms (``autopar.optim.LAMB``) all-reduces them
        over these."""
        ctx = self.ctx
        out = {}
        for s in self.slots:
            groups = [g for a, g in ctx.tensor_groups.items() if isinstance(s.plan.on(a), Shard)]
            if ctx.zero_stage >= 1 and ctx.dp > 1:
                groups.append(ctx.dp_group)
            out[s.stepped] = tuple(groups)
        return out

    @property
    def regather(self):
        """What an edge registers a gathered value with when its consumer saves it
        (``runtime/regather.py``); its hooks chain ZeRO-3's ``Reshard``."""
        return self.ctx.regather

    def saved_hooks(self):
        """The context a step's forward and backward run in: gathered activations kept as shards
        (``runtime/regather.py``) and ZeRO-3's reshard after forward (``runtime/reshard.py``)."""
        return self.ctx.regather.hooks()

    def zero_grad(self) -> None:
        """Drop every gradient of the last step. ZeRO 0/1 with dp > 1: ``.grad`` is a view of a
        bucket buffer of the reducer's, which dropping its last views frees (the next backward
        allocates the step's own: gradients start each step unallocated, as the plan counts)."""
        if self.ctx.grad_files is not None:
            self.ctx.grad_files.forget()
        for s in self.slots:
            s.local.grad = None
            s.opt_param.grad = None
            s.full_grad = None
            s.host_grad = None
            s.reduced = None
            s.open_scopes = 0
        self.weights_changed()

    def weights_changed(self) -> None:
        """The rows may have changed (a step's start and end): gathered tensors not read yet are
        dropped (``runtime/prefetch.py``)."""
        if self.ctx.groups is not None:
            self.ctx.groups.invalidate()

    # ---- full tensors (collective: every rank calls) -------------------------------------------
    def full_tensor(self, slot: ParamSlot, which: str = "param") -> torch.Tensor:
        ctx = self.ctx
        if which == "param":
            t = stored_rows(slot, ctx)
            if ctx.gathers:
                t = gather_rows(slot, t, ctx, record=False)
        else:
            t = self._tp_local_grad(slot)
        return self._full_of_tp_local(slot, t)

    def full_of_opt(self, slot: ParamSlot, t: torch.Tensor) -> torch.Tensor:
        """The full tensor of ``t``, a tensor shaped like ``slot.opt_param`` (an optimizer state:
        this rank's ZeRO rows of its tp-local part). Collective over the stage's mesh."""
        ctx = self.ctx
        if ctx.zero_stage >= 1 and ctx.dp > 1:
            t = gather_rows(slot, t.reshape(-1), ctx, record=False)
        return self._full_of_tp_local(slot, t.reshape(slot.layout.local_shape))

    def _full_of_tp_local(self, slot: ParamSlot, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        ctx = self.ctx
        d = DTensor.from_local(t, ctx.mesh, ctx.placements(slot.name), run_check=False,
                               shape=torch.Size(slot.plan.shape), stride=contiguous_stride(slot.plan.shape))
        full = d.full_tensor()
        if slot.plan.strided > 1:               # tp ranks' rows in rank order -> the model's order
            order = [r for i in range(ctx.tp) for r in tp_local_rows(slot.plan, ctx.tp, i)]
            out = torch.empty_like(full)
            out[torch.tensor(order, device=full.device)] = full
            full = out
        return full

    def local_of(self, slot: ParamSlot, full: torch.Tensor, what: str = "param") -> torch.Tensor:
        """This rank's part of the full tensor ``full`` (the inverse of ``full_tensor`` /
        ``full_of_opt``): ``what="param"`` shaped like ``slot.local``, ``"opt"`` like
        ``slot.opt_param``. Local: no communication."""
        ctx, p, lay = self.ctx, slot.plan, slot.layout
        if p.shape:
            tp_rank = self.ctx.mesh.get_coordinate()[ctx.tensor_axis] if ctx.tensor_axis is not None else 0
            cols = tuple(slot.tp_ranges[1:])
            tp_local = torch.cat([slice_of(full, ((a, b),) + cols)
                                  for a, b in row_runs(held_rows(p, slot.tp_ranges, ctx.tp, tp_rank))])
        else:
            tp_local = full.reshape(())
        a, b = slot.rows
        if ctx.zero_stage == 3:
            return (tp_local if p.shape else tp_local.reshape(1))[a:b].reshape(slot.local.shape)
        if what == "opt" and ctx.zero_stage in (1, 2):
            return tp_local.reshape(lay.rows, lay.row_numel)[a:b].reshape(slot.opt_param.shape)
        return tp_local.reshape(slot.local.shape)

    def _tp_local_grad(self, slot: ParamSlot) -> torch.Tensor:
        ctx = self.ctx
        host = slot.host_grad
        if host is None and ctx.grad_files is not None and slot.name in ctx.grad_files.held:
            host = ctx.grad_files.read_now(slot.name)     # nvme_grads: in its file
        if host is not None:                     # offloaded: the optimizer's rows, on the host
            g = host.to(ctx.device or slot.local.device, _dtype(slot.plan.dtype), copy=True)   # reused buffer
            if ctx.zero_stage >= 1 and ctx.dp > 1:
                return gather_rows(slot, g.reshape(-1), ctx, record=False)
            return g.reshape(slot.layout.local_shape)
        if ctx.zero_stage == 0 or ctx.dp == 1:
            g = slot.local.grad
            return torch.zeros(slot.layout.local_shape, dtype=_dtype(slot.plan.dtype),
                               device=slot.local.device) if g is None else g
        g = slot.opt_param.grad
        if g is None:
            g = torch.zeros_like(slot.opt_param)
        return gather_rows(slot, g.reshape(-1), ctx, record=False)

    def full_dict(self, which: str = "param") -> dict[str, torch.Tensor]:
        """Every parameter name of the original module (tied names too) -> full tensor."""
        full = {s.name: self.full_tensor(s, which) for s in self.slots}
        return {alias: full[canon] for alias, canon in self.aliases.items() if canon in full}


def held_rows(p: ParamPlan, ranges: tuple, tp: int, tp_rank: int) -> list[int]:
    """Rows (dim 0) of the full parameter this rank holds, in local order: ``ranges[0]`` of its
    ``local_ranges`` over every tensor axis, or the strided rows of TENSOR coordinate ``tp_rank``
    (fused QKV; ``program.py`` refuses a strided parameter whose rows another axis shards)."""
    if not p.shape:
        return [0]
    if p.strided > 1:
        return tp_local_rows(p, tp, tp_rank)
    return list(range(*ranges[0]))


def tp_local_rows(p: ParamPlan, tp: int, tp_rank: int) -> list[int]:
    """Rows (dim 0) of the full parameter held by tp rank ``tp_rank``, in local order."""
    if not p.shape:
        return [0]
    n = p.shape[0]
    if not (isinstance(p.tp, Shard) and p.tp.dim % len(p.shape) == 0):
        return list(range(n))
    if p.strided > 1:
        m = n // p.strided
        rows: list[int] = []
        for j in range(p.strided):
            a, b = chunk_range(m, tp, tp_rank)
            rows.extend(range(j * m + a, j * m + b))
        return rows
    a, b = chunk_range(n, tp, tp_rank)
    return list(range(a, b))


def row_runs(rows: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs [start, end) of a row list (an empty list gives one empty run)."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs or [(0, 0)]


def _aliases(model: nn.Module) -> dict[str, str]:
    canonical = {id(p): n for n, p in model.named_parameters()}
    return {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}


