"""The running world: process groups with timeouts, the DeviceMesh of the plan's mesh, plan agreement.

The mesh is plan data (``autopar.mesh.Mesh``: named axes, outermost first, row-major ranks);
``build_mesh`` turns any number of named axes into a DeviceMesh with the same names, so code
below looks axes up by role name (``autopar.mesh.DATA``, ``TENSOR``), never by position.

Every group autopar creates carries ``timeout_s`` (default 120 s), so a dead or diverging rank
makes the others fail within that time with torch.distributed's error instead of hanging.
Before any training collective every rank checks, with one ``all_gather_object``, that all ranks
traced the same model and hold the same plan; on a mismatch every rank raises the same error.
"""
from __future__ import annotations

import datetime
import hashlib
import os
from typing import Optional

import torch
import torch.distributed as dist

from autopar.mesh import CONTEXT, DATA, PIPELINE, TENSOR_AXES, Mesh
from autopar.plan import Plan

DEFAULT_TIMEOUT_S = 120.0
RUNTIME_ROLES = (PIPELINE, DATA) + TENSOR_AXES   # the mesh axes the runtime runs (tp2, tp3: 2-D / 3-D tp)


class PlanMismatchError(RuntimeError):
    """The plan does not fit this world or this model (raised on every rank)."""


def check_runtime_mesh(mesh: Mesh) -> None:
    """Raise NotImplementedError unless the runtime runs every axis of ``mesh`` (``RUNTIME_ROLES``)."""
    unknown = [a for a in mesh.axes if a not in RUNTIME_ROLES]
    if unknown:
        raise NotImplementedError(
            f"mesh axes {unknown} are not supported by the runtime (it runs the axes "
            f"{', '.join(RUNTIME_ROLES)}: pipeline, data and tensor parallel); re-plan without them")


def runtime_mesh(plan: Plan) -> Mesh:
    """The mesh this runtime builds for ``plan``: ``Plan.mesh`` (pipeline stages outermost when
    pp > 1) with a context-parallel axis folded into the data axis (the mesh the graph's ops run
    on, ``Plan``'s module docstring; attention's cp groups are ``context_group``'s), after
    checking the runtime runs every axis."""
    mesh = plan.mesh.fold(CONTEXT, DATA)
    check_runtime_mesh(mesh)
    return mesh


def context_group(plan: Plan, timeout_s: float = DEFAULT_TIMEOUT_S):
    """(this rank's cp process group, its cp coordinate); every rank creates every cp group, in
    the same order. None when the plan has no context parallelism."""
    if plan.context_parallel == 1:
        return None, 0
    mesh = plan.mesh
    rank = dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    mine = None
    for ranks in mesh.groups(CONTEXT):
        g = dist.new_group(ranks=list(ranks), timeout=timeout)
        if rank in ranks:
            mine = g
    return mine, mesh.coord(rank, CONTEXT)


def init_world(timeout_s: float = DEFAULT_TIMEOUT_S, device_type: str = "cpu") -> tuple[int, int]:
    """Join (or start) the default process group; returns (rank, world size).

    Already initialized: used as is. Launched by torchrun (RANK/WORLD_SIZE/MASTER_ADDR set): joins
    with ``timeout_s``. Otherwise a one-process world."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def start_watchdog(heartbeat_timeout_s: Optional[float]):
    """Start this rank's heartbeat watchdog (``runtime/watchdog.py``) unless it is disabled (None),
    the world has one rank, or ``spawn_ranks`` started this rank (it has its own heartbeat)."""
    from autopar.runtime.launch import in_launched_rank
    from autopar.runtime.watchdog import Watchdog

    if heartbeat_timeout_s is None or dist.get_world_size() == 1 or in_launched_rank():
        return None
    store = dist.distributed_c10d._get_default_store()
    return Watchdog(store, dist.get_rank(), dist.get_world_size(), stale_s=heartbeat_timeout_s).start()


def build_mesh(mesh: Mesh, device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S):
    """DeviceMesh of ``mesh`` (any number of named axes; for training, ``runtime_mesh(plan)``)
    over all ranks: the same axes, names and sizes, ranks row-major (the last axis' ranks
    adjacent), one process group per group of ranks along each axis (``Mesh.groups``). Subgroups
    are made here with ``timeout_s`` (``init_device_mesh`` would give them the 30-minute default).
    Which axes the training runtime runs is ``runtime_mesh``'s check, not this one's."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    if mesh.size != world:
        raise PlanMismatchError(world_size_message(mesh, world))
    if not mesh.axes:
        raise PlanMismatchError("the plan's mesh has no axes; re-plan (`autopar plan`)")
    timeout = datetime.timedelta(seconds=timeout_s)
    rank = dist.get_rank()
    mine = {}
    # every rank creates every group of every axis, in the same order (a new_group requirement)
    for axis in mesh.axes:
        for ranks in mesh.groups(axis):
            g = dist.new_group(ranks=list(ranks), timeout=timeout)
            if rank in ranks:
                mine[axis] = g
    layout = torch.arange(world).view(*mesh.shape)
    return DeviceMesh.from_group([mine[a] for a in mesh.axes], device_type, mesh=layout,
                                 mesh_dim_names=tuple(mesh.axes))


def world_size_message(mesh: Mesh, world: int) -> str:
    return (f"the plan's mesh {mesh.describe()} holds {mesh.size} ranks != WORLD_SIZE({world}); plan for "
            f"{world} ranks (`autopar plan ... --cluster ... ` with {world} GPUs) or launch {mesh.size}")


def plan_digest(plan: Plan) -> str:
    """sha256 of the plan's JSON (what ranks compare)."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()


def check_agreement(plan: Plan, graph_fingerprint: str) -> None:
    """Raise ``PlanMismatchError`` on EVERY rank unless all ranks traced the same model, that model
    is the one the plan was made for, and all ranks hold the same plan. One all_gather_object."""
    mine = (graph_fingerprint, plan.model_fingerprint, plan_digest(plan))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    wrong_model = [r for r, (g, p, _) in enumerate(everyone) if g != p]
    if wrong_model:
        g, p, _ = everyone[wrong_model[0]]
        raise PlanMismatchError(
            f"the plan was made for another model: plan fingerprint {p[:12]}, traced model {g[:12]} "
            f"(ranks {wrong_model}); re-run `autopar plan` for this model, batch size and sequence length")
    digests = {d for _, _, d in everyone}
    if len(digests) > 1:
        by = {}
        for r, (_, _, d) in enumerate(everyone):
            by.setdefault(d[:12], []).append(r)
        raise PlanMismatchError(f"ranks hold different plans {by}; give every rank the same plan")
    models = {g for g, _, _ in everyone}
    if len(models) > 1:
        raise PlanMismatchError("ranks traced different models; pass the same module to every rank")
