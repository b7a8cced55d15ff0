"""Rotary embedding (rotate-half) against the reference, forward and backward."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernels_testutil import FWD_TOL, KERNEL_SETTINGS, assert_close, make_generator

from autopar.kernels import rope as rp


def hf_cos_sin(t, d, base=10000.0):
    """cos, sin (T, D) as HuggingFace LLaMA builds them: the same angles on both halves."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(t).float(), inv_freq)  # (T, D/2)
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos(), emb.sin()


@KERNEL_SETTINGS
@given(b=st.integers(1, 2), h=st.integers(1, 3), t=st.integers(1, 40), half=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), hf=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rope_forward_backward(b, h, t, half, dtype, hf, seed):
    g = make_generator(seed)
    d = 2 * half
    x = torch.randn(b, h, t, d, generator=g).to(dtype).requires_grad_()
    if hf:
        cos, sin = hf_cos_sin(t, d)
    else:  # arbitrary tables: catches a kernel that reads the wrong half of sin or cos
        cos, sin = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    cos, sin = cos.to(dtype), sin.to(dtype)
    y, y_ref = rp.rope(x, cos, sin), rp.rope_ref(x, cos, sin)
    assert_close(y, y_ref, FWD_TOL[dtype], "y")
    dy = torch.randn(y.shape, generator=g).to(dtype)
    assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(y_ref, x, dy)[0],
                 FWD_TOL[dtype], "dx")


def test_rope_rotates_pairs():
    """Position t rotates the pair (x_i, x_{i+D/2}) by angle t * f_i: norms are preserved and
    position 0 is the identity."""
    x = torch.randn(1, 1, 5, 8)
    cos, sin = hf_cos_sin(5, 8)
    y = rp.rope(x, cos, sin)
    assert_close(y[..., 0, :], x[..., 0, :], (1e-6, 1e-6), "t=0")
    pair_norm = lambda z: z[..., :4] ** 2 + z[..., 4:] ** 2  # noqa: E731
    assert_close(pair_norm(y), pair_norm(x), (1e-5, 1e-5), "pair norms")


def test_rope_bad_shapes():
    with pytest.raises(ValueError, match="D even"):
        rp.rope(torch.zeros(1, 1, 4, 5), torch.zeros(4, 5), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="cos/sin"):
        rp.rope(torch.zeros(1, 1, 4, 6), torch.zeros(3, 6), torch.zeros(3, 6))


@pytest.mark.parametrize("shape", [(2, 3, 37, 40), (5, 19, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_config_matches_reference(shape, dtype):
    """Each config of the tuned list (16..64 positions, 1 or 4 leading rows per program) forward
    and backward against the reference, NaN-poisoned outputs: T leaves a partial position tile,
    the leading rows (6, 5) a partial group, and D/2 (20, 3) is no power of two."""
    g = make_generator(sum(shape))
    t, d = shape[-2:]
    x, dy = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    cos, sin = (torch.randn(t, d, generator=g).to(dtype) for _ in range(2))
    xr = x.clone().requires_grad_()
    y_ref = rp.rope_ref(xr, cos, sin)
    (dx_ref,) = torch.autograd.grad(y_ref, xr, dy)
    for i in range(len(rp.CONFIGS)):
        assert_close(rp._launch_rope(x, cos, sin, False, config=i), y_ref, FWD_TOL[dtype],
                     f"config {i}: y")
        assert_close(rp._launch_rope(dy, cos, sin, True, config=i), dx_ref, FWD_TOL[dtype],
                     f"config {i}: dx")
