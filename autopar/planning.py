"""Planning for the running world (``autoparallelize`` without a plan): rank 0 traces and solves,
every rank receives the plan as JSON (or rank 0's error, raised on every rank alike)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from autopar.plan import Plan
from autopar.solver.forcing import Force


def _default_cluster(device_type: str, world: int):
    from autopar.cost.hardware import GPU_NAMES, resolve_cluster

    if device_type == "cuda":
        name = torch.cuda.get_device_name().lower()
        gpu = next((g for g in GPU_NAMES if g.split("-")[0] in name), "h100")
        return resolve_cluster(gpu, nodes=1, gpus_per_node=world)
    return resolve_cluster("cpu", nodes=1, gpus_per_node=world)


def solve_on_rank0(model, inputs, loss_fn, target, cluster, force: Force, device_type: str,
                    model_name: str, dtype: Optional[str] = None) -> Plan:
    """Rank 0 plans (for compute ``dtype``, default the parameters'); every rank receives the plan
    JSON (or rank 0's error, raised everywhere)."""
    payload: list = [None]
    if dist.get_rank() == 0:
        try:
            from autopar.cost.hardware import resolve_cluster
            from autopar.solver import plan_model
            from autopar.trace import trace_model

            world = dist.get_world_size()
            spec = (_default_cluster(device_type, world) if cluster is None
                    else resolve_cluster(cluster, nodes=1, gpus_per_node=world) if isinstance(cluster, str)
                    else cluster)
            g = trace_model(model, inputs, loss_fn=loss_fn, example_target=target, model_name=model_name)
            seq = inputs[0].shape[1] if inputs[0].dim() >= 2 else None
            dtype = dtype or str(next(model.parameters()).dtype).removeprefix("torch.")
            p = plan_model(g, spec, global_batch=inputs[0].shape[0], seq_len=seq, dtype=dtype, force=force)
            payload = [("plan", p.to_json())]
        except Exception as e:  # sent to every rank and re-raised there, not swallowed
            payload = [("error", (type(e).__name__, f"{type(e).__name__}: {e}"))]
    dist.broadcast_object_list(payload, src=0)
    kind, text = payload[0]
    if kind == "error":
        name, message = text
        raise _error_class(name)(f"planning failed on rank 0: {message}")
    return Plan.from_json(text)


def _error_class(name: str) -> type:
    """The class every rank raises rank 0's planning error as: the same for autopar's own errors
    (so ``except PlanningError`` / ``except TraceError`` / ``except ValueError`` work on every
    rank), RuntimeError for anything else."""
    from autopar.solver.errors import InfeasibleError, PlanningError
    from autopar.trace.errors import TraceError

    known = {c.__name__: c for c in (InfeasibleError, PlanningError, TraceError, ValueError, TypeError,
                                      NotImplementedError)}
    return known.get(name, RuntimeError)
