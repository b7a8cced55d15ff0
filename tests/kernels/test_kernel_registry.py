"""The kernel registry: lookup, pattern search, device selection, and that every entry's Triton
and reference callables agree on a small input."""

import dataclasses

import pytest
import torch
from kernels_testutil import assert_close, make_generator

from autopar.kernels import registry


def test_lookup_and_unknown_name():
    entry = registry.lookup("rms_norm")
    assert entry.name == "rms_norm" and entry.pattern == ("aten.rms_norm.default",)
    with pytest.raises(KeyError, match="known: layer_norm"):
        registry.lookup("flash_attn_v9")
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.name = "other"


def test_for_target_orders_longest_pattern_first():
    assert [e.name for e in registry.for_target("aten.gelu.default")] == ["bias_gelu", "gelu"]
    assert [e.name for e in registry.for_target(torch.ops.aten.layer_norm.default)] == [
        "add_layer_norm", "layer_norm"]
    assert [e.name for e in registry.for_target("aten.scaled_dot_product_attention.default")] == [
        "attention"]
    assert registry.for_target("aten.mm.default") == []


def test_every_pattern_names_a_real_aten_op():
    for entry in map(registry.lookup, registry.names()):
        for target in entry.pattern:
            _, op, overload = target.split(".")
            assert hasattr(getattr(torch.ops.aten, op), overload), (entry.name, target)


def test_select_by_device(monkeypatch):
    entry = registry.lookup("softmax")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert registry.select("softmax", "cpu") is entry.reference
    assert registry.select("softmax", torch.device("cuda", 0)) is entry.triton
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.select("softmax", "cpu") is entry.triton


def test_triton_on_cpu_without_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        registry.lookup("softmax").triton(torch.zeros(2, 3, device="cpu"))


def _small_calls():
    g = make_generator(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, w, b = r(5, 24), r(24), r(24)
    q, k, v = r(1, 2, 9, 16), r(1, 2, 9, 16), r(1, 2, 9, 16)
    cos, sin = r(9, 16), r(9, 16)
    target = torch.tensor([1, 0, -100, 3, 2])
    flat = lambda: [r(50), r(50), torch.zeros(50), torch.zeros(50)]  # noqa: E731
    return {
        "layer_norm": ((x, w, b), {}), "rms_norm": ((x, w), {}),
        "add_layer_norm": ((x, r(5, 24), w, b), {}), "add_rms_norm": ((x, r(5, 24), w), {}),
        "softmax": ((x,), {}), "cross_entropy": ((x, target), {}),
        "gelu": ((x,), {}), "bias_gelu": ((x, b), {}), "swiglu": ((x, r(5, 24)), {}),
        "attention": ((q, k, v, True), {}), "rope": ((q, cos, sin), {}),
        "adamw": (flat, dict(step=2, lr=1e-2)), "lamb": (flat, dict(step=2, lr=1e-2)),
        "lars": (lambda: [r(50), r(50), torch.zeros(50)], dict(lr=0.5, weight_decay=1e-2)),
    }


@pytest.mark.parametrize("name", registry.names())
def test_triton_and_reference_agree(name):
    args, kwargs = _small_calls()[name]
    entry = registry.lookup(name)
    if callable(args):  # optimizers update buffers in place: give each its own copy
        bufs = args()
        a, e = [t.clone() for t in bufs], [t.clone() for t in bufs]
        extra = ([0, 20, 50],) if name in ("lamb", "lars") else ()
        entry.triton(*a, *extra, **kwargs)
        entry.reference(*e, *extra, **kwargs)
        got, expected = a, e
    else:
        got, expected = entry.triton(*args, **kwargs), entry.reference(*args, **kwargs)
    got = got if isinstance(got, (tuple, list)) else (got,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    for a, e in zip(got, expected, strict=True):
        assert_close(a, e, (1e-5, 1e-4), name)
