"""Bias + GeLU (erf and tanh) and SwiGLU against their references, forward and backward."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from kernels_testutil import BWD_TOL, FWD_TOL, KERNEL_SETTINGS, assert_close, make_generator

from autopar.kernels import activations as act

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@KERNEL_SETTINGS
@given(m=st.integers(1, 40), n=st.integers(1, 1100), dtype=DTYPES, with_bias=st.booleans(),
       approximate=st.sampled_from(["none", "tanh"]), seed=st.integers(0, 2**16))
def test_bias_gelu_forward_backward(m, n, dtype, with_bias, approximate, seed):
    g = make_generator(seed)
    x = (2 * torch.randn(m, n, generator=g)).to(dtype).requires_grad_()
    bias = torch.randn(n, generator=g).to(dtype).requires_grad_() if with_bias else None
    y = act.bias_gelu(x, bias, approximate)
    y_ref = act.bias_gelu_ref(x, bias, approximate)
    assert_close(y, y_ref, FWD_TOL[dtype], "y")
    dy = torch.randn(m, n, generator=g).to(dtype)
    inputs = (x, bias) if with_bias else (x,)
    for name, a, e in zip(("dx", "dbias"), torch.autograd.grad(y, inputs, dy),
                          torch.autograd.grad(y_ref, inputs, dy)):
        assert_close(a, e, BWD_TOL[dtype], name)


def test_gelu_matches_torch_in_fp32():
    x = torch.linspace(-8, 8, 2001).reshape(3, 667).requires_grad_()
    for approximate in ("none", "tanh"):
        y = act.bias_gelu(x, None, approximate)
        assert_close(y, F.gelu(x, approximate=approximate), (1e-6, 1e-5), approximate)
        dy = torch.ones_like(y)
        assert_close(torch.autograd.grad(y, x, dy)[0],
                     torch.autograd.grad(F.gelu(x, approximate=approximate), x, dy)[0],
                     (1e-5, 1e-5), f"grad {approximate}")
    with pytest.raises(ValueError, match="approximate"):
        act.bias_gelu(x, None, "fast")


@KERNEL_SETTINGS
@given(shape=st.lists(st.integers(1, 37), min_size=1, max_size=3), dtype=DTYPES,
       seed=st.integers(0, 2**16))
def test_swiglu_forward_backward(shape, dtype, seed):
    g = make_generator(seed)
    a = (2 * torch.randn(shape, generator=g)).to(dtype).requires_grad_()
    b = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    y, y_ref = act.swiglu(a, b), act.swiglu_ref(a, b)
    assert_close(y, y_ref, FWD_TOL[dtype], "y")
    dy = torch.randn(shape, generator=g).to(dtype)
    for name, got, exp in zip(("da", "db"), torch.autograd.grad(y, (a, b), dy),
                              torch.autograd.grad(y_ref, (a, b), dy)):
        assert_close(got, exp, FWD_TOL[dtype], name)


@pytest.mark.parametrize("m,n,approximate", [(300, 77, "tanh"), (37, 1100, "none")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_gelu_every_config_matches_reference(m, n, approximate, dtype):
    """Each forward and backward config of the tuned lists against the reference, NaN-poisoned
    outputs and partial dbias buffer. 300 rows make most backward configs' programs walk two
    tiles of rows (the interpreter counts 4 SMs); 1100 columns leave a partial second stripe."""
    g = make_generator(m + n)
    x = (2 * torch.randn(m, n, generator=g)).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    xr, br = x.clone().requires_grad_(), bias.clone().requires_grad_()
    y_ref = act.bias_gelu_ref(xr, br, approximate)
    dx_ref, db_ref = torch.autograd.grad(y_ref, (xr, br), dy)
    fwd, bwd = (len(t.configs) for t in act._gelu_tuned(act._gelu_tile(n)[1]))
    for i in range(max(fwd, bwd)):
        y = act._bias_gelu_fwd(x, bias, approximate, config=i % fwd)
        assert_close(y, y_ref, FWD_TOL[dtype], f"config {i % fwd}: y")
        dx, db = act._bias_gelu_bwd(x, bias, dy, approximate, config=i % bwd)
        assert_close(dx, dx_ref, BWD_TOL[dtype], f"config {i % bwd}: dx")
        assert_close(db.to(dtype), db_ref, BWD_TOL[dtype], f"config {i % bwd}: dbias")


@pytest.mark.parametrize("shape", [(7, 2345), (13,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_every_config_matches_reference(shape, dtype):
    """Each config of SWIGLU_CONFIGS (blocks of 2048..8192), forward and backward, against the
    reference with NaN-poisoned outputs; 16415 elements end in a partial block for every one."""
    g = make_generator(len(shape))
    a, b, dy = ((2 * torch.randn(shape, generator=g)).to(dtype) for _ in range(3))
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    y_ref = act.swiglu_ref(ar, br)
    grads_ref = torch.autograd.grad(y_ref, (ar, br), dy)
    for i in range(len(act.SWIGLU_CONFIGS)):
        assert_close(act._swiglu_fwd(a, b, config=i), y_ref, FWD_TOL[dtype], f"config {i}: y")
        for name, got, exp in zip(("da", "db"), act._swiglu_bwd(a, b, dy, config=i), grads_ref):
            assert_close(got, exp, FWD_TOL[dtype], f"config {i}: {name}")
