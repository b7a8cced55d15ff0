"""Cross-entropy with a fused log-softmax over large vocabularies, forward and backward.

For logits (M, V) and integer targets (M,), per row r with target t (ignore_index rows give 0):
    lse_r  = log(sum_v exp(x_rv))                 (per-slice max/sum, then a combine)
    loss_r = lse_r - x_rt
    loss   = sum_r loss_r / #{r : t_r != ignore_index}   (reduction="mean"; also "sum", "none")
    dx_rv  = (exp(x_rv - lse_r) - [v == t_r]) * g_r      (g_r = grad_out / n_valid for "mean")

Parallelism: the vocab is split into BLOCK_V slices and every (row, slice) pair is one program, so
a 128k vocab keeps many more programs streaming than one program per row would. The forward
writes each slice's (max, sum exp) in fp32 to two (M, slices) buffers; a small combine kernel
turns them into lse and the loss; the backward's grid is the same (row, slice) pairs. BLOCK_V
(with its warps) and the combine's rows per program are autotuned on CUDA over short lists
(``_tuned``); the first entries, 16384 with 16 warps and 16 rows, are the choices made by hand
before tuning existed and what the interpreter runs.

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

import functools

import torch
import triton
import triton.language as tl

from autopar.kernels import _launch

BLOCK_V = 16384  # the widest vocab slice per program: 32 elements per thread at 16 warps


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
def _ce_partial_kernel(LOGITS, PART_M, PART_D, V, stride_l, stride_p, BLOCK_V: tl.constexpr):
    """Program (row, chunk): max and sum exp(x - max) of one BLOCK_V slice of a row (fp32)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(LOGITS + row * stride_l + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)  # every chunk holds at least one column, so m > -inf for finite logits
    d = tl.sum(tl.exp(x - m), axis=0)
    tl.store(PART_M + row * stride_p + chunk, m)
    tl.store(PART_D + row * stride_p + chunk, d)


@triton.jit
def _ce_combine_kernel(LOGITS, TARGET, PART_M, PART_D, LOSS, LSE, M, stride_l, stride_p, n_chunks,
                       ignore_index, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """BLOCK_R rows per program: lse from the per-chunk partials, then loss = lse - x_target."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    chunks = tl.arange(0, BLOCK_C)
    row_ok = rows < M
    ok = row_ok[:, None] & (chunks[None, :] < n_chunks)
    off = rows[:, None] * stride_p + chunks[None, :]
    pm = tl.load(PART_M + off, mask=ok, other=float("-inf"))
    pd = tl.load(PART_D + off, mask=ok, other=0.0)
    m = tl.max(pm, axis=1)
    m_safe = tl.where(row_ok, m, 0.0)
    d = tl.sum(pd * tl.exp(pm - m_safe[:, None]), axis=1)
    lse = m_safe + tl.log(d)
    t = tl.load(TARGET + rows, mask=row_ok, other=ignore_index)
    valid = t != ignore_index
    x_t = tl.load(LOGITS + rows * stride_l + tl.where(valid, t, 0), mask=row_ok, other=0.0)
    tl.store(LOSS + rows, tl.where(valid, lse - x_t.to(tl.float32), 0.0), mask=row_ok)
    tl.store(LSE + rows, lse, mask=row_ok)


@triton.jit
def _ce_bwd_kernel(LOGITS, TARGET, LSE, SCALE, DLOGITS, V, stride_l, stride_d, stride_s,
                   ignore_index, BLOCK_V: tl.constexpr):
    """Program (row, chunk): dx = (softmax - onehot) * g over one BLOCK_V slice (may be in place)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    t = tl.load(TARGET + row)
    valid = t != ignore_index
    lse = tl.load(LSE + row)
    g = tl.load(SCALE + row * stride_s)
    g = tl.where(valid, g, 0.0)
    x = tl.load(LOGITS + row * stride_l + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(x - lse)
    dx = (p - tl.where(cols == t, 1.0, 0.0)) * g
    tl.store(DLOGITS + row * stride_d + cols, dx.to(DLOGITS.dtype.element_ty), mask=mask)


@functools.cache
def _tuned(cap: int) -> tuple[_launch.Tuned, _launch.Tuned, _launch.Tuned]:
    """(partial, combine, backward) for vocab slices of at most ``cap`` (a power of two).

    Partial and backward: slices of cap, cap/2, cap/4 (16384/8192/4096 by default) with warps so
    each thread holds ~32 elements (4..16): wider slices mean fewer programs and partials, narrower
    ones more programs to spread over the SMs and a shorter reduction each. The backward writes
    the gradient into the logits when in place, so tuning restores DLOGITS after every trial.
    Combine: 16 rows per program (4 warps), then 64 (fewer, longer programs) and 4 (one warp each:
    more programs in flight for the scattered target-logit loads)."""
    blocks = dict.fromkeys(max(1, cap >> s) for s in range(3))
    slices = [triton.Config({"BLOCK_V": b}, num_warps=max(4, min(16, b // 1024))) for b in blocks]
    rows = [triton.Config({"BLOCK_R": r}, num_warps=w) for r, w in ((16, 4), (64, 4), (4, 1))]
    small = _launch.TUNE_MIN_NUMEL
    return (_launch.Tuned(_ce_partial_kernel, slices, key=["V"], min_numel=small),
            _launch.Tuned(_ce_combine_kernel, rows, key=["n_chunks"], min_numel=small),
            _launch.Tuned(_ce_bwd_kernel, slices, key=["V"], restore_value=["DLOGITS"],
                          min_numel=small))


def _lse_and_loss(x2, t, ignore_index, block_v, configs=(None, None)):
    """Per-row loss and lse of logits x2 (M, V). ``configs``: (partial, combine) indices to run
    instead of the tuned choices."""
    m, v = x2.shape
    loss_rows = _launch.empty((m,), torch.float32, x2.device)
    lse = _launch.empty((m,), torch.float32, x2.device)
    if m == 0:
        return loss_rows, lse
    partial, combine, _ = _tuned(min(block_v, triton.next_power_of_2(v)))

    def chunks(meta):
        return triton.cdiv(v, meta["BLOCK_V"])

    stride_p = max(chunks(c.kwargs) for c in partial.configs)  # room for the narrowest slices
    part_m = _launch.empty((m, stride_p), torch.float32, x2.device)
    part_d = _launch.empty((m, stride_p), torch.float32, x2.device)
    ran = partial.run(lambda meta: (m, chunks(meta)), x2, part_m, part_d, v, x2.stride(0), stride_p,
                      config=configs[0])
    n_chunks = chunks(ran.kwargs)  # the columns the config that ran wrote
    combine.run(lambda meta: (triton.cdiv(m, meta["BLOCK_R"]),), x2, t, part_m, part_d, loss_rows,
                lse, m, x2.stride(0), stride_p, n_chunks, ignore_index,
                BLOCK_C=triton.next_power_of_2(n_chunks), config=configs[1])
    return loss_rows, lse


def _grad_logits(x2, t, lse, scale, stride_s, dx, ignore_index, block_v, config=None):
    """dx = (softmax(x2) - onehot(t)) * scale, written into dx (may be x2). ``config``: the index
    of the backward's config to run instead of the tuned choice."""
    m, v = x2.shape
    if m > 0:
        bwd = _tuned(min(block_v, triton.next_power_of_2(v)))[2]
        bwd.run(lambda meta: (m, triton.cdiv(v, meta["BLOCK_V"])), x2, t, lse, scale, dx, v,
                x2.stride(0), dx.stride(0), stride_s, ignore_index, config=config)
    return dx


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
        loss_rows, lse = _lse_and_loss(x2, t, ignore_index, block_v)
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
        _grad_logits(x2, t, lse, scale, stride_s, dx, ignore_index, block_v)
        return dx.view(shape), None, None, None, None, None


def cross_entropy(logits, target, ignore_index: int = -100, reduction: str = "mean", *,
                  inplace_backward: bool = True, block_v: int = BLOCK_V):
    """Fused cross-entropy over the last dim of ``logits`` (..., V) with integer ``target`` (...).

    Returns an fp32 loss. With ``inplace_backward=True`` (default) the backward overwrites the
    logits buffer with the gradient and returns it (see the module docstring). ``block_v`` is the
    widest vocab slice per program (a power of two; the tuned lists try it, half and a quarter of
    it; tests use small ones to get several slices).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction={reduction!r}; use 'mean', 'sum' or 'none'")
    if block_v & (block_v - 1):
        raise ValueError(f"cross_entropy: block_v={block_v} must be a power of two")
    return _CrossEntropyFn.apply(logits, target, ignore_index, reduction, inplace_backward, block_v)
