"""The collectives one rank of a pipelined plan (pp > 1) issues per step, from Plan + GraphIR alone:
``expected.py``'s counting rules applied to the stages the rank holds (``stages.cut_pipeline``), plus
the pipeline's own traffic, as ``runtime/pipeline.py`` issues and logs it:

- per micro-batch, each stage this rank holds (and the loss part, on the last stage's rank) runs its
  nodes through an executor of its own: its DTensor edges, vocab-parallel cross-entropy, the loss's
  all-reduces (loss part) and ZeRO-3's gathers of the parameters it reads (one scope per stage:
  ``expected.part_collectives``). A value the stage receives enters as the ``Wire``'s DTensor
  (``stages.wire_placements``: the plan's output placement, Replicate where it is Partial or left to
  DTensor): its edges start from that placement, and it needs a gradient when floating point.
- sending a boundary value (every stage, the last one's to the loss part too) redistributes it to its
  wire placement: an all_reduce, in forward, on each axis where the plan's output is Partial (its
  backward, Replicate -> Partial, is free). A value whose placement the plan leaves to DTensor is not
  predicted (as an edge from such a value in ``expected.py``).
- point-to-point sends of boundary activations and their gradients: ``stages.expected_sends``.
- tied parameters (read by stages on several pipeline ranks: tied embedding and head): one
  all_reduce over the pipeline of the tp-local gradient per parameter, after the schedule.
- the reducer and ZeRO-1/2's all_gather after the step, over the parameters this rank's stages hold.
- the step's loss broadcast over the pipeline from the last stage's rank (one fp32), once a step.

Phases: everything inside the schedule is logged in phase ``"pipeline"`` (``api._step``): the stages'
forward and backward collectives, which the schedule interleaves over micro-batches, so "forward" /
"backward" would not say when they ran; the tied all-reduce runs in the same phase, after the
schedule. The point-to-point sends carry "forward" (activations) or "backward" (their gradients), as
``StageModule`` logs them. The reducer's run in "step".

Not in the log, so not predicted: torch's own receives.
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Optional

from autopar.codegen.buckets import DEFAULT_BUCKET_BYTES
from autopar.codegen.expected_context import context_collectives
from autopar.codegen.edge_bytes import norm as _norm, piece_bytes as _piece_bytes
from autopar.codegen.expected import Collective, param_layouts, part_collectives, reducer_collectives
from autopar.codegen.program import RankProgram, compile_program, local_dp_nodes
from autopar.codegen.stages import PipelineCut, cut_pipeline, expected_sends, wire_placements
from autopar.ir import GraphIR
from autopar.mesh import PIPELINE, TENSOR_AXES
from autopar.placements import Partial
from autopar.plan import Plan, stage_rank

PHASE = "pipeline"          # api._step's log phase around the schedule


def rank_program(graph: GraphIR, plan: Plan, cut: PipelineCut, pp_rank: int, dp_mode: str = "auto") -> RankProgram:
    """The program a pipeline rank runs (``build.py``): the plan compiled on ``graph``, with the
    parameters of its stages only."""
    keys = local_dp_nodes(graph, plan, single=True) if dp_mode == "auto" else None
    program = compile_program(graph, plan, local_dp=keys)
    held = cut.params_of(graph, _stages_of(plan, cut, pp_rank))
    return dataclasses.replace(program, params=tuple(p for p in program.params if p.name in held))


def tensor_coords(mesh, coord: tuple[int, ...]) -> dict[str, int]:
    """The rank's coordinate on each tensor axis of the stage mesh (``mesh.TENSOR_AXES``: "tp" and any
    outer "tp2" / "tp3"), by axis name, from its stage-mesh coordinate ``coord``: the ``tp_rank``
    ``expected.part_collectives`` / ``param_layouts`` / ``reducer_collectives`` take."""
    return {a: int(c) for a, c in zip(mesh.axes, coord) if a in TENSOR_AXES}


def _stages_of(plan: Plan, cut: PipelineCut, pp_rank: int) -> list[int]:
    return [sc.index for sc in cut.stages if stage_rank(plan.pipeline_schedule, plan.pp, sc.index) == pp_rank]


def expected_pipeline_collectives(graph: GraphIR, plan: Plan, *, pp_rank: int, coord: tuple[int, ...],
                                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, backend: str = "gloo",
                                  dp_mode: str = "auto", program: Optional[RankProgram] = None,
                                  cut: Optional[PipelineCut] = None,
                                  fused: Collection[str] = ()) -> list[Collective]:
    """One step's collectives on the rank at pipeline coordinate ``pp_rank`` and stage-mesh
    coordinate ``coord`` (``graph``: the FULL trace at one global micro-batch; ``program``: this
    rank's, ``rank_program``'s when None). See the module docstring."""
    if cut is None:
        cut = cut_pipeline(graph, plan)
    if program is None:
        program = rank_program(graph, plan, cut, pp_rank, dp_mode)
    mesh = program.mesh
    tp_rank = tensor_coords(mesh, coord)
    key_of = {n.name: n.key for n in graph.nodes}
    nplan = {n.key: n for n in program.nodes}
    by_key = {n.key: n for n in graph.nodes}
    mine = _stages_of(plan, cut, pp_rank)
    last = len(cut.stages) - 1

    def wire(names) -> dict:
        return {key_of[x]: wire_placements(nplan[key_of[x]].output, len(mesh.axes)) for x in names}

    per_micro_batch: list[Collective] = []
    for s in mine:
        sc = cut.stages[s]
        per_micro_batch += part_collectives(graph, program, backend=backend, tp_rank=tp_rank, fused=fused,
                                            part={key_of[x] for x in sc.nodes}, received=wire(sc.recv),
                                            phases=(PHASE, PHASE))
        per_micro_batch += _send_redistributions(program, sc.send, key_of, nplan, by_key)
        per_micro_batch += context_collectives(graph, program, plan.context_parallel, plan.context_parallel_mode,
                                               phases=(PHASE, PHASE), part={key_of[x] for x in sc.nodes})
    if last in mine:
        per_micro_batch += part_collectives(graph, program, backend=backend, tp_rank=tp_rank, fused=fused,
                                            loss_key=key_of[cut.loss_output], part={key_of[x] for x in cut.loss},
                                            received=wire(cut.stages[last].send), phases=(PHASE, PHASE))
    out = per_micro_batch * plan.num_micro_batches
    out += expected_sends(graph, plan, cut, program, tuple(coord), pp_rank)
    out += _tied(graph, plan, cut, program, pp_rank, tp_rank)
    out.append(Collective("broadcast", PIPELINE, 4, PHASE, "pipeline"))      # the step's loss
    out += reducer_collectives(program, bucket_bytes, tp_rank)
    return out


def _send_redistributions(program: RankProgram, send, key_of: dict, nplan: dict, by_key: dict) -> list[Collective]:
    """``Wire.send`` of each value in ``send``: Partial -> Replicate on each axis (forward).
    ``nplan`` / ``by_key``: the program's node plans and the graph's nodes by key."""
    mesh = program.mesh
    sizes = tuple(mesh.shape)
    out = []
    for name in send:
        key = key_of[name]
        np_ = nplan[key]
        if np_.output is None or (program.local_dp and not np_.dtensor):
            continue
        meta = by_key[key].out
        pl = tuple(None if p is None else _norm(p, len(meta.shape)) for p in np_.output)
        for ax, p in enumerate(pl):
            if sizes[ax] > 1 and isinstance(p, Partial):
                out.append(Collective("all_reduce", mesh.axes[ax], _piece_bytes(meta, pl, sizes, ax, "all_reduce"),
                                      PHASE, "dtensor"))
    return out


def _tied(graph: GraphIR, plan: Plan, cut: PipelineCut, program: RankProgram, pp_rank: int,
          tp_rank: dict[str, int]) -> list[Collective]:
    """``PipelineRunner._sum_tied_grads``: per parameter this rank holds that stages on another
    pipeline rank hold too, an all_reduce of its tensor-local gradient over those ranks (``tp_rank``:
    the rank's coordinate on each tensor axis, ``tensor_coords``)."""
    holders: dict[str, set[int]] = {}
    for sc in cut.stages:
        for name in cut.params_of(graph, [sc.index]):
            holders.setdefault(name, set()).add(stage_rank(plan.pipeline_schedule, plan.pp, sc.index))
    out = []
    for lay in param_layouts(program, tp_rank):
        ranks = holders.get(lay.name, set())
        if len(ranks) > 1 and pp_rank in ranks:
            out.append(Collective("all_reduce", PIPELINE, lay.nbytes, PHASE, "tied"))
    return out
