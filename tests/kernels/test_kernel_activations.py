"""Bias + GeLU (erf and tanh) and SwiGLU against their references, forward and backward."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from kernels_testutil import BWD_TOL, FWD_TOL, KERNEL_SETTINGS, assert_close, make_generator

from kernels import activations as act

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
