"""Plan + GraphIR -> RankProgram: what every node of the FULL traced graph does on the mesh.

The program is plain frozen data keyed by FX node name, the same on every rank; the executor
(``executor.py``) runs it on DTensors. Placements are one per axis of the plan's stage mesh
(``program.mesh``: ``plan.stage_mesh``, in ``plan.mesh_axes`` order), which the runtime builds as
its DeviceMesh with the same names. Codegen never spells an axis name or position: it asks for the
axis of a role (``autopar.mesh.DATA`` carries the batch, ``TENSOR`` is tensor parallel) by name,
and a mesh without that axis reads as if it had one of size 1.

Reading a Plan (conventions agreed with the solver):

- A node of layer i >= 1 of a full trace (key ``"...@i"``) takes the strategy of layer 0's key.
- ``NodeStrategy.output`` / ``inputs`` hold one placement per plan mesh axis. A strategy with ONE
  placement on a multi-axis plan is read as the placement on the TENSOR axis; the other axes are
  then left to DTensor ("keep": ``None`` in ``NodePlan``), and inputs get Shard(0) on the DATA axis
  when they carry the batch.
- Parameters: the parameter node's output placement on each tensor axis (``TENSOR`` and the outer
  tensor axes "tp2", "tp3" of 2-D/3-D tensor parallelism, ``autopar.mesh.TENSOR_AXES``) is how the
  parameter is stored and used (``ParamPlan.storage``; ``ParamPlan.tp`` is the TENSOR entry). A
  parameter stored Shard on an outer axis and read Replicate there is all-gathered at each use
  (its gradient reduce-scattered back: DTensor's). On the DATA axis a parameter is Replicate (ZeRO 0-2) or
  Shard(0) (ZeRO-3), which the runtime realizes itself (``runtime/params.py``); any other DATA
  placement of a parameter is an error.
- Nodes without a strategy (getitem, views the solver skipped) keep what DTensor propagates.

Strided shards (Megatron's fused QKV): a split into k equal chunks whose input is Shard(d) on tp
along the split dim (the solver's "strided" split) can only be local if each rank holds 1/t of
EVERY chunk. The column-parallel linear that produces the split input then stores its weight rows
(and bias) as k blocks each split over tp (``ParamPlan.strided = k``), and the split runs on the
local tensor. Any other producer is an error. Strided splits and vocab-parallel cross-entropy are
TENSOR-axis layouts only: a plan that splits a dim sharded on an outer tensor axis, or class-shards
a cross-entropy's logits there, is refused (ValueError).

Recompute regions: ``plan.recompute == "full"`` puts each layer's op nodes (same block and layer
id, in graph order) in one ``torch.utils.checkpoint`` region (with ``plan.recompute_layers``: the
layers ``Plan.recomputed_layers`` names only); per-op recompute (``"selective"`` = ``"ops:attention"``,
``"ops:attention+mlp_act"``, ...: ``autopar/recompute_ops.py``) wraps each region
``solver/op_classes.layer_regions`` finds (a fused attention core alone; an MLP's up-projection
and activation; a norm and the projection reading it), the ones the solver priced.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Collection, Optional

from autopar.codegen.gather_groups import gather_groups
from autopar.ir import TARGET_KEY, GraphIR, NodeInfo
from autopar.mesh import DATA, TENSOR, Mesh, axis_position, tensor_axes
from autopar.placements import Partial, Placement, Replicate, Shard
from autopar.plan import NodeStrategy, Plan, parse_offload
from autopar.cost.compute import op_kind
from autopar.recompute_ops import recompute_classes
from autopar.solver.saved import regathered_operand

FLOAT = frozenset({"float64", "float32", "float16", "bfloat16"})

log = logging.getLogger("autopar.codegen")

Placements = tuple[Optional[Placement], ...]   # one per mesh axis (plan.mesh_axes order); None = keep


@dataclass(frozen=True)
class NodePlan:
    name: str                                  # FX node name
    key: str
    kind: str                                  # "input" | "param" | "buffer" | "op" | "output"
    target: str
    inputs: tuple[Optional[Placements], ...]   # per tensor input (NodeInfo.inputs order); None = keep
    output: Optional[Placements]               # None = keep what DTensor gives
    region: Optional[int] = None               # recompute region id
    param_name: Optional[str] = None
    strided: int = 0                           # a split of k equal chunks of a strided tp shard: k
    dtensor: bool = True                       # local-dp mode: False = runs on plain local tensors
    # tensor input positions whose edge, when it only all-gathers, keeps the shard for backward and
    # gathers again there (``solver/saved.regathered_operand``, ``runtime/regather.py``)
    regather: tuple[int, ...] = ()


@dataclass(frozen=True)
class ParamPlan:
    name: str              # canonical name in the original module
    shape: tuple[int, ...]
    dtype: str
    tp: Placement          # storage placement on the TENSOR axis (Replicate or Shard)
    uses: int              # parameter nodes of the graph that read it and have users
    strided: int = 1       # k > 1: rows are k equal blocks, each Shard(0)-split on TENSOR (fused QKV)
    group: int = -1        # ZeRO-3 forward gather group (``gather_groups.py``); -1: gathered alone
    # (axis, storage placement) per tensor axis of the stage mesh (``autopar.mesh.TENSOR_AXES``),
    # outermost first, TENSOR's being ``tp``; () = stored ``tp`` on TENSOR, Replicate elsewhere
    storage: tuple[tuple[str, Placement], ...] = ()

    def __post_init__(self) -> None:
        for axis, p in self.storage:
            if axis == TENSOR and p != self.tp:
                raise ValueError(f"parameter {self.name}: storage {p} on {TENSOR} but tp={self.tp}")

    def on(self, axis: str) -> Placement:
        """The storage placement on mesh axis ``axis`` (Replicate on DATA and non-tensor axes: ZeRO's
        rows are the runtime's own)."""
        return next((p for a, p in self.storage if a == axis), self.tp if axis == TENSOR else Replicate())

    def placements(self, axes) -> tuple[Placement, ...]:
        """The storage placement on each of ``axes`` (a mesh's axis names, in its order)."""
        return tuple(self.on(a) for a in axes)


@dataclass(frozen=True)
class Region:
    index: int
    kind: str                      # "layer" | op classes ("attention", "mlp_act+norm", ...)
    nodes: tuple[str, ...]         # FX names, graph order


@dataclass(frozen=True)
class RankProgram:
    mesh: Mesh                     # the plan's stage mesh: placements are one per axis, in its order
    zero_stage: int
    recompute: str
    nodes: tuple[NodePlan, ...]
    params: tuple[ParamPlan, ...]
    regions: tuple[Region, ...]
    unplanned: tuple[str, ...]     # op keys the plan has no strategy for (DTensor decides)
    local_dp: bool = False         # the DATA axis as plain local batch shards (see ``local_dp_nodes``)
    # cp > 1: the keys of the position sources the runtime replaces by its chunk's positions
    # (``solver/context.position_sources`` of a graph traced at the chunk's length; ``context_run.py``)
    positions: frozenset[str] = frozenset()
    # ... and, where DATA has size > 1, the keys of the nodes computed from them, parameters,
    # buffers and constants only (``GraphIR.batch_free``: a position embedding): their gradient
    # summands stay Partial on DATA up to the reducer, as a parameter's do. With cp their values
    # differ across the DATA axis' cp ranks (an all-reduce on the way would give each rank the sum
    # over all ranks' positions); without, an all-reduce there would only repeat the reducer's
    positional: frozenset[str] = frozenset()
    context: bool = False          # cp > 1: attention runs over the cp ranks (``context_run.py``)

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def base_key(key: str) -> str:
    return key.split("@", 1)[0]


def axis_index(mesh: Mesh, role: str) -> Optional[int]:
    """Position of the axis named ``role`` in ``mesh`` (None: the mesh has no such axis)."""
    return axis_position(mesh.axes, role)


def on_axis(placements: Optional[Placements], i: Optional[int], default=None):
    """``placements[i]``, or ``default`` when there are none or no axis ``i``."""
    return default if placements is None or i is None else placements[i]


def with_axis(placements: Placements, i: Optional[int], p) -> Placements:
    """``placements`` with entry ``i`` replaced by ``p`` (unchanged when ``i`` is None)."""
    return placements if i is None else placements[:i] + (p,) + placements[i + 1:]


def to_mesh(placements: tuple[Placement, ...], plan: Plan, where: str) -> Placements:
    """Plan placements, one per axis in ``plan.mesh_axes`` order, as the program keeps them. A
    single placement on a multi-axis plan is the TENSOR axis' (the other axes: None, keep); see
    the module docstring."""
    axes = tuple(plan.mesh_axes)
    if len(placements) == len(axes):
        out = tuple(placements)
    elif len(placements) == 1 and TENSOR in axes:
        out = tuple(placements[0] if a == TENSOR else None for a in axes)
    else:
        raise ValueError(f"{where}: {len(placements)} placements for mesh axes {axes}")
    # on an axis of one rank every placement holds the whole value: Replicate (DTensor would
    # otherwise refuse views that merge a dim "sharded" over one rank)
    return tuple(Replicate() if n == 1 and p is not None else p for p, n in zip(out, plan.mesh_shape))


def _strategies(plan: Plan) -> dict[str, NodeStrategy]:
    return {s.key: s for s in plan.strategies}


def _used_keys(graph: GraphIR) -> set[str]:
    return {r.key for n in graph.nodes for r in n.inputs}


def _param_dp_check(p: Optional[Placement], key: str) -> None:
    if p not in (None, Replicate(), Shard(0)):
        raise ValueError(f"parameter node {key}: {DATA} placement {p} is not supported (parameters are "
                         f"Replicate on {DATA}, or Shard(0) under ZeRO-3)")


def _batch_default(n: NodeInfo, graph: GraphIR, mesh: Mesh) -> Placements:
    """Replicate everywhere, Shard(0) on the DATA axis (size > 1) for a value carrying the batch."""
    carries = bool(n.outputs and n.out.shape and n.out.shape[0] == graph.batch_size and mesh.size_of(DATA) > 1)
    return tuple(Shard(0) if carries and a == DATA else Replicate() for a in mesh.axes)


def _regions(graph: GraphIR, recompute: str, layers: Optional[frozenset] = None,
             seq_len: Optional[int] = None) -> tuple[tuple[Region, ...], dict[str, int]]:
    """``layers``: under "full", only these layer ids recompute (``Plan.recomputed_layers``).
    Per-op recompute ("selective", "ops:..."): the regions ``solver/op_classes.py`` prices, one per
    connected group of a class's ops in each layer (``seq_len``: finds an unfused attention core)."""
    regions: list[Region] = []
    of: dict[str, int] = {}
    if recompute == "full":
        current: list[str] = []
        layer = None
        for n in graph.nodes:
            here = (n.block, n.layer_id) if n.kind == "op" and n.layer_id is not None else None
            if here is not None and layers is not None and n.layer_id not in layers:
                here = None
            if here != layer and current:
                regions.append(Region(len(regions), "layer", tuple(current)))
                current = []
            layer = here
            if here is not None:
                current.append(n.name)
        if current:
            regions.append(Region(len(regions), "layer", tuple(current)))
    elif recompute_classes(recompute):
        from autopar.solver.op_classes import layer_regions
        from autopar.solver.strategies import graph_facts

        name_of = {n.key: n.name for n in graph.nodes}
        for kind, keys in layer_regions(graph_facts(graph, seq_len), recompute_classes(recompute)):
            regions.append(Region(len(regions), kind, tuple(name_of[k] for k in keys)))
    elif recompute != "none":
        raise ValueError(f"plan.recompute={recompute!r} is not one of none, selective, full, ops:...")
    for r in regions:
        for name in r.nodes:
            of[name] = r.index
    return tuple(regions), of


SPLIT_TARGETS = ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default")


def _split_chunks(n: NodeInfo) -> tuple[int, int]:
    """(split dim, number of equal chunks) of a split node, or raise."""
    nd = len(n.out.shape)
    dim = n.args[2] if len(n.args) > 2 else dict(n.kwargs).get("dim", 0)
    dim = dim + nd if dim < 0 else dim
    k = len(n.outputs)
    sizes = {m.shape[dim] for m in n.outputs}
    if len(sizes) != 1:
        raise NotImplementedError(f"node {n.key}: a strided tp shard needs equal chunks, got {sorted(sizes)}")
    return dim, k


def _outer_tensor_layouts(graph: GraphIR, ins_of: dict, mesh: Mesh) -> None:
    """Raise ValueError for a node that would need a strided split or vocab-parallel cross-entropy
    on an outer tensor axis ("tp2", "tp3"): both are TENSOR-axis layouts only (module docstring)."""
    outer = [(a, axis_index(mesh, a)) for a in tensor_axes(mesh.axes) if a != TENSOR and mesh.size_of(a) > 1]
    if not outer:
        return
    by_key = {n.key: n for n in graph.nodes}
    for n in graph.nodes:
        ins = ins_of.get(n.name)
        if n.kind != "op" or not ins or ins[0] is None:
            continue
        for axis, i in outer:
            p = on_axis(ins[0], i)
            if not isinstance(p, Shard):
                continue
            if n.target in SPLIT_TARGETS and p.dim % len(n.out.shape) == _split_chunks(n)[0]:
                raise ValueError(f"node {n.key}: splits dim {p.dim}, which is sharded on the tensor axis {axis}; "
                                 f"a split of a sharded dim runs only on {TENSOR} (a strided layout): re-plan "
                                 f"with that split's input Replicate on {axis} or move the shard to {TENSOR}")
            logits = by_key[n.inputs[0].key].outputs if n.inputs else ()
            nd = len(logits[n.inputs[0].index or 0].shape) if logits else 0
            if n.target == "aten.cross_entropy_loss.default" and nd >= 2 and p.dim % nd == 1:
                raise ValueError(f"node {n.key}: cross-entropy logits class-sharded (Shard(1)) on the tensor axis "
                                 f"{axis}; vocab-parallel cross-entropy runs only on {TENSOR}: re-plan with the "
                                 f"logits' classes Replicate on {axis}")


def _strided_splits(graph: GraphIR, ins_of: dict, mesh: Mesh) -> tuple[dict[str, int], dict[str, int]]:
    """Split nodes run on local chunks (name -> k) and the parameters stored strided (name -> k)."""
    _outer_tensor_layouts(graph, ins_of, mesh)
    splits: dict[str, int] = {}
    params: dict[str, int] = {}
    if mesh.size_of(TENSOR) == 1:
        return splits, params
    ti = axis_index(mesh, TENSOR)
    by_key = {n.key: n for n in graph.nodes}
    for n in graph.nodes:
        if n.kind != "op" or n.target not in SPLIT_TARGETS or not ins_of.get(n.name):
            continue
        tp_in = on_axis(ins_of[n.name][0], ti)
        dim, k = _split_chunks(n)
        if not (isinstance(tp_in, Shard) and tp_in.dim % len(n.out.shape) == dim):
            continue
        producer = by_key[n.inputs[0].key]
        if producer.target != "aten.linear.default" or dim != len(producer.out.shape) - 1:
            raise NotImplementedError(
                f"node {n.key}: splitting a tp-sharded dim needs a strided layout, which the runtime "
                f"builds only for a column-parallel linear's output (producer here: {producer.target}); "
                "re-plan with that split Replicate on tp")
        splits[n.name] = k
        for r in producer.inputs[1:]:
            pn = by_key[r.key]
            if pn.kind == "param":
                params[pn.param_name or pn.key] = k
    return splits, params


def _has_shape_literal(args) -> bool:
    return any(isinstance(a, tuple) and any(isinstance(x, int) and not isinstance(x, bool) for x in a)
               for a in args)


def local_dp_nodes(graph: GraphIR, plan: Plan, *, single: bool = False) -> Optional[frozenset[str]]:
    """Local-dp mode: when the DATA axis is the only one of size > 1 (tp == 1), nodes whose DATA
    placement only carries the batch can run on plain tensors of the LOCAL batch (a graph traced at
    global_batch / dp: no DTensor dispatch, DDP's speed); ZeRO-3's parameters count as Replicate,
    as their consumers read them (``ParamStore`` gathers their rows at each use). Only nodes that
    reduce over the batch -- a Partial output on DATA, and everything after them (the loss) -- need
    DTensor's global semantics (an exact mean, ignore_index counts). Returns those nodes' keys, or None when the plan does not
    allow the mode (another axis of size > 1; a node whose DATA output is Replicate although an
    input is Shard, i.e. a batch reduction DTensor would all-reduce mid-graph; a strategy without a
    placement per axis; a batch not divisible by dp). ``single``: a stage mesh of one rank (dp == 1,
    a pipeline stage) runs on plain tensors too, every node (nothing reduces across ranks)."""
    mesh = plan.stage_mesh
    dp = mesh.size_of(DATA)
    # cp > 1: the DATA axis holds dp x cp ranks, and the batch it splits is folded (cp x the rows)
    if (dp == 1 and not single) or mesh.size != dp or (graph.batch_size * plan.context_parallel) % dp:
        return None
    di = axis_index(mesh, DATA)
    strategies = _strategies(plan)
    dp_out: dict[str, Optional[Placement]] = {}
    dtensor: set[str] = set()
    for n in graph.nodes:
        s = strategies.get(base_key(n.key))
        if s is None or len(s.output) != len(plan.mesh_axes):
            if n.kind in ("op", "input"):
                return None
            dp_out[n.key] = Replicate()
            continue
        out = to_mesh(s.output, plan, n.key)[di]
        if n.kind == "param" and plan.zero_stage == 3:
            out = Replicate()               # stored as rows, gathered before use: read whole
        dp_out[n.key] = out
        if n.kind != "op":
            continue
        ins = [dp_out.get(r.key) for r in n.inputs]
        if isinstance(out, Partial) or any(r.key in dtensor for r in n.inputs):
            if _has_shape_literal(n.args):
                return None                 # a global-shape literal on a local-batch graph
            dtensor.add(n.key)
        elif isinstance(out, Replicate) and any(isinstance(i, (Shard, Partial)) for i in ins):
            return None
    return frozenset(dtensor)


_LISTED = 5                              # node keys named per kind of mismatch


def _rank_of(n: NodeInfo) -> int:
    """The most dims among a node's outputs (a Shard dim beyond it is out of range for all)."""
    return max((len(m.shape) for m in n.outputs), default=0)


def _names(keys: list[str]) -> str:
    more = f", ... ({len(keys) - _LISTED} more)" if len(keys) > _LISTED else ""
    return ", ".join(k if k.isprintable() else repr(k) for k in keys[:_LISTED]) + more


def plan_fit_problems(graph: GraphIR, plan: Plan) -> list[str]:
    """How the plan's strategies disagree with ``graph``, the training trace of the model the plan
    was made for (full or collapsed, any batch): strategies for nodes the graph does not have;
    nodes the solver always plans (tensor-valued ops, and inputs, parameters and buffers that are
    read) without a strategy; strategies with another number of input placements than the node
    has tensor inputs; Shard dims beyond a tensor's dims. A plan file's fingerprint ties it to the
    model, not its strategies: these are what an edited or truncated file gets wrong."""
    keys = {n.key for n in graph.nodes} | {base_key(n.key) for n in graph.nodes}
    strategies = _strategies(plan)
    used = _used_keys(graph)
    by_key = {n.key: n for n in graph.nodes}
    out: list[str] = []
    unknown = [k for k in strategies if k not in keys]
    if unknown:
        out.append(f"strategies for {len(unknown)} node{'s' if len(unknown) > 1 else ''} the model does not "
                   f"have: {_names(unknown)}")
    missing = list(dict.fromkeys(
        base_key(n.key) for n in graph.nodes if base_key(n.key) not in strategies and n.outputs
        and (n.kind == "op" or (n.kind in ("input", "param", "buffer") and n.key in used))))
    if missing:
        out.append(f"no strategy for {len(missing)} of its nodes: {_names(missing)}")
    arity, dims = [], []
    for n in graph.nodes:
        s = strategies.get(base_key(n.key))
        if s is None or "@" in n.key:            # copies of layer 0 read layer 0's strategy: checked there
            continue
        if len(s.inputs) != len(n.inputs):
            arity.append(f"{n.key} ({len(s.inputs)} for {len(n.inputs)})")
            continue
        sides = [("output", s.output, n)]
        sides += [(f"input {i}", p, by_key[r.key]) for i, (p, r) in enumerate(zip(s.inputs, n.inputs))
                  if r.key in by_key]
        for side, placements, holder in sides:
            rank = _rank_of(holder)
            bad = [p.dim for p in placements if isinstance(p, Shard) and p.dim >= rank]
            if bad:
                shape = f" (shape {list(holder.outputs[0].shape)})" if len(holder.outputs) == 1 else ""
                dims.append(f"{n.key} shards dim {bad[0]} of its {side}, which has {rank} "
                            f"dim{'' if rank == 1 else 's'}{shape}")
    if arity:
        out.append(f"strategies whose input placements do not match the node's tensor inputs: {_names(arity)}")
    if dims:
        out.append(_names(dims))
    return out


def check_plan_fits(graph: GraphIR, plan: Plan) -> None:
    """``ValueError`` naming every ``plan_fit_problems`` (none: returns). Checked by
    ``compile_program`` on a training trace (one with the loss target) of a plan that has
    strategies; forward-only traces (``pm(x)``, eval mode) hold fewer nodes and are not checked."""
    problems = plan_fit_problems(graph, plan)
    if problems:
        raise ValueError(f"the plan does not fit the model {plan.model_name or graph.model_name!r}: "
                         + "; ".join(problems) + ". Re-plan with `autopar plan ... --json FILE` for this model "
                         "rather than editing the plan's strategies")


def compile_program(graph: GraphIR, plan: Plan, *, local_dp: Optional[frozenset[str]] = None) -> RankProgram:
    """The rank program for ``graph`` (a FULL trace: ``collapse_repeats=False``) under ``plan``, on
    one pipeline stage's mesh (with pp > 1 every stage runs a part of it: ``stages.py``).

    local_dp: ``local_dp_nodes(global graph, plan)`` to run in local-dp mode (``graph`` is then
    the trace at the local batch), None for DTensor everywhere."""
    mesh = plan.stage_mesh
    di = axis_index(mesh, DATA)
    parse_offload(plan.offload)                  # a clear ValueError for a bad value
    if not 0 <= plan.zero_stage <= 3:
        raise ValueError(f"plan.zero_stage={plan.zero_stage} is not 0..3")
    collapsed = [b.path for b in graph.blocks if b.traced != b.count]
    if collapsed:
        raise ValueError(f"the graph has collapsed repeated blocks {collapsed}; the runtime executes a "
                         "full trace (trace_model(..., collapse_repeats=False))")
    strategies = _strategies(plan)
    used = _used_keys(graph)
    regions, region_of = _regions(graph, plan.recompute, plan.recomputed_layers(), plan.seq_len)
    # offloaded activations: what is saved goes to the host as it is (no shard kept on the device)
    regather = {} if "activations" in parse_offload(plan.offload) else _regathered(
        graph, region_of, zero3=plan.zero_stage == 3)
    nodes: list[NodePlan] = []
    unplanned: list[str] = []
    param_storage: dict[str, tuple] = {}       # name -> ((tensor axis, storage placement), ...)
    param_meta: dict[str, tuple] = {}
    param_uses: dict[str, int] = {}
    for n in graph.nodes:
        s = strategies.get(base_key(n.key))
        where = f"node {n.key} ({n.name})"
        out = to_mesh(s.output, plan, where) if s is not None else None
        ins: tuple = tuple(to_mesh(p, plan, where) for p in s.inputs) if s is not None else ()
        if s is not None and len(ins) != len(n.inputs):
            log.warning("%s: the plan lists %d input placements for %d tensor inputs; inputs kept",
                        where, len(ins), len(n.inputs))
            ins = ()
        if n.kind == "input" and (out is None or (di is not None and out[di] is None)):
            default = _batch_default(n, graph, mesh)
            out = default if out is None else with_axis(out, di, default[di])
        if n.kind == "param":
            _param_dp_check(on_axis(out, di), n.key)
            storage = tuple((a, on_axis(out, axis_index(mesh, a), Replicate())) for a in tensor_axes(mesh.axes))
            for a, p in storage:
                if isinstance(p, Partial):
                    raise ValueError(f"parameter node {n.key}: a Partial placement on {a} is not a way "
                                     "to store a parameter")
            name = n.param_name or n.key
            param_meta.setdefault(name, (n.out.shape, n.out.dtype))
            if n.key in used:
                param_uses[name] = param_uses.get(name, 0) + 1
                param_storage.setdefault(name, storage)
        if n.kind == "op" and s is None and n.target != "getitem":
            unplanned.append(n.key)
        nodes.append(NodePlan(name=n.name, key=n.key, kind=n.kind, target=n.target,
                              inputs=ins, output=out, region=region_of.get(n.name),
                              param_name=n.param_name, regather=regather.get(n.key, ())))
    if plan.strategies and any(n.key == TARGET_KEY for n in graph.nodes):
        check_plan_fits(graph, plan)        # after the per-node checks above, which say more
    if local_dp is not None:
        nodes = [replace(n, dtensor=n.key in local_dp) for n in nodes]
    splits, strided = _strided_splits(graph, {n.name: n.inputs for n in nodes if n.inputs}, mesh)
    if splits:
        nodes = [replace(n, strided=splits.get(n.name, 0)) for n in nodes]
    param_tp = {name: dict(st).get(TENSOR, Replicate()) for name, st in param_storage.items()}
    for name, k in strided.items():
        if param_tp.get(name) != Shard(0):
            raise NotImplementedError(f"parameter {name} feeds a strided split but is stored "
                                      f"{param_tp.get(name)} on {TENSOR}, not Shard(0) (column parallel)")
        outer = [a for a, p in param_storage[name] if a != TENSOR and isinstance(p, Shard)
                 and p.dim % len(param_meta[name][0]) == 0]
        if outer:
            raise ValueError(f"parameter {name} is stored strided (fused QKV rows, on {TENSOR}) and also "
                             f"Shard(0) on {outer[0]}; re-plan with its rows Replicate on {outer[0]}")
    groups = gather_groups(graph, region_of) if plan.zero_stage == 3 else {}
    params = tuple(ParamPlan(name=name, shape=tuple(shape), dtype=dtype,
                             tp=param_tp.get(name, Replicate()), uses=param_uses.get(name, 0),
                             strided=strided.get(name, 1), group=groups.get(name, -1),
                             storage=param_storage.get(name, ()))
                   for name, (shape, dtype) in param_meta.items())
    if unplanned:
        log.info("plan has no strategy for %d op nodes (DTensor propagates): %s", len(unplanned),
                 ", ".join(unplanned[:6]) + (" ..." if len(unplanned) > 6 else ""))
    positions = positional = frozenset()
    if plan.context_parallel > 1:
        from autopar.solver.context import position_sources

        positions = position_sources(graph, plan.seq_len // plan.context_parallel)
    if mesh.size_of(DATA) > 1:
        positional = graph.batch_free(positions)
    return RankProgram(mesh=mesh, zero_stage=plan.zero_stage, recompute=plan.recompute,
                       nodes=tuple(nodes), params=params, regions=regions, unplanned=tuple(unplanned),
                       local_dp=local_dp is not None, positions=positions, positional=positional,
                       context=plan.context_parallel > 1)


def needs_grad(graph: GraphIR, received: Collection[str] = ()) -> dict[str, bool]:
    """Whether each node's value needs a gradient; ``received``: values a pipeline stage receives
    (they require a gradient when floating point)."""
    need: dict[str, bool] = {}
    for n in graph.nodes:
        if n.key in received:
            need[n.key] = bool(n.outputs) and n.out.dtype in FLOAT
        elif n.kind == "param":
            need[n.key] = True
        elif n.kind == "op":
            need[n.key] = bool(n.outputs) and n.outputs[0].dtype in FLOAT and any(
                need.get(r.key, False) for r in n.inputs)
        else:
            need[n.key] = False
    return need


def _regathered(graph: GraphIR, region_of: dict, zero3: bool) -> dict[str, tuple[int, ...]]:
    """Op key -> its ``NodePlan.regather`` positions. None inside recompute regions (the replay
    gathers again anyway, under ``torch.utils.checkpoint``'s own saved-tensor hooks), nor, under
    ZeRO-3, for a parameter (or a view of one): the shard kept would be ZeRO-3's gathered rows,
    which ``runtime/reshard.py`` frees after the forward."""
    need = needs_grad(graph)
    by_key = {n.key: n for n in graph.nodes}

    def param_view(key: str) -> bool:
        n = by_key[key]
        while n.kind == "op" and op_kind(n.target) == "free" and n.inputs:
            n = by_key[n.inputs[0].key]
        return n.kind == "param"

    out = {}
    for n in graph.nodes:
        if n.kind != "op" or region_of.get(n.name) is not None or not need.get(n.key, False):
            continue
        def grad(j, n=n):
            return j < len(n.inputs) and need.get(n.inputs[j].key, False)
        pos = tuple(i for i in range(len(n.inputs)) if regathered_operand(n.target, i, grad)
                    and not (zero3 and param_view(n.inputs[i].key)))
        if pos:
            out[n.key] = pos
    return out
