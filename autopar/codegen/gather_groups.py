"""ZeRO-3 gather groups: which parameters one forward all-gather fetches together.

autopar's ZeRO-3 stores each parameter as this dp rank's rows and all-gathers them where a scope
reads it (``runtime/params.py``). One collective per parameter tensor pays the link's latency once
per tensor: a GPT layer has about a dozen tensors. As FSDP gathers one module at a time, the
forward gathers one *group* at a time: the parameters of one layer of the repeated block (or of one
stretch of the graph outside it: the embedding before the block, the head after it), of one dtype,
in one collective; and while that group's ops run, the next group is gathered in the background
(``runtime/prefetch.py``).

A group is one layer's (or stretch's) parameters read in one recompute region (or outside any),
so a region's replay in the backward reads exactly one group and re-gathers it in one collective;
the saved weights of a group outside regions are re-gathered together when the backward first
needs one of them (``runtime/reshard.py``). A parameter joins a group only when each forward reads
it exactly once, in one place: one parameter node of the graph, every reading op in the same layer
(or stretch) and the same region. A tied weight read both by the embedding and by the head, or a
weight read by two parameter nodes, is gathered on its own at each read.

Groups are numbered in the order the forward first reads them, which is the prefetch order.
``codegen/expected.py`` predicts the grouped collectives from the same numbers.
"""
from __future__ import annotations

from autopar.ir import GraphIR


def gather_groups(graph: GraphIR, region_of: dict[str, int]) -> dict[str, int]:
    """Parameter name -> group number (forward order) for the parameters that join a group (module
    docstring); ``region_of``: FX node name -> recompute region of the op nodes in one."""
    by_key = {n.key: n for n in graph.nodes}
    where: dict[str, set] = {}            # name -> {(label, region)} of its reading ops
    nodes: dict[str, set] = {}            # name -> parameter node keys read
    first: dict[str, tuple] = {}          # name -> label of its first reader
    segment, in_block = 0, False
    for n in graph.nodes:
        if n.kind != "op":
            continue
        if n.block is not None and n.layer_id is not None:
            label: tuple = (n.block, n.layer_id)
            in_block = True
        else:
            if in_block:
                segment, in_block = segment + 1, False
            label = ("", segment)
        for r in n.inputs:
            u = by_key[r.key]
            if u.kind != "param":
                continue
            name = u.param_name or u.key
            here = label + (region_of.get(n.name), u.out.dtype)
            where.setdefault(name, set()).add(here)
            nodes.setdefault(name, set()).add(u.key)
            first.setdefault(name, here)
    order: dict[tuple, int] = {}
    out: dict[str, int] = {}
    for name, label in first.items():             # insertion order: forward order of first reads
        if len(where[name]) != 1 or len(nodes[name]) != 1:
            continue
        out[name] = order.setdefault(label, len(order))
    return out
