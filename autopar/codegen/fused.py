"""Fused-kernel substitution: which graph nodes an ``autopar/kernels/`` registry kernel replaces, and how.

    fk = fused_kernels("auto", device_type)     # None: nothing is substituted
    out = fk.run(key, target, args, kwargs)      # the node's output through the kernel, or None

The executor calls ``run`` for every op node after its inputs were placed (``edge``); ``None``
means "run the aten op as usual" (no adapter, or a condition fails: the reason is logged once per
node and placement signature). Values are DTensors (the kernel runs on each rank's LOCAL tensor
and the output is re-wrapped with ``DTensor.from_local``, so autograd flows through the kernel's
``autograd.Function``) or plain tensors (local-dp mode: the local batch, nothing to check).

Modes (``autoparallelize(kernels=...)``):
    "auto"  substitute on CUDA (Triton kernels); on the CPU nothing, even with TRITON_INTERPRET=1
    "on"    substitute on any device with ``registry.select``: Triton on CUDA or when
            TRITON_INTERPRET=1 (the interpreter: tests), else the plain-torch reference
    "off"   never

Autotuning and ranks: the kernels' launch configs (``autopar/kernels/_launch.Tuned``) differ in reduction
order, and ranks tuning independently could pick different ones; where tp ranks compute the same
replicated value (a LayerNorm over a Replicate activation, its weight gradient) the rounding would
then differ across ranks and replicated parameters could drift apart. So in a multi-process run
one rank tunes each (kernel, key) and every rank launches its choice (``autopar/kernels/_agree.py``, through
the process group's store; AUTOPAR_KERNELS_TUNE=local lets each rank tune alone, fine with dp only,
and =never launches every list's first, hand-picked config).

Adapter table (aten call of torch.export's training IR -> kernel call; every condition must hold):

  aten.layer_norm.default(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable)
      -> layer_norm(x, weight, bias, eps)
      normalized_shape == (x.shape[-1],) <= 65536; x fp32/bf16/fp16; weight/bias None or (N,) of
      x's dtype; x not Partial nor sharded on its last dim on any axis; weight/bias Replicate on
      every axis (their local gradient is Partial on each axis that shards x).
  aten.rms_norm.default(x, normalized_shape, weight=None, eps=None)
      -> rms_norm(x, weight, eps if not None else finfo(x.dtype).eps)      conditions as layer_norm
  aten.gelu.default(x, approximate="none"|"tanh") -> bias_gelu(x, None, approximate)
      x fp32/bf16/fp16, not Partial (elementwise: any shard is exact)
  aten.softmax.int(x, dim, dtype=None) -> softmax(x)
      dim is the last dim, dtype None or x's; x not Partial nor sharded on the last dim
  aten.scaled_dot_product_attention.default(q, k, v, attn_mask=None, dropout_p=0.0,
          is_causal=False, scale=None, enable_gqa=False) -> attention(q, k, v, is_causal, scale)[0]
      no mask, dropout_p == 0; q, k, v 4-D (B, H, T, D), one float dtype, k.shape == v.shape,
      same B, D as q, D in attention.SUPPORTED_HEAD_DIMS, Tk > 0; k's heads H (or, with
      enable_gqa, a divisor Hkv of H: each k/v head is repeated H/Hkv times locally, as aten
      does, and autograd sums its gradient back); per mesh axis q, k, v have the same placement,
      Replicate or Shard(0 = batch / 1 = heads; with enable_gqa the axis size divides Hkv, so
      every rank's query heads find their key heads on that rank).
  aten.cross_entropy_loss.default(logits, target, weight=None, reduction=1, ignore_index=-100,
          label_smoothing=0.0) -> cross_entropy(logits, target, ignore_index, "sum"|"mean"|"none")
      logits 2-D (N, C) float, target 1-D integer; weight None, label_smoothing 0; logits not
      Partial, not sharded on the class dim (the vocab-parallel path handles that; it is checked
      first by the executor); the target is redistributed to the logits' placements.
      The mean must be over the GLOBAL batch: where rows are sharded (Shard(0) on an axis of size
      > 1) each rank computes its rows' SUM with the kernel and divides by the global count of
      non-ignored targets (one 4-byte all_reduce per sharded axis, forward); the result is
      Partial on those axes. (DTensor's own rule all-reduces the count in the backward instead.)
      The loss is returned in the logits' dtype, as aten does (the kernel's is fp32).
      The kernel's in-place backward (the gradient written into the logits buffer) is off: the
      local logits may be shared with other users.

Multi-node regions (``patterns.py`` finds them, ``fused_regions.REGION_ADAPTERS`` checks and launches):
residual add + LayerNorm/RMSNorm (one kernel returning the normed value and the new residual),
hand-written RMSNorm (LLaMA's pow/mean/add/rsqrt/mul/mul), rotate-half RoPE, SwiGLU, bias + GeLU,
hand-written tanh GeLU (GPT-2's gelu_new).
The executor defers a region's members to its anchor and runs the kernel there when every
internal edge of the plan keeps the data operand's placements and the adapter accepts; otherwise
the members run one by one.

Not substituted (gaps): ``aten._softmax``; LayerNorm/RMSNorm over more than the last dim; RoPE
whose x is sharded on T or D (the kernel indexes cos/sin by the local T); GeLU after a bias add
that torch.export folded into ``aten.linear`` (the common case: there is no add to fuse).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from autopar.codegen.fused_args import (NORM_MAX_N, call_arg, first_reason, is_dt, last_dim_local,
                                        no_partial, param_grad_placements, placements_of,
                                        replicated, shard_dim, to_local, why_not_float, wrap_local)
from autopar.codegen.fused_regions import REGION_ADAPTERS

log = logging.getLogger("autopar.codegen")

MODES = ("auto", "on", "off")


# ---- adapters ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Adapter:
    target: str                                          # aten target, str of the OpOverload
    kernel: str                                          # autopar.kernels.registry name
    check: Callable[[tuple, dict], Optional[str]]        # why it cannot substitute, None = it can
    launch: Callable[[Callable, tuple, dict], Any]       # (kernel fn, args, kwargs) -> output


def _norm_check(args, kwargs, has_bias: bool) -> Optional[str]:
    x = args[0]
    shape = tuple(call_arg(args, kwargs, 1, "normalized_shape", ()))
    weight = call_arg(args, kwargs, 2, "weight")
    bias = call_arg(args, kwargs, 3, "bias") if has_bias else None
    why = why_not_float(x, "input")
    if why:
        return why
    n = x.shape[-1] if x.ndim else 0
    if shape != (n,):
        return f"normalized_shape {shape} is not the last dim only ({n},)"
    if n > NORM_MAX_N:
        return f"last dim {n} > {NORM_MAX_N}"
    for t, what in ((weight, "weight"), (bias, "bias")):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,) or t.dtype != x.dtype):
            return f"{what} is not a ({n},) tensor of dtype {x.dtype}"
    return first_reason(last_dim_local(x, "input"), replicated(weight, "weight"), replicated(bias, "bias"))


def _layer_norm_launch(fn, args, kwargs):
    x = args[0]
    weight, bias = call_arg(args, kwargs, 2, "weight"), call_arg(args, kwargs, 3, "bias")
    eps = float(call_arg(args, kwargs, 4, "eps", 1e-5))
    gp = param_grad_placements(x)
    y = fn(to_local(x), to_local(weight, gp), to_local(bias, gp), eps)
    return wrap_local(y, x, placements_of(x), x.shape)


def _rms_norm_launch(fn, args, kwargs):
    x = args[0]
    weight = call_arg(args, kwargs, 2, "weight")
    eps = call_arg(args, kwargs, 3, "eps")
    eps = float(torch.finfo(x.dtype).eps if eps is None else eps)
    y = fn(to_local(x), to_local(weight, param_grad_placements(x)), eps)
    return wrap_local(y, x, placements_of(x), x.shape)


def _gelu_check(args, kwargs) -> Optional[str]:
    x = args[0]
    approx = call_arg(args, kwargs, 1, "approximate", "none")
    if approx not in ("none", "tanh"):
        return f"approximate={approx!r}"
    return first_reason(why_not_float(x, "input"), no_partial(x, "input"))


def _gelu_launch(fn, args, kwargs):
    x = args[0]
    y = fn(to_local(x), None, call_arg(args, kwargs, 1, "approximate", "none"))
    return wrap_local(y, x, placements_of(x), x.shape)


def _softmax_check(args, kwargs) -> Optional[str]:
    x = args[0]
    why = why_not_float(x, "input")
    if why:
        return why
    dim = call_arg(args, kwargs, 1, "dim")
    dtype = call_arg(args, kwargs, 2, "dtype")
    if x.ndim == 0 or dim % x.ndim != x.ndim - 1:
        return f"dim={dim} is not the last dim"
    if dtype is not None and dtype != x.dtype:
        return f"dtype={dtype} converts"
    return last_dim_local(x, "input")


def _softmax_launch(fn, args, kwargs):
    x = args[0]
    return wrap_local(fn(to_local(x)), x, placements_of(x), x.shape)


def _sdpa_check(args, kwargs) -> Optional[str]:
    from autopar.kernels.attention import SUPPORTED_HEAD_DIMS
    from torch.distributed.tensor import Replicate

    q, k, v = args[:3]
    if call_arg(args, kwargs, 3, "attn_mask") is not None:
        return "attn_mask is given"
    if float(call_arg(args, kwargs, 4, "dropout_p", 0.0)) != 0.0:
        return "dropout_p != 0"
    gqa = bool(call_arg(args, kwargs, 7, "enable_gqa", False))
    why = first_reason(why_not_float(q, "q"), why_not_float(k, "k"), why_not_float(v, "v"))
    if why:
        return why
    if not q.ndim == k.ndim == v.ndim == 4:
        return f"q, k, v are not 4-D (B, H, T, D): {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if not q.dtype == k.dtype == v.dtype:
        return "q, k, v dtypes differ"
    b, h, _, d = q.shape
    hkv = k.shape[1]
    heads_ok = hkv > 0 and h % hkv == 0 if gqa else hkv == h
    if k.shape != v.shape or k.shape[0] != b or not heads_ok or k.shape[3] != d or k.shape[2] == 0:
        return f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}" + (
            f" (enable_gqa={gqa})" if gqa or hkv != h else "")
    if d not in SUPPORTED_HEAD_DIMS:
        return f"head dim {d} is not in {SUPPORTED_HEAD_DIMS}"
    pq, pk, pv = placements_of(q), placements_of(k), placements_of(v)
    if not (pq == pk == pv):
        return f"q, k, v placements differ ({pq}, {pk}, {pv})"
    for i, p in enumerate(pq):
        if not (isinstance(p, Replicate) or shard_dim(p, 4) in (0, 1)):
            return f"q, k, v placement {p} is not Replicate or a batch/head shard"
        if gqa and hkv != h and shard_dim(p, 4) == 1 and hkv % q.device_mesh.size(i) != 0:
            return f"{hkv} key/value heads do not split evenly over mesh axis {i}"
    return None


def _sdpa_launch(fn, args, kwargs):
    q, k, v = args[:3]
    causal = bool(call_arg(args, kwargs, 5, "is_causal", False))
    scale = call_arg(args, kwargs, 6, "scale")
    kl, vl = to_local(k), to_local(v)
    if k.shape[1] != q.shape[1]:           # enable_gqa: each local k/v head serves rep query heads
        rep = q.shape[1] // k.shape[1]
        kl, vl = kl.repeat_interleave(rep, dim=1), vl.repeat_interleave(rep, dim=1)
    out, _lse = fn(to_local(q), kl, vl, causal, scale)
    return wrap_local(out, q, placements_of(q), tuple(q.shape[:-1]) + (v.shape[-1],))


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _ce_check(args, kwargs) -> Optional[str]:
    x, t = args[0], args[1]
    why = why_not_float(x, "logits")
    if why:
        return why
    if x.ndim != 2 or not isinstance(t, torch.Tensor) or t.ndim != 1 or t.is_floating_point():
        return "not (N, C) logits with (N,) integer targets"
    if call_arg(args, kwargs, 2, "weight") is not None:
        return "a class weight is given"
    if float(call_arg(args, kwargs, 5, "label_smoothing", 0.0)) != 0.0:
        return "label_smoothing != 0"
    if call_arg(args, kwargs, 3, "reduction", 1) not in _REDUCTIONS:
        return f"reduction {call_arg(args, kwargs, 3, 'reduction', 1)}"
    why = no_partial(x, "logits")
    if why:
        return why
    if any(shard_dim(p, 2) == 1 for p in placements_of(x)):
        return "logits are sharded on the class dim"
    return None


def _ce_launch(fn, args, kwargs):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Partial, Replicate, Shard

    x, t = args[0], args[1]
    reduction = _REDUCTIONS[call_arg(args, kwargs, 3, "reduction", 1)]
    ignore_index = int(call_arg(args, kwargs, 4, "ignore_index", -100))
    if not is_dt(x):
        return fn(x, t, ignore_index, reduction).to(x.dtype)
    mesh = x.device_mesh
    if is_dt(t) and tuple(t.placements) != tuple(x.placements):
        t = t.redistribute(mesh, tuple(x.placements))
    rows_sharded = [i for i, p in enumerate(x.placements) if isinstance(p, Shard) and mesh.size(i) > 1]
    xl, tl = to_local(x), to_local(t)
    if reduction == "none":
        y = fn(xl, tl, ignore_index, "none").to(x.dtype)
        pl = tuple(Shard(0) if isinstance(p, Shard) else Replicate() for p in x.placements)
        return wrap_local(y, x, pl, (x.shape[0],))
    if not rows_sharded:
        y = fn(xl, tl, ignore_index, reduction).to(x.dtype)
        return wrap_local(y, x, tuple(Replicate() for _ in x.placements), ())
    total = fn(xl, tl, ignore_index, "sum")                 # fp32, this rank's rows
    if reduction == "mean":
        count = (tl != ignore_index).sum().to(torch.float32)
        for i in rows_sharded:
            count = funcol.wait_tensor(funcol.all_reduce(count, "sum", group=(mesh, i)))
        total = total / count
    pl = tuple(Partial() if i in rows_sharded else Replicate() for i in range(mesh.ndim))
    return wrap_local(total.to(x.dtype), x, pl, ())


ADAPTERS: dict[str, Adapter] = {a.target: a for a in (
    Adapter("aten.layer_norm.default", "layer_norm", lambda a, k: _norm_check(a, k, True), _layer_norm_launch),
    Adapter("aten.rms_norm.default", "rms_norm", lambda a, k: _norm_check(a, k, False), _rms_norm_launch),
    Adapter("aten.gelu.default", "gelu", _gelu_check, _gelu_launch),
    Adapter("aten.softmax.int", "softmax", _softmax_check, _softmax_launch),
    Adapter("aten.scaled_dot_product_attention.default", "attention", _sdpa_check, _sdpa_launch),
    Adapter("aten.cross_entropy_loss.default", "cross_entropy", _ce_check, _ce_launch),
)}


# ---- the pass ----------------------------------------------------------------------------------

class FusedKernels:
    """Substitutes registry kernels for the nodes ``ADAPTERS`` accept. ``implementation`` is
    "triton" (the kernels' launchers) or "reference" (their plain-torch references).

    ``used`` maps node key -> kernel name, in the order nodes were first substituted."""

    def __init__(self, implementation: str) -> None:
        if implementation not in ("triton", "reference"):
            raise ValueError(f"implementation={implementation!r}: choose 'triton' or 'reference'")
        from autopar.kernels.registry import lookup

        self.implementation = implementation
        kernels = {a.kernel for a in ADAPTERS.values()} | set(REGION_ADAPTERS)
        self._fns = {k: getattr(lookup(k), implementation) for k in kernels}
        if implementation == "triton":      # the local logits may have other users: no in-place grad
            self._fns["cross_entropy"] = functools.partial(self._fns["cross_entropy"], inplace_backward=False)
        self._decided: dict[tuple, Optional[str]] = {}
        self.used: dict[str, str] = {}

    def decide(self, key: str, kernel: str, sig: tuple, why: Callable[[], Optional[str]]) -> bool:
        """Whether node ``key`` runs ``kernel`` for inputs of placement signature ``sig``: ``why()``
        is asked once per (key, sig) and a reason not to is logged once."""
        if (key, sig) not in self._decided:
            reason = why()
            self._decided[(key, sig)] = reason
            if reason:
                log.info("node %s: %s kernel not substituted: %s", key, kernel, reason)
        return self._decided[(key, sig)] is None

    def run(self, key: str, target: str, args: tuple, kwargs: dict) -> Optional[Any]:
        """The node's output through its kernel, or None to run the aten op."""
        adapter = ADAPTERS.get(target)
        if adapter is None:
            return None
        sig = tuple(placements_of(a) for a in args if isinstance(a, torch.Tensor))
        if not self.decide(key, adapter.kernel, sig, lambda: adapter.check(args, kwargs)):
            return None
        self.used.setdefault(key, adapter.kernel)
        return adapter.launch(self._fns[adapter.kernel], args, kwargs)

    def check_match(self, key: str, match, specs: dict, plan_why: Callable[[], Optional[str]]) -> bool:
        """Whether ``match`` (patterns.Match, anchored at node ``key``) runs fused with operands
        ``specs`` (role -> (value, placements after its edge)); ``plan_why`` says why the plan
        forbids it (a reshard inside the region), if it does."""
        adapter = REGION_ADAPTERS[match.kernel]
        sig = tuple(pl for _, pl in specs.values())
        return self.decide(key, match.kernel, sig, lambda: plan_why() or adapter.check(match, specs))

    def run_match(self, key: str, match, values: dict) -> tuple:
        """The kernel outputs of an accepted ``match`` from its edged operands (role -> value)."""
        self.used.setdefault(key, match.kernel)
        return REGION_ADAPTERS[match.kernel].launch(self._fns[match.kernel], match, values)


def fused_kernels(mode: str, device_type: str) -> Optional[FusedKernels]:
    """The substitution pass for ``mode`` (see the module docstring) on ``device_type``, or None."""
    import os

    if mode not in MODES:
        raise ValueError(f"kernels={mode!r}: choose one of {', '.join(MODES)}")
    if mode == "off" or (mode == "auto" and device_type != "cuda"):
        return None
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    impl = "triton" if device_type == "cuda" or interpret else "reference"
    try:
        return FusedKernels(impl)
    except ImportError as e:
        if mode == "on":
            raise ImportError(f"kernels='on' needs the kernels package and triton ({e}); install "
                              "autopar[kernels] or pass kernels='off'") from e
        log.warning("fused kernels are off: %s (install autopar[kernels], or pass kernels='off' "
                    "to silence this)", e)
        return None
