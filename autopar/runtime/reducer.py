"""Data-parallel gradient reduction and ZeRO parameter gathers, bucketed (see ``runtime/params.py``).

After backward every rank holds, per parameter, its tp-local gradient SUMMAND over dp. Per bucket
(``codegen/buckets.py``), one collective on the dp group (the DATA axis of the mesh,
``autopar.mesh.DATA``; its records carry that axis' name):

    ZeRO 0      all_reduce      in place, on the bucket buffer the gradients live in (below)
    ZeRO 1-3    reduce_scatter  input laid out rank-major ([rank 0's padded rows of every
                                parameter][rank 1's ...]), output = this rank's rows (each rank's
                                optimizer updates only those: the ZeRO paper's 2 x params of
                                traffic with the all-gather below, not an all-reduce's 2 more)
    after the optimizer step, ZeRO 1, 2: all_gather of the updated rows, same layout

Memory (what the plan's model, ``cost/memory.py``, counts: one copy of the gradients for ZeRO 0/1,
grads / dp for ZeRO 2/3; the runtime's ZeRO-1 keeps what its ZeRO-2 keeps, the summands until their
bucket's reduce-scatter, less than the plan counts):

- ZeRO 0 (dp > 1), DDP's ``gradient_as_bucket_view``: each bucket has one flat buffer and every
  parameter's ``.grad`` is a view of its slice. A post-accumulate-grad hook moves a fresh ``.grad``
  (the step's first: autograd made a new one) into its slice and replaces it by the view; later
  micro-batches then accumulate in place (autograd adds into a defined ``.grad``). A parameter
  without a gradient gets its slice zeroed when the bucket is launched. The buffer is allocated
  when the bucket's first gradient of a step arrives; after the step only the gradients (its
  views) hold it, so ``zero_grad`` (set to None) frees it. As in the plan's peak model
  (``cost.memory.step_peak_bytes``), gradients then start each step unallocated: a buffer kept
  from step to step would sit beside the forward's activations (gpt-tiny, dp=2: peak +14 %).
- ZeRO 1-3: the send buffer is filled parameter by parameter and each full summand is dropped as
  soon as it is copied in; the send buffer is dropped when its collective has finished.
- A bucket's transient buffers (ZeRO 1-3's send buffer and output; ``reduce_dtype``'s cast) stay
  bounded: launching bucket b first finishes every bucket before b - 1, before b's buffers are
  made (at most two buckets' buffers at once), and a finished bucket drops its ``Work`` (gloo's
  keeps its tensors alive).

Mixed precision (``runtime/precision.py``): with ``reduce_dtype`` a bucket is cast to it before
its collective (a copy, one bucket at a time) and back to the parameters' dtype after (ZeRO 0:
into the bucket buffer, in place).

Micro-batches (m > 1):
- ZeRO 0/1, and every pipeline schedule: the hooks are ``arm``ed only for the last micro-batch of
  a step, so the earlier ones accumulate their summands in place and each bucket is reduced once
  per step (DDP's ``no_sync``; one copy of the gradients, as the plan counts for ZeRO 0/1 and,
  ``solver.overlap.reduces_once_per_step``, for pipelined ZeRO 2/3). Under a pipeline schedule the
  last backward is per stage: ``last_backward(indices)`` arms a stage's own parameters while torch
  runs its last backward (or weight pass) of the step, so their buckets are reduced beside the
  stages' remaining backwards, as the plan prices it (Megatron's overlap-grad-reduce does the
  same); a parameter two stages read (tied, on this rank or over pp: summed after the schedule)
  waits for ``reduce``.
- ZeRO 2/3 without a pipeline (``each_micro_batch``): every micro-batch's backward reduce-scatters
  its buckets (``end_micro_batch`` finishes the round), and each rank adds the reduced rows to its
  own 1/dp gradient, as DeepSpeed's ZeRO-2 and FSDP do: the gradients stay near grads / dp whatever
  m is, for m reduce-scatters per bucket (``solver/overlap.dp_sync`` prices them per micro-batch).

Overlap: full buckets are launched asynchronously in bucket order (the same order on every rank,
whatever order gradients complete in) while backward goes on; ``reduce`` launches what is left
(unused parameters contribute zeros), waits, and logs every bucket's collective in bucket order.
A parameter's gradient is complete
- ZeRO 0-2: at its post-accumulate-grad hook (autograd sums every use within one backward);
- ZeRO-3: when the last of the graph scopes that read it in this micro-batch's forward ran its
  ``_UseParam.backward`` (``ParamSlot.open_scopes`` back to 0: tied weights, a recompute region
  and the main graph are several scopes). A scope that never runs backward (its output does not
  reach the loss) keeps the bucket for ``reduce``. Backward runs in the same order on every rank,
  so the launches, and the collectives around them on the dp group (ZeRO-3's re-gathers), keep
  one order everywhere.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from autopar.codegen.buckets import DEFAULT_BUCKET_BYTES, plan_buckets
from autopar.mesh import DATA
from autopar.runtime.collectives import collective_range, release, wait_for
from autopar.runtime.params import ParamSlot, ParamStore, chunk_numel


@dataclasses.dataclass
class _Flight:
    """A launched bucket collective."""
    kind: str                          # "all_reduce" | "reduce_scatter"
    nbytes: int                        # what it moves (logged by ``reduce``)
    work: Any
    send: Optional[torch.Tensor]       # its input (ZeRO 0/1: the bucket buffer or its cast)
    out: Optional[torch.Tensor]        # reduce_scatter's output


class GradReducer:
    def __init__(self, store: ParamStore, bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True,
                 reduce_dtype: Optional[torch.dtype] = None, pipelined: bool = False) -> None:
        self.store = store
        # called with a bucket's slots once their optimizer gradients are reduced (offload's copy to
        # the host, ``runtime/offload.py``); None: nothing to do
        self.on_reduced: Optional[Any] = None
        self.on_reduced_frees = False             # ... and the device copies are dropped after it
        self.reduce_dtype = reduce_dtype          # mixed precision: buckets cross dp in this dtype
        self.slots = store.slots
        self.buckets = plan_buckets([s.layout for s in self.slots], bucket_bytes)
        ctx = store.ctx
        self.dp, self.stage, self.group, self.log = ctx.dp, ctx.zero_stage, ctx.dp_group, ctx.log
        self.overlap = overlap and self.dp > 1
        self.views = self.dp > 1 and self.stage == 0           # gradients live in the bucket buffers
        # ZeRO 2/3 keep grads / dp through the micro-batches: each one's backward reduce-scatters
        self.each_micro_batch = self.dp > 1 and self.stage >= 2 and not pipelined
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self.index_of = {s.name: i for i, s in enumerate(self.slots)}
        self._offset: dict[int, int] = {}         # slot index -> its first element in its bucket buffer
        self._numel: list[int] = []
        for bucket in self.buckets:
            n = 0
            for i in bucket:
                self._offset[i] = n
                n += self.slots[i].layout.numel
            self._numel.append(n)
        self.begin_step()
        if self.stage == 3:
            if self.overlap:
                ctx.on_full_grad = self._on_full_grad
        elif self.views or self.overlap:
            for i, s in enumerate(self.slots):
                s.local.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))

    @property
    def armed(self) -> bool:
        """Whether gradients completed now start their reduction: the step's last micro-batch (its
        gradients are the step's) or, ``each_micro_batch``, any."""
        return self._armed

    def arm(self, armed: bool, last: bool = True) -> None:
        """Whether gradients completed now start their bucket's reduction (overlap): on for the
        step's last micro-batch (``last``) and, ``each_micro_batch``, for every one; off for the
        earlier ones otherwise (they only accumulate, as DDP's ``no_sync``) and for a pipeline
        schedule (``reduce`` then launches every bucket after it). Called before each micro-batch's
        forward: ZeRO-3 counts that forward's scopes afresh."""
        self._armed = armed
        self._last = last
        for s in self.slots:
            s.open_scopes = 0

    @contextlib.contextmanager
    def last_backward(self, indices: frozenset):
        """A pipeline stage's last backward (or weight pass) of the step runs inside: the slots
        ``indices`` (read by that stage only) complete at their gradient hook (ZeRO-3: once the
        scopes of every micro-batch's forward ran their backward, ``ParamSlot.open_scopes``, which a
        pipeline counts over the whole step) and their buckets launch as they fill. dp == 1: nothing."""
        self._early = indices if self.overlap else frozenset()
        try:
            yield
        finally:
            self._early = frozenset()

    def begin_step(self) -> None:
        self._armed = self._last = True
        self._early: frozenset = frozenset()       # slots a pipeline stage's last backward completes
        self._done: list[_Flight] = []             # this step's finished rounds (micro-batches)
        self._begin_round()

    def _begin_round(self) -> None:
        self._pending = [len(b) for b in self.buckets]
        self._inflight: list[Optional[_Flight]] = [None] * len(self.buckets)
        self._next = 0                             # buckets launched: [0, _next)
        self._finished = 0                         # buckets finished: [0, _finished)
        # ZeRO-0 bucket buffers of this step (the last step's live on in its gradients' views)
        self._flat: list[Optional[torch.Tensor]] = [None] * len(self.buckets)

    # ---- gradients arriving (backward) -------------------------------------------------------
    def _on_grad(self, i: int, _param) -> None:
        """ZeRO 0-2: parameter ``i``'s ``.grad`` was accumulated (post-accumulate-grad hook)."""
        if self.views:
            self._into_bucket(i)
        if self.overlap and (self._armed or i in self._early):
            self._complete(i)

    def _on_full_grad(self, slot: ParamSlot) -> None:
        """ZeRO-3: one scope of ``slot`` added its gradient to ``slot.full_grad``."""
        i = self.index_of[slot.name]
        if self.bucket_of[i] < self._next:       # its send buffer is built: this summand would be lost
            raise RuntimeError(
                f"ZeRO-3: a gradient of {slot.name} arrived after its bucket's reduce-scatter was launched "
                "(a graph scope read it without being counted by ParamStore.use); read parameters only "
                "through ParamStore.use(name) with grad enabled, or build the GradReducer with overlap=False")
        if (self._armed or i in self._early) and slot.open_scopes == 0:
            self._complete(i)

    def _complete(self, i: int) -> None:
        """Parameter ``i``'s gradient of this step is complete: launch every full bucket, in order."""
        self._pending[self.bucket_of[i]] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s slice of its bucket buffer (allocated on first use), shaped like it."""
        b, s = self.bucket_of[i], self.slots[i]
        if self._flat[b] is None:
            self._flat[b] = torch.empty(self._numel[b], dtype=s.local.dtype, device=s.local.device)
        a = self._offset[i]
        return self._flat[b][a: a + s.layout.numel].view(s.layout.local_shape)

    def _into_bucket(self, i: int) -> None:
        """Make parameter ``i``'s ``.grad`` its bucket view: a gradient made elsewhere (the step's
        first, or one a pipeline's tied-weight sum replaced) is copied in; none: zeros."""
        s = self.slots[i]
        view, g = self._view(i), s.local.grad
        if g is not None and g.data_ptr() == view.data_ptr() and g.stride() == view.stride():
            return
        if g is None:
            view.zero_()
        else:
            view.copy_(g)
        s.local.grad = view

    # ---- collectives -------------------------------------------------------------------------
    def _launch(self, b: int) -> None:
        self._finish_until(b - 1)                # before b's buffers exist: at most two buckets' at once
        slots = [self.slots[i] for i in self.buckets[b]]
        if self.stage == 0:
            for i in self.buckets[b]:
                self._into_bucket(i)
            flat = self._flat[b]
            send = flat if self.reduce_dtype is None else flat.to(self.reduce_dtype)
            nbytes = send.numel() * send.element_size()
            with collective_range("all_reduce", DATA, nbytes):
                work = dist.all_reduce(send, group=self.group, async_op=True)
            self._inflight[b] = _Flight("all_reduce", nbytes, work, send, None)
        else:
            send = self._interleave(slots)
            out = send.new_empty(send.numel() // self.dp)
            nbytes = send.numel() * send.element_size()
            with collective_range("reduce_scatter", DATA, nbytes):
                work = dist.reduce_scatter_single(out, send, group=self.group, async_op=True)
            self._inflight[b] = _Flight("reduce_scatter", nbytes, work, send, out)

    def _interleave(self, slots: list[ParamSlot]) -> torch.Tensor:
        """The send buffer in rank-major layout: [rank 0's padded rows of each parameter][rank 1's
        ...], in ``reduce_dtype`` if set. Each full summand is dropped once copied in."""
        dp, first = self.dp, slots[0].local
        widths = [chunk_numel(s, dp) for s in slots]
        send = torch.empty(dp, sum(widths), dtype=self.reduce_dtype or first.dtype,
                           device=self.store.ctx.device or first.device)
        offset = 0
        for s, w in zip(slots, widths):
            lay = s.layout
            c = lay.chunk_rows(dp)
            dst = send[:, offset: offset + w].view(dp, c, lay.row_numel)
            offset += w
            g = s.full_grad if self.stage == 3 else s.local.grad
            if g is None or not w:               # unused this step: contributes zeros (every rank alike)
                dst.zero_()
                continue
            g = g.reshape(lay.rows, lay.row_numel)
            full = lay.rows // c                 # ranks whose chunk is whole; then one partial, then empty
            dst[:full].copy_(g[: full * c].view(full, c, lay.row_numel))
            if full < dp:
                rest = lay.rows - full * c
                dst[full, :rest].copy_(g[full * c:])
                dst[full, rest:].zero_()
                dst[full + 1:].zero_()
            if self.stage == 3:                  # the full summand is no longer needed
                s.full_grad = None
            else:
                s.local.grad = None
        return send.view(-1)

    def _finish_until(self, b: int) -> None:
        """Wait for and finish the buckets before ``b`` (launched, in order)."""
        while self._finished < min(b, self._next):
            self._finish(self._finished)
            self._finished += 1

    def _finish(self, b: int) -> None:
        f = self._inflight[b]
        wait_for(f.work, f.kind, DATA, f.nbytes)
        slots = [self.slots[i] for i in self.buckets[b]]
        if f.kind == "all_reduce":
            flat = self._flat[b]
            if f.send is not flat:               # reduce_dtype: back to the parameters' dtype
                flat.copy_(f.send)
        else:
            out = f.out if self.reduce_dtype is None else f.out.to(slots[0].local.dtype)
            self._finish_reduce_scatter(slots, out)
        if f.send is not self._flat[b]:          # the interleaved or cast buffer: read, done with
            release(f.send)
        f.send = f.out = f.work = None           # a finished Work may still hold its tensors
        if self.on_reduced is not None and self._last:     # the step's gradients (the last round)
            self.on_reduced(slots)
            if self.on_reduced_frees:            # the bucket's gradients went to the host
                self._flat[b] = None

    def end_micro_batch(self) -> None:
        """``each_micro_batch``: after a micro-batch's backward other than the step's last, reduce
        what it left (every bucket, unused parameters as zeros) into each rank's rows."""
        if self.each_micro_batch:
            self._reduce_round()
            self._begin_round()

    def _reduce_round(self) -> None:
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        self._finish_until(len(self.buckets))
        self._done += self._inflight

    def reduce(self) -> None:
        """Reduce this step's gradient summands over dp; leave each optimizer parameter's .grad."""
        if self.dp == 1:
            for s in self.slots:
                if self.stage in (1, 2) and s.local.grad is not None:
                    s.opt_param.grad = s.local.grad.view(s.opt_param.shape)
                elif self.stage == 3 and s.full_grad is not None:     # parameter offload: the summand is the gradient
                    s.give_grad(s.full_grad.view(s.opt_param.shape))
                    s.full_grad = None
            return
        self._reduce_round()
        for f in self._done:                     # in bucket order per round, as before any overlap
            self.log.add(f.kind, DATA, f.nbytes, "reducer")
        self.begin_step()

    def _finish_reduce_scatter(self, slots: list[ParamSlot], out: torch.Tensor) -> None:
        dp = self.dp
        offset = 0
        for s in slots:
            lay = s.layout
            c = lay.chunk_rows(dp)
            mine = out[offset: offset + c * lay.row_numel].view(c, lay.row_numel)[: s.rows[1] - s.rows[0]]
            offset += c * lay.row_numel
            s.give_grad(mine.view(s.opt_param.shape), accumulate=self.each_micro_batch)
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
            nbytes = out.numel() * out.element_size()
            with collective_range("all_gather", DATA, nbytes):
                dist.all_gather_single(out, send, group=self.group)
            self.log.add("all_gather", DATA, nbytes, "zero")
            gathered = out.view(dp, -1)
            offset = 0
            for s in slots:
                lay = s.layout
                w = lay.chunk_rows(dp) * lay.row_numel
                _copy_rows(s.local.data.view(-1), gathered[:, offset: offset + w])
                offset += w


def _copy_rows(dst: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst`` (a parameter, flat) = the first ``dst.numel()`` elements of ``rows`` (dp x w, each
    rank's padded chunk; a strided slice of the gathered bucket) read row by row, copied in place:
    the full rows in one copy, the padded last one in a second, no temporary of the parameter's
    size (``rows.reshape(-1)`` would make one)."""
    w = rows.shape[1]
    full = min(dst.numel() // w, rows.shape[0])
    dst[: full * w].view(full, w).copy_(rows[:full])
    tail = dst.numel() - full * w
    if tail:
        dst[full * w:].copy_(rows[full, :tail])


__all__ = ["GradReducer", "DEFAULT_BUCKET_BYTES"]
