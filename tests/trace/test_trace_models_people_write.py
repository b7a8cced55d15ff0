"""Models written the way people write them: HuggingFace from a config, nanoGPT-style code."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.data import lm_loss
from autopar.trace import run_graph, trace_model

transformers = pytest.importorskip("transformers")


def _hf_gpt2(layers: int = 3) -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=256,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _hf_llama(layers: int = 3) -> nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("build,block", [(_hf_gpt2, "transformer.h"), (_hf_llama, "model.layers")])
def test_hf_from_config_on_meta(build, block):
    with torch.device("meta"):
        model = build()
        tokens = torch.zeros(2, 16, dtype=torch.long)
    ir = trace_model(model, (tokens,), loss_fn=lm_loss, example_target=tokens)
    full = trace_model(model, (tokens,), loss_fn=lm_loss, example_target=tokens,
                       collapse_repeats=False)
    assert [(b.path, b.count, b.traced) for b in ir.blocks] == [(block, 3, 1)]
    assert ir.param_count == full.param_count == sum(p.numel() for p in model.parameters())
    assert ir.fingerprint == full.fingerprint and ir.fwd_flops == full.fwd_flops
    assert {n.key for n in ir.nodes} <= {n.key for n in full.nodes}
    targets = {n.target for n in ir.nodes}
    assert "aten.scaled_dot_product_attention.default" in targets
    assert ir.nodes[-1].outputs[0].shape == ()          # the loss is in the graph
    names = {n.param_name for n in ir.nodes if n.kind == "param"}
    assert any(name.startswith(block + ".0.") for name in names)


def test_hf_llama_full_trace_runs_on_cpu():
    torch.manual_seed(0)
    model = _hf_llama(layers=2)
    tokens = torch.randint(0, 256, (2, 16))
    ir = trace_model(model, (tokens,), loss_fn=lm_loss, example_target=tokens,
                     collapse_repeats=False)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    got = run_graph(ir, tensors, (tokens,), tokens)
    want = lm_loss(model(tokens, use_cache=False).logits, tokens)
    torch.testing.assert_close(got, want)


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, verbatim in spirit: fused qkv, flash attention, dropout module."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(0.0)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, 4 * n_embd),
                                      c_proj=nn.Linear(4 * n_embd, n_embd)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        m = self.mlp
        return x + m.c_proj(F.gelu(m.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """Returns (logits, loss) like nanoGPT; loss only when targets are passed."""

    def __init__(self, vocab=128, block_size=16, n_layer=3, n_embd=32, n_head=4) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([NanoBlock(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def test_nanogpt_style_module_traces_and_runs():
    torch.manual_seed(0)
    model = NanoGPT()
    idx = torch.randint(0, 128, (2, 16))
    ir = trace_model(model, (idx,))                       # tuple output -> first tensor (logits)
    assert ir.nodes[-1].outputs[0].shape == (2, 16, 128)
    assert [(b.path, b.count, b.traced) for b in ir.blocks] == [("transformer.h", 3, 1)]
    assert ir.param_count == sum(p.numel() for p in model.parameters())
    # the tied weight: two placeholders, both named as model.named_parameters() names it
    names = [n.param_name for n in ir.nodes if n.kind == "param"]
    assert names.count("transformer.wte.weight") == 2 and "lm_head.weight" not in names
    assert set(names) == {k for k in dict(model.named_parameters())
                          if not k.startswith(("transformer.h.1.", "transformer.h.2."))}
    full = trace_model(model, (idx,), loss_fn=lm_loss, example_target=idx, collapse_repeats=False)
    tensors = dict(model.named_parameters())
    torch.testing.assert_close(run_graph(full, tensors, (idx,), idx),
                               lm_loss(model(idx)[0], idx))
    per_layer = [n for n in full.nodes if n.target == "aten.linear.default" and n.layer_id == 2]
    assert len(per_layer) == 4 and math.prod(per_layer[0].outputs[0].shape) == 2 * 16 * 96
