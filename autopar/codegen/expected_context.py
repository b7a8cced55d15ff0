"""The collectives context-parallel attention issues (``context_run.py``), per forward and
backward of a graph, for ``expected.py``'s count.

Per ``scaled_dot_product_attention`` node, on the "cp" axis: ``context_attention.ring_traffic`` or
``ulysses_traffic`` of the rank's local q and k (rows: the folded batch over the DATA axis; heads:
over the TENSOR axis when the node's input is Shard(heads) or Shard(batch) there); a node in a
recompute region issues its forward traffic again in the backward. ``graph`` is the trace the
runtime runs: the folded batch (``ContextRun.fold``) at the chunk's length.
"""
from __future__ import annotations

from autopar.codegen import context_attention as ca
from autopar.codegen.program import RankProgram, axis_index
from autopar.ir import DTYPE_BYTES, SDPA_TARGET, GraphIR
from autopar.mesh import CONTEXT, DATA, TENSOR
from autopar.placements import Shard


def context_collectives(graph: GraphIR, program: RankProgram, cp: int, mode: str,
                        phases: tuple[str, str] = ("forward", "backward"), part=None) -> list:
    """``part``: the keys of the nodes that run (a pipeline stage's; all when None)."""
    from autopar.codegen.expected import Collective

    if cp <= 1:
        return []
    mesh = program.mesh
    di, ti = axis_index(mesh, DATA), axis_index(mesh, TENSOR)
    by_key = {n.key: n for n in graph.nodes}
    nplan = {n.key: n for n in program.nodes}
    traffic = ca.ring_traffic if mode == "ring" else ca.ulysses_traffic
    fwd, bwd = phases
    out: list = []
    for n in graph.nodes:
        if n.kind != "op" or n.target != SDPA_TARGET or (part is not None and n.key not in part):
            continue
        p = nplan[n.key]
        q, k = (by_key[r.key].outputs[0] for r in n.inputs[:2])

        def local(meta, i):
            shape = list(meta.shape)
            if di is not None:
                shape[0] //= mesh.shape[di]
            pl = p.inputs[i] if p.inputs and i < len(p.inputs) and p.inputs[i] is not None else None
            t = pl[ti] if pl is not None and ti is not None else None
            if isinstance(t, Shard) and t.dim in (0, 1):
                shape[t.dim] //= mesh.shape[ti]
            return shape

        moves = traffic(local(q, 0), local(k, 1), cp, DTYPE_BYTES[k.dtype])
        issued = [(kind, b, fwd) for kind, b in moves["forward"]] + [(kind, b, bwd) for kind, b in moves["backward"]]
        if p.region is not None:
            issued += [(kind, b, bwd) for kind, b in moves["forward"]]
        out += [Collective(kind, CONTEXT, int(b), phase, "context") for kind, b, phase in issued]
    return out
