"""Plan + GraphIR -> the pipeline cut: which nodes of the FULL traced graph each stage runs, what it
receives from the stage before it and what it sends to the stage after it.

Assignment, for the stages of ``plan.stages`` (each holds the repeated block's layers
``[first_layer, last_layer)``):

- a node of the repeated block runs on the stage that holds its layer;
- the loss: every node that depends on the target (``|target|0``) forms the *loss part*, run on the
  last stage by the schedule's ``loss_fn`` (``torch.distributed.pipelining`` hands the target to
  the loss function only);
- a node outside the block that depends on the model inputs runs on the first stage if it comes
  before the block's first node in graph order (embedding), else on the last stage (head);
- "free" nodes, which depend on no model input (parameters, buffers, constants, position
  ``arange``\\s, RoPE tables): on every stage that reads them (recomputed, never sent); one that
  nobody reads (an in-place buffer update) where its position puts it, as above;
- a ``getitem`` runs with the node it picks from (values sent between stages are tensors).

A value made on stage s and read on stage t > s goes s -> s+1 -> ... -> t: ``torch.distributed.
pipelining`` sends only between neighbouring stages, so stages in between pass it on. Stage k's
``recv`` lists what stage k-1 sends (its ``send``), in one order both sides agree on; the last
stage's ``send`` is what the loss part reads (in a forward-only graph: the model's output).
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

from autopar.codegen.shards import local_ranges
from autopar.ir import DTYPE_BYTES, TARGET_KEY, GraphIR, NodeInfo
from autopar.placements import Partial, Replicate
from autopar.plan import Plan, stage_rank



@dataclass(frozen=True)
class StageCut:
    """One stage's share of the graph: FX node names, graph order."""
    index: int
    nodes: tuple[str, ...]         # nodes this stage runs (placeholders it reads included)
    recv: tuple[str, ...]          # values received from stage index - 1 (empty on stage 0)
    send: tuple[str, ...]          # values sent to stage index + 1 (last stage: to the loss part)


@dataclass(frozen=True)
class PipelineCut:
    stages: tuple[StageCut, ...]
    loss: tuple[str, ...]          # the loss part's nodes (run on the last stage), graph order
    loss_output: str               # the node whose value is the loss (forward only: the model output)
    inputs: tuple[str, ...]        # model-input placeholders (fed to stage 0), in input order
    target: str                    # the target placeholder (fed to the loss part); "" forward only

    def params_of(self, graph: GraphIR, stage_indices) -> frozenset[str]:
        """Canonical names of the parameters the given stages read (the loss part counts as the
        last stage's)."""
        by_name = {n.name: n for n in graph.nodes}
        names: set[str] = set()
        last = len(self.stages) - 1
        for i in stage_indices:
            part = self.stages[i].nodes + (self.loss if i == last else ())
            names |= {by_name[x].param_name for x in part if by_name[x].kind == "param"}
        return frozenset(names)


def cut_pipeline(graph: GraphIR, plan: Plan) -> PipelineCut:
    """The stages of ``plan`` on ``graph`` (a full trace: every layer present); see the module
    docstring. Raises ``ValueError`` for a graph the cut cannot serve."""
    stages = plan.stages
    if not stages:
        raise ValueError("the plan lists no stages")
    blocks = {n.block for n in graph.nodes if n.block is not None}
    if len(blocks) != 1:
        raise ValueError(f"a pipeline cut needs one repeated block, this graph has {len(blocks)}; "
                         "re-plan with --force pp=1")
    n_stages = len(stages)
    layer_stage = {}
    for st in stages:
        for layer in range(st.first_layer, st.last_layer):
            layer_stage[layer] = st.index
    layers = {n.layer_id for n in graph.nodes if n.block is not None}
    if max(layer_stage) >= len(layers):
        raise ValueError(f"the plan's stages hold layers 0..{max(layer_stage)}, the model has {len(layers)}; "
                         "re-plan for this model")
    keys = {n.key: n for n in graph.nodes}
    inputs = [n for n in graph.nodes if n.kind == "input" and n.key != TARGET_KEY]
    target = next((n for n in graph.nodes if n.key == TARGET_KEY), None)
    out = next(n for n in graph.nodes if n.kind == "output")
    # what reads the last stage's values: the loss part, or (a forward-only graph) the output
    loss_keys = graph.dependents({target.key}) if target is not None else set()
    sink = loss_keys if target is not None else {out.key}
    dyn = graph.dependents({n.key for n in inputs}) - loss_keys
    block_ops = [i for i, n in enumerate(graph.nodes) if n.block is not None and n.kind == "op"]
    first_block, last_block = block_ops[0], block_ops[-1]
    position = {n.key: i for i, n in enumerate(graph.nodes)}
    users: dict[str, list[NodeInfo]] = {n.key: [] for n in graph.nodes}
    for n in graph.nodes:
        for r in n.inputs:
            users[r.key].append(n)

    home: dict[str, int] = {}               # dyn and block nodes: the one stage that computes them

    def by_position(n: NodeInfo) -> int:
        if position[n.key] < first_block or n.kind != "op":
            return 0
        if position[n.key] > last_block:
            return n_stages - 1
        raise ValueError(f"node {n.name} ({n.target}) sits between the repeated layers but belongs to none "
                         "of them; a pipeline cut cannot place it")

    for n in graph.nodes:
        if n.kind == "output" or n.key in loss_keys:
            continue
        if n.block is not None:
            if n.layer_id not in layer_stage:
                raise ValueError(f"layer {n.layer_id} of {n.block} is in no stage of the plan (its stages "
                                 f"cover layers 0..{max(layer_stage)}); re-plan for this model")
            home[n.key] = layer_stage[n.layer_id]
        elif n.target == "getitem" and n.inputs and n.inputs[0].key in home:
            home[n.key] = home[n.inputs[0].key]
        elif n.key in dyn or n.kind == "input":
            home[n.key] = by_position(n)
    for n in graph.nodes:                   # a getitem of a block node keeps its producer's stage
        if n.target == "getitem" and n.inputs and n.inputs[0].key in home:
            home[n.key] = home[n.inputs[0].key]

    # free nodes: on every stage (or the loss part) that reads them, through other free nodes
    need: dict[str, set] = {}               # free node key -> stages ("loss" for the loss part)
    for n in reversed(graph.nodes):
        if n.kind == "output" or n.key in home or n.key in loss_keys:
            continue
        where: set = set()
        for u in users[n.key]:
            if u.key in loss_keys:
                where.add("loss")
            elif u.key in home:
                where.add(home[u.key])
            else:
                where |= need.get(u.key, set())
        if not where and n.kind == "op":
            where = {by_position(n)}        # read by nobody: an in-place update, where it sits
        need[n.key] = where

    runs: dict = {i: [] for i in range(n_stages)}
    runs["loss"] = []
    for n in graph.nodes:
        if n.kind == "output":
            continue
        if n.key in loss_keys:
            runs["loss"].append(n.name)
        elif n.key in home:
            runs[home[n.key]].append(n.name)
        else:
            for s in need[n.key]:
                runs[s].append(n.name)

    # values crossing stages: made on stage s, read on stage t > s (the loss part counts as stage
    # n_stages, after the last)
    crossing: dict[int, list[str]] = {i: [] for i in range(n_stages)}   # sent from stage i to i + 1
    for n in graph.nodes:
        if n.key not in home:
            continue
        s = home[n.key]
        readers = [n_stages if u.key in sink else home[u.key] for u in users[n.key]
                   if u.key in sink or u.key in home]
        if any(r < s for r in readers):
            raise ValueError(f"node {n.name} runs on stage {s} but an earlier stage reads it")
        for k in range(s, max(readers, default=s)):    # stage n_stages: the loss part
            crossing[k].append(n.name)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    cuts = []
    for i in range(n_stages):
        send = tuple(sorted(crossing[i], key=order.__getitem__))
        recv = tuple(sorted(crossing[i - 1], key=order.__getitem__)) if i else ()
        cuts.append(StageCut(i, tuple(runs[i]), recv, send))
    if target is None:                      # forward only: the model's output, sent by the last stage
        loss_output = out.inputs[-1].key
    else:
        loss_output = next((r.key for r in reversed(out.inputs) if r.key in loss_keys), None)
        if loss_output is None:
            raise ValueError("the graph's output does not depend on the target: no loss to pipeline")
    return PipelineCut(stages=tuple(cuts), loss=tuple(runs["loss"]), loss_output=keys[loss_output].name,
                       inputs=tuple(n.name for n in inputs), target=target.name if target is not None else "")


_MEAN_OPS = ("aten.mean.default", "aten.mean.dim")
_SUM_OPS = ("aten.sum.default", "aten.sum.dim_IntList")
_PASS_THROUGH = ("aten._to_copy.default", "aten.clone.default", "aten.view.default", "aten.reshape.default",
                 "aten.squeeze.default", "aten.alias.default", "aten.detach.default")


def loss_reduction(graph: GraphIR) -> str:
    """How the traced loss combines its batch rows: "mean" or "sum" (micro-batch losses are then
    averaged or added). Read off the op that makes the loss (through casts and views): an op with a
    ``reduction`` argument (cross_entropy, nll, mse, ...: 1 mean, 2 sum), ``mean`` or ``sum``.
    ``ValueError`` for anything else: splitting the batch would need to know."""
    by_key = {n.key: n for n in graph.nodes}
    out = next(n for n in graph.nodes if n.kind == "output")
    node = by_key[out.inputs[-1].key]
    while node.target in _PASS_THROUGH and node.inputs:
        node = by_key[node.inputs[0].key]
    if node.target in _MEAN_OPS:
        return "mean"
    if node.target in _SUM_OPS:
        return "sum"
    op = _aten_op(node.target)
    if op is not None:
        names = [a.name for a in op._schema.arguments]
        if "reduction" in names:
            i = names.index("reduction")
            given = dict(node.kwargs)
            value = node.args[i] if i < len(node.args) else given.get("reduction", op._schema.arguments[i].default_value)
            if value in (1, 2):
                return "mean" if value == 1 else "sum"
    raise ValueError(f"the loss ends in {node.target} ({node.source or node.name}), which is neither a mean "
                     "nor a sum over the batch; several micro-batches need to know how to combine their "
                     "losses: end the loss with .mean() or .sum(), or re-plan with --force microbatches=1")


def _aten_op(target: str):
    """``"aten.mse_loss.default"`` -> the OpOverload (None if it is not one)."""
    import torch

    parts = target.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    packet = getattr(torch.ops.aten, parts[1], None)
    return getattr(packet, parts[2], None) if packet is not None else None


def wire_placements(output: Optional[tuple], ndim_mesh: int) -> tuple:
    """The placements a value crosses a stage boundary in (one per stage-mesh axis): the plan's
    output placement, Replicate where it says "keep" (None) or Partial."""
    want = output if output is not None else (None,) * ndim_mesh
    return tuple(Replicate() if w is None or isinstance(w, Partial) else w for w in want)


def expected_sends(graph: GraphIR, plan: Plan, cut: PipelineCut, program, coord: tuple[int, ...],
                   pp_rank: int) -> list:
    """The point-to-point sends one step costs the rank at stage-mesh coordinate ``coord`` and
    pipeline coordinate ``pp_rank`` (``graph``: the micro-batch trace): per micro-batch, each of its
    stages but the last sends its boundary values forward (this rank's shards), and each but the
    first sends their gradients back (the same bytes, for the floating-point ones)."""
    from autopar.codegen.expected import Collective
    from autopar.mesh import PIPELINE

    metas = {n.name: n.out for n in graph.nodes if n.outputs}
    plans = {n.name: n for n in program.nodes}
    mesh = program.mesh

    def shard_bytes(name: str) -> int:
        meta = metas[name]
        pl = wire_placements(plans[name].output, len(mesh.axes))
        ranges = local_ranges(meta.shape, pl, mesh.shape, coord)
        n = 1
        for a, b in ranges:
            n *= b - a
        return n * DTYPE_BYTES[meta.dtype]

    floating = ("float64", "float32", "float16", "bfloat16")
    last = len(cut.stages) - 1
    out = []
    for _ in range(plan.num_micro_batches):
        for sc in cut.stages:
            if stage_rank(plan.pipeline_schedule, plan.pp, sc.index) != pp_rank:
                continue
            if sc.index < last:
                out.append(Collective("send", PIPELINE, sum(shard_bytes(x) for x in sc.send), "forward", "p2p"))
            out += [Collective("send", PIPELINE, shard_bytes(x), "backward", "p2p")
                    for x in sc.recv if metas[x].dtype in floating]
    return out
