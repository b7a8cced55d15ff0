"""The activation dtypes a bf16 plan counts on autopar's runtime (``solver/autocast.py``) against
torch.autocast running the model, and the bytes kept for backward that follow from them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.models import build_model
from autopar.solver.autocast import autocast_dtypes, saved_copy_factor, weight_copies
from autopar.solver.rules import base_name
from autopar.solver.saved import kept_tensors
from autopar.solver.strategies import graph_facts
from autopar.trace import trace_model

MODULE_OPS = {"linear": nn.Linear, "layer_norm": nn.LayerNorm, "embedding": nn.Embedding}


def _facts(module, inputs, loss_fn=None, target=None, seq_len=None):
    g = trace_model(module, inputs, loss_fn=loss_fn, example_target=target, collapse_repeats=False)
    return graph_facts(g, seq_len)


@pytest.mark.parametrize("spec", ["gpt-tiny", "llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"])
def test_module_outputs_match_autocast_on_the_cpu(spec):
    """Every Linear, LayerNorm and Embedding output of the model, run under CPU autocast bf16,
    has the dtype the graph's node of that module is given; the loss is fp32."""
    b = build_model(spec, device="cpu")
    seen = {}
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, str(o.dtype).split(".")[1]))
             for name, m in b.module.named_modules() if isinstance(m, tuple(MODULE_OPS.values()))]
    x, y = b.make_batch(b.example_inputs[0].shape[0], torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = b.loss_fn(b.module(*x) if isinstance(x, tuple) else b.module(x), y)
    for h in hooks:
        h.remove()
    facts = _facts(b.module, b.example_inputs, b.loss_fn, b.example_target)
    dtypes = autocast_dtypes(facts, "bfloat16", "cpu")
    checked = 0
    for n in facts.graph.nodes:
        if n.kind == "op" and base_name(n.target) in MODULE_OPS and n.module_path in seen:
            assert dtypes[n.key][0] == seen[n.module_path], (n.module_path, n.target)
            checked += 1
    assert checked >= len(seen) > 4
    assert str(loss.dtype) == "torch.float32" == "torch." + next(
        dtypes[n.key][0] for n in facts.graph.nodes if base_name(n.target) == "cross_entropy_loss")


class Scores(nn.Module):
    """softmax(q k^T) v by hand: autocast's CUDA policy runs the softmax in fp32, the CPU's in
    the dtype of its bf16 input."""
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x):
        q = self.q(x)
        return torch.softmax(q @ x.transpose(-1, -2), dim=-1) @ x


def test_device_policies_differ_where_torch_does():
    x = torch.randn(2, 4, 8)
    facts = _facts(Scores(), (x,))
    soft = next(n.key for n in facts.graph.nodes if base_name(n.target) == "softmax")
    assert autocast_dtypes(facts, "bfloat16", "cuda")[soft] == ("float32",)
    assert autocast_dtypes(facts, "bfloat16", "cpu")[soft] == ("bfloat16",)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = Scores().q(x)
        assert torch.softmax(q @ x.transpose(-1, -2), dim=-1).dtype == torch.bfloat16


def test_kept_bytes_on_gpt_tiny():
    """gpt-tiny under bf16 autocast, by hand: a LayerNorm's fp32 output read only by a Linear is
    kept as the Linear's bf16 copy (0.5 of its bytes); the residual stream that a LayerNorm saves
    stays fp32 (no entry: 1); the loss keeps an fp32 copy of the bf16 logits (2); each Linear's
    weight is cast once and kept by it (its bias is cast too, but addmm's backward does not save it)."""
    b = build_model("gpt-tiny", device="meta")
    facts = _facts(b.module, b.example_inputs, b.loss_fn, b.example_target)
    dtypes = autocast_dtypes(facts, "bfloat16", "cuda")
    f = saved_copy_factor(facts, dtypes, "bfloat16", "cuda", kept_tensors(facts))
    by = {(n.module_path, base_name(n.target)): n.key for n in facts.graph.nodes if n.kind == "op"}
    assert f[by[("transformer.h.0.ln_1", "layer_norm")]] == 0.5
    assert dtypes[by[("transformer.h.0.ln_1", "layer_norm")]] == ("float32",)
    residual = by[("transformer.h.0", "add")]
    assert dtypes[residual] == ("float32",) and residual not in f
    assert f[by[("lm_head", "linear")]] == 2.0
    copies = weight_copies(facts, dtypes)
    linears = [k for (path, op), k in by.items() if op == "linear"]
    assert sorted(copies) == sorted(linears)
    assert all([pos for pos, _ in copies[k]] == [1] and facts.nodes[copies[k][0][1]].kind == "param"
               for k in linears)
