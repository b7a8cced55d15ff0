"""LayerNorm / RMSNorm / fused residual-add norms against their references (forward, backward)."""

import pytest
import torch
import torch.nn.functional as F
import triton
from hypothesis import given
from hypothesis import strategies as st
from kernels_testutil import (BWD_TOL, FWD_TOL, KERNEL_SETTINGS, ON_CUDA, assert_close,
                              make_generator)

from autopar.kernels import norms

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def _inputs(shape, dtype, seed, n_extra=0):
    g = make_generator(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype).requires_grad_()
    b = (0.5 * torch.randn(n, generator=g)).to(dtype).requires_grad_()
    extra = [torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(n_extra)]
    return x, w, b, extra, g


@KERNEL_SETTINGS
@given(m=st.integers(1, 33), n=st.integers(1, 300), lead=st.sampled_from([(), (2,)]),
       dtype=DTYPES, rms=st.booleans(), with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_norm_forward_backward(m, n, lead, dtype, rms, with_bias, seed):
    x, w, b, _, g = _inputs((*lead, m, n), dtype, seed)
    if rms:
        args, fn, ref = (x, w), norms.rms_norm, norms.rms_norm_ref
    else:
        args = (x, w, b) if with_bias else (x, w)
        fn, ref = norms.layer_norm, norms.layer_norm_ref
    y, y_ref = fn(*args), ref(*args)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y, y_ref, FWD_TOL[dtype], "y")
    dy = torch.randn(y.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(y, args, dy)
    grads_ref = torch.autograd.grad(y_ref, args, dy)
    for name, a, e in zip(("dx", "dw", "db"), grads, grads_ref):
        assert_close(a, e, BWD_TOL[dtype], name)


@KERNEL_SETTINGS
@given(m=st.integers(1, 33), n=st.integers(1, 300), dtype=DTYPES, rms=st.booleans(),
       use_residual_grad=st.booleans(), seed=st.integers(0, 2**16))
def test_add_norm_forward_backward(m, n, dtype, rms, use_residual_grad, seed):
    x, w, b, (r,), g = _inputs((m, n), dtype, seed, n_extra=1)
    if rms:
        args, fn, ref = (x, r, w), norms.add_rms_norm, norms.add_rms_norm_ref
    else:
        args, fn, ref = (x, r, w, b), norms.add_layer_norm, norms.add_layer_norm_ref
    (y, h), (y_ref, h_ref) = fn(*args), ref(*args)
    assert_close(y, y_ref, FWD_TOL[dtype], "y")
    assert_close(h, h_ref, FWD_TOL[dtype], "h")
    dy = torch.randn(y.shape, generator=g).to(dtype)
    outs, outs_ref, douts = [y], [y_ref], [dy]
    if use_residual_grad:  # the new residual stream feeds the next layer too
        dh = torch.randn(h.shape, generator=g).to(dtype)
        outs, outs_ref, douts = [y, h], [y_ref, h_ref], [dy, dh]
    grads = torch.autograd.grad(outs, args, douts)
    grads_ref = torch.autograd.grad(outs_ref, args, douts)
    for name, a, e in zip(("dx", "dresidual", "dw", "db"), grads, grads_ref):
        assert_close(a, e, BWD_TOL[dtype], name)


def test_add_norm_with_only_the_residual_used():
    """Gradients flow when the normed output is unused (its gradient arrives as None)."""
    x, w, b, (r,), g = _inputs((6, 50), torch.float32, 4, n_extra=1)
    _, h = norms.add_layer_norm(x, r, w, b)
    _, h_ref = norms.add_layer_norm_ref(x, r, w, b)
    dh = torch.randn(h.shape, generator=g)
    grads = torch.autograd.grad(h, (x, r), dh)
    for name, a, e in zip(("dx", "dresidual"), grads, torch.autograd.grad(h_ref, (x, r), dh)):
        assert_close(a, e, BWD_TOL[torch.float32], name)


def test_layer_norm_tutorial_shape_1823x781():
    """The Triton tutorial's irregular shape, fp32, forward and backward."""
    x, w, b, _, g = _inputs((1823, 781), torch.float32, 0)
    y = norms.layer_norm(x, w, b)
    y_ref = F.layer_norm(x, (781,), w, b)
    assert_close(y, y_ref, FWD_TOL[torch.float32], "y")
    dy = torch.randn(y.shape, generator=g)
    for name, a, e in zip(("dx", "dw", "db"), torch.autograd.grad(y, (x, w, b), dy),
                          torch.autograd.grad(y_ref, (x, w, b), dy)):
        assert_close(a, e, (1e-4, 1e-4), name)


def test_references_match_torch():
    x, w, b, _, _ = _inputs((7, 65), torch.float32, 1)
    assert_close(norms.layer_norm_ref(x, w, b), F.layer_norm(x, (65,), w, b), (1e-6, 1e-5), "ln")
    assert_close(norms.rms_norm_ref(x, w, eps=1e-6), F.rms_norm(x, (65,), w, eps=1e-6),
                 (1e-6, 1e-5), "rms")


def test_norm_without_weight():
    x, _, _, _, _ = _inputs((5, 40), torch.float32, 2)
    assert_close(norms.rms_norm(x), norms.rms_norm_ref(x), FWD_TOL[torch.float32], "rms")
    assert_close(norms.layer_norm(x), norms.layer_norm_ref(x), FWD_TOL[torch.float32], "ln")


def test_norm_too_wide_raises():
    with pytest.raises(ValueError, match="65536"):
        norms.layer_norm(torch.zeros(1, norms.MAX_N + 1), torch.ones(norms.MAX_N + 1))


@pytest.mark.parametrize("kind", ["layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("m,n", [(13, 200), (3, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_config_matches_reference(kind, m, n, dtype):
    """Each forward and backward config of the tuned lists (grids of 1..8 programs per SM, the
    pipelined and plain loops, both warp counts) against the reference, NaN-poisoned outputs.
    LayerNorm (bias, its own list) and RMSNorm with a residual and dh cover every flag."""
    x, w, b, (r,), g = _inputs((m, n), dtype, m + n, n_extra=1)
    dy, dh = (torch.randn(m, n, generator=g).to(dtype) for _ in range(2))
    is_rms = kind == "add_rms_norm"
    if is_rms:
        b, args, douts, names = None, (x, r, w), (dy, dh), ("dx", "dresidual", "dw")
        refs, eps = norms.add_rms_norm_ref(x, r, w), 1e-6
    else:
        r, dh, args, douts, names = None, None, (x, w, b), (dy,), ("dx", "dw", "db")
        refs, eps = (norms.layer_norm_ref(x, w, b),), 1e-5
    grads_ref = torch.autograd.grad(refs, args, douts)
    block_n = triton.next_power_of_2(n)
    n_fwd = len(norms.fwd_tuned(block_n).configs)
    n_bwd = len(norms.bwd_tuned(block_n, is_rms).configs)
    with torch.no_grad():
        for i in range(max(n_fwd, n_bwd)):
            y, h, mean, rstd, _, x2 = norms._norm_fwd(x, r, w, b, eps, is_rms, kind,
                                                      config=i % n_fwd)
            dx, dw, db = norms._norm_bwd(dy, h if is_rms else x2, w, b is not None, mean, rstd,
                                         dh, is_rms, config=i % n_bwd)
            for name, a, e in zip(("y", "h"), (y, h), refs):
                assert_close(a, e, FWD_TOL[dtype], f"config {i}: {name}")
            grads = (dx, dx, dw.to(dtype)) if is_rms else (dx, dw.to(dtype), db.to(dtype))
            for name, a, e in zip(names, grads, grads_ref):
                assert_close(a, e, BWD_TOL[dtype], f"config {i}: {name}")


@pytest.mark.skipif(not ON_CUDA, reason="autotuning needs CUDA (the interpreter runs configs[0])")
def test_autotuned_add_rms_norm_matches_reference():
    """Above TUNE_MIN_NUMEL every config is timed; the chosen backward grid sets how many rows of
    the (NaN-poisoned) partial dw buffer are summed."""
    x, w, _, (r,), g = _inputs((512, 4096), torch.bfloat16, 5, n_extra=1)
    dy, dh = (torch.randn(512, 4096, generator=g).to(torch.bfloat16) for _ in range(2))
    outs, outs_ref = norms.add_rms_norm(x, r, w), norms.add_rms_norm_ref(x, r, w)
    for name, a, e in zip(("y", "h"), outs, outs_ref):
        assert_close(a, e, FWD_TOL[torch.bfloat16], name)
    grads = torch.autograd.grad(outs, (x, r, w), (dy, dh))
    # the gradients' reference in fp32 from the kernel's own bf16 h (x + r rounded as it stores it):
    # a bf16 autograd reference sums 512 rounded products into dw, off by up to 0.25 where the sum
    # cancels (61 of 4096 entries beyond the bound), while the kernel accumulates in fp32
    x32, r32, w32 = (t.detach().float().requires_grad_() for t in (x, r, w))
    h32 = x32 + r32
    h = h32 + ((x32 + r32).to(torch.bfloat16).float() - h32).detach()
    grads_ref = torch.autograd.grad((norms.rms_norm_ref(h, w32, eps=1e-6), h), (x32, r32, w32),
                                    (dy.float(), dh.float()))
    for name, a, e in zip(("dx", "dresidual", "dw"), grads, grads_ref):
        assert_close(a.float(), e, BWD_TOL[torch.bfloat16], name)
