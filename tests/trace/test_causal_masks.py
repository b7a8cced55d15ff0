"""Constant causal attention masks fold to is_causal=True (autopar/trace/causal_masks.py); every
other mask stays as traced, and the traced graph computes what the model computes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.trace import run_graph, trace_model
from autopar.trace.causal_masks import fold_causal_masks, is_causal_mask
from one_process import one_process_losses

T = 8


class MaskedAttention(nn.Module):
    """One attention layer whose mask ``kind`` is built in forward, as HF does."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(16, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 32)

    def mask(self, tokens):
        i = torch.arange(T, device=tokens.device)
        keep = i[None, :] <= i[:, None]                                   # causal
        if self.kind == "sliding":
            keep = keep & (i[:, None] - i[None, :] < 3)
        if self.kind == "padding":                                       # depends on the input
            keep = keep & (tokens != 0)[:, None, None, :]
        if self.kind == "additive":
            return torch.zeros(T, T, device=tokens.device).masked_fill(~keep, float("-inf"))
        return keep[None, None].expand(tokens.shape[0], 1, T, T) if keep.dim() == 2 else keep

    def forward(self, tokens):
        x = self.emb(tokens)
        q, k, v = self.qkv(x).view(tokens.shape[0], T, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(tokens))
        return self.out(y.transpose(1, 2).reshape(tokens.shape[0], T, 16))


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _sdpa_calls(ir):
    return [n for n in ir.graph_module.graph.nodes
            if n.target is torch.ops.aten.scaled_dot_product_attention.default]


@pytest.mark.parametrize("kind,folds", [("causal", True), ("additive", True), ("sliding", False),
                                        ("padding", False)])
def test_only_constant_causal_masks_fold(kind, folds):
    torch.manual_seed(0)
    model = MaskedAttention(kind)
    tokens = torch.randint(0, 16, (3, T))
    tokens[0, :2] = 0                                           # some padding for "padding"
    ir = trace_model(model, (tokens,), loss_fn=_loss, example_target=tokens, collapse_repeats=False)
    (call,) = _sdpa_calls(ir)
    assert (call.kwargs.get("is_causal") is True and len(call.args) == 3) is folds, call.format_node()
    if folds:        # the mask's subgraph is gone (nothing else used it), assertions included
        targets = {str(n.target) for n in ir.graph_module.graph.nodes}
        assert not {"aten.arange.default", "aten.le.Tensor", "aten.masked_fill.Scalar"} & targets
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    torch.testing.assert_close(run_graph(ir, tensors, (tokens,), tokens), _loss(model(tokens), tokens))


def test_is_causal_mask():
    keep = torch.ones(4, 6, dtype=torch.bool).tril()
    assert is_causal_mask(keep, 4, 6)                               # top-left, as sdpa's is_causal
    assert not is_causal_mask(torch.ones(4, 6, dtype=torch.bool).tril(2), 4, 6)   # bottom-right
    assert is_causal_mask(keep.expand(2, 3, 4, 6), 4, 6)
    assert not is_causal_mask(keep[None, None], 4, 7) and not is_causal_mask(keep[0], 1, 6)
    additive = torch.zeros(4, 6).masked_fill(~keep, float("-inf"))
    assert is_causal_mask(additive, 4, 6)
    assert not is_causal_mask(additive.masked_fill(~keep, -1e9), 4, 6)   # -1e9 is not -inf
    assert is_causal_mask(additive.masked_fill(~keep, torch.finfo(torch.float32).min), 4, 6)  # older HF
    assert not is_causal_mask(additive.masked_fill(keep, 1.0), 4, 6)     # kept entries must add 0
    assert not is_causal_mask(keep.long(), 4, 6)


def test_large_masks_are_left_alone():
    model = MaskedAttention("causal")
    tokens = torch.zeros(3, T, dtype=torch.long)
    ep = torch.export.export(model, (tokens,), strict=False)
    gm = ep.graph_module
    assert fold_causal_masks(gm, max_elements=T * T - 1) == 0      # the (T, T) comparison is too big
    assert fold_causal_masks(gm) == 1 and fold_causal_masks(gm) == 0


# ---- masks too large to fold at trace time: checked on the first training step ----------------

def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 16, (4, T), generator=gen) for _ in range(3)]


def _train(rank: int, world: int, kind: str, force: str, engine: str) -> dict:
    from autopar.api import autoparallelize
    from autopar.trace import causal_masks

    causal_masks.MAX_ELEMENTS = 0               # this rank only: nothing folds at trace time
    torch.manual_seed(0)
    data = _batches()
    pm = autoparallelize(MaskedAttention(kind), (data[0],), loss_fn=_loss, example_target=data[0],
                         force=force, optimizer=_sgd, timeout_s=30, engine=engine)
    losses = [pm.step((t,), t) for t in data]
    masks = pm._train.causal_masks
    return {"losses": losses, "verdicts": dict(masks.verdicts), "skipped": len(masks.skip), "engine": pm.engine,
            "active": sorted(masks.active)}


def _reference(kind: str) -> list[float]:
    torch.manual_seed(0)
    return one_process_losses(MaskedAttention(kind), _batches(), _loss, _sgd)


@pytest.mark.parametrize("kind,force,causal,engine", [
    ("causal", "dp=2", True, "interpreter"), ("causal", "dp=2", True, "auto"), ("additive", "tp=2", True, "auto"),
    ("sliding", "dp=2", False, "auto")])
def test_unfolded_masks_are_checked_on_the_first_step(kind, force, causal, engine):
    """On the interpreter, and on the emitted modules (``emit_runtime.masked_attention``, which
    keep computing the mask): the verdict on the first step, the mask dropped from the next on
    where causal, the losses of one process."""
    from autopar.runtime.launch import spawn_ranks

    out = spawn_ranks(_train, 2, (kind, force, engine), timeout_s=60)
    want = _reference(kind)
    for o in out:
        assert o["engine"] == ("interpreter" if engine == "interpreter" else "emitted"), o
        assert list(o["verdicts"].values()) == [causal], o
        assert bool(o["active"]) is causal, o          # applied from the second step
        if engine == "interpreter":
            assert (o["skipped"] > 0) is causal, o      # the mask's subgraph is no longer computed
        # SGD is linear in the gradients (no Adam 1/sqrt(v) magnification): losses ~2.8 stay within a
        # few ulps (2.4e-7 each) of one process; a wrong run moves step 2 by ~lr*|g|^2 >> 1e-6.
        torch.testing.assert_close(o["losses"], want, rtol=0, atol=1e-6)
