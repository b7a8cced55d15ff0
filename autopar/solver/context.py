"""Context parallelism in the planner: whether a model can run with each sequence split over cp
ranks, the (cp, kind) pairs the search tries, and what attention's exchange costs.

Under cp a rank holds a chunk of every sequence (``codegen/context_attention.py``). Every op but
attention must then be token-wise: it maps the tokens it is given to outputs of the same tokens
(embeddings, linears, norms, the MLP, a loss over tokens). Attention exchanges K/V blocks around
the cp ring (ring attention) or trades sequence shards for head shards (Ulysses all-to-all).
Positions are the one thing a chunk cannot compute from its own tokens: the runtime replaces the
position sources a model builds from the sequence length (``arange(0, T)``, a buffer's first T
rows such as RoPE tables) with its chunk's global positions (``position_sources``).

Costs per attention node and micro-batch (local sizes: tokens / cp, heads / tp when tp shards
them; ``cost/context_parallel.py`` holds the schedules):
  ring:     forward cp - 1 rotations of one K|V block, backward cp - 1 of K|V and cp of dK|dV;
            each rotation overlaps one block of attention compute, so only max(0, send - block)
            is exposed;
  ulysses:  forward all-to-alls of q, k, v and the output, backward of their gradients; not
            overlapped. Needs the (tp-local) heads divisible by cp.
"""
from __future__ import annotations

from typing import Optional

from autopar.cost.collectives import all_to_all_s
from autopar.cost.context_parallel import RingTraffic, ring_time
from autopar.ir import SDPA_TARGET, NodeInfo
from autopar.plan import CONTEXT_MODES
from autopar.solver.strategies import GraphFacts, tensor_nodes, token_dims_of

# Sequences shorter than this are not split by a free search while the batch has a row per rank
# for data parallelism: below it the K/V exchange of every layer outweighs what a shorter sequence
# saves, and data parallelism over more rows is cheaper. With fewer rows than ranks (``rest``) cp
# is tried at any length; a forced cp (``--force cp=N``) is planned at any length the chunks divide.
CP_MIN_FREE_SEQ = 16384
RING_GRAD_BYTES = 4      # bytes per element of the ring's dK|dV accumulators (fp32, ``context_attention``)
_ARANGE = ("aten.arange.start", "aten.arange.default", "aten.arange.start_step")


def _arg(n: NodeInfo, i: int, default=None):
    return n.args[i] if len(n.args) > i else default


def is_position_source(n: NodeInfo, seq: int, leaf_kinds: dict) -> bool:
    """``arange(0, seq)`` or ``x[0:seq]`` of a buffer/parameter along dim 0 (a RoPE table)."""
    if n.kind != "op":
        return False
    if n.target in _ARANGE:
        a = [x for x in n.args if not hasattr(x, "key")]
        if n.target == "aten.arange.default":
            return a[:1] == [seq]
        return a[:2] == [0, seq] and (len(a) < 3 or a[2] == 1)
    if n.target == "aten.slice.Tensor" and n.inputs and leaf_kinds.get(n.inputs[0].key) in ("buffer", "param"):
        return _arg(n, 1, 0) == 0 and _arg(n, 2) in (0, None) and _arg(n, 3) == seq and _arg(n, 4, 1) == 1
    return False


def position_sources(graph, seq: int) -> frozenset[str]:
    """Keys of the position sources of ``graph`` traced at ``seq`` tokens per sequence."""
    kinds = {n.key: n.kind for n in graph.nodes}
    return frozenset(n.key for n in graph.nodes if is_position_source(n, seq, kinds))


def _whole_sequence_leaf(facts: GraphFacts, n: NodeInfo, kinds: dict, seq: int) -> Optional[str]:
    """Why elementwise op ``n`` cannot run on a chunk: it broadcasts a parameter or buffer whose dim
    of the sequence's length lines up with a token dim of its output (``h + self.pos``, a learned
    position table added whole), which a rank holding T / cp tokens cannot read as it is."""
    from autopar.solver.rules import is_elementwise      # rules -> ... -> here

    if not is_elementwise(n.target):
        return None
    out = n.outputs[0].shape
    tdims = token_dims_of(facts, n.key, out)
    for ref in facts.inputs[n.key]:
        if kinds.get(ref.key) not in ("param", "buffer"):
            continue
        shape = facts.nodes[ref.key].outputs[0].shape
        if any(size == seq and len(out) - len(shape) + i in tdims for i, size in enumerate(shape)):
            return (f"{n.key} ({n.target}) adds the {kinds[ref.key]} {ref.key} of shape {tuple(shape)} whole to the "
                    f"tokens, sized to all {seq} of them, so a rank's chunk cannot read it: index it with positions "
                    "(table[torch.arange(T)] or an nn.Embedding of position ids: each rank gets its chunk's)")
    return None


def attention_nodes(graph) -> list[NodeInfo]:
    return [n for n in graph.nodes if n.kind == "op" and n.target == SDPA_TARGET]


def _heads(facts: GraphFacts) -> int:
    """The attention heads ``configs.model_dims`` reads from SDPA's queries (0: none)."""
    from autopar.solver.configs import model_dims      # configs -> timing -> problem -> here

    return model_dims(facts.graph)["heads"] or 0


def context_problem(facts: GraphFacts, unbatched: Optional[tuple] = None) -> Optional[str]:
    """Why this model cannot run context-parallel (None: it can). ``unbatched``: the graph's
    ``data_axis.unbatched_ops`` where the caller has them (computed here otherwise)."""
    seq = facts.seq_len
    g = facts.graph
    if not seq:
        return "the model has no sequence dim (give --seq-len for a sequence model)"
    if not attention_nodes(g):
        return "the model has no scaled_dot_product_attention to split the sequence around"
    if g.batch_size == 1:      # a size-1 dim does not tell the batch apart: the folded batch could not be split
        return ("the model was traced at one sequence, where its batch dim cannot be told apart; give a batch of "
                "2 or more sequences")
    nodes = tensor_nodes(g)
    tokens: dict[str, bool] = {n.key: any(token_dims_of(facts, n.key, m.shape) for m in n.outputs) for n in nodes}
    target = [n for n in nodes if n.kind == "input" and n.key.startswith("|target|")]
    if target and not tokens[target[0].key]:
        return "the loss target has no sequence dim (the loss is per sample, not per token)"
    kinds = {n.key: n.kind for n in g.nodes}
    from_pos: set[str] = set()
    for n in nodes:
        if n.kind != "op":
            continue
        ins = [r.key for r in facts.inputs[n.key]]
        if is_position_source(n, seq, kinds) or any(k in from_pos for k in ins):
            from_pos.add(n.key)
        if n.target == SDPA_TARGET:
            if len(ins) > 3 or _arg(n, 3) is not None:
                return f"attention {n.key} takes an attention mask (context parallelism runs causal or full attention)"
            if _arg(n, 4, 0.0):
                return f"attention {n.key} uses dropout (context parallelism runs it without)"
            if dict(n.kwargs).get("enable_gqa") or _arg(n, 7, False):
                return (f"attention {n.key} uses enable_gqa (context parallelism takes K/V with the queries' "
                        "heads: repeat them before the call)")
            continue
        whole = _whole_sequence_leaf(facts, n, kinds, seq) if tokens[n.key] else None
        if whole is not None:
            return whole
        if not any(tokens.get(k) for k in ins):
            if n.key not in from_pos and any(seq in m.shape for m in n.outputs) and not tokens[n.key]:
                return (f"{n.key} ({n.target}) builds a sequence-length tensor that is not a position "
                        "(arange(0, T) or a table's first T rows), so a chunk cannot compute it")
            continue
        if tokens[n.key] or all(len(m.shape) == 0 for m in n.outputs):
            continue
        return (f"{n.key} ({n.target}) mixes tokens outside attention, so the sequence cannot be split "
                "over ranks")
    if unbatched is None:
        from autopar.solver.data_axis import unbatched_ops      # data_axis -> tensor_axes -> problem -> here

        unbatched = unbatched_ops(facts)
    if unbatched:
        key = unbatched[0]
        return (f"{key} ({facts.nodes[key].target}) does not run on the data axis' batch shards, into which "
                "context parallelism folds each sequence's chunks (solver/data_axis.py)")
    return None


def cp_choices(facts: GraphFacts, rest: int, tp: int, forced_cp: Optional[int], forced_mode: Optional[str],
               problem: Optional[str], global_batch: Optional[int] = None) -> list[tuple[int, str]]:
    """(cp, mode) pairs for a configuration whose dp x cp ranks number ``rest``: cp = 1, and when
    the model allows it (``problem`` is None) and the sequence is long (``CP_MIN_FREE_SEQ``), the
    global batch has fewer rows than ``rest`` or cp is forced, each power-of-two cp dividing ``rest`` whose zig-zag chunks divide the sequence,
    with ring and (heads / tp divisible by cp) Ulysses."""
    if forced_cp == 1 or problem is not None or not facts.seq_len:
        return [(1, "none")] if forced_cp in (None, 1) else []
    seq = facts.seq_len
    heads = _heads(facts)
    cps = [forced_cp] if forced_cp else ([c for c in (2, 4, 8, 16, 32, 64) if c <= rest]
                                         if seq >= CP_MIN_FREE_SEQ or (global_batch or rest) < rest else [])
    out = [] if forced_cp else [(1, "none")]
    for cp in cps:
        if rest % cp or seq % (2 * cp):
            continue
        for mode in ([forced_mode] if forced_mode else CONTEXT_MODES):
            if mode == "ulysses" and (heads % tp or (heads // tp) % cp):
                continue
            out.append((cp, mode))
    return out


def check_context_force(force, facts: GraphFacts, problem: Optional[str]) -> None:
    """A forced cp / cpmode that cannot work: one ``PlanningError`` line saying what to change."""
    from autopar.solver.errors import PlanningError

    cp, mode = force.context_parallel, force.context_parallel_mode
    if mode is not None and cp == 1:
        raise PlanningError(f"cpmode={mode} needs cp > 1; drop cpmode or force cp=2 or more")
    if not (cp and cp > 1) and mode is None:
        return
    what = f"cp={cp}" if cp else f"cpmode={mode}"
    if problem is not None:
        raise PlanningError(f"{what}: {problem}; drop {what}")
    seq = facts.seq_len
    if cp and seq % (2 * cp):
        raise PlanningError(f"cp={cp} cuts each sequence into 2 x cp = {2 * cp} equal chunks (two per rank, for "
                            f"causal load balance), but the sequence has {seq} tokens; use a sequence length "
                            f"divisible by {2 * cp} or another cp")
    heads = _heads(facts)
    tp = force.tp or 1
    if mode == "ulysses" and cp and (heads % tp or (heads // tp) % cp):
        raise PlanningError(f"cpmode=ulysses with cp={cp} splits the {heads // max(tp, 1)} heads per tp rank over "
                            f"the cp ranks, which cp does not divide; use cpmode=ring or a cp that divides "
                            f"{heads // max(tp, 1)}")


def attention_comm(q_bytes: float, kv_bytes: float, out_bytes: float, cp: int, mode: str, fwd_s: float,
                   bwd_s: float, link, elem_bytes: int = 2, slowdown: float = 0.0) -> tuple[tuple, tuple]:
    """Exposed (forward, backward) communication of one attention node of one rank under cp:
    ``(("cp:<kind>", seconds),)`` each, by ``cost/context_parallel.py``'s schedules. Bytes are the
    rank's local q, k + v and output (its tokens, its tp heads) with ``elem_bytes`` per element;
    ``fwd_s`` / ``bwd_s`` its attention compute, which ring rotations overlap block by block, at
    ``slowdown`` x what they hide (the cluster's ``overlap_slowdown``)."""
    if cp <= 1:
        return (), ()
    if mode == "ring":
        # the engine accumulates dK|dV in fp32 on their way around the ring (``context_attention``)
        grad_block = kv_bytes * RING_GRAD_BYTES / max(elem_bytes, 1)
        t = ring_time(RingTraffic(kv_bytes, (cp - 1) * kv_bytes, (cp - 1) * kv_bytes + cp * grad_block, grad_block),
                      cp, link, fwd_s / cp, bwd_s / cp, slowdown)
        return (("cp:ring", t.forward_exposed_s),), (("cp:ring", t.backward_exposed_s),)
    a2a = sum(all_to_all_s(b, cp, link) for b in (q_bytes, kv_bytes, out_bytes))
    return (("cp:all_to_all", a2a),), (("cp:all_to_all", a2a),)
