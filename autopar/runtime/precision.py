"""Mixed precision as the plan prices it: compute in the plan's dtype, fp32 master weights.

A plan made for ``bfloat16`` or ``float16`` (``autopar plan --dtype``, ``autoparallelize(dtype=)``)
of a model whose parameters are fp32 runs as ``torch.autocast`` runs it on one process:

- forward and backward under ``torch.autocast(device, dtype=plan.dtype)``: the same aten ops as the
  one-process reference, each cast by autocast's own per-op policy (matmuls, convolutions and
  attention in the low dtype, reductions such as cross-entropy in fp32). The parameters stay fp32
  and are the optimizer's master weights: 4 + 4 + 8 bytes per parameter of model state, which the
  planner counts for such plans (``solver/runtime_profile.for_dtype``), with autocast's
  activation dtypes and copies (``solver/autocast.py``);
- gradients are reduced over the data-parallel axis in the plan's dtype (``reduce_dtype``: the
  bucket is cast down before the collective and back after it, so the traffic is what the plan
  priced), accumulated and stepped in fp32;
- float16 adds dynamic loss scaling (``DynamicLossScale``): the loss is multiplied by the scale
  before backward; after the reduction every rank unscales its gradient shards and checks them for
  inf/NaN, and one all-reduce (MAX) over the whole world makes the verdict common: an overflow on
  any rank skips the optimizer step on every rank and halves the scale; ``growth_interval`` clean
  steps in a row double it. These are ``torch.amp.GradScaler``'s rules, run with its own kernels
  (``_amp_foreach_non_finite_check_and_unscale_``, ``_amp_update_scale_``), so a run matches a
  one-process ``GradScaler`` run step for step.

A plan whose dtype equals the parameters' (fp32 plans, or a model already in bf16) runs as it is.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


def parse_dtype(dtype) -> torch.dtype:
    """'bf16' / 'bfloat16' / torch.bfloat16 (and fp16, fp32 alike) -> the torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in _NAMES.values():
        return dtype
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _NAMES:
        raise ValueError(f"dtype={dtype!r}: choose 'bf16', 'fp16' or 'fp32' (or the torch dtype)")
    return _NAMES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the plan's spelling)."""
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Precision:
    """How a plan's dtype runs for parameters of dtype ``master`` (module docstring)."""
    compute: torch.dtype
    master: torch.dtype

    @property
    def mixed(self) -> bool:
        """Autocast to ``compute`` with ``master`` weights (the plan's dtype is lower than theirs)."""
        return self.compute != self.master and self.master == torch.float32

    @property
    def reduce_dtype(self) -> Optional[torch.dtype]:
        """The dtype gradients cross the data-parallel axis in (None: as they are)."""
        return self.compute if self.mixed else None

    @property
    def loss_scaling(self) -> bool:
        return self.mixed and self.compute == torch.float16

    def autocast(self, device_type: str):
        """The context forward and backward run in."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.compute)

    def describe(self) -> str:
        if not self.mixed:
            return dtype_name(self.compute)
        return (f"{dtype_name(self.compute)} autocast, {dtype_name(self.master)} master weights, gradients "
                f"reduced in {dtype_name(self.compute)}" + (", dynamic loss scale" if self.loss_scaling else ""))


def precision_for(plan_dtype: str, param_dtype: torch.dtype) -> Precision:
    """The precision a plan made for ``plan_dtype`` runs at with parameters of ``param_dtype``."""
    compute = parse_dtype(plan_dtype)
    if compute.itemsize > param_dtype.itemsize:
        raise ValueError(f"the plan computes in {dtype_name(compute)} but the model's parameters are "
                         f"{dtype_name(param_dtype)}: give the model in {dtype_name(compute)} (or fp32), "
                         f"or plan for {dtype_name(param_dtype)}")
    return Precision(compute, param_dtype)


class DynamicLossScale:
    """float16's loss scale, with ``torch.amp.GradScaler``'s defaults and update rule, made common
    to every rank of ``group`` (module docstring). ``scale`` multiplies the loss;
    ``unscale_(grads)`` divides the gradients and says whether the step may be taken on every
    rank; ``update`` moves the scale."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group=None) -> None:
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(f"loss scale: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                             f"growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, "
                             f"{growth_interval}")
        self._scale = torch.full((), float(init_scale), dtype=torch.float32)
        self._growth_tracker = torch.zeros((), dtype=torch.int32)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.group = group
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        return float(self._scale)

    def unscale_(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` (this rank's) by the scale in place; True when no rank found inf/NaN."""
        found = torch.zeros(1, dtype=torch.float32)
        inv = self._scale.double().reciprocal().float().reshape(1)
        by_kind: dict = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), gs in by_kind.items():
            f = found.to(device)
            torch._amp_foreach_non_finite_check_and_unscale_(gs, f, inv.to(device))
            found = torch.maximum(found, f.cpu())
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        return not bool(found.item())

    def update(self, stepped: bool) -> None:
        found = torch.full((), 0.0 if stepped else 1.0, dtype=torch.float32)
        torch._amp_update_scale_(self._scale, self._growth_tracker, found, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)
        self.skipped_steps += 0 if stepped else 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": int(self._growth_tracker),
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["growth_tracker"]))
        self.skipped_steps = int(state.get("skipped_steps", 0))
