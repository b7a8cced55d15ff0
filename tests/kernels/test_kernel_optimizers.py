"""Fused AdamW against torch.optim.AdamW and LAMB against the plain-torch reference."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernels_testutil import ON_CUDA, KERNEL_SETTINGS, assert_close, make_generator

from autopar.kernels import _launch
from autopar.kernels import optimizers as opt

# AdamW: the same fp32 operations in torch's order (IEEE sqrt/div, lerp and addcmul as FMAs);
# measured bitwise equal to torch's single-tensor AdamW for exp_avg / exp_avg_sq in the
# interpreter and within 2 ulp for param (torch's scalar-tensor ops round differently).
ADAMW_TOL = (1e-7, 1e-6)
# Norms are summed in a different order than torch.norm. On a GPU the order differs more: the
# H200 run (benchmarks/results/kernel_tests_h200.txt) saw 2.1e-6 absolute / 3.3e-5 relative on
# one element of a 42-element tensor at scale 100.
LAMB_TOL = (1e-5, 1e-4) if ON_CUDA else (1e-6, 1e-5)


@KERNEL_SETTINGS
@given(n=st.integers(1, 5000), steps=st.integers(1, 4), lr=st.sampled_from([1e-3, 3e-2]),
       weight_decay=st.sampled_from([0.0, 0.1]), betas=st.sampled_from([(0.9, 0.999), (0.8, 0.95)]),
       eps=st.sampled_from([1e-8, 1e-6]), seed=st.integers(0, 2**16))
def test_adamw_matches_torch_optim(n, steps, lr, weight_decay, betas, eps, seed):
    g = make_generator(seed)
    p0 = torch.randn(n, generator=g)
    param, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    ref_param = torch.nn.Parameter(p0.clone())
    torch_opt = torch.optim.AdamW([ref_param], lr=lr, betas=betas, eps=eps,
                                  weight_decay=weight_decay, foreach=False)
    ref2 = (p0.clone(), torch.zeros(n), torch.zeros(n))
    for step in range(1, steps + 1):
        grad = torch.randn(n, generator=g)
        opt.adamw_step(param, grad, m, v, step=step, lr=lr, beta1=betas[0], beta2=betas[1],
                       eps=eps, weight_decay=weight_decay)
        opt.adamw_step_ref(*ref2[:1], grad, *ref2[1:], step=step, lr=lr, beta1=betas[0],
                           beta2=betas[1], eps=eps, weight_decay=weight_decay)
        ref_param.grad = grad.clone()
        torch_opt.step()
    state = torch_opt.state[ref_param]
    assert_close(param, ref_param.detach(), ADAMW_TOL, "param")
    assert_close(m, state["exp_avg"], ADAMW_TOL, "exp_avg")
    assert_close(v, state["exp_avg_sq"], ADAMW_TOL, "exp_avg_sq")
    # the plain-torch reference is torch's algorithm operation for operation: bitwise equal
    assert torch.equal(ref2[0], ref_param.detach())


def test_adamw_first_step_by_hand():
    """Step 1: m_hat = g and v_hat = g^2, so p = p (1 - lr wd) - lr g / (|g| + eps)."""
    g = make_generator(0)
    p, grad = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    expect = p * (1 - 1e-2 * 0.1) - 1e-2 * grad / (grad.abs() + 1e-8)
    opt.adamw_step(p, grad, torch.zeros(1000), torch.zeros(1000), step=1, lr=1e-2,
                   weight_decay=0.1)
    assert_close(p, expect, (1e-6, 1e-5), "param")


@KERNEL_SETTINGS
@given(sizes=st.lists(st.integers(0, 2500), min_size=1, max_size=5), steps=st.integers(1, 3),
       weight_decay=st.sampled_from([0.0, 0.01]), bias_correction=st.booleans(),
       scale=st.sampled_from([1e-3, 1.0, 100.0]), seed=st.integers(0, 2**16))
def test_lamb_matches_reference(sizes, steps, weight_decay, bias_correction, scale, seed):
    g = make_generator(seed)
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    n = offsets[-1]
    p0 = scale * torch.randn(n, generator=g)  # scale pushes trust ratios against both clamps
    if len(sizes) > 1:
        p0[offsets[0]:offsets[1]] = 0  # a zero tensor: ratio 1 by rule
    bufs = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    ref = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    for step in range(1, steps + 1):
        grad = torch.randn(n, generator=g)
        kw = dict(step=step, lr=1e-2, weight_decay=weight_decay, bias_correction=bias_correction)
        opt.lamb_step(bufs[0], grad, bufs[1], bufs[2], offsets, **kw)
        opt.lamb_step_ref(ref[0], grad, ref[1], ref[2], offsets, **kw)
    for name, a, e in zip(("param", "exp_avg", "exp_avg_sq"), bufs, ref):
        assert_close(a, e, LAMB_TOL, name)


def test_lamb_first_step_by_hand():
    """Step 1, no weight decay: m_hat = g and v_hat = g^2, so u = g / (|g| + eps) ~ sign(g),
    ||u|| = sqrt(n) and p moves by lr * clamp(||p|| / sqrt(n), 0.01, 10) * sign(g)."""
    n = 400
    g = make_generator(0)
    grad = torch.randn(n, generator=g)
    for scale, expected_ratio in ((1.0, None), (1e3, 10.0), (1e-5, 0.01)):
        p = scale * torch.randn(n, generator=g)
        ratio = expected_ratio or (p.norm() / math.sqrt(n)).item()
        expect = p - 1e-2 * ratio * grad / (grad.abs() + 1e-6)
        opt.lamb_step(p, grad, torch.zeros(n), torch.zeros(n), [0, n], step=1, lr=1e-2,
                      weight_decay=0.0)
        assert_close(p, expect, (1e-6, 1e-5), f"scale {scale}")


def test_lamb_chunks_never_straddle_tensors():
    tid, start, end = opt.lamb_chunks([0, 5, 5, 4100, 4101], 4101, block=2048)
    assert tid.tolist() == [0, 2, 2, 3]
    assert start.tolist() == [0, 5, 2053, 4100]
    assert end.tolist() == [5, 2053, 4100, 4101]


def test_optimizer_argument_errors():
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="flat contiguous fp32"):
        opt.adamw_step(x.double(), x, x, x, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="steps count from 1"):
        opt.adamw_step(x, x, x, x, step=0, lr=1e-3)
    with pytest.raises(ValueError, match="offsets"):
        opt.lamb_step(x, x, x, x, [0, 3], step=1, lr=1e-3)


def _state(n, seed):
    """param, grad, exp_avg, exp_avg_sq as after a few steps (moments not zero)."""
    g = make_generator(seed)
    p, grad, m, v = (torch.randn(n, generator=g) for _ in range(4))
    return p, grad, 0.1 * m, 0.01 * v.abs()


ADAMW_N = 5000
LAMB_OFFSETS = [0, 5, 5, 3005, 5054, 5055]  # chunks of 2048: 1 + 0 + 2 + 2 + 1 = 6


def _steps(config=None):
    """(AdamW result, its reference, LAMB result, its reference): one step each from the same
    state, the fused kernels with ``config`` (None: the tuned choice)."""
    out = []
    for fused, ref, extra in ((opt.adamw_step, opt.adamw_step_ref, ()),
                              (opt.lamb_step, opt.lamb_step_ref, (LAMB_OFFSETS,))):
        bufs = _state(LAMB_OFFSETS[-1] if extra else ADAMW_N, seed=len(extra))
        expect = [b.clone() for b in bufs]
        fused(*bufs, *extra, step=3, lr=1e-2, config=config)
        ref(*expect, *extra, step=3, lr=1e-2)
        out += [bufs, expect]
    return out


def _assert_steps(results, what):
    adamw, adamw_ref, lamb, lamb_ref = results
    for name, i in (("param", 0), ("exp_avg", 2), ("exp_avg_sq", 3)):
        assert_close(adamw[i], adamw_ref[i], ADAMW_TOL, f"{what}: adamw {name}")
        assert_close(lamb[i], lamb_ref[i], LAMB_TOL, f"{what}: lamb {name}")
    assert torch.equal(adamw[1], adamw_ref[1]) and torch.equal(lamb[1], lamb_ref[1])  # grad read only


def test_every_config_matches_reference():
    """Each config of ADAMW_CONFIGS and LAMB_CONFIGS against one step of the references: blocks
    of 512..2048 over 5000 elements; 1, 2 or 4 chunks per program over LAMB's 6 chunks (4 leaves
    the last program's tile half empty), with the NaN-poisoned partial sums."""
    for i in range(max(len(opt.ADAMW_CONFIGS), len(opt.LAMB_CONFIGS))):
        _assert_steps(_steps(config=i), f"config {i}")


def test_autotuning_applies_one_step(monkeypatch):
    """Autotuning launches every config several times on the real buffers before the launch
    that counts, and these kernels update them in place: restore_value must put them back after
    each trial. The CUDA path of Tuned runs here under the interpreter with the benchmark
    replaced (it launches each config twice and times the later configs faster, so the launch
    after tuning runs the last one); the result must still be a single step of the reference."""
    tuned = (opt._ADAMW, opt._LAMB_MOMENTS, opt._LAMB_APPLY)
    trials = {t.name: [] for t in tuned}
    monkeypatch.setattr(_launch, "interpreting", lambda: False)  # take the autotuner's path
    monkeypatch.setattr(_launch, "check_device", lambda *tensors: None)  # CPU tensors are fine
    for t in tuned:
        clock = itertools.count(100, -1)

        def bench(kernel_call, quantiles, name=t.name, clock=clock):
            kernel_call()
            kernel_call()
            trials[name].append(next(clock))
            return [trials[name][-1]] * len(quantiles)

        monkeypatch.setattr(t, "min_numel", 0)
        monkeypatch.setattr(t._autotuner, "cache", {})
        # do_bench is a cached_property: an entry in the instance dict is what it would cache
        monkeypatch.setitem(vars(t._autotuner), "do_bench", bench)
    _assert_steps(_steps(), "autotuned")
    for t in tuned:
        assert len(trials[t.name]) == len(t.configs), t.name
        assert t.best_config is t.configs[-1], t.name
