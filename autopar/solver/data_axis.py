"""Placements on the data-parallel axis (``mesh.DATA``), from the op rules like every other axis.

On DATA a node's strategies are its rule's (``strategies.enumerate_strategies`` on ``dp`` ranks),
except that parameters and buffers are Replicate there: the reducer sums their gradients and
ZeRO realizes its own layout (ZeRO-3 stores Shard(0) and gathers the rows before each use; the
plan says so on the parameter's output, its consumers read it Replicate).

The batch shards. The rules carry the batch dim through every op that keeps it
(``GraphFacts.batch_dims``); a sum or mean over it gives a Partial, and what is computed from
Partials alone stays Partial where the rule is linear (``batch_shard_placements``). Such an
assignment moves nothing on DATA: producer and consumer agree on every edge in forward, and in
backward the only gradients that do not come back as they went out are the Partial summands of
values computed from parameters alone (a position embedding read by batch-sharded ops), which the
runtime keeps Partial up to the reducer, as a parameter's (``RankProgram.positional``; the DATA
tables price those edges so). It also divides every batch-carrying op's work by dp (no strategy
divides it more) and keeps the least memory, so it is an optimum of the DATA axis' ILP whenever
each op's rule offers it (other optima differ in ties, such as a view's placement):
``unbatched_ops`` checks that once per graph (on every built-in model it holds: no DATA tables
are built, nothing is solved; ``tests/solver/test_data_axis.py`` solves them anyway).

Elsewhere -- a reduction over the batch that does not sum (``amax``, ``var``, ``norm``), an op
without a rule reading batch-sharded data (``aten.one_hot``), an op whose rule has no batch shard
-- the DATA axis is solved like an outer tensor axis (``tensor_axes.py``): its tables are built
on the tensors of the dp ranks' micro-batch (dp x mbs rows) as one rank of the solved tensor axes
holds them, its ILP picks each node's placement (an all-gather of the batch before an
``amax``, ...), and the innermost tensor axis is solved again given that choice, so compute and
memory are those of the local tensors; the DATA axis' collectives are added to the step
(``dp:all_gather``, ...). Context parallelism (which folds the sequence into DATA's batch) is not
offered there (``context.context_problem``).
"""
from __future__ import annotations

from dataclasses import replace

from autopar.cost.collectives import axis_link
from autopar.mesh import DATA, TENSOR
from autopar.placements import Partial, Placement, Replicate, Shard
from autopar.solver.problem import splits_rows, summarize
from autopar.solver.rules import find_rule
from autopar.solver.strategies import GraphFacts, input_meta, tensor_nodes
from autopar.solver.tensor_axes import axis_tables, solve_axis, with_outer_axes


def batch_shard_placements(facts: GraphFacts, keys, zero: int) -> tuple[dict, dict]:
    """The batch shards (module docstring): (DATA placement of each node's output, of each tensor
    as its consumers read it). Activations are Shard(batch dim); parameters Replicate, stored
    Shard(0) under ZeRO-3 (read Replicate); values reduced over the batch and what is computed
    from them Partial; ops with no rule (``facts.unknown_targets``) Replicate."""
    out, read = {}, {}
    for k in keys:
        n = facts.nodes[k]
        if n.kind in ("param", "buffer"):
            out[k] = Shard(0) if (zero == 3 and n.kind == "param") else Replicate()
            read[k] = Replicate()
            continue
        bd = facts.batch_dims.get(k)
        if bd:
            out[k] = Shard(min(bd))
        elif n.target in facts.unknown_targets:
            out[k] = Replicate()
        elif any(isinstance(read.get(r.key), (Shard, Partial)) for r in facts.inputs[k]):
            out[k] = Partial()
        else:
            out[k] = Replicate()
        read[k] = out[k]
    return out, read


def unbatched_ops(facts: GraphFacts) -> tuple[str, ...]:
    """Op nodes whose rule does not offer the batch shards' placements (module docstring): an op
    reading a batch shard or a Partial without a rule, or whose rule has no strategy with exactly
    those inputs and that output, or whose batch dim is not a whole multiple of the traced batch
    (a split batch need not divide by dp). Empty: the batch shards are the DATA axis' optimum."""
    nodes = tensor_nodes(facts.graph)
    out, read = batch_shard_placements(facts, [n.key for n in nodes], 0)
    metas = {n.key: n.outputs for n in nodes}
    b0 = facts.graph.batch_size
    bad = []
    for n in nodes:
        if n.kind != "op":
            continue
        want = tuple(read.get(r.key, Replicate()) for r in facts.inputs[n.key])
        if isinstance(out[n.key], Replicate) and all(isinstance(p, Replicate) for p in want):
            continue                                  # the batch does not reach it
        fn = find_rule(n.target)
        if fn is None:
            bad.append(n.key)
            continue
        ins = [input_meta(facts, n, i, metas) for i in range(len(want))]
        if not any(p.output == out[n.key] and tuple(p.inputs) == want and not p.comms for p in fn(n, ins, n.outputs)):
            bad.append(n.key)
        elif isinstance(out[n.key], Shard) and any(m.shape and m.shape[out[n.key].dim] % b0 for m in n.outputs):
            bad.append(n.key)
    return tuple(bad)


def data_placements(facts: GraphFacts, keys, zero: int, axes: tuple) -> tuple[dict, dict]:
    """(DATA placement of each node's output, of each node's inputs in order) for the plan: the
    DATA axis' solved choice where ``axes`` holds one, else the batch shards."""
    solved = [(tab, choice) for a, tab, choice in axes if a == DATA]
    if not solved:
        out, read = batch_shard_placements(facts, keys, zero)
        ins = {k: tuple(read.get(r.key, Replicate()) for r in facts.inputs[k]) for k in keys}
        return out, ins
    tab, choice = solved[0]
    out, ins = {}, {}
    for k in keys:
        s = tab.strategies[k][choice[k]] if k in choice else None
        if s is None:
            out[k], ins[k] = Replicate(), tuple(Replicate() for _ in facts.inputs[k])
            continue
        p: Placement = s.output
        if facts.nodes[k].kind == "param" and zero == 3:
            p = Shard(0)                  # ZeRO-3's rows, gathered before use (read Replicate)
        out[k], ins[k] = p, tuple(s.inputs) + tuple(Replicate() for _ in facts.inputs[k][len(s.inputs):])
    return out, ins


def solve_data_axis(searcher, tables, choice, axes: tuple, cfg):
    """The DATA axis of ``cfg`` solved given the tensor axes' solution (``tables`` and ``choice``
    of the innermost axis, ``axes`` the outer ones' (axis, tables, choice)), then the innermost
    tensor axis again given it (module docstring): (inner tables, inner choice, combined summary,
    outer axes with DATA's (axis, tables, choice) last)."""
    rows = cfg.mbs * cfg.dp                         # the dp ranks' micro-batch
    solved = {a: (tab, ch) for a, tab, ch in axes}
    solved[TENSOR] = (tables, choice)
    facts = searcher.facts

    free = facts.graph.batch_free()

    def runtime_layout(key: str, s) -> bool:
        n = facts.nodes[key]
        if n.kind in ("param", "buffer"):             # stored and read Replicate: the gradients
            return isinstance(s.output, Replicate)    # stay the reducer's Partial summands
        if n.kind == "input":                         # each rank is given its rows of the batch
            bd = facts.batch_dims.get(key)
            return s.output == (Shard(min(bd)) if bd else Replicate())
        return all(isinstance(p, Replicate) for p, r in zip(s.inputs, facts.inputs[key])
                   if facts.nodes[r.key].kind in ("param", "buffer"))

    data_tab = axis_tables(searcher, DATA, cfg.dp, solved, axis_link(searcher.cluster, (cfg.data, cfg.tp), 0),
                           sp=False, mbs=rows, cp=cfg.cp, cp_mode=cfg.cp_mode, also=runtime_layout)
    # a parameter's gradient summands are summed by the reducer (ZeRO: reduce-scattered), which the
    # step prices (``overlap.dp_sync``), and so are those of values computed from parameters alone
    # (the runtime keeps them Partial on DATA: ``RankProgram.positional``): their edges move
    # nothing on DATA in backward
    data_tab = replace(data_tab, _edge_cache={}, edges=tuple(
        replace(e, grad=False) if facts.nodes[e.u].kind in ("param", "buffer") or e.u in free else e
        for e in data_tab.edges))
    data_choice = solve_axis(searcher, data_tab)
    outer = {a: v for a, v in solved.items() if a != TENSOR}
    outer[DATA] = (data_tab, data_choice)
    # each op works on its rank's rows where DATA splits it, on all dp x mbs where not
    split = {k: cfg.mbs if splits_rows(data_tab.strategies[k][data_choice[k]]) else rows for k in data_tab.keys}
    inner = axis_tables(searcher, TENSOR, tables.t, outer, tables.link, sp=cfg.sp, mbs=rows, cp=cfg.cp,
                        cp_mode=cfg.cp_mode, rows=split)
    inner = replace(inner, mbs=cfg.mbs)           # built on dp x mbs rows; each rank's share is mbs
    inner_choice = solve_axis(searcher, inner)
    out_axes = tuple((a, tab, ch) for a, (tab, ch) in outer.items())
    summary = with_outer_axes(summarize(inner, inner_choice), out_axes, cfg.tp)
    lk = facts.loss_key
    if lk in data_choice and not isinstance(data_tab.strategies[lk][data_choice[lk]].output, Partial):
        # the batch is gathered before the loss: every dp rank holds it whole and returns it as it is,
        # with no one-value all-reduces over the batch shards (``overlap.loss_scalars_s``)
        summary = replace(summary, loss_scalars=0)
    return inner, inner_choice, summary, out_axes
