"""trace_model: keys, repeated blocks, totals, FLOPs and bytes against hand counts."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autopar.ir import GraphIR
from autopar.models import build_model
from autopar.trace import base_key, node_key_map, trace_model


def _trace(name: str, collapse: bool = True, **kw) -> GraphIR:
    b = build_model(name, **kw)
    return trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn,
                       example_target=b.example_target, collapse_repeats=collapse, model_name=name)


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[GraphIR, GraphIR]:
    return _trace("gpt-tiny", True), _trace("gpt-tiny", False)


def test_collapsed_and_full_keys_agree(tiny_pair):
    col, full = tiny_pair
    assert col.blocks[0].path == "transformer.h"
    assert (col.blocks[0].count, col.blocks[0].traced) == (2, 1)
    assert (full.blocks[0].count, full.blocks[0].traced) == (2, 2)
    col_keys = [n.key for n in col.nodes]
    full_first = [n.key for n in full.nodes if not n.layer_id]
    assert col_keys == full_first                      # layer 0 and non-block nodes, same order
    layer1 = [n.key for n in full.nodes if n.layer_id == 1]
    layer0 = [n.key for n in full.nodes if n.layer_id == 0]
    assert [base_key(k) for k in layer1] == layer0     # copy 1 = copy 0's keys + "@1"
    assert all(k.endswith("@1") for k in layer1)
    assert len({n.key for n in full.nodes}) == len(full.nodes)
    assert col.fingerprint == full.fingerprint
    assert col.param_count == full.param_count
    assert col.fwd_flops == full.fwd_flops


def test_block_nodes_carry_block_and_layer(tiny_pair):
    col, full = tiny_pair
    n = col.node("transformer.h.*.attn.c_attn|aten.linear.default|0")
    assert (n.block, n.layer_id) == ("transformer.h", 0)
    assert n.module_path == "transformer.h.0.attn.c_attn"
    assert col.multiplicity(n) == 2
    m = full.node("transformer.h.*.attn.c_attn|aten.linear.default|0@1")
    assert (m.block, m.layer_id) == ("transformer.h", 1)
    assert m.module_path == "transformer.h.1.attn.c_attn"
    assert full.multiplicity(m) == 1
    head = col.node("lm_head|aten.linear.default|0")
    assert head.block is None and col.multiplicity(head) == 1
    # the head reads the last layer's output (copy 0 in the collapsed trace, copy 1 in the full one)
    assert head.args[0].key == "transformer.ln_f|aten.layer_norm.default|0"


def test_kinds_params_and_tied_weights(tiny_pair):
    col, _ = tiny_pair
    kinds = {n.kind for n in col.nodes}
    assert kinds == {"param", "input", "op", "output"}
    assert [n.key for n in col.nodes if n.kind == "input"] == ["|input|0", "|target|0"]
    assert col.nodes[-1].key == "|output|0" and col.nodes[-1].outputs[0].shape == ()
    p = col.node("transformer.h.*.attn.c_attn.weight|param|0")
    assert p.param_name == "transformer.h.0.attn.c_attn.weight" and p.out.shape == (192, 64)
    # GPT ties lm_head to wte: two placeholders, one canonical name, counted once
    tied = [n for n in col.nodes if n.param_name == "transformer.wte.weight"]
    assert {n.key for n in tied} == {"transformer.wte.weight|param|0", "lm_head.weight|param|0"}
    module = build_model("gpt-tiny").module
    assert col.param_count == sum(p.numel() for p in module.parameters())


def test_linear_flops_and_bytes_by_hand():
    ir = _trace("mlp", batch=4)
    n = ir.node("layers.*.fc|aten.linear.default|0")
    B, W = 4, 1024
    assert n.flops == 2 * B * W * W
    assert n.bytes_moved == 4 * (B * W + W * W + W + B * W)   # x, weight, bias in; out
    assert n.outputs[0].shape == (B, W)
    head = ir.node("head|aten.linear.default|0")
    assert head.flops == 2 * B * W * 10


def test_contraction_flops_match_torch_flop_counter():
    torch.manual_seed(0)
    b = build_model("mlp", batch=4, device="cpu")
    with FlopCounterMode(display=False) as counter:
        b.module(*b.example_inputs)
    ir = trace_model(b.module, b.example_inputs)
    linear = sum(n.flops * ir.multiplicity(n) for n in ir.nodes
                 if n.target == "aten.linear.default")
    assert linear == counter.get_total_flops()


def test_sdpa_flops_full_square_and_views_free(tiny_pair):
    col, _ = tiny_pair
    B, H, T, D = 8, 4, 32, 16
    sdpa = col.node("transformer.h.*.attn|aten.scaled_dot_product_attention.default|0")
    assert sdpa.flops == 4 * B * H * T * T * D         # causal counted in full (Megatron)
    assert sdpa.bytes_moved == 4 * 4 * B * H * T * D   # q, k, v read; out written (fp32)
    for n in col.nodes:
        if n.target in ("aten.view.default", "aten.transpose.int", "getitem", "aten.split.Tensor"):
            assert n.flops == 0 and n.bytes_moved == 0, n.key
    emb = col.node("transformer.wte|aten.embedding.default|0")
    assert emb.flops == 0 and emb.bytes_moved == 2 * 4 * B * T * 64 + 8 * B * T


def test_gpt_forward_flops_match_megatron_terms():
    """Contractions of a GPT forward: 24Bslh^2 + 4Bs^2hl + 2BshV (Narayanan et al. 2021)."""
    B, s, l, h, V = 1536, 2048, 96, 12288, 51200
    ir = _trace("gpt3-175b")
    contraction = sum(n.flops * ir.multiplicity(n) for n in ir.nodes if n.target in (
        "aten.linear.default", "aten.scaled_dot_product_attention.default"))
    assert contraction == 24 * B * s * l * h * h + 4 * B * s * s * h * l + 2 * B * s * h * V
    assert contraction <= ir.fwd_flops <= 1.01 * contraction   # elementwise terms are small


def test_gpt3_175b_shape_and_speed():
    b = build_model("gpt3-175b")
    start = time.perf_counter()
    ir = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    elapsed = time.perf_counter() - start
    l, h, V = 96, 12288, 51200
    assert abs(ir.param_count - (12 * l * h * h + V * h)) / ir.param_count < 0.02
    assert ir.param_count == sum(p.numel() for p in b.module.parameters())
    assert ir.blocks[0].count == 96 and ir.blocks[0].traced == 1
    assert ir.batch_size == 1536
    assert elapsed < 3.0, f"collapsed GPT-3 175B trace took {elapsed:.2f}s"


def test_fingerprint_stable_across_rebuilds_and_devices():
    a = _trace("gpt-tiny")
    b = _trace("gpt-tiny")
    torch.manual_seed(0)
    c = _trace("gpt-tiny", device="cpu")
    assert a.fingerprint == b.fingerprint == c.fingerprint
    assert [n.key for n in a.nodes] == [n.key for n in c.nodes]
    assert _trace("gpt-tiny", batch=4).fingerprint != a.fingerprint       # shapes are in it
    assert _trace("gpt:hidden=64,layers=3,heads=4,vocab=256,seq=32").fingerprint != a.fingerprint


def test_node_key_map_matches_graph(tiny_pair):
    col, _ = tiny_pair
    names = [n.name for n in col.graph_module.graph.nodes]
    mapping = node_key_map(col)
    assert list(mapping) == names
    assert mapping[col.nodes[0].name] == col.nodes[0].key


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _Indexed(nn.Module):
    """Indexes its layer list by position: cannot run on a one-layer clone."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 3
        self.layers = nn.ModuleList([_Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n):
            x = self.layers[i](x)
        return x


class _ParallelHeads(nn.Module):
    """Identical modules used side by side: not a repeated block."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(h(x) for h in self.heads)


class _Sequential(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[_Block() for _ in range(5)])
        self.extra = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))  # not identical

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra(self.body(x))


def test_indexed_layer_list_falls_back_to_full_trace():
    with torch.device("meta"):
        m = _Indexed()
    with pytest.warns(UserWarning, match="tracing every copy"):
        ir = trace_model(m, (torch.randn(2, 8),))
    assert ir.blocks[0].traced == ir.blocks[0].count == 3
    assert ir.param_count == 3 * 72


def test_parallel_identical_modules_are_not_a_block():
    with torch.device("meta"):
        m = _ParallelHeads()
    with pytest.warns(UserWarning, match="not treated as repeated blocks"):
        ir = trace_model(m, (torch.randn(2, 8),))
    assert ir.blocks == ()
    linears = [n for n in ir.nodes if n.target == "aten.linear.default"]
    assert len(linears) == 4 and all(n.block is None for n in linears)
    assert ir.param_count == 4 * 72


def test_sequential_blocks_detected_and_collapsed():
    with torch.device("meta"):
        m = _Sequential()
    ir = trace_model(m, (torch.randn(2, 8),))
    assert [(b.path, b.count, b.traced, b.param_count) for b in ir.blocks] == [("body", 5, 1, 72)]
    assert ir.param_count == sum(p.numel() for p in m.parameters())
    assert ir.node("body.*.fc|aten.linear.default|0").layer_id == 0
    full = trace_model(m, (torch.randn(2, 8),), collapse_repeats=False)
    assert ir.fingerprint == full.fingerprint
