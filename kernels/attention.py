"""FlashAttention-style fused attention, forward and backward, causal and non-causal.

q (B, H, Tq, D), k and v (B, H, Tk, D), all one dtype; D in {16, 32, 64, 128} (anything else
raises ValueError: pad D up to the next supported size). Tq, Tk need not be multiples of the
blocks. Causal masking is top-left aligned (query i sees keys j <= i), as
F.scaled_dot_product_attention(is_causal=True) does.

Forward (Dao et al., FlashAttention-2): one program per (query block, batch*head) streams the
key/value blocks through SRAM, keeping the running row max m, the running sum l and the output
accumulator in registers (scores in the log2 domain: exp2(s * scale * log2 e)):
    s = q k^T * scale;  m' = max(m, rowmax s);  p = exp(s - m');  l = l e^(m - m') + rowsum p
    acc = acc e^(m - m') + p v;       out = acc / l,   lse = m + log l   (fp32, natural log)
Key blocks strictly below the diagonal (and inside Tk) run without any masking; only the
diagonal blocks and the Tk tail pay for the mask. Work: 4 B H Tq Tk D FLOPs (half when causal),
memory: read 3 BHTD + write BHTD (+ BHT lse), no (T, T) matrix ever exists.

The lse output lets partial results over sequence shards be merged exactly
(``merge_attention``), and it is differentiable: its gradient d lse_i / d s_ij = p_ij folds into
the backward's delta_i = rowsum(dO_i * O_i) - dlse_i.

Backward: a preprocessing kernel computes delta; one kernel per key block accumulates dK, dV
over the query blocks that see it, and one kernel per query block accumulates dQ over key blocks
(p is recomputed from q, k and the saved lse; nothing of size T x T is stored):
    p = exp(s - lse);  dV += p^T dO;  dP = dO V^T;  dS = p * (dP - delta);  dK += dS^T Q * scale
    dQ += dS K * scale
FLOPs: 2.5x the forward's (5 matmuls against 2).

On the GPU fp32 inputs use full fp32 products (tl.dot input_precision="ieee", not Triton's TF32
default): slower than bf16 but accurate to ~1e-6 like the reference; bf16 uses the tensor cores.

``merge_attention(out1, lse1, out2, lse2)`` (plain torch) combines two partial attentions of the
same queries over disjoint key sets: lse = logaddexp(lse1, lse2),
out = out1 exp(lse1 - lse) + out2 exp(lse2 - lse).

Run the tests:  TRITON_INTERPRET=1 pytest tests/kernels/test_kernel_attention.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import _launch

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass(frozen=True)
class AttentionBlocks:
    """Tile sizes and warps. fwd_m % fwd_n == 0, bwd_kv_n % bwd_kv_m == 0 and
    bwd_q_m % bwd_q_n == 0 keep the diagonal aligned to whole blocks; all are powers of two >= 16."""

    fwd_m: int = 128  # query rows per forward program
    fwd_n: int = 64  # keys per forward iteration
    fwd_warps: int = 8
    bwd_kv_n: int = 64  # keys per dK/dV program
    bwd_kv_m: int = 32  # queries per dK/dV iteration
    bwd_kv_warps: int = 4
    bwd_q_m: int = 128  # queries per dQ program
    bwd_q_n: int = 32  # keys per dQ iteration
    bwd_q_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        sizes = (self.fwd_m, self.fwd_n, self.bwd_kv_n, self.bwd_kv_m, self.bwd_q_m, self.bwd_q_n)
        if any(s < 16 or s & (s - 1) for s in sizes):
            raise ValueError(f"AttentionBlocks: tile sizes {sizes} must be powers of two >= 16")
        if self.fwd_m % self.fwd_n or self.bwd_kv_n % self.bwd_kv_m or self.bwd_q_m % self.bwd_q_n:
            raise ValueError(f"AttentionBlocks: need fwd_m % fwd_n == 0, bwd_kv_n % bwd_kv_m == 0, "
                             f"bwd_q_m % bwd_q_n == 0; got {sizes}")


def default_blocks(head_dim: int) -> AttentionBlocks:
    """Tiles for Hopper, chosen from ptxas reports of the sm_90a build (Triton 3.9 here; no GPU
    timing yet): at D=128 the forward (128x64, 8 warps) spills 28 bytes, dK/dV 64x32 with 4 warps
    and dQ 128x32 with 8 warps spill 0 and 32 bytes; larger backward tiles spill hundreds. At
    D <= 64 register pressure halves and the dK/dV tile grows to 128x64 with 8 warps. The
    tutorial's Hopper forward tile 128x128 (8 warps, 3 stages) spills 452 bytes causal (20 non-
    causal) in this two-loop kernel, so the forward keeps 128x64 until a GPU timing says otherwise."""
    if head_dim <= 64:
        return AttentionBlocks(bwd_kv_n=128, bwd_kv_m=64, bwd_kv_warps=8)
    return AttentionBlocks()


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def attention_ref(q, k, v, causal: bool = False, sm_scale: float | None = None):
    """Plain-torch attention returning (out, lse). Reads 3 BHTD, writes and re-reads the fp32
    (B, H, Tq, Tk) scores and probabilities, writes BHTD."""
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, H, Tq, Tk)
    if causal:
        tq, tk = q.shape[-2], k.shape[-2]
        keep = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p, v.float())  # (B, H, Tq, D)
    return out.to(q.dtype), lse


def merge_attention(out1, lse1, out2, lse2):
    """Merge two partial attentions of the same queries over disjoint key sets.

    out* (B, H, T, D), lse* (B, H, T) fp32 natural-log. Returns (out, lse); a partial whose lse
    is -inf (it saw no key) contributes nothing. Differentiable (plain torch)."""
    lse = torch.logaddexp(lse1, lse2)  # (B, H, T)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w1 = torch.exp(lse1 - lse_safe).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse_safe).unsqueeze(-1)
    out = out1.float() * w1 + out2.float() * w2
    return out.to(out1.dtype), lse


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b. UPCAST (set under TRITON_INTERPRET=1 only) feeds the interpreter fp32
    operands: its tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584). bf16 products
    are exact in fp32, so this matches the GPU's bf16 tensor-core path with fp32 accumulation."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    if a.dtype == tl.float32:  # fp32 inputs: full-precision products, not TF32 (tl.dot's default)
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, offs_m, lo, hi, T_K, qk_scale,
               HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL_MASK: tl.constexpr, KEY_MASK: tl.constexpr, UPCAST: tl.constexpr):
    offs_d = tl.arange(0, HEAD_D)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_off = offs_n[:, None] * HEAD_D + offs_d[None, :]
        if KEY_MASK:
            k = tl.load(k_base + kv_off, mask=offs_n[:, None] < T_K, other=0.0)
        else:
            k = tl.load(k_base + kv_off)
        s = _dot(q, tl.trans(k), None, UPCAST) * qk_scale  # (BLOCK_M, BLOCK_N), log2 domain
        if KEY_MASK:
            s = tl.where(offs_n[None, :] < T_K, s, float("-inf"))
        if CAUSAL_MASK:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if KEY_MASK:
            v = tl.load(v_base + kv_off, mask=offs_n[:, None] < T_K, other=0.0)
        else:
            v = tl.load(v_base + kv_off)
        acc = _dot(p.to(v.dtype), v, acc, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, T_Q, T_K, qk_scale,
                     CAUSAL: tl.constexpr, HEAD_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    # the largest (most expensive, when causal) query blocks go first
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    q_base = Q + bh * T_Q * HEAD_D
    k_base = K + bh * T_K * HEAD_D
    v_base = V + bh * T_K * HEAD_D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    row_ok = offs_m < T_Q
    q = tl.load(q_base + offs_m[:, None] * HEAD_D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    full_hi = (T_K // BLOCK_N) * BLOCK_N  # keys in whole blocks
    if CAUSAL:
        unmasked_hi = tl.minimum(start_m, full_hi)  # key blocks every query row here sees whole
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, offs_m, 0, unmasked_hi, T_K,
                                   qk_scale, HEAD_D, BLOCK_N, False, False, UPCAST)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, offs_m, unmasked_hi,
                                   tl.minimum(start_m + BLOCK_M, T_K), T_K, qk_scale,
                                   HEAD_D, BLOCK_N, True, True, UPCAST)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, offs_m, 0, full_hi, T_K,
                                   qk_scale, HEAD_D, BLOCK_N, False, False, UPCAST)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, offs_m, full_hi, T_K, T_K,
                                   qk_scale, HEAD_D, BLOCK_N, False, True, UPCAST)
    out = acc / l_i[:, None]
    tl.store(O + bh * T_Q * HEAD_D + offs_m[:, None] * HEAD_D + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bh * T_Q + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess_kernel(O, DO, DLSE, DELTA, n_rows, HAS_DLSE: tl.constexpr,
                           HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    ok = rows < n_rows
    off = rows[:, None] * HEAD_D + offs_d[None, :]
    o = tl.load(O + off, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=ok[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + rows, mask=ok, other=0.0)
    tl.store(DELTA + rows, delta, mask=ok)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n, lo, hi, T_Q,
                    qk_scale, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    CAUSAL_MASK: tl.constexpr, ROW_MASK: tl.constexpr, UPCAST: tl.constexpr):
    # Padded query rows load q = dO = lse = delta = 0, so they add exactly zero to dK and dV.
    offs_d = tl.arange(0, HEAD_D)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        off = offs_m[:, None] * HEAD_D + offs_d[None, :]
        if ROW_MASK:
            ok = offs_m < T_Q
            q = tl.load(q_base + off, mask=ok[:, None], other=0.0)
            do = tl.load(do_base + off, mask=ok[:, None], other=0.0)
            lse2 = tl.load(lse_base + offs_m, mask=ok, other=0.0) * 1.4426950408889634
            delta = tl.load(delta_base + offs_m, mask=ok, other=0.0)
        else:
            q = tl.load(q_base + off)
            do = tl.load(do_base + off)
            lse2 = tl.load(lse_base + offs_m) * 1.4426950408889634
            delta = tl.load(delta_base + offs_m)
        s_t = _dot(k, tl.trans(q), None, UPCAST) * qk_scale  # (BLOCK_N, BLOCK_M): keys x queries
        p_t = tl.exp2(s_t - lse2[None, :])
        if CAUSAL_MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = _dot(p_t.to(do.dtype), do, dv, UPCAST)
        dp_t = _dot(v, tl.trans(do), None, UPCAST)  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = _dot(ds_t.to(q.dtype), q, dk, UPCAST)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, T_Q, T_K, sm_scale, qk_scale,
                          CAUSAL: tl.constexpr, HEAD_D: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    q_base = Q + bh * T_Q * HEAD_D
    do_base = DO + bh * T_Q * HEAD_D
    lse_base = LSE + bh * T_Q
    delta_base = DELTA + bh * T_Q
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    kv_off = bh * T_K * HEAD_D + offs_n[:, None] * HEAD_D + offs_d[None, :]
    key_ok = offs_n[:, None] < T_K
    # padded key rows load as zeros; whatever accumulates in their dK/dV rows is never stored
    k = tl.load(K + kv_off, mask=key_ok, other=0.0)
    v = tl.load(V + kv_off, mask=key_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_D], dtype=tl.float32)
    full_hi = (T_Q // BLOCK_M) * BLOCK_M  # queries in whole blocks
    if CAUSAL:
        # queries [start_n, start_n + BLOCK_N) straddle the diagonal; earlier ones see none of
        # these keys, later ones see all of them
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n,
                                 start_n, tl.minimum(start_n + BLOCK_N, T_Q), T_Q, qk_scale,
                                 HEAD_D, BLOCK_M, True, True, UPCAST)
        rest_lo = start_n + BLOCK_N
    else:
        rest_lo = 0
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n,
                             rest_lo, full_hi, T_Q, qk_scale, HEAD_D, BLOCK_M, False, False,
                             UPCAST)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n,
                             tl.maximum(rest_lo, full_hi), T_Q, T_Q, qk_scale,
                             HEAD_D, BLOCK_M, False, True, UPCAST)
    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=key_ok)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, offs_m, lo, hi, T_K, qk_scale,
                  HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL_MASK: tl.constexpr, KEY_MASK: tl.constexpr, UPCAST: tl.constexpr):
    # Padded key rows load k = v = 0 and their p is masked, so they add nothing to dQ.
    offs_d = tl.arange(0, HEAD_D)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_off = offs_n[:, None] * HEAD_D + offs_d[None, :]
        if KEY_MASK:
            k = tl.load(k_base + kv_off, mask=offs_n[:, None] < T_K, other=0.0)
            v = tl.load(v_base + kv_off, mask=offs_n[:, None] < T_K, other=0.0)
        else:
            k = tl.load(k_base + kv_off)
            v = tl.load(v_base + kv_off)
        s = _dot(q, tl.trans(k), None, UPCAST) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(s - lse2[:, None])
        if KEY_MASK:  # exp2(0 - lse2) of a padded key can overflow when all scores are tiny
            p = tl.where(offs_n[None, :] < T_K, p, 0.0)
        if CAUSAL_MASK:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        dp = _dot(do, tl.trans(v), None, UPCAST)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq, UPCAST)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, T_Q, T_K, sm_scale, qk_scale,
                        CAUSAL: tl.constexpr, HEAD_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    k_base = K + bh * T_K * HEAD_D
    v_base = V + bh * T_K * HEAD_D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    row_ok = offs_m < T_Q
    q_off = bh * T_Q * HEAD_D + offs_m[:, None] * HEAD_D + offs_d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + q_off, mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE + bh * T_Q + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh * T_Q + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    full_hi = (T_K // BLOCK_N) * BLOCK_N
    if CAUSAL:
        unmasked_hi = tl.minimum(start_m, full_hi)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, offs_m, 0, unmasked_hi, T_K,
                           qk_scale, HEAD_D, BLOCK_N, False, False, UPCAST)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, offs_m, unmasked_hi,
                           tl.minimum(start_m + BLOCK_M, T_K), T_K, qk_scale,
                           HEAD_D, BLOCK_N, True, True, UPCAST)
    else:
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, offs_m, 0, full_hi, T_K,
                           qk_scale, HEAD_D, BLOCK_N, False, False, UPCAST)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, offs_m, full_hi, T_K, T_K,
                           qk_scale, HEAD_D, BLOCK_N, False, True, UPCAST)
    tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _check(q, k, v):
    _launch.check_device("attention", q, k, v)
    _launch.float_dtypes_ok("attention", q)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention: q, k, v must be (B, H, T, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    b, h, _, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[1] != h or k.shape[3] != d:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         f"(B={b}, H={h}, Tk, D={d})")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"attention: head dim D={d} is not supported; supported: "
                         f"{SUPPORTED_HEAD_DIMS} (pad D up to the next one)")
    if k.shape[2] == 0:
        raise ValueError("attention: no keys (Tk == 0)")


def _forward(q, k, v, causal, scale, blocks):
    b, h, tq, d = q.shape
    tk = k.shape[2]
    o = _launch.empty(q.shape, q.dtype, q.device)
    lse = _launch.empty((b, h, tq), torch.float32, q.device)
    grid = (triton.cdiv(tq, blocks.fwd_m), b * h)
    _attn_fwd_kernel[grid](q, k, v, o, lse, tq, tk, scale * LOG2E,
                           CAUSAL=causal, HEAD_D=d, BLOCK_M=blocks.fwd_m, BLOCK_N=blocks.fwd_n,
                           UPCAST=_launch.interpreting(),
                           num_warps=blocks.fwd_warps, num_stages=blocks.num_stages)
    return o, lse


def _backward(q, k, v, o, lse, do, dlse, causal, scale, blocks):
    b, h, tq, d = q.shape
    tk = k.shape[2]
    do = do.contiguous()
    delta = _launch.empty((b, h, tq), torch.float32, q.device)
    n_rows = b * h * tq
    pre_block = 32
    _bwd_preprocess_kernel[(triton.cdiv(n_rows, pre_block),)](
        o, do, dlse.contiguous() if dlse is not None else delta, delta, n_rows,
        HAS_DLSE=dlse is not None, HEAD_D=d, BLOCK_M=pre_block, num_warps=4)
    dq = _launch.empty(q.shape, q.dtype, q.device)
    dk = _launch.empty(k.shape, k.dtype, k.device)
    dv = _launch.empty(v.shape, v.dtype, v.device)
    _attn_bwd_dkdv_kernel[(triton.cdiv(tk, blocks.bwd_kv_n), b * h)](
        q, k, v, do, lse, delta, dk, dv, tq, tk, scale, scale * LOG2E,
        CAUSAL=causal, HEAD_D=d, BLOCK_N=blocks.bwd_kv_n, BLOCK_M=blocks.bwd_kv_m,
        UPCAST=_launch.interpreting(),
        num_warps=blocks.bwd_kv_warps, num_stages=blocks.num_stages)
    _attn_bwd_dq_kernel[(triton.cdiv(tq, blocks.bwd_q_m), b * h)](
        q, k, v, do, lse, delta, dq, tq, tk, scale, scale * LOG2E,
        CAUSAL=causal, HEAD_D=d, BLOCK_M=blocks.bwd_q_m, BLOCK_N=blocks.bwd_q_n,
        UPCAST=_launch.interpreting(),
        num_warps=blocks.bwd_q_warps, num_stages=blocks.num_stages)
    return dq, dk, dv


class _AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, blocks):
        _check(q, k, v)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        blocks = blocks or default_blocks(q.shape[-1])
        o, lse = _forward(q, k, v, causal, scale, blocks)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.meta = (causal, scale, blocks)
        ctx.set_materialize_grads(False)  # unused lse: dlse is None and the kernel skips it
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, blocks = ctx.meta
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = _backward(q, k, v, o, lse, do, dlse, causal, scale, blocks)
        return dq, dk, dv, None, None, None


def attention(q, k, v, causal: bool = False, sm_scale: float | None = None, *,
              blocks: AttentionBlocks | None = None):
    """Fused attention over (B, H, T, D) tensors; returns (out (B, H, Tq, D), lse (B, H, Tq) fp32).

    ``sm_scale`` defaults to 1/sqrt(D); ``blocks`` overrides the tile sizes (tests use small ones
    so that short sequences still cross block boundaries). Both outputs are differentiable."""
    return _AttentionFn.apply(q, k, v, causal, sm_scale, blocks)
