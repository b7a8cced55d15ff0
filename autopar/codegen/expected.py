"""The collectives a rank should issue for one training step, derived from Plan + GraphIR alone.

What the runtime does (``executor.py``, ``runtime/params.py``, ``runtime/reducer.py``) written
as counting rules, so a test can hold ``ParallelModel.collectives`` against it:

Axes are the plan's stage mesh (``program.mesh``), in its order; dp below is the DATA axis and
tp the TENSOR axis (``autopar.mesh``), found by name (a mesh without one: size 1).

forward, per tensor edge producer u -> consumer n (input i), per mesh axis a of size > 1:
    ``reshard_kind(out(u)[a], in(n, i)[a])`` (``placements.py``: S->R all_gather, P->R
    all_reduce, P->S reduce_scatter, S(i)->S(j) all_to_all -- all_gather on gloo, R->S and R->P
    free), one axis at a time in ``placements.redistribute_steps``' order (free steps, then
    reduce-scatters and all-to-alls, then all-reduces and all-gathers; ``edges.redistribute``
    runs that order), each on the piece a rank holds then. A getitem's edge is its producer's
    output -> the getitem's output. A parameter's
    output is its tp storage placement on tp, Replicate elsewhere: dp sharding is ZeRO's, below.
backward, per edge whose value needs a gradient: the consumer's gradient placement G
    (``input_grads``: R for a Partial input, Partial for a Replicate input of a node whose output
    is not Replicate on that axis, else the input placement) -> the producer's output placement
    with Partial read as Replicate (a parameter keeps a Partial gradient on dp: the reducer's; so
    does a value computed from a context-parallel rank's positions, ``RankProgram.positional``).
    Two consumers hand back another G than ``input_grads``: an elementwise op (DTensor's
    pointwise rule) whose output is Shard(d) chunks a Replicate input that is not broadcast along
    d into that shard itself, so its G is the shard (the edge all-gathers it, not Partial); a loss
    DTensor runs (nll_loss's rule) hands back the logits' gradient as it read them; a sum/mean
    over a sharded dim (output Partial) hands back Replicate (its backward expands the Replicate
    gradient), and so does an add/sub that such a gradient reaches through edges the runtime does
    not wrap (``expected_grads.py``): those edges then move nothing where the plan says Shard.
re-gathers: an edge into an input the plan marks (``NodePlan.regather``: the consumer saves it as
    it got it) whose forward moves are all-gathers only issues them again in backward: the shard
    was kept for it (``runtime/regather.py``); not for a node run through a fused kernel.
rule-less ops (no planner rule, ``solver/rules.find_rule``): the planner makes them Replicate on
    dp while their inputs stay batch-sharded (``solver/data_axis.batch_shard_placements``); DTensor keeps
    the split (a view, a broadcast) and the executor gathers each output to Replicate
    (``GraphExecutor._fix_output``): an all_gather per output on every axis where the plan has
    the op Replicate and some input Shard (none Partial); its gradient goes back for free.
the loss: Partial axes of the loss are all-reduced (4 bytes) to return one float; DTensor's
    nll_loss backward all-reduces its ``total_weight`` (4 bytes) on every axis where the loss is
    Partial (a DTensor implementation detail, listed here so the count is exact) -- where DTensor
    computed it Partial, i.e. the logits' rows are sharded there; Replicate logits give a
    Replicate loss, which the executor makes the plan's Partial for free. nll_loss's rule moves
    the target to the logits' placement (without the class dim), in forward and again in its
    backward (a batch-sharded target of Replicate logits: all_gather twice).
vocab-parallel cross-entropy (``vocab_ce.VocabParallelCE``: logits Shard(1) on tp, no class
    weight, no label smoothing): forward, on tp, three all_reduces of one value per local row
    (row max and sum-exp in fp32, the target logit in the logits dtype); mean: on each other
    axis that shards the rows, an all_reduce of the target count (4 bytes, fp32) in forward
    instead of DTensor's backward ``total_weight`` all_reduce.
fused cross-entropy (``codegen/fused.py``, node keys in ``fused``: ``ParallelModel.fused_kernels``):
    mean over rows sharded on an axis: an all_reduce of the target count (4 bytes, fp32) in
    forward on that axis instead of DTensor's backward ``total_weight`` all_reduce. The other
    fused kernels run where the plan's edges are unchanged: they issue nothing of their own.
local-dp mode (tp == 1, ``program.local_dp_nodes``): only edges into nodes that run on DTensors
    (the loss) count; the rest runs on plain local tensors.
recompute: every forward collective of a node inside a recompute region is issued again in
    backward (non-reentrant checkpoint, early stop off); ZeRO-3 gathers of parameters read in a
    region too.
ZeRO (dp > 1), per parameter read per scope (main graph or region): ZeRO-3 all_gather of its rows
    (one per gather group instead, for the parameters in one, ``gather_groups.py``: forward, and
    backward for a region's replay or the group's saved weights, ``runtime/reshard.py``).
    Per gradient bucket (``buckets.py``): all_reduce (ZeRO 0/1) or reduce_scatter (2/3); after the
    optimizer step all_gather (ZeRO 1/2).

``nbytes`` as ``autopar.cost.collectives``, of the piece the collective moves: the tensor divided
by its shard counts on the other axes, an uneven shard padded to equal chunks as DTensor pads it
(``edge_bytes.py``; a rule-less op's gathered output is taken as even). ZeRO-3's backward re-gather
counts the parameters autograd keeps (``_saves``: a matmul keeps a weight only for its input's
gradient). Not predicted: ops DTensor has no rule for that must gather
(``ParallelModel.fallbacks`` names them), and reshardings DTensor inserts inside an op whose
planned input placements it does not accept -- both show up as differences, which is the point.

Context parallelism (cp > 1): ``graph`` is the folded trace the runtime runs, and attention's
own traffic on the "cp" axis is ``expected_context.py``'s.

Pipelined plans (pp > 1): ``expected_pipeline.py`` applies these rules to each stage a rank holds
(``part_collectives``) and adds the pipeline's own traffic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Optional

from autopar.codegen.expected_context import context_collectives
from autopar.codegen.expected_grads import replicate_grads
from autopar.codegen.edge_bytes import edge_moves, moved as _moved, norm as _norm, piece_bytes as _piece_bytes
from autopar.codegen.buckets import DEFAULT_BUCKET_BYTES, ParamLayout, bucket_comm_bytes, plan_buckets
from autopar.codegen.program import RankProgram, axis_index, compile_program, local_dp_nodes, needs_grad
from autopar.codegen.shards import chunk_range, local_shape
from autopar.cost.compute import op_kind
from autopar import placements
from autopar.ir import DTYPE_BYTES, OUTPUT_KEY, GraphIR, NodeInfo, TensorMeta
from autopar.mesh import DATA, TENSOR
from autopar.placements import Partial, Placement, Replicate, Shard
from autopar.plan import Plan
from autopar.solver.rules import arg, find_rule, is_elementwise
from autopar.solver.saved import saves_operand_given


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues (predicted here, recorded by ``runtime/collectives.py``).
    ``nbytes``: all_reduce the tensor, all_gather the OUTPUT, reduce_scatter the INPUT, all_to_all
    each rank's send buffer (as ``autopar.cost.collectives``)."""
    kind: str      # "all_reduce" | "all_gather" | "reduce_scatter" | "all_to_all" | "broadcast"
    axis: str      # the mesh axis' name (the plan's), or "world"
    nbytes: int    # see the module docstring
    phase: str     # "forward" | "backward" | "step" (reducer / optimizer) | "setup"
    source: str    # "dtensor" | "reducer" | "zero" | "fallback"

    def key(self) -> tuple[str, str, int, str]:
        """What tests compare: (kind, axis, nbytes, phase)."""
        return (self.kind, self.axis, self.nbytes, self.phase)


VOCAB_CE_TARGET = "aten.cross_entropy_loss.default"
LOSS_TARGETS = frozenset({"aten.cross_entropy_loss.default", "aten.nll_loss.default",
                          "aten.nll_loss_nd.default", "aten.nll_loss_forward.default"})


def reshard_kind(src: Placement, dst: Placement, backend: str) -> Optional[str]:
    k = placements.reshard_kind(src, dst)
    if k == "all_to_all" and backend == "gloo":
        return "all_gather"            # DTensor on a CPU group: all-gather + local chunk
    return k


def _grad_placement(b: Placement, out: Placement, elementwise: Optional[tuple] = None) -> Placement:
    """The placement of the gradient an op hands back for an input it read as ``b`` (its output
    ``out``). ``elementwise``: (input meta, output meta) of an elementwise op's input: DTensor
    runs it with every operand that is not broadcast along the output's shard in that shard (a
    Replicate one is chunked locally), so such an input's gradient comes back in the shard, not
    Partial (the edge into the op then all-gathers it)."""
    if isinstance(b, Partial):
        return Replicate()
    if isinstance(b, Replicate) and isinstance(out, Shard) and elementwise is not None:
        m, o = elementwise
        d = out.dim % len(o.shape)
        e = d - (len(o.shape) - len(m.shape))
        if e >= 0 and m.shape[e] == o.shape[d]:
            return Shard(e)
    if isinstance(b, Replicate) and not isinstance(out, Replicate):
        return Partial()
    return b


def _loss_target(p_in: Optional[Placement], ndim: int) -> Optional[Placement]:
    """Where DTensor's nll_loss rule puts the target on an axis where the logits (``ndim`` dims,
    classes on dim 1, or 0 for one row) are ``p_in``: the logits' placement on its other dims (a
    class shard is replicated first); None: not a case predicted here (Partial logits)."""
    channel = 1 if ndim >= 2 else 0
    if isinstance(p_in, Replicate):
        return Replicate()
    if isinstance(p_in, Shard):
        d = p_in.dim % ndim
        return Replicate() if d == channel else Shard(d - 1 if d > channel else d)
    return None


def _rule_less(target: str) -> bool:
    """Whether the planner has no sharding rule for ``target``: it plans the op Replicate on the
    DATA axis (``solver/data_axis.batch_shard_placements``) while its inputs stay batch-sharded there."""
    return find_rule(target) is None and target != "getitem"


def _saves(n: NodeInfo, i: int, need: dict) -> bool:
    """Whether autograd keeps ``n``'s tensor input ``i`` for backward (``need``: which values need a
    gradient)."""
    return saves_operand_given(n.target, i, lambda j: j < len(n.inputs) and need.get(n.inputs[j].key, False))


def _read_moved(stored, read, di: Optional[int]) -> bool:
    """Whether a parameter stored with placements ``stored`` and read as ``read`` (one per mesh
    axis; None: kept) is redistributed on an axis other than DATA."""
    if stored is None or read is None:
        return False
    return any(i != di and a is not None and b is not None and a != b
               for i, (a, b) in enumerate(zip(stored, read)))


def _saved_params(graph: GraphIR, region_of: dict, runs=lambda key: True, need: Optional[dict] = None) -> set:
    """Parameters that an op outside recompute regions keeps for backward (directly or through
    views): ZeRO-3 gathers each of them once more in backward (``runtime/reshard.py``). ``runs``:
    whether a node runs (a pipeline stage's part); ``need``: which values need a gradient
    (``needs_grad``; a linear over the model's inputs keeps no weight)."""
    need = needs_grad(graph) if need is None else need
    users: dict = {}
    for n in graph.nodes:
        if n.kind == "op" and region_of.get(n.key) is None and runs(n.key):
            for i, r in enumerate(n.inputs):
                users.setdefault(r.key, []).append((n, i))

    def kept(key: str, seen: set) -> bool:
        for n, i in users.get(key, ()):
            if op_kind(n.target) == "free" and n.key not in seen:
                seen.add(n.key)
                if kept(n.key, seen):
                    return True
            elif _saves(n, i, need):
                return True
        return False

    return {n.param_name or n.key for n in graph.nodes if n.kind == "param" and kept(n.key, set())}


def expected_collectives(graph: GraphIR, plan: Plan, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         backend: str = "gloo", tp_rank: "int | Mapping[str, int]" = 0, dp_mode: str = "auto",
                         program: Optional[RankProgram] = None, fused: Collection[str] = ()) -> list[Collective]:
    """One step's collectives on a rank with TENSOR-axis coordinate ``tp_rank`` (or its coordinates
    by axis name, for outer tensor axes: ``param_layouts``) (``graph``: the FULL trace
    at one global micro-batch, i.e. the global batch when the plan has one). ``dp_mode`` as
    ``autoparallelize``'s: in local-dp mode only the nodes that reduce over the batch run on
    DTensors, so only their edges communicate. ``fused``: keys of the nodes that ran through a fused
    kernel (``ParallelModel.fused_kernels``). With ``plan.num_micro_batches`` m > 1 what the graph
    issues (its edges, the loss, ZeRO-3's gathers) happens m times, the reducer's once (ZeRO 2/3's
    reduce-scatters m times: ``GradReducer.each_micro_batch``). Pipelined plans (pp > 1):
    ``expected_pipeline.expected_pipeline_collectives``."""
    if program is None:
        program = compile_program(graph, plan, local_dp=local_dp_nodes(graph, plan) if dp_mode == "auto" else None)
    by_key = {n.key: n for n in graph.nodes}
    loss = next((by_key[r.key] for r in by_key[OUTPUT_KEY].inputs), None) if OUTPUT_KEY in by_key else None
    per_run = part_collectives(graph, program, backend=backend, tp_rank=tp_rank, fused=fused,
                               loss_key=loss.key if loss is not None else None)
    per_run += context_collectives(graph, program, plan.context_parallel, plan.context_parallel_mode)
    rounds = plan.num_micro_batches if program.zero_stage >= 2 else 1
    return per_run * plan.num_micro_batches + reducer_collectives(program, bucket_bytes, tp_rank, rounds)


def part_collectives(graph: GraphIR, program: RankProgram, *, backend: str = "gloo", tp_rank: int = 0,
                     fused: Collection[str] = (), loss_key: Optional[str] = None,
                     part: Optional[Collection[str]] = None, received: Optional[dict] = None,
                     phases: tuple[str, str] = ("forward", "backward")) -> list[Collective]:
    """What one forward and backward of (a part of) ``graph`` issues: DTensor edges, vocab-parallel
    cross-entropy, the loss ``loss_key``'s all-reduces and ZeRO-3's gathers (module docstring).
    ``part``: keys of the nodes that run (all of them when None); ``received``: key -> placements of
    the values a pipeline stage receives instead of computing (``stages.wire_placements``): they need
    a gradient when floating point. ``phases``: the (forward, backward) phase names the log uses."""
    fwd, bwd = phases
    mesh = program.mesh
    axes, sizes = tuple(mesh.axes), tuple(mesh.shape)
    di, ti = axis_index(mesh, DATA), axis_index(mesh, TENSOR)
    by_key = {n.key: n for n in graph.nodes}
    nplan = {n.key: n for n in program.nodes}
    params = {p.name: p for p in program.params}
    received = received or {}
    need = needs_grad(graph, received)
    region_of = {n.key: n.region for n in program.nodes}
    runs = (lambda key: True) if part is None else frozenset(part).__contains__
    out: list[Collective] = []

    def add(kind, axis, nbytes, phase, source="dtensor"):
        out.append(Collective(kind, axes[axis], int(nbytes), phase, source))

    def out_placement(n: NodeInfo) -> Optional[tuple]:
        if n.key in received:
            return received[n.key]
        if n.kind == "param":                      # its storage placement on every tensor axis
            return params[n.param_name or n.key].placements(axes)
        return nplan[n.key].output

    def edge(meta: TensorMeta, a_pl, b_pl, consumer_out, ph, grad: bool, is_param: bool,
             out_meta: Optional[TensorMeta] = None, elementwise: bool = False, as_read: bool = False,
             rep: Collection[int] = (), regather: bool = False):
        """Producer placements ``a_pl`` -> consumer input ``b_pl`` (the consumer's output
        ``consumer_out``, of ``out_meta``; ``elementwise``: the consumer is a pointwise op;
        ``as_read``: the consumer hands back the gradient in the placement it read, a loss;
        ``rep``: axes where it hands it back Replicate, ``expected_grads.replicate_grads``;
        ``regather``: the consumer saves the value as it is, so all-gathers only are issued again
        in backward, ``runtime/regather.py``)."""
        if a_pl is None or b_pl is None:
            return
        nd = len(meta.shape)
        od = len(out_meta.shape) if out_meta is not None else nd
        a_pl = tuple(None if x is None else _norm(x, nd) for x in a_pl)
        b_pl = tuple(None if x is None else _norm(x, nd) for x in b_pl)
        live = [ax for ax in range(len(axes)) if sizes[ax] > 1 and a_pl[ax] is not None and b_pl[ax] is not None]
        src = tuple(Replicate() if x is None else x for x in a_pl)
        dst = tuple(b_pl[ax] if ax in live else src[ax] for ax in range(len(axes)))
        moves(meta, src, dst, ph)
        if regather and placements.gathers_only(src, dst):
            moves(meta, src, dst, (bwd,))
        if not grad or consumer_out is None:
            return
        tgt = tuple(Replicate() if isinstance(x, Partial) else x for x in src)
        g_pl = list(tgt)
        for ax in (a for a in live if consumer_out[a] is not None):
            g = Replicate() if ax in rep else b_pl[ax] if as_read else _grad_placement(
                b_pl[ax], _norm(consumer_out[ax], od), (meta, out_meta) if elementwise and out_meta is not None else None)
            if not (is_param and ax == di and isinstance(g, Partial)):     # else the reducer's summand
                g_pl[ax] = g
        moves(meta, tuple(g_pl), tgt, (bwd,))

    def moves(meta: TensorMeta, src: tuple, dst: tuple, ph) -> None:
        for kind, ax, nbytes in edge_moves(meta, src, dst, sizes, backend):
            for phase in ph:
                add(kind, ax, nbytes, phase)

    # ---- DTensor edges ----
    rep_grads = {} if program.local_dp else replicate_grads(
        graph, nplan, out_placement, sizes, di, need, program.positional, lambda k: runs(k) and k not in received)
    for n in graph.nodes:
        if n.kind != "op" or not runs(n.key) or n.key in received:
            continue
        np_ = nplan[n.key]
        if program.local_dp and not np_.dtensor:
            continue                                       # plain local tensors: no DTensor edges
        ph = (fwd, bwd) if np_.region is not None else (fwd,)
        if n.target == "getitem":
            u = by_key[n.inputs[0].key]
            edge(n.out, out_placement(u), np_.output, np_.output, ph, need[n.key], False)
            continue
        if not np_.inputs:
            continue
        pointwise = is_elementwise(n.target) and bool(n.outputs)
        x0 = by_key[n.inputs[0].key] if n.inputs else None
        loss_rule = x0 is not None and bool(x0.outputs) and dtensor_loss(
            n, np_, mesh, len(x0.outputs[n.inputs[0].index or 0].shape), fused)
        metas = []
        for i, (r, b_pl) in enumerate(zip(n.inputs, np_.inputs)):
            u = by_key[r.key]
            metas.append(None)
            if not u.outputs:
                continue
            meta = metas[-1] = u.outputs[r.index or 0] if r.index is not None else u.out
            if u.target in ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default"):
                continue                                   # consumed through getitem
            edge(meta, out_placement(u), b_pl, np_.output, ph, need[u.key],
                 u.kind == "param" or u.key in program.positional, n.out if n.outputs else None, pointwise,
                 loss_rule, rep_grads.get((n.key, i), ()), i in np_.regather and n.key not in fused)
        # a loss DTensor runs (nll_loss's rule): the target follows the logits' placement, moved
        # there in forward and again by the backward op (which reads the target too)
        if loss_rule and len(metas) > 1 and metas[0] is not None and metas[1] is not None:
            xd, td = len(metas[0].shape), len(metas[1].shape)
            t_pl = tuple(None if q is None else _norm(q, td) for q in np_.inputs[1])
            for ax in range(len(axes)):
                want = _loss_target(np_.inputs[0][ax], xd)
                if sizes[ax] == 1 or want is None or t_pl[ax] is None:
                    continue
                mv = _moved(metas[1], t_pl, sizes, ax, t_pl[ax], want, backend)
                if mv is not None:
                    for phase in ph + (bwd,):
                        add(mv[0], ax, mv[1], phase)
        # a rule-less op Replicate on an axis where an input is Shard: DTensor keeps the split
        # (a view, a broadcast), and the executor gathers each output to the plan's Replicate
        # (``GraphExecutor._fix_output``); its gradient comes back Replicate, chunked for free
        if np_.output is not None and _rule_less(n.target):
            for ax in range(len(axes)):
                if sizes[ax] == 1 or not isinstance(np_.output[ax], Replicate):
                    continue
                ins = [b[ax] for b in np_.inputs if b is not None]
                if not any(isinstance(b, Shard) for b in ins) or any(isinstance(b, Partial) for b in ins):
                    continue
                for m in n.outputs:
                    for phase in ph:
                        add("all_gather", ax, _piece_bytes(m, np_.output, sizes, ax, "all_gather"), phase)

    # ---- vocab-parallel cross-entropy ----
    vocab_ce = set()
    for n in graph.nodes:
        np_ = nplan.get(n.key)
        if n.kind != "op" or np_ is None or not n.inputs or not runs(n.key) or (program.local_dp and not np_.dtensor):
            continue
        x = by_key[n.inputs[0].key].outputs[n.inputs[0].index or 0]
        nd = len(x.shape)
        if not vocab_parallel_ce(n, np_, mesh, nd):
            continue
        vocab_ce.add(n.key)
        ph = (fwd, bwd) if np_.region is not None else (fwd,)
        pl = tuple(Replicate() if a == ti else _norm(q, nd) for a, q in enumerate(np_.inputs[0]))
        rows32 = TensorMeta(tuple(1 if d == 1 else s for d, s in enumerate(x.shape)), "float32")
        rows_x = TensorMeta(rows32.shape, x.dtype)
        for phase in ph:
            for meta in (rows32, rows32, rows_x):          # row max, row sum-exp, target logit
                add("all_reduce", ti, _piece_bytes(meta, pl, sizes, ti, "all_reduce"), phase)
            if _ce_reduction(n) == 1:
                for ax in range(len(axes)):
                    if ax != ti and sizes[ax] > 1 and isinstance(pl[ax], Shard):
                        add("all_reduce", ax, 4, phase)       # the global target count

    # ---- the loss ----
    loss = by_key.get(loss_key) if loss_key is not None and runs(loss_key) else None
    if loss is not None and nplan[loss.key].output is not None:
        for ax in range(len(axes)):
            if sizes[ax] > 1 and isinstance(nplan[loss.key].output[ax], Partial):
                add("all_reduce", ax, DTYPE_BYTES[loss.out.dtype], fwd)
                if loss.key in fused and loss.target == VOCAB_CE_TARGET:
                    if _ce_reduction(loss) == 1:
                        add("all_reduce", ax, 4, fwd)        # the kernel's global target count
                elif loss.target in LOSS_TARGETS and loss.key not in vocab_ce:
                    xd = len(by_key[loss.inputs[0].key].outputs[loss.inputs[0].index or 0].shape)
                    if not dtensor_loss(loss, nplan[loss.key], mesh, xd, fused) or \
                            _loss_rows_sharded(nplan[loss.key], ax, xd):
                        add("all_reduce", ax, DTYPE_BYTES[loss.out.dtype], bwd)

    # ---- ZeRO-3: each scope gathers the parameters it reads ----
    dp = mesh.size_of(DATA)
    if dp > 1 and program.zero_stage == 3:
        lay = {l.name: l for l in param_layouts(program, tp_rank)}
        scopes = set()
        for n in graph.nodes:
            if n.kind != "op" or not runs(n.key):
                continue
            for r in n.inputs:
                u = by_key[r.key]
                if u.kind == "param":
                    scopes.add((u.param_name or u.key, region_of.get(n.key)))
        # a parameter read with another placement on a tensor axis than it is stored with (stored
        # Shard on tp2, read Replicate) is redistributed first: its consumers keep that new
        # tensor, not the gathered rows, so nothing is gathered again in backward
        moved = {u.param_name or u.key for n in graph.nodes if n.kind == "op"
                 for r, want in zip(n.inputs, nplan[n.key].inputs or ())
                 if (u := by_key[r.key]).kind == "param" and _read_moved(nplan[u.key].output, want, di)}
        saved = _saved_params(graph, region_of, runs, need) - moved
        group = {p.name: p.group for p in program.params}
        # (pass, group) -> bytes: one gather each (gather_groups.py); the pass, not the phase, tells
        # a forward gather from a backward one (a pipeline logs both as "pipeline")
        grouped: dict[tuple, int] = {}
        for name, region in sorted(scopes, key=lambda s: (s[0], -1 if s[1] is None else s[1])):
            nb = int(lay[name].padded_numel(dp) * DTYPE_BYTES[lay[name].dtype])
            g = group.get(name, -1)
            if g >= 0:
                grouped[(0, g)] = grouped.get((0, g), 0) + nb
            else:
                out.append(Collective("all_gather", axes[di], nb, fwd, "zero"))
            if region is not None or name in saved:        # replayed / re-gathered (reshard.py)
                if g >= 0:
                    grouped[(1, g)] = grouped.get((1, g), 0) + nb
                else:
                    out.append(Collective("all_gather", axes[di], nb, bwd, "zero"))
        out += [Collective("all_gather", axes[di], nb, bwd if back else fwd, "zero")
                for (back, _), nb in sorted(grouped.items())]
    return out


def param_layouts(program: RankProgram, tp_rank: "int | Mapping[str, int]") -> list[ParamLayout]:
    """The ``ParamLayout`` of each of ``program``'s parameters on a rank: ``tp_rank`` is its
    TENSOR-axis coordinate (an int; any outer tensor axis at 0) or its coordinates by axis name
    (``{"tp2": 1, "tp": 0}``; an axis not named: 0). The layout is the part of the parameter the
    rank's coordinates on every tensor axis select (``ParamPlan.storage``)."""
    mesh = program.mesh
    coords = dict(tp_rank) if isinstance(tp_rank, Mapping) else {TENSOR: tp_rank}
    coord = tuple(coords.get(a, 0) for a in mesh.axes)
    return [ParamLayout(p.name, _tp_local_shape(p, mesh, coord), p.dtype) for p in program.params]


def reducer_collectives(program: RankProgram, bucket_bytes: int, tp_rank: int, rounds: int = 1) -> list[Collective]:
    """The gradient reducer's collectives of a step (ZeRO 0: all_reduce, 1-3: reduce_scatter per
    bucket, ``rounds`` times: once per step or, ZeRO 2/3 without a pipeline, per micro-batch) and
    ZeRO 1/2's all_gather of the updated rows, over ``program.params``, in the order logged."""
    mesh = program.mesh
    dp = mesh.size_of(DATA)
    if dp == 1:
        return []
    axis = mesh.axes[axis_index(mesh, DATA)]
    layouts = param_layouts(program, tp_rank)
    buckets = plan_buckets(layouts, bucket_bytes)
    kind = "all_reduce" if program.zero_stage == 0 else "reduce_scatter"
    out = [Collective(kind, axis, bucket_comm_bytes(layouts, b, dp, kind), "step", "reducer")
           for b in buckets] * rounds
    if program.zero_stage in (1, 2):
        out += [Collective("all_gather", axis, bucket_comm_bytes(layouts, b, dp, "all_gather"), "step", "zero")
                for b in buckets]
    return out


def dtensor_loss(n: NodeInfo, np_, mesh, logits_ndim: int, fused: Collection[str] = ()) -> bool:
    """Whether ``n`` is a loss (``LOSS_TARGETS``) that DTensor's nll_loss rule runs (logits of
    ``logits_ndim`` dims): not fused (``fused``), not vocab-parallel cross-entropy, both planned
    input placements known."""
    if n.target not in LOSS_TARGETS or n.key in fused or len(np_.inputs) < 2 or np_.inputs[0] is None \
            or np_.inputs[1] is None:
        return False
    return not vocab_parallel_ce(n, np_, mesh, logits_ndim)


def _loss_rows_sharded(np_, ax: int, logits_ndim: int) -> bool:
    """Whether the logits of a loss DTensor runs are sharded over their rows on axis ``ax``
    (a dim other than the classes): its loss is then Partial there, and nll_loss's backward
    all-reduces its ``total_weight``; Replicate logits give a Replicate loss (the executor makes
    it the plan's Partial for free)."""
    p = np_.inputs[0][ax]
    return isinstance(_loss_target(p, logits_ndim), Shard)


def _ce_reduction(n: NodeInfo) -> int:
    """A cross-entropy or NLL loss's reduction: 0 none, 1 mean (the default), 2 sum."""
    return arg(n, 3, "reduction", 1)


def vocab_parallel_ce(n: NodeInfo, np_, mesh, ndim: int) -> bool:
    """Whether the executor runs this node as vocab-parallel cross-entropy: the plan's logits
    placement is Shard(class dim 1) on the TENSOR axis of ``mesh`` (size > 1) and Shard(another
    dim) or Replicate elsewhere,
    no class weight, no label smoothing (``vocab_ce.vocab_parallel_ce`` decides the same on the
    runtime placements)."""
    from autopar.ir import Ref

    ti = axis_index(mesh, TENSOR)
    if n.target != VOCAB_CE_TARGET or mesh.size_of(TENSOR) == 1 or ndim < 2 or not np_.inputs or np_.inputs[0] is None:
        return False
    weight = n.args[2] if len(n.args) > 2 else dict(n.kwargs).get("weight")
    smoothing = n.args[5] if len(n.args) > 5 else dict(n.kwargs).get("label_smoothing", 0.0)
    if isinstance(weight, Ref) or float(smoothing or 0.0) != 0.0:
        return False
    pl = tuple(None if q is None else _norm(q, ndim) for q in np_.inputs[0])
    return isinstance(pl[ti], Shard) and pl[ti].dim == 1 and all(
        isinstance(q, Replicate) or (isinstance(q, Shard) and q.dim != 1) for a, q in enumerate(pl) if a != ti)


def _tp_local_shape(p, mesh, coord: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the part of ``p`` that mesh coordinate ``coord`` stores (strided rows: TENSOR's)."""
    if not p.shape:
        return ()
    shape = list(local_shape(p.shape, p.placements(mesh.axes), mesh.shape, coord))
    if isinstance(p.tp, Shard) and p.tp.dim % len(shape) == 0 and p.strided > 1:
        a, b = chunk_range(p.shape[0] // p.strided, mesh.size_of(TENSOR), coord[mesh.axes.index(TENSOR)])
        shape[0] = (b - a) * p.strided
    return tuple(shape)
