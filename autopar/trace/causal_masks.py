"""Constant causal masks become ``is_causal=True`` (a rewrite of the exported graph).

HuggingFace models build their attention mask inside ``forward`` (``create_causal_mask``: aranges,
comparisons, ``index``, ``expand``), and torch.export keeps that subgraph: every step then
materializes (B, 1, T, T) index tensors and passes the mask to
``scaled_dot_product_attention``. With a mask, attention cannot use its causal fast path nor
autopar's fused kernel, and its shards cannot stay local (a mask is given in global coordinates).

``fold_causal_masks(graph_module)`` finds every ``aten.scaled_dot_product_attention`` whose
``attn_mask`` is computed from constants only (no placeholder among its ancestors: nothing the
model's inputs or weights decide), evaluates that subgraph once on the CPU, and, when the mask is
exactly causal -- ``mask[..., i, j]`` keeps key j iff j <= i, the lower triangle
``scaled_dot_product_attention(is_causal=True)`` uses, broadcast over batch and heads; a bool mask
or an additive float one of 0 and -inf (or finfo.min) -- rewrites the call to ``attn_mask=None,
is_causal=True`` and erases the mask subgraph (with the metadata assertions on it) when nothing
else uses it. Anything else (a padding mask from an input, a sliding window, a mask whose
subgraph holds more than ``MAX_ELEMENTS`` elements in one tensor) is left exactly as traced; a
constant mask too large to evaluate here is checked on the training device on the first step
instead (``codegen/causal_check.py``).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import fx

log = logging.getLogger(__name__)

SDPA = torch.ops.aten.scaled_dot_product_attention.default
ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
# The largest tensor the mask's subgraph may hold for it to be evaluated (HF's index tensors are
# (B, 1, T, T) int64: 2**25 elements is 256 MB, e.g. B = 8 at T = 2048).
MAX_ELEMENTS = 1 << 25


def constant_subgraph(node: fx.Node) -> Optional[list[fx.Node]]:
    """``node`` and everything it is computed from, in graph order; None if a placeholder (or
    anything but a call_function) is among them."""
    seen: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op != "call_function":
            return None
        seen[n] = None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _numel(n: fx.Node) -> int:
    val = n.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else 0


def _on_cpu(x: Any) -> Any:
    return torch.device("cpu") if isinstance(x, torch.device) else x


def _evaluate(nodes: list[fx.Node]) -> torch.Tensor:
    """Run ``nodes`` (constants only, in graph order) on the CPU; the last one's value."""
    env: dict[fx.Node, Any] = {}
    for n in nodes:
        args = fx.node.map_aggregate(fx.node.map_arg(n.args, env.__getitem__), _on_cpu)
        kwargs = {k: _on_cpu(v) for k, v in fx.node.map_arg(n.kwargs, env.__getitem__).items()}
        env[n] = n.target(*args, **kwargs)
    return env[nodes[-1]]


def is_causal_mask(mask: torch.Tensor, tq: int, tk: int) -> bool:
    """Whether ``mask`` is exactly the top-left lower triangle of (tq, tk) that ``is_causal=True``
    applies, broadcast over leading dims. bool: True keeps. float (additive): 0 keeps; -inf or the
    dtype's most negative value drops (older HF fills with ``finfo.min``: every causal row keeps
    its diagonal, so exp of such a score underflows to exactly 0, as with -inf)."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (tq, tk):
        return False
    keep = torch.ones(tq, tk, dtype=torch.bool, device=mask.device).tril().expand_as(mask)
    if mask.dtype == torch.bool:
        return torch.equal(mask, keep)
    if not mask.is_floating_point():
        return False
    dropped = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
    return bool(torch.equal(~dropped, keep) and (mask[keep] == 0).all())


def sdpa_mask(node: fx.Node) -> tuple[Optional[fx.Node], bool]:
    """(the attn_mask node or None, is_causal) of an sdpa call."""
    args, kwargs = node.args, node.kwargs
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
    return (mask if isinstance(mask, fx.Node) else None), bool(causal)


def causal_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """sdpa(q, k, v, mask, dropout_p, False, ...) -> sdpa(q, k, v, dropout_p=..., is_causal=True,
    ...), the other arguments unchanged."""
    names = ("attn_mask", "dropout_p", "is_causal")
    kwargs = {**dict(zip(names, args[3:])), **kwargs}
    kwargs.pop("attn_mask", None)
    kwargs["is_causal"] = True
    return tuple(args[:3]), kwargs


def unused_after_fold(nodes: list[fx.Node], gone: set) -> list[fx.Node]:
    """Those of ``nodes`` (a mask's constant subgraph, graph order) nothing would read once the
    users in ``gone`` stop reading the mask, with the metadata assertions on them; latest first."""
    out: list[fx.Node] = []
    dead: set = set(gone)
    for n in reversed(nodes):
        users = [u for u in n.users if u not in dead]
        if all(u.target is ASSERT_METADATA and u.args[0] is n for u in users):
            out.extend(users)
            out.append(n)
            dead.update(users)
            dead.add(n)
    return out




def fold_causal_masks(gm: fx.GraphModule, max_elements: Optional[int] = None) -> int:
    """Rewrite, in place, the sdpa calls of ``gm`` whose constant mask is causal (module
    docstring; ``max_elements`` defaults to ``MAX_ELEMENTS``); returns how many were rewritten."""
    max_elements = MAX_ELEMENTS if max_elements is None else max_elements
    verdicts: dict[fx.Node, bool] = {}
    folded = 0
    subgraphs: list[list[fx.Node]] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask, causal = sdpa_mask(node)
        if mask is None or causal:
            continue
        if mask not in verdicts:
            nodes = constant_subgraph(mask)
            verdicts[mask] = False
            if nodes is not None and max(map(_numel, nodes)) <= max_elements:
                q, k = node.args[0].meta["val"], node.args[1].meta["val"]
                try:
                    verdicts[mask] = is_causal_mask(_evaluate(nodes), q.shape[-2], k.shape[-2])
                except Exception as e:  # an op that cannot run on the CPU: leave the mask
                    log.info("attention mask %s not evaluated (%s: %s)", mask.name,
                             type(e).__name__, e)
                if verdicts[mask]:
                    subgraphs.append(nodes)
        if verdicts[mask]:
            node.args, node.kwargs = causal_call(node.args, node.kwargs)
            folded += 1
    for nodes in subgraphs:
        for n in unused_after_fold(nodes, set()):
            gm.graph.erase_node(n)
    if folded:
        gm.recompile()
    return folded
