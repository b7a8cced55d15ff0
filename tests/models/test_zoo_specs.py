"""Custom-size specs and user model files."""
from __future__ import annotations

import textwrap

import pytest
import torch

from autopar.models import build_model
from autopar.trace import trace_model


def test_custom_gpt_equals_builtin():
    custom = build_model("gpt:hidden=12288,layers=96,heads=96,vocab=51200,seq=2048")
    builtin = build_model("gpt3-175b")
    count = sum(p.numel() for p in custom.module.parameters())
    assert count == sum(p.numel() for p in builtin.module.parameters())
    assert custom.example_inputs[0].shape == (8, 2048)


def test_custom_llama_and_mlp():
    b = build_model("llama:hidden=256,layers=3,heads=8,kv_heads=2,ffn=512,vocab=1000,seq=64")
    cfg = b.module.cfg
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.vocab) == (
        256, 3, 8, 2, 512, 1000)
    assert b.module.layers[0].attention.wk.weight.shape == (2 * 32, 256)
    m = build_model("mlp:width=64,depth=5,classes=3", batch=7)
    assert m.example_inputs[0].shape == (7, 64)
    ir = trace_model(m.module, m.example_inputs, loss_fn=m.loss_fn, example_target=m.example_target)
    assert ir.blocks[0].count == 5


@pytest.mark.parametrize("spec,match", [
    ("gpt:hidden=64,layer=2", "allowed keys for gpt: hidden, layers, heads"),
    ("llama:hidden=64,experts=8", "kv_heads"),
    ("mlp:width", "key=value"),
    ("mlp:width=abc", "not a valid int"),
    ("gpt:hidden=-1", "positive"),
    ("gpt:hidden=65,heads=4", "divisible"),
    ("gpt5", "unknown model"),
])
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        build_model(spec)


USER_FILE = '''
import torch
from torch import nn
import torch.nn.functional as F
from dataclasses import dataclass

@dataclass
class Cfg:
    width: int = 16

class Net(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.emb = nn.Embedding(50, cfg.width)
        self.blocks = nn.ModuleList([nn.Linear(cfg.width, cfg.width) for _ in range(3)])
        self.out = nn.Linear(cfg.width, 5)

    def forward(self, tokens, scale):
        x = self.emb(tokens).mean(1) * scale
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.out(x)

def build():
    return Net(Cfg()), (torch.randint(0, 50, (4, 6)), torch.ones(4, 1))

def build_with_loss():
    return (Net(Cfg()), (torch.zeros(4, 6, dtype=torch.long), torch.ones(4, 1)),
            lambda out, t: F.cross_entropy(out, t), torch.zeros(4, dtype=torch.long))
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent(USER_FILE))
    return str(path)


def test_user_model_file(user_file):
    b = build_model(f"{user_file}:build")
    assert b.default_batch == 4 and b.loss_fn is None and b.example_target is None
    assert all(p.device.type == "meta" for p in b.module.parameters())    # built under meta
    ir = trace_model(b.module, b.example_inputs)
    assert ir.blocks[0].path == "blocks" and ir.blocks[0].count == 3
    assert ir.param_count == sum(p.numel() for p in b.module.parameters())

    b2 = build_model(f"{user_file}:build_with_loss", batch=10)
    assert b2.example_inputs[0].shape == (10, 6) and b2.example_inputs[1].shape == (10, 1)
    assert b2.example_target.shape == (10,)
    ir2 = trace_model(b2.module, b2.example_inputs, loss_fn=b2.loss_fn,
                      example_target=b2.example_target)
    assert ir2.batch_size == 10 and ir2.nodes[-1].outputs[0].shape == ()
    inputs, target = b2.make_batch(3, torch.Generator().manual_seed(0))
    assert inputs[0].shape == (3, 6) and inputs[0].dtype == torch.int64
    assert int(inputs[0].max()) < 50 and inputs[1].dtype == torch.float32
    assert target.shape == (3,) and int(target.max()) < 5
    assert build_model(f"{user_file}:build", batch=2).example_inputs[0].shape == (2, 6)


def test_user_model_on_cpu_has_real_weights(user_file):
    b = build_model(f"{user_file}:build", device="cpu")
    assert b.module(*b.example_inputs).shape == (4, 5)


def test_user_model_errors(user_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        build_model(f"{tmp_path}/nope.py:build")
    with pytest.raises(ValueError, match=r"no function 'missing'.*build_with_loss"):
        build_model(f"{user_file}:missing")
    with pytest.raises(ValueError, match="seq_len"):
        build_model(f"{user_file}:build", seq_len=8)


def test_user_code_errors_are_one_line_with_their_origin(tmp_path):
    """The user's own exception shows, prefixed by where it came from, as one line."""
    f = tmp_path / "raises.py"
    f.write_text("import torch\n\ndef build():\n    raise RuntimeError('my config is broken')\n")
    with pytest.raises(ValueError) as e:
        build_model(f"{f}:build")
    msg = str(e.value)
    assert f"{f}:build: build() raised RuntimeError: my config is broken (at {f}:4)" == msg
    bad_import = tmp_path / "bad_import.py"
    bad_import.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match=r"importing .*bad_import.py raised ModuleNotFoundError"):
        build_model(f"{bad_import}:build")
