"""Bias + GeLU and SwiGLU, forward and backward, fused elementwise kernels.

bias_gelu(x, bias, approximate):   y = gelu(x + bias)              x (M, N), bias (N,) or None
    erf:   gelu(u) = u/2 * (1 + erf(u / sqrt 2))
           gelu'(u) = (1 + erf(u / sqrt 2)) / 2 + u * exp(-u^2 / 2) / sqrt(2 pi)
    tanh:  gelu(u) = u/2 * (1 + tanh(k (u + c u^3))),  k = sqrt(2/pi), c = 0.044715
           gelu'(u) = (1 + t) / 2 + u/2 (1 - t^2) k (1 + 3 c u^2)      (t = the tanh above)
    forward  read MN (+N), write MN      (eager: add writes MN, gelu reads it back: 2 MN more)
    backward read 2 MN (x, dy), write MN (dx); dbias = sum_rows dx from per-program partial sums,
             each program walking a column stripe of rows so the partials stay small (one
             (N,) fp32 row per row group, about PROGRAMS_PER_SM groups per SM and stripe).
    Matches F.gelu(x + bias, approximate=...) (tanh is written through sigmoid: tanh(z) =
    2 sigmoid(2z) - 1, since tl has no tanh in every Triton version).

swiglu(a, b):   y = silu(a) * b = a * sigmoid(a) * b          (the LLaMA MLP gate)
    forward  read 2 MN, write MN;   backward read 3 MN, write 2 MN:
    da = dy * b * s * (1 + a (1 - s)),  db = dy * a * s,  s = sigmoid(a)

Launch parameters are not fixed: bias_gelu's rows per tile and warps (and the backward's programs
per SM), and swiglu's flat block and warps, come from short config lists autotuned on CUDA by
_launch.Tuned (_gelu_tuned, SWIGLU_CONFIGS); the first entry of each list is the choice made by
hand before tuning existed, and what the interpreter runs.

Run the tests:  TRITON_INTERPRET=1 pytest tests/kernels/test_kernel_activations.py
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from autopar.kernels import _launch

BLOCK_M = 8  # rows per bias_gelu tile before tuning
BLOCK_N_MAX = 1024  # the widest column stripe of a bias_gelu tile


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
                          HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          PROGRAMS_PER_SM: tl.constexpr):  # read by the launcher's grid only
    pid_m = tl.program_id(0)
    # whole BLOCK_M tiles per program, spread over the grid's rows (see _gelu_bwd_grid)
    rows_per_program = tl.cdiv(tl.cdiv(M, BLOCK_M), tl.num_programs(0)) * BLOCK_M
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


def _gelu_tile(n: int):
    """(BLOCK_M, BLOCK_N, warps) before tuning: 8 rows of at most 1024 columns, 8 warps from 4096
    elements up (32 elements per thread at N >= 1024), else 4."""
    block_n = min(triton.next_power_of_2(n), BLOCK_N_MAX)
    return BLOCK_M, block_n, 8 if BLOCK_M * block_n >= 4096 else 4


@functools.cache
def _gelu_tuned(block_n: int) -> tuple[_launch.Tuned, _launch.Tuned]:
    """(forward, backward) configs for column stripes of block_n; BLOCK_M and warps are tuned,
    block_n stays (it only sets how a row is cut, and the partial dbias rows are per stripe).

    Forward: #0 the pre-tuning tile; #1 the same tile on half the warps (twice the erf/exp
    evaluations per thread to overlap with the loads); #2 twice the rows on twice the warps (the
    same share per thread, half the programs). Backward, whose programs each walk a column
    stripe, holding its dbias partial in registers, over a grid of about PROGRAMS_PER_SM
    programs per SM: #0 the pre-tuning choice, 8 programs per SM stepping 8 rows at a time (the
    list's most registers per thread: few programs fit an SM at once); #1 4 rows a step on as
    many warps (about two thirds of the registers per thread, so more programs resident) with
    16 programs per SM; #2 2 rows a step on 4 warps with 32 per SM (fewer registers still,
    more resident programs and loads in flight); #3 the pre-tuning tile with 32 programs per SM
    (shorter programs, 4x the partial dbias rows: ~17 MB at 8192x28672); #4 twice the warps (half
    the elements per thread). sm90_build.py reports no spill for any of them at N=28672."""
    bm, _, w = _gelu_tile(block_n)

    def fwd(rows, warps):
        return triton.Config({"BLOCK_M": rows}, num_warps=warps)

    def bwd(rows, warps, programs):
        return triton.Config({"BLOCK_M": rows, "PROGRAMS_PER_SM": programs}, num_warps=warps)

    fwd_configs = [fwd(bm, w), fwd(bm, w // 2), fwd(2 * bm, 2 * w)]
    bwd_configs = [bwd(bm, w, 8), bwd(bm // 2, w, 16), bwd(bm // 4, w // 2, 32), bwd(bm, w, 32),
                   bwd(bm, 2 * w, 8)]
    flags = ["HAS_BIAS", "APPROX_TANH"]
    small = _launch.TUNE_MIN_NUMEL
    return (_launch.Tuned(_bias_gelu_fwd_kernel, fwd_configs, key=["N", *flags], min_numel=small),
            _launch.Tuned(_bias_gelu_bwd_kernel, bwd_configs, key=["M", "N", *flags],
                          min_numel=small))


def _gelu_bwd_grid(m: int, n: int, block_n: int, device):
    """The backward's grid as a function of its config: (row groups, column stripes), about
    PROGRAMS_PER_SM programs per SM, none without a tile of rows (the kernel recomputes its rows
    per program from the grid)."""
    stripes = triton.cdiv(n, block_n)
    sms = _launch.num_programs_hint(device)

    def grid(meta):
        tiles = triton.cdiv(m, meta["BLOCK_M"])
        want = max(1, meta["PROGRAMS_PER_SM"] * sms // stripes)
        return (triton.cdiv(tiles, triton.cdiv(tiles, want)), stripes)

    return grid


def _bias_gelu_fwd(x2, bias, approximate, config=None):
    """gelu(x2 + bias) for x2 (M, N); ``config``: the index of the forward's list to run instead
    of the tuned choice."""
    m, n = x2.shape
    y = _launch.empty((m, n), x2.dtype, x2.device)
    block_n = _gelu_tile(n)[1]
    _gelu_tuned(block_n)[0].run(
        lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, block_n)),
        x2, bias if bias is not None else x2, y, m, n, x2.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, APPROX_TANH=approximate == "tanh", BLOCK_N=block_n,
        config=config)
    return y


def _bias_gelu_bwd(x2, bias, dy2, approximate, config=None):
    """(dx, dbias in fp32 or None) for dy2 (M, N); ``config`` as for _bias_gelu_fwd."""
    m, n = x2.shape
    dx = _launch.empty((m, n), x2.dtype, x2.device)
    if dx.numel() == 0:
        return dx, torch.zeros(n, device=x2.device) if bias is not None else None
    block_n = _gelu_tile(n)[1]
    tuned = _gelu_tuned(block_n)[1]
    grid = _gelu_bwd_grid(m, n, block_n, x2.device)
    db_part = dx  # unused without a bias
    if bias is not None:  # one partial row per row group: room for the largest grid of the list
        rows = max(grid(c.kwargs)[0] for c in tuned.configs)
        db_part = _launch.empty((rows, n), torch.float32, x2.device)
    ran = tuned.run(grid, x2, bias if bias is not None else x2, dy2, dx, db_part, m, n,
                    x2.stride(0), dy2.stride(0), dx.stride(0), HAS_BIAS=bias is not None,
                    APPROX_TANH=approximate == "tanh", BLOCK_N=block_n, config=config)
    # sum the rows the config that ran wrote (autotuning may have left others)
    db = db_part[:grid(ran.kwargs)[0]].sum(0) if bias is not None else None
    return dx, db


class _BiasGeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        _launch.check_device("bias_gelu", *(t for t in (x, bias) if t is not None))
        _launch.float_dtypes_ok("bias_gelu", x)
        n = x.shape[-1]
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"bias_gelu: bias shape {tuple(bias.shape)} != ({n},)")
        x2 = x.reshape(-1, n).contiguous()  # (M, N)
        y = _bias_gelu_fwd(x2, bias, approximate)
        ctx.save_for_backward(x2, bias)
        ctx.approximate = approximate
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, bias = ctx.saved_tensors
        dx, db = _bias_gelu_bwd(x2, bias, dy.reshape(x2.shape).contiguous(), ctx.approximate)
        return dx.view(dy.shape), db.to(bias.dtype) if db is not None else None, None


def _flat_config(block, warps):
    return triton.Config({"BLOCK": block}, num_warps=warps)


# SwiGLU's flat blocks (bf16: 8 elements are one 16-byte load): one or two loads per thread and
# tensor, on 256 or 512 threads. #0 the pre-tuning choice, 2048 on 8 warps (one load); #1 4096
# on 8 warps (two: more bytes in flight per thread); #2 4096 on 16 warps (one, half the
# programs); #3 8192 on 16 warps (two, a quarter of the programs). 4096 on 4 warps (four loads)
# was dropped when its backward spilled (184 B) in a build without the alignment attributes real
# launches have; built as launched (sm90_build.py) it takes 62 registers and does not spill.
SWIGLU_CONFIGS = tuple(_flat_config(b, w) for b, w in ((2048, 8), (4096, 8), (4096, 16), (8192, 16)))
_SWIGLU_FWD = _launch.Tuned(_swiglu_fwd_kernel, SWIGLU_CONFIGS, key=["numel"],
                            min_numel=_launch.TUNE_MIN_NUMEL)
_SWIGLU_BWD = _launch.Tuned(_swiglu_bwd_kernel, SWIGLU_CONFIGS, key=["numel"],
                            min_numel=_launch.TUNE_MIN_NUMEL)


def _flat_grid(numel):
    return lambda meta: (triton.cdiv(numel, meta["BLOCK"]),)


def _swiglu_fwd(a1, b1, config=None):
    """silu(a1) * b1 (contiguous); ``config``: the index of SWIGLU_CONFIGS to run."""
    y = _launch.empty(a1.shape, a1.dtype, a1.device)
    _SWIGLU_FWD.run(_flat_grid(a1.numel()), a1, b1, y, a1.numel(), config=config)
    return y


def _swiglu_bwd(a1, b1, dy1, config=None):
    """(da, db) for contiguous a1, b1, dy1; ``config`` as for _swiglu_fwd."""
    da = _launch.empty(a1.shape, a1.dtype, a1.device)
    db = _launch.empty(b1.shape, b1.dtype, b1.device)
    _SWIGLU_BWD.run(_flat_grid(a1.numel()), a1, b1, dy1, da, db, a1.numel(), config=config)
    return da, db


class _SwigluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        _launch.check_device("swiglu", a, b)
        _launch.float_dtypes_ok("swiglu", a, b)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"swiglu: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} "
                             "must have the same shape and dtype")
        a1, b1 = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a1, b1)
        return _swiglu_fwd(a1, b1)

    @staticmethod
    def backward(ctx, dy):
        a1, b1 = ctx.saved_tensors
        return _swiglu_bwd(a1, b1, dy.contiguous())


def bias_gelu(x, bias=None, approximate: str = "none"):
    """gelu(x + bias) over the last dim, ``approximate`` "none" (erf) or "tanh" like F.gelu."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: approximate={approximate!r}; use 'none' (erf) or 'tanh'")
    return _BiasGeluFn.apply(x, bias, approximate)


def swiglu(a, b):
    """silu(a) * b, elementwise; a and b have the same shape and dtype."""
    return _SwigluFn.apply(a, b)
