"""Built-in models: build on meta instantly, trace collapsed, published parameter counts."""
from __future__ import annotations

import pickle

import pytest
import torch

from autopar.models import ModelBundle, build_model, list_models
from autopar.trace import trace_model

# Published parameter counts: HF gpt2* checkpoints, Meta's LLaMA-3 model cards,
# HF bert-large-uncased (BertForMaskedLM), timm vit_huge_patch14_224 (1000 classes).
PUBLISHED = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200, "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800, "bert-large": 335_174_458, "vit-h": 632_045_800,
}
GPT3 = {"gpt3-1.3b": (24, 2048, 1.3e9), "gpt3-2.7b": (32, 2560, 2.7e9),
        "gpt3-6.7b": (32, 4096, 6.7e9), "gpt3-13b": (40, 5120, 13e9),
        "gpt3-175b": (96, 12288, 175e9)}
LAYERS = {"gpt2": 12, "gpt2-medium": 24, "gpt2-large": 36, "gpt2-xl": 48, "llama3-8b": 32,
          "llama3-70b": 80, "llama3-405b": 126, "bert-large": 24, "vit-h": 32, "mlp": 4,
          "gpt-tiny": 2, **{k: v[0] for k, v in GPT3.items()}}


def test_list_models():
    assert set(list_models()) == set(LAYERS)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_builds_on_meta_and_traces_collapsed(name):
    b = build_model(name)      # on meta: nothing allocated, init is free
    assert isinstance(b, ModelBundle) and b.name == name and b.description
    assert all(p.device.type == "meta" for p in b.module.parameters())
    assert all(x.device.type == "meta" for x in b.example_inputs)
    assert b.example_inputs[0].shape[0] == b.default_batch
    ir = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn,
                     example_target=b.example_target, model_name=name)
    assert [(blk.count, blk.traced) for blk in ir.blocks] == [(LAYERS[name], 1)]
    assert ir.param_count == sum(p.numel() for p in b.module.parameters())
    assert ir.nodes[-1].outputs[0].shape == ()      # scalar loss
    if name in PUBLISHED:
        assert ir.param_count == PUBLISHED[name]
    if name in GPT3:
        layers, hidden, nominal = GPT3[name]
        assert abs(ir.param_count - nominal) / nominal < 0.05
        assert b.seq_len == 2048 and b.example_inputs[0].shape[1] == 2048


def test_lm_shapes_and_overrides():
    b = build_model("gpt2", batch=4, seq_len=128)
    assert b.example_inputs[0].shape == (4, 128) and b.example_inputs[0].dtype == torch.int64
    assert b.example_target.shape == (4, 128) and b.seq_len == 128
    with pytest.raises(ValueError, match="1024"):
        build_model("gpt2", seq_len=2048)
    long = build_model("llama3-8b", batch=1, seq_len=16384)   # RoPE tables grow, params do not
    assert long.example_inputs[0].shape == (1, 16384)
    assert sum(p.numel() for p in long.module.parameters()) == PUBLISHED["llama3-8b"]
    with pytest.raises(ValueError, match="not a sequence model"):
        build_model("vit-h", seq_len=10)
    vit = build_model("vit-h", batch=2)
    assert vit.example_inputs[0].shape == (2, 3, 224, 224) and vit.example_target.shape == (2,)
    assert vit.seq_len is None


def test_bf16_build():
    b = build_model("llama3-8b", batch=1, seq_len=256, dtype=torch.bfloat16)
    assert {p.dtype for p in b.module.parameters()} == {torch.bfloat16}
    ir = trace_model(b.module, b.example_inputs)
    assert ir.node("output|aten.linear.default|0").outputs[0].dtype == "bfloat16"


@pytest.mark.parametrize("name", ["gpt-tiny", "mlp"])
def test_cpu_init_is_deterministic(name):
    def params(seed):
        torch.manual_seed(seed)
        state = build_model(name, device="cpu").module.state_dict()
        return {k: v.detach().clone() for k, v in state.items()}
    a, b, c = params(0), params(0), params(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_gpt_init_statistics():
    torch.manual_seed(0)
    m = build_model("gpt:hidden=256,layers=2,heads=4,vocab=512,seq=64", device="cpu").module
    assert abs(m.transformer.wte.weight.std().item() - 0.02) < 0.002
    assert abs(m.transformer.h[0].attn.c_proj.weight.std().item() - 0.02 / 2) < 0.002
    assert torch.count_nonzero(m.transformer.h[0].mlp.c_fc.bias) == 0
    assert m.lm_head.weight is m.transformer.wte.weight


def test_make_batch_real_and_learnable():
    b = build_model("gpt-tiny")
    inputs, target = b.make_batch(5, torch.Generator().manual_seed(0))
    again, _ = b.make_batch(5, torch.Generator().manual_seed(0))
    assert inputs[0].device.type == "cpu" and inputs[0].shape == (5, 32)
    assert torch.equal(inputs[0], again[0])
    assert torch.equal(inputs[0][:, 1:], target[:, :-1])            # next-token targets
    assert 0 <= int(inputs[0].min()) and int(inputs[0].max()) < 256
    x, y = build_model("mlp").make_batch(6, torch.Generator().manual_seed(0))
    assert x[0].shape == (6, 1024) and torch.equal(y, x[0][:, :10].argmax(1))
    (tokens,), tgt = build_model("bert-large").make_batch(2, torch.Generator().manual_seed(0))
    assert tokens.shape == tgt.shape == (2, 512) and (tokens == 103).any()
    pickle.dumps(b.make_batch)


def test_gpt_tiny_trains_on_its_batches():
    torch.manual_seed(0)
    b = build_model("gpt-tiny", device="cpu")
    opt = torch.optim.AdamW(b.module.parameters(), lr=5e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(20):
        inputs, target = b.make_batch(16, g)
        loss = b.loss_fn(b.module(*inputs), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
