"""Data-parallel gradient reduction and ZeRO parameter gathers, bucketed (see ``runtime/params.py``).

After backward every rank holds, per parameter, its tp-local gradient SUMMAND over dp. Per bucket
(``codegen/buckets.py``), one collective on the dp group (the DATA axis of the mesh,
``autopar.mesh.DATA``; its records carry that axis' name):

    ZeRO 0, 1   all_reduce      flat concat of the bucket's gradients; ZeRO-1 then hands each
                                rank's optimizer a view of its rows
    ZeRO 2, 3   reduce_scatter  input laid out rank-major ([rank 0's padded rows of every
                                parameter][rank 1's ...]), output = this rank's rows
    after the optimizer step, ZeRO 1, 2: all_gather of the updated rows, same layout

Mixed precision (``runtime/precision.py``): with ``reduce_dtype`` a bucket is cast to it before
its collective and back to the parameters' dtype after (the bytes the plan priced).

Micro-batches: the hooks are ``arm``ed only for the last micro-batch of a step, so the earlier
ones accumulate into ``.grad`` and each bucket is reduced once per step.

Overlap (ZeRO 0-2): a post-accumulate-grad hook on every parameter counts its bucket down; full
buckets are launched asynchronously in bucket order (the same order on every rank, whatever order
the hooks fire in) while backward goes on; ``reduce`` launches what is left (unused parameters
contribute zeros) and waits. ZeRO-3 gradients arrive through ``_UseParam`` and are reduced after
backward.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from autopar.codegen.buckets import DEFAULT_BUCKET_BYTES, plan_buckets
from autopar.mesh import DATA
from autopar.runtime.params import ParamSlot, ParamStore


class GradReducer:
    def __init__(self, store: ParamStore, bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True,
                 reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.store = store
        self.reduce_dtype = reduce_dtype          # mixed precision: buckets cross dp in this dtype
        self.slots = store.slots
        self.buckets = plan_buckets([s.layout for s in self.slots], bucket_bytes)
        ctx = store.ctx
        self.dp, self.stage, self.group, self.log = ctx.dp, ctx.zero_stage, ctx.dp_group, ctx.log
        self.overlap = overlap and self.dp > 1 and self.stage in (0, 1, 2)
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self.begin_step()
        if self.overlap:
            for i, s in enumerate(self.slots):
                s.local.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))

    def arm(self, armed: bool) -> None:
        """Whether gradients arriving now start their bucket's reduction (overlap). Off for all
        but the last micro-batch of a step (earlier ones only accumulate, as DDP's ``no_sync``) and
        for a pipeline schedule (``reduce`` then launches every bucket after it)."""
        self._armed = armed

    def begin_step(self) -> None:
        self._armed = True
        self._pending = [len(b) for b in self.buckets]
        self._inflight: list = [None] * len(self.buckets)
        self._next = 0

    def _on_grad(self, i: int, _param) -> None:
        if not self._armed:
            return
        self._pending[self.bucket_of[i]] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        slots = [self.slots[i] for i in self.buckets[b]]
        if self.stage in (0, 1):
            flat = self._down(torch.cat([self._summand(s).reshape(-1) for s in slots]))
            self._inflight[b] = ("all_reduce", flat, None, dist.all_reduce(flat, group=self.group, async_op=True))
        else:
            send = self._down(self._interleave(slots))
            out = send.new_empty(send.numel() // self.dp)
            self._inflight[b] = ("reduce_scatter", send, out,
                                 dist.reduce_scatter_single(out, send, group=self.group, async_op=True))

    def _down(self, flat: torch.Tensor) -> torch.Tensor:
        return flat if self.reduce_dtype is None else flat.to(self.reduce_dtype)

    def _up(self, flat: torch.Tensor) -> torch.Tensor:
        """A reduced bucket back in the parameters' dtype."""
        return flat if self.reduce_dtype is None else flat.to(self.slots[0].local.dtype)

    def _summand(self, s: ParamSlot) -> torch.Tensor:
        g = s.full_grad if self.stage == 3 else s.local.grad
        if g is None:                        # unused this step: contributes zeros (every rank alike)
            g = torch.zeros(s.layout.local_shape, dtype=s.local.dtype, device=s.local.device)
        return g

    def reduce(self) -> None:
        """Reduce this step's gradient summands over dp; leave each optimizer parameter's .grad."""
        if self.dp == 1:
            for s in self.slots:
                if self.stage in (1, 2) and s.local.grad is not None:
                    s.opt_param.grad = s.local.grad.view(s.opt_param.shape)
            return
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        for b, bucket in enumerate(self.buckets):
            kind, buf, out, work = self._inflight[b]
            work.wait()
            self.log.add(kind, DATA, buf.numel() * buf.element_size(), "reducer")
            slots = [self.slots[i] for i in bucket]
            if kind == "all_reduce":
                self._finish_all_reduce(slots, self._up(buf))
            else:
                self._finish_reduce_scatter(slots, self._up(out))
        self.begin_step()

    def _finish_all_reduce(self, slots: list[ParamSlot], flat: torch.Tensor) -> None:
        offset = 0
        for s in slots:
            n = s.layout.numel
            s.local.grad = flat[offset: offset + n].view(s.layout.local_shape)
            offset += n
            if self.stage == 1:
                rows = s.local.grad.view(s.layout.rows, s.layout.row_numel)
                s.opt_param.grad = rows[s.rows[0]: s.rows[1]]

    def _interleave(self, slots: list[ParamSlot]) -> torch.Tensor:
        """Rank-major layout: [rank 0's padded rows of each parameter][rank 1's ...]."""
        dp = self.dp
        pieces = []
        for s in slots:
            lay = s.layout
            c = lay.chunk_rows(dp)
            g = self._summand(s).reshape(lay.rows, lay.row_numel)
            if c * dp != lay.rows:
                g = torch.cat([g, g.new_zeros(c * dp - lay.rows, lay.row_numel)])
            pieces.append(g.view(dp, c * lay.row_numel))
        send = torch.cat(pieces, dim=1).reshape(-1)
        for s in slots:                      # the full summands are no longer needed
            s.local.grad = None if self.stage == 2 else s.local.grad
        return send

    def _finish_reduce_scatter(self, slots: list[ParamSlot], out: torch.Tensor) -> None:
        dp = self.dp
        offset = 0
        for s in slots:
            lay = s.layout
            c = lay.chunk_rows(dp)
            mine = out[offset: offset + c * lay.row_numel].view(c, lay.row_numel)[: s.rows[1] - s.rows[0]]
            offset += c * lay.row_numel
            s.opt_param.grad = mine.view(s.opt_param.shape)
            s.full_grad = None

    @torch.no_grad()
    def gather_params(self) -> None:
        """ZeRO 1/2: after the optimizer updated this rank's rows, all-gather every parameter."""
        if self.stage not in (1, 2) or self.dp == 1:
            return
        dp = self.dp
        for bucket in self.buckets:
            slots = [self.slots[i] for i in bucket]
            pieces = []
            for s in slots:
                lay = s.layout
                c = lay.chunk_rows(dp)
                mine = s.opt_param.reshape(-1)
                if mine.numel() != c * lay.row_numel:
                    mine = torch.cat([mine, mine.new_zeros(c * lay.row_numel - mine.numel())])
                pieces.append(mine)
            send = torch.cat(pieces)
            out = send.new_empty(send.numel() * dp)
            dist.all_gather_single(out, send, group=self.group)
            self.log.add("all_gather", DATA, out.numel() * out.element_size(), "zero")
            gathered = out.view(dp, -1)
            offset = 0
            for s in slots:
                lay = s.layout
                w = lay.chunk_rows(dp) * lay.row_numel
                rows = gathered[:, offset: offset + w].reshape(-1)[: lay.numel]
                s.local.data.view(-1).copy_(rows)
                offset += w


__all__ = ["GradReducer", "DEFAULT_BUCKET_BYTES"]
