"""Context-parallel attention on local tensors: ring attention and Ulysses (axis "cp", degree n).

Every sequence is split over the n cp ranks; rank c holds the tokens at global positions
``chunk_positions(T, n, c, order)`` of every row:
  * "contiguous": rank c holds [c T/n, (c+1) T/n);
  * "zigzag" (causal load balance): the sequence is cut in 2n pieces, rank c holds piece c then
    piece 2n-1-c.
Outside attention every op is token-wise, so SDPA is the only op that communicates. ``fold`` lays a
global batch out so that Shard(0) over the dp*n ranks (rank k = d*n + c) gives rank (d, c) its rows
and tokens; ``unfold`` is its inverse.

Both engines take this rank's LOCAL q, k, v (B, H, T/n, D) (k, v the same shape and dtype as q), the
process group of the n cp ranks (ordered by cp coordinate, ``rank`` = this rank's) and global token
positions, and return this rank's rows of the full-sequence ``F.scaled_dot_product_attention``
(``is_causal``: key position <= query position), differentiable w.r.t. q, k, v.

Collectives (what ``ring_traffic`` / ``ulysses_traffic`` predict; all are functional
``_c10d_functional.all_to_all_single`` ops on the cp group, so ``CollectiveRecorder`` logs them; the
size is each rank's send buffer, autopar's all_to_all convention). With Tl = T/n, E = B*H*Tl*D
(k's shape), ``eb`` k's element size, and nothing at all when n == 1:

ring_attention (an autograd Function; K/V move to cp rank (rank+1) mod n each step, the buffer
flattened, all of it sent to that one peer):
  forward:  n-1 all_to_all of the K|V buffer, 2E elements of k.dtype            (2 E eb bytes each)
  backward: per step i = 0..n-1: (i < n-1) one all_to_all of the K|V buffer (2 E eb bytes), issued
            before the step's compute (prefetch), then one all_to_all of the fp32 dK|dV accumulator
            (2 E * 4 bytes) after it; issued order: KV, dKV, KV, dKV, ..., KV, dKV, dKV;
            n-1 K|V rotations + n accumulator rotations = 2n-1 collectives. After the n-th
            rotation each accumulator is back at the rank that owns its K/V tokens.
ulysses_attention (autograd through the functional all_to_all's registered backward; heads split
in n groups of H/n; q, k, v travel in one buffer):
  forward:  all_to_all of q|k|v (3E elements, q.dtype), then all_to_all of the output (E elements)
  backward: all_to_all of dOut (E elements), then all_to_all of dq|dk|dv (3E elements)

Compute: ring attention runs each block through torch's flash attention op (the CPU kernel, and
on CUDA the FlashAttention-2 kernel for fp16/bf16), split into the pieces a causal chunk layout makes
(keys all before the queries, or the causal diagonal of one piece: ``_pairs``), so no block's
scores are ever materialized; other layouts and dtypes use plain fp32 math with an explicit mask.
Partial results merge by log-sum-exp in fp32; the backward runs the kernels' backward per block
with the saved global output and lse (exact per key block); blocks whose every key is after every
local query are skipped; the output is q.dtype. Ulysses un-permutes the gathered sequence to natural order and calls
``F.scaled_dot_product_attention(is_causal=causal)`` in q.dtype.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

ORDERS = ("contiguous", "zigzag")


# ---- chunk layout ---------------------------------------------------------------------------

def _check_split(seq_len: int, n: int, order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"unknown cp chunk order {order!r}: use 'contiguous' or 'zigzag'")
    if n < 1:
        raise ValueError(f"cp degree must be >= 1, got {n}")
    pieces = 2 * n if order == "zigzag" else n
    if seq_len % pieces:
        what = "2*cp" if order == "zigzag" else "cp"
        raise ValueError(
            f"sequence length {seq_len} does not split into {pieces} equal {order} pieces "
            f"({what}={pieces}, cp={n}): make the sequence length a multiple of {pieces} (pad it) "
            f"or choose a cp degree whose {what} divides {seq_len}")


def chunk_order(n: int, order: str) -> list[list[int]]:
    """Per cp rank, the indices of the pieces it holds, in order: pieces of T/n ("contiguous":
    [[0], [1], ...]) or of T/(2n) ("zigzag": [[0, 2n-1], [1, 2n-2], ...])."""
    _check_split(2 * n if order == "zigzag" else n, n, order)
    if order == "contiguous":
        return [[c] for c in range(n)]
    return [[c, 2 * n - 1 - c] for c in range(n)]


def chunk_positions(seq_len: int, n: int, rank: int, order: str) -> torch.Tensor:
    """Global positions (int64, length seq_len/n) of the tokens cp rank ``rank`` holds."""
    _check_split(seq_len, n, order)
    if not 0 <= rank < n:
        raise ValueError(f"cp rank {rank} out of range for cp={n}")
    piece = seq_len // (2 * n if order == "zigzag" else n)
    return torch.cat([torch.arange(p * piece, (p + 1) * piece, dtype=torch.int64)
                      for p in chunk_order(n, order)[rank]])


def _all_chunk_positions(seq_len: int, n: int, order: str) -> list[torch.Tensor]:
    return [chunk_positions(seq_len, n, c, order) for c in range(n)]


# ---- fold / unfold --------------------------------------------------------------------------

def fold(x: torch.Tensor, *, dp: int, n: int, seq_dim: Optional[int], order: str) -> torch.Tensor:
    """Global batch (rows on dim 0; the sequence on ``seq_dim``, None for a per-row tensor) -> the
    folded batch (dp*n*B/dp rows, T/n tokens): the rows of rank k = d*n + c are block d's B/dp rows,
    in order, restricted to cp rank c's chunk (seq_dim None: block d's rows, repeated per c)."""
    B = x.shape[0]
    if dp < 1 or B % dp:
        raise ValueError(f"batch {B} does not split over dp={dp}: make the batch a multiple of dp")
    blocks = x.split(B // dp, dim=0)
    if seq_dim is None:
        return torch.cat([b for b in blocks for _ in range(n)], dim=0)
    seq_dim = _seq_dim(x, seq_dim)
    pos = _all_chunk_positions(x.shape[seq_dim], n, order)
    return torch.cat([b.index_select(seq_dim, p) for b in blocks for p in pos], dim=0)


def unfold(y: torch.Tensor, *, dp: int, n: int, seq_dim: int, order: str) -> torch.Tensor:
    """Inverse of ``fold`` (with a sequence dim): folded (dp*n*B/dp, ..., T/n, ...) -> (B, ..., T, ...)."""
    rows = y.shape[0]
    if dp < 1 or n < 1 or rows % (dp * n):
        raise ValueError(f"folded batch {rows} is not a multiple of dp*cp = {dp}*{n}")
    seq_dim = _seq_dim(y, seq_dim)
    pos = torch.cat(_all_chunk_positions(y.shape[seq_dim] * n, n, order))
    inverse = torch.argsort(pos)
    parts = y.split(rows // (dp * n), dim=0)
    blocks = [torch.cat(parts[d * n:(d + 1) * n], dim=seq_dim).index_select(seq_dim, inverse)
              for d in range(dp)]
    return torch.cat(blocks, dim=0)


def _seq_dim(x: torch.Tensor, seq_dim: int) -> int:
    d = seq_dim + x.dim() if seq_dim < 0 else seq_dim
    if not 1 <= d < x.dim():
        raise ValueError(f"seq_dim {seq_dim} is not a non-batch dim of a {x.dim()}-d tensor "
                         f"(dim 0 holds the rows)")
    return d


# ---- checks ---------------------------------------------------------------------------------

def _check_inputs(q, k, v, n: int, rank: int, positions, all_positions, engine: str):
    if q.dim() != 4:
        raise ValueError(f"{engine}: q must be (B, H, T/cp, D), got shape {tuple(q.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"{engine}: k {tuple(k.shape)} and v {tuple(v.shape)} must have q's shape "
                         f"{tuple(q.shape)} (repeat K/V heads for GQA before the call)")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{engine}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 0 <= rank < n:
        raise ValueError(f"{engine}: cp rank {rank} out of range for cp={n}")
    positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).cpu()
    tl = q.shape[2]
    if positions.numel() != tl:
        raise ValueError(f"{engine}: the local q/k/v hold {tl} tokens but positions has "
                         f"{positions.numel()}: pass this rank's chunk (length T/cp = seq_len/{n}) and "
                         f"its positions (chunk_positions(seq_len, {n}, {rank}, order))")
    if all_positions is not None:
        all_positions = [torch.as_tensor(p, dtype=torch.int64).reshape(-1).cpu() for p in all_positions]
        if len(all_positions) != n or any(p.numel() != tl for p in all_positions):
            raise ValueError(f"{engine}: all_positions must hold {n} tensors of {tl} positions, got "
                             f"lengths {[p.numel() for p in all_positions]}")
        if not torch.equal(all_positions[rank], positions):
            raise ValueError(f"{engine}: all_positions[{rank}] differs from positions")
        cat = torch.cat(all_positions)
        if not torch.equal(torch.sort(cat).values, torch.arange(n * tl)):
            raise ValueError(f"{engine}: all_positions must cover 0..{n * tl - 1} exactly once")
    return positions, all_positions


def _infer_all_positions(positions: torch.Tensor, n: int, rank: int) -> list[torch.Tensor]:
    t = positions.numel() * n
    for order in ORDERS:
        try:
            cand = _all_chunk_positions(t, n, order)
        except ValueError:
            continue
        if torch.equal(cand[rank], positions):
            return cand
    raise ValueError("ring_attention: positions are neither a contiguous nor a zig-zag chunk; pass "
                     "all_positions (every cp rank's positions)")


# ---- communication --------------------------------------------------------------------------

def _wait(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _rotate(flat: torch.Tensor, group, rank: int, n: int) -> torch.Tensor:
    """Send the whole 1-D ``flat`` to cp rank (rank+1) mod n, receive (rank-1) mod n's (un-waited)."""
    from torch.distributed._functional_collectives import all_to_all_single

    send, recv = [0] * n, [0] * n
    send[(rank + 1) % n] = flat.numel()
    recv[(rank - 1) % n] = flat.numel()
    return all_to_all_single(flat.contiguous(), recv, send, group)


# ---- ring attention -------------------------------------------------------------------------

def _block_mask(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool):
    """(None, False): no mask; (None, True): the block is entirely masked; (mask, False) otherwise
    (mask True where the key is after the query)."""
    if not causal:
        return None, False
    if int(kpos.min()) > int(qpos.max()):
        return None, True
    if int(kpos.max()) <= int(qpos.min()):
        return None, False
    return kpos.view(1, -1) > qpos.view(-1, 1), False


def _runs(pos: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive positions: (local start, length, first position). Vectorized:
    it runs per block and step on chunks of up to a million tokens (a zig-zag chunk has 2 runs)."""
    starts = torch.cat([torch.zeros(1, dtype=torch.int64),
                        torch.nonzero(pos[1:] - pos[:-1] != 1).flatten() + 1]).tolist()
    ends = starts[1:] + [pos.numel()]
    firsts = pos[starts].tolist()
    return [(a, e - a, f) for a, e, f in zip(starts, ends, firsts)]


def _pairs(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool) -> Optional[list]:
    """The block as pieces a flash kernel runs whole: (q slice, k slice, is_causal) per pair of
    position runs that attend -- all keys before the queries (full), or the same run (the causal
    diagonal) -- or None when some pair is partly masked otherwise (then the masked reference)."""
    if not causal:
        return [(slice(None), slice(None), False)]
    out = []
    for qs, ql, qp in _runs(qpos):
        for ks, kl, kp in _runs(kpos):
            if kp + kl - 1 < qp:
                out.append((slice(qs, qs + ql), slice(ks, ks + kl), False))
            elif kp == qp and kl == ql:
                out.append((slice(qs, qs + ql), slice(ks, ks + kl), True))
            elif kp <= qp + ql - 1:
                return None                       # partly masked: not a kernel shape
    return out


def _flash(q: torch.Tensor) -> Optional[str]:
    """Which memory-efficient attention op runs blocks of ``q``'s device and dtype (None: the
    plain masked math): torch's flash attention on CPU, and on CUDA for 16-bit inputs."""
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        return "cuda"
    return None


def _flash_forward(kind: str, q, k, v, causal: bool, scale: float):
    """(out, lse fp32) of one block by torch's flash attention op."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if kind == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    else:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]
    return o.float(), lse.float()


def _flash_backward(kind: str, do, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of one block given the WHOLE attention's output and log-sum-exp of these
    queries (FlashAttention's backward is exact per key block with the global statistics)."""
    do, q, k, v, out = (x.contiguous() for x in (do, q, k, v, out))
    if kind == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale)
    # no cumulative sequence lengths: given them, the op takes the varlen path, which reads (total,
    # heads, dim) tensors (it read the heads as the head size: "head_size should be a multiple of 8")
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, zero, zero,
        scale=scale)


def _merge(out, lse, rows, bout, blse):
    """Fold a block's (out, lse) for query ``rows`` into the running fp32 (out, lse)."""
    o, l = out[:, :, rows], lse[:, :, rows]
    new = torch.logaddexp(l, blse)
    safe = _finite(new)
    out[:, :, rows] = o * torch.exp(l - safe).unsqueeze(-1) + bout * torch.exp(blse - safe).unsqueeze(-1)
    lse[:, :, rows] = new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, rank, n, qpos, kv_positions, causal, scale):
        b, h, tl, d = k.shape
        qf = q.float()
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        kind = _flash(q)
        for i in range(n):
            nxt = _rotate(kv, group, rank, n) if i < n - 1 else None     # prefetch the next block
            src = (rank - i) % n
            mask, skip = _block_mask(qpos, kv_positions[src], causal)
            pairs = _pairs(qpos, kv_positions[src], causal) if kind and not skip else None
            if pairs is not None:
                kb, vb = kv.view(2, b, h, tl, d)
                for qs, ks, diag in pairs:
                    bout, blse = _flash_forward(kind, q[:, :, qs], kb[:, :, ks], vb[:, :, ks], diag, scale)
                    _merge(out, lse, qs, bout, blse)
            elif not skip:
                kb, vb = kv.float().view(2, b, h, tl, d)
                s = torch.matmul(qf, kb.transpose(-1, -2)) * scale
                if mask is not None:
                    s = s.masked_fill(mask.to(s.device), float("-inf"))
                blse = torch.logsumexp(s, dim=-1)
                p = torch.exp(s - _finite(blse).unsqueeze(-1))
                bout = torch.matmul(p, vb)
                new = torch.logaddexp(lse, blse)
                safe = _finite(new)
                out = out * torch.exp(lse - safe).unsqueeze(-1) + bout * torch.exp(blse - safe).unsqueeze(-1)
                lse = new
            if nxt is not None:
                kv = _wait(nxt)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.rank, ctx.n, ctx.qpos, ctx.kv_positions = group, rank, n, qpos, kv_positions
        ctx.causal, ctx.scale = causal, scale
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, rank, n, scale = ctx.group, ctx.rank, ctx.n, ctx.scale
        b, h, tl, d = k.shape
        qf, do = q.float(), dout.float()
        delta = (do * out.float()).sum(-1, keepdim=True)               # Dr = rowsum(dO * O)
        lse_safe = _finite(lse).unsqueeze(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        dkv = torch.zeros(kv.numel(), dtype=torch.float32, device=q.device)
        kind = _flash(q)
        for i in range(n):
            nxt = _rotate(kv, group, rank, n) if i < n - 1 else None
            src = (rank - i) % n
            mask, skip = _block_mask(ctx.qpos, ctx.kv_positions[src], ctx.causal)
            pairs = _pairs(ctx.qpos, ctx.kv_positions[src], ctx.causal) if kind and not skip else None
            if pairs is not None:
                kb, vb = kv.view(2, b, h, tl, d)
                dkb, dvb = dkv.view(2, b, h, tl, d)           # views: the accumulator updated in place
                for qs, ks, diag in pairs:
                    gq, gk, gv = _flash_backward(kind, dout[:, :, qs], q[:, :, qs], kb[:, :, ks], vb[:, :, ks],
                                                 out[:, :, qs], lse[:, :, qs], diag, scale)
                    dq[:, :, qs] += gq.float()
                    dkb[:, :, ks] += gk.float()
                    dvb[:, :, ks] += gv.float()
            elif not skip:
                kb, vb = kv.float().view(2, b, h, tl, d)
                s = torch.matmul(qf, kb.transpose(-1, -2)) * scale
                p = torch.exp(s - lse_safe)
                if mask is not None:
                    p = p.masked_fill(mask.to(p.device), 0.0)
                p = torch.where(torch.isinf(lse).unsqueeze(-1), torch.zeros_like(p), p)
                dkb, dvb = dkv.view(2, b, h, tl, d)
                dvb = dvb + torch.matmul(p.transpose(-1, -2), do)
                ds = p * (torch.matmul(do, vb.transpose(-1, -2)) - delta)
                dq = dq + torch.matmul(ds, kb) * scale
                dkb = dkb + torch.matmul(ds.transpose(-1, -2), qf) * scale
                dkv = torch.cat([dkb.reshape(-1), dvb.reshape(-1)])
            if n > 1:
                dkv = _wait(_rotate(dkv, group, rank, n))               # to the next holder of block src
            if nxt is not None:
                kv = _wait(nxt)
        dk, dv = dkv.view(2, b, h, tl, d)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 7


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, rank: int, n: int,
                   positions: torch.Tensor, all_positions: Optional[Sequence[torch.Tensor]] = None,
                   causal: bool, scale: Optional[float] = None) -> torch.Tensor:
    """This rank's rows of the full-sequence attention by ring attention (see the module docstring).
    ``all_positions`` (every cp rank's positions) may be left out when the chunks are contiguous or
    zig-zag (inferred from ``positions``)."""
    positions, all_positions = _check_inputs(q, k, v, n, rank, positions, all_positions, "ring_attention")
    if all_positions is None:
        all_positions = _infer_all_positions(positions, n, rank) if causal else [positions] * n
    _check_group(group, rank, n, "ring_attention")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, group, rank, n, positions, list(all_positions), causal, scale)


def _check_group(group, rank: int, n: int, engine: str) -> None:
    if n == 1:
        return
    import torch.distributed as dist

    size, me = dist.get_world_size(group), dist.get_rank(group)
    if size != n or me != rank:
        raise ValueError(f"{engine}: the cp group has {size} ranks and this is its rank {me}, but "
                         f"n={n}, rank={rank} were passed: pass the group of the {n} cp ranks ordered "
                         f"by cp coordinate")


# ---- Ulysses --------------------------------------------------------------------------------

def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, rank: int, n: int,
                      positions: torch.Tensor, all_positions: Sequence[torch.Tensor], causal: bool,
                      scale: Optional[float] = None) -> torch.Tensor:
    """This rank's rows of the full-sequence attention by Ulysses: all_to_all from sequence shards to
    head shards, full-sequence SDPA on H/n heads, all_to_all back (see the module docstring)."""
    if all_positions is None:
        raise ValueError("ulysses_attention: pass all_positions (every cp rank's positions)")
    positions, all_positions = _check_inputs(q, k, v, n, rank, positions, all_positions,
                                             "ulysses_attention")
    b, h, tl, d = q.shape
    if h % n:
        raise ValueError(f"ulysses_attention: {h} heads do not split over cp={n}: use a cp degree that "
                         f"divides the number of heads (or ring attention)")
    _check_group(group, rank, n, "ulysses_attention")
    if n == 1:
        order = torch.argsort(positions).to(q.device)
        out = F.scaled_dot_product_attention(q[:, :, order], k[:, :, order], v[:, :, order],
                                             is_causal=causal, scale=scale)
        return out[:, :, torch.argsort(order)]
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    hn = h // n
    # send buffer (n, 3, B, H/n, Tl, D): slot j = head group j of q|k|v, for cp rank j
    qkv = torch.stack([q, k, v]).view(3, b, n, hn, tl, d).permute(2, 0, 1, 3, 4, 5).contiguous()
    got = _wait(all_to_all_single_autograd(qkv.view(-1), None, None, group)).view(n, 3, b, hn, tl, d)
    # slot j = cp rank j's tokens of this rank's head group -> (3, B, H/n, n*Tl, D), gathered order
    full = got.permute(1, 2, 3, 0, 4, 5).reshape(3, b, hn, n * tl, d)
    order = torch.argsort(torch.cat(list(all_positions))).to(q.device)   # gathered -> natural
    qs, ks, vs = full[:, :, :, order].unbind(0)
    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
    o = o[:, :, torch.argsort(order)]                                     # natural -> gathered
    send = o.reshape(b, hn, n, tl, d).permute(2, 0, 1, 3, 4).contiguous()  # slot j: cp rank j's tokens
    back = _wait(all_to_all_single_autograd(send.view(-1), None, None, group)).view(n, b, hn, tl, d)
    return back.permute(1, 0, 2, 3, 4).reshape(b, h, tl, d)               # slot j = head group j


# ---- traffic --------------------------------------------------------------------------------

def ring_traffic(q_shape: Sequence[int], kv_shape: Sequence[int], n: int, elem_bytes: int, *,
                 acc_bytes: int = 4) -> dict[str, list[tuple[str, int]]]:
    """The collectives one rank issues in ring attention, per phase, in issue order, as (kind,
    nbytes) with nbytes = the send buffer (autopar's all_to_all convention). ``elem_bytes``: k's
    element size; ``acc_bytes``: the dK|dV accumulator's (fp32)."""
    if n <= 1:
        return {"forward": [], "backward": []}
    e = math.prod(kv_shape)
    kv = ("all_to_all", 2 * e * elem_bytes)
    dkv = ("all_to_all", 2 * e * acc_bytes)
    return {"forward": [kv] * (n - 1), "backward": [kv, dkv] * (n - 1) + [dkv]}


def ulysses_traffic(q_shape: Sequence[int], kv_shape: Sequence[int], n: int,
                    elem_bytes: int) -> dict[str, list[tuple[str, int]]]:
    """As ``ring_traffic`` for Ulysses: q|k|v in, the output back; backward the reverse."""
    if n <= 1:
        return {"forward": [], "backward": []}
    eq, ekv = math.prod(q_shape), math.prod(kv_shape)
    qkv = ("all_to_all", (eq + 2 * ekv) * elem_bytes)
    o = ("all_to_all", eq * elem_bytes)
    return {"forward": [qkv, o], "backward": [o, qkv]}
