"""Memory the runtime must give back, checked on one process without a process group.

- ``runtime/reshard.acyclic``: a saved-tensor hook that keeps an op's output as it is closes a
  reference cycle (the output's ``grad_fn`` is the node saving it) that Python's collector cannot
  see through. A backward that runs the node frees it; one that does not (``autograd.grad`` with
  ``retain_graph=True`` that a later call never finishes: the zero-bubble schedules' input pass,
  whose input-only nodes no weight pass runs) used to leak the graph for good. ``Observed``'s hooks
  detach what they keep.
- ``reducer._copy_rows``: ZeRO 1/2's gathered rows copied into a parameter in place (no temporary
  of the parameter's size), padded last chunk included.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from autopar.runtime.reducer import _copy_rows
from autopar.runtime.reshard import Observed


class _Keep(Observed):
    """Hooks that keep every saved tensor as it is (what Reshard / Regather do with most)."""

    def __init__(self) -> None:
        self._observers = []

    def _pack(self, t):
        return t

    def _unpack(self, saved):
        return saved


def _attention_like(hooks):
    """Input -> linear -> softmax(q k^T) v -> linear, under ``hooks``; returns (input, output, a
    weak reference to the softmax output, which its own backward node saves)."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)
    x = torch.randn(2, 8, 16, requires_grad=True)
    with hooks:
        q, k, v = lin1(x).view(2, 8, 3, 16).unbind(2)
        a = torch.softmax(q @ k.transpose(1, 2), -1)
        y = lin2(a @ v)
    return x, y, weakref.ref(a)


@pytest.mark.parametrize("observed", [False, True])
def test_input_pass_graph_is_freed(observed):
    """Only the input gradient, the graph retained (a zero-bubble input pass), then everything
    dropped: the softmax output is gone with the hooks of ``Observed``, and kept for good by a plain
    pack hook that returns the tensor itself (torch's behaviour: the reason for ``acyclic``)."""
    hooks = _Keep().hooks() if observed else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    x, y, softmax_out = _attention_like(hooks)
    torch.autograd.grad(y.sum(), [x], retain_graph=True)
    del x, y
    gc.collect()
    assert (softmax_out() is None) == observed


def test_detached_saved_tensors_give_the_same_gradients():
    x, y, _ = _attention_like(_Keep().hooks())
    g_obs = torch.autograd.grad(y.sum(), [x])[0]
    x, y, _ = _attention_like(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    assert torch.equal(g_obs, torch.autograd.grad(y.sum(), [x])[0])


@pytest.mark.parametrize("numel,dp,width", [(12, 4, 3), (10, 4, 3), (9, 4, 3), (1, 2, 1), (7, 2, 4), (3, 4, 1)])
def test_copy_rows(numel, dp, width):
    """dp chunks of ``width`` (the last ones padded) read row by row, from a strided slice of the
    gathered bucket, as ``rows.reshape(-1)[:numel]`` would."""
    bucket = torch.arange(dp * (width + 3), dtype=torch.float32).view(dp, width + 3)
    rows = bucket[:, 2: 2 + width]
    dst = torch.full((numel,), -1.0)
    _copy_rows(dst, rows)
    assert torch.equal(dst, rows.reshape(-1)[:numel])
