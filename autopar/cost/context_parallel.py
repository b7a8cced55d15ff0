"""Context parallelism of one attention layer per micro-batch: ring attention vs DeepSpeed-Ulysses.

Sources: ``shared/reference/parallelism_facts.md`` ("facts §x"). cp = n ranks, full sequence s,
batch b, heads a, kv heads a_kv, head dim d, B bytes per element; every rank holds s/n tokens.

Ring (Liu et al. 2023, facts §2b; RFA ring-flash-attention's loop): the K|V block of a rank is
``2 b a_kv (s/n) d`` elements. Forward: n compute steps, the first n-1 each overlapped with one
rotation of K|V. Backward (RA rotates K, V, dK, dV, facts §2b): n compute steps; K|V rotate n-1
times and dK|dV n times (each block's gradient travels with it and goes home at the end):

    step 0: K|V;  steps 1..n-2: K|V + dK|dV;  step n-1: dK|dV;  after the last step: dK|dV home

Each overlapped step exposes max(0, transfer - block compute) and, for the part it hides, the
compute's slowdown beside it (``ClusterSpec.overlap_slowdown`` x hidden, as the data-parallel
overlap prices it: ``collectives.overlapped_cost``; measured 0.59-0.84 on 4 gloo ranks sharing 2
cores, where the transfer needs a core the compute is using); the final dK|dV send is fully
exposed. Block compute = the rank's attention time / n (causal masks balanced by zig-zag, facts
§2b "Load balance"). Times: ``collectives.p2p_s``; a ring that leaves the node runs at the slowest
hop (the per-GPU NIC).

Ulysses (Jacobs et al. 2023, facts §2c): all-to-all of q, k, v and o forward ("3Nh (QKV) + Nh
(output)"), of dO, dQ, dK, dV backward ("backward is symmetric" [D]); each rank sends (n-1)/n of
its ``b x heads x (s/n) x d`` tensor; not overlapped. heads % n == 0 is required (facts §2c
Constraints). With GQA and a_kv % n != 0, K and V are repeated to lcm(a_kv, n) heads before the
all-to-all (DeepSpeed's GQA path, facts §2c; sizing derived here).

Attention FLOPs per rank (forward, full count 4 b a s^2 d / n; causal halves the work; backward
2.5x, ``compute.backward_factor("attention")``). Both kinds do the same FLOPs per rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from autopar.cost.collectives import all_to_all_s, axis_link, overlapped_cost, p2p_s
from autopar.cost.compute import backward_factor
from autopar.cost.hardware import ClusterSpec, GPUSpec, LinkSpec

CP_KINDS = ("ring", "ulysses")


def _check(cp: int, seq: int, **sizes: float) -> None:
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if seq % cp:
        raise ValueError(f"seq={seq} is not divisible by cp={cp}")
    bad = {k: v for k, v in sizes.items() if v <= 0}
    if bad:
        raise ValueError(f"sizes must be positive: {bad}")


def attention_flops_per_rank(cp: int, seq: int, batch: int, heads: int, head_dim: int, *, causal: bool = True,
                             backward: bool = False) -> float:
    """FLOPs one rank does: 4 b a s^2 d / cp forward (QK^T and PV), x 1/2 causal, x 2.5 backward."""
    _check(cp, seq, batch=batch, heads=heads, head_dim=head_dim)
    flops = 4.0 * batch * heads * seq * seq * head_dim / cp * (0.5 if causal else 1.0)
    return flops * (backward_factor("attention") if backward else 1.0)


def ring_block_compute_s(gpu: GPUSpec, cp: int, seq: int, batch: int, heads: int, head_dim: int, *,
                         causal: bool = True, dtype: str = "bfloat16") -> tuple[float, float]:
    """(forward, backward) seconds of one ring step: the rank's attention / cp. Priced as
    ``compute.op_time_s`` prices attention: FULL count / (peak x ``gpu.attention_eff(causal)``)."""
    full = attention_flops_per_rank(cp, seq, batch, heads, head_dim, causal=False)
    fwd = full / cp / (gpu.peak_flops_for(dtype) * gpu.attention_eff(causal))
    return fwd, fwd * backward_factor("attention")


def cp_link(cluster: ClusterSpec, cp: int, *, nic_aggregation: bool = False) -> LinkSpec:
    """The link of a cp group of adjacent ranks: inside a node if it fits, else the NIC."""
    return axis_link(cluster, (cp,), 0, nic_aggregation=nic_aggregation)


@dataclass(frozen=True)
class RingTraffic:
    block_bytes: float       # one K|V block: 2 b a_kv (s/n) d B
    forward_bytes: float     # per rank sent: (n-1) blocks
    backward_bytes: float    # (n-1) K|V + n dK|dV blocks
    grad_block_bytes: float = 0.0   # one dK|dV block when it differs (fp32 accumulators); 0: block_bytes

    @property
    def total_bytes(self) -> float:
        return self.forward_bytes + self.backward_bytes


def ring_traffic(cp: int, seq: int, batch: int, kv_heads: int, head_dim: int, bytes_per_elem: float = 2) -> RingTraffic:
    _check(cp, seq, batch=batch, kv_heads=kv_heads, head_dim=head_dim, bytes_per_elem=bytes_per_elem)
    block = 2.0 * batch * kv_heads * (seq // cp) * head_dim * bytes_per_elem
    if cp == 1:
        return RingTraffic(block, 0.0, 0.0)
    return RingTraffic(block, (cp - 1) * block, (cp - 1) * block + cp * block)


@dataclass(frozen=True)
class RingTime:
    forward_comm_s: float      # all transfers, as if alone
    backward_comm_s: float
    forward_exposed_s: float   # what overlap with the block compute leaves
    backward_exposed_s: float

    @property
    def exposed_s(self) -> float:
        return self.forward_exposed_s + self.backward_exposed_s


def ring_time(traffic: RingTraffic, cp: int, link: LinkSpec, fwd_block_compute_s: float,
              bwd_block_compute_s: float, slowdown: float = 0.0) -> RingTime:
    """Transfers of the schedule in the module docstring and their exposed part, with ``slowdown``
    x the hidden part (the cluster's ``overlap_slowdown``)."""
    if cp == 1:
        return RingTime(0.0, 0.0, 0.0, 0.0)
    kv, dkv = traffic.block_bytes, traffic.grad_block_bytes or traffic.block_bytes
    one, grad = p2p_s(kv, link), p2p_s(dkv, link)
    fwd = [one] * (cp - 1)
    # overlapped with backward steps 0..n-1: K|V (step 0), K|V + dK|dV, ..., dK|dV (step n-1)
    bwd = [one] + [p2p_s(kv + dkv, link)] * (cp - 2) + [grad]
    tail = grad                                        # last dK|dV home: nothing left to hide behind

    return RingTime(sum(fwd), sum(bwd) + tail,
                    sum(overlapped_cost(t, fwd_block_compute_s, True, slowdown) for t in fwd),
                    sum(overlapped_cost(t, bwd_block_compute_s, True, slowdown) for t in bwd) + tail)


@dataclass(frozen=True)
class UlyssesTraffic:
    all_to_all_bytes: tuple[float, ...]   # send buffer per rank: q, k, v, o (backward dO, dQ, dK, dV)
    kv_heads_sent: int                    # a_kv, or lcm(a_kv, cp) when K|V are repeated
    cp: int

    @property
    def forward_bytes(self) -> float:
        """Bytes each rank sends forward: (n-1)/n of every buffer (the rest stays local)."""
        return sum(self.all_to_all_bytes) * (self.cp - 1) / self.cp

    @property
    def backward_bytes(self) -> float:
        return self.forward_bytes

    @property
    def total_bytes(self) -> float:
        return self.forward_bytes + self.backward_bytes


def ulysses_traffic(cp: int, seq: int, batch: int, heads: int, kv_heads: int, head_dim: int,
                    bytes_per_elem: float = 2) -> UlyssesTraffic:
    _check(cp, seq, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, bytes_per_elem=bytes_per_elem)
    if heads % cp:
        raise ValueError(f"Ulysses needs the heads divisible by the cp degree: heads={heads}, cp={cp}; "
                         f"use ring attention or a cp that divides {heads}")
    kv_sent = kv_heads if kv_heads % cp == 0 else math.lcm(kv_heads, cp)
    per_head = batch * (seq // cp) * head_dim * bytes_per_elem
    return UlyssesTraffic((heads * per_head, kv_sent * per_head, kv_sent * per_head, heads * per_head), kv_sent, cp)


def ulysses_time_s(traffic: UlyssesTraffic, cp: int, link: LinkSpec) -> tuple[float, float]:
    """(forward, backward) seconds of the four all-to-alls each way (not overlapped)."""
    one_way = sum(all_to_all_s(nb, cp, link) for nb in traffic.all_to_all_bytes)
    return one_way, one_way


@dataclass(frozen=True)
class CPChoice:
    kind: str                     # "ring" | "ulysses": the one with less exposed communication
    ring_s: float                 # exposed ring time, forward + backward
    ulysses_s: Optional[float]    # all-to-all time, forward + backward; None when heads % cp != 0
    ring: RingTime
    compute_s: float              # the rank's attention forward + backward (same for both kinds)
    note: str = ""


def best_cp_kind(cluster: ClusterSpec, cp: int, seq: int, batch: int, heads: int, kv_heads: int, head_dim: int, *,
                 bytes_per_elem: float = 2, causal: bool = True, dtype: str = "bfloat16",
                 nic_aggregation: bool = False) -> CPChoice:
    """Ring vs Ulysses for one attention layer per micro-batch on ``cluster`` (cp adjacent ranks)."""
    link = cp_link(cluster, cp, nic_aggregation=nic_aggregation)
    fwd_c, bwd_c = ring_block_compute_s(cluster.gpu, cp, seq, batch, heads, head_dim, causal=causal, dtype=dtype)
    ring = ring_time(ring_traffic(cp, seq, batch, kv_heads, head_dim, bytes_per_elem), cp, link, fwd_c, bwd_c,
                     cluster.overlap_slowdown)
    compute = cp * (fwd_c + bwd_c)
    try:
        uly = sum(ulysses_time_s(ulysses_traffic(cp, seq, batch, heads, kv_heads, head_dim, bytes_per_elem), cp, link))
    except ValueError as e:
        return CPChoice("ring", ring.exposed_s, None, ring, compute, note=str(e))
    kind = "ulysses" if uly < ring.exposed_s else "ring"
    return CPChoice(kind, ring.exposed_s, uly, ring, compute)
