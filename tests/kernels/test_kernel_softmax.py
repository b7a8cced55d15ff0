"""Row softmax (single block and the online multi-block loop) against the reference and torch."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernels_testutil import BWD_TOL, FWD_TOL, KERNEL_SETTINGS, assert_close, make_generator

from autopar.kernels import softmax as sm


@KERNEL_SETTINGS
@given(m=st.integers(1, 20), n=st.integers(1, 300), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       block_n=st.sampled_from([None, 16, 64]), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_softmax_forward_backward(m, n, dtype, block_n, masked, seed):
    g = make_generator(seed)
    x = (3 * torch.randn(m, n, generator=g))
    if masked:  # some -inf entries, never a whole row: the online max must skip them
        drop = torch.rand(m, n, generator=g) < 0.3
        drop[:, 0] = False
        x = x.masked_fill(drop, float("-inf"))
    x = x.to(dtype).requires_grad_()
    y = sm.softmax(x, block_n=block_n)
    y_ref = sm.softmax_ref(x)
    assert_close(y, y_ref, FWD_TOL[dtype], "y")
    assert_close(sm.softmax_ref(x.detach().float()), torch.softmax(x.detach().float(), -1),
                 (1e-6, 1e-5), "reference vs torch")
    dy = torch.randn(m, n, generator=g).to(dtype)
    (dx,), (dx_ref,) = torch.autograd.grad(y, x, dy), torch.autograd.grad(y_ref, x, dy)
    assert_close(dx, dx_ref, BWD_TOL[dtype], "dx")


def test_softmax_long_row_uses_loop():
    """A row wider than the single-block limit takes the two-pass online path."""
    g = make_generator(0)
    n = sm.SINGLE_BLOCK_MAX + 77
    x = torch.randn(2, n, generator=g).requires_grad_()
    assert sm._config(n, None) == (sm.LOOP_BLOCK, False)
    y = sm.softmax(x)
    assert_close(y, torch.softmax(x, -1), (1e-7, 1e-5), "y")
    dy = torch.randn(2, n, generator=g)
    assert_close(torch.autograd.grad(y, x, dy)[0],
                 torch.autograd.grad(torch.softmax(x, -1), x, dy)[0], (1e-7, 1e-4), "dx")


@pytest.mark.parametrize("block_n", [None, 64])  # one block per row; the multi-block loop
@pytest.mark.parametrize("m,n", [(11, 200), (2, 131)])  # both 256 wide: one compile each
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_config_matches_reference(block_n, m, n, dtype):
    """Each warps config of the forward's and backward's tuned lists, NaN-poisoned outputs."""
    g = make_generator(m + n)
    x = (3 * torch.randn(m, n, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(dtype)
    y_ref = sm.softmax_ref(x)
    (dx_ref,) = torch.autograd.grad(y_ref, x, dy)
    blk, _ = sm._config(n, block_n)
    n_fwd, n_bwd = (len(sm.row_tuned(k, blk, ("N",)).configs)
                    for k in (sm._softmax_fwd_kernel, sm._softmax_bwd_kernel))
    for i in range(max(n_fwd, n_bwd)):
        y = sm._softmax_fwd(x.detach(), block_n, config=i % n_fwd)
        assert_close(y, y_ref, FWD_TOL[dtype], f"config {i}: y")
        assert_close(sm._softmax_bwd(y, dy, block_n, config=i % n_bwd), dx_ref, BWD_TOL[dtype],
                     f"config {i}: dx")
