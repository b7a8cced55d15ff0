"""Random ops of an exported graph (dropout, rand, randn, bernoulli, ...): they draw from each
rank's own generator, so a parallel run's values differ from one process's (``autoparallelize``
warns once)."""
from __future__ import annotations

from typing import Any

import torch


def _schema_args(node, op) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    out = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def random_ops(fx_graph) -> dict[str, int]:
    """Random ops of an exported graph (ATen's ``nondeterministic_seeded`` tag: dropout, rand,
    randn, bernoulli, normal, multinomial, ...) -> count; a dropout (or SDPA) with p == 0 or
    train=False draws nothing and is left out."""
    found: dict[str, int] = {}
    for n in fx_graph.nodes:
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded not in t.tags:
            continue
        name = str(t)
        args = _schema_args(n, t)
        if args.get("p", args.get("dropout_p")) == 0 or args.get("train") is False:
            continue                  # dropout (or attention dropout) that draws nothing
        found[name.removeprefix("aten.")] = found.get(name.removeprefix("aten."), 0) + 1
    return found
