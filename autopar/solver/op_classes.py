"""Per-operator recompute: the op classes of each layer, their checkpoint regions, and what the
regions drop (``autopar/recompute_ops.py`` has the vocabulary).

The same functions serve the solver (collapsed trace, ``problem.build_tables``) and codegen (the
full trace, ``codegen/program.py``), so that the plan's regions are the ones priced.

Regions, per layer (op nodes of one (block, layer id)), from aten targets only:

- ``attention``: the attention core (``core_nodes``: fused SDPA / flash, or the non-view ops whose
  output has two sequence dims) and, when it is unfused, the matmuls that read the core (P x V);
- ``mlp_act``: activations (``ACTIVATIONS``), the ``mul`` reading one (SwiGLU's gate x up), then
  repeatedly the matmul producers of a member whose every reader is a member (the up-projections);
- ``norm``: the norms (``NORMS``) and the matmuls reading their output.

The regions of the classes chosen are merged where they share a node; the views between members
join them. A region whose inputs from outside are not all computed before its first member (the
executor runs a region at its first member) is left out, by the solver and codegen alike.

What a set of regions drops (``torch.utils.checkpoint``, non-reentrant: a region keeps its inputs,
everything its ops save is recomputed): an op's output kept for backward (``saved.kept_tensors``)
is dropped when the op is inside a region and nothing outside that region saves it (directly or
through views) nor reads it as the input of another region; an output that nothing saved becomes
kept when a region reads it (``extra``)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

from autopar.cost.compute import op_kind
from autopar.recompute_ops import OP_CLASSES, recompute_name
from autopar.solver.rules import base_name
from autopar.solver.saved import kept_tensors, saves_input
from autopar.solver.strategies import GraphFacts

ACTIVATIONS = frozenset({"gelu", "silu", "relu", "mish", "softplus", "elu", "leaky_relu", "hardswish",
                         "hardsigmoid", "sigmoid", "tanh", "gelu_", "silu_", "relu_"})
ALIASING = frozenset({"contiguous"})      # may return its input (no copy): treated as a view here
NORMS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "group_norm", "batch_norm",
                   "_fused_rms_norm", "native_batch_norm"})


@dataclass(frozen=True)
class OpSet:
    """The regions of one set of op classes (``name``: canonical ``Plan.recompute``)."""
    name: str
    classes: tuple
    regions: tuple            # (kind, keys in graph order) per region
    members: frozenset        # op and view keys inside a region
    drop: frozenset           # op keys whose kept output the regions drop
    extra: frozenset          # op keys whose output only a region's input keeps
    region_drop: tuple        # per region, its dropped keys (re-materialized in its backward)


def core_nodes(facts: GraphFacts) -> frozenset:
    """Attention core: fused SDPA nodes and ops whose output has two sequence dims (scores)."""
    core = set()
    for k in facts.part:
        n = facts.nodes[k]
        if "scaled_dot_product" in n.target or "flash" in n.target:
            core.add(k)
        elif len(facts.seq_dims.get(k, ())) >= 2 and op_kind(n.target) != "free":
            core.add(k)
    return frozenset(core)


class _Graph:
    """Reachability through views (``op_kind`` "free") on the op nodes of ``facts``."""

    def __init__(self, facts: GraphFacts, alias: bool = False):
        self.facts = facts
        self.order = {n.key: i for i, n in enumerate(facts.graph.nodes)}
        # views, and ``contiguous``: after a fused attention (whose output is laid out (B, S, H, D) and
        # returned transposed) it aliases its input, so a reader saving it keeps the attention output
        self.free = {k for k in facts.part if op_kind(facts.nodes[k].target) == "free"
                     or (alias and base_name(facts.nodes[k].target) in ALIASING)}
        self._readers: dict = {}

    def readers(self, key: str) -> tuple:
        """Non-view op nodes reading ``key`` directly or through views: (reader, views on the way)."""
        if key not in self._readers:
            out, stack, seen = [], [(key, ())], set()
            while stack:
                k, path = stack.pop()
                for c, _ in self.facts.consumers.get(k, ()):
                    if c in seen or c not in self.facts.part:
                        continue
                    seen.add(c)
                    if c in self.free:
                        stack.append((c, path + (c,)))
                    else:
                        out.append((c, path))
            self._readers[key] = tuple(out)
        return self._readers[key]

    def source(self, key: str) -> tuple[Optional[str], tuple]:
        """The non-view producer a value comes from through views, and the views on the way."""
        path = []
        while key in self.free:
            ins = self.facts.inputs.get(key, ())
            if not ins:
                return None, tuple(path)
            path.append(key)
            key = ins[0].key
        return (key if key in self.facts.part else None), tuple(path)


def _layers(facts: GraphFacts) -> dict:
    out: dict = {}
    for k in facts.part:
        n = facts.nodes[k]
        if n.kind == "op" and n.layer_id is not None and facts.part[k] == "block":
            out.setdefault((n.block, n.layer_id), []).append(k)
    return out


def _class_members(g: _Graph, keys: list, core: frozenset) -> dict:
    """Class -> non-view member keys of one layer (before merging)."""
    facts = g.facts
    inlayer = set(keys)
    ops = [k for k in keys if k not in g.free]
    attn = {k for k in ops if k in core}
    for k in list(attn):
        if op_kind(facts.nodes[k].target) != "attention":        # unfused: the P x V matmul joins
            attn.update(c for c, _ in g.readers(k) if c in inlayer and op_kind(facts.nodes[c].target) == "matmul")
    act = {k for k in ops if base_name(facts.nodes[k].target) in ACTIVATIONS and k not in attn}
    act.update(c for a in list(act) for c, _ in g.readers(a) if c in inlayer and base_name(facts.nodes[c].target) == "mul")
    changed = True
    while act and changed:                   # the up-projections only the activation reads
        changed = False
        for m in list(act):
            for ref in facts.inputs.get(m, ()):
                p, _ = g.source(ref.key)
                if p is None or p in act or p not in inlayer or op_kind(facts.nodes[p].target) != "matmul":
                    continue
                if p in attn or not all(c in act for c, _ in g.readers(p)):
                    continue
                act.add(p)
                changed = True
    norm = {k for k in ops if base_name(facts.nodes[k].target) in NORMS}
    norm.update(c for k in list(norm) for c, _ in g.readers(k)
                if c in inlayer and op_kind(facts.nodes[c].target) == "matmul" and c not in attn)
    return {"attention": attn, "mlp_act": act, "norm": norm}


def _with_views(g: _Graph, members: set) -> set:
    """``members`` plus the views leading from a member to a member."""
    out = set(members)
    for m in members:
        for ref in g.facts.inputs.get(m, ()):
            p, path = g.source(ref.key)
            if p in members:
                out.update(path)
    return out


def _components(g: _Graph, members: set) -> list:
    """``members`` split into its connected parts (a member reading another, through views)."""
    parent = {m: m for m in members}

    def root(m):
        while parent[m] != m:
            m = parent[m]
        return m

    for m in members:
        for ref in g.facts.inputs.get(m, ()):
            p, _ = g.source(ref.key)
            if p in parent:
                parent[root(p)] = root(m)
    out: dict = {}
    for m in members:
        out.setdefault(root(m), set()).add(m)
    return sorted(out.values(), key=lambda s: min(g.order[m] for m in s))


def _merge(groups: list) -> list:
    """Union of the (kind, set) groups that share a node."""
    out: list = []
    for kind, s in groups:
        s = set(s)
        kinds = [kind]
        rest = []
        for k2, s2 in out:
            if s & s2:
                s |= s2
                kinds += k2
            else:
                rest.append((k2, s2))
        out = rest + [(kinds, s)]
    return out


def _runnable(g: _Graph, members: set) -> bool:
    """Every input from outside is computed before the region's first member."""
    first = min(g.order[m] for m in members)
    return all(r.key in members or g.order.get(r.key, -1) < first
               for m in members for r in g.facts.inputs.get(m, ()))


def layer_regions(facts: GraphFacts, classes, core: Optional[frozenset] = None) -> list:
    """(kind, keys in graph order) of the regions of ``classes`` in every layer, graph order."""
    g = _Graph(facts)
    core = core_nodes(facts) if core is None else core
    return _regions(g, facts, classes, core)


def _regions(g: _Graph, facts: GraphFacts, classes, core: frozenset) -> list:
    out = []
    for _, keys in sorted(_layers(facts).items(), key=lambda kv: g.order[kv[1][0]]):
        per = _class_members(g, keys, core)
        groups = [(c, comp) for c in OP_CLASSES if c in classes for comp in _components(g, per[c])]
        for kinds, s in _merge(groups):
            s = _with_views(g, s)
            if s and _runnable(g, s):
                kind = "+".join(c for c in OP_CLASSES if c in kinds)
                out.append((kind, tuple(sorted(s, key=g.order.__getitem__))))
    return out


def op_set(facts: GraphFacts, classes, kept: Optional[frozenset] = None, core: Optional[frozenset] = None,
           g: Optional[_Graph] = None, alias: bool = False) -> OpSet:
    """``alias``: ``contiguous`` returns its input (local tensors, tp = 1: measured on this
    runtime; under DTensor the attention output is copied). Regions do not depend on it."""
    plain = _Graph(facts)
    g = g or (_Graph(facts, True) if alias else plain)
    kept = kept_tensors(facts) if kept is None else kept
    core = core_nodes(facts) if core is None else core
    regions = _regions(plain, facts, classes, core)
    region_of = {k: i for i, (_, ks) in enumerate(regions) for k in ks}
    drop, extra = set(), set()
    per_region = [set() for _ in regions]
    ng = facts.needs_grad
    for k in facts.part:
        if k in g.free or not ng.get(k, False):
            continue
        r = region_of.get(k)
        readers = g.readers(k)
        if r is None:
            if k not in kept and any(region_of.get(c) is not None for c, _ in readers):
                extra.add(k)
            continue
        if k not in kept:
            continue
        held = any(region_of.get(c) != r and (region_of.get(c) is not None
                                              or (ng.get(c, False) and saves_input(facts.nodes[c].target)))
                   for c, _ in readers)
        if not held:
            drop.add(k)
            per_region[r].add(k)
    name = recompute_name(classes)
    return OpSet(name, tuple(c for c in OP_CLASSES if c in classes), tuple(regions), frozenset(region_of),
                 frozenset(drop), frozenset(extra), tuple(frozenset(s) for s in per_region))


def _all_op_sets(facts: GraphFacts, alias: bool) -> dict:
    g = _Graph(facts)
    ga = _Graph(facts, True) if alias else g
    kept = kept_tensors(facts)
    core = core_nodes(facts)
    present = set()
    for keys in _layers(facts).values():
        present.update(c for c, s in _class_members(g, keys, core).items() if s)
    have = [c for c in OP_CLASSES if c in present]
    out = {}
    for n in range(1, len(have) + 1):
        for cs in itertools.combinations(have, n):
            s = op_set(facts, cs, kept, core, ga, alias)
            out[s.name] = s
    return out



_SETS_MEMO: dict = {}


def all_op_sets(facts: GraphFacts, alias: bool = False) -> dict:
    """Canonical name -> ``OpSet`` for every non-empty set of the classes the graph has (memoized
    per ``facts``: the tables of every (tp, sp, mbs, cp) share it)."""
    hit = _SETS_MEMO.get((id(facts), alias))
    if hit is not None and hit[0] is facts:
        return hit[1]
    out = _all_op_sets(facts, alias)
    if len(_SETS_MEMO) > 8:
        _SETS_MEMO.clear()
    _SETS_MEMO[(id(facts), alias)] = (facts, out)
    return out


@dataclass(frozen=True)
class RcCost:
    """One layer per micro-batch under an op set's regions (``PartCost.rc``)."""
    fwd_s: float              # the members' forward compute, re-run in backward
    comm_fwd: dict            # kind -> seconds: the members' forward collectives, re-issued
    kept_bytes: float         # the layer's saved bytes with the regions
    workspace_bytes: float    # the largest region's dropped bytes (re-materialized in its backward)


def rc_costs(tab, choice: dict, saved_bytes: float) -> dict:
    """Name -> ``RcCost`` of the block under ``choice`` (``problem.summarize``); ``saved_bytes``:
    the layer's saved bytes without recompute."""
    out = {}
    count = max(1, tab.count)
    in_block = [e for e in tab.edges if e.part == "block"]
    for name, os in tab.op_sets.items():
        fwd, comm = 0.0, {}
        for k in os.members:
            if k not in tab.costs or tab.kinds.get(k) in ("param", "buffer", "input"):
                continue
            c = tab.costs[k][choice[k]]
            fwd += c.fwd_s
            for kd, s in c.comm_fwd:
                if s > 0:
                    kd = kd if ":" in kd else f"{tab.axis}:{kd}"
                    comm[kd] = comm.get(kd, 0.0) + s
        for e in in_block:
            if e.v in os.members and e.u in choice:
                ec = tab.edge_costs(e)[choice[e.u]][choice[e.v]]
                if ec.fwd_kind and ec.fwd_s > 0:
                    kd = f"{tab.axis}:{ec.fwd_kind}"
                    comm[kd] = comm.get(kd, 0.0) + ec.fwd_s * e.weight / count
        saved = lambda k: tab.costs[k][choice[k]].saved_bytes if k in tab.costs else 0.0
        kept = saved_bytes - sum(saved(k) for k in os.drop) \
            + sum(tab.costs[k][choice[k]].out_bytes for k in os.extra if k in tab.costs)
        work = max((sum(saved(k) for k in ks) for ks in os.region_drop), default=0.0)
        out[name] = RcCost(fwd, comm, kept, work)
    return out


def rc_lower_bounds(tab, batch_only: bool = False) -> dict:
    """Name -> ``RcCost`` bounding every choice from below (``problem.lower_bound_summary``): each
    node at its least bytes / time, no collectives; ``batch_only``: bytes of batch tensors only."""
    out = {}
    facts = tab.facts
    block = [k for k in tab.keys if facts.part.get(k) == "block" and tab.kinds[k] not in ("param", "buffer", "input")]
    counted = [k for k in block if not batch_only or facts.batch_dims.get(k)]
    least = {k: min(c.saved_bytes for c in tab.costs[k]) for k in counted}
    for name, os in tab.op_sets.items():
        fwd = sum(min(c.fwd_s for c in tab.costs[k]) for k in os.members
                  if k in tab.costs and tab.kinds.get(k) not in ("param", "buffer", "input"))
        kept = sum(b for k, b in least.items() if k not in os.drop) \
            + sum(min(c.out_bytes for c in tab.costs[k]) for k in os.extra if k in least)
        work = max((sum(least.get(k, 0.0) for k in ks) for ks in os.region_drop), default=0.0)
        out[name] = RcCost(fwd, {}, kept, work)
    return out


def present_classes(graph, seq_len: Optional[int] = None) -> tuple:
    """The op classes some layer of ``graph`` has (attention unfused needs ``seq_len``)."""
    from autopar.solver.strategies import graph_facts

    facts = graph_facts(graph, seq_len)
    g = _Graph(facts)
    core = core_nodes(facts)
    have = set()
    for keys in _layers(facts).values():
        have.update(c for c, s in _class_members(g, keys, core).items() if s)
    return tuple(c for c in OP_CLASSES if c in have)


def scaled_rc(rc: Optional[dict], f: float) -> Optional[dict]:
    """``PartCost.rc`` of a memory-only bound scaled by ``f`` (``search._quick_summary``)."""
    if rc is None:
        return None
    return {k: RcCost(0.0, {}, v.kept_bytes * f, v.workspace_bytes * f) for k, v in rc.items()}


def recompute_candidates(tab) -> tuple:
    """The outer search's recompute candidates: "none", then the prefixes of the op classes that
    drop bytes, ordered by bytes dropped per second of recompute (Korthikanti's argument: the
    attention core's s^2 scores first, then what is cheap to re-run), then "full" and "partial".
    ``tab``: tables at tp = 1, mbs = 1 (a class's ratio barely depends on the sharding: bytes and
    FLOPs of its ops scale alike); priced with ``rc_lower_bounds``."""
    bounds = rc_lower_bounds(tab)
    facts = tab.facts
    saved = sum(min(c.saved_bytes for c in tab.costs[k]) for k in tab.keys
                if facts.part.get(k) == "block" and tab.kinds[k] not in ("param", "buffer", "input"))
    ratio = {}
    for c in OP_CLASSES:
        rc = bounds.get(recompute_name((c,)))
        if rc is not None and saved - rc.kept_bytes > 0:
            ratio[c] = (saved - rc.kept_bytes) / max(rc.fwd_s, 1e-12)
    order = sorted(ratio, key=lambda c: (-ratio[c], OP_CLASSES.index(c)))
    prefixes = [recompute_name(order[:i]) for i in range(1, len(order) + 1)]
    return ("none", *prefixes, "full", "partial")
