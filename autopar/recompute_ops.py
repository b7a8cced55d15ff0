"""Per-operator recompute: the vocabulary of ``Plan.recompute``.

``Plan.recompute`` is one of

- ``"none"``: every activation autograd saves stays until its backward;
- ``"full"``: each layer (``Plan.recompute_layers``: the first K of each pipeline rank) runs in one
  ``torch.utils.checkpoint`` region and keeps its input only;
- ``"ops:<class>+<class>..."``: inside every layer of the repeated block, the op classes named
  (``OP_CLASSES``, canonical order, each once) run in their own checkpoint regions, so that the
  activations saved inside a region are dropped and recomputed in backward;
- ``"selective"``: the alias of ``"ops:attention"`` (Korthikanti et al.'s selective recompute);
  the canonical name of that set, so plans and plan files that say "selective" read unchanged.

The classes, found in the traced graph by aten target (``solver/op_classes.py``):

- ``attention``: the attention core (fused SDPA / flash; unfused: the ops whose output has two
  sequence dims, the scores, with the probabilities x V matmul that reads them);
- ``mlp_act``: the MLP activation (gelu, silu, relu, ...; a SwiGLU's gating product with it) and
  the up-projections only it reads (their outputs are what it saves);
- ``norm``: layer / RMS / group / batch norms and the matmuls only their output feeds (a norm's
  output is saved by the projection that reads it, so that projection re-runs with it).
"""
from __future__ import annotations

import functools
from typing import Optional

OP_CLASSES = ("attention", "mlp_act", "norm")
OPS_PREFIX = "ops:"


def _bad(value: str, why: str) -> ValueError:
    return ValueError(f"recompute={value!r}: {why}; use none, full, selective, or ops:CLASS+CLASS with classes "
                      f"{', '.join(OP_CLASSES)}")


def canonical_recompute(value: str, extra: tuple = ()) -> str:
    """``value`` in canonical spelling: ``"ops:attention"`` -> ``"selective"``, ``"ops:"`` classes
    in ``OP_CLASSES`` order (an empty set -> ``"none"``). ``extra``: other accepted names (the
    solver's ``"partial"``). Raises a one-line ``ValueError`` listing the classes."""
    value = str(value).strip()
    if value in ("none", "full", "selective") or value in extra:
        return value
    if not value.startswith(OPS_PREFIX):
        raise _bad(value, "unknown recompute")
    names = [c.strip() for c in value[len(OPS_PREFIX):].split("+") if c.strip()]
    unknown = [c for c in names if c not in OP_CLASSES]
    if unknown:
        raise _bad(value, f"unknown op class {', '.join(repr(c) for c in unknown)}")
    if len(set(names)) != len(names):
        raise _bad(value, "an op class is named twice")
    return recompute_name(names)


def recompute_name(classes) -> str:
    """The canonical ``Plan.recompute`` of a set of op classes."""
    cs = tuple(c for c in OP_CLASSES if c in set(classes))
    if not cs:
        return "none"
    if cs == ("attention",):
        return "selective"
    return OPS_PREFIX + "+".join(cs)


@functools.lru_cache(maxsize=256)      # asked per configuration and rank by the search's step model
def recompute_classes(value: str) -> Optional[tuple[str, ...]]:
    """The op classes a recompute recomputes per operator: () for "none", ("attention",) for
    "selective", the named ones for "ops:..."; None for the per-layer kinds ("full", "partial")."""
    if value == "none":
        return ()
    if value == "selective":
        return ("attention",)
    if isinstance(value, str) and value.startswith(OPS_PREFIX):
        return tuple(c for c in OP_CLASSES if c in value[len(OPS_PREFIX):].split("+"))
    return None


def is_per_op(value: str) -> bool:
    """Whether ``value`` recomputes some op classes (not "none", not per layer)."""
    cs = recompute_classes(value)
    return bool(cs)


def recompute_problem(value) -> Optional[str]:
    """Why ``value`` is not a plan's recompute in canonical spelling (None: it is), saying what to write."""
    try:
        canonical = canonical_recompute(value)
    except ValueError as e:
        return str(e)
    return None if canonical == value else f"recompute={value!r}: write {canonical!r} (the canonical spelling)"
