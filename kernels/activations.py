"""Bias + GeLU and SwiGLU, forward and backward, fused elementwise kernels.

bias_gelu(x, bias, approximate):   y = gelu(x + bias)              x (M, N), bias (N,) or None
    erf:   gelu(u) = u/2 * (1 + erf(u / sqrt 2))
           gelu'(u) = (1 + erf(u / sqrt 2)) / 2 + u * exp(-u^2 / 2) / sqrt(2 pi)
    tanh:  gelu(u) = u/2 * (1 + tanh(k (u + c u^3))),  k = sqrt(2/pi), c = 0.044715
           gelu'(u) = (1 + t) / 2 + u/2 (1 - t^2) k (1 + 3 c u^2)      (t = the tanh above)
    forward  read MN (+N), write MN      (eager: add writes MN, gelu reads it back: 2 MN more)
    backward read 2 MN (x, dy), write MN (dx); dbias = sum_rows dx from per-program partial sums,
             each program walking a column stripe of rows so the partials stay small.
    Matches F.gelu(x + bias, approximate=...) (tanh is written through sigmoid: tanh(z) =
    2 sigmoid(2z) - 1, since tl has no tanh in every Triton version).

swiglu(a, b):   y = silu(a) * b = a * sigmoid(a) * b          (the LLaMA MLP gate)
    forward  read 2 MN, write MN;   backward read 3 MN, write 2 MN:
    da = dy * b * s * (1 + a (1 - s)),  db = dy * a * s,  s = sigmoid(a)

Run the tests:  TRITON_INTERPRET=1 pytest tests/kernels/test_kernel_activations.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import _launch

BLOCK_M = 8
BLOCK_N_MAX = 1024
FLAT_BLOCK = 2048


def bias_gelu_ref(x, bias=None, approximate: str = "none"):
    # read MN (x), write MN fp32 (u = x + bias), read it back, write MN (y)
    u = x.float() if bias is None else x.float() + bias.float()
    return F.gelu(u, approximate=approximate).to(x.dtype)


def swiglu_ref(a, b):
    # read 2 MN, write MN fp32 silu(a), read it back, write MN (y)
    return (F.silu(a.float()) * b.float()).to(a.dtype)


@triton.jit
def _tanh(z):
    return 2.0 * tl.sigmoid(2.0 * z) - 1.0


@triton.jit
def _gelu_and_grad(u, APPROX_TANH: tl.constexpr):
    if APPROX_TANH:
        k: tl.constexpr = 0.7978845608028654  # sqrt(2/pi)
        c: tl.constexpr = 0.044715
        t = _tanh(k * (u + c * u * u * u))
        y = 0.5 * u * (1.0 + t)
        dydu = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * k * (1.0 + 3.0 * c * u * u)
    else:
        cdf = 0.5 * (1.0 + tl.erf(u * 0.7071067811865476))
        y = u * cdf
        dydu = cdf + u * tl.exp(-0.5 * u * u) * 0.3989422804014327  # 1/sqrt(2 pi)
    return y, dydu


@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, M, N, stride_x, stride_y,
                          HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    u = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y, _ = _gelu_and_grad(u, APPROX_TANH)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(X, B, DY, DX, DB_PART, M, N, stride_x, stride_dy, stride_dx,
                          rows_per_program,
                          HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid_m.to(tl.int64) * rows_per_program
    for r0 in range(row_start, row_start + rows_per_program, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        u = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u += bias[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        _, dydu = _gelu_and_grad(u, APPROX_TANH)
        dx = tl.where(mask, dy * dydu, 0.0)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        db += tl.sum(dx, axis=0)
    if HAS_BIAS:
        tl.store(DB_PART + pid_m * N + cols, db, mask=cols < N)


@triton.jit
def _swiglu_fwd_kernel(A, B, Y, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (a * tl.sigmoid(a) * b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(A, B, DY, DA, DB, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    tl.store(DA + offs, (dy * b * s * (1.0 + a * (1.0 - s))).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dy * a * s).to(DB.dtype.element_ty), mask=mask)


def _gelu_blocks(n: int):
    block_n = min(triton.next_power_of_2(n), BLOCK_N_MAX)
    return BLOCK_M, block_n


class _BiasGeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        _launch.check_device("bias_gelu", *(t for t in (x, bias) if t is not None))
        _launch.float_dtypes_ok("bias_gelu", x)
        n = x.shape[-1]
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"bias_gelu: bias shape {tuple(bias.shape)} != ({n},)")
        x2 = x.reshape(-1, n).contiguous()  # (M, N)
        m = x2.shape[0]
        y = _launch.empty((m, n), x.dtype, x.device)
        bm, bn = _gelu_blocks(n)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _bias_gelu_fwd_kernel[grid](x2, bias if bias is not None else x2, y, m, n, x2.stride(0),
                                    y.stride(0), HAS_BIAS=bias is not None,
                                    APPROX_TANH=approximate == "tanh", BLOCK_M=bm, BLOCK_N=bn,
                                    num_warps=8 if bm * bn >= 4096 else 4)
        ctx.save_for_backward(x2, bias)
        ctx.approximate = approximate
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, bias = ctx.saved_tensors
        m, n = x2.shape
        dy2 = dy.reshape(m, n).contiguous()
        dx = _launch.empty((m, n), x2.dtype, x2.device)
        bm, bn = _gelu_blocks(n)
        n_col_blocks = triton.cdiv(n, bn)
        # enough programs to fill the GPU; each walks rows_per_program rows of one column stripe
        want = max(1, 8 * _launch.num_programs_hint(x2.device) // n_col_blocks)
        rows_per_program = triton.cdiv(triton.cdiv(m, want), bm) * bm
        grid_m = triton.cdiv(m, rows_per_program)
        db_part = _launch.empty((grid_m, n), torch.float32, x2.device) if bias is not None else dx
        _bias_gelu_bwd_kernel[(grid_m, n_col_blocks)](
            x2, bias if bias is not None else x2, dy2, dx, db_part, m, n, x2.stride(0),
            dy2.stride(0), dx.stride(0), rows_per_program, HAS_BIAS=bias is not None,
            APPROX_TANH=ctx.approximate == "tanh", BLOCK_M=bm, BLOCK_N=bn,
            num_warps=8 if bm * bn >= 4096 else 4)
        db = db_part.sum(0).to(bias.dtype) if bias is not None else None
        return dx.view(dy.shape), db, None


class _SwigluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        _launch.check_device("swiglu", a, b)
        _launch.float_dtypes_ok("swiglu", a, b)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"swiglu: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} "
                             "must have the same shape and dtype")
        a1, b1 = a.contiguous(), b.contiguous()
        y = _launch.empty(a.shape, a.dtype, a.device)
        numel = a1.numel()
        _swiglu_fwd_kernel[(triton.cdiv(numel, FLAT_BLOCK),)](a1, b1, y, numel, BLOCK=FLAT_BLOCK,
                                                             num_warps=8)
        ctx.save_for_backward(a1, b1)
        return y

    @staticmethod
    def backward(ctx, dy):
        a1, b1 = ctx.saved_tensors
        dy1 = dy.contiguous()
        da = _launch.empty(a1.shape, a1.dtype, a1.device)
        db = _launch.empty(b1.shape, b1.dtype, b1.device)
        numel = a1.numel()
        _swiglu_bwd_kernel[(triton.cdiv(numel, FLAT_BLOCK),)](a1, b1, dy1, da, db, numel,
                                                             BLOCK=FLAT_BLOCK, num_warps=8)
        return da, db


def bias_gelu(x, bias=None, approximate: str = "none"):
    """gelu(x + bias) over the last dim, ``approximate`` "none" (erf) or "tanh" like F.gelu."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: approximate={approximate!r}; use 'none' (erf) or 'tanh'")
    return _BiasGeluFn.apply(x, bias, approximate)


def swiglu(a, b):
    """silu(a) * b, elementwise; a and b have the same shape and dtype."""
    return _SwigluFn.apply(a, b)
