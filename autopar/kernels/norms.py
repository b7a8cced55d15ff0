"""LayerNorm and RMSNorm, forward and backward, with an optional fused residual add.

For an (M, N) input (any leading dims are flattened into M), one program normalizes one row whose
N elements fit in one block (BLOCK_N = next_power_of_2(N) <= 65536), so x is read once:

    forward   y = (x - mean) * rstd * w + b          (LayerNorm)
              y = x * rstd * w                       (RMSNorm, rstd = 1/sqrt(mean(x^2) + eps))
    residual  h = x + residual;  y = norm(h);  returns (y, h)   -- h is the next residual stream
    backward  xhat = (x - mean) * rstd (or x * rstd), g = w * dy
              dx = rstd * (g - xhat * mean(g * xhat) - mean(g))   (drop the last term for RMSNorm)
              dw = sum_rows dy * xhat,  db = sum_rows dy

The backward runs a persistent grid (PROGRAMS_PER_SM programs per SM), each walking a contiguous
range of rows and accumulating dw/db for its rows in registers; the per-program partial sums
(G, N) fp32 are summed by torch afterwards (G*N is small next to M*N). The loop can be
software-pipelined by hand (PREFETCH): the next row's x and dy loads are issued before the current
row's reductions, so each SM keeps two rows of loads in flight instead of idling through the
reduction. Statistics are fp32; mean and rstd are saved (M floats each) so the backward
recomputes xhat instead of storing it.

Launch parameters (warps; for the backward also programs per SM and PREFETCH) are not fixed: each
kernel has a short config list per row width (row_tuned, bwd_tuned), autotuned on CUDA by
_launch.Tuned; the first entry of each list is the choice made by hand before tuning existed.

Run the tests:  TRITON_INTERPRET=1 pytest tests/kernels/test_kernel_norms.py
Benchmark:      python benchmarks/kernel_speed.py --only layer_norm rms_norm add_rms_norm
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from autopar.kernels import _launch

MAX_N = 65536


# --------------------------------------------------------------------------------------------
# References (plain PyTorch, fp32 math, output in the input dtype)
# --------------------------------------------------------------------------------------------


def layer_norm_ref(x, weight=None, bias=None, eps: float = 1e-5):
    # read MN (x), write MN (y); eager torch also writes the fp32 temporaries (xf, xf - mean, ...)
    xf = x.float()  # (M, N)
    mean = xf.mean(-1, keepdim=True)  # (M, 1)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)  # (M, 1)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def rms_norm_ref(x, weight=None, eps: float = 1e-6):
    # read MN (x), write MN (y)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def add_layer_norm_ref(x, residual, weight=None, bias=None, eps: float = 1e-5):
    # read 2 MN (x, residual), write 2 MN (y, h); h is normalized before rounding to the dtype
    h = x.float() + residual.float()
    return layer_norm_ref(h, weight, bias, eps).to(x.dtype), h.to(residual.dtype)


def add_rms_norm_ref(x, residual, weight=None, eps: float = 1e-6):
    # read 2 MN (x, residual), write 2 MN (y, h)
    h = x.float() + residual.float()
    return rms_norm_ref(h, weight, eps).to(x.dtype), h.to(residual.dtype)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _norm_fwd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD,
    N, stride_x, stride_r, stride_y, stride_h, eps,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(H + row * stride_h + cols, x.to(H.dtype.element_ty), mask=mask)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        tl.store(MEAN + row, mean)
        xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DH, DX, DW_PART, DB_PART,
    M, N, stride_dy, stride_x, stride_dh, stride_dx,
    IS_RMS: tl.constexpr, HAS_DH: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,  # read by the launcher's grid only (a tuned parameter)
):
    pid = tl.program_id(0)
    rows_per_program = tl.cdiv(M, tl.num_programs(0))  # the grid is _bwd_grid: no program idles
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    if not PREFETCH:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    if PREFETCH:  # software pipeline: row r+1's x and dy are in flight while row r reduces
        x_next = tl.load(X + row_start * stride_x + cols, mask=mask, other=0.0)
        dy_next = tl.load(DY + row_start * stride_dy + cols, mask=mask, other=0.0)
    for row in range(row_start, row_end):
        if PREFETCH:
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            next_mask = cols < tl.where(row + 1 < row_end, N, 0)  # nothing past the last row
            x_next = tl.load(X + (row + 1) * stride_x + cols, mask=next_mask, other=0.0)
            dy_next = tl.load(DY + (row + 1) * stride_dy + cols, mask=next_mask, other=0.0)
        else:
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            mean = tl.load(MEAN + row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        if PREFETCH:  # reload w (an L1 hit) rather than hold it: the prefetched row needs the registers
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        g = w * dy
        c1 = tl.sum(xhat * g, axis=0) / N
        if IS_RMS:
            dx = (g - xhat * c1) * rstd
        else:
            c2 = tl.sum(g, axis=0) / N
            dx = (g - (xhat * c1 + c2)) * rstd
        if HAS_DH:
            dx += tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    tl.store(DW_PART + pid * N + cols, dw_acc, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * N + cols, db_acc, mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _row_warps(block_n: int, per_thread: int = 32) -> int:
    """Warps for a one-row block: enough threads that each holds <= per_thread elements of a
    row array (4..32 warps). The first config of every one-row kernel's list (the choice before
    tuning): the forward uses per_thread=32, the backward 16 (it keeps ~7 row arrays live)."""
    return max(4, min(32, block_n // (32 * per_thread)))


@functools.cache
def row_tuned(kernel, block_n: int, key: tuple[str, ...]) -> _launch.Tuned:
    """Configs of a kernel holding one block_n-wide row per program (norm forward, softmax):
    _row_warps first, then twice as many warps (half the elements per thread: fewer registers,
    more loads in flight) and half as many (a cheaper cross-warp reduction). One list per row
    width, since the warps scale with it; sm90_build.py reports no spill for any of them at 8192."""
    w = _row_warps(block_n)
    warps = dict.fromkeys(x for x in (w, 2 * w, w // 2) if 1 <= x <= 32)
    return _launch.Tuned(kernel, [triton.Config({}, num_warps=x) for x in warps], key=list(key),
                         min_numel=_launch.TUNE_MIN_NUMEL)


def fwd_tuned(block_n: int) -> _launch.Tuned:
    """The forward's configs for rows of block_n (tuned per N and per kind of norm)."""
    return row_tuned(_norm_fwd_kernel, block_n, ("N", "IS_RMS", "HAS_RESIDUAL", "HAS_BIAS"))


@functools.cache
def bwd_tuned(block_n: int, is_rms: bool) -> _launch.Tuned:
    """Backward configs for rows of block_n. First the pre-tuning choice: 4 programs per SM,
    _row_warps(per_thread=16) warps, the pipelined loop for RMSNorm only. At N=8192 (sm_90a) one
    program takes most of an SM's register file (16 warps x 98 to 126 registers, or 32 x 64), so
    one program is resident per SM and PROGRAMS_PER_SM sets the number of waves: 1 is a single
    wave with 4x fewer dw partial rows to write and sum, 2 is in between, 8 suits narrower rows
    where several programs share an SM. Twice the warps halves each thread's share of a row (no
    spill at 8192). Each kind also tries the other loop: RMSNorm the plain one, LayerNorm the
    pipelined one (left out while builds without the alignment attributes real launches have
    showed it spilling; built as launched, sm90_build.py, it takes 124 and 128 registers, no
    spill)."""
    warps = _row_warps(block_n, per_thread=16)

    def cfg(programs=4, num_warps=warps, prefetch=is_rms):
        return triton.Config(dict(PROGRAMS_PER_SM=programs, PREFETCH=prefetch), num_warps=num_warps)

    configs = [cfg(), cfg(programs=1), cfg(programs=2), cfg(programs=8)]
    if warps < 32:
        configs.append(cfg(num_warps=2 * warps))
    configs.append(cfg(prefetch=not is_rms))
    return _launch.Tuned(_norm_bwd_kernel, configs, key=["N", "HAS_DH", "HAS_BIAS"],
                         min_numel=_launch.TUNE_MIN_NUMEL)


def _bwd_grid(m: int, programs: int) -> int:
    """Programs of the persistent backward: about ``programs``, each walking cdiv(m, grid) rows,
    none left without a row (the kernel recomputes its rows per program as cdiv(M, grid))."""
    return triton.cdiv(m, triton.cdiv(m, max(1, min(m, programs))))


def _rows(name: str, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    if n > MAX_N:
        raise ValueError(f"{name}: the last dim is {n} > {MAX_N}; one row must fit one block "
                         "(split the hidden dim or use the reference)")
    return x.reshape(-1, n).contiguous()


def _norm_fwd(x, residual, weight, bias, eps, is_rms, name, config=None):
    """``config``: run that index of the forward's config list instead of the tuned choice."""
    _launch.check_device(name, *(t for t in (x, residual, weight, bias) if t is not None))
    _launch.float_dtypes_ok(name, x)
    n = x.shape[-1]
    x2 = _rows(name, x)  # (M, N)
    m = x2.shape[0]
    if weight is None:
        weight = torch.ones(n, dtype=x.dtype, device=x.device)
    if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"{name}: weight/bias must have shape ({n},)")
    r2 = None if residual is None else _rows(name, residual)
    if r2 is not None and (r2.shape != x2.shape or residual.dtype != x.dtype):
        raise ValueError(f"{name}: residual {tuple(residual.shape)} {residual.dtype} must match "
                         f"x {tuple(x.shape)} {x.dtype}")
    y = _launch.empty((m, n), x.dtype, x.device)
    h = None if r2 is None else _launch.empty((m, n), residual.dtype, x.device)
    mean = _launch.empty((m,), torch.float32, x.device)
    rstd = _launch.empty((m,), torch.float32, x.device)
    block_n = triton.next_power_of_2(n)
    fwd_tuned(block_n).run(
        (m,), x2, r2 if r2 is not None else x2, weight, bias if bias is not None else weight, y,
        h if h is not None else y, mean, rstd,
        n, x2.stride(0), (r2 if r2 is not None else x2).stride(0), y.stride(0),
        (h if h is not None else y).stride(0), eps,
        IS_RMS=is_rms, HAS_RESIDUAL=r2 is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n,
        config=config,
    )
    return y, h, mean, rstd, weight, x2


def _norm_bwd(dy, x2, weight, has_bias, mean, rstd, dh, is_rms, config=None):
    """``config``: run that index of bwd_tuned's list instead of the tuned choice."""
    m, n = x2.shape
    dy2 = dy.reshape(m, n).contiguous()
    dh2 = None if dh is None else dh.reshape(m, n).contiguous()
    dx = _launch.empty((m, n), x2.dtype, x2.device)
    block_n = triton.next_power_of_2(n)
    tuned = bwd_tuned(block_n, is_rms)
    sms = _launch.num_programs_hint(x2.device)

    def grid(meta):
        return (_bwd_grid(m, meta["PROGRAMS_PER_SM"] * sms),)

    # one partial dw (db) row per program: room for the largest grid any config launches
    rows = max(grid(c.kwargs)[0] for c in tuned.configs)
    dw_part = _launch.empty((rows, n), torch.float32, x2.device)
    db_part = _launch.empty((rows, n), torch.float32, x2.device) if has_bias else dw_part
    ran = tuned.run(
        grid, dy2, x2, weight, mean, rstd, dh2 if dh2 is not None else dy2, dx, dw_part, db_part,
        m, n, dy2.stride(0), x2.stride(0), (dh2 if dh2 is not None else dy2).stride(0), dx.stride(0),
        IS_RMS=is_rms, HAS_DH=dh2 is not None, HAS_BIAS=has_bias, BLOCK_N=block_n, config=config,
    )
    used = grid(ran.kwargs)[0]  # the rows the config that ran wrote (autotuning may leave others)
    dw = dw_part[:used].sum(0)  # fp32; the caller casts to the parameter dtypes
    db = db_part[:used].sum(0) if has_bias else None
    return dx, dw, db


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms):
        name = "rms_norm" if is_rms else "layer_norm"
        y, _, mean, rstd, w, x2 = _norm_fwd(x, None, weight, bias, eps, is_rms, name)
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.meta = (is_rms, weight is not None, bias.dtype if bias is not None else None, x.shape)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, mean, rstd = ctx.saved_tensors
        is_rms, has_weight, bias_dtype, shape = ctx.meta
        dx, dw, db = _norm_bwd(dy, x2, w, bias_dtype is not None, mean, rstd, None, is_rms)
        return (dx.view(shape), dw.to(w.dtype) if has_weight else None,
                db.to(bias_dtype) if db is not None else None, None, None)


class _AddNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, is_rms):
        name = "add_rms_norm" if is_rms else "add_layer_norm"
        y, h, mean, rstd, w, _ = _norm_fwd(x, residual, weight, bias, eps, is_rms, name)
        ctx.save_for_backward(h, w, mean, rstd)  # the backward normalizes h, the summed stream
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        ctx.meta = (is_rms, weight is not None, bias.dtype if bias is not None else None, x.shape)
        return y.view(x.shape), h.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dh):
        h2, w, mean, rstd = ctx.saved_tensors
        is_rms, has_weight, bias_dtype, shape = ctx.meta
        if dy is None:  # only the residual stream was used downstream
            dy = torch.zeros_like(h2)
        dx, dw, db = _norm_bwd(dy, h2, w, bias_dtype is not None, mean, rstd, dh, is_rms)
        dx = dx.view(shape)  # d(x + residual) / dx = d / dresidual: one tensor for both
        return (dx, dx, dw.to(w.dtype) if has_weight else None,
                db.to(bias_dtype) if db is not None else None, None, None)


# --------------------------------------------------------------------------------------------
# Public API (same signatures as the references)
# --------------------------------------------------------------------------------------------


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    """LayerNorm over the last dim (<= 65536 elements); differentiable in x, weight, bias."""
    return _NormFn.apply(x, weight, bias, eps, False)


def rms_norm(x, weight=None, eps: float = 1e-6):
    """RMSNorm over the last dim (<= 65536 elements); differentiable in x and weight."""
    return _NormFn.apply(x, weight, None, eps, True)


def add_layer_norm(x, residual, weight=None, bias=None, eps: float = 1e-5):
    """h = x + residual; returns (layer_norm(h), h). h is stored in residual's dtype."""
    return _AddNormFn.apply(x, residual, weight, bias, eps, False)


def add_rms_norm(x, residual, weight=None, eps: float = 1e-6):
    """h = x + residual; returns (rms_norm(h), h). h is stored in residual's dtype."""
    return _AddNormFn.apply(x, residual, weight, None, eps, True)
