"""Offload's copies beside the compute (``runtime/copy_stream.py``) and the backward's prefetch of
saved activations (``runtime/activation_offload.ActivationOffload``). The CUDA side stream itself runs in
``tests/runtime/test_gpu.py`` (``-m gpu``); here the prefetch's bookkeeping runs on CPU copies
that say they overlap."""
from __future__ import annotations

import pytest
import torch

from autopar.runtime.copy_stream import STREAM_ENV, Copies, side_stream_enabled
from autopar.runtime.activation_offload import ActivationOffload


class _Overlapping(Copies):
    """Synchronous CPU copies that let the offload prefetch as on a side stream."""
    overlapped = True


def _grads(model, inputs, loss_fn, target, hooks=None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    ctx = hooks() if hooks is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with ctx:
        loss_fn(model(*inputs), target).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_backward_prefetches_the_saved_tensors_it_needs_next():
    """gpt-tiny (attention saves q, k, v, its output and more: nodes that unpack several tensors)
    with its activations offloaded and prefetched: the same gradients as without, nearly every
    tensor found prefetched, never more than the largest saved tensor's bytes waiting, and nothing
    held past the step."""
    from autopar.models import build_model

    b = build_model("gpt-tiny", batch=4, device="cpu")
    gen = torch.Generator().manual_seed(1)
    x, y = b.make_batch(4, gen)
    want = _grads(b.module, x, b.loss_fn, y)
    params = {p.untyped_storage().data_ptr() for p in b.module.parameters()}
    off = ActivationOffload(torch.device("cpu"), lambda: params)
    off.copies = _Overlapping(torch.device("cpu"))
    waiting = []
    take = off._unpack

    def watched(saved):
        waiting.append(sum(u.tensor.nbytes for u in off._ahead.values()))
        return take(saved)

    sizes = []
    to_host = off.to_host

    def sent(local):
        sizes.append(local.nbytes)
        return to_host(local)

    off._unpack, off.to_host = watched, sent
    got = _grads(b.module, x, b.loss_fn, y, off.hooks)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert off.unpacked == len(sizes) >= 2 * 8
    # 26 of 29: the backward's first, and per layer attention's q, which it unpacks first of its
    # five although packed first (the window, the largest saved tensor's bytes, ends one short);
    # one tensor at a time would miss all five attention tensors (20 of 29)
    assert off.prefetched >= 0.85 * off.unpacked, (off.prefetched, off.unpacked)
    assert 0 < max(waiting) <= max(sizes)
    assert not off._ahead and not off._order


def test_cpu_copies_are_synchronous_and_not_overlapped():
    copies = Copies(torch.device("cpu"))
    assert not copies.overlapped
    t = torch.arange(6.0).view(2, 3).t()                # transposed: the host copy is contiguous,
    host = copies.down(t)                               # the device copy gets the layout back
    assert torch.equal(host, t) and host.is_contiguous()
    back = copies.up(host, Copies.dense_stride(t)).get()
    assert torch.equal(back, t) and back.stride() == t.stride()
    q = torch.arange(24.0).view(2, 12)[:, 4:8].view(2, 2, 2).transpose(0, 1)   # a gappy view (q of a fused qkv)
    assert Copies.dense_stride(q) == torch.empty_like(q).stride()
    assert torch.equal(copies.up(copies.down(q), Copies.dense_stride(q)).get(), q)
    buf = torch.empty(6)
    assert copies.down(t.contiguous(), out=buf) is buf and torch.equal(buf, t.reshape(-1))


def test_side_stream_switch(monkeypatch):
    monkeypatch.delenv(STREAM_ENV, raising=False)
    assert side_stream_enabled(torch.device("cuda")) and not side_stream_enabled(torch.device("cpu"))
    monkeypatch.setenv(STREAM_ENV, "0")
    assert not side_stream_enabled(torch.device("cuda"))
    monkeypatch.setenv(STREAM_ENV, "yes")
    with pytest.raises(ValueError, match="use 1 .* or 0"):
        side_stream_enabled(torch.device("cuda"))


class _Event:
    """A CUDA event's stand-in: done once waited for (or when told so)."""

    def __init__(self, log, name, done=False):
        self.log, self.name, self.done = log, name, done

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append(self.name)
        self.done = True


def test_copies_down_are_throttled_to_twice_the_largest_in_flight():
    """The side stream's copies down: once more than twice the largest tensor sent is in flight,
    the host waits for the oldest (the device must not keep what it is offloading); copies already
    done leave the queue without a wait."""
    copies = Copies(torch.device("cpu"))
    waited = []
    for i, nbytes in enumerate((100, 100, 100, 50, 300)):
        copies._throttle(_Event(waited, i), nbytes)
    # 100, 200, 300 > 200 -> wait 0; then 100 + 100 + 50 = 250 > 200 -> wait 1; then 50 + 300 < 600
    assert waited == [0, 1] and [e.name for e, _ in copies._in_flight] == [2, 3, 4]
    copies._throttle(_Event(waited, 5), 10)                            # 460 <= 600: no wait
    copies._in_flight[0][0].done = True                                # copy 2 finished by itself
    copies._throttle(_Event(waited, 6), 10)                            # leaves without a wait
    assert [e.name for e, _ in copies._in_flight] == [3, 4, 5, 6] and waited == [0, 1]
