"""``--force`` parsing: ``"tp=8,pp=8,dp=1,mbs=1,recompute=full,sp=off,zero=1"`` -> ``Force``.

``schedule=NAME`` pins the pipeline schedule (``plan.PIPELINE_SCHEDULES``: gpipe, 1f1b,
interleaved_1f1b, interleaved_zb, zbv, dualpipev) and ``vpp=K`` the stages per pipeline rank
(virtual stages). Whether they fit the model and the other degrees is checked by the search
(``configs.check_force``).

``offload=CLASSES`` pins the offloaded tensor classes, joined by "+" (``plan.parse_offload``:
optimizer, grads, params, activations, nvme, nvme_params; "none" forbids offload), e.g. offload=optimizer+grads.

``cp=N`` splits every sequence over N context-parallel ranks and ``cpmode=ring|ulysses`` pins how
attention crosses them (``solver/context.py``).

``tpmode=1d|2d|2.5d|3d`` lays the tp ranks out as one tensor axis or as a q x q, d x q x q or
q x q x q mesh of them (``solver/tensor_axes.py``); the multi-axis modes need tp forced too. Not
forced, the search tries each family that fits (``configs.tensor_shapes``); ``tpmode=1d`` keeps it
to one axis."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from autopar.mesh import CONTEXT, DATA, PIPELINE, TENSOR
from autopar.plan import CONTEXT_MODES, PIPELINE_SCHEDULES, offload_name, parse_offload
from autopar.recompute_ops import canonical_recompute

_INT_KEYS = {"tp": "tp", "pp": "pp", "dp": "dp", "mbs": "micro_batch_size", "zero": "zero_stage",
             "microbatches": "num_micro_batches", "vpp": "virtual_stages", "cp": "context_parallel"}
_BOOL_WORDS = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}


@dataclass(frozen=True)
class Force:
    """Choices pinned by the user; ``None`` leaves the choice to the solver."""
    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None
    micro_batch_size: Optional[int] = None
    num_micro_batches: Optional[int] = None
    zero_stage: Optional[int] = None
    recompute: Optional[str] = None
    sequence_parallel: Optional[bool] = None
    offload: Optional[str] = None
    schedule: Optional[str] = None           # pipeline schedule (plan.PIPELINE_SCHEDULES)
    virtual_stages: Optional[int] = None     # stages per pipeline rank ("vpp")
    context_parallel: Optional[int] = None   # cp ranks per sequence
    context_parallel_mode: Optional[str] = None   # "ring" | "ulysses" ("cpmode")
    tensor_parallel_mode: Optional[str] = None    # "1d" | "2d" | "2.5d" | "3d" ("tpmode"; solver/tensor_axes.py)

    def items(self) -> tuple[tuple[str, str], ...]:
        return tuple((f.name, str(getattr(self, f.name))) for f in fields(self) if getattr(self, f.name) is not None)


def parse_force(spec: "str | dict | Force | None") -> Force:
    if spec is None or spec == "":
        return Force()
    if isinstance(spec, Force):
        return spec
    if isinstance(spec, str):
        pairs = {}
        for part in spec.split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise ValueError(f"--force item {part!r} is not KEY=VALUE (e.g. tp=8,pp=2,recompute=full)")
            k, v = part.split("=", 1)
            pairs[k.strip()] = v.strip()
        spec = pairs
    out: dict = {}
    for k, v in spec.items():
        k = str(k)
        if k in _INT_KEYS:
            try:
                iv = int(v)
            except (TypeError, ValueError):
                raise ValueError(f"--force {k}={v!r}: expected an integer") from None
            if iv < (0 if k == "zero" else 1) or (k == "zero" and iv > 3):
                raise ValueError(f"--force {k}={iv}: out of range" + (" (zero is 0..3)" if k == "zero" else " (must be >= 1)"))
            out[_INT_KEYS[k]] = iv
        elif k == "recompute":
            try:                                            # partial: the solver picks the layers
                out["recompute"] = canonical_recompute(str(v), extra=("partial",))
            except ValueError as e:
                raise ValueError(f"--force {e}") from None
        elif k == "schedule":
            if v not in PIPELINE_SCHEDULES:
                raise ValueError(f"--force schedule={v!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
            out["schedule"] = v
        elif k == "tpmode":
            from autopar.cost.tensor_parallel import parse_tp_mode

            try:
                mode = parse_tp_mode(v)
            except ValueError as e:
                raise ValueError(f"--force tpmode={v}: {e}") from None
            out["tensor_parallel_mode"] = mode
        elif k == "cpmode":
            if v not in CONTEXT_MODES:
                raise ValueError(f"--force cpmode={v!r}: choose one of {', '.join(CONTEXT_MODES)}")
            out["context_parallel_mode"] = v
        elif k == "offload":
            try:
                out["offload"] = offload_name(parse_offload(str(v)))   # canonical: "optimizer+activations"
            except ValueError as e:
                raise ValueError(f"--force {e}") from None
        elif k == "sp":
            if isinstance(v, bool):
                out["sequence_parallel"] = v
            elif str(v).lower() in _BOOL_WORDS:
                out["sequence_parallel"] = _BOOL_WORDS[str(v).lower()]
            else:
                raise ValueError(f"--force sp={v!r}: use on or off")
        else:
            known = sorted(list(_INT_KEYS) + ["recompute", "offload", "sp", "schedule", "cpmode", "tpmode"])
            raise ValueError(f"--force: unknown key {k!r}; known keys: {', '.join(known)}")
    return Force(**out)


def check_world(force: Force, world: int) -> None:
    """Forced degrees must divide the world (and multiply to it when all are given). The degrees
    are the mesh roles (``autopar.mesh``), which ``--force`` names as they are."""
    roles = (DATA, TENSOR, PIPELINE, CONTEXT)
    degree = {DATA: force.dp, TENSOR: force.tp, PIPELINE: force.pp, CONTEXT: force.context_parallel}
    for name in roles:
        v = degree[name]
        if v is not None and world % v:
            raise ValueError(f"--force {name}={v} does not divide the world size {world}; choose a "
                             f"divisor of {world}")
    given = {name: degree[name] if name != CONTEXT else (degree[name] or 1) for name in roles}
    if all(v is not None for v in given.values()) and math.prod(given.values()) != world:
        product = " * ".join(f"{name}({v})" for name, v in given.items())
        raise ValueError(f"--force {product} != WORLD_SIZE({world})")
