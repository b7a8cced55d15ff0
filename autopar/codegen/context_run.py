"""Context parallelism at run time: what the executor does differently when a plan splits every
sequence over cp ranks (``plan.context_parallel`` > 1; the planner's side is ``solver/context.py``).

- The batch is *folded* (``context_attention.fold``): each sequence's cp chunks become rows of a
  batch of dp x cp blocks, so rank (d, c) of the graph's DATA axis (dp x cp ranks, ``Plan``'s
  module docstring) receives exactly its rows' chunk c by the usual Shard(0). The chunk order is
  zig-zag (two of 2 cp pieces per rank: causal attention's work is balanced); token-wise ops do
  not care, the loss is a mean over all tokens, and outputs are unfolded for the user.
- Position sources (``solver/context.position_sources``: ``arange(0, T)``, a RoPE table's first
  T rows), traced at the chunk's length, are replaced by this rank's global positions.
- ``scaled_dot_product_attention`` runs through the cp engine (ring or Ulysses) on local tensors;
  on DTensors (tp > 1) each rank's local heads go through it and come back with the same
  placements (heads and batch are sharded independently of the cp chunks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor, Replicate as TReplicate, Shard as TShard

from autopar.codegen import context_attention as ca
from autopar.codegen.shards import contiguous_stride

ORDER = "zigzag"      # the chunk order every context-parallel run uses (``context_attention``)


@dataclass(frozen=True)
class ContextRun:
    """One rank's context-parallel state: its cp group and coordinate, the plan's mode and the
    positions of its chunk (every cp rank's, for Ulysses and ring masks)."""
    group: Any                       # the cp ranks' process group
    rank: int                        # this rank's coordinate on the cp axis
    n: int                           # cp
    mode: str                        # "ring" | "ulysses"
    seq_len: int                     # tokens per sequence (global)
    dp: int                          # data-parallel blocks of rows (the plan's dp)
    all_positions: tuple[torch.Tensor, ...]

    @staticmethod
    def make(group, rank: int, n: int, mode: str, seq_len: int, dp: int, device) -> "ContextRun":
        pos = tuple(ca.chunk_positions(seq_len, n, r, ORDER).to(device) for r in range(n))
        return ContextRun(group, rank, n, mode, seq_len, dp, pos)

    @property
    def positions(self) -> torch.Tensor:
        return self.all_positions[self.rank]

    @property
    def local_len(self) -> int:
        return self.seq_len // self.n

    def _seq_dim(self, x: torch.Tensor) -> Optional[int]:
        return 1 if x.dim() >= 2 and x.shape[1] == self.seq_len else None

    def fold(self, x: torch.Tensor) -> torch.Tensor:
        """A global batch tensor (rows first; the sequence on dim 1, or per row) -> its folded form."""
        if x.dim() == 0:
            return x
        return ca.fold(x, dp=self.dp, n=self.n, seq_dim=self._seq_dim(x), order=ORDER)

    def unfold(self, y: torch.Tensor) -> torch.Tensor:
        """A folded output with the chunk on dim 1 -> the global batch's (rows, sequence, ...)."""
        if y.dim() < 2 or y.shape[1] != self.local_len:
            raise ValueError(f"the model's output {tuple(y.shape)} has no sequence dim of the chunk length "
                             f"{self.local_len} on dim 1, so its context-parallel pieces cannot be reassembled; "
                             "return (batch, sequence, ...) from forward, or re-plan with --force cp=1")
        return ca.unfold(y, dp=self.dp, n=self.n, seq_dim=1, order=ORDER)

    # ---- the graph's nodes ----------------------------------------------------------------------

    def position_value(self, target: str, out, args) -> Any:
        """The value of a position source for this rank's chunk (``out``: what the node computed
        at the chunk's length, which gives the dtype and, for DTensors, mesh and placements)."""
        if "arange" in target:
            local = self.positions.to(_local(out).dtype)
        else:                                   # aten.slice.Tensor(table, 0, 0, T)
            local = _local(args[0]).index_select(0, self.positions)
        if isinstance(out, DTensor):
            return DTensor.from_local(local, out.device_mesh, out.placements, run_check=False)
        return local

    def attention(self, args, kwargs):
        """``aten.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0, is_causal,
        scale=)`` over the cp ranks."""
        q, k, v = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
        causal = bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))
        scale = args[6] if len(args) > 6 else kwargs.get("scale")
        if (args[7] if len(args) > 7 else kwargs.get("enable_gqa", False)):
            raise NotImplementedError("context-parallel attention takes k/v with the queries' heads (enable_gqa "
                                      "is not supported)")
        if mask is not None or dropout:
            raise NotImplementedError("context-parallel attention runs without an attention mask or dropout "
                                      "(the planner refuses such models: re-plan)")
        engine = ca.ring_attention if self.mode == "ring" else ca.ulysses_attention
        if not isinstance(q, DTensor):
            return engine(q, k, v, group=self.group, rank=self.rank, n=self.n, positions=self.positions,
                          all_positions=list(self.all_positions), causal=causal, scale=scale)
        q, k, v = (_heads_only(x) for x in (q, k, v))
        out = engine(q.to_local(), k.to_local(), v.to_local(), group=self.group, rank=self.rank, n=self.n,
                     positions=self.positions, all_positions=list(self.all_positions), causal=causal,
                     scale=scale)
        shape = torch.Size(tuple(q.shape[:-1]) + (v.shape[-1],))
        return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False, shape=shape,
                                  stride=contiguous_stride(shape))


def _local(x):
    return x.to_local() if isinstance(x, DTensor) else x


def _heads_only(x: DTensor) -> DTensor:
    """``x`` (b, h, t, d) with only its batch and heads sharded (a sequence or head-dim shard, or a
    Partial, is gathered first: the cp engine owns the sequence)."""
    want = tuple(p if isinstance(p, TShard) and p.dim in (0, 1) else TReplicate() for p in x.placements)
    return x if want == tuple(x.placements) else x.redistribute(x.device_mesh, want)

