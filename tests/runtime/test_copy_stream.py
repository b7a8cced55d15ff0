"""Offload's copies beside the compute (``runtime/copy_stream.py``) and the backward's prefetch of
saved activations (``runtime/offload.ActivationOffload``). The CUDA side stream itself runs in
``tests/runtime/test_gpu.py`` (``-m gpu``); here the prefetch's bookkeeping runs on CPU copies
that say they overlap."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.runtime.copy_stream import STREAM_ENV, Copies, side_stream_enabled
from autopar.runtime.offload import ActivationOffload


class _Overlapping(Copies):
    """Synchronous CPU copies that let the offload prefetch as on a side stream."""
    overlapped = True


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32)]
    return nn.Sequential(*layers)


def _grads(model, x, hooks=None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    ctx = hooks() if hooks is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with ctx:
        model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_backward_prefetches_the_next_saved_tensor_it_needs():
    model = _model()
    x = torch.randn(16, 8, 32)
    want = _grads(model, x)
    off = ActivationOffload(torch.device("cpu"), lambda: {p.untyped_storage().data_ptr() for p in model.parameters()})
    off.copies = _Overlapping(torch.device("cpu"))
    ahead = []
    take = off._unpack

    def watched(saved):                 # at most one prefetched tensor waits at any unpack
        ahead.append(len(off._ahead))
        return take(saved)

    off._unpack = watched
    got = _grads(model, x, off.hooks)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert off.unpacked >= 4 * 4 and max(ahead) <= 1
    # the backward runs the forward in reverse: every unpack but the first finds its tensor prefetched
    assert off.prefetched == off.unpacked - 1, (off.prefetched, off.unpacked)
    assert not off._ahead and not off._order             # nothing held past the step


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
