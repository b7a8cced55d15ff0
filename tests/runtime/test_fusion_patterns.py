"""Multi-node fusion regions (autopar/codegen/patterns.py, fused.REGION_ADAPTERS).

(a) The matcher on exported graphs: LLaMA's layers, HuggingFace's way of writing RMSNorm and RoPE
    (weight first, slices instead of chunk), and the shapes it must refuse (an intermediate with
    another user, a broadcast residual add, a residual read before the norm, silu used twice).
(b) Each region adapter, through the Triton kernel (interpreter) and the reference, equals the
    eager region it replaces, forward and backward, fp32; and refuses placements, dtypes and
    shapes outside its conditions (given as torch placements, no mesh needed).
"""
from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.codegen.fused import REGION_ADAPTERS, FusedKernels
from autopar.codegen.patterns import Match, find_fusions

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
IMPLS = ["reference"] + (["triton"] if INTERPRET or torch.cuda.is_available() else [])


def _matches(module: nn.Module, *args) -> tuple[Match, ...]:
    ep = torch.export.export(module, args, strict=False)
    return find_fusions(ep.graph)


def _kinds(matches) -> Counter:
    return Counter(m.kernel for m in matches)


# ---- (a) the matcher -----------------------------------------------------------------------------

def test_llama_layers():
    from autopar.models.llama import Llama, LlamaConfig

    m = Llama(LlamaConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, kv_heads=2, ffn=48))
    found = _matches(m, torch.randint(0, 64, (2, 16)))
    assert _kinds(found) == {"rms_norm": 1, "add_rms_norm": 4, "rope": 4, "swiglu": 2}
    add_norm = next(f for f in found if f.kernel == "add_rms_norm")
    assert [r for r, _ in add_norm.operands] == ["x", "residual", "weight"]
    assert add_norm.const("eps") == 1e-5
    assert dict(add_norm.outputs) == {add_norm.anchor: 0, add_norm.members[0]: 1}   # (y, h)
    rope = next(f for f in found if f.kernel == "rope")
    assert [r for r, _ in rope.operands] == ["x", "cos", "sin"]
    assert any(name.startswith("chunk") for name in rope.members)


class HFStyle(nn.Module):
    """HuggingFace's LlamaRMSNorm (weight * (h * rsqrt(var + eps))) after a residual add, and
    rotate_half by slicing."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x, res, cos, sin):
        h = x + res
        var = h.pow(2).mean(-1, keepdim=True)
        n = self.weight * (h * torch.rsqrt(var + 1e-6))
        half = n.shape[-1] // 2
        rot = torch.cat((-n[..., half:], n[..., :half]), dim=-1)
        return n * cos + rot * sin, h


def test_hf_style_rms_norm_and_sliced_rope():
    x, res, cos, sin = torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(5, 16), torch.randn(5, 16)
    found = _matches(HFStyle(), x, res, cos, sin)
    assert _kinds(found) == {"add_rms_norm": 1, "rope": 1}
    norm = next(f for f in found if f.kernel == "add_rms_norm")
    assert norm.const("eps") == 1e-6
    rope = next(f for f in found if f.kernel == "rope")
    assert sum(n.startswith("slice") for n in rope.members) == 2


class Refusals(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x, pos, a, b):
        # 1. broadcast residual add: the norm matches alone, the add stays
        h = x + pos
        y1 = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * self.w
        # 2. rsqrt has another user: no RMSNorm region
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        y2 = x * r * self.w + r
        # 3. the residual is read before the norm: the norm matches without the add
        g = x + a
        early = g.sum()
        y3 = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5) * self.w
        # 4. silu used twice: no SwiGLU
        s = torch.nn.functional.silu(a)
        y4 = s * b + s
        return y1, y2, y3 + early, y4


def test_refusals():
    x, pos, a, b = torch.randn(2, 3, 8), torch.randn(3, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    graph = torch.export.export(Refusals(), (x, pos, a, b), strict=False).graph
    found = find_fusions(graph)
    assert _kinds(found) == {"rms_norm": 2}                  # cases 1 and 3, without their adds
    members = {n for f in found for n in f.members}
    shared = [n.name for n in graph.nodes if str(n.target) == "aten.rsqrt.default" and len(n.users) > 1]
    silu = [n.name for n in graph.nodes if str(n.target) == "aten.silu.default"]
    assert len(shared) == 1 and shared[0] not in members    # case 2
    assert silu and silu[0] not in members                  # case 4
    adds = [n.name for n in graph.nodes if str(n.target) == "aten.add.Tensor" and len(n.args) == 2
            and all(isinstance(a, torch.fx.Node) for a in n.args)]
    assert not set(adds) & members                          # cases 1 and 3: no residual folded


class TanhGelus(nn.Module):
    """GPT-2's gelu_new as HF writes it (NewGELUActivation) and as nanoGPT did, then two that
    must not match: a wrong constant, and an intermediate read elsewhere."""

    def forward(self, x):
        hf = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        nano = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
        wrong = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.04 * torch.pow(x, 3.0))))
        t = torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))
        shared = 0.5 * x * (1.0 + t) + t
        return hf, nano, wrong, shared


def test_handwritten_tanh_gelu():
    found = _matches(TanhGelus(), torch.randn(2, 3, 8))
    assert _kinds(found) == {"gelu": 2}
    for f in found:
        assert f.const("approximate") == "tanh" and len(f.members) == 8
        assert [r for r, _ in f.operands] == ["x"]


# ---- (b) region adapters ---------------------------------------------------------------------------

def _rand(*shape, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(grad)


def _match(kernel, **consts) -> Match:
    return Match(kernel, ("anchor",), (), (("anchor", 0),), tuple(consts.items()))


def _rms(h, w, eps):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


REGIONS = [   # (kernel, consts, operands builder, eager region -> outputs)
    ("rms_norm", {"eps": 1e-5}, lambda: {"x": _rand(3, 5, 40), "weight": _rand(40, seed=1)},
     lambda o: (_rms(o["x"], o["weight"], 1e-5),)),
    ("add_rms_norm", {"eps": 1e-6}, lambda: {"x": _rand(4, 24), "residual": _rand(4, 24, seed=1),
                                              "weight": _rand(24, seed=2)},
     lambda o: (_rms(o["x"] + o["residual"], o["weight"], 1e-6), o["x"] + o["residual"])),
    ("add_rms_norm", {"eps": None}, lambda: {"x": _rand(4, 24), "residual": _rand(4, 24, seed=1)},
     lambda o: (torch.rms_norm(o["x"] + o["residual"], [24]), o["x"] + o["residual"])),
    ("add_layer_norm", {"eps": 1e-5}, lambda: {"x": _rand(2, 3, 33), "residual": _rand(2, 3, 33, seed=1),
                                                "weight": _rand(33, seed=2), "bias": _rand(33, seed=3)},
     lambda o: (torch.layer_norm(o["x"] + o["residual"], [33], o["weight"], o["bias"], 1e-5),
                o["x"] + o["residual"])),
    ("swiglu", {}, lambda: {"a": _rand(3, 70), "b": _rand(3, 70, seed=1)},
     lambda o: (torch.nn.functional.silu(o["a"]) * o["b"],)),
    ("bias_gelu", {"approximate": "tanh"}, lambda: {"x": _rand(3, 5, 36), "bias": _rand(36, seed=1)},
     lambda o: (torch.nn.functional.gelu(o["x"] + o["bias"], approximate="tanh"),)),
    ("gelu", {"approximate": "tanh"}, lambda: {"x": _rand(3, 5, 36)},
     lambda o: (0.5 * o["x"] * (1 + torch.tanh(math.sqrt(2 / math.pi) * (o["x"] + 0.044715 * o["x"] ** 3))),)),
    ("rope", {}, lambda: {"x": _rand(2, 3, 7, 16), "cos": _rand(7, 16, seed=1, grad=False),
                          "sin": _rand(7, 16, seed=2, grad=False)},
     lambda o: (o["x"] * o["cos"] + _rotate(o["x"]) * o["sin"],)),
    ("rope", {"hf_shapes": True}, lambda: {"x": _rand(2, 3, 7, 16), "cos": _rand(1, 1, 7, 16, seed=1, grad=False),
                                           "sin": _rand(1, 7, 16, seed=2, grad=False)},
     lambda o: (o["x"] * o["cos"] + _rotate(o["x"]) * o["sin"],)),
]


def _fwd_bwd(fn, ops):
    outs = fn(ops)
    gen = torch.Generator().manual_seed(9)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    leaves = [v for v in ops.values() if v.requires_grad]
    return [o.detach() for o in outs], torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", REGIONS, ids=lambda c: f"{c[0]}-{c[1]}")
def test_region_adapter_matches_eager(case, impl):
    kernel, consts, build, eager = case
    m = _match(kernel, **consts)
    fk = FusedKernels(impl)
    ops = build()
    assert REGION_ADAPTERS[kernel].check(m, {r: (v, ()) for r, v in ops.items()}) is None
    want, want_g = _fwd_bwd(eager, build())
    got, got_g = _fwd_bwd(lambda o: fk.run_match("k", m, o), build())
    assert fk.used == {"k": kernel}
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert len(got_g) == len(want_g)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


R, S0, S1, S2, S3, P = (Replicate(),), (Shard(0),), (Shard(1),), (Shard(2),), (Shard(3),), (Partial(),)


@pytest.mark.parametrize("kernel,consts,ops,why", [
    ("add_rms_norm", {}, lambda: {"x": (_rand(4, 8), S1), "residual": (_rand(4, 8), S1)}, "sharded on dim 1"),
    ("add_rms_norm", {}, lambda: {"x": (_rand(4, 8), S0), "residual": (_rand(4, 8), R)}, "placements"),
    ("add_rms_norm", {}, lambda: {"x": (_rand(4, 8), P), "residual": (_rand(4, 8), P)}, "Partial"),
    ("add_rms_norm", {}, lambda: {"x": (_rand(4, 8), S0), "residual": (_rand(4, 8).double(), S0)}, "dtype"),
    ("rms_norm", {}, lambda: {"x": (_rand(4, 8), S0), "weight": (_rand(8), S0)}, "Replicate"),
    ("rms_norm", {}, lambda: {"x": (_rand(4, 8), S0), "weight": (_rand(8).double(), R)}, "dtype"),
    ("swiglu", {}, lambda: {"a": (_rand(4, 8), R), "b": (_rand(4, 1), R)}, "shape"),
    ("bias_gelu", {}, lambda: {"x": (_rand(4, 8), S1), "bias": (_rand(8), R)}, "sharded on dim 1"),
    ("bias_gelu", {"approximate": "sigmoid"}, lambda: {"x": (_rand(4, 8), R), "bias": (_rand(8), R)}, "approximate"),
    ("gelu", {"approximate": "tanh"}, lambda: {"x": (_rand(4, 8), P)}, "Partial"),
    ("gelu", {"approximate": "tanh"}, lambda: {"x": (_rand(4, 8).long(), R)}, "fp32/bf16"),
    ("rope", {}, lambda: {"x": (_rand(1, 2, 4, 8), S2), "cos": (_rand(4, 8, grad=False), R),
                          "sin": (_rand(4, 8, grad=False), R)}, "sharded on dim 2"),
    ("rope", {}, lambda: {"x": (_rand(1, 2, 4, 8), S1), "cos": (_rand(4, 8), R),
                          "sin": (_rand(4, 8, grad=False), R)}, "requires grad"),
    ("rope", {}, lambda: {"x": (_rand(1, 2, 4, 8), S1), "cos": (_rand(4, 8, grad=False), S0),
                          "sin": (_rand(4, 8, grad=False), R)}, "Replicate"),
    ("rope", {}, lambda: {"x": (_rand(1, 2, 4, 7), R), "cos": (_rand(4, 7, grad=False), R),
                          "sin": (_rand(4, 7, grad=False), R)}, "D even"),
    ("rope", {}, lambda: {"x": (_rand(2, 2, 4, 8), R), "cos": (_rand(2, 1, 4, 8, grad=False), R),
                          "sin": (_rand(4, 8, grad=False), R)}, "leading dims of 1"),
])
def test_region_adapter_declines(kernel, consts, ops, why):
    reason = REGION_ADAPTERS[kernel].check(_match(kernel, **consts), ops())
    assert reason is not None and why in reason, reason


def test_region_adapter_accepts_batch_and_head_shards():
    """Rows (dim 0) and heads (dim 1) may be sharded: the kernels are local along them."""
    ok = REGION_ADAPTERS["rope"].check(_match("rope"), {"x": (_rand(2, 4, 4, 8), S1),
                                                        "cos": (_rand(4, 8, grad=False), R),
                                                        "sin": (_rand(4, 8, grad=False), R)})
    assert ok is None
    ok = REGION_ADAPTERS["add_layer_norm"].check(_match("add_layer_norm"), {
        "x": (_rand(2, 4, 8), S1), "residual": (_rand(2, 4, 8), S1), "weight": (_rand(8), R)})
    assert ok is None


def test_tanh_gelu_region_accepts_any_shard():
    """Elementwise, so a column-parallel MLP's hidden (sharded on its last dim) runs fused."""
    for pl in (R, S0, S1):
        assert REGION_ADAPTERS["gelu"].check(_match("gelu", approximate="tanh"), {"x": (_rand(4, 8), pl)}) is None
