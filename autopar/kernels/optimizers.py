"""Fused AdamW, LAMB and LARS steps over flat fp32 buffers (param, grad and the optimizer state:
exp_avg and exp_avg_sq for AdamW and LAMB, momentum_buffer for LARS).

param and the state are updated in place; grad is only read. ``step`` is the step number after
incrementing (1 for the first step), as in torch.optim.

AdamW (torch.optim.AdamW, amsgrad=False, maximize=False), the same operations in the same order:
    p  = p * (1 - lr wd)                           decoupled weight decay
    m  = m + (1 - b1) (g - m)                      (lerp)
    v  = v b2 + (1 - b2) g g
    p  = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    memory: read 4N, write 3N fp32 (28 bytes per parameter); one pass.
    IEEE sqrt and division (tl.sqrt_rn, tl.div_rn) keep the rounding torch's; in the interpreter
    the result is bitwise torch's single-tensor AdamW, on a GPU within an ulp or so (FMA fusion).

LAMB (You et al., 2019; trust-ratio rule of DeepSpeed's FusedLamb), per tensor i of the flat
buffer, tensor i spanning [offsets[i], offsets[i+1]):
    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g g
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd p       (bias correction optional)
    r_i = clamp(||p_i|| / ||u_i||, min_trust, max_trust) if both norms > 0 else 1
          (defaults [0.01, 10], DeepSpeed's min_coeff/max_coeff)
    p = p - lr r_i u
    Two passes, because r_i needs the whole tensor's norms before any p changes:
    pass 1 updates m, v and writes per-chunk partial sums of p^2 and u^2 (read 4N, write 2N);
    torch sums the partials per tensor and forms r (tiny); pass 2 recomputes u from m, v, p and
    writes p (read 3N, write N). Total 40 bytes per parameter. When the buffer's tensors are
    shards of larger ones (tensor parallel, ZeRO), ``reduce_sq`` sums the squared norms over the
    shards between the passes (``autopar.optim.LAMB`` passes an all-reduce). Chunks never straddle two tensors:
    the chunk table (tensor id, start, end per chunk, LAMB_BLOCK elements at most) is built on
    the host from ``offsets``; a program takes CHUNKS consecutive entries of it as one tile.

LARS (You, Gitman, Ginsburg 2017, arXiv:1708.03888), the update of timm's ``Lars`` (NVIDIA apex
LARC's trust ratio in front of torch's SGD with momentum, dampening 0), per tensor i:
    r_i = tc ||p_i|| / (||g_i|| + wd ||p_i|| + eps) if both norms > 0 else 1   (adapting groups)
          (trust_clip: r_i = min(r_i / lr, 1), LARC's clipping; not adapting: r_i = 1)
    d = r_i (g + wd p);   b = momentum b + d;   p = p - lr (d + momentum b if nesterov else b)
    A group adapts when weight_decay != 0 or always_adapt (timm's rule: its no-decay group, the
    biases and norm weights, gets plain SGD). Two passes over LAMB's chunk table: pass 1 writes
    per-chunk partial sums of p^2 and g^2 (read 2N), ``reduce_sq`` sums them over the shards as
    for LAMB, pass 2 updates b and p (read 3N, write 2N): 28 bytes per parameter (20 when the
    group does not adapt: no pass 1, no ``reduce_sq``).

Launch parameters (AdamW's block and warps, LAMB's and LARS's chunks per program and warps) come
from short config lists autotuned on CUDA by _launch.Tuned (ADAMW_CONFIGS, LAMB_CONFIGS; the first
entry is the choice made by hand before tuning existed, and what the interpreter runs). Tuning times each
config on the real buffers, so every kernel names the buffers it updates in ``restore_value``:
the autotuner saves them before each trial and puts them back after it, and the step is applied
once, by the launch that follows.

Run the tests:  TRITON_INTERPRET=1 pytest tests/kernels/test_kernel_optimizers.py \
                                        tests/kernels/test_kernel_lars.py
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Optional

import torch
import triton
import triton.language as tl

from autopar.kernels import _launch

ADAMW_BLOCK = 1024
LAMB_BLOCK = 2048     # the chunk table's chunk: LAMB's and LARS's kernels
ReduceSq = Callable[[torch.Tensor], torch.Tensor]    # (n_tensors, 2) squared norms -> summed


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def adamw_step_ref(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float,
                   beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 1e-2) -> None:
    """torch.optim.AdamW's single-tensor step in plain torch. Reads 4N, writes 3N, but eagerly:
    each line is its own pass over memory (about 8 reads and 6 writes of N)."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def lamb_step_ref(param, grad, exp_avg, exp_avg_sq, offsets: Sequence[int], *, step: int,
                  lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-6,
                  weight_decay: float = 1e-2, min_trust: float = 0.01, max_trust: float = 10.0,
                  bias_correction: bool = True, reduce_sq: Optional[ReduceSq] = None) -> None:
    """LAMB in plain torch, one tensor slice at a time (see the module docstring)."""
    offsets = _offsets_list(offsets, param.numel(), "lamb")
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    spans = _spans(offsets)
    updates, sq = [], torch.zeros(len(spans), 2, dtype=torch.float32, device=param.device)
    for i, (lo, hi) in enumerate(spans):
        p, g, m, v = param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        u = (m / bc1) / ((v / bc2).sqrt() + eps) + weight_decay * p
        sq[i, 0], sq[i, 1] = p.square().sum(), u.square().sum()
        updates.append(u)
    ratio = _trust_ratio(reduce_sq(sq) if reduce_sq is not None else sq, min_trust, max_trust)
    for (lo, hi), u, r in zip(spans, updates, ratio):
        param[lo:hi].sub_(lr * r * u)


def _trust_ratio(sq: torch.Tensor, min_trust: float, max_trust: float) -> torch.Tensor:
    """Per tensor clamp(||p|| / ||u||) from (n_tensors, 2) squared norms, 1 where either is 0
    (no Python branch on tensor values, so torch.compile traces it without graph breaks)."""
    w_norm, u_norm = sq.sqrt().unbind(1)
    return torch.where((w_norm > 0) & (u_norm > 0), (w_norm / u_norm).clamp(min_trust, max_trust),
                       torch.ones_like(w_norm))


def lars_step_ref(param, grad, momentum_buffer, offsets: Sequence[int], *, lr: float,
                  momentum: float = 0.9, weight_decay: float = 1e-4, trust_coefficient: float = 1e-3,
                  eps: float = 1e-8, nesterov: bool = False, trust_clip: bool = False,
                  always_adapt: bool = False, reduce_sq: Optional[ReduceSq] = None) -> None:
    """LARS in plain torch, one tensor slice at a time (see the module docstring)."""
    spans = _spans(_offsets_list(offsets, param.numel(), "lars"))
    ratio = torch.ones(len(spans), dtype=torch.float32, device=param.device)
    if weight_decay != 0 or always_adapt:
        sq = torch.zeros(len(spans), 2, dtype=torch.float32, device=param.device)
        for i, (lo, hi) in enumerate(spans):
            sq[i, 0], sq[i, 1] = param[lo:hi].square().sum(), grad[lo:hi].square().sum()
        ratio = _lars_ratio(reduce_sq(sq) if reduce_sq is not None else sq, trust_coefficient,
                            weight_decay, eps, lr, trust_clip)
    for (lo, hi), r in zip(spans, ratio):
        p, b = param[lo:hi], momentum_buffer[lo:hi]
        d = grad[lo:hi].add(p, alpha=weight_decay).mul_(r)
        b.mul_(momentum).add_(d)
        p.add_(d.add(b, alpha=momentum) if nesterov else b, alpha=-lr)


def _lars_ratio(sq: torch.Tensor, trust_coefficient: float, weight_decay: float, eps: float,
                lr: float, trust_clip: bool) -> torch.Tensor:
    """Per tensor LARS's local rate from (n_tensors, 2) squared norms (||p||^2, ||g||^2), 1 where
    either is 0, then LARC's clip min(r / lr, 1) if ``trust_clip`` (as timm's Lars)."""
    w_norm, g_norm = sq.sqrt().unbind(1)
    ratio = trust_coefficient * w_norm / (g_norm + w_norm * weight_decay + eps)
    ratio = torch.where((w_norm > 0) & (g_norm > 0), ratio, torch.ones_like(w_norm))
    return (ratio / lr).clamp(max=1.0) if trust_clip else ratio


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _adamw_kernel(P, G, M, V, numel, decay, one_minus_beta1, beta2, one_minus_beta2, eps,
                  step_size, bc2_sqrt, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    p = p * decay
    m = tl.fma(one_minus_beta1, g - m, m)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn((-step_size) * m, denom)  # addcdiv: self + (value * t1) / t2
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)


@triton.jit
def _lamb_update(p, m, v, inv_bc1, inv_bc2, eps, weight_decay):
    return (m * inv_bc1) / (tl.sqrt(v * inv_bc2) + eps) + weight_decay * p


@triton.jit
def _chunk_tile(CHUNK_START, CHUNK_END, n_chunks, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's chunks c (CHUNKS table entries from program_id * CHUNKS on) as a
    (CHUNKS, BLOCK) tile: (c, the flat offsets, their mask, which chunks exist)."""
    c = tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)
    ok = c < n_chunks
    start = tl.load(CHUNK_START + c, mask=ok, other=0)
    end = tl.load(CHUNK_END + c, mask=ok, other=0)  # a missing chunk is empty
    offs = start[:, None] + tl.arange(0, BLOCK)[None, :]
    return c, offs, offs < end[:, None], ok


@triton.jit
def _lamb_moments_kernel(P, G, M, V, CHUNK_START, CHUNK_END, PART, n_chunks, beta1, beta2, eps,
                         weight_decay, inv_bc1, inv_bc2, BLOCK: tl.constexpr,
                         CHUNKS: tl.constexpr):
    c, offs, mask, ok = _chunk_tile(CHUNK_START, CHUNK_END, n_chunks, CHUNKS, BLOCK)
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    u = tl.where(mask, _lamb_update(p, m, v, inv_bc1, inv_bc2, eps, weight_decay), 0.0)
    tl.store(PART + 2 * c, tl.sum(p * p, axis=1), mask=ok)  # every chunk's partials, each launch
    tl.store(PART + 2 * c + 1, tl.sum(u * u, axis=1), mask=ok)


@triton.jit
def _lamb_apply_kernel(P, M, V, RATIO, CHUNK_TENSOR, CHUNK_START, CHUNK_END, n_chunks, lr, eps,
                       weight_decay, inv_bc1, inv_bc2, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    c, offs, mask, ok = _chunk_tile(CHUNK_START, CHUNK_END, n_chunks, CHUNKS, BLOCK)
    ratio = tl.load(RATIO + tl.load(CHUNK_TENSOR + c, mask=ok, other=0), mask=ok, other=0.0)
    p = tl.load(P + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    p = p - (lr * ratio[:, None]) * _lamb_update(p, m, v, inv_bc1, inv_bc2, eps, weight_decay)
    tl.store(P + offs, p, mask=mask)


@triton.jit
def _lars_norms_kernel(P, G, CHUNK_START, CHUNK_END, PART, n_chunks, BLOCK: tl.constexpr,
                       CHUNKS: tl.constexpr):
    c, offs, mask, ok = _chunk_tile(CHUNK_START, CHUNK_END, n_chunks, CHUNKS, BLOCK)
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0)
    tl.store(PART + 2 * c, tl.sum(p * p, axis=1), mask=ok)  # every chunk's partials, each launch
    tl.store(PART + 2 * c + 1, tl.sum(g * g, axis=1), mask=ok)


@triton.jit
def _lars_apply_kernel(P, G, B, RATIO, CHUNK_TENSOR, CHUNK_START, CHUNK_END, n_chunks, lr,
                       momentum, weight_decay, NESTEROV: tl.constexpr, BLOCK: tl.constexpr,
                       CHUNKS: tl.constexpr):
    c, offs, mask, ok = _chunk_tile(CHUNK_START, CHUNK_END, n_chunks, CHUNKS, BLOCK)
    ratio = tl.load(RATIO + tl.load(CHUNK_TENSOR + c, mask=ok, other=0), mask=ok, other=0.0)
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0)
    b = tl.load(B + offs, mask=mask, other=0.0)
    d = (g + weight_decay * p) * ratio[:, None]
    b = momentum * b + d
    if NESTEROV:
        p = p - lr * (d + momentum * b)
    else:
        p = p - lr * b
    tl.store(P + offs, p, mask=mask)
    tl.store(B + offs, b, mask=mask)


# --------------------------------------------------------------------------------------------
# Launch configs (autotuned on CUDA; the first of each list is the choice made before tuning)
# --------------------------------------------------------------------------------------------

# AdamW's flat blocks (fp32: 4 elements are one 16-byte load). #0 1024 on 4 warps (two loads per
# thread and tensor); #1 2048 on 8 warps (the same share per thread, half the programs); #2 2048
# on 4 warps (four loads per thread and tensor in flight); #3 512 on 4 warps (one load each:
# fewer registers, more programs resident per SM).
ADAMW_CONFIGS = tuple(triton.Config({"BLOCK": b}, num_warps=w)
                      for b, w in ((1024, 4), (2048, 8), (2048, 4), (512, 4)))
# LAMB: chunks of the table (LAMB_BLOCK elements at most) per program, one (CHUNKS, LAMB_BLOCK)
# tile. #0 one chunk on 8 warps (8 elements per thread); #1 one on 4 warps (16 per thread: more
# loads in flight); #2 two chunks on 16 warps and #3 four on 32 warps (8 per thread, a half and
# a quarter of the programs). Both kernels use the list. Left out: two chunks on 8 warps (184
# registers in the moments kernel, against 63 for #0) and four on 16 warps (512 threads get at
# most 128 registers each, and the moments kernel spilled once built with the 16-byte aligned
# pointers real launches have). LARS's two kernels run over the same chunk table with this list
# (fewer live values than LAMB's moments kernel: no moments, no sqrt or division); timing a list
# of their own on a GPU is left to the next tuning run.
LAMB_CONFIGS = tuple(triton.Config({"CHUNKS": c}, num_warps=w)
                     for c, w in ((1, 8), (1, 4), (2, 16), (4, 32)))
# Every kernel here updates buffers in place, and the autotuner launches each config many times
# on the real arguments: restore_value names every buffer a kernel writes, so the autotuner saves
# them before each of those launches and puts them back after it, and only the launch that
# follows tuning steps them. LAMB's PART (per-chunk partial sums) is written in full by every
# launch of every config, never accumulated into, so it needs neither restoring nor resetting;
# torch sums the per-tensor norms from it after the launch that counts.
_ADAMW = _launch.Tuned(_adamw_kernel, ADAMW_CONFIGS, key=["numel"],
                       min_numel=_launch.TUNE_MIN_NUMEL, restore_value=["P", "M", "V"])
_LAMB_MOMENTS = _launch.Tuned(_lamb_moments_kernel, LAMB_CONFIGS, key=["n_chunks"],
                              min_numel=_launch.TUNE_MIN_NUMEL, restore_value=["M", "V"])
_LAMB_APPLY = _launch.Tuned(_lamb_apply_kernel, LAMB_CONFIGS, key=["n_chunks"],
                            min_numel=_launch.TUNE_MIN_NUMEL, restore_value=["P"])
_LARS_NORMS = _launch.Tuned(_lars_norms_kernel, LAMB_CONFIGS, key=["n_chunks"],
                            min_numel=_launch.TUNE_MIN_NUMEL)  # writes only PART, in full
_LARS_APPLY = _launch.Tuned(_lars_apply_kernel, LAMB_CONFIGS, key=["n_chunks"],
                            min_numel=_launch.TUNE_MIN_NUMEL, restore_value=["P", "B"])


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _check_buffers(name, **bufs: torch.Tensor) -> None:
    """Every buffer (param first) flat, contiguous, fp32, on one device, as long as param."""
    _launch.check_device(name, *bufs.values())
    numel = bufs["param"].numel()
    for label, t in bufs.items():
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name}: {label} must be a flat contiguous fp32 buffer, got "
                             f"{t.dtype} of shape {tuple(t.shape)}")
        if t.numel() != numel:
            raise ValueError(f"{name}: {label} has {t.numel()} elements, param {numel}")


def adamw_step(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float = 0.9,
               beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
               config: int | None = None) -> None:
    """One fused AdamW step, in place on param, exp_avg, exp_avg_sq (see module docstring).
    ``config``: the index of ADAMW_CONFIGS to run instead of the tuned choice (tests)."""
    _check_buffers("adamw_step", param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    if step < 1:
        raise ValueError(f"adamw_step: step={step}; steps count from 1")
    numel = param.numel()
    if numel == 0:
        return
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    _ADAMW.run(lambda meta: (triton.cdiv(numel, meta["BLOCK"]),),
               param, grad, exp_avg, exp_avg_sq, numel, 1 - lr * weight_decay, 1 - beta1, beta2,
               1 - beta2, eps, lr / bias_correction1, math.sqrt(bias_correction2), config=config)


def _offsets_list(offsets, numel: int, name: str) -> list[int]:
    offs = [int(o) for o in (offsets.tolist() if torch.is_tensor(offsets) else offsets)]
    if len(offs) < 2 or offs[0] != 0 or offs[-1] != numel or any(
            b < a for a, b in zip(offs[:-1], offs[1:])):
        raise ValueError(f"{name}: offsets must rise from 0 to numel={numel} (one more entry than "
                         f"tensors), got {offs[:4]}{'...' if len(offs) > 4 else ''}")
    return offs


def _spans(offs: list[int]) -> list[tuple[int, int]]:
    return list(zip(offs[:-1], offs[1:]))


def lamb_chunks(offsets: Sequence[int], numel: int, block: int = LAMB_BLOCK):
    """Chunk table for the LAMB kernels: (tensor_id, start, end) int64 CPU tensors, one entry per
    block-sized chunk of each tensor (empty tensors get none). Build it once per parameter layout
    and pass it to ``lamb_step(chunks=...)`` or ``lars_step(chunks=...)`` (moved to the device)
    to skip the per-step copy."""
    offs = torch.tensor(_offsets_list(offsets, numel, "chunk table"), dtype=torch.int64)
    per_tensor = (offs[1:] - offs[:-1] + block - 1) // block  # chunks per tensor
    tid = torch.repeat_interleave(torch.arange(per_tensor.numel()), per_tensor)
    first = torch.cumsum(per_tensor, 0) - per_tensor  # index of each tensor's first chunk
    start = offs[tid] + (torch.arange(tid.numel()) - first[tid]) * block
    end = torch.minimum(start + block, offs[tid + 1])
    return tid, start, end


def _chunk_table(name: str, param: torch.Tensor, offsets, chunks):
    """(number of tensors, the chunk table on param's device): ``chunks`` if given, else built."""
    offs = _offsets_list(offsets, param.numel(), name)
    if chunks is None:
        chunks = tuple(t.to(param.device) for t in lamb_chunks(offs, param.numel()))
    return len(offs) - 1, chunks


def _tensor_sq(n_tensors: int, device, reduce_sq: Optional[ReduceSq], tid=None, part=None):
    """The (n_tensors, 2) squared norms: the per-chunk ``part`` summed per tensor (zeros when the
    buffer has no chunks), then ``reduce_sq``'d. A rank whose shards are all empty still calls
    it: the other shards' ranks wait in its all-reduce."""
    sq = torch.zeros(n_tensors, 2, dtype=torch.float32, device=device)
    if part is not None:
        sq.index_add_(0, tid, part)
    return reduce_sq(sq) if reduce_sq is not None else sq


def lamb_step(param, grad, exp_avg, exp_avg_sq, offsets: Sequence[int], *, step: int,
              lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-6,
              weight_decay: float = 1e-2, min_trust: float = 0.01, max_trust: float = 10.0,
              bias_correction: bool = True, chunks=None, config: int | None = None,
              reduce_sq: Optional[ReduceSq] = None) -> None:
    """One fused LAMB step over a flat buffer holding several tensors (see module docstring).
    ``chunks``: a precomputed ``lamb_chunks(offsets, numel)`` already on param's device.
    ``reduce_sq``: applied to the (n_tensors, 2) fp32 squared norms (||p||^2, ||u||^2) of this
    buffer's tensors before the trust ratio: where each tensor is one shard of a larger one,
    it sums them over the shards (an all-reduce), so the ratio is the whole tensor's.
    ``config``: the index of LAMB_CONFIGS both kernels run instead of their tuned choices."""
    _check_buffers("lamb_step", param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    if step < 1:
        raise ValueError(f"lamb_step: step={step}; steps count from 1")
    n_tensors, (tid, start, end) = _chunk_table("lamb", param, offsets, chunks)
    n_chunks = tid.numel()
    if n_chunks == 0:
        _tensor_sq(n_tensors, param.device, reduce_sq)    # the other shards' ranks wait for it
        return
    inv_bc1 = 1.0 / (1 - beta1**step) if bias_correction else 1.0
    inv_bc2 = 1.0 / (1 - beta2**step) if bias_correction else 1.0
    part = _launch.empty((n_chunks, 2), torch.float32, param.device)

    def grid(meta):
        return (triton.cdiv(n_chunks, meta["CHUNKS"]),)

    _LAMB_MOMENTS.run(grid, param, grad, exp_avg, exp_avg_sq, start, end, part, n_chunks, beta1,
                      beta2, eps, weight_decay, inv_bc1, inv_bc2, BLOCK=LAMB_BLOCK, config=config)
    ratio = _trust_ratio(_tensor_sq(n_tensors, param.device, reduce_sq, tid, part), min_trust, max_trust)
    _LAMB_APPLY.run(grid, param, exp_avg, exp_avg_sq, ratio, tid, start, end, n_chunks, lr, eps,
                    weight_decay, inv_bc1, inv_bc2, BLOCK=LAMB_BLOCK, config=config)


def lars_step(param, grad, momentum_buffer, offsets: Sequence[int], *, lr: float,
              momentum: float = 0.9, weight_decay: float = 1e-4, trust_coefficient: float = 1e-3,
              eps: float = 1e-8, nesterov: bool = False, trust_clip: bool = False,
              always_adapt: bool = False, chunks=None, config: int | None = None,
              reduce_sq: Optional[ReduceSq] = None) -> None:
    """One fused LARS step over a flat buffer holding several tensors (see module docstring).
    ``chunks``: a precomputed ``lamb_chunks(offsets, numel)`` already on param's device.
    ``reduce_sq``: applied to the (n_tensors, 2) fp32 squared norms (||p||^2, ||g||^2) before the
    local rates, as for ``lamb_step`` (called only when the group adapts: weight_decay != 0 or
    ``always_adapt``). ``config``: the index of LAMB_CONFIGS both kernels run."""
    _check_buffers("lars_step", param=param, grad=grad, momentum_buffer=momentum_buffer)
    n_tensors, (tid, start, end) = _chunk_table("lars", param, offsets, chunks)
    n_chunks = tid.numel()
    adapt = weight_decay != 0 or always_adapt
    if n_chunks == 0:
        if adapt:
            _tensor_sq(n_tensors, param.device, reduce_sq)    # the other shards' ranks wait for it
        return

    def grid(meta):
        return (triton.cdiv(n_chunks, meta["CHUNKS"]),)

    if adapt:
        part = _launch.empty((n_chunks, 2), torch.float32, param.device)
        _LARS_NORMS.run(grid, param, grad, start, end, part, n_chunks, BLOCK=LAMB_BLOCK, config=config)
        ratio = _lars_ratio(_tensor_sq(n_tensors, param.device, reduce_sq, tid, part),
                            trust_coefficient, weight_decay, eps, lr, trust_clip)
    else:
        ratio = torch.ones(n_tensors, dtype=torch.float32, device=param.device)
    _LARS_APPLY.run(grid, param, grad, momentum_buffer, ratio, tid, start, end, n_chunks, lr,
                    momentum, weight_decay, NESTEROV=bool(nesterov), BLOCK=LAMB_BLOCK, config=config)
