"""Fused LARS (kernels.optimizers.lars_step) against its plain-torch reference and against a
straightforward per-tensor LARS written here from the update rule (timm's Lars)."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernels_testutil import DEVICE, ON_CUDA, KERNEL_SETTINGS, assert_close, make_generator

from autopar.kernels import _launch
from autopar.kernels import optimizers as opt
from autopar.kernels.registry import lookup, select

# The same fp32 operations per element in all three; the squared norms are summed in another
# order (chunks of LAMB_BLOCK, then per tensor; torch.linalg.vector_norm here), a relative
# difference of a few 1e-7 in the local rate for these sizes, and the kernel may contract
# (g + wd p) * r into FMAs. On a GPU sums reorder more (LAMB's H200 run: 3.3e-5 relative).
TOL = (1e-5, 1e-4) if ON_CUDA else (1e-6, 1e-5)


def _per_tensor_lars(params, grads, bufs, *, lr, momentum=0.9, weight_decay=1e-4,
                     trust_coefficient=1e-3, eps=1e-8, nesterov=False, trust_clip=False,
                     always_adapt=False):
    """LARS on whole tensors, written out from the rule (module docstring of kernels.optimizers)."""
    for p, g, b in zip(params, grads, bufs):
        r = torch.tensor(1.0)
        if weight_decay != 0 or always_adapt:
            w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
            if w_norm > 0 and g_norm > 0:
                r = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps)
            if trust_clip:
                r = torch.clamp(r / lr, max=1.0)
        d = (g + weight_decay * p) * r
        b.mul_(momentum).add_(d)
        p.sub_(lr * (d + momentum * b if nesterov else b))


def _split(flat, offsets):
    return [flat[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


@KERNEL_SETTINGS
@given(sizes=st.lists(st.integers(0, 2500), min_size=1, max_size=5), steps=st.integers(1, 3),
       momentum=st.sampled_from([0.0, 0.9]), weight_decay=st.sampled_from([0.0, 1e-2]),
       trust_coefficient=st.sampled_from([1e-3, 0.1]), nesterov=st.booleans(),
       trust_clip=st.booleans(), always_adapt=st.booleans(),
       scale=st.sampled_from([1e-3, 1.0, 100.0]), seed=st.integers(0, 2**16))
def test_lars_matches_reference_and_per_tensor_lars(sizes, steps, momentum, weight_decay,
                                                    trust_coefficient, nesterov, trust_clip,
                                                    always_adapt, scale, seed):
    g = make_generator(seed)
    offsets = [0, *itertools.accumulate(sizes)]
    n = offsets[-1]
    p0 = scale * torch.randn(n, generator=g)
    _split(p0, offsets)[0].zero_()           # ||p|| = 0: rate 1 by rule
    kw = dict(lr=0.5, momentum=momentum, weight_decay=weight_decay,
              trust_coefficient=trust_coefficient, nesterov=nesterov, trust_clip=trust_clip,
              always_adapt=always_adapt)
    fused, ref, plain = ([p0.clone(), torch.zeros(n)] for _ in range(3))
    for _ in range(steps):
        grad = torch.randn(n, generator=g)
        _split(grad, offsets)[-1].zero_()    # ||g|| = 0: rate 1 by rule (the same tensor if only one)
        opt.lars_step(fused[0], grad, fused[1], offsets, **kw)
        opt.lars_step_ref(ref[0], grad, ref[1], offsets, **kw)
        _per_tensor_lars(_split(plain[0], offsets), _split(grad, offsets), _split(plain[1], offsets), **kw)
    for other, what in ((ref, "reference"), (plain, "per-tensor LARS")):
        assert_close(fused[0], other[0], TOL, f"param vs {what}")
        # the buffer is the step itself: compare it on its own scale, not the parameters'
        atol = TOL[0] * max(other[1].abs().max().item(), 1e-30) if n else TOL[0]
        assert_close(fused[1], other[1], (atol, TOL[1]), f"momentum_buffer vs {what}")


def test_lars_first_step_by_hand():
    """Step 1, zero buffer, no weight decay, always adapting: p moves by lr * tc ||p|| / ||g|| * g,
    a step of norm lr * tc * ||p|| whatever the gradient's scale (the point of LARS)."""
    n, lr, tc = 3000, 0.5, 1e-2
    g = make_generator(0)
    p = torch.randn(n, generator=g)
    for grad_scale in (1e-4, 1.0, 1e4):
        grad = grad_scale * torch.randn(n, generator=g)
        new = p.clone()
        opt.lars_step(new, grad, torch.zeros(n), [0, n], lr=lr, weight_decay=0.0,
                      trust_coefficient=tc, eps=0.0, always_adapt=True)
        assert_close(new, p - lr * tc * p.norm() / grad.norm() * grad, (1e-6, 1e-5), f"scale {grad_scale}")
        torch.testing.assert_close((p - new).norm(), lr * tc * p.norm(), rtol=1e-4, atol=0)


def test_lars_reduce_sq_sees_the_norms_and_only_when_adapting():
    """``reduce_sq`` gets (||p||^2, ||g||^2) per tensor (zeros for an empty buffer: the other
    shards' ranks wait in its all-reduce) and its result sets the rates; a group that does not
    adapt (weight_decay 0, not always_adapt) calls no reduce_sq at all."""
    offsets = [0, 300, 300, 2600]
    g = make_generator(3)
    p0, grad = torch.randn(2600, generator=g), torch.randn(2600, generator=g)
    seen = []

    def doubled(sq):                    # as if a second shard held the same values
        seen.append(sq.clone())
        return 2 * sq

    for fn in (opt.lars_step, opt.lars_step_ref):
        seen.clear()
        p = p0.clone()
        fn(p, grad, torch.zeros(2600), offsets, lr=0.5, weight_decay=1e-2, reduce_sq=doubled)
        want = torch.stack([torch.stack((a.square().sum(), b.square().sum()))
                            for a, b in zip(_split(p0, offsets), _split(grad, offsets))])
        assert len(seen) == 1
        torch.testing.assert_close(seen[0], want, rtol=1e-5, atol=0)
        # doubling both squared norms leaves ||p|| / (||g|| + wd ||p||) and so the step unchanged
        plain = p0.clone()
        opt.lars_step_ref(plain, grad, torch.zeros(2600), offsets, lr=0.5, weight_decay=1e-2)
        assert_close(p, plain, TOL, fn.__name__)
        q = p0.clone()                  # ||p|| doubled, ||g|| kept: the rate follows what reduce_sq returns
        fn(q, grad, torch.zeros(2600), offsets, lr=0.5, weight_decay=1e-2,
           reduce_sq=lambda sq: sq * torch.tensor([4.0, 1.0]))
        assert (q - plain).abs().max() > 100 * TOL[0], fn.__name__
        seen.clear()
        fn(p, grad, torch.zeros(2600), offsets, lr=0.5, weight_decay=0.0, reduce_sq=doubled)
        assert not seen
    empty = torch.zeros(0)
    opt.lars_step(empty, empty, empty, [0, 0, 0], lr=0.5, reduce_sq=doubled)
    assert len(seen) == 1 and torch.equal(seen[0], torch.zeros(2, 2))


LARS_OFFSETS = [0, 5, 5, 3005, 5054, 5055]  # chunks of 2048: 1 + 0 + 2 + 2 + 1 = 6


def _one_step(fn, **kw):
    g = make_generator(7)
    n = LARS_OFFSETS[-1]
    p, grad, buf = torch.randn(n, generator=g), torch.randn(n, generator=g), 0.01 * torch.randn(n, generator=g)
    fn(p, grad, buf, LARS_OFFSETS, lr=0.5, weight_decay=1e-2, nesterov=True, **kw)
    return p, grad, buf


def test_every_config_matches_reference():
    """Each config of LAMB_CONFIGS (1, 2 or 4 chunks per program over 6 chunks; LARS's kernels
    share LAMB's chunk table and list) against one reference step from a non-zero buffer."""
    want = _one_step(opt.lars_step_ref)
    for i in range(len(opt.LAMB_CONFIGS)):
        got = _one_step(opt.lars_step, config=i)
        assert_close(got[0], want[0], TOL, f"config {i}: param")
        assert_close(got[2], want[2], TOL, f"config {i}: momentum_buffer")
        assert torch.equal(got[1], want[1])          # grad is only read


def test_autotuning_applies_one_step(monkeypatch):
    """The autotuner launches every config on the real buffers before the launch that counts:
    restore_value must put param and buffer back after each trial (the benchmark is replaced by
    two launches per config, timed so that the last config wins)."""
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    monkeypatch.setattr(_launch, "check_device", lambda *tensors: None)
    trials = []
    for t in (opt._LARS_NORMS, opt._LARS_APPLY):
        clock = itertools.count(100, -1)

        def bench(kernel_call, quantiles, clock=clock):
            kernel_call()
            kernel_call()
            trials.append(next(clock))
            return [trials[-1]] * len(quantiles)

        monkeypatch.setattr(t, "min_numel", 0)
        monkeypatch.setattr(t._autotuner, "cache", {})
        monkeypatch.setitem(vars(t._autotuner), "do_bench", bench)
    got, want = _one_step(opt.lars_step), _one_step(opt.lars_step_ref)
    assert len(trials) == 2 * len(opt.LAMB_CONFIGS)
    assert_close(got[0], want[0], TOL, "param")
    assert_close(got[2], want[2], TOL, "momentum_buffer")


def test_registry_and_argument_errors(monkeypatch):
    assert lookup("lars").triton is opt.lars_step and lookup("lars").reference is opt.lars_step_ref
    assert select("lars", DEVICE) is opt.lars_step            # CUDA, or TRITON_INTERPRET=1
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="momentum_buffer must be a flat contiguous fp32"):
        opt.lars_step(x, x, x.double(), [0, 8], lr=1.0)
    with pytest.raises(ValueError, match="momentum_buffer has 7 elements"):
        opt.lars_step(x, x, x[:7], [0, 8], lr=1.0)
    with pytest.raises(ValueError, match="lars: offsets"):
        opt.lars_step(x, x, x, [0, 3], lr=1.0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert select("lars", "cpu") is opt.lars_step_ref
