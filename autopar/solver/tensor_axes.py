"""Tensor parallelism over several mesh axes: 2-D (q x q), 2.5-D (d x q x q), 3-D (q x q x q).

The tensor-parallel group of ``tp`` ranks is laid out as one mesh axis ("1d", Megatron) or as
several (``tensor_shape``): "2d" q x q (SUMMA / Optimus), "2.5d" d x q x q (Tesseract: d
layers of a q x q grid), "3d" q x q x q. The axes are named ``mesh.TENSOR_AXES`` from the inside
out: "tp" innermost (adjacent ranks), then "tp2", "tp3". Each node gets a placement on EVERY axis,
and DTensor runs the combination: what the families' papers do with explicit broadcasts and
reductions, the placements do with the all-gathers, reduce-scatters and all-reduces DTensor's
redistribution issues on each axis (e.g. SUMMA's broadcasts of A and B blocks are, byte for byte,
an all-gather of the activation along one axis and of the weight along the other).

Solved per axis (the ILP's strategy space would grow as s^k with k axes):
1. the innermost axis alone, on the whole tensors (the 1-D tables of its size);
2. each outer axis with the inner choices fixed (``AxisBackground``): its tables are built on the
   tensors as one rank of the solved axes holds them (each node's outputs divided along the dims
   they shard), its nodes' work scaled by the share each rank keeps, and its strategies never shard
   a dim another axis already shards (nested shards of one dim are left out);
3. the innermost axis again, given the outer axes' choices, so that its costs are those of the
   local tensors too.
The combined summary is step 3's (compute and memory per rank are those of all axes' shards)
with every axis' collectives added, named by axis ("tp:all_reduce", "tp2:all_gather", ...).
This is coordinate descent, not the joint optimum. Steps 2-3 repeat as sweeps (each outer axis
given every other axis' latest choice, then the inner one), up to ``MAX_SWEEPS`` in all, while
the combined time per micro-batch falls (``_combined_s``), where the family is forced
(``--force tpmode=...``: ``search._Searcher.solution``): LLaMA-3 8B on 64 H100s, forced 3-D
(2 x 2 x 2) and 2-D (2 x 2), went from 1.608 to 1.550 s and from 1.174 to 1.137 s per predicted
step (-3.6%, -3.1%); GPTs of hidden 4096 (2 x 2) and 8192 (8 x 8) and gpt-tiny's 2-D, 2.5-D and
3-D plans did not move. The free search, which tries the families beside the single axis, ranks
them on one sweep: more took the 1M-token LLaMA-3 8B plan from 4.4 to 6.1 s of solving (the same
plan, 1-D), and sweeping only its winner further did not find those gains (the better plans were
other configurations' once swept). A configuration whose plan does not fit runs the
memory-constrained ILP (``memory_constraints.memory_constraints``) on the inner axis' tables of step 3, the
outer axes' choices kept.
Sequence parallelism applies to the innermost axis.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from autopar.cost.collectives import axis_link
from autopar.cost.tensor_parallel import parse_tp_mode
from autopar.ir import TensorMeta
from autopar.mesh import DATA, TENSOR, TENSOR_AXES
from autopar.placements import Partial, Replicate, Shard
from autopar.solver.errors import PlanningError
from autopar.solver.ilp import solve_ilp
from autopar.solver.problem import (AxisBackground, AxisSummary, AxisTables, build_tables, fill_cache, ilp_problem,
                                    summarize)

CROSS_ENTROPY = "aten.cross_entropy_loss.default"
EMBEDDING = "aten.embedding.default"
MAX_SWEEPS = 3                 # coordinate-descent sweeps over the tensor axes (module docstring)


def tensor_shape(mode: Optional[str], tp: int) -> tuple[int, ...]:
    """The tensor mesh of ``tp`` ranks for ``mode``, outermost axis first; () for "1d" (one axis).
    PlanningError, naming the fix, when ``tp`` has no such shape."""
    if mode is None or parse_tp_mode(mode) == "1d":
        return ()
    mode = parse_tp_mode(mode)
    if mode == "2d":
        q = math.isqrt(tp)
        if q >= 2 and q * q == tp:
            return (q, q)
        raise PlanningError(f"tpmode=2d lays tp out as q x q ranks, and tp={tp} is not a square of q >= 2; "
                            "force tp=4, 9, 16, ... (or tpmode=1d)")
    if mode == "3d":
        q = round(tp ** (1 / 3))
        if q >= 2 and q ** 3 == tp:
            return (q, q, q)
        raise PlanningError(f"tpmode=3d lays tp out as q x q x q ranks, and tp={tp} is not a cube of q >= 2; "
                            "force tp=8, 27, 64, ... (or tpmode=2d / 2.5d)")
    # 2.5d: d x q x q with depth d >= 2; the widest grid q (the papers' d <= q keeps the grid wide)
    for q in range(math.isqrt(tp), 1, -1):
        if tp % (q * q) == 0 and tp // (q * q) >= 2:
            return (tp // (q * q), q, q)
    raise PlanningError(f"tpmode=2.5d lays tp out as d x q x q ranks (d, q >= 2), and tp={tp} has no such shape; "
                        "force tp=8, 16, 18, 32, ... (or tpmode=1d / 2d)")


def axis_names(shape: tuple[int, ...]) -> tuple[str, ...]:
    """The mesh axes of a tensor shape (outermost first): ("tp2", "tp") for 2-D, ... ."""
    if len(shape) > len(TENSOR_AXES):
        raise ValueError(f"at most {len(TENSOR_AXES)} tensor axes, got the shape {shape}")
    return TENSOR_AXES[len(TENSOR_AXES) - len(shape):]


def _local_metas(metas: dict, solved: dict) -> dict:
    """``metas`` as one rank of the ``solved`` axes holds them: each node's outputs divided along
    the dim its chosen output placement shards on each axis (``solved``: axis -> (tables, choice))."""
    out = dict(metas)
    for tab, choice in solved.values():
        for k in tab.keys:
            p = tab.strategies[k][choice[k]].output
            if isinstance(p, Shard):
                out[k] = tuple(_split(m, p.dim, tab.t) for m in out[k])
    return out


def _split(m: TensorMeta, dim: int, t: int) -> TensorMeta:
    if not m.shape:
        return m
    d = dim % len(m.shape)
    return TensorMeta(m.shape[:d] + (max(1, m.shape[d] // t),) + m.shape[d + 1:], m.dtype)


def _sharded_dims(solved: dict) -> dict:
    """key -> (output dims, per-input dims, whether the output is Partial) of the ``solved`` axes."""
    out: dict = {}
    for tab, choice in solved.values():
        for k in tab.keys:
            s = tab.strategies[k][choice[k]]
            o, ins, partial = out.get(k, (frozenset(), (), False))
            ins = ins or tuple(frozenset() for _ in s.inputs)
            o = o | ({s.output.dim} if isinstance(s.output, Shard) else set())
            ins = tuple(d | ({p.dim} if isinstance(p, Shard) else set()) for d, p in zip(ins, s.inputs))
            out[k] = (o, ins, partial or isinstance(s.output, Partial))
    return out


def _work(solved: dict) -> dict:
    """op key -> the share of its work one rank of the ``solved`` tensor axes does (the data
    axis' share is in the rows each op works on: ``axis_tables``' ``rows``)."""
    out: dict = {}
    for tab, choice in solved.values():
        if tab.axis == DATA:
            continue
        for k in tab.keys:
            out[k] = out.get(k, 1.0) * tab.strategies[k][choice[k]].compute_scale
    return out


def _allowed(graph_nodes: dict, sharded: dict):
    """The strategy filter of an axis given the others (module docstring): no dim sharded twice,
    no strided split (the runtime realizes it on "tp" only), no vocab-parallel loss off "tp" (the
    loss may split its rows only), and a vocab-parallel embedding (a Partial output: DTensor masks
    the ids out of one axis' vocab range) only where no other axis splits its table, and the
    other way round."""
    def allowed(key: str, s) -> bool:
        if s.name == "strided":
            return False
        dims_out, dims_in, partial = sharded.get(key, (frozenset(), (), False))
        if isinstance(s.output, Shard) and s.output.dim in dims_out:
            return False
        if any(isinstance(p, Shard) and p.dim in dims for p, dims in zip(s.inputs, dims_in)):
            return False
        n = graph_nodes.get(key)
        if n is None:
            return True
        if n.target == EMBEDDING and s.inputs:
            table_split = bool(dims_in and dims_in[0])
            if (isinstance(s.output, Partial) and (table_split or dims_out)) or \
                    (partial and not isinstance(s.inputs[0], Replicate)):
                return False
        return not (n.target == CROSS_ENTROPY and s.inputs and isinstance(s.inputs[0], Shard)
                    and s.inputs[0].dim != 0)
    return allowed


def axis_tables(searcher, axis: str, t: int, solved: dict, link, sp: bool, mbs: int, cp: int, cp_mode: str,
                also=None, rows: Optional[dict] = None) -> AxisTables:
    """The tables of ``axis`` (``t`` ranks) given the ``solved`` axes' choices (module docstring),
    on the tensors of a micro-batch of ``mbs`` rows; ``also(key, strategy)``: one more filter;
    ``rows``: the rows each op works on where not ``mbs`` (``AxisBackground.rows``)."""
    base = fill_cache(searcher.facts, searcher.cluster, mbs, searcher.dtype, searcher.profile,
                      searcher.cache(mbs, cp), cp)
    metas = _local_metas(base["metas"], solved)
    cache = {"metas": metas, "protos": dict(base["protos"]), "kept": base["kept"], "copies": base["copies"]}
    nodes = {n.key: n for n in searcher.facts.graph.nodes}
    by_axes = _allowed(nodes, _sharded_dims(solved))
    allowed = by_axes if also is None else (lambda k, s: by_axes(k, s) and also(k, s))
    bg = AxisBackground(axis, link, _work(solved), allowed, rows, batch_only=axis == DATA)
    return build_tables(searcher.facts, searcher.cluster, t, sp and axis == TENSOR, mbs, searcher.dtype,
                        searcher.profile, cache, cp=cp, cp_mode=cp_mode, background=bg)


def solve_axis(searcher, tab: AxisTables) -> dict:
    """One axis' ILP (no solve where every node has one strategy): key -> strategy index."""
    if all(len(tab.strategies[k]) == 1 for k in tab.keys):
        return {k: 0 for k in tab.keys}
    r = solve_ilp(ilp_problem(tab))
    searcher.record(r)
    return {k: r.choice[i] for i, k in enumerate(tab.keys)}


def solve_axes(searcher, shape: tuple[int, ...], sp: bool, mbs: int, cp: int, cp_mode: str,
               sweeps: Optional[int] = None):
    """(inner tables, inner choice, combined summary, ((axis, tables, choice) of the outer axes))
    for the tensor mesh ``shape`` (module docstring), in up to ``sweeps`` sweeps (default
    ``MAX_SWEEPS``)."""
    names = axis_names(shape)
    tables = dict(sp=sp, mbs=mbs, cp=cp, cp_mode=cp_mode)
    mesh_shape = (1,) + tuple(shape)
    links = {a: axis_link(searcher.cluster, mesh_shape, i + 1) for i, a in enumerate(names)}
    first = searcher.solution(shape[-1], sp, mbs, cp, cp_mode)                     # the whole tensors
    best = _sweep(searcher, shape, {TENSOR: (first.tables, first.choice)}, links, tables)
    for _ in range((MAX_SWEEPS if sweeps is None else sweeps) - 1):
        solved = {a: (tab, choice) for a, tab, choice in best[3]}
        solved[TENSOR] = best[:2]
        again = _sweep(searcher, shape, solved, links, tables)
        if _combined_s(again[2]) >= _combined_s(best[2]) * (1 - 1e-9):
            break
        best = again
    return best


def _sweep(searcher, shape: tuple[int, ...], solved: dict, links: dict, tables: dict):
    """One coordinate-descent sweep: each outer axis (tp2, then tp3) solved given every other axis'
    choice in ``solved`` (the inner axis' included), then the inner axis given the outer ones."""
    names = axis_names(shape)
    solved = dict(solved)
    for axis, t in reversed(tuple(zip(names[:-1], shape[:-1]))):                 # tp2, then tp3
        tab = axis_tables(searcher, axis, t, {a: v for a, v in solved.items() if a != axis}, links[axis], **tables)
        solved[axis] = (tab, solve_axis(searcher, tab))
    outer = {a: v for a, v in solved.items() if a != TENSOR}
    inner_tab = axis_tables(searcher, TENSOR, shape[-1], outer, links[TENSOR], **tables)
    inner_choice = solve_axis(searcher, inner_tab)
    axes = tuple((a, tab, choice) for a, (tab, choice) in outer.items())
    return inner_tab, inner_choice, with_outer_axes(summarize(inner_tab, inner_choice), axes, math.prod(shape)), axes


def _combined_s(summary: AxisSummary) -> float:
    """Seconds per micro-batch of a combined summary: every part's compute and its axes' exposed
    collectives, a layer counted for each copy (what a sweep must lower to be kept)."""
    return sum((p.fwd_s + p.bwd_s) * (summary.count if name == "block" else 1) for name, p in summary.parts.items())


def with_outer_axes(inner: AxisSummary, axes: tuple, tp: int) -> AxisSummary:
    """``inner`` (tables local to every axis) with the collectives of the outer ``axes`` ((axis,
    tables, choice) each; () for one axis: ``inner`` as it is) added. Its ILP objective stays the
    inner axis' (a lower bound of the whole)."""
    if not axes:
        return inner
    outers = [summarize(tab, choice) for _, tab, choice in axes]
    parts = {}
    for name, p in inner.parts.items():
        cf, cb = dict(p.comm_fwd), dict(p.comm_bwd)
        for o in outers:
            for src, dst in ((o.parts[name].comm_fwd, cf), (o.parts[name].comm_bwd, cb)):
                for k, sec in src.items():
                    dst[k] = dst.get(k, 0.0) + sec
        parts[name] = replace(p, comm_fwd=cf, comm_bwd=cb)
    return replace(inner, t=tp, parts=parts)


