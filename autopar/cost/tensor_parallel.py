"""Tensor-parallel families as cost formulas: Megatron 1-D, SUMMA 2-D, Tesseract 2.5-D, 3-D.

Sources: ``shared/reference/parallelism_facts.md`` (below "facts §x.y"). Tokens N = batch x seq;
the layer's four linears Y = X W are qkv (h -> 3h), proj (h -> h), fc1 (h -> f), fc2 (f -> h),
f = ffn (4h by default). Per linear with X [N, k], W [k, n], per layer per micro-batch:

    family  grid          X / W per device        collectives (count x tensor)
    1d      t             N k (repl.) / k n / t   layer: fwd 2 AR(N h), bwd 2 AR(N h); SP: AG+RS pairs
    2d      q x q         N k / q^2 / k n / q^2   fwd q Bcast_row(Nk/q^2) + q Bcast_col(kn/q^2);
                                                  bwd the same broadcasts + q Reduce_row(Nk/q^2)
                                                  + q Reduce_col(kn/q^2)
    2.5d    d x q x q     N k / (d q^2) / kn/q^2  2d on N/d tokens per depth layer + AR_dep(kn/q^2)
    3d      q x q x q     N k / q^3 / k n / q^3   fwd AG_in(Nk/q^2) AG_w(kn/q^2) RS_out(Nn/q^2);
                                                  bwd AG_out(Nn/q^2) RS_in(Nk/q^2) RS_w(kn/q^2)

Bytes per device (``Collective.traffic_bytes``: all-reduce 2(n-1)/n of the tensor, the others
(n-1)/n; a broadcast / reduce of q steps moves (q-1)/q per device on average because each rank is
the root once) give facts §1.3: 1d 8 N h (t-1)/t per layer; 2d 3(q-1)(Nk + kn)/q^2 per linear;
3d 2(q-1)/q^3 (Nk + kn + Nn). Times: ``autopar.cost.collectives`` (broadcast / reduce: one pass,
bus factor 1, (n-1) latencies). Mesh layout: the row axis is innermost (adjacent ranks), then
column, then depth (2.5d src offsets tesseract_dim**2 * dep_rank, facts §1.2; the row/column order
is my reading of CAI's initializers, UNVERIFIED); ``layer_comm_time`` places the family's mesh
innermost in the cluster, so inner axes fill a node first (``collectives.axis_link``).

Derived here, not in the papers: when the token split of a 2d/2.5d/3d family falls on the
sequence (batch not divisible by it; GPT runs use batch 1), attention needs the other shards'
K and V: an all-gather of K|V forward and a reduce-scatter of dK|dV backward over the
sequence-split ranks are added ("seq-split attention"). Left out: biases and LayerNorm
parameters (O(h)), bias collectives, SUMMA staging buffers, Megatron-SP's backward re-gather.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

from autopar.cost.collectives import axis_link, bus_factor, collective_s
from autopar.cost.hardware import ClusterSpec, LinkSpec

TP_MODES = ("1d", "2d", "2.5d", "3d")
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def parse_tp_mode(text: str) -> str:
    """"1d" | "2d" | "2.5d" | "3d" (case and spaces ignored; "2p5d" is read as "2.5d")."""
    key = str(text).strip().lower().replace("2p5d", "2.5d").replace("-", "")
    if key not in TP_MODES:
        raise ValueError(f"unknown tensor-parallel mode {text!r}; choose one of {', '.join(TP_MODES)}")
    return key


@dataclass(frozen=True)
class TPFamily:
    """One family shape: ``mode`` with side ``q`` (1d: q is t) and, for 2.5d, depth ``d``."""
    mode: str
    q: int
    d: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", parse_tp_mode(self.mode))
        if self.q < 1 or self.d < 1:
            raise ValueError(f"{self.mode}: q={self.q} and d={self.d} must be >= 1")
        if self.d != 1 and self.mode != "2.5d":
            raise ValueError(f"{self.mode}: only 2.5d has a depth; got d={self.d}")

    @property
    def mesh(self) -> tuple[tuple[str, int], ...]:
        """(axis name, size), outermost first; the last axis is adjacent ranks."""
        q = self.q
        return {"1d": (("tp", q),), "2d": (("col", q), ("row", q)),
                "2.5d": (("dep", self.d), ("col", q), ("row", q)),
                "3d": (("z", q), ("y", q), ("x", q))}[self.mode]

    @property
    def ranks(self) -> int:
        return math.prod(size for _, size in self.mesh)

    @property
    def token_split(self) -> tuple[str, ...]:
        """Mesh axes the tokens (rows of X) are split over (facts §1.1)."""
        return {"1d": (), "2d": ("col",), "2.5d": ("dep", "col"), "3d": ("z", "y")}[self.mode]

    def __str__(self) -> str:
        if self.mode == "1d":
            return f"1d t={self.q}"
        return f"{self.mode} " + "x".join(str(size) for _, size in reversed(self.mesh))


def _iroot(n: int, k: int) -> Optional[int]:
    r = round(n ** (1.0 / k))
    return next((c for c in (r - 1, r, r + 1) if c >= 1 and c ** k == n), None)


def tp_shapes(tp: int) -> list[TPFamily]:
    """Every family shape with ``tp`` ranks: 1d t=tp; 2d q*q; 2.5d q*q*d with q >= 2, d >= 2
    (d = 1 is 2d, q = 1 is plain data parallelism); 3d q^3."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    out = [TPFamily("1d", tp)]
    q2 = _iroot(tp, 2)
    if q2 is not None and q2 > 1:
        out.append(TPFamily("2d", q2))
    out += [TPFamily("2.5d", q, tp // (q * q)) for q in range(2, math.isqrt(tp) + 1)
            if tp % (q * q) == 0 and tp // (q * q) >= 2]
    q3 = _iroot(tp, 3)
    if q3 is not None and q3 > 1:
        out.append(TPFamily("3d", q3))
    return out


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of one kind per layer per micro-batch. ``nbytes`` follows the
    collectives.py convention (all-gather: output; reduce-scatter: input; broadcast / reduce: the
    block). ``per_step``: a gradient reduction that gradient accumulation pays once per step."""
    kind: str
    axes: tuple[str, ...]
    group: int
    nbytes: float
    count: int
    phase: str          # "fwd" | "bwd"
    what: str
    per_step: bool = False

    @property
    def traffic_bytes(self) -> float:
        """Bytes each device sends (= receives), averaged over the group, for all ``count``."""
        factor = (self.group - 1) / self.group if self.kind in ("broadcast", "reduce") \
            else bus_factor(self.kind, self.group)
        return self.count * factor * self.nbytes

    def time_s(self, link: LinkSpec) -> float:
        """All ``count`` of them, serial, on ``link``."""
        if self.group == 1:
            return 0.0
        if self.kind in ("broadcast", "reduce"):   # pipelined ring: bus factor 1, n-1 hops
            one = link.latency_of(self.group - 1) + self.nbytes / link.busbw_Bps
        else:
            one = collective_s(self.kind, self.nbytes, self.group, link)
        return self.count * one


@dataclass(frozen=True)
class LayerComm:
    family: TPFamily
    collectives: tuple[Collective, ...]
    notes: tuple[str, ...] = ()

    def bytes(self, phase: Optional[str] = None) -> float:
        """Traffic bytes per device per layer per micro-batch (``phase`` "fwd"/"bwd" or both)."""
        return sum(c.traffic_bytes for c in self.collectives if phase in (None, c.phase))


@dataclass(frozen=True)
class LayerDims:
    hidden: int
    seq: int
    batch: int
    heads: int
    ffn: int
    bytes_per_elem: float

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def linears(self) -> tuple[tuple[str, int, int], ...]:
        h, f = self.hidden, self.ffn
        return (("qkv", h, 3 * h), ("proj", h, h), ("fc1", h, f), ("fc2", f, h))


def _dims(hidden, seq, batch, heads, ffn, bytes_per_elem) -> LayerDims:
    d = LayerDims(hidden, seq, batch, heads, ffn or 4 * hidden, bytes_per_elem)
    if min(hidden, seq, batch, heads, d.ffn) < 1 or bytes_per_elem <= 0:
        raise ValueError(f"layer sizes must be positive: {d}")
    return d


def _check_divisible(fam: TPFamily, dims: LayerDims) -> list[str]:
    heads_split = fam.q   # 1d: t; 2d / 2.5d: the column index; 3d: one axis of q
    notes = []
    if dims.heads % heads_split:
        notes.append(f"heads={dims.heads} not divisible by {heads_split}: no real {fam} layout "
                     f"(formula extrapolated)")
    return notes


def layer_comm(family: TPFamily, *, hidden: int, seq: int, batch: int, heads: int, ffn: Optional[int] = None,
               bytes_per_elem: float = 2, sequence_parallel: bool = False) -> LayerComm:
    """Collectives ``family`` issues per transformer layer per micro-batch (module docstring)."""
    dm = _dims(hidden, seq, batch, heads, ffn, bytes_per_elem)
    B, N, h, q, d = bytes_per_elem, dm.tokens, hidden, family.q, family.d
    notes = _check_divisible(family, dm)
    cs: list[Collective] = []

    def add(kind, axes, group, nbytes, count, phase, what, per_step=False):
        cs.append(Collective(kind, axes, group, nbytes, count, phase, what, per_step))

    if family.mode == "1d":
        # facts §1.3: "all-reduced among t model replicas twice each in the forward and backward
        # pass for each layer" (MLM-paper §3.2, ops g and f of MLM mappings.py, facts §1.2)
        if not sequence_parallel:
            add("all_reduce", ("tp",), q, N * h * B, 2, "fwd", "g: after proj and fc2")
            add("all_reduce", ("tp",), q, N * h * B, 2, "bwd", "f: at the qkv and fc1 inputs")
        else:   # facts §1.2 / §2d: each all-reduce becomes an all-gather + reduce-scatter pair
            add("all_gather", ("tp",), q, N * h * B, 2, "fwd", "SP gather before qkv and fc1")
            add("reduce_scatter", ("tp",), q, N * h * B, 2, "fwd", "SP scatter after proj and fc2")
            add("all_gather", ("tp",), q, N * h * B, 2, "bwd", "grad of the SP scatters")
            add("reduce_scatter", ("tp",), q, N * h * B, 2, "bwd", "grad of the SP gathers")
        return LayerComm(family, tuple(cs), tuple(notes))
    if family.mode in ("2d", "2.5d"):
        # facts §1.2 (Matmul_AB_2D / ABT / ATB): q SUMMA steps per GEMM; 2.5d runs them inside
        # each depth layer on N/d tokens (facts §1.1 X [N/(dq), k/q]), W replicated over depth.
        for name, k, n in dm.linears:
            x_blk, w_blk = N * k / (d * q * q) * B, k * n / (q * q) * B
            add("broadcast", ("row",), q, x_blk, q, "fwd", f"{name}: X blocks along rows")
            add("broadcast", ("col",), q, w_blk, q, "fwd", f"{name}: W blocks along columns")
            add("broadcast", ("col",), q, w_blk, q, "bwd", f"{name}: dX = dY W^T, W blocks")
            add("reduce", ("row",), q, x_blk, q, "bwd", f"{name}: dX partial sums")
            add("broadcast", ("row",), q, x_blk, q, "bwd", f"{name}: dW = X^T dY, X blocks")
            add("reduce", ("col",), q, w_blk, q, "bwd", f"{name}: dW partial sums")
            if family.mode == "2.5d":
                # facts §1.2 observation + §1.3: Tesseract needs sum over depth of dW; not found in
                # CAI's code, modelled as an all-reduce over the depth axis (like data parallelism)
                add("all_reduce", ("dep",), d, w_blk, 1, "bwd", f"{name}: dW over depth", True)
        # facts §1.2: "LayerNorm: 2 all-reduces along the row group in backward"; the forward's 2
        # (mean, variance over the row-split hidden dim) are derived. Two layernorms per layer.
        stats = N / (d * q) * B
        add("all_reduce", ("row",), q, stats, 4, "fwd", "layernorm statistics")
        add("all_reduce", ("row",), q, stats, 4, "bwd", "layernorm gradient statistics")
    else:
        # facts §1.2 _Linear3D: AG(X, input) AG(W, weight) RS(Y, output); backward AG(dY, output)
        # RS(dX, input) RS(dW, weight); swap_in_out_group after each linear alternates x and z.
        for i, (name, k, n) in enumerate(dm.linears):
            inp, out = (("x",), ("z",)) if i % 2 == 0 else (("z",), ("x",))
            xg, wg, yg = N * k / q**2 * B, k * n / q**2 * B, N * n / q**2 * B
            add("all_gather", inp, q, xg, 1, "fwd", f"{name}: gather X")
            add("all_gather", ("y",), q, wg, 1, "fwd", f"{name}: gather W")
            add("reduce_scatter", out, q, yg, 1, "fwd", f"{name}: scatter Y")
            add("all_gather", out, q, yg, 1, "bwd", f"{name}: gather dY")
            add("reduce_scatter", inp, q, xg, 1, "bwd", f"{name}: scatter dX")
            add("reduce_scatter", ("y",), q, wg, 1, "bwd", f"{name}: scatter dW")
        # layernorm statistics over the axis the hidden dim is split on (z here): derived, as 2d
        add("all_reduce", ("z",), q, N / q**2 * B, 4, "fwd", "layernorm statistics")
        add("all_reduce", ("z",), q, N / q**2 * B, 4, "bwd", "layernorm gradient statistics")
    # Derived (module docstring): sequence-split attention when batch does not cover the token split
    sizes = dict(family.mesh)
    split = math.prod(sizes[a] for a in family.token_split)
    seq_ranks = split // math.gcd(batch, split)
    if seq_ranks > 1:
        head_split = q                                   # hidden columns per device: h / q
        kv = 2 * N / split * seq_ranks * h / head_split * B
        add("all_gather", family.token_split, seq_ranks, kv, 1, "fwd", "seq-split attention: gather K|V")
        add("reduce_scatter", family.token_split, seq_ranks, kv, 1, "bwd", "seq-split attention: dK|dV")
        notes.append(f"batch={batch} < token split {split}: the split falls on the sequence; K|V "
                     f"all-gather over {seq_ranks} ranks added (derived, not in the papers)")
    return LayerComm(family, tuple(cs), tuple(notes))


@dataclass(frozen=True)
class LayerMemory:
    """Bytes per device per layer: weights, saved activations (one micro-batch), and (3d) the
    gathered weights _Linear3D saves for its backward (facts §1.2)."""
    param_bytes: float
    activation_bytes: float
    gathered_weight_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.activation_bytes + self.gathered_weight_bytes


def layer_memory(family: TPFamily, *, hidden: int, seq: int, batch: int, heads: int, ffn: Optional[int] = None,
                 bytes_per_elem: float = 2, sequence_parallel: bool = False) -> LayerMemory:
    """Weights (matrices only) and Korthikanti's saved activations (facts §5: sbh(34 + 5as/h) for
    f = 4h and 2-byte elements, 1-byte dropout masks), split as each family shards them (facts §1.4):
    1d sbh(10 + 24/t + 5as/(ht)), with SP all / t; 2d all / q^2; 2.5d all / (d q^2); 3d the
    linear inputs / q^2 (saved gathered) and the rest / q^3."""
    dm = _dims(hidden, seq, batch, heads, ffn, bytes_per_elem)
    B, N, h, f, a, q, d = bytes_per_elem, dm.tokens, hidden, dm.ffn, heads, family.q, family.d
    weights = sum(k * n for _, k, n in dm.linears) * B
    repl_in = 2 * N * h * B                 # qkv and fc1 inputs (replicated in 1d without SP)
    shard_in = (N * h + N * f) * B          # proj and fc2 inputs
    rest_repl = 2 * N * h * B + 2 * N * h   # 2 layernorm inputs + 2 dropout masks (1 byte)
    rest_shard = 3 * N * h * B + N * f * B  # Q, K, V and the GeLU input
    scores = a * seq * seq * batch * (2 * B + 1)   # softmax out, dropout out, dropout mask
    everything = repl_in + shard_in + rest_repl + rest_shard + scores
    if family.mode == "1d":
        t = q
        act = everything / t if sequence_parallel else repl_in + rest_repl + (shard_in + rest_shard + scores) / t
        return LayerMemory(weights / t, act)
    if family.mode in ("2d", "2.5d"):
        return LayerMemory(weights / q**2, everything / (d * q * q))
    return LayerMemory(weights / q**3, (repl_in + shard_in) / q**2 + (rest_repl + rest_shard + scores) / q**3,
                       weights / q**2)


@dataclass(frozen=True)
class LayerCommTime:
    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


LinkChooser = Callable[[str], LinkSpec]


def family_links(family: TPFamily, cluster: ClusterSpec, *, nic_aggregation: bool = False) -> dict[str, LinkSpec]:
    """The link of each mesh axis when the family's ranks are the innermost of the cluster (inner
    axes fill a node first; ``collectives.axis_link``)."""
    shape = tuple(size for _, size in family.mesh)
    return {name: axis_link(cluster, shape, i, nic_aggregation=nic_aggregation)
            for i, (name, _) in enumerate(family.mesh)}


def layer_comm_time(comm: LayerComm, links: Union[ClusterSpec, LinkChooser], *, nic_aggregation: bool = False,
                    micro_batches: int = 1) -> LayerCommTime:
    """Seconds of the layer's collectives, serial (no overlap). ``links``: a ClusterSpec (see
    ``family_links``) or a function axis name -> LinkSpec. A group over several axes runs at the
    slowest of their links. ``per_step`` collectives are divided by ``micro_batches``."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if isinstance(links, ClusterSpec):
        table = family_links(comm.family, links, nic_aggregation=nic_aggregation)
        choose: LinkChooser = table.__getitem__
    else:
        choose = links
    out = {"fwd": 0.0, "bwd": 0.0}
    for c in comm.collectives:
        link = min((choose(a) for a in c.axes), key=lambda lk: lk.busbw_Bps)
        out[c.phase] += c.time_s(link) / (micro_batches if c.per_step else 1)
    return LayerCommTime(out["fwd"], out["bwd"])
