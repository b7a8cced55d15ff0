"""Fused attention: forward (out, lse) and backward against the reference, the merge of partial
results over key shards, block-size edge cases and the supported head dims.

Descriptor modes (host- or device-built TMA descriptors, AUTOPAR_ATTENTION_DESC): in the
interpreter the tests marked with ``MODES`` run in both; on CUDA they run in the mode the
environment selects (as every other test does), so a GPU run covers both modes with two pytest
invocations, one per mode, and a failure of one mode cannot hide the other."""

import contextlib
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from kernels_testutil import KERNEL_SETTINGS, ON_CUDA, assert_close, make_generator

from autopar.kernels import attention as at
from autopar.kernels import attention_configs as ac

# Small tiles so that sequences of a few dozen tokens cross several blocks and the diagonal.
SMALL = at.AttentionBlocks(fwd_m=32, fwd_n=16, fwd_warps=4, bwd_kv_n=32, bwd_kv_m=16,
                           bwd_kv_warps=4, bwd_q_m=32, bwd_q_n=16, bwd_q_warps=4, num_stages=1)
OUT_TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
LSE_TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1e-4, 1e-5)}  # fp32 math either way
GRAD_TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (5e-2, 5e-2)}
MODES = (at.descriptor_mode(),) if ON_CUDA else ac.DESC_MODES


@contextlib.contextmanager
def desc_mode(mode):
    """Run the block with AUTOPAR_ATTENTION_DESC=mode (a context manager rather than the
    monkeypatch fixture, which hypothesis tests cannot take)."""
    with mock.patch.dict(os.environ, {ac.DESC_ENV: mode}):
        yield


def _qkv(b, h, tq, tk, d, dtype, g):
    q = torch.randn(b, h, tq, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, h, tk, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, h, tk, d, generator=g).to(dtype).requires_grad_()
    return q, k, v


def _check(q, k, v, causal, blocks, g, use_lse_grad=True):
    dtype = q.dtype
    out, lse = at.attention(q, k, v, causal, blocks=blocks)
    out_ref, lse_ref = at.attention_ref(q, k, v, causal)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert_close(out, out_ref, OUT_TOL[dtype], "out")
    assert_close(lse, lse_ref, LSE_TOL[dtype], "lse")
    dout = torch.randn(out.shape, generator=g).to(dtype)
    outs, outs_ref, douts = [out], [out_ref], [dout]
    if use_lse_grad:
        dlse = torch.randn(lse.shape, generator=g)
        outs, outs_ref, douts = [out, lse], [out_ref, lse_ref], [dout, dlse]
    grads = torch.autograd.grad(outs, (q, k, v), douts)
    grads_ref = torch.autograd.grad(outs_ref, (q, k, v), douts)
    for name, a, e in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(a, e, GRAD_TOL[dtype], name)


@pytest.mark.parametrize("mode", MODES)
@KERNEL_SETTINGS
@given(b=st.integers(1, 2), h=st.integers(1, 2), tq=st.integers(1, 70), tk=st.integers(1, 70),
       d=st.sampled_from([16, 32, 64]), causal=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), use_lse_grad=st.booleans(),
       seed=st.integers(0, 2**16))
def test_attention_forward_backward(mode, b, h, tq, tk, d, causal, dtype, use_lse_grad, seed):
    g = make_generator(seed)
    q, k, v = _qkv(b, h, tq, tk, d, dtype, g)
    with desc_mode(mode):
        _check(q, k, v, causal, SMALL, g, use_lse_grad)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_attention_default_blocks(causal, d, mode):
    """No ``blocks``: the tuned lists (their first configs here; on CUDA the autotuned ones) on a
    sequence that is not a multiple of any tile."""
    g = make_generator(1)
    q, k, v = _qkv(1, 1, 150, 150, d, torch.bfloat16, g)
    with desc_mode(mode):
        _check(q, k, v, causal, None, g)


def _tuned_configs():
    """(kernel, head dim, index) of every entry of the tuned config lists."""
    cases = [("fwd", 64, i) for i in range(len(at.FWD_CONFIGS))]
    cases += [("dkdv", d, i) for d, c in at.DKDV_CONFIGS.items() for i in range(len(c))]
    return cases + [("dq", 64, i) for i in range(len(at.DQ_CONFIGS))]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kernel, d, i", _tuned_configs())
def test_every_tuned_config(kernel, d, i, mode):
    """Config i of one kernel's list (the others at their first config; the interpreter would
    otherwise only ever run the first), forward and backward with a gradient through lse, against
    the reference: causal and not, fp32 and bf16, Tq != Tk and neither a multiple of any tile, so
    both the unmasked and the masked loops and both tails run."""
    fwd_cfg = at.FWD_CONFIGS[i] if kernel == "fwd" else None
    dkdv_cfg = at.DKDV_CONFIGS[d][i] if kernel == "dkdv" else None
    dq_cfg = at.DQ_CONFIGS[i] if kernel == "dq" else None
    g = make_generator(i)
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (False, True):
            q, k, v = _qkv(1, 1, 150, 139, d, dtype, g)
            scale = d ** -0.5
            with desc_mode(mode):
                out, lse = at._forward(q.detach(), k.detach(), v.detach(), causal, scale, fwd_cfg)
            out_ref, lse_ref = at.attention_ref(q, k, v, causal)
            what = f"{mode} {dtype} causal={causal}"
            assert_close(out, out_ref, OUT_TOL[dtype], f"out {what}")
            assert_close(lse, lse_ref, LSE_TOL[dtype], f"lse {what}")
            dout = torch.randn(out.shape, generator=g).to(dtype)
            dlse = torch.randn(lse.shape, generator=g)
            with desc_mode(mode):
                grads = at._backward(q.detach(), k.detach(), v.detach(), out, lse, dout, dlse,
                                     causal, scale, dkdv_cfg, dq_cfg)
            grads_ref = torch.autograd.grad([out_ref, lse_ref], (q, k, v), [dout, dlse])
            for name, a, e in zip(("dq", "dk", "dv"), grads, grads_ref):
                assert_close(a, e, GRAD_TOL[dtype], f"{name} {what}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_attention_all_scores_very_negative(mode):
    """Every score is about -100, so lse is too: a padded key's exp(0 - lse) would overflow and
    turn dQ into NaN unless the kernel masks it (the padded keys' own dK/dV rows do overflow,
    harmlessly: they are never stored; NumPy warns about them in the interpreter)."""
    g = make_generator(3)
    q = (5 + 0.1 * torch.randn(1, 1, 20, 16, generator=g)).requires_grad_()
    k = (-5 + 0.1 * torch.randn(1, 1, 21, 16, generator=g)).requires_grad_()
    v = torch.randn(1, 1, 21, 16, generator=g).requires_grad_()
    with desc_mode(mode):
        _check(q, k, v, False, SMALL, g)


def test_reference_matches_sdpa():
    g = make_generator(2)
    q, k, v = _qkv(2, 3, 17, 23, 16, torch.float32, g)
    for causal in (False, True):
        out, _ = at.attention_ref(q, k, v, causal)
        assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                     (1e-5, 1e-5), f"causal={causal}")


@KERNEL_SETTINGS
@given(t=st.integers(1, 40), tk1=st.integers(1, 40), tk2=st.integers(1, 40),
       seed=st.integers(0, 2**16))
def test_merge_of_key_shards_equals_full_attention(t, tk1, tk2, seed):
    """attention(q, [K1; K2], [V1; V2]) == merge(attention(q, K1, V1), attention(q, K2, V2)),
    values and gradients (the gradient reaches the shards through both out and lse). In the
    descriptor mode of the environment only (host by default; gpu_check.sh runs this file under
    each): the merge does not depend on how the kernel loads its blocks, which
    test_attention_forward_backward and test_every_tuned_config check in both modes."""
    g = make_generator(seed)
    q, k1, v1 = _qkv(2, 2, t, tk1, 32, torch.float32, g)
    _, k2, v2 = _qkv(2, 2, t, tk2, 32, torch.float32, g)
    out_full, lse_full = at.attention(q, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2),
                                      blocks=SMALL)
    o1, l1 = at.attention(q, k1, v1, blocks=SMALL)
    o2, l2 = at.attention(q, k2, v2, blocks=SMALL)
    out, lse = at.merge_attention(o1, l1, o2, l2)
    assert_close(out, out_full, (2e-5, 1e-4), "out")
    assert_close(lse, lse_full, (2e-5, 1e-5), "lse")
    dout = torch.randn(out.shape, generator=g)
    inputs = (q, k1, v1, k2, v2)
    grads = torch.autograd.grad(out, inputs, dout)
    grads_full = torch.autograd.grad(out_full, inputs, dout)
    for name, a, e in zip(("dq", "dk1", "dv1", "dk2", "dv2"), grads, grads_full):
        assert_close(a, e, (1e-4, 1e-3), name)


def test_merge_with_empty_partial():
    o = torch.randn(1, 1, 3, 16)
    lse = torch.randn(1, 1, 3)
    empty_lse = torch.full_like(lse, float("-inf"))
    out, merged = at.merge_attention(o, lse, torch.zeros_like(o), empty_lse)
    assert torch.equal(merged, lse)
    assert_close(out, o, (0, 0), "out")


def test_descriptor_mode_selection(monkeypatch):
    monkeypatch.delenv(ac.DESC_ENV, raising=False)
    assert at.descriptor_mode() == "host"
    for mode in ("host", "device"):
        monkeypatch.setenv(ac.DESC_ENV, mode)
        assert at.descriptor_mode() == mode
    monkeypatch.setenv(ac.DESC_ENV, "Device ")  # no guessing: the exact names only
    with pytest.raises(ValueError, match="AUTOPAR_ATTENTION_DESC='Device ' is not a descriptor"):
        at.descriptor_mode()
    q = torch.zeros(1, 1, 4, 16)
    with pytest.raises(ValueError, match="descriptor mode"):
        at.attention(q, q, q)


def test_allocator_installed_lazily_and_kept():
    """The device path's Triton allocator: none before the first call (nothing at import), ours
    after it (in an empty context, as a fresh thread such as autograd's backward thread starts
    with, so nothing leaks into the session), and a user's own allocator is never replaced."""
    import contextvars

    import triton
    from triton.runtime import _allocation

    from autopar.kernels import _launch

    def probe():
        before = _allocation._allocator.get()
        _launch.ensure_triton_allocator()
        ours = _allocation._allocator.get()
        _launch.ensure_triton_allocator()
        again = _allocation._allocator.get()

        def mine(size, alignment, stream):
            raise AssertionError("not called")

        triton.set_allocator(mine)
        _launch.ensure_triton_allocator()
        return before, ours, again, _allocation._allocator.get()

    before, ours, again, kept = contextvars.Context().run(probe)
    assert isinstance(before, _allocation.NullAllocator)
    assert ours is _launch._torch_scratch and again is ours
    assert kept.__name__ == "mine"
    if ON_CUDA:
        buf = _launch._torch_scratch(1000, 128, None)
        assert buf.numel() == 1000 and buf.data_ptr() % 128 == 0 and buf.is_cuda


@pytest.mark.parametrize("d", [8, 48, 96, 256])
def test_unsupported_head_dim_raises(d):
    q = torch.zeros(1, 1, 4, d)
    with pytest.raises(ValueError, match="head dim"):
        at.attention(q, q, q)


def test_bad_blocks_raise():
    with pytest.raises(ValueError, match="fwd_m % fwd_n"):
        at.AttentionBlocks(fwd_m=32, fwd_n=64)
    with pytest.raises(ValueError, match="powers of two"):
        at.AttentionBlocks(fwd_m=48)
