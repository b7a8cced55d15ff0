"""Multi-node fusion regions (``patterns.py`` finds them): what a region adapter checks and how it
launches its kernel.

A region adapter sees its operands as (value, placements the value will have after its planned
edge) before any edge runs, so a declined match costs no communication; the executor has already
checked that the region's internal edges move nothing (every internal value keeps the data
operand's placements). Conditions, per kernel:
  add_rms_norm / add_layer_norm / rms_norm (hand-written): the data operands (x, residual) float,
      one dtype and shape, the same placements, not Partial nor sharded on the last dim (the norm's
      dim, <= NORM_MAX_N); weight / bias None or (N,) of x's dtype, Replicate. eps from the graph
      (aten.rms_norm's eps=None: finfo(dtype).eps, as aten).
  swiglu: a and b float, one dtype, shape and placements, not Partial.
  bias_gelu: x float, not Partial nor sharded on its last dim; bias (N,) of x's dtype, Replicate.
  gelu (hand-written tanh GeLU): x float, not Partial (elementwise: any shard is exact).
  rope: x (..., T, D) float, D even, not Partial nor sharded on T or D; cos and sin (T, D) of x's
      dtype, possibly with leading dims of 1 (HF's (1, 1, T, D)), Replicate, not requiring grad
      (the kernel gives them none).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from autopar.codegen.fused_args import (NORM_MAX_N, first_reason, param_grad_placements,
                                        placements_of, to_local, why_not_float, why_not_replicated,
                                        why_partial, why_sharded, wrap_local)

Spec = tuple          # (value, torch placements after its edge; () for plain tensors)


def _spec_float(spec: Spec, what: str, like: Optional[torch.Tensor] = None) -> Optional[str]:
    t = spec[0]
    why = why_not_float(t, what)
    if why is None and like is not None and t.dtype != like.dtype:
        why = f"{what} dtype {t.dtype} differs from {like.dtype}"
    return why


def _same_data(specs: list, names: list) -> Optional[str]:
    """The data operands: float, and the first one's dtype, shape and placements."""
    why = _spec_float(specs[0], names[0])
    if why:
        return why
    x, pl = specs[0]
    for (t, tpl), what in zip(specs[1:], names[1:]):
        why = _spec_float((t, tpl), what, x)
        if why:
            return why
        if tuple(t.shape) != tuple(x.shape):
            return f"{what} shape {tuple(t.shape)} differs from {names[0]} {tuple(x.shape)}"
        if tpl != pl:
            return f"{what} placements {tpl} differ from {names[0]} {pl}"
    return None


def _vector(spec: Optional[Spec], n: int, x: torch.Tensor, what: str) -> Optional[str]:
    """A weight or bias: None, or an (n,) tensor of x's dtype, Replicate."""
    if spec is None:
        return None
    t, pl = spec
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,) or t.dtype != x.dtype:
        return f"{what} is not a ({n},) tensor of dtype {x.dtype}"
    return why_not_replicated(pl, what)


def _region_norm_check(m, ops: dict) -> Optional[str]:
    data = [r for r in ("x", "residual") if r in ops]
    why = _same_data([ops[r] for r in data], data)
    if why:
        return why
    x, pl = ops["x"]
    n = x.shape[-1] if x.ndim else 0
    if x.ndim == 0 or n > NORM_MAX_N:
        return f"last dim {n} is not in 1..{NORM_MAX_N}"
    return first_reason(why_sharded(pl, x.ndim, (-1,), "input"), _vector(ops.get("weight"), n, x, "weight"),
                  _vector(ops.get("bias"), n, x, "bias"))


def _region_norm_launch(fn, m, vals: dict) -> tuple:
    x = vals["x"]
    gp = param_grad_placements(x)
    eps = m.const("eps")
    eps = float(torch.finfo(x.dtype).eps if eps is None else eps)
    params = [to_local(vals.get("weight"), gp)] + ([to_local(vals.get("bias"), gp)] if "layer" in m.kernel else [])
    if "residual" not in vals:
        return (wrap_local(fn(to_local(x), *params, eps), x, placements_of(x), x.shape),)
    y, h = fn(to_local(x), to_local(vals["residual"]), *params, eps)
    return tuple(wrap_local(t, x, placements_of(x), x.shape) for t in (y, h))


def _region_swiglu_check(m, ops: dict) -> Optional[str]:
    return first_reason(_same_data([ops["a"], ops["b"]], ["a", "b"]), why_partial(ops["a"][1], "a"))


def _region_swiglu_launch(fn, m, vals: dict) -> tuple:
    a = vals["a"]
    return (wrap_local(fn(to_local(a), to_local(vals["b"])), a, placements_of(a), a.shape),)


def _region_bias_gelu_check(m, ops: dict) -> Optional[str]:
    x, pl = ops["x"]
    if m.const("approximate", "none") not in ("none", "tanh"):
        return f"approximate={m.const('approximate')!r}"
    why = _spec_float(ops["x"], "input")
    if why:
        return why
    return first_reason(why_sharded(pl, x.ndim, (-1,), "input"), _vector(ops["bias"], x.shape[-1], x, "bias"))


def _region_bias_gelu_launch(fn, m, vals: dict) -> tuple:
    x = vals["x"]
    y = fn(to_local(x), to_local(vals["bias"], param_grad_placements(x)), m.const("approximate", "none"))
    return (wrap_local(y, x, placements_of(x), x.shape),)


def _region_gelu_check(m, ops: dict) -> Optional[str]:
    x, pl = ops["x"]
    return first_reason(_spec_float(ops["x"], "input"), why_partial(pl, "input"))


def _region_gelu_launch(fn, m, vals: dict) -> tuple:
    x = vals["x"]
    y = fn(to_local(x), None, m.const("approximate"))
    return (wrap_local(y, x, placements_of(x), x.shape),)


def _region_rope_check(m, ops: dict) -> Optional[str]:
    x, pl = ops["x"]
    why = _spec_float(ops["x"], "x")
    if why:
        return why
    if x.ndim < 2 or x.shape[-1] % 2:
        return f"x {tuple(x.shape)} is not (..., T, D) with D even"
    why = why_sharded(pl, x.ndim, (-2, -1), "x")
    if why:
        return why
    for role in ("cos", "sin"):
        t, tpl = ops[role]
        why = _spec_float(ops[role], role, x)
        if why:
            return why
        if tuple(t.shape[-2:]) != tuple(x.shape[-2:]) or t.ndim > x.ndim or any(s != 1 for s in t.shape[:-2]):
            return f"{role} {tuple(t.shape)} is not (T, D) = {tuple(x.shape[-2:])} (leading dims of 1 allowed)"
        if t.requires_grad:
            return f"{role} requires grad (the kernel gives cos and sin none)"
        why = why_not_replicated(tpl, role)
        if why:
            return why
    return None


def _region_rope_launch(fn, m, vals: dict) -> tuple:
    x = vals["x"]
    t, d = x.shape[-2:]
    cos, sin = (to_local(vals[r]).reshape(t, d).contiguous() for r in ("cos", "sin"))
    return (wrap_local(fn(to_local(x), cos, sin), x, placements_of(x), x.shape),)


@dataclass(frozen=True)
class RegionAdapter:
    kernel: str                                              # autopar.kernels.registry name
    check: Callable[[Any, dict], Optional[str]]              # (match, role -> Spec) -> why not
    launch: Callable[[Callable, Any, dict], tuple]           # (fn, match, role -> value) -> outputs


REGION_ADAPTERS: dict[str, RegionAdapter] = {a.kernel: a for a in (
    RegionAdapter("add_rms_norm", _region_norm_check, _region_norm_launch),
    RegionAdapter("add_layer_norm", _region_norm_check, _region_norm_launch),
    RegionAdapter("rms_norm", _region_norm_check, _region_norm_launch),
    RegionAdapter("swiglu", _region_swiglu_check, _region_swiglu_launch),
    RegionAdapter("bias_gelu", _region_bias_gelu_check, _region_bias_gelu_launch),
    RegionAdapter("gelu", _region_gelu_check, _region_gelu_launch),
    RegionAdapter("rope", _region_rope_check, _region_rope_launch),
)}
