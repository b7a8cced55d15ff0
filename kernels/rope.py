"""Rotary position embedding, LLaMA "rotate half" convention, forward and backward.

x (..., T, D) (e.g. q or k in (B, H, T, D)), cos and sin (T, D) as HuggingFace builds them
(cos = cat(cos(t f), cos(t f)) over the two halves of D). With x = [x1, x2] split at D/2:
    rotate_half(x) = [-x2, x1]
    y  = x * cos + rotate_half(x) * sin      ->  y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2
    dx = dy * cos + rotate_half^T(dy * sin)  ->  dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
(rotate_half^T(z) = [z2, -z1]). No gradient flows to cos and sin.
Memory: read R T D + 2 T D, write R T D (R = product of the leading dims); eager writes four
temporaries of x's size (x*cos, the two halves' cat, *sin, the sum).
D must be even. One program handles BLOCK_R (row, t) pairs and all of D.

Run the tests:  TRITON_INTERPRET=1 pytest tests/kernels/test_kernel_rope.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _launch

ROWS_PER_PROGRAM = 16


def rope_ref(x, cos, sin):
    # read RTD (x) + 2 TD, write RTD; eager also writes rotate_half(x) and two products
    xf = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos.float() + rot * sin.float()).to(x.dtype)


@triton.jit
def _rope_kernel(X, COS, SIN, Y, n_rows, T, HALF, BACKWARD: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat (r, t) index
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < HALF)
    t = rows % T
    d = 2 * HALF
    x_ptr = X + rows[:, None] * d + cols[None, :]
    cs_off = t[:, None] * d + cols[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + cs_off, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs_off + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs_off, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs_off + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y_ptr = Y + rows[:, None] * d + cols[None, :]
    tl.store(y_ptr, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + HALF, y2.to(Y.dtype.element_ty), mask=mask)


def _launch_rope(x, cos, sin, backward):
    t, d = x.shape[-2], x.shape[-1]
    x1 = x.contiguous()
    y = _launch.empty(x.shape, x.dtype, x.device)
    n_rows = x1.numel() // d
    block_h = triton.next_power_of_2(d // 2)
    _rope_kernel[(triton.cdiv(n_rows, ROWS_PER_PROGRAM),)](
        x1, cos, sin, y, n_rows, t, d // 2, BACKWARD=backward,
        BLOCK_R=ROWS_PER_PROGRAM, BLOCK_H=block_h, num_warps=4)
    return y


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        _launch.check_device("rope", x, cos, sin)
        _launch.float_dtypes_ok("rope", x, cos, sin)
        if x.dim() < 2 or x.shape[-1] % 2:
            raise ValueError(f"rope: x must be (..., T, D) with D even, got {tuple(x.shape)}")
        t, d = x.shape[-2], x.shape[-1]
        if cos.shape != (t, d) or sin.shape != (t, d):
            raise ValueError(f"rope: cos/sin must be (T, D) = ({t}, {d}), got "
                             f"{tuple(cos.shape)} and {tuple(sin.shape)}")
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _launch_rope(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch_rope(dy, cos, sin, backward=True), None, None


def rope(x, cos, sin):
    """Apply rotary embedding (rotate-half) to x (..., T, D) with cos, sin of shape (T, D)."""
    return _RopeFn.apply(x, cos, sin)
