"""FlashAttention-style fused attention, forward and backward, causal and non-causal.

q (B, H, Tq, D), k and v (B, H, Tk, D), all one dtype; D in {16, 32, 64, 128} (anything else
raises ValueError: pad D up to the next supported size). Tq, Tk need not be multiples of the
blocks. Causal masking is top-left aligned (query i sees keys j <= i), as
F.scaled_dot_product_attention(is_causal=True) does.

Forward (Dao et al., FlashAttention-2): one program per (query block, batch*head) streams the
key/value blocks through SRAM, keeping the running row max m, the running sum l and the output
accumulator in registers. Scores live in the log2 domain, the softmax scale folded into one
constant qk_scale = scale * log2(e), so the exponential is the hardware exp2:
    s = q k^T qk_scale;  m' = max(m, rowmax s);  p = 2^(s - m');  l = l 2^(m - m') + rowsum p
    acc = acc 2^(m - m') + p v;       out = acc / l,   lse = (m + log2 l) ln 2   (fp32, natural log)
Key blocks strictly below the diagonal (and inside Tk) run without any masking; only the
diagonal band and the Tk tail pay for the mask (the Triton tutorial 06-fused-attention's
off-band / on-band split). Work: 4 B H Tq Tk D FLOPs (half when causal), memory: read 3 BHTD +
write BHTD (+ BHT lse), no (T, T) matrix ever exists.

The lse output lets partial results over sequence shards be merged exactly
(``merge_attention``), and it is differentiable: its gradient d lse_i / d s_ij = p_ij folds into
the backward's delta_i = rowsum(dO_i * O_i) - dlse_i.

Backward (FlashAttention-2, in the tutorial's three-kernel form): a preprocessing kernel computes
delta; one kernel per key block keeps K, V in SRAM and accumulates dK, dV over the query blocks
that see it; one kernel per query block accumulates dQ over key blocks (p is recomputed from q, k
and the saved lse; nothing of size T x T is stored, and no program writes another's rows, so no
atomics):
    p = 2^(s - lse log2 e);  dV += p^T dO;  dP = dO V^T;  dS = p * (dP - delta);
    dK += dS^T Q * scale;    dQ += dS K * scale
FLOPs: 2.5x the forward's (5 matmuls against 2).

Loads of q, k, v and dO go through TMA tensor descriptors (Hopper's bulk copy engine, as the
tutorial's Hopper path): the copy engine computes the addresses, so the pipelined loops keep no
per-thread pointers in registers (the sm_90a build of the 128 x 64 forward at D=128 drops from 255
registers and a spill to ~140), and a descriptor over the (B*H, T, D) view zero-fills rows past T,
so the Tq/Tk tails need no load masks either, only the score masks above. Outputs are written
with masked stores (their dtype then also keys the autotuning: descriptors carry none).
Descriptors need 16-byte aligned rows and base: D * itemsize >= 32 bytes always is, and an
unaligned base is copied first.

The descriptors are made in one of two ways, chosen at every launch by ``descriptor_mode()`` from
the environment variable AUTOPAR_ATTENTION_DESC:
  "host" (the default, the tutorial's Hopper path): the launcher builds
      ``triton.tools.tensor_descriptor.TensorDescriptor``s (``_desc``) and each config's pre_hook
      (``attention_configs._size_boxes``) sizes their boxes;
  "device" (the tutorial's path where the host cannot make descriptors): the launcher passes the
      tensors themselves and each kernel builds the same (B*H, T, D) descriptors with
      ``tl.make_tensor_descriptor`` (``_device_desc``), boxes from the config's constexpr tiles.
      Each program writes its descriptors (128 bytes each) to global scratch that Triton takes
      from the allocator of ``triton.set_allocator``; ``_launch.ensure_triton_allocator``
      installs a torch-backed one on first use (per thread: Triton keeps it in a ContextVar)
      unless one is set, and nothing happens at import.
One kernel body serves both (the DEVICE_DESC constexpr). Why both: an open Triton report
(triton-lang/triton#9719, "needs reproducer") says host-side descriptors give NaNs on H200/B200
with Triton 3.6, the version of the H200 we are lent, while device-side ones work. Neither path
has run on a GPU yet: the first GPU run (bash benchmarks/gpu_check.sh, which runs the attention
tests once per mode) should tell which to keep. The interpreter runs both (the tests do), and
tests/kernels/sm90_build.py builds both for sm_90a.

On the GPU fp32 inputs use full fp32 products (tl.dot input_precision="ieee", not Triton's TF32
default): slower than bf16 but accurate to ~1e-6 like the reference; bf16 uses the tensor cores.

Launch configs (tiles, warps, pipeline stages) are ``_launch.Tuned`` lists per kernel
(``FWD_CONFIGS``, ``DKDV_CONFIGS``, ``DQ_CONFIGS``, in autopar/kernels/attention_configs.py): on CUDA the first call per (Tq, Tk, D,
causal, dtype) times them all and keeps the fastest; the interpreter runs the first. Every entry
builds for sm_90a in bf16 without register spills (tests/kernels/sm90_build.py prints the
counts); fp32, whose products skip the tensor cores, spills in all of them and runs the first.

``merge_attention(out1, lse1, out2, lse2)`` (plain torch) combines two partial attentions of the
same queries over disjoint key sets: lse = logaddexp(lse1, lse2),
out = out1 exp(lse1 - lse) + out2 exp(lse2 - lse).

Run the tests:  TRITON_INTERPRET=1 pytest tests/kernels/test_kernel_attention.py  (both modes)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from autopar.kernels import _launch
from autopar.kernels.attention_configs import (DKDV_CONFIGS, DQ_CONFIGS, FWD_CONFIGS, AttentionBlocks,
                                       descriptor_mode)

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
LOG2E = 1.4426950408889634
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
def _device_desc(x, n_rows, HEAD_D: tl.constexpr, BLOCK: tl.constexpr, DEVICE_DESC: tl.constexpr):
    """The descriptor a kernel loads ``x`` through (the tutorial's _maybe_make_tensor_desc, keyed
    on a constexpr instead of the argument's type). Host path (DEVICE_DESC False): ``x`` already
    is one, built by the launcher (``_desc``) with its box sized by ``_size_boxes``; returned as
    is. Device path: ``x`` is the contiguous (B, H, n_rows, HEAD_D) tensor's pointer, and the same
    descriptor is built here, over the (B*H, n_rows, HEAD_D) view (B*H = grid axis 1 in every
    kernel), with a (1, BLOCK, HEAD_D) box from the config's constexpr tiles."""
    if DEVICE_DESC:
        return tl.make_tensor_descriptor(x, shape=[tl.num_programs(1), n_rows, HEAD_D],
                                         strides=[n_rows * HEAD_D, HEAD_D, 1],
                                         block_shape=[1, BLOCK, HEAD_D])
    else:
        return x


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, desc_k, desc_v, bh, offs_m, lo, hi, T_K, qk_scale,
               HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """Key blocks [lo, hi). MASK: the diagonal band or the Tk tail (the descriptor zero-fills
    keys past Tk; their scores are masked to -inf here), causally masked when CAUSAL."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_D)
        qk = _dot(q, tl.trans(k), None, UPCAST)  # (BLOCK_M, BLOCK_N) raw scores
        if MASK:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            keep = offs_n[None, :] < T_K
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            s = s - m_new[:, None]
        else:
            # the tutorial's order: row max of the raw scores (qk_scale >= 0, see _AttentionFn),
            # then scale and shift in one FMA per score
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            s = qk * qk_scale - m_new[:, None]
        p = tl.exp2(s)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = desc_v.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_D)
        acc = _dot(p.to(v.dtype), v, acc, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(desc_q, desc_k, desc_v, O, LSE, T_Q, T_K, qk_scale,
                     CAUSAL: tl.constexpr, HEAD_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                     DEVICE_DESC: tl.constexpr):
    desc_q = _device_desc(desc_q, T_Q, HEAD_D, BLOCK_M, DEVICE_DESC)
    desc_k = _device_desc(desc_k, T_K, HEAD_D, BLOCK_N, DEVICE_DESC)
    desc_v = _device_desc(desc_v, T_K, HEAD_D, BLOCK_N, DEVICE_DESC)
    # the largest (most expensive, when causal) query blocks go first
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = desc_q.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_D)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    full_hi = (T_K // BLOCK_N) * BLOCK_N  # keys in whole blocks
    if CAUSAL:
        masked_lo = tl.minimum(start_m, full_hi)  # key blocks every query row here sees whole
        hi = tl.minimum(start_m + BLOCK_M, T_K)
    else:
        masked_lo = full_hi
        hi = T_K
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, desc_k, desc_v, bh, offs_m, 0, masked_lo, T_K,
                               qk_scale, HEAD_D, BLOCK_N, False, CAUSAL, UPCAST)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, desc_k, desc_v, bh, offs_m, masked_lo, hi, T_K,
                               qk_scale, HEAD_D, BLOCK_N, True, CAUSAL, UPCAST)
    out = acc / l_i[:, None]
    row_ok = offs_m < T_Q
    offs_d = tl.arange(0, HEAD_D)
    bh64 = bh.to(tl.int64)
    tl.store(O + bh64 * T_Q * HEAD_D + offs_m[:, None] * HEAD_D + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bh64 * T_Q + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


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
def _bwd_descs(desc_q, desc_k, desc_v, desc_do, T_Q, T_K, HEAD_D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DEVICE_DESC: tl.constexpr):
    """The backward kernels' four descriptors (``_device_desc``): q and dO in boxes of BLOCK_M
    rows, k and v in boxes of BLOCK_N."""
    return (_device_desc(desc_q, T_Q, HEAD_D, BLOCK_M, DEVICE_DESC),
            _device_desc(desc_k, T_K, HEAD_D, BLOCK_N, DEVICE_DESC),
            _device_desc(desc_v, T_K, HEAD_D, BLOCK_N, DEVICE_DESC),
            _device_desc(desc_do, T_Q, HEAD_D, BLOCK_M, DEVICE_DESC))


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, desc_q, desc_do, lse_base, delta_base, bh, offs_n, lo, hi,
                    T_Q, qk_scale, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """Query blocks [lo, hi). MASK: the diagonal band or the Tq tail (masked lse/delta loads,
    causal mask when CAUSAL). Query rows past Tq load q = dO = lse = delta = 0 (the descriptors
    zero-fill), so p = 1 there but dP = 0 and dS = 0: they add exactly zero to dK and dV."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = desc_q.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_D)
        if MASK:
            ok = offs_m < T_Q
            lse2 = tl.load(lse_base + offs_m, mask=ok, other=0.0) * 1.4426950408889634
            delta = tl.load(delta_base + offs_m, mask=ok, other=0.0)
        else:
            lse2 = tl.load(lse_base + offs_m) * 1.4426950408889634
            delta = tl.load(delta_base + offs_m)
        s_t = _dot(k, tl.trans(q), None, UPCAST) * qk_scale  # (BLOCK_N, BLOCK_M): keys x queries
        p_t = tl.exp2(s_t - lse2[None, :])
        if MASK and CAUSAL:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        do = desc_do.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_D)
        dv = _dot(p_t.to(do.dtype), do, dv, UPCAST)
        dp_t = _dot(v, tl.trans(do), None, UPCAST)  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = _dot(ds_t.to(q.dtype), q, dk, UPCAST)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(desc_q, desc_k, desc_v, desc_do, LSE, DELTA, DK, DV, T_Q, T_K,
                          sm_scale, qk_scale, CAUSAL: tl.constexpr, HEAD_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                          DEVICE_DESC: tl.constexpr):
    desc_q, desc_k, desc_v, desc_do = _bwd_descs(desc_q, desc_k, desc_v, desc_do, T_Q, T_K, HEAD_D,
                                                 BLOCK_M, BLOCK_N, DEVICE_DESC)
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    lse_base = LSE + bh64 * T_Q
    delta_base = DELTA + bh64 * T_Q
    offs_n = start_n + tl.arange(0, BLOCK_N)
    # key rows past Tk load as zeros; whatever accumulates in their dK/dV rows is never stored
    k = desc_k.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_D)
    v = desc_v.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_D)
    dk = tl.zeros([BLOCK_N, HEAD_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_D], dtype=tl.float32)
    full_hi = (T_Q // BLOCK_M) * BLOCK_M  # queries in whole blocks
    if CAUSAL:
        # queries [start_n, start_n + BLOCK_N) straddle the diagonal; earlier ones see none of
        # these keys, later ones see all of them
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, desc_q, desc_do, lse_base, delta_base, bh,
                                 offs_n, start_n, tl.minimum(start_n + BLOCK_N, T_Q), T_Q,
                                 qk_scale, HEAD_D, BLOCK_M, True, True, UPCAST)
        rest_lo = start_n + BLOCK_N
    else:
        rest_lo = 0
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, desc_q, desc_do, lse_base, delta_base, bh, offs_n,
                             rest_lo, full_hi, T_Q, qk_scale, HEAD_D, BLOCK_M, False, CAUSAL,
                             UPCAST)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, desc_q, desc_do, lse_base, delta_base, bh, offs_n,
                             tl.maximum(rest_lo, full_hi), T_Q, T_Q, qk_scale, HEAD_D, BLOCK_M,
                             True, False, UPCAST)
    offs_d = tl.arange(0, HEAD_D)
    kv_off = bh64 * T_K * HEAD_D + offs_n[:, None] * HEAD_D + offs_d[None, :]
    key_ok = offs_n[:, None] < T_K
    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=key_ok)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, desc_k, desc_v, bh, offs_m, lo, hi, T_K, qk_scale,
                  HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """Key blocks [lo, hi). MASK: the diagonal band or the Tk tail. Keys past Tk load k = v = 0
    and their p is masked (2^(0 - lse2) could overflow when every score is very negative)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_D)
        v = desc_v.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_D)
        s = _dot(q, tl.trans(k), None, UPCAST) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(s - lse2[:, None])
        if MASK:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            keep = offs_n[None, :] < T_K
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(keep, p, 0.0)
        dp = _dot(do, tl.trans(v), None, UPCAST)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq, UPCAST)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(desc_q, desc_k, desc_v, desc_do, LSE, DELTA, DQ, T_Q, T_K, sm_scale,
                        qk_scale, CAUSAL: tl.constexpr, HEAD_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                        DEVICE_DESC: tl.constexpr):
    desc_q, desc_k, desc_v, desc_do = _bwd_descs(desc_q, desc_k, desc_v, desc_do, T_Q, T_K, HEAD_D,
                                                 BLOCK_M, BLOCK_N, DEVICE_DESC)
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < T_Q
    q = desc_q.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_D)
    do = desc_do.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_D)
    lse2 = tl.load(LSE + bh64 * T_Q + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh64 * T_Q + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    full_hi = (T_K // BLOCK_N) * BLOCK_N
    if CAUSAL:
        masked_lo = tl.minimum(start_m, full_hi)
        hi = tl.minimum(start_m + BLOCK_M, T_K)
    else:
        masked_lo = full_hi
        hi = T_K
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, desc_k, desc_v, bh, offs_m, 0, masked_lo, T_K,
                       qk_scale, HEAD_D, BLOCK_N, False, CAUSAL, UPCAST)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, desc_k, desc_v, bh, offs_m, masked_lo, hi, T_K,
                       qk_scale, HEAD_D, BLOCK_N, True, CAUSAL, UPCAST)
    offs_d = tl.arange(0, HEAD_D)
    tl.store(DQ + bh64 * T_Q * HEAD_D + offs_m[:, None] * HEAD_D + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

def _fp32_first_config(configs, nargs, **kwargs):
    """Autotuner prune: fp32 products (input_precision="ieee") run without tensor cores and
    spill in every config, each taking ptxas tens of seconds at D=128, so fp32 is not timed: it
    runs the first config."""
    q = kwargs["desc_q"]  # a host descriptor, or the tensor itself on the device path
    dtype = q.base.dtype if isinstance(q, TensorDescriptor) else q.dtype
    return configs[:1] if dtype == torch.float32 else configs


def _tuned(kernel, configs):
    return _launch.Tuned(kernel, configs, key=["T_Q", "T_K", "HEAD_D", "CAUSAL"],
                         prune_configs_by=dict(early_config_prune=_fp32_first_config))


_FWD = _tuned(_attn_fwd_kernel, FWD_CONFIGS)
_DKDV = {max_d: _tuned(_attn_bwd_dkdv_kernel, c) for max_d, c in DKDV_CONFIGS.items()}
_DQ = _tuned(_attn_bwd_dq_kernel, DQ_CONFIGS)


def _desc(t):
    """A TMA descriptor over contiguous (B, H, T, D) ``t`` viewed as (B*H, T, D); _size_boxes
    sets its box per config. Rows past T read as zeros."""
    b, h, n, d = t.shape
    return TensorDescriptor(t, [b * h, n, d], [n * d, d, 1], [1, 16, d])


def _desc_args(**tensors):
    """The kernels' desc_* arguments (named by the keys) and their DEVICE_DESC flag: host
    descriptors, or on the device path the tensors themselves (each kernel builds its
    descriptors; on CUDA their global scratch comes from a torch-backed Triton allocator)."""
    if descriptor_mode() == "host":
        return dict({f"desc_{n}": _desc(t) for n, t in tensors.items()}, DEVICE_DESC=False)
    if any(t.is_cuda for t in tensors.values()):
        _launch.ensure_triton_allocator()
    return dict({f"desc_{n}": t for n, t in tensors.items()}, DEVICE_DESC=True)


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


def _forward(q, k, v, causal, scale, config=None):
    """(out, lse) from contiguous, 16-byte aligned q, k, v with at least one query; scale >= 0."""
    b, h, tq, d = q.shape
    o = _launch.empty(q.shape, q.dtype, q.device)
    lse = _launch.empty((b, h, tq), torch.float32, q.device)
    _FWD.run(lambda c: (triton.cdiv(tq, c["BLOCK_M"]), b * h), config=config,
             **_desc_args(q=q, k=k, v=v), O=o, LSE=lse, T_Q=tq, T_K=k.shape[2],
             qk_scale=scale * LOG2E, CAUSAL=causal, HEAD_D=d, UPCAST=_launch.interpreting())
    return o, lse


def _backward(q, k, v, o, lse, do, dlse, causal, scale, dkdv_config=None, dq_config=None):
    """(dq, dk, dv); the same preconditions as _forward, plus contiguous, aligned do."""
    b, h, tq, d = q.shape
    tk = k.shape[2]
    delta = _launch.empty((b, h, tq), torch.float32, q.device)
    n_rows = b * h * tq
    pre_block = 32
    _bwd_preprocess_kernel[(triton.cdiv(n_rows, pre_block),)](
        o, do, dlse.contiguous() if dlse is not None else delta, delta, n_rows,
        HAS_DLSE=dlse is not None, HEAD_D=d, BLOCK_M=pre_block, num_warps=4)
    dq = _launch.empty(q.shape, q.dtype, q.device)
    dk = _launch.empty(k.shape, k.dtype, k.device)
    dv = _launch.empty(v.shape, v.dtype, v.device)
    args = dict(**_desc_args(q=q, k=k, v=v, do=do), LSE=lse, DELTA=delta, T_Q=tq, T_K=tk,
                sm_scale=scale, qk_scale=scale * LOG2E, CAUSAL=causal, HEAD_D=d,
                UPCAST=_launch.interpreting())
    _DKDV[64 if d <= 64 else 128].run(lambda c: (triton.cdiv(tk, c["BLOCK_N"]), b * h),
                                      config=dkdv_config, DK=dk, DV=dv, **args)
    _DQ.run(lambda c: (triton.cdiv(tq, c["BLOCK_M"]), b * h), config=dq_config, DQ=dq, **args)
    return dq, dk, dv


def _prepared(t):
    """Contiguous with a 16-byte aligned start, as the TMA descriptors require."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class _AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, blocks):
        _check(q, k, v)
        q, k, v = _prepared(q), _prepared(k), _prepared(v)
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        # the forward takes row maxima of unscaled scores, which needs scale >= 0:
        # s = q k^T scale = q (-k)^T (-scale) (exact), and dk flips back in backward
        flip = scale < 0
        if flip:
            k, scale = -k, -scale
        configs = blocks.configs() if blocks is not None else (None, None, None)
        if q.numel() == 0:  # no queries: nothing to launch (descriptors need a nonempty shape)
            o, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
        else:
            o, lse = _forward(q, k, v, causal, scale, configs[0])
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.meta = (causal, scale, flip, configs)
        ctx.set_materialize_grads(False)  # unused lse: dlse is None and the kernel skips it
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, flip, configs = ctx.meta
        if q.numel() == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None
        do = _prepared(do) if do is not None else torch.zeros_like(o)
        dq, dk, dv = _backward(q, k, v, o, lse, do, dlse, causal, scale, *configs[1:])
        return dq, -dk if flip else dk, dv, None, None, None


def attention(q, k, v, causal: bool = False, sm_scale: float | None = None, *,
              blocks: AttentionBlocks | None = None):
    """Fused attention over (B, H, T, D) tensors; returns (out (B, H, Tq, D), lse (B, H, Tq) fp32).

    ``sm_scale`` defaults to 1/sqrt(D); ``blocks`` fixes the tiles instead of the tuned config
    lists (tests use small ones so that short sequences still cross block boundaries). Both
    outputs are differentiable."""
    return _AttentionFn.apply(q, k, v, causal, sm_scale, blocks)
