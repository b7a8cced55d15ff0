"""The outer search space: the configurations (tp, pp, dp, micro-batch, ZeRO, recompute, sequence
parallel, pipeline schedule and stages per rank) the forced choices allow, and a one-line
``PlanningError`` for forced choices that cannot work (``check_force``) or leave no configuration
(``no_config_error``). ``search.py`` evaluates what ``outer_configs`` lists."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from autopar.cost.flops import pipeline_schedule_problem
from autopar.ir import GraphIR
from autopar.plan import V_SCHEDULES, parse_offload, split_backward_problem
from autopar.solver.errors import PlanningError
from autopar.solver.forcing import Force
from autopar.solver.tensor_axes import tensor_shape
from autopar.solver.timing import OuterConfig

# Largest stages per rank the search tries unless vpp is forced: each doubling halves the
# interleaved bubble but doubles the stage-to-stage traffic, and each v tried adds configurations.
MAX_FREE_VPP = 4
RECOMPUTES = ("none", "selective", "full", "partial")    # partial: full on the first K layers per rank


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2_divisors(n: int) -> list[int]:
    out, d = [], 1
    while d <= n:
        if n % d == 0:
            out.append(d)
        d *= 2
    return out


# ---- model facts used to validate forced choices ------------------------------------------------

def model_dims(graph: GraphIR) -> dict:
    """Attention heads (from SDPA's query), hidden size (last dim of the block's input), layers.
    A convolutional model has no hidden size here: the last dim of its activations is spatial
    (the channels, which tp splits, are dim 1)."""
    nodes = {n.key: n for n in graph.nodes}
    heads = hidden = None
    conv = any(n.kind == "op" and n.target.split(".")[1:2] in (["conv1d"], ["conv2d"], ["conv3d"], ["convolution"])
               for n in graph.nodes)
    for n in graph.nodes:
        if "scaled_dot_product_attention" in n.target and n.inputs:
            q = nodes[n.inputs[0].key].outputs[0]
            if len(q.shape) == 4:
                heads = q.shape[1]
        if hidden is None and not conv and n.block is not None and n.kind == "op" and n.inputs:
            src = nodes.get(n.inputs[0].key)
            if src is not None and src.block is None and src.outputs and len(src.out.shape) >= 2:
                hidden = src.out.shape[-1]
    layers = graph.blocks[0].count if len(graph.blocks) == 1 else 1
    return {"heads": heads, "hidden": hidden, "layers": layers}


def _family_problem(shape: tuple[int, ...], dims: dict) -> str:
    """Why the multi-axis tensor mesh ``shape`` does not fit the model ("" when it does): every
    side must divide the hidden size, the inner one the attention heads."""
    for q in sorted(set(shape)):
        if dims["hidden"] and dims["hidden"] % q:
            return f"{q} does not divide the hidden size {dims['hidden']}"
    if dims["heads"] and dims["heads"] % shape[-1]:
        return f"its inner axis of {shape[-1]} ranks does not divide the {dims['heads']} attention heads"
    return ""


def tensor_shapes(force: Force, tp: int, dims: Optional[dict]) -> list[tuple[int, ...]]:
    """The tensor meshes the search tries for ``tp`` ranks (``tensor_axes.tensor_shape``; ():
    one axis): the forced family's; else one axis and, for a model with a hidden size
    (``model_dims``), each multi-axis family of ``tp`` that fits it (2-D q x q, 2.5-D d x q x q
    with the widest grid, 3-D q x q x q; one shape once). Sequence parallelism splits the sequence
    on the innermost axis of any of them (``tensor_axes.py``) when forced on."""
    if force.tensor_parallel_mode is not None:
        return [tensor_shape(force.tensor_parallel_mode, tp)]
    out: list[tuple[int, ...]] = [()]
    if dims is None or not dims["hidden"] or tp < 4:
        return out
    for mode in ("2d", "2.5d", "3d"):
        try:
            shape = tensor_shape(mode, tp)
        except PlanningError:
            continue
        if shape not in out and not _family_problem(shape, dims):
            out.append(shape)
    return out


def check_force(force: Force, graph: GraphIR, world: int, global_batch: int, seq_len: Optional[int] = None) -> None:
    dims = model_dims(graph)
    if force.offload not in (None, "none") and "params" in parse_offload(force.offload) \
            and force.zero_stage not in (None, 3):
        raise PlanningError(f"offload={force.offload} offloads params, which needs ZeRO-3 (the host holds each "
                            f"rank's rows and they are gathered before use); force zero=3 or drop params")
    for name, v in (("tp", force.tp), ("pp", force.pp), ("dp", force.dp)):
        if v is not None and world % v:
            raise PlanningError(f"{name}={v} does not divide the {world} GPUs of the cluster")
    mode = force.tensor_parallel_mode
    if mode not in (None, "1d"):
        if force.tp is None:
            raise PlanningError(f"tpmode={mode} needs the total tensor degree: force tp too, e.g. "
                                f"tp={ {'2d': 4, '2.5d': 8, '3d': 8}[mode] },tpmode={mode}")
        shape = tensor_shape(mode, force.tp)
        problem = _family_problem(shape, dims)
        if problem:
            raise PlanningError(f"tpmode={mode} lays tp={force.tp} out as {'x'.join(map(str, shape))}, and {problem}; "
                                f"force another tp or tpmode (tpmode=1d: one axis)")
    elif force.tp is not None and force.tp > 1:
        if dims["heads"] and dims["heads"] % force.tp:
            raise PlanningError(f"tp={force.tp} does not divide the {dims['heads']} attention "
                                f"head{'s' if dims['heads'] > 1 else ''}; {_use_tp(dims['heads'], world)}")
        if dims["hidden"] and dims["hidden"] % force.tp:
            raise PlanningError(f"tp={force.tp} does not divide the hidden size {dims['hidden']}; "
                                f"{_use_tp(dims['hidden'], world)}")
    if force.pp is not None and force.pp > 1:
        if len(graph.blocks) != 1:
            raise PlanningError(f"pp={force.pp} needs one repeated block to cut into stages; "
                                f"this model has {len(graph.blocks)}")
        if dims["layers"] < force.pp:
            raise PlanningError(f"pp={force.pp} needs >= {force.pp} layers (one per stage) but the model has "
                                f"{dims['layers']}; use pp <= {dims['layers']}")
    _check_degree_product(force, world, dims["layers"], len(graph.blocks) == 1, global_batch)
    _check_schedule_force(force, world, dims["layers"], len(graph.blocks) == 1, global_batch)
    if force.dp is not None and global_batch % force.dp:
        raise PlanningError(f"dp={force.dp} does not divide the global batch {global_batch}; use a batch divisible "
                            f"by {force.dp} or a dp that divides {global_batch}")
    if force.sequence_parallel and force.tp == 1:
        raise PlanningError("sequence parallelism needs tp > 1 (it shards the sequence over the tp group)")
    _check_recompute_force(force, graph, seq_len)


def _check_recompute_force(force: Force, graph: GraphIR, seq_len: Optional[int]) -> None:
    """A forced per-op recompute names classes the graph has (``op_classes``)."""
    from autopar.recompute_ops import recompute_classes
    from autopar.solver.op_classes import present_classes

    cs = recompute_classes(force.recompute) if force.recompute else None
    if not cs or cs == ("attention",):       # "selective" keeps meaning attention, as it always has
        return
    have = present_classes(graph, seq_len)
    missing = [c for c in cs if c not in have]
    if missing:
        raise PlanningError(f"recompute={force.recompute}: the model has no {', '.join(missing)} ops to recompute "
                            f"(op classes found in its layers: {', '.join(have) or 'none'})")


def _use_tp(n: int, world: int) -> str:
    """What to force instead: the tp degrees that divide both ``n`` and the world."""
    ok = [d for d in _divisors(n) if world % d == 0]
    return "use tp=1 (no tensor parallelism)" if ok == [1] else "use tp=" + " or ".join(map(str, ok))


def _check_degree_product(force: Force, world: int, layers: int, has_block: bool, global_batch: int) -> None:
    """The forced degrees multiply to the world, or leave a whole, usable degree for the free axis."""
    given = {n: v for n, v in (("dp", force.dp), ("tp", force.tp), ("pp", force.pp)) if v is not None}
    if len(given) < 2:
        return
    cp = force.context_parallel or 1
    prod = cp
    for v in given.values():
        prod *= v
    shown = " * ".join(f"{n}({v})" for n, v in given.items()) + (f" * cp({cp})" if cp > 1 else "")
    if len(given) == 3:
        if prod != world:
            raise PlanningError(f"Invalid parallel dims: {shown} = {prod} != WORLD_SIZE({world}); "
                                f"choose degrees whose product is {world}")
        return
    free = next(n for n in ("dp", "tp", "pp") if n not in given)
    if world % prod:
        raise PlanningError(f"Invalid parallel dims: {shown} = {prod} does not divide WORLD_SIZE({world}), "
                            f"so no {free} completes them; choose degrees whose product divides {world}")
    rest = world // prod
    if free == "pp" and rest > 1 and (not has_block or layers < rest):
        why = (f"the {layers} layers do not fill {rest} stages of >= 1 layer" if has_block
               else "this model has no repeated block to cut into stages")
        raise PlanningError(f"Invalid parallel dims: {shown} = {prod} leaves pp = {world} / {prod} = {rest}, "
                            f"but {why}; force degrees whose product is {world}")
    if free == "dp" and global_batch % rest:
        raise PlanningError(f"{shown} = {prod} leaves dp = {world} / {prod} = {rest}, which does not divide "
                            f"the global batch {global_batch}; use a batch divisible by {rest} or other degrees")


def _check_schedule_force(force: Force, world: int, layers: int, has_block: bool, global_batch: int) -> None:
    """A forced schedule / vpp that cannot work: one line saying what to change."""
    sched, v = force.schedule, force.virtual_stages
    if sched is None and v is None:
        return
    pinned = ",".join(x for x in (f"schedule={sched}" if sched else "", f"vpp={v}" if v else "") if x)
    if force.pp == 1 or (force.pp is None and world == 1) or not has_block:
        if sched in (None, "1f1b") and v in (None, 1):
            return
        why = "this model has no repeated block to cut into stages" if not has_block else "pp=1 has no pipeline"
        raise PlanningError(f"{pinned} needs a pipeline (pp > 1) but {why}; drop {pinned} or force pp > 1")
    if sched is not None and v is not None:
        if sched in ("gpipe", "1f1b") and v != 1:
            raise PlanningError(f"schedule={sched} runs one stage per rank: vpp={v} needs schedule=interleaved_1f1b "
                                f"or interleaved_zb (or drop vpp)")
        if sched in V_SCHEDULES and v != 2:
            raise PlanningError(f"schedule={sched} runs exactly 2 stages per rank; use vpp=2 (or drop vpp)")
        if sched.startswith("interleaved") and v < 2:
            raise PlanningError(f"schedule={sched} needs vpp >= 2 stages per rank; use schedule=1f1b for vpp=1")
    need = (v or (2 if sched and sched not in ("gpipe", "1f1b") else 1)) * (force.pp or 2)
    if need > layers:
        raise PlanningError(f"{pinned} with pp={force.pp or 2} needs {need} stages of >= 1 layer but the model has "
                            f"{layers} layers; use a smaller pp or vpp")
    if force.pp and force.pp > 1 and force.dp and sched:
        m = force.num_micro_batches or (global_batch // force.dp // force.micro_batch_size
                                        if force.micro_batch_size and global_batch % (force.dp * force.micro_batch_size) == 0
                                        else None)
        vs = [v] if v else ([1] if sched in ("gpipe", "1f1b") else [2])
        why = pipeline_schedule_problem(sched, force.pp, vs[0], m, layers) if m else None
        if why:
            raise PlanningError(why)
    if sched and force.recompute and force.recompute != "none":
        why = split_backward_problem(sched, force.recompute, force.tp or 1, force.context_parallel or 1,
                                     force.dp or 1, force.zero_stage or 0, force.offload or "none")
        if why:
            raise PlanningError(why)


def _schedules(force: Force, pp: int, layers: int) -> list[tuple[str, int]]:
    """(schedule, stages per rank) candidates for pp ranks (forced ones only, when forced)."""
    if pp == 1:
        return [("1f1b", 1)]
    # v: powers of two up to MAX_FREE_VPP dividing the layers per rank (an even split of each rank's
    # share); a forced vpp may be any value with pp * vpp <= layers (the cut is then uneven).
    vs = []
    v = 2
    while v <= MAX_FREE_VPP and pp * v <= layers and (layers // pp) % v == 0:
        vs.append(v)
        v *= 2
    # gpipe only when forced: it has 1f1b's bubble and holds m >= min(pp - r, m) micro-batches on
    # every rank with the same cut, so 1f1b is never slower and never larger (exact pruning).
    out = [("1f1b", 1)] + ([("gpipe", 1)] if force.schedule == "gpipe" else [])
    out += [("interleaved_1f1b", v) for v in vs]
    # the zero-bubble schedules (run exactly by runtime/pipeline.py): the step model prices their
    # split backward (cost.split_backward: host time, recompute regions replayed per weight-pass
    # group, gradients held from B to W), so they compete freely; the combinations the runtime
    # refuses (recompute regions issuing collectives) are filtered in _configs_of
    out += [("interleaved_zb", v) for v in vs]
    if 2 * pp <= layers:
        out += [("zbv", 2)]
    # dualpipev only when forced: torch 2.13 runs its overlapped F&B one after the other, so it has
    # zbv's bubble, needs m >= 2 pp and holds one more chunk per rank (never better than zbv)
    if 2 * pp <= layers and force.schedule == "dualpipev":
        out += [("dualpipev", 2)]
    if force.virtual_stages is not None and force.virtual_stages not in vs + [1]:
        out += [(s, force.virtual_stages) for s in ("interleaved_1f1b", "interleaved_zb")]
    return [(s, v) for s, v in out if (force.schedule is None or s == force.schedule)
            and (force.virtual_stages is None or v == force.virtual_stages)]


# ---- enumeration ----------------------------------------------------------------------------------

def outer_configs(force: Force, world: int, layers: int, has_block: bool, global_batch: int,
                  cp_options=None, offload_free: bool = False, recomputes=None,
                  dims: Optional[dict] = None) -> list[OuterConfig]:
    """Every configuration the forced values allow. ``cp_options(rest, tp)``: the (cp, mode)
    pairs for ``rest`` = dp x cp ranks (``context.cp_choices``; None: cp = 1 only). Each carries
    the forced offload (else "none"); ``offload_free`` (the search's offload pass) adds ZeRO-3
    on a single data rank, which only params offload makes worth having. ``recomputes``: the
    recompute candidates (``op_classes.recompute_candidates``; None: ``RECOMPUTES``). ``dims``
    (``model_dims``): the multi-axis tensor families are tried too (``tensor_shapes``)."""
    tps = [force.tp] if force.tp else _divisors(world)
    pps = [force.pp] if force.pp else [p for p in _divisors(world) if p <= layers and (has_block or p == 1)]
    out = []
    for tp, pp in ((tp, pp) for tp in tps for pp in pps if world % (tp * pp) == 0):
        rest = world // (tp * pp)
        for cp, cp_mode in (cp_options(rest, tp) if cp_options else [(1, "none")]):
            base = _configs_of(force, tp, pp, rest // cp, cp, cp_mode, layers, global_batch, offload_free, recomputes)
            for shape in tensor_shapes(force, tp, dims):      # () for one axis (tensor_axes.py)
                # several axes: sequence parallelism where forced on (its larger tables cost the
                # free search ~10% more solving, for no gain on the plans measured)
                out += [replace(c, tp_shape=shape) if shape else c for c in base
                        if not shape or c.sp == bool(force.sequence_parallel)]
    return out


def _configs_of(force: Force, tp: int, pp: int, dp: int, cp: int, cp_mode: str, layers: int,
                global_batch: int, offload_free: bool = False, recomputes=None) -> list[OuterConfig]:
    out: list[OuterConfig] = []
    if (force.dp and dp != force.dp) or global_batch % dp:
        return out
    per_replica = global_batch // dp
    if force.micro_batch_size:
        mbss = [force.micro_batch_size]
    elif force.num_micro_batches:
        mbss = [per_replica // force.num_micro_batches] if per_replica % force.num_micro_batches == 0 else []
    else:
        mbss = _pow2_divisors(per_replica)
    for mbs in mbss:
        if per_replica % mbs:
            continue
        m = per_replica // mbs
        if force.num_micro_batches and m != force.num_micro_batches:
            continue
        scheds = [sv for sv in _schedules(force, pp, layers)
                  if pipeline_schedule_problem(sv[0], pp, sv[1], m, layers) is None]
        if not scheds:
            continue
        sps = [force.sequence_parallel] if force.sequence_parallel is not None else \
            ([False, True] if tp > 1 else [False])
        zeros = [force.zero_stage] if force.zero_stage is not None else \
            ([0, 1, 2, 3] if dp * cp > 1 else ([0, 3] if offload_free else [0]))
        rcs = [force.recompute] if force.recompute else list(recomputes or RECOMPUTES)
        for sp in sps:
            if sp and tp == 1:
                continue
            for z in zeros:
                for rc in rcs:
                    for sched, v in scheds:
                        # the offload pass may add params offload to ZeRO-3 later (offload_choice): check it
                        off = force.offload or ("optimizer+params" if offload_free and z == 3 else "none")
                        if split_backward_problem(sched, rc, tp, cp, dp, z, off):
                            continue             # the runtime refuses it
                        out.append(OuterConfig(tp, pp, dp, mbs, m, rc, z, sp, sched, v,
                                               cp=cp, cp_mode=cp_mode, offload=force.offload or "none"))
    return out


def no_config_error(force: Force, world: int, global_batch: int, layers: int) -> PlanningError:
    forced = ", ".join(f"{k}={v}" for k, v in force.items())
    if force.micro_batch_size or force.num_micro_batches:
        return PlanningError(
            f"no (tp, pp, dp) lets mbs={force.micro_batch_size or '?'} / micro-batches="
            f"{force.num_micro_batches or '?'} divide the global batch {global_batch} on {world} GPUs "
            f"(mbs must divide global_batch / dp, and a pipeline needs at least pp micro-batches)")
    if force.schedule or force.virtual_stages:
        return PlanningError(f"no configuration of {world} GPUs can run the forced values ({forced}): the "
                             f"schedule needs >= pp micro-batches (interleaved: a multiple of max(1, m // pp); "
                             f"dualpipev: >= 2 pp) and >= 1 of the {layers} layers per stage; force pp and mbs that "
                             f"allow it")
    rows = global_batch // force.dp if force.dp and global_batch % force.dp == 0 else None
    if force.pp and force.pp > 1 and rows is not None and rows < force.pp:
        return PlanningError(f"no configuration of {world} GPUs runs the forced values ({forced}): a pipeline of "
                             f"pp={force.pp} needs >= {force.pp} micro-batches of >= 1 row, and dp={force.dp} leaves "
                             f"{rows} row{'s' if rows > 1 else ''} of the global batch {global_batch} a rank; use a "
                             f"global batch of >= {force.pp * force.dp}, a smaller dp or pp <= {rows}")
    return PlanningError(f"no parallel configuration of {world} GPUs with the forced values ({forced}) divides the "
                         f"global batch {global_batch} and the {layers} layers (tp x pp x dp x cp = {world}; dp "
                         f"divides the batch; a pipeline needs >= pp micro-batches and >= 1 layer a stage); force "
                         f"fewer values or other ones")
