"""Constant attention masks checked on the first step (those the trace could not fold).

``trace/causal_masks.py`` folds a constant causal mask into ``is_causal=True`` when its subgraph
is small enough to evaluate on the CPU at trace time. At training sizes (HF's (B, 1, T, T) index
tensors over the global batch) it is not, and every step would rebuild the mask and run masked
attention: no fused kernel, no causal fast path, and shards that cannot stay local.

``RuntimeCausalMasks`` finds those attention calls (a mask computed from constants only) and,
the first time each mask is computed on the training device, checks it where it lies: every
rank tests its own piece (Replicate, or sharded on batch / head dims; a shard of the last two
dims or a Partial counts as "not causal") and the ranks agree by a MIN all-reduce of one flag, so
every rank takes the same path. From the next step on (``begin_step``; the rest of the first
step, recompute replays included, runs as traced) a causal verdict makes that attention
``is_causal=True`` without the mask (``call``), and the mask's subgraph, read by nothing else, is
no longer computed (``skip``: the executor stores None for those nodes). A verdict is kept for the
executor's life: the subgraph reads no input, so later steps would compute the same mask.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import fx

from autopar.trace.causal_masks import (SDPA, causal_call, constant_subgraph, is_causal_mask,
                                        sdpa_mask, unused_after_fold)


class RuntimeCausalMasks:
    """The attention calls of one graph with a constant, not yet folded mask (module docstring)."""

    def __init__(self, graph: fx.Graph) -> None:
        self._mask_of: dict[str, fx.Node] = {}          # attention node -> its constant mask
        self._users: dict[fx.Node, list[fx.Node]] = {}  # mask -> its attention nodes
        self._subgraph: dict[fx.Node, list[fx.Node]] = {}
        self.verdicts: dict[str, bool] = {}             # mask name -> causal on every rank
        self.active: set[str] = set()                  # causal masks dropped from the calls
        self.skip: set[str] = set()                     # nodes no longer computed
        for node in graph.nodes:
            if node.op != "call_function" or node.target is not SDPA:
                continue
            mask, causal = sdpa_mask(node)
            if mask is None or causal:
                continue
            if mask not in self._subgraph:
                nodes = constant_subgraph(mask)
                if nodes is None:
                    continue
                self._subgraph[mask] = nodes
            self._mask_of[node.name] = mask
            self._users.setdefault(mask, []).append(node)

    def mask_node(self, node: fx.Node) -> Optional[fx.Node]:
        """The constant mask of attention ``node`` whose verdict is still to come, or None."""
        mask = self._mask_of.get(node.name)
        return mask if mask is not None and mask.name not in self.verdicts else None

    def verify(self, node: fx.Node, mask, agree: Callable[[bool], bool]) -> None:
        """Decide ``node``'s mask from its value ``mask`` (a DTensor or this rank's plain piece);
        ``agree(flag)`` is True only if every rank's flag is."""
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        ok = agree(local_causal(mask, q.shape[-2], k.shape[-2]))
        self.verdicts[self._mask_of[node.name].name] = ok

    def begin_step(self) -> None:
        """Apply the causal verdicts reached so far (between steps, never inside one)."""
        for m, users in self._users.items():
            if self.verdicts.get(m.name) and m.name not in self.active:
                self.active.add(m.name)
                self.skip |= {n.name for n in unused_after_fold(self._subgraph[m], set(users))}

    def call(self, node: fx.Node) -> tuple[tuple, dict]:
        """``node``'s arguments: without the mask and with is_causal=True once it is verified causal."""
        mask = self._mask_of.get(node.name)
        if mask is not None and mask.name in self.active:
            return causal_call(node.args, node.kwargs)
        return node.args, node.kwargs


class MaskVerdicts:
    """The emitted modules' side (``emit_runtime.masked_attention``): per attention node with a
    constant mask, its verdict (reached the first time the mask is computed, every rank agreeing)
    and whether it is applied (from the next ``begin_step`` on, never inside a step). The mask is
    still computed each step (``skip`` stays empty): the module does not change between steps."""

    def __init__(self) -> None:
        self.verdicts: dict[str, bool] = {}
        self.active: set[str] = set()
        self.skip: frozenset = frozenset()

    def begin_step(self) -> None:
        self.active |= {k for k, ok in self.verdicts.items() if ok}


def agree_on_every_rank(flag: bool, device, log_paused) -> bool:
    """True only if ``flag`` is True on every rank (one MIN all-reduce, unlogged under ``log_paused()``)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([int(flag)], device=device)
    with log_paused():
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def local_causal(mask, tq: int, tk: int) -> bool:
    """Whether this rank's piece of ``mask`` is causal for ``tq`` queries and ``tk`` keys (a shard
    of the last two dims or a Partial counts as not causal)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(mask, DTensor):
        nd = mask.ndim
        if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % nd < nd - 2)
                   for p in mask.placements):
            return False
        mask = mask.to_local()
    return isinstance(mask, torch.Tensor) and is_causal_mask(mask, tq, tk)
