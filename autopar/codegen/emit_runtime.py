"""The functions emitted stage modules call (``emit.py``), printed under their own names.

Each does, for one value, what the interpreter (``executor.GraphExecutor``) does at the same point,
with the same code underneath (``edges.edge``, ``fallback.run_local``, ``vocab_ce``), so the
emitted module issues the same collectives in the same order as the interpreter."""
from __future__ import annotations

import contextlib
import functools
import logging
import re
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate as TReplicate

from autopar.codegen import fallback
from autopar.codegen.causal_check import MaskVerdicts, agree_on_every_rank, local_causal
from autopar.codegen.edges import edge, release_masks, resolve_placements, unmasked
from autopar.codegen.shards import contiguous_stride, local_ranges, slice_of
from autopar.codegen.vocab_ce import VocabParallelCE, ce_arg, vocab_parallel_ce
from autopar.codegen.writes import probe_copies, write_back as write_buffers
from autopar.mesh import TENSOR
from autopar.trace.causal_masks import causal_call
from autopar.placements import Partial, Replicate, Shard, parse_placement, to_torch

log = logging.getLogger("autopar.codegen")


# ---- placements as text ------------------------------------------------------------------------

def fmt(placements) -> str:
    """``(Shard(0), None)`` -> ``"S(0)_"`` (None: keep)."""
    return "".join("_" if p is None else str(p) for p in placements)


@functools.lru_cache(maxsize=None)
def parse(text: str) -> tuple:
    """``"S(0)_"`` -> ``(Shard(0), None)`` (cached: the emitted code passes the same strings every step)."""
    return tuple(None if t == "_" else parse_placement(t) for t in re.findall(r"S\(\d+\)|R|P|_", text))


def norm(placements, ndim: int):
    """Negative Shard dims made absolute (for comparison and printing)."""
    if placements is None:
        return None
    return tuple(Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements)


class StageRuntime:
    """What the emitted helpers read: the stage's DeviceMesh, ``params.use(name)`` (a
    ``runtime.params.ParamStore`` or anything with that method), full buffers and constants;
    ``local_dp``: the program runs its plain nodes on local tensors; ``log_paused``: a context
    manager under which ``local_op``'s one-time probes run unlogged (the interpreter's)."""

    def __init__(self, mesh, params, buffers: Optional[dict] = None, constants: Optional[dict] = None,
                 local_dp: bool = False, log_paused=contextlib.nullcontext, context=None) -> None:
        self.mesh, self.params = mesh, params
        self.context = context                    # cp > 1: this rank's ``context_run.ContextRun``
        self.buffers, self.constants = buffers or {}, constants or {}
        self.local_dp = local_dp
        self.log_paused = log_paused
        self.device = (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
                       else torch.device(mesh.device_type))
        self.fallbacks: set[str] = set()          # op targets run on local tensors (as the executor's)
        self.probed: set = set()
        self.local_sigs: set = set()
        self.regather = getattr(params, "regather", None)   # a ParamStore's (``runtime/regather.py``)
        self.replaying = False                    # a recompute region's replay runs (no write-back)
        self.masks = MaskVerdicts()               # constant attention masks (``masked_attention``)


def axis_index_of(mesh, role: str) -> Optional[int]:
    names = tuple(mesh.mesh_dim_names or ())
    return names.index(role) if role in names else None


def param(rt: StageRuntime, name: str):
    """Parameter ``name`` as a DTensor in its storage placement (one use per scope)."""
    return rt.params.use(name)


def place(rt: StageRuntime, x, placements: str):
    """A full tensor every rank holds -> this rank's shard in ``placements`` (no communication;
    Partial reads as Replicate; local-dp mode: the plain local shard); a DTensor -> ``redistribute``."""
    if isinstance(x, DTensor):
        return redistribute(x, placements)
    want = tuple(Replicate() if p is None or isinstance(p, Partial) else p for p in norm(parse(placements), x.dim()))
    local = slice_of(x, local_ranges(x.shape, want, tuple(rt.mesh.shape), tuple(rt.mesh.get_coordinate()))) \
        if x.dim() else x
    if rt.local_dp:
        return local.to(rt.device)
    return DTensor.from_local(local.to(rt.device).contiguous(), rt.mesh, tuple(to_torch(p) for p in want),
                              run_check=False, shape=x.shape, stride=contiguous_stride(x.shape))


def buffer(rt: StageRuntime, name: str, placements: str):
    """Buffer (or lifted constant) ``name``, placed."""
    return place(rt, rt.buffers[name] if name in rt.buffers else rt.constants[name], placements)


def wrap_plain(rt: StageRuntime, x, placements: str):
    """Local-dp mode: a plain local-batch tensor entering a DTensor node, as a DTensor in its
    producer's planned placements (Partial/keep read as Replicate; the executor's ``_wrap_plain``)."""
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
        return x
    pl = tuple(TReplicate() if w is None or isinstance(w, Partial) else to_torch(w)
               for w in norm(parse(placements), x.dim()))
    return DTensor.from_local(x, rt.mesh, pl, run_check=False)


def redistribute(x, placements: str, keep_partial_grad: Optional[str] = None, regather=None):
    """``x`` in ``placements`` (``edges.edge``: autograd-correct). ``keep_partial_grad``: the axis
    on which a parameter's gradient stays Partial (the reducer sums it); ``regather``: see
    ``redistribute_saved``."""
    if not isinstance(x, DTensor):
        return x
    keep = (axis_index_of(x.device_mesh, keep_partial_grad),) if keep_partial_grad else ()
    return edge(x, resolve_placements(tuple(x.placements), x.ndim, parse(placements)), keep, regather)


def redistribute_saved(rt: StageRuntime, x, placements: str, target_op: str,
                       keep_partial_grad: Optional[str] = None):
    """``redistribute`` into an input its consumer (of ``target_op``) saves as it is
    (``NodePlan.regather``): a value only all-gathered is kept as its shard for backward
    (``runtime/regather.py``)."""
    if rt.regather is None or not isinstance(x, DTensor):
        return redistribute(x, placements, keep_partial_grad)
    return redistribute(rt.regather.cast_for(x, target_op), placements, keep_partial_grad, rt.regather)


def replicated_input(x, placements: str, keep_partial_grad: Optional[str] = None):
    """``x`` already in ``placements``: identity forward; backward all-reduces a Partial gradient."""
    return redistribute(x, placements, keep_partial_grad)


def pin(rt: StageRuntime, out, placements: str, keep_partial_grad: Optional[str] = None):
    """An op's output in its planned placements where DTensor's rule gave others (the executor's
    ``_fix_output``: a plain tensor becomes a replicated DTensor first, outside local-dp mode; a
    masked Partial a plain one, ``edges.unmasked``).
    ``keep_partial_grad``: as ``redistribute``'s (a value of this cp rank's positions)."""
    if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) and not rt.local_dp:
        out = DTensor.from_local(out, rt.mesh, tuple(TReplicate() for _ in range(rt.mesh.ndim)), run_check=False)
    if isinstance(out, DTensor):
        return redistribute(unmasked(out), placements, keep_partial_grad)
    if isinstance(out, (tuple, list)):
        return type(out)(redistribute(unmasked(o), placements, keep_partial_grad) if isinstance(o, DTensor) else o
                         for o in out)
    return out


def masked_attention(rt: StageRuntime, key: str, dtensors: bool, op, *args, **kwargs):
    """``aten.scaled_dot_product_attention`` with a constant mask the trace could not fold
    (``causal_check.py``): the first time, every rank checks its piece of the mask and all agree;
    from the next step on (``rt.masks.begin_step``) a causal one is dropped for ``is_causal=True``.
    ``dtensors``: through ``local_op`` (DTensor operands), else the op on plain tensors."""
    masks = rt.masks
    if key in masks.active:
        args, kwargs = causal_call(args, kwargs)
    elif key not in masks.verdicts:
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        masks.verdicts[key] = agree_on_every_rank(local_causal(mask, args[0].shape[-2], args[1].shape[-2]),
                                                  rt.device, rt.log_paused)
    return local_op(rt, op, *args, **kwargs) if dtensors else op(*args, **kwargs)


def context_attention(rt: StageRuntime, *args, **kwargs):
    """cp > 1: ``aten.scaled_dot_product_attention`` over the cp ranks, ring or Ulysses
    (``context_run.ContextRun.attention``)."""
    return rt.context.attention(args, kwargs)


def context_positions(rt: StageRuntime, op, target: str, *args, **kwargs):
    """cp > 1: a position source (``arange(0, T)``, a RoPE table's first T rows) computed at the
    chunk's length, then given this rank's chunk's positions (``ContextRun.position_value``)."""
    return rt.context.position_value(target, op(*args, **kwargs), args)


def strided_split(x: DTensor, k: int) -> tuple:
    """A strided tensor-parallel shard (fused QKV) split into its k chunks on local tensors."""
    t = axis_index_of(x.device_mesh, TENSOR)
    dim = x.placements[t].dim
    shape = list(x.shape)
    shape[dim] //= k
    return tuple(DTensor.from_local(c, x.device_mesh, x.placements, run_check=False, shape=torch.Size(shape),
                                    stride=contiguous_stride(shape)) for c in torch.chunk(x.to_local(), k, dim=dim))


def vocab_parallel_cross_entropy(*args, **kwargs):
    """``aten.cross_entropy_loss`` on class-sharded logits via ``loss_parallel`` (``vocab_ce.py``);
    otherwise the aten op on DTensors."""
    if isinstance(args[0], DTensor) and vocab_parallel_ce(args, kwargs, args[0].device_mesh):
        return VocabParallelCE.apply(args[0], args[1], ce_arg(args, kwargs, 3, "reduction", 1),
                                     ce_arg(args, kwargs, 4, "ignore_index", -100))
    return torch.ops.aten.cross_entropy_loss.default(*args, **kwargs)


def local_op(rt: StageRuntime, op, *args, **kwargs):
    """``op`` on local shards where DTensor has no (right) rule, else on DTensors, decided once per
    (op, placements) as the executor decides: attention on the CPU and split convolutions go local
    at once; any other op emitted through here (one without a registered DTensor rule) is probed
    once without autograd, unlogged, and goes local if DTensor cannot run it."""
    flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    if not flat:
        return op(*args, **kwargs)
    target = str(op)
    sig = (target, tuple(tuple(t.placements) for t in flat))
    if sig not in rt.probed:
        rt.probed.add(sig)
        if ((target in fallback.SDPA_TARGETS and flat[0].device.type == "cpu")
                or fallback.needs_local(target, sig[1]) or _lacks_rule(rt, op, target, args, kwargs)):
            rt.fallbacks.add(target)
            rt.local_sigs.add(sig)
    if sig in rt.local_sigs:
        return fallback.run_local(op, target, args, kwargs, flat[0].device_mesh)
    return op(*args, **kwargs)


def _lacks_rule(rt: StageRuntime, op, target: str, args, kwargs) -> bool:
    """The executor's ``_lacks_rule``: run ``op`` once on DTensors (copies of what it writes)."""
    if target in fallback.OWN_LOCAL_TARGETS:
        return False                          # DTensor runs these where ``needs_local`` did not say local
    args = probe_copies(op, args)             # the probe must not write: copies of the written operands
    try:
        with torch.no_grad(), rt.log_paused():
            release_masks(op(*args, **kwargs))
    except NotImplementedError as e:
        if "sharding strategy" not in str(e) and "sharding propagation" not in str(e):
            raise
        log.info("DTensor has no sharding rule inside %s (%s); running it on local tensors "
                 "(see autopar/codegen/fallback.py)", target, str(e).splitlines()[0][:160])
        return True
    return False


def forced_local_op(op, *args, **kwargs):
    """``op`` on local shards, always (a target in ``emit_stage(fallbacks=...)``: one the executor
    found DTensor has no rule for)."""
    flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    if not flat:
        return op(*args, **kwargs)
    return fallback.run_local(op, str(op), args, kwargs, flat[0].device_mesh)


def recompute(region: nn.Module, rt: StageRuntime, *values, written: tuple = ()):
    """A recompute region: ``torch.utils.checkpoint`` (non-reentrant, early stop off). ``written``:
    positions of ``values`` the region writes in place (a BatchNorm's running statistics): they
    stay out of checkpoint's saved inputs (its version check rejects changed ones) and the replay
    in backward gets copies of what the forward read, its writes not written back (the
    interpreter's ``_run_region``)."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    if not written:
        with set_checkpoint_early_stop(False):
            return checkpoint(region, rt, *values, use_reentrant=False)
    kept = {i: values[i] for i in written}
    saved = {i: v.detach().clone() for i, v in kept.items()
             if isinstance(v, torch.Tensor)} if torch.is_grad_enabled() else {}
    passed = [i for i in range(len(values)) if i not in kept]
    calls = [0]

    def fn(*vals):
        calls[0] += 1
        replay = calls[0] > 1
        full = dict(zip(passed, vals))
        full.update({i: saved[i].clone() if replay and i in saved else v for i, v in kept.items()})
        rt.replaying, was = replay or rt.replaying, rt.replaying
        try:
            return region(rt, *(full[i] for i in range(len(values))))
        finally:
            rt.replaying = was

    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *(values[i] for i in passed), use_reentrant=False)


def write_back(rt: StageRuntime, out, target: str, writes: tuple, *written):
    """After op ``target`` wrote buffers in place: ``writes.write_back`` (a write that did not land
    in the whole buffer copied into it), once per step, never in a replay (the interpreter's
    ``_write_back``). Returns ``out``, the op's result."""
    if not rt.replaying:
        write_buffers(rt.buffers, writes, written, target)
    return out


HELPERS = (param, place, buffer, wrap_plain, redistribute, replicated_input, pin, strided_split,
           vocab_parallel_cross_entropy, local_op, forced_local_op, recompute, write_back, context_attention,
           context_positions, masked_attention, fallback.assert_global_metadata)


def _register_names() -> None:
    """Print the helpers under their own names (``redistribute(...)``, not a module path)."""
    from torch.fx.graph import _register_custom_builtin

    for fn in HELPERS:
        _register_custom_builtin(fn.__name__, f"from {fn.__module__} import {fn.__name__}", fn)


_register_names()


def has_dtensor_rule(op) -> bool:
    """Whether DTensor dispatch handles ``op`` without a probe: a registered sharding strategy or
    rule, a custom handler, or a composite op (decomposed before DTensor sees it)."""
    from torch._ops import OpOverload

    if not isinstance(op, OpOverload):
        return True                         # operator.getitem and other Python callables
    disp = DTensor._op_dispatcher
    sp = disp.sharding_propagator
    for table in (sp.op_strategy_funcs, sp.op_to_rules, getattr(sp, "op_single_dim_strategy_funcs", {}),
                  getattr(disp, "_custom_op_handlers", {})):
        if op in table:
            return True
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")

