"""Collective times from the NCCL ring bus-bandwidth algebra, and which link a mesh axis crosses.

Convention (nccl-tests, see ``reference/nccl_busbw_reference.csv`` and NCCL's
PERFORMANCE.md): for a collective on ``nbytes`` and ``n`` ranks,

    algbw = nbytes / time,        busbw = algbw * bus_factor(kind, n)

so ``time = bus_factor * nbytes / busbw`` (+ latency). ``busbw`` is a property of the link, the
same for every collective (that is the point of the convention; a link measured otherwise, gloo's
by ``autopar calibrate``, carries each kind's own relative busbw: ``LinkSpec.busbw_scale``):

    kind            bus_factor     nbytes means
    all_reduce      2(n-1)/n       the tensor (same size in and out)
    all_gather      (n-1)/n        the OUTPUT (n x each rank's shard)
    reduce_scatter  (n-1)/n        the INPUT (n x each rank's output shard)
    all_to_all      (n-1)/n        each rank's send buffer (= its receive buffer)
    p2p             1              the message (broadcast is also 1)

Latency term (ring): a ring all-gather / reduce-scatter takes n-1 steps, so (n-1)*latency; a
ring all-reduce is reduce-scatter + all-gather, 2(n-1)*latency; all-to-all is n-1 pairwise steps,
(n-1)*latency; p2p one latency. Every collective adds the link's ``call_latency_s`` once (its fixed
cost: 0 unless ``autopar calibrate`` measured it). n == 1 -> 0.

All-reduce on NCCL (a link with ``all_reduce_tree``, every GPU family's): NCCL 2.4+ runs it on two
binary trees ("Massively Scale Your Deep Learning Training with NCCL 2.4", NVIDIA, 2019: logarithmic
latency, and the two trees together carry the ring's full bandwidth), so it costs 2 ceil(log2 n)
steps (up and down a tree) and the ring's bandwidth term. NCCL picks ring or tree per size with its
own tuning model; at equal bandwidth the tree is never slower here, and the ring's 2(n-1) steps
would price DDP's 25 MiB buckets over 1,024 ranks at 16 ms of latency each (8 us a hop) where the
tree has 20 steps. Inside one node NCCL's tree is a chain (2(k-1) steps, as a ring's) and H100's
NVLS a reduction in the switch (a few steps): both priced at 2 ceil(log2 k), a simplification of
a few microseconds an all-reduce. All-gather and reduce-scatter stay rings (NCCL's PAT algorithm,
2.23+, is logarithmic only at one GPU per node). gloo (CPU ranks) runs rings.
"""
from __future__ import annotations

import math
from dataclasses import replace

from autopar.cost.hardware import ClusterSpec, LinkSpec

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
SCALAR_BYTES = 4        # one fp32 value: the loss, a mean's count (their all-reduces and broadcast)


def bus_factor(kind: str, n: int) -> float:
    """busbw / algbw for ``kind`` on ``n`` ranks (nccl-tests convention); "broadcast" and "p2p" -> 1."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, got n={n}")
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind in ("p2p", "broadcast"):
        return 1.0
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS + ('broadcast',)}")


def _ring_s(kind: str, nbytes: float, n: int, link: LinkSpec, steps: int) -> float:
    if nbytes < 0:
        raise ValueError(f"{kind}: nbytes must be >= 0, got {nbytes}")
    if n == 1:
        return 0.0
    return link.latency_of(steps) + bus_factor(kind, n) * nbytes / link.busbw_of(kind)


def all_reduce_s(nbytes: float, n: int, link: LinkSpec) -> float:
    """All-reduce of an ``nbytes`` tensor on ``n`` ranks: steps*lat + 2(n-1)/n * nbytes / busbw, with
    2 ceil(log2 n) steps on a link whose all-reduces take trees (NCCL: ``link.all_reduce_tree``),
    else a ring's 2(n-1) (module docstring)."""
    steps = 2 * math.ceil(math.log2(n)) if link.all_reduce_tree and n > 1 else 2 * (n - 1)
    return _ring_s("all_reduce", nbytes, n, link, steps)


def all_gather_s(output_nbytes: float, n: int, link: LinkSpec) -> float:
    """All-gather producing ``output_nbytes`` on every rank: (n-1)*lat + (n-1)/n * output / busbw."""
    return _ring_s("all_gather", output_nbytes, n, link, n - 1)


def reduce_scatter_s(input_nbytes: float, n: int, link: LinkSpec) -> float:
    """Reduce-scatter of an ``input_nbytes`` tensor: (n-1)*lat + (n-1)/n * input / busbw."""
    return _ring_s("reduce_scatter", input_nbytes, n, link, n - 1)


def all_to_all_s(nbytes: float, n: int, link: LinkSpec) -> float:
    """All-to-all where each rank sends ``nbytes`` in total: (n-1)*lat + (n-1)/n * nbytes / busbw."""
    return _ring_s("all_to_all", nbytes, n, link, n - 1)


def p2p_s(nbytes: float, link: LinkSpec) -> float:
    """One send/recv of ``nbytes``: call latency + lat + nbytes / busbw (0 bytes -> 0)."""
    if nbytes < 0:
        raise ValueError(f"p2p: nbytes must be >= 0, got {nbytes}")
    return 0.0 if nbytes == 0 else link.latency_of(1) + nbytes / link.busbw_of("p2p")


def broadcast_s(nbytes: float, n: int, link: LinkSpec, binomial: bool) -> float:
    """Broadcast of ``nbytes`` from one rank to ``n``. ``binomial``: gloo, whose broadcast is a binomial
    tree (``gloo/broadcast.cc``: ceil(log2 n) rounds, each a send to one more rank per holder);
    else NCCL's, a ring from the root: n-1 hops, the message pipelined along it (bus factor 1)."""
    if nbytes < 0:
        raise ValueError(f"broadcast: nbytes must be >= 0, got {nbytes}")
    if n == 1 or nbytes == 0:
        return 0.0
    hops = math.ceil(math.log2(n)) if binomial else n - 1
    return link.latency_of(hops) + (hops if binomial else 1) * nbytes / link.busbw_of("p2p")


def collective_s(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    """Dispatch by ``kind`` in COLLECTIVE_KINDS (nbytes as in the module docstring's table)."""
    if kind == "all_reduce":
        return all_reduce_s(nbytes, n, link)
    if kind == "all_gather":
        return all_gather_s(nbytes, n, link)
    if kind == "reduce_scatter":
        return reduce_scatter_s(nbytes, n, link)
    if kind == "all_to_all":
        return all_to_all_s(nbytes, n, link)
    if kind == "p2p":
        return 0.0 if n == 1 else p2p_s(nbytes, link)
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")


def overlapped_cost(comm_s: float, window_s: float, overlapped: bool, slowdown: float) -> float:
    """``exposed + contention`` of a collective of ``comm_s`` beside ``window_s`` of compute: the part
    the window cannot hide, plus ``slowdown`` x the hidden part (``ClusterSpec.overlap_slowdown``;
    the rule of ``solver/runtime_profile.py``)."""
    if not overlapped:
        return comm_s
    hidden = min(comm_s, window_s)
    return comm_s - hidden + slowdown * hidden


def axis_link(cluster: ClusterSpec, mesh_shape: tuple[int, ...], axis: int, *,
              nic_aggregation: bool = False) -> LinkSpec:
    """The link a group along mesh ``axis`` crosses.

    Ranks of one pipeline stage are laid out row-major over ``mesh_shape`` (last axis fastest:
    its groups are adjacent ranks); stages start at multiples of the stage size. A group along
    ``axis`` has stride ``prod(mesh_shape[axis+1:])`` and spans a block of ``stride*size``
    ranks starting at a multiple of that block; it stays inside one node iff
    ``gpus_per_node % (stride*size) == 0`` -> ``cluster.intra``; otherwise ``cluster.inter``.

    Simplification (default): a group that spans nodes runs at the per-GPU inter-node busbw (one
    NIC per GPU). That is exact for groups with one member per node (e.g. dp across nodes with
    tp=8 inside) and pessimistic for groups with k > 1 members per node, where NCCL spreads rings
    over k NICs. ``nic_aggregation=True`` models that: busbw = min(intra, k * inter) with k the
    group's members per node (the node's NICs are shared by the gpus_per_node/k concurrent
    groups of this axis); e.g. DGX-A100 8 NICs -> 192 GB/s, as nccl_busbw_reference.csv reports.
    """
    if not 0 <= axis < len(mesh_shape):
        raise ValueError(f"axis {axis} out of range for mesh_shape {mesh_shape}")
    if any(s < 1 for s in mesh_shape):
        raise ValueError(f"mesh_shape {mesh_shape} has a non-positive size")
    size = mesh_shape[axis]
    stride = math.prod(mesh_shape[axis + 1:])
    span = stride * size
    if size == 1 or (span <= cluster.gpus_per_node and cluster.gpus_per_node % span == 0):
        return cluster.intra
    if not nic_aggregation:
        return cluster.inter
    per_node = max(1, cluster.gpus_per_node // stride) if stride < cluster.gpus_per_node else 1
    per_node = min(per_node, size)
    if per_node <= 1:
        return cluster.inter
    bw = min(cluster.intra.busbw_Bps, per_node * cluster.inter.busbw_Bps)
    return replace(cluster.inter, name=f"{cluster.inter.name}x{per_node}nics", busbw_Bps=bw,
                   source=f"{cluster.inter.source}; aggregated over {per_node} NICs per node (nic_aggregation)")


def stage_link(cluster: ClusterSpec, stage_size: int) -> LinkSpec:
    """Link for pipeline p2p between adjacent stages of ``stage_size`` GPUs each: ``inter`` if a
    stage fills a node (stage_size >= gpus_per_node), else ``intra`` (stages packed into nodes;
    a boundary that falls inside a node is the common case and is what we model)."""
    if stage_size < 1:
        raise ValueError(f"stage_size must be >= 1, got {stage_size}")
    return cluster.inter if stage_size >= cluster.gpus_per_node else cluster.intra
