"""Cost tables on the tp axis for one (t, sp, micro-batch) and the ILP built from them.

Everything here is per micro-batch of ``mbs`` sequences. Node costs: forward compute
(``cost.op_time_s`` on the node's FLOPs and bytes scaled to ``mbs`` and by the strategy's compute
scale), backward = ``backward_factor(kind)`` x forward for nodes that need gradients, plus the
collectives inside the op. Edge costs: forward resharding of the producer's output to the
consumer's input placement, and backward resharding of the consumer's input gradient to the
producer's output-gradient placement (``reshard.py``), after the runtime profile's overlap
(``max(0, comm - window)`` with the window the compute of the matmul on either end of the edge).

Weights (how often a cost occurs per micro-batch in the whole model): nodes and edges inside the
repeated block run ``GraphIR.multiplicity`` times (the block is solved once, all layers share its
strategies). The block's *carried* input (the residual stream: the tensor from before the block
that has the same shape as the block's output) is consumed by the first layer only; layer i+1
consumes layer i's output, so the trace's edges from the carried producer get weight 1 and
"wrap" edges from the block output to the same consumers get weight count - 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from autopar.cost.collectives import SCALAR_BYTES, all_reduce_s, axis_link, collective_s
from autopar.cost.compute import backward_factor, memory_class, op_kind, op_time_s
from autopar.cost.hardware import ClusterSpec, LinkSpec, device_kind
from autopar.ir import DTYPE_BYTES, SDPA_TARGET, TensorMeta
from autopar.mesh import DATA, TENSOR
from autopar.placements import Partial, Shard
from autopar.solver.ilp import IlpEdge, IlpProblem, LinearConstraint
from autopar.solver.reshard import grad_target, reshard_kind, reshard_s
from autopar.solver.rules import arg, base_name
from autopar.solver.runtime_profile import RuntimeProfile
from autopar.solver.op_classes import all_op_sets, core_nodes, rc_costs, rc_lower_bounds
from autopar.solver.autocast import autocast_dtypes, saved_copy_factor, upcast_inputs, weight_copies
from autopar.solver.saved import (AUTOCAST_LOW, DROPOUT_MASK_BYTES_PER_ELEM, is_dropout, kept_tensors,
                                  regathered_operand)
from autopar.solver.context import attention_comm
from autopar.solver.strategies import (GraphFacts, batch_scale, bytes_moved_parts, enumerate_strategies, input_meta,
                                       ref_index, scaled_metas, tensor_nodes)

PARTS = ("pre", "block", "post")
# Tie-breaker added to the ILP objective: seconds per byte of memory a strategy keeps (local
# parameter states at 16 B/element, saved activations). Among equally fast choices it prefers the
# smaller one (sharded parameters also shrink the DP gradient sync the ILP cannot see); at 1e-15 s/B
# a whole GB weighs 1 us, below any timing difference that matters.
MEMORY_TIE_BREAK_S_PER_BYTE = 1e-15
STATE_BYTES_PER_PARAM = 16


@dataclass(frozen=True)
class NodeCost:
    """One node under one strategy, per micro-batch, one copy (one layer for block nodes)."""
    fwd_s: float                          # forward compute
    bwd_s: float                          # backward compute
    comm_fwd: tuple[tuple[str, float], ...]
    comm_bwd: tuple[tuple[str, float], ...]
    saved_bytes: int                      # activation bytes kept for backward (ops)
    param_numel: int                      # local parameter elements (params)
    out_bytes: int                        # local output bytes
    host_s: float = 0.0                   # the host's share of ``fwd_s`` (per-node cost, a ring's own)
    copy_bytes: int = 0                   # of ``saved_bytes``: autocast's low copies of parameters it read

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s + sum(s for _, s in self.comm_fwd) + sum(s for _, s in self.comm_bwd)


@dataclass(frozen=True)
class EdgeSpec:
    u: str
    v: str
    pos: int                  # input position at v
    index: int                # output index at u
    weight: int               # occurrences per micro-batch in the whole model
    part: str                 # "pre" | "block" | "post"
    nbytes: int               # full tensor bytes at this micro-batch
    grad: bool                # a gradient flows back along it
    wrap: bool = False
    regather: bool = False    # the consumer saves this input as it is: one only all-gathered is re-gathered in bwd


@dataclass(frozen=True)
class EdgeCost:
    fwd_kind: Optional[str]
    fwd_s: float              # exposed
    bwd_kind: Optional[str]
    bwd_s: float              # exposed
    regather_s: float = 0.0   # exposed backward all-gather of a saved input kept sharded

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.regather_s


@dataclass
class AxisTables:
    """Strategies and costs of every tensor node for one (t, sp, mbs)."""
    facts: GraphFacts
    t: int
    sp: bool
    mbs: int
    link: LinkSpec
    profile: RuntimeProfile
    keys: tuple[str, ...]
    strategies: dict
    costs: dict
    weight: dict
    edges: tuple[EdgeSpec, ...]
    metas: dict
    kinds: dict                       # key -> op kind ("param"/"input"/"buffer" for leaves)
    core: frozenset                   # attention-core op keys (selective recompute)
    carried: Optional[str]            # key of the block's carried producer (outside the block)
    block_out: Optional[str]          # key of the block's output node
    count: int                        # repeats of the block (1 without a block)
    _edge_cache: dict = field(default_factory=dict)
    op_sets: dict = field(default_factory=dict)   # recompute name -> op_classes.OpSet (per-op recompute)
    axis: str = TENSOR                # the mesh axis these tables are for (names its collectives)
    # (t, link, source placement, target placement, bytes) -> (kind, seconds): shared by the tables
    # of one ``build_tables`` cache (the same activation sizes recur on every edge and table)
    reshard_cache: dict = field(default_factory=dict)

    def wire_factor(self, key: str) -> float:
        """A pipeline's boundary value crosses at its traced dtype (``runtime/pipeline.Wire.send``
        casts autocast's 16-bit output back; the last stage's output too, which torch's fwd_cache
        holds for the loss): its bytes there over its bytes in these tables."""
        traced, here = self.facts.nodes[key].out.dtype, self.metas[key][0].dtype
        if not self.profile.autocast or traced == here or traced not in DTYPE_BYTES or here not in DTYPE_BYTES:
            return 1.0
        return DTYPE_BYTES[traced] / DTYPE_BYTES[here]

    def edge_costs(self, e: EdgeSpec) -> list[list[EdgeCost]]:
        key = (e.u, e.v, e.pos, e.wrap)
        if key not in self._edge_cache:
            self._edge_cache[key] = _edge_matrix(self, e)
        return self._edge_cache[key]


def _block_info(facts: GraphFacts):
    g = facts.graph
    if len(g.blocks) != 1:
        return None, None, 1
    count = g.blocks[0].count // max(1, g.blocks[0].traced)
    outs = [k for k, p in facts.part.items() if p == "block"
            and any(facts.part.get(c) == "post" for c, _ in facts.consumers[k])]
    if len(outs) != 1:
        return None, None, count
    w = outs[0]
    wshape = facts.nodes[w].out.shape
    cands = []
    for k, n in facts.nodes.items():
        if facts.part.get(k) == "block" or n.kind not in ("op", "input") or not n.outputs:
            continue
        if n.out.shape == wshape and any(facts.part.get(c) == "block" for c, _ in facts.consumers[k]):
            cands.append(k)
    return (cands[0] if len(cands) == 1 else None), w, count




def causal_attention(n) -> bool:
    """Whether attention node ``n`` runs a causal kernel: SDPA with ``is_causal=True`` (a causal
    mask folded by ``trace/causal_masks.py`` included); SDPA without it, or with an explicit mask,
    runs the full score matrix (BERT, ViT). Other attention targets count as causal (the LLM
    kernels ``attention_efficiency`` was measured on)."""
    if base_name(n.target) != "scaled_dot_product_attention":
        return True
    return bool(arg(n, 5, "is_causal", False)) and len(n.inputs) <= 3


@dataclass(frozen=True)
class AxisBackground:
    """What the other tensor axes' choices mean to the tables of one more axis
    (``solver/tensor_axes.py``): the tables' metas are already local to them (the caller's
    ``cache["metas"]``); ``work`` scales a node's FLOPs, bytes moved and in-op collective bytes by
    the share of it each rank keeps; ``allowed(key, strategy)`` drops strategies that shard a dim
    another axis shards; ``link`` is this axis' link; ``axis`` names its collectives."""
    axis: str
    link: LinkSpec
    work: dict                        # op key -> share of the op's work per rank (1: all of it)
    allowed: Callable[[str, object], bool]   # (key, Strategy) -> whether this axis may use it
    # op key -> rows of the micro-batch the op works on, where not the tables' ``mbs`` (the data
    # axis' choice: ``data_axis.py``; its share is in the rows, not in ``work``)
    rows: Optional[dict] = None
    # this axis splits the batch, not the weights: a strategy's compute scale applies to the bytes
    # of tensors with a batch dim only (each data-parallel rank reads every weight whole)
    batch_only: bool = False


def build_tables(facts: GraphFacts, cluster: ClusterSpec, t: int, sp: bool, mbs: int, dtype: str,
                 profile: RuntimeProfile, cache: Optional[dict] = None, cp: int = 1,
                 cp_mode: str = "none", background: Optional[AxisBackground] = None) -> AxisTables:
    """``cache``: a dict the caller keeps per (mbs, cp, dtype) to share metas and rule proposals
    between tables of different t / sp. ``cp`` > 1: each rank holds 1/cp of every sequence's
    tokens (token dims and FLOPs scaled), and attention adds its ``cp_mode`` exchange
    (``solver/context.py``). ``background``: the tables of an outer tensor axis, given the
    other axes' choices (``AxisBackground``)."""
    gpu = cluster.gpu
    link = axis_link(cluster, (1, t), 1) if background is None else background.link
    cp_link = axis_link(cluster, (1, cp, t), 1)
    cache = fill_cache(facts, cluster, mbs, dtype, profile, {} if cache is None else cache, cp)
    metas = cache["metas"]
    kept = cache["kept"]
    copy_factor, weights_read, upcast = cache["copies"]
    carried, block_out, count = _block_info(facts)
    # the host's per-node cost of a step (measured by ``autopar calibrate``; 0 by default): DTensor
    # dispatch when tp > 1, plain tensors otherwise (the runtime's local data-parallel mode); over a
    # mesh of more axes DTensor costs more, added per node by ``timing._rank_eval``
    overhead = gpu.dtensor_op_overhead_s if t > 1 else gpu.op_overhead_s
    g = facts.graph
    keys, strategies, costs, weight, kinds = [], {}, {}, {}, {}
    for n in tensor_nodes(g):
        if n.kind != "op" and not facts.consumers[n.key]:
            continue                      # e.g. the untraced twin of a tied weight
        strats = enumerate_strategies(facts, n, metas, t, sp, cache["protos"])
        if background is not None:
            strats = [x for x in strats if background.allowed(n.key, x)]
        if not strats:
            continue
        keys.append(n.key)
        strategies[n.key] = strats
        weight[n.key] = g.multiplicity(n)
        if n.kind != "op":
            kinds[n.key] = n.kind
            is_param = n.kind == "param"
            costs[n.key] = [NodeCost(0.0, 0.0, (), (), 0,
                                     (metas[n.key][0].numel // (t if isinstance(s.output, Shard) else 1)) if is_param else 0,
                                     s.out_bytes_local) for s in strats]
            continue
        kind = op_kind(n.target)
        kinds[n.key] = kind
        share = 1.0 if background is None else background.work.get(n.key, 1.0)
        rows = mbs if background is None or background.rows is None else background.rows.get(n.key, mbs)
        flops = n.flops * batch_scale(facts, n, rows / cp) * share
        fixed, varying = (b * share for b in bytes_moved_parts(facts, n, rows / cp, dtype))
        batch_only = background is not None and background.batch_only
        grad = facts.needs_grad.get(n.key, False)
        saves = n.key in kept
        mask = is_dropout(n) and grad
        causal = kind != "attention" or causal_attention(n)
        mclass = memory_class(n.target)
        host = overhead                       # the node's whole host cost of a step, counted once
        if cp > 1 and cp_mode == "ring" and n.target == SDPA_TARGET:
            host += gpu.ring_attention_overhead_s    # the ring's blocks, merges and rotations from Python
        row = []
        for s in strats:
            cs = (1.0 / t if splits_rows(s) else 1.0) if batch_only else s.compute_scale
            nbytes = fixed + varying * cs if batch_only else (fixed + varying) * cs
            compute = op_time_s(flops * cs, nbytes, dtype, gpu, kind, causal, mclass)
            fwd = compute + host
            bwd = compute * backward_factor(kind) if grad else 0.0
            cf = tuple((c.kind, collective_s(c.kind, c.nbytes * share, t, link)) for c in s.comms if c.phase == "fwd")
            cb = tuple((c.kind, collective_s(c.kind, c.nbytes * share, t, link)) for c in s.comms
                       if c.phase == "bwd" and grad)
            if cp > 1 and n.target == SDPA_TARGET:
                q, k, v = (metas[r.key][0].nbytes / (t if isinstance(p, Shard) else 1)
                           for r, p in zip(facts.inputs[n.key][:3], s.inputs))
                elem = DTYPE_BYTES[metas[facts.inputs[n.key][1].key][0].dtype]
                xf, xb = attention_comm(q, k + v, s.out_bytes_local, cp, cp_mode, compute, bwd, cp_link, elem,
                                        cluster.overlap_slowdown)
                cf, cb = cf + xf, cb + (xb if grad else ())
            saved = int(s.out_bytes_local * copy_factor.get(n.key, 1.0)) if saves else 0
            copies = sum(_local_numel(metas[pk][0], s.inputs[pos], t) * DTYPE_BYTES[dtype]
                         for pos, pk in weights_read.get(n.key, ()))
            saved += copies
            if mask:
                saved += DROPOUT_MASK_BYTES_PER_ELEM * (s.out_bytes_local // max(1, DTYPE_BYTES[metas[n.key][0].dtype]))
            out_b = s.out_bytes_local
            for pos in upcast.get(n.key, ()):        # computed on an fp32 copy of a 16-bit input
                out_b = max(out_b, _local_numel(input_meta(facts, n, pos, metas), s.inputs[pos], t)
                            * DTYPE_BYTES["float32"])
            row.append(NodeCost(fwd, bwd, cf, cb, saved, 0, out_b, host, copies))
        costs[n.key] = row
    edges = _edges(facts, metas, set(keys), carried, block_out, count, dtype if profile.autocast else None)
    return AxisTables(facts, t, sp, mbs, link, profile, tuple(keys), strategies, costs, weight, tuple(edges),
                      metas, kinds, core_nodes(facts), carried, block_out, count,
                      op_sets=all_op_sets(facts, alias=t == 1), axis=TENSOR if background is None else background.axis,
                      reshard_cache=cache.setdefault("reshard", {}))


def splits_rows(s) -> bool:
    """Whether strategy ``s`` on the data axis works on its rank's rows only: its output or an
    input is sharded there, or its output is a Partial (a view's too, which a tensor axis counts
    as whole work: ``Proto.split``)."""
    return isinstance(s.output, (Shard, Partial)) or any(isinstance(p, Shard) for p in s.inputs)


def fill_cache(facts: GraphFacts, cluster: ClusterSpec, mbs: int, dtype: str, profile: RuntimeProfile,
               cache: dict, cp: int = 1) -> dict:
    """``build_tables``' cache of one (mbs, cp), filled once: the metas at ``mbs`` rows, the rules'
    proposals, the tensors kept for backward and autocast's copies. Returns ``cache``."""
    if "metas" not in cache:
        # under autocast (``autocast.py``) activations have autocast's per-op dtypes, and a matmul
        # saves the low copies of what it reads in fp32: its activation and its weight
        device = device_kind(cluster)
        dtypes = autocast_dtypes(facts, dtype, device) if profile.autocast else None
        cache["metas"] = scaled_metas(facts, mbs, dtype, cp, dtypes)
        cache["protos"] = {}
        cache["kept"] = kept_tensors(facts)
        cache["copies"] = ((saved_copy_factor(facts, dtypes, dtype, device, cache["kept"]), weight_copies(facts, dtypes),
                            upcast_inputs(facts, dtypes, dtype, device)) if dtypes else ({}, {}, {}))
    return cache


def _local_numel(meta: TensorMeta, placement, t: int) -> int:
    """Elements of ``meta`` one rank of a ``t``-way axis holds under ``placement``."""
    return meta.numel // (t if isinstance(placement, Shard) else 1)


def _edges(facts: GraphFacts, metas: dict, present: set, carried, block_out, count,
           low: Optional[str] = None) -> list[EdgeSpec]:
    """The tables' edges. ``low``: the autocast dtype, when the plan runs under autocast: an fp32
    input that a matmul saves and that arrives through all-gathers is cast before the gather
    (``runtime/regather.Regather.cast_for``), so the gather moves ``low`` bytes."""
    out = []
    for k in facts.part:            # op nodes in topological order
        if k not in present:
            continue
        n = facts.nodes[k]
        vpart = facts.part[k]
        ins = facts.inputs[k]

        def grad_of(j, ins=ins):
            return j < len(ins) and facts.needs_grad.get(ins[j].key, False)
        for pos, ref in enumerate(ins):
            if ref.key not in present:
                continue
            rg = facts.needs_grad.get(k, False) and regathered_operand(n.target, pos, grad_of)
            idx = ref_index(facts, n, ref)
            meta: TensorMeta = metas[ref.key][idx]
            if low is not None and rg and base_name(n.target) in AUTOCAST_LOW and meta.dtype == "float32":
                meta = TensorMeta(meta.shape, low)
            grad = facts.needs_grad.get(ref.key, False)
            if vpart == "block":
                if ref.key == carried:
                    out.append(EdgeSpec(ref.key, k, pos, idx, 1, "pre", meta.nbytes, grad, regather=rg))
                    if count > 1:
                        out.append(EdgeSpec(block_out, k, pos, 0, count - 1, "block", meta.nbytes, grad, wrap=True,
                                            regather=rg))
                else:
                    out.append(EdgeSpec(ref.key, k, pos, idx, count, "block", meta.nbytes, grad, regather=rg))
            else:
                out.append(EdgeSpec(ref.key, k, pos, idx, 1, vpart, meta.nbytes, grad, regather=rg))
    return out


def _edge_matrix(tab: AxisTables, e: EdgeSpec) -> list[list[EdgeCost]]:
    su_list, sv_list = tab.strategies[e.u], tab.strategies[e.v]
    cu, cv = tab.costs[e.u], tab.costs[e.v]
    mm_u, mm_v = tab.kinds[e.u] == "matmul", tab.kinds[e.v] == "matmul"
    overlap = tab.profile.tp_overlap_kinds
    cache = tab.reshard_cache.setdefault((tab.t, tab.link, e.nbytes), {})   # hashes the link once an edge

    def rs(src, dst):
        k = (src, dst)
        if k not in cache:
            cache[k] = (reshard_kind(src, dst), reshard_s(src, dst, e.nbytes, tab.t, tab.link))
        return cache[k]

    outs, out_ix = _indexed([su.output for su in su_list])
    ins, in_ix = _indexed([sv.inputs[e.pos] for sv in sv_list])
    fwd = [[rs(o, i) for i in ins] for o in outs]
    if e.grad:
        gsrc, gsrc_ix = _indexed([sv.input_grads[e.pos] for sv in sv_list])
        gdst, gdst_ix = _indexed([grad_target(o) for o in outs])
        bwd = [[rs(g, d) for d in gdst] for g in gsrc]
    rows = []
    for a, su in enumerate(su_list):
        row, f_row = [], fwd[out_ix[a]]
        for b, sv in enumerate(sv_list):
            fk, fs = f_row[in_ix[b]]
            bk, bs = bwd[gsrc_ix[b]][gdst_ix[out_ix[a]]] if e.grad else (None, 0.0)
            rg = fs if (e.regather and fk == "all_gather") else 0.0
            if fk in overlap and fs > 0:
                win = max(cu[a].fwd_s if mm_u else 0.0, cv[b].fwd_s if mm_v else 0.0)
                fs = max(0.0, fs - win)
            # backward: the gradient reshard and the re-gather share the matmul's backward window
            hidden_b = (bs if bk in overlap else 0.0) + (rg if "all_gather" in overlap else 0.0)
            if hidden_b > 0:
                win = max(cu[a].bwd_s if mm_u else 0.0, cv[b].bwd_s if mm_v else 0.0)
                scale = max(0.0, hidden_b - win) / hidden_b
                bs = bs * scale if bk in overlap else bs
                rg = rg * scale if "all_gather" in overlap else rg
            row.append(EdgeCost(fk, fs, bk, bs, rg))
        rows.append(row)
    return rows


def _indexed(items: list) -> tuple[list, list[int]]:
    """The distinct ``items`` in first-seen order and each item's index among them (an edge's
    strategies share a few placements: the reshard costs are looked up per distinct pair)."""
    index: dict = {}
    at = [index.setdefault(x, len(index)) for x in items]
    return list(index), at


# ---- the ILP ----------------------------------------------------------------------------------

def ilp_problem(tab: AxisTables, constraints: tuple[LinearConstraint, ...] = ()) -> IlpProblem:
    index = {k: i for i, k in enumerate(tab.keys)}
    tie = MEMORY_TIE_BREAK_S_PER_BYTE
    node_costs = [[tab.weight[k] * (c.total_s + tie * (c.param_numel * STATE_BYTES_PER_PARAM + c.saved_bytes))
                   for c in tab.costs[k]] for k in tab.keys]
    edges = []
    for e in tab.edges:
        m = tab.edge_costs(e)
        if e.u == e.v:          # a wrap edge into the block output itself: both ends share one choice
            for s in range(len(m)):
                node_costs[index[e.u]][s] += e.weight * m[s][s].total_s
            continue
        edges.append(IlpEdge(index[e.u], index[e.v],
                             tuple(tuple(e.weight * c.total_s for c in row) for row in m)))
    return IlpProblem(tab.keys, tuple(tuple(r) for r in node_costs), tuple(edges), constraints)


# ---- summaries of a choice --------------------------------------------------------------------

@dataclass(frozen=True)
class PartCost:
    """Per micro-batch, for one copy of the part (one layer for "block")."""
    fwd_compute_s: float
    bwd_compute_s: float
    comm_fwd: dict                    # kind -> exposed seconds
    comm_bwd: dict
    saved_bytes: float                # activation bytes kept for backward
    core_fwd_s: float                 # attention-core forward (selective recompute re-runs it)
    core_saved_bytes: float           # activation bytes of the core (dropped by selective)
    max_out_bytes: float              # largest single local output
    param_numel: float                # local parameter elements used only by this part
    window_fwd_s: float = 0.0         # compute that overlapped comm can hide behind (forward)
    window_bwd_s: float = 0.0         # ... (backward); = the compute, or its max for bounds
    # per-operator recompute (block only): name -> op_classes.RcCost (re-run forward, its re-issued
    # comm, the layer's saved bytes with the set's regions, one region's re-materialized bytes)
    rc: Optional[dict] = None
    param_tensors: float = 0.0        # parameter tensors used only by this part (block: one layer's)
    weight_copy_bytes: float = 0.0    # of ``saved_bytes``: autocast's low copies of parameters
    nodes: float = 0.0                # op nodes (each pays the host's per-node cost once per micro-batch)
    # op kind ("matmul", "attention", "memory") -> (forward, backward) compute seconds, host cost
    # excluded: what ``autopar profile`` splits the predicted compute by
    by_kind: dict = field(default_factory=dict)

    @property
    def fwd_s(self) -> float:
        return self.fwd_compute_s + sum(self.comm_fwd.values())

    @property
    def bwd_s(self) -> float:
        return self.bwd_compute_s + sum(self.comm_bwd.values())


@dataclass(frozen=True)
class AxisSummary:
    """What the outer search needs from a tp-axis solution (or a lower bound of one)."""
    t: int
    sp: bool
    mbs: int
    parts: dict                       # "pre" | "block" | "post" -> PartCost
    shared_param_numel: float         # local elements of params used by both pre and post (tied)
    layer_input_bytes: float          # local bytes of one layer's input (full recompute, p2p)
    count: int
    objective_s: float                # the ILP objective (whole model, per micro-batch)
    is_lower_bound: bool = False
    shared_param_tensors: float = 0.0  # parameter tensors pre and post share (tied)
    # local bytes of what the loss reads (``GraphFacts.loss_inputs``) at its traced dtype
    # (``AxisTables.wire_factor``): the last pipeline stage's output, held in torch's fwd_cache until
    # its micro-batch's backward (``layer_memory.held_loss_input_bytes``)
    loss_input_bytes: float = 0.0
    loss_scalars: int = 0             # ``GraphFacts.loss_scalars``: the loss's one-value all-reduces per micro-batch


def _add(d: dict, kind: str, s: float) -> None:
    if s > 0:
        d[kind] = d.get(kind, 0.0) + s


def _param_part(tab: AxisTables, k: str) -> str:
    """The part parameter ``k`` is counted in: "block", "pre" or "post", or "shared" (read by both
    pre and post: tied)."""
    parts = tab.facts.param_parts[k]
    if "block" in parts:
        return "block"
    return "shared" if parts >= {"pre", "post"} else next(iter(parts))


def summarize(tab: AxisTables, choice: dict) -> AxisSummary:
    """``choice``: key -> strategy index."""
    acc = {p: dict(fwd=0.0, bwd=0.0, cf={}, cb={}, saved=0.0, core_f=0.0, core_b=0.0, mx=0.0, params=0.0,
                   tensors=0.0, nodes=0.0, kinds={}, copies=0.0) for p in PARTS + ("shared",)}
    count = tab.count
    for k in tab.keys:
        c = tab.costs[k][choice[k]]
        kind = tab.kinds[k]
        if kind in ("param", "buffer", "input"):
            if kind == "param":
                a = acc[_param_part(tab, k)]
                a["params"] += c.param_numel
                a["tensors"] += 1
            continue
        a = acc[tab.facts.part[k]]
        a["nodes"] += 1
        a["fwd"] += c.fwd_s
        a["bwd"] += c.bwd_s
        f, b = a["kinds"].get(kind, (0.0, 0.0))
        a["kinds"][kind] = (f + c.fwd_s - c.host_s, b + c.bwd_s)
        for kd, s in c.comm_fwd:
            _add(a["cf"], kd if ":" in kd else f"{tab.axis}:{kd}", s)
        for kd, s in c.comm_bwd:
            _add(a["cb"], kd if ":" in kd else f"{tab.axis}:{kd}", s)
        a["saved"] += c.saved_bytes
        a["copies"] += c.copy_bytes
        a["mx"] = max(a["mx"], c.out_bytes)
        if k in tab.core:
            a["core_f"] += c.fwd_s
            a["core_b"] += c.saved_bytes
    for e in tab.edges:
        ec = tab.edge_costs(e)[choice[e.u]][choice[e.v]]
        a = acc[e.part]
        scale = e.weight / count if e.part == "block" else e.weight
        if ec.fwd_kind:
            _add(a["cf"], f"{tab.axis}:{ec.fwd_kind}", ec.fwd_s * scale)
        if ec.bwd_kind:
            _add(a["cb"], f"{tab.axis}:{ec.bwd_kind}", ec.bwd_s * scale)
        _add(a["cb"], f"{tab.axis}:all_gather", ec.regather_s * scale)
    lk = tab.facts.loss_key
    if tab.axis != DATA and lk in choice and isinstance(tab.strategies[lk][choice[lk]].output, Partial):
        # the loss's one-value all-reduces where it is Partial (GraphFacts.loss_scalars; the data axis'
        # are ``timing._rank_eval``'s): gloo's ring on CPU ranks, NCCL's tree on GPUs (all_reduce_s)
        loss_s = tab.facts.loss_scalars * all_reduce_s(SCALAR_BYTES, tab.t, tab.link)
        _add(acc[tab.facts.part[lk]]["cf"], f"{tab.axis}:all_reduce", loss_s)
    shared = acc.pop("shared")
    parts = {p: PartCost(v["fwd"], v["bwd"], v["cf"], v["cb"], v["saved"], v["core_f"], v["core_b"], v["mx"],
                         v["params"], v["fwd"], v["bwd"], param_tensors=v["tensors"], nodes=v["nodes"],
                         by_kind=v["kinds"], weight_copy_bytes=v["copies"])
             for p, v in acc.items()}
    if tab.op_sets:
        parts["block"] = replace(parts["block"], rc=rc_costs(tab, choice, parts["block"].saved_bytes))
    layer_in = 0.0
    if tab.block_out is not None and tab.block_out in choice:
        layer_in = tab.costs[tab.block_out][choice[tab.block_out]].out_bytes
    obj = ilp_problem_objective(tab, choice)
    loss_in = sum(tab.costs[k][choice[k]].out_bytes * tab.wire_factor(k) for k in tab.facts.loss_inputs if k in choice)
    return AxisSummary(tab.t, tab.sp, tab.mbs, parts, shared["params"], layer_in, count, obj,
                       shared_param_tensors=shared["tensors"], loss_input_bytes=loss_in,
                       loss_scalars=tab.facts.loss_scalars)


def ilp_problem_objective(tab: AxisTables, choice: dict) -> float:
    total = sum(tab.weight[k] * tab.costs[k][choice[k]].total_s for k in tab.keys)
    total += sum(e.weight * tab.edge_costs(e)[choice[e.u]][choice[e.v]].total_s for e in tab.edges)
    return total


def lower_bound_summary(tab: AxisTables, batch_only: bool = False) -> AxisSummary:
    """A lower bound on the time and memory of ANY choice: every quantity at its own minimum over
    strategies, edges at 0, and the overlap windows at their maximum (so exposed communication,
    ``max(0, comm - window)``, is bounded below too). Used to prune outer configurations before
    their ILP is solved."""
    acc = {p: dict(fwd=0.0, bwd=0.0, saved=0.0, core_f=0.0, core_b=0.0, mx=0.0, params=0.0, wf=0.0, wb=0.0,
                   tensors=0.0, nodes=0.0, copies=0.0) for p in PARTS + ("shared",)}
    for k in tab.keys:
        cs = tab.costs[k]
        kind = tab.kinds[k]
        if kind == "param":
            a = acc[_param_part(tab, k)]
            a["params"] += min(c.param_numel for c in cs)
            a["tensors"] += 1
            continue
        if kind in ("buffer", "input"):
            continue
        a = acc[tab.facts.part[k]]
        a["nodes"] += 1
        a["fwd"] += min(c.fwd_s for c in cs)
        a["bwd"] += min(c.bwd_s for c in cs)
        a["wf"] += max(c.fwd_s for c in cs)
        a["wb"] += max(c.bwd_s for c in cs)
        if batch_only and not tab.facts.batch_dims.get(k):
            continue
        a["saved"] += min(c.saved_bytes for c in cs)
        a["copies"] += max(c.copy_bytes for c in cs)        # made again, not offloaded: the most
        a["mx"] = max(a["mx"], min(c.out_bytes for c in cs))
        if k in tab.core:           # saved - core_saved must bound the non-core bytes from below
            a["core_f"] += min(c.fwd_s for c in cs)
            a["core_b"] += min(c.saved_bytes for c in cs)
    shared = acc.pop("shared")
    parts = {p: PartCost(v["fwd"], v["bwd"], {}, {}, v["saved"], v["core_f"], v["core_b"], v["mx"], v["params"],
                         v["wf"], v["wb"], param_tensors=v["tensors"], nodes=v["nodes"], weight_copy_bytes=v["copies"])
             for p, v in acc.items()}
    if tab.op_sets:
        parts["block"] = replace(parts["block"], rc=rc_lower_bounds(tab, batch_only))
    layer_in = 0.0
    if tab.block_out is not None and tab.block_out in tab.costs:
        layer_in = min(c.out_bytes for c in tab.costs[tab.block_out])
    obj = sum(tab.weight[k] * min(c.total_s for c in tab.costs[k]) for k in tab.keys)
    loss_in = sum(min(c.out_bytes for c in tab.costs[k]) * tab.wire_factor(k) for k in tab.facts.loss_inputs
                  if k in tab.costs and not (batch_only and not tab.facts.batch_dims.get(k)))
    return AxisSummary(tab.t, tab.sp, tab.mbs, parts, shared["params"], layer_in, tab.count, obj, is_lower_bound=True,
                       shared_param_tensors=shared["tensors"], loss_input_bytes=loss_in,
                       loss_scalars=tab.facts.loss_scalars)
