"""Fused cross-entropy (loss, lse pass and in-place gradient) against the reference and torch."""

import pytest
import torch
import torch.nn.functional as F
import triton
from hypothesis import given
from hypothesis import strategies as st
from kernels_testutil import KERNEL_SETTINGS, ON_CUDA, assert_close, make_generator

from autopar.kernels import cross_entropy as ce

LOSS_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 1e-5)}  # fp32 math on the same inputs
GRAD_TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (4e-3, 1.6e-2)}  # bf16 grads: 1 ulp


@KERNEL_SETTINGS
@given(m=st.integers(1, 17), v=st.integers(1, 300), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       block_v=st.sampled_from([16, 64, 4096]), reduction=st.sampled_from(["mean", "sum", "none"]),
       inplace=st.booleans(), ignore_frac=st.sampled_from([0.0, 0.3]), seed=st.integers(0, 2**16))
def test_cross_entropy_forward_backward(m, v, dtype, block_v, reduction, inplace, ignore_frac, seed):
    g = make_generator(seed)
    base = (4 * torch.randn(m, v, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(0, v, (m,), generator=g)
    target[torch.rand(m, generator=g) < ignore_frac] = -100
    target[0] = torch.randint(0, v, (1,), generator=g)  # at least one row counts
    loss_ref = ce.cross_entropy_ref(base, target, reduction=reduction)
    assert_close(loss_ref, F.cross_entropy(base.detach().float(), target, reduction=reduction),
                 (1e-5, 1e-5), "reference vs torch")
    grad_out = torch.rand(loss_ref.shape, generator=g) + 0.5
    (grad_ref,) = torch.autograd.grad(loss_ref, base, grad_out)

    logits = base * 1  # a non-leaf buffer, as the lm-head output would be
    loss = ce.cross_entropy(logits, target, reduction=reduction, inplace_backward=inplace,
                            block_v=block_v)
    assert loss.dtype == torch.float32
    assert_close(loss, loss_ref, LOSS_TOL[dtype], "loss")
    (grad,) = torch.autograd.grad(loss, base, grad_out)
    assert_close(grad, grad_ref, GRAD_TOL[dtype], "dlogits")
    if inplace:  # documented: the logits buffer now holds the gradient
        assert_close(logits.detach(), grad_ref, GRAD_TOL[dtype], "logits buffer after backward")


def test_cross_entropy_all_ignored_mean_is_nan_like_torch():
    logits = torch.randn(3, 10, requires_grad=True)
    target = torch.full((3,), -100)
    loss = ce.cross_entropy(logits * 1, target)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits, target))
    loss_sum = ce.cross_entropy(logits * 1, target, reduction="sum")
    assert loss_sum.item() == 0.0
    (grad,) = torch.autograd.grad(loss_sum, logits)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_cross_entropy_multi_dim_and_bad_args():
    g = make_generator(3)
    logits = torch.randn(2, 5, 33, generator=g)
    target = torch.randint(0, 33, (2, 5), generator=g)
    assert_close(ce.cross_entropy(logits.clone(), target, block_v=16),
                 F.cross_entropy(logits.reshape(-1, 33), target.reshape(-1)), (1e-5, 1e-5), "loss")
    with pytest.raises(ValueError, match="reduction"):
        ce.cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="power of two"):
        ce.cross_entropy(logits, target, block_v=48)


@pytest.mark.parametrize("m,v,block_v", [(3, 20000, ce.BLOCK_V), (9, 77, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_config_matches_reference(m, v, block_v, dtype):
    """Each config of the partial, combine and backward lists (V=20000 gets the default list:
    slices of 16384, 8192, 4096), the gradient written in place, NaN-poisoned outputs."""
    g = make_generator(v)
    x = (4 * torch.randn(m, v, generator=g)).to(dtype)
    target = torch.randint(0, v, (m,), generator=g)
    target[1] = -100
    grad_out = torch.rand(m, generator=g) + 0.5
    logits = x.float().requires_grad_()
    loss_ref = ce.cross_entropy_ref(logits, target, reduction="none")
    (grad_ref,) = torch.autograd.grad(loss_ref, logits, grad_out)
    lse_ref = torch.logsumexp(x.float(), -1)
    partial, combine, bwd = ce._tuned(min(block_v, triton.next_power_of_2(v)))
    for i in range(max(len(partial.configs), len(combine.configs), len(bwd.configs))):
        loss, lse = ce._lse_and_loss(x, target, -100, block_v,
                                     configs=(i % len(partial.configs), i % len(combine.configs)))
        assert_close(loss, loss_ref, LOSS_TOL[dtype], f"config {i}: loss")
        assert_close(lse, lse_ref, LOSS_TOL[dtype], f"config {i}: lse")
        dx = x.clone()
        ce._grad_logits(dx, target, lse, grad_out, 1, dx, -100, block_v,
                        config=i % len(bwd.configs))
        assert_close(dx, grad_ref.to(dtype), GRAD_TOL[dtype], f"config {i}: dlogits in place")


@pytest.mark.skipif(not ON_CUDA, reason="autotuning needs CUDA (the interpreter runs configs[0])")
def test_autotuned_in_place_backward_matches_reference():
    """Above TUNE_MIN_NUMEL every config is timed, the in-place backward too: each trial writes
    the gradient into the logits, so tuning must restore them (restore_value) before the next."""
    g = make_generator(7)
    base = (4 * torch.randn(64, 32768, generator=g)).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, 32768, (64,), generator=g)
    loss_ref = ce.cross_entropy_ref(base, target)
    (grad_ref,) = torch.autograd.grad(loss_ref, base)
    logits = base * 1
    loss = ce.cross_entropy(logits, target)
    assert_close(loss, loss_ref, LOSS_TOL[torch.bfloat16], "loss")
    (grad,) = torch.autograd.grad(loss, base)
    assert_close(grad, grad_ref, GRAD_TOL[torch.bfloat16], "dlogits")
