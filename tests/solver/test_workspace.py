"""``solver.layer_memory.workspace_bytes`` on hand-worked cases: a block of 100 saved bytes and 10
parameters (4 bytes each), the largest output's backward 30 bytes, ZeRO-3's gathers inside a layer's
backward: the layer in use and the next one prefetched, its output and send buffers (2 + 1/dp
layers, each a whole copy beside the rank's own rows: so at the measured peak of gpt-tiny's and a
30-layer GPT's ZeRO-3 steps, the storage tracker's live list).

- fp32, no recompute, dp=2: 30 + 2.5 x 10 x 4 = 130 (the gathers beside the backward's);
- + full recompute: + one re-materialized layer, 100: 230;
- parameters on the host (gathered over dp=2 as well): 30 + 100 + 100 = 230;
- autocast: the matmuls saved 16-bit copies, so the gathers peak in the (re-run) forward, not
  beside the backward's workspace: no recompute max(30, 100) = 100; with full recompute the re-run
  forward is in the backward, which gathers without prefetch (one layer: 10 x 4 = 40),
  100 + max(30, 40) = 140, and with the parameters on the host the same 140; per-op recompute keeps
  most activations through the forward, beside its prefetched layers: 20 (the attention core
  re-run) + max(30, 100) = 120;
- ``in_layer`` False (the head's or the embedding's backward): no re-materialized layer and no
  layer's gathers beside it (the backward gathers a layer when its backward starts): 30;
- ``forward_apart`` (the run's prediction counts the forward's gathers at their own peak): autocast
  without recompute leaves them out, 30; with full recompute the backward's one layer stays, 140.

``forward_gather_bytes``: at a layer's gather landing, its output buffer and its copies out (a layer
each) and a send buffer (1/dp of a layer): dp=2: 2.5 x 10 x 4 = 100, dp=4: 2.25 x 40 = 90; a tied
parameter of 3 elements gathered whole beside them: + 12; one rank with host rows copies two layers
up: 80; ZeRO below 3, or one rank without host rows: no gathers, 0.
"""
from types import SimpleNamespace

import pytest

from autopar.solver.layer_memory import forward_gather_bytes, workspace_bytes


def _cfg(**kw):
    base = dict(recompute="none", recompute_layers=None, zero=3, data=2, classes=())
    return SimpleNamespace(**{**base, **kw})


SUMMARY = SimpleNamespace(parts={"block": SimpleNamespace(saved_bytes=100.0, param_numel=10.0, core_saved_bytes=20.0,
                                                          rc=None)}, shared_param_numel=0.0)


@pytest.mark.parametrize("cfg, autocast, in_layer, want", [
    (_cfg(), False, True, 30 + 100),
    (_cfg(recompute="full"), False, True, 30 + 100 + 100),
    (_cfg(recompute="full", classes=("params",)), False, True, 30 + 100 + 100),
    (_cfg(data=1, classes=("params",)), False, True, 30 + 80),
    (_cfg(), True, True, 100),
    (_cfg(recompute="full"), True, True, 100 + 40),
    (_cfg(recompute="full", classes=("params",)), True, True, 100 + 40),
    (_cfg(recompute="full", zero=0), True, True, 100 + 30),
    (_cfg(recompute="selective"), True, True, 20 + 100),
    (_cfg(recompute="full"), False, False, 30),
    (_cfg(recompute="full"), True, False, 30),
])
def test_hand_worked(cfg, autocast, in_layer, want):
    got = workspace_bytes(SUMMARY, cfg, 30.0, 2, param_bytes=4, autocast=autocast, in_layer=in_layer)
    assert got == pytest.approx(want)


@pytest.mark.parametrize("recompute, want", [("none", 30), ("full", 100 + 40)])
def test_forward_apart_leaves_the_forward_gathers_out(recompute, want):
    got = workspace_bytes(SUMMARY, _cfg(recompute=recompute), 30.0, 2, param_bytes=4, autocast=True,
                          forward_apart=True)
    assert got == pytest.approx(want)


@pytest.mark.parametrize("cfg, shared, want", [
    (_cfg(), 0.0, 100),
    (_cfg(data=4), 0.0, 90),
    (_cfg(), 3.0, 100 + 12),
    (_cfg(data=1, classes=("params",)), 0.0, 80),
    (_cfg(data=1), 0.0, 0),
    (_cfg(zero=2), 0.0, 0),
])
def test_forward_gathers_hand_worked(cfg, shared, want):
    summary = SimpleNamespace(parts=SUMMARY.parts, shared_param_numel=shared)
    assert forward_gather_bytes(summary, cfg, param_bytes=4) == pytest.approx(want)
