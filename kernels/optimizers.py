"""Fused AdamW and LAMB steps over flat fp32 buffers (param, grad, exp_avg, exp_avg_sq).

param, exp_avg and exp_avg_sq are updated in place; grad is only read. ``step`` is the step
number after incrementing (1 for the first step), as in torch.optim.

AdamW (torch.optim.AdamW, amsgrad=False, maximize=False), the same operations in the same order:
    p  = p * (1 - lr wd)                           decoupled weight decay
    m  = m + (1 - b1) (g - m)                      (lerp)
    v  = v b2 + (1 - b2) g g
    p  = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    memory: read 4N, write 3N fp32 (28 bytes per parameter); one pass.
    IEEE sqrt and division (tl.sqrt_rn, tl.div_rn) keep the rounding torch's; in the interpreter
    the result is bitwise torch's single-tensor AdamW, on a GPU within an ulp or so (FMA fusion).

LAMB (You et al., 2019; trust-ratio rule of DeepSpeed's FusedLamb), per tensor i of the flat
buffer, tensor i spanning [offsets[i], offsets[i+1]):
    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g g
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd p       (bias correction optional)
    r_i = clamp(||p_i|| / ||u_i||, min_trust, max_trust) if both norms > 0 else 1
          (defaults [0.01, 10], DeepSpeed's min_coeff/max_coeff)
    p = p - lr r_i u
    Two passes, because r_i needs the whole tensor's norms before any p changes:
    pass 1 updates m, v and writes per-chunk partial sums of p^2 and u^2 (read 4N, write 2N);
    torch sums the partials per tensor and forms r (tiny); pass 2 recomputes u from m, v, p and
    writes p (read 3N, write N). Total 40 bytes per parameter. Chunks never straddle two tensors:
    the chunk table (tensor id, start, end per chunk) is built on the host from ``offsets``.

Run the tests:  TRITON_INTERPRET=1 pytest tests/kernels/test_kernel_optimizers.py
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels import _launch

ADAMW_BLOCK = 1024
LAMB_BLOCK = 2048


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def adamw_step_ref(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float,
                   beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 1e-2) -> None:
    """torch.optim.AdamW's single-tensor step in plain torch. Reads 4N, writes 3N, but eagerly:
    each line is its own pass over memory (about 8 reads and 6 writes of N)."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def lamb_step_ref(param, grad, exp_avg, exp_avg_sq, offsets: Sequence[int], *, step: int,
                  lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-6,
                  weight_decay: float = 1e-2, min_trust: float = 0.01, max_trust: float = 10.0,
                  bias_correction: bool = True) -> None:
    """LAMB in plain torch, one tensor slice at a time (see the module docstring)."""
    offsets = _offsets_list(offsets, param.numel())
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        p, g, m, v = param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        u = (m / bc1) / ((v / bc2).sqrt() + eps) + weight_decay * p
        w_norm, u_norm = p.norm(), u.norm()
        # no Python branch on tensor values, so torch.compile traces this without graph breaks
        ratio = torch.where((w_norm > 0) & (u_norm > 0),
                            (w_norm / u_norm).clamp(min_trust, max_trust), torch.ones_like(w_norm))
        p.sub_(lr * ratio * u)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _adamw_kernel(P, G, M, V, numel, decay, one_minus_beta1, beta2, one_minus_beta2, eps,
                  step_size, bc2_sqrt, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    p = p * decay
    m = tl.fma(one_minus_beta1, g - m, m)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn((-step_size) * m, denom)  # addcdiv: self + (value * t1) / t2
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)


@triton.jit
def _lamb_update(p, m, v, inv_bc1, inv_bc2, eps, weight_decay):
    return (m * inv_bc1) / (tl.sqrt(v * inv_bc2) + eps) + weight_decay * p


@triton.jit
def _lamb_moments_kernel(P, G, M, V, CHUNK_START, CHUNK_END, PART, beta1, beta2, eps,
                         weight_decay, inv_bc1, inv_bc2, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    start = tl.load(CHUNK_START + c)
    end = tl.load(CHUNK_END + c)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < end
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    u = tl.where(mask, _lamb_update(p, m, v, inv_bc1, inv_bc2, eps, weight_decay), 0.0)
    tl.store(PART + 2 * c, tl.sum(p * p, axis=0))
    tl.store(PART + 2 * c + 1, tl.sum(u * u, axis=0))


@triton.jit
def _lamb_apply_kernel(P, M, V, RATIO, CHUNK_TENSOR, CHUNK_START, CHUNK_END, lr, eps,
                       weight_decay, inv_bc1, inv_bc2, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    start = tl.load(CHUNK_START + c)
    end = tl.load(CHUNK_END + c)
    ratio = tl.load(RATIO + tl.load(CHUNK_TENSOR + c))
    offs = start + tl.arange(0, BLOCK)
    mask = offs < end
    p = tl.load(P + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    p = p - (lr * ratio) * _lamb_update(p, m, v, inv_bc1, inv_bc2, eps, weight_decay)
    tl.store(P + offs, p, mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _check_buffers(name, param, grad, exp_avg, exp_avg_sq):
    bufs = (param, grad, exp_avg, exp_avg_sq)
    _launch.check_device(name, *bufs)
    for label, t in zip(("param", "grad", "exp_avg", "exp_avg_sq"), bufs):
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name}: {label} must be a flat contiguous fp32 buffer, got "
                             f"{t.dtype} of shape {tuple(t.shape)}")
        if t.numel() != param.numel():
            raise ValueError(f"{name}: {label} has {t.numel()} elements, param {param.numel()}")


def adamw_step(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float = 0.9,
               beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
    """One fused AdamW step, in place on param, exp_avg, exp_avg_sq (see module docstring)."""
    _check_buffers("adamw_step", param, grad, exp_avg, exp_avg_sq)
    if step < 1:
        raise ValueError(f"adamw_step: step={step}; steps count from 1")
    numel = param.numel()
    if numel == 0:
        return
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    _adamw_kernel[(triton.cdiv(numel, ADAMW_BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, numel, 1 - lr * weight_decay, 1 - beta1, beta2,
        1 - beta2, eps, lr / bias_correction1, math.sqrt(bias_correction2),
        BLOCK=ADAMW_BLOCK, num_warps=4)


def _offsets_list(offsets, numel: int) -> list[int]:
    offs = [int(o) for o in (offsets.tolist() if torch.is_tensor(offsets) else offsets)]
    if len(offs) < 2 or offs[0] != 0 or offs[-1] != numel or any(
            b < a for a, b in zip(offs[:-1], offs[1:])):
        raise ValueError(f"lamb: offsets must rise from 0 to numel={numel} (one more entry than "
                         f"tensors), got {offs[:4]}{'...' if len(offs) > 4 else ''}")
    return offs


def lamb_chunks(offsets: Sequence[int], numel: int, block: int = LAMB_BLOCK):
    """Chunk table for the LAMB kernels: (tensor_id, start, end) int64 CPU tensors, one entry per
    block-sized chunk of each tensor (empty tensors get none). Build it once per parameter layout
    and pass it to ``lamb_step(chunks=...)`` (moved to the device) to skip the per-step copy."""
    offs = torch.tensor(_offsets_list(offsets, numel), dtype=torch.int64)
    per_tensor = (offs[1:] - offs[:-1] + block - 1) // block  # chunks per tensor
    tid = torch.repeat_interleave(torch.arange(per_tensor.numel()), per_tensor)
    first = torch.cumsum(per_tensor, 0) - per_tensor  # index of each tensor's first chunk
    start = offs[tid] + (torch.arange(tid.numel()) - first[tid]) * block
    end = torch.minimum(start + block, offs[tid + 1])
    return tid, start, end


def lamb_step(param, grad, exp_avg, exp_avg_sq, offsets: Sequence[int], *, step: int,
              lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-6,
              weight_decay: float = 1e-2, min_trust: float = 0.01, max_trust: float = 10.0,
              bias_correction: bool = True, chunks=None) -> None:
    """One fused LAMB step over a flat buffer holding several tensors (see module docstring).
    ``chunks``: a precomputed ``lamb_chunks(offsets, numel)`` already on param's device."""
    _check_buffers("lamb_step", param, grad, exp_avg, exp_avg_sq)
    if step < 1:
        raise ValueError(f"lamb_step: step={step}; steps count from 1")
    offs = _offsets_list(offsets, param.numel())
    n_tensors = len(offs) - 1
    if chunks is None:
        chunks = tuple(t.to(param.device) for t in lamb_chunks(offs, param.numel()))
    tid, start, end = chunks
    n_chunks = tid.numel()
    if n_chunks == 0:
        return
    inv_bc1 = 1.0 / (1 - beta1**step) if bias_correction else 1.0
    inv_bc2 = 1.0 / (1 - beta2**step) if bias_correction else 1.0
    part = _launch.empty((n_chunks, 2), torch.float32, param.device)
    _lamb_moments_kernel[(n_chunks,)](param, grad, exp_avg, exp_avg_sq, start, end, part, beta1,
                                      beta2, eps, weight_decay, inv_bc1, inv_bc2,
                                      BLOCK=LAMB_BLOCK, num_warps=8)
    sq = torch.zeros(n_tensors, 2, dtype=torch.float32, device=param.device).index_add_(0, tid, part)
    w_norm, u_norm = sq.sqrt().unbind(1)
    ratio = torch.where((w_norm > 0) & (u_norm > 0),
                        (w_norm / u_norm).clamp(min_trust, max_trust), torch.ones_like(w_norm))
    _lamb_apply_kernel[(n_chunks,)](param, exp_avg, exp_avg_sq, ratio, tid, start, end, lr, eps,
                                    weight_decay, inv_bc1, inv_bc2, BLOCK=LAMB_BLOCK, num_warps=8)
