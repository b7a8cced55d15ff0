"""Cross-entropy with a fused log-softmax over large vocabularies, forward and backward.

For logits (M, V) and integer targets (M,), per row r with target t (ignore_index rows give 0):
    lse_r  = log(sum_v exp(x_rv))                 (online max/sum, one pass over vocab blocks)
    loss_r = lse_r - x_rt
    loss   = sum_r loss_r / #{r : t_r != ignore_index}   (reduction="mean"; also "sum", "none")
    dx_rv  = (exp(x_rv - lse_r) - [v == t_r]) * g_r      (g_r = grad_out / n_valid for "mean")

Memory: the forward reads the logits once (read MV) and writes two floats per row (loss_r, lse_r);
no (M, V) temporary exists. The backward reads the logits and the saved lse again and writes the
gradient **in place into the logits buffer** (read MV, write MV) by default, so at no point does a
second logits-sized tensor exist: the eager path (log_softmax then nll_loss) writes an (M, V)
log-probability tensor in the forward and a separate (M, V) gradient in the backward.
The logits buffer therefore holds the gradient after backward: pass ``inplace_backward=False``
when something else still needs the logits (then the backward allocates the (M, V) gradient).
All math is fp32; the returned loss is fp32 whatever the logits dtype.

Not checked on the device: a target outside [0, V) that is not ignore_index reads an arbitrary
logit instead of raising (torch raises); the reference raises.

Run the tests:  TRITON_INTERPRET=1 pytest tests/kernels/test_kernel_cross_entropy.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _launch
from kernels.softmax import _online_max_sum

BLOCK_V = 4096
NUM_WARPS = 8


def cross_entropy_ref(logits, target, ignore_index: int = -100, reduction: str = "mean"):
    # read MV (logits), write MV fp32 (log-probs); the backward writes another MV gradient
    logp = torch.log_softmax(logits.float(), dim=-1)  # (M, V)
    valid = target != ignore_index  # (M,)
    safe = torch.where(valid, target, torch.zeros_like(target))
    nll = -logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * valid  # (M,)
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    return nll.sum() / valid.sum()


@triton.jit
def _ce_fwd_kernel(LOGITS, TARGET, LOSS, LSE, V, stride_l, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = LOGITS + row * stride_l
    m_row, d_row = _online_max_sum(row_ptr, V, BLOCK_V)
    lse = m_row + tl.log(d_row)
    t = tl.load(TARGET + row)
    valid = t != ignore_index
    x_t = tl.load(row_ptr + tl.where(valid, t, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
    tl.store(LSE + row, lse)


@triton.jit
def _ce_bwd_kernel(LOGITS, TARGET, LSE, SCALE, DLOGITS, V, stride_l, stride_d, stride_s,
                   ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(TARGET + row)
    valid = t != ignore_index
    lse = tl.load(LSE + row)
    g = tl.load(SCALE + row * stride_s)
    g = tl.where(valid, g, 0.0)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(LOGITS + row * stride_l + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        dx = (p - tl.where(cols == t, 1.0, 0.0)) * g
        tl.store(DLOGITS + row * stride_d + cols, dx.to(DLOGITS.dtype.element_ty), mask=mask)


class _CrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, inplace_backward, block_v):
        _launch.check_device("cross_entropy", logits, target)
        _launch.float_dtypes_ok("cross_entropy", logits)
        v = logits.shape[-1]
        x2 = logits.reshape(-1, v)  # (M, V)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        t = target.reshape(-1)
        if t.shape[0] != x2.shape[0]:
            raise ValueError(f"cross_entropy: {t.shape[0]} targets for {x2.shape[0]} rows of logits")
        m = x2.shape[0]
        loss_rows = _launch.empty((m,), torch.float32, logits.device)
        lse = _launch.empty((m,), torch.float32, logits.device)
        if m > 0:
            _ce_fwd_kernel[(m,)](x2, t, loss_rows, lse, v, x2.stride(0), ignore_index,
                                 BLOCK_V=block_v, num_warps=NUM_WARPS)
        n_valid = (t != ignore_index).sum()  # stays on the device: no host sync
        if reduction == "none":
            loss = loss_rows.view(target.shape)
        elif reduction == "sum":
            loss = loss_rows.sum()
        else:
            loss = loss_rows.sum() / n_valid
        ctx.save_for_backward(x2, t, lse, n_valid)
        ctx.meta = (ignore_index, reduction, inplace_backward, block_v, logits.shape)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        x2, t, lse, n_valid = ctx.saved_tensors
        ignore_index, reduction, inplace_backward, block_v, shape = ctx.meta
        if reduction == "none":
            scale = grad_out.reshape(-1).float().contiguous()
            stride_s = 1
        else:
            scale = grad_out.float().reshape(1)
            if reduction == "mean":
                scale = scale / n_valid
            stride_s = 0
        dx = x2 if inplace_backward else _launch.empty(x2.shape, x2.dtype, x2.device)
        if x2.shape[0] > 0:
            _ce_bwd_kernel[(x2.shape[0],)](x2, t, lse, scale, dx, x2.shape[1], x2.stride(0),
                                           dx.stride(0), stride_s, ignore_index,
                                           BLOCK_V=block_v, num_warps=NUM_WARPS)
        return dx.view(shape), None, None, None, None, None


def cross_entropy(logits, target, ignore_index: int = -100, reduction: str = "mean", *,
                  inplace_backward: bool = True, block_v: int = BLOCK_V):
    """Fused cross-entropy over the last dim of ``logits`` (..., V) with integer ``target`` (...).

    Returns an fp32 loss. With ``inplace_backward=True`` (default) the backward overwrites the
    logits buffer with the gradient and returns it (see the module docstring). ``block_v`` is the
    vocab block width (a power of two; tests use small ones to exercise the loop).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction={reduction!r}; use 'mean', 'sum' or 'none'")
    if block_v & (block_v - 1):
        raise ValueError(f"cross_entropy: block_v={block_v} must be a power of two")
    return _CrossEntropyFn.apply(logits, target, ignore_index, reduction, inplace_backward, block_v)
