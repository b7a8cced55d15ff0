"""Row softmax (last dim), forward and backward, with an online max/sum for long rows.

Short rows (next_power_of_2(N) <= 32768) are loaded once into one block:
    y = exp(x - max(x)) / sum(exp(x - max(x)))           read MN, write MN
Long rows loop over BLOCK_N-wide blocks twice. Pass one keeps a running max m and a running sum
d per lane (the online softmax of Milakov & Gimelshein, 2018): when a new block raises the max,
the old sum is rescaled by exp(m_old - m_new); the lanes are combined once at the end. Pass two
re-reads the row and writes exp(x - m) / d:                 read 2 MN, write MN
Backward: dx = y * (dy - sum(y * dy))                       read 2 MN, write MN (long rows: 3 MN read)

A row that is entirely -inf gives NaN, as torch.softmax does.

Warps are autotuned on CUDA per block width (norms.row_tuned: _row_warps first, the choice made
by hand before tuning existed, then twice and half as many).

Run the tests:  TRITON_INTERPRET=1 pytest tests/kernels/test_kernel_softmax.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autopar.kernels import _launch
from autopar.kernels.norms import row_tuned

SINGLE_BLOCK_MAX = 32768
LOOP_BLOCK = 4096


def softmax_ref(x):
    # read MN (x), write MN fp32 exp temporaries, write MN (y)
    xf = x.float()
    e = torch.exp(xf - xf.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)


@triton.jit
def _online_max_sum(X, N, BLOCK_N: tl.constexpr):
    """Per-row max and sum(exp(x - max)) over a row of N elements read in BLOCK_N blocks."""
    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    d = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(X + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes that have seen only -inf
        d = d * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    m_row = tl.max(m, axis=0)
    m_row_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    d_row = tl.sum(d * tl.exp(m - m_row_safe), axis=0)
    return m_row, d_row


@triton.jit
def _softmax_fwd_kernel(X, Y, N, stride_x, stride_y, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    if SINGLE:
        cols = tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(y_row + cols, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=cols < N)
    else:
        m_row, d_row = _online_max_sum(x_row, N, BLOCK_N)
        inv = 1.0 / d_row
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x = tl.load(x_row + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
            tl.store(y_row + cols, (tl.exp(x - m_row) * inv).to(Y.dtype.element_ty), mask=cols < N)


@triton.jit
def _softmax_bwd_kernel(Y, DY, DX, N, stride_y, stride_dy, stride_dx,
                        BLOCK_N: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    y_row = Y + row * stride_y
    dy_row = DY + row * stride_dy
    dx_row = DX + row * stride_dx
    if SINGLE:
        cols = tl.arange(0, BLOCK_N)
        y = tl.load(y_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(y * dy, axis=0))
        tl.store(dx_row + cols, dx.to(DX.dtype.element_ty), mask=cols < N)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            y = tl.load(y_row + cols, mask=cols < N, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=cols < N, other=0.0).to(tl.float32)
            acc += y * dy
        dot = tl.sum(acc, axis=0)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            y = tl.load(y_row + cols, mask=cols < N, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=cols < N, other=0.0).to(tl.float32)
            tl.store(dx_row + cols, (y * (dy - dot)).to(DX.dtype.element_ty), mask=cols < N)


def _config(n: int, block_n: int | None):
    """(BLOCK_N, SINGLE): one block per row when it fits, else LOOP_BLOCK-wide blocks."""
    if block_n is not None:
        return block_n, triton.next_power_of_2(n) <= block_n
    if triton.next_power_of_2(n) <= SINGLE_BLOCK_MAX:
        return triton.next_power_of_2(n), True
    return LOOP_BLOCK, False


def _softmax_fwd(x2, block_n, config=None):
    """y = softmax(x2) over rows; ``config``: the index of the warps config to run."""
    n = x2.shape[1]
    y = _launch.empty(x2.shape, x2.dtype, x2.device)
    blk, single = _config(n, block_n)
    row_tuned(_softmax_fwd_kernel, blk, ("N",)).run(
        (x2.shape[0],), x2, y, n, x2.stride(0), y.stride(0), BLOCK_N=blk, SINGLE=single,
        config=config)
    return y


def _softmax_bwd(y, dy2, block_n, config=None):
    """dx = y * (dy - sum(y * dy)) over rows; ``config`` as for _softmax_fwd."""
    n = y.shape[1]
    dx = _launch.empty(y.shape, y.dtype, y.device)
    blk, single = _config(n, block_n)
    row_tuned(_softmax_bwd_kernel, blk, ("N",)).run(
        (y.shape[0],), y, dy2, dx, n, y.stride(0), dy2.stride(0), dx.stride(0), BLOCK_N=blk,
        SINGLE=single, config=config)
    return dx


class _SoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, block_n):
        _launch.check_device("softmax", x)
        _launch.float_dtypes_ok("softmax", x)
        n = x.shape[-1]
        y = _softmax_fwd(x.reshape(-1, n).contiguous(), block_n)  # (M, N)
        ctx.save_for_backward(y)
        ctx.block_n = block_n
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        dy2 = dy.reshape(-1, y.shape[-1]).contiguous()
        return _softmax_bwd(y, dy2, ctx.block_n).view(dy.shape), None


def softmax(x, *, block_n: int | None = None):
    """Softmax over the last dim. ``block_n`` forces the block width (tests use it to exercise the
    multi-block loop on short rows); by default rows up to 32768 wide are one block."""
    return _SoftmaxFn.apply(x, block_n)
