"""The zoo's GPT and LLaMA compute what HuggingFace's GPT-2 and LLaMA compute (same weights)."""
from __future__ import annotations

import pytest
import torch

from autopar.models import build_model

transformers = pytest.importorskip("transformers")


def test_gpt_matches_hf_gpt2():
    torch.manual_seed(0)
    ours = build_model("gpt:hidden=64,layers=2,heads=4,vocab=128,seq=32", device="cpu").module
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                  activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")
    state = {k: (v.t() if k.endswith(transposed) else v) for k, v in ours.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("attn.bias") or k.endswith("masked_bias")
                                  for k in missing), missing
    tokens = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(ours(tokens), hf(tokens, use_cache=False).logits,
                               rtol=1e-4, atol=1e-4)


def test_llama_matches_hf_llama():
    torch.manual_seed(0)
    ours = build_model("llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,vocab=128,seq=32,"
                       "rope_theta=10000", device="cpu").module
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=96, vocab_size=128,
                                   max_position_embeddings=32, rms_norm_eps=1e-5,
                                   rope_theta=10000.0, bos_token_id=0, eos_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    top = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
    layer = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}

    def hf_name(k: str) -> str:
        if k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            module, _, param = rest.rpartition(".")
            return f"model.layers.{i}.{layer[module]}.{param}"
        module, _, param = k.rpartition(".")
        return f"{top[module]}.{param}"

    state = {hf_name(k): v for k, v in ours.state_dict().items()}
    hf.load_state_dict(state, strict=True)
    tokens = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(ours(tokens), hf(tokens, use_cache=False).logits,
                               rtol=1e-4, atol=1e-4)
