"""The running world: process groups with timeouts, the ("dp", "tp") DeviceMesh, plan agreement.

Every group autopar creates carries ``timeout_s`` (default 120 s), so a dead or diverging rank
makes the others fail within that time with torch.distributed's error instead of hanging.
Before any training collective every rank checks, with one ``all_gather_object``, that all ranks
traced the same model and hold the same plan; on a mismatch every rank raises the same error.
"""
from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.plan import Plan

DEFAULT_TIMEOUT_S = 120.0
MESH_AXES = ("dp", "tp")
PIPELINE_ISSUE = ("pipeline parallelism (pp > 1) is not implemented by the runtime yet; it is the "
                  "next runtime issue (pipeline stages and schedules). Re-plan with --force pp=1")


class PlanMismatchError(RuntimeError):
    """The plan does not fit this world or this model (raised on every rank)."""


@dataclass(frozen=True)
class MeshDims:
    dp: int
    tp: int

    @property
    def size(self) -> int:
        return self.dp * self.tp


def mesh_dims(plan: Plan) -> MeshDims:
    """The (dp, tp) sizes of the plan's mesh; axes missing from ``plan.mesh_axes`` have size 1."""
    if plan.pp > 1:
        raise NotImplementedError(PIPELINE_ISSUE)
    sizes = dict(zip(plan.mesh_axes, plan.mesh_shape))
    unknown = set(sizes) - set(MESH_AXES) - {"pp"}
    if unknown:
        raise NotImplementedError(f"mesh axes {sorted(unknown)} are not supported by the runtime "
                                  f"(it runs {MESH_AXES}); re-plan without them")
    dims = MeshDims(sizes.get("dp", 1), sizes.get("tp", 1))
    if (dims.dp, dims.tp) != (plan.dp, plan.tp):
        raise PlanMismatchError(f"plan mesh {dict(sizes)} disagrees with its degrees dp={plan.dp} "
                                f"tp={plan.tp}; the plan file is inconsistent")
    return dims


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


def build_mesh(dims: MeshDims, device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S):
    """DeviceMesh(("dp", "tp")) over all ranks, row-major (tp ranks adjacent). Subgroups are made
    here with ``timeout_s`` (``init_device_mesh`` would give them the 30-minute default)."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    if dims.size != world:
        raise PlanMismatchError(world_size_message(dims.dp, dims.tp, world))
    timeout = datetime.timedelta(seconds=timeout_s)
    rank = dist.get_rank()
    layout = torch.arange(world).view(dims.dp, dims.tp)
    mine = {}
    # every rank creates every group in the same order (a new_group requirement)
    for axis, groups in (("dp", layout.t().tolist()), ("tp", layout.tolist())):
        for ranks in groups:
            g = dist.new_group(ranks=ranks, timeout=timeout)
            if rank in ranks:
                mine[axis] = g
    return DeviceMesh.from_group([mine["dp"], mine["tp"]], device_type, mesh=layout,
                                 mesh_dim_names=MESH_AXES)


def world_size_message(dp: int, tp: int, world: int) -> str:
    return (f"the plan's mesh dp({dp}) * tp({tp}) = {dp * tp} != WORLD_SIZE({world}); plan for "
            f"{world} ranks (`autopar plan ... --cluster ... ` with {world} GPUs) or launch {dp * tp}")


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
