"""Rotary position embedding, LLaMA "rotate half" convention, forward and backward.

x (..., T, D) (e.g. q or k in (B, H, T, D)), cos and sin (T, D) as HuggingFace builds them
(cos = cat(cos(t f), cos(t f)) over the two halves of D). With x = [x1, x2] split at D/2:
    rotate_half(x) = [-x2, x1]
    y  = x * cos + rotate_half(x) * sin      ->  y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2
    dx = dy * cos + rotate_half^T(dy * sin)  ->  dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
(rotate_half^T(z) = [z2, -z1]). No gradient flows to cos and sin.
Memory: read R T D + 2 T D, write R T D (R = product of the leading dims); eager writes four
temporaries of x's size (x*cos, the two halves' cat, *sin, the sum).
D must be even. One program handles BLOCK_T positions t (all of D) of LEAD consecutive leading
rows r: it loads the BLOCK_T rows of cos and sin once and applies them from registers to each of
its LEAD rows of x, so the tables are loaded once per LEAD rows of x instead of once per row (they
stay in L2 either way: these are load instructions and L2 traffic saved, not HBM bytes). BLOCK_T,
LEAD and the warps are autotuned on CUDA over a short list (CONFIGS); its first entry, 16
positions of one row on 4 warps, is the choice made by hand before tuning existed (it then
covered 16 flattened (r, t) rows) and what the interpreter runs.

Run the tests:  TRITON_INTERPRET=1 pytest tests/kernels/test_kernel_rope.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autopar.kernels import _launch


def rope_ref(x, cos, sin):
    # read RTD (x) + 2 TD, write RTD; eager also writes rotate_half(x) and two products
    xf = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos.float() + rot * sin.float()).to(x.dtype)


@triton.jit
def _rope_kernel(X, COS, SIN, Y, n_lead, T, HALF, BACKWARD: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, LEAD: tl.constexpr):
    n_t_blocks = tl.cdiv(T, BLOCK_T)
    pid = tl.program_id(0)  # t-blocks vary fastest: with LEAD=1 the programs walk x in order
    t = (pid % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    lead0 = (pid // n_t_blocks) * LEAD
    row0 = lead0.to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = (t[:, None] < T) & (cols[None, :] < HALF)
    d = 2 * HALF
    cs_off = t[:, None] * d + cols[None, :]
    c1 = tl.load(COS + cs_off, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs_off + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs_off, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs_off + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1: the forward with -s2, -s1
        a = -s2
        b = -s1
    else:
        a = s1
        b = s2
    for i in range(0, tl.minimum(LEAD, n_lead - lead0)):  # the tables stay in registers
        row = (row0 + i) * T * d  # x's row r at position t, column j: row + cs_off
        x1 = tl.load(X + row + cs_off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + row + cs_off + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row + cs_off, (x1 * c1 - x2 * a).to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + row + cs_off + HALF, (x2 * c2 + x1 * b).to(Y.dtype.element_ty), mask=mask)


def _cfg(block_t, lead, warps):
    return triton.Config({"BLOCK_T": block_t, "LEAD": lead}, num_warps=warps)


# (positions, leading rows, warps) per program. #0: the pre-tuning choice. #1: the same tile
# applied to 4 rows, so cos/sin are loaded once per 4 rows of x (a quarter of the table loads and
# of the programs). #2: 32 positions x 4 rows on 8 warps, the same per-thread share with half the
# programs again. #3: 64 positions of one row on 8 warps, twice the elements per thread: more
# bytes in flight per program, no reuse. sm90_build.py reports no spill for any at D=128.
CONFIGS = (_cfg(16, 1, 4), _cfg(16, 4, 4), _cfg(32, 4, 8), _cfg(64, 1, 8))
_TUNED = _launch.Tuned(_rope_kernel, CONFIGS, key=["n_lead", "T", "HALF", "BACKWARD"],
                       min_numel=_launch.TUNE_MIN_NUMEL)


def _launch_rope(x, cos, sin, backward, config=None):
    """y = rope(x) (or its backward); ``config``: the index of CONFIGS to run instead of the
    tuned choice."""
    t, d = x.shape[-2], x.shape[-1]
    x1 = x.contiguous()
    y = _launch.empty(x.shape, x.dtype, x.device)
    n_lead = x1.numel() // (t * d) if t * d else 0
    if n_lead == 0:
        return y

    def grid(meta):
        return (triton.cdiv(t, meta["BLOCK_T"]) * triton.cdiv(n_lead, meta["LEAD"]),)

    _TUNED.run(grid, x1, cos, sin, y, n_lead, t, d // 2, BACKWARD=backward,
               BLOCK_H=triton.next_power_of_2(d // 2), config=config)
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
