"""Placements per mesh axis, in DTensor's words: ``Shard(dim)``, ``Replicate()``, ``Partial()``.

Frozen, hashable, JSON-friendly. ``repr`` is for machines (``Shard(dim=0)``), ``str`` for
people (``S(0)``, ``R``, ``P``). A node's placement on an N-axis mesh is a tuple of N of these;
``format_placements`` prints it short, e.g. ``S(0)R``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    reduce_op: str = "sum"

    def __str__(self) -> str:
        return "P"


Placement = Union[Shard, Replicate, Partial]


def format_placements(placements: tuple[Placement, ...]) -> str:
    return "".join(str(p) for p in placements)


def parse_placement(text: str) -> Placement:
    """Inverse of ``str``: ``"S(2)"`` -> ``Shard(2)``, ``"R"`` -> ``Replicate()``, ``"P"`` -> ``Partial()``."""
    text = text.strip()
    if text == "R":
        return Replicate()
    if text in ("P", "P(sum)"):
        return Partial()
    if text.startswith("S(") and text.endswith(")") and text[2:-1].isdigit():
        return Shard(int(text[2:-1]))
    raise ValueError(f"not a placement: {text!r} (expected 'R', 'P' or 'S(<dim>)')")


def parse_placements(text: str) -> tuple[Placement, ...]:
    """``"S(0)R"`` -> ``(Shard(0), Replicate())``."""
    out: list[Placement] = []
    i = 0
    while i < len(text):
        if text[i] == "S":
            j = text.find(")", i)
            if j < 0:
                raise ValueError(f"not a placement list: {text!r} (an 'S(' without ')'; expected e.g. 'S(0)R')")
            out.append(parse_placement(text[i : j + 1]))
            i = j + 1
        else:
            out.append(parse_placement(text[i]))
            i += 1
    return tuple(out)


def reshard_kind(src: Placement, dst: Placement) -> Optional[str]:
    """The collective for ``src -> dst`` on one axis, or None when it is local (free)."""
    if src == dst:
        return None
    if isinstance(src, Replicate):
        return None                        # slice, or local scaling to Partial
    if isinstance(src, Shard):
        if isinstance(dst, Shard):
            return "all_to_all"
        return "all_gather"                # to R, or to P via R
    # src is Partial
    if isinstance(dst, Replicate):
        return "all_reduce"
    if isinstance(dst, Shard):
        return "reduce_scatter"
    return None


def to_torch(p: Placement):
    """The matching ``torch.distributed.tensor`` placement (imported lazily: planning needs no torch.distributed)."""
    from torch.distributed.tensor import Partial as TPartial, Replicate as TReplicate, Shard as TShard

    if isinstance(p, Shard):
        return TShard(p.dim)
    if isinstance(p, Replicate):
        return TReplicate()
    return TPartial(p.reduce_op)


# ---- several axes: one move per axis, in a fixed order ----------------------------------------------

def _order(src: Placement, dst: Placement) -> int:
    """Where a move on one axis goes: free local steps (a chunk of a Replicate, a Replicate made
    Partial) 0, reduce-scatter 1, all-to-all 2 (these keep or shrink what a rank holds), all-reduce 3,
    all-gather 4 (these grow it)."""
    if isinstance(src, Replicate):
        return 0
    if isinstance(src, Partial):
        return 1 if isinstance(dst, Shard) else 3
    return 2 if isinstance(dst, Shard) else 4


def _sharded_twice(pl: tuple) -> bool:
    dims = [p.dim for p in pl if isinstance(p, Shard)]
    return len(dims) != len(set(dims))


def redistribute_steps(src: tuple, dst: tuple) -> list[tuple[int, Placement]]:
    """The single-axis moves ``(axis, placement)`` that take placements ``src`` to ``dst``, in the
    order autopar's runtime runs them (``codegen/edges.redistribute``) and its prediction counts
    them (``codegen/expected.py``): the free local steps first, then the collectives that keep or
    shrink what a rank holds, then those that grow it (``_order``), axes outermost first within
    each. A Shard made Partial is gathered to Replicate first. A move that would shard one tensor
    dim on two axes waits; when every remaining move would, an axis that shards such a dim is
    gathered to Replicate first. Shard dims are compared as given: pass them normalized (>= 0).
    When ``src`` or ``dst`` already shards a dim on two axes (DTensor's nested shards, a dim split
    by the outer axis first): ``_nested_steps``, DTensor's order. Two Partials count as the same
    placement."""
    if len(src) != len(dst):
        raise ValueError(f"placements {src} and {dst} are for meshes of different dimensions ({len(src)} and "
                         f"{len(dst)} axes): give one placement per mesh axis on both sides")
    if _sharded_twice(src) or _sharded_twice(dst):
        return _nested_steps(src, dst)
    cur, out = list(src), []
    for _ in range(4 * len(cur) + 1):
        todo = [a for a in range(len(cur)) if cur[a] != dst[a]
                and not (isinstance(cur[a], Partial) and isinstance(dst[a], Partial))]
        if not todo:
            return out
        nxt = {a: Replicate() if isinstance(cur[a], Shard) and isinstance(dst[a], Partial) else dst[a] for a in todo}
        ok = [(_order(cur[a], nxt[a]), a) for a in todo
              if not _sharded_twice(tuple(cur[:a]) + (nxt[a],) + tuple(cur[a + 1:]))]
        if ok:
            a = min(ok)[1]
            cur[a] = nxt[a]
        else:                       # every move waits on a dim another axis shards: free one
            a = next(b for b in todo if isinstance(cur[b], Shard))
            cur[a] = Replicate()
        out.append((a, cur[a]))
    raise RuntimeError(f"no single-axis moves found from {src} to {dst} (a bug in redistribute_steps)")


def _nested_steps(src: tuple, dst: tuple) -> list[tuple[int, Placement]]:
    """``redistribute_steps`` where ``src`` or ``dst`` shards a tensor dim on two axes, in the order
    DTensor's own redistribution takes (torch's greedy ``DTensorRedistributePlanner``): with a
    shard in ``src``, the axes from the innermost out, each moved to what ``dst`` asks, except a
    Shard whose dim the axes outside it shard otherwise in ``src`` than in ``dst``, gathered to
    Replicate first (a dim is split by its outer axis first, so the inner split must go before the
    outer one changes); then the axes from the outermost in, to ``dst``. A Shard made Partial goes
    through Replicate, and every Replicate made Partial (local: each rank keeps 1/n) comes last.
    E.g. (S(0), P, S(0)) -> (S(0), S(0), R) all-gathers the third axis, then reduce-scatters the
    second over the gathered piece (twice the first piece's bytes)."""
    first = tuple(Replicate() if isinstance(d, Partial) and not isinstance(c, Partial) else d
                  for c, d in zip(src, dst))
    cur: list = list(src)
    out: list = []

    def move(ax: int, p: Placement) -> None:
        if cur[ax] != p and not (isinstance(cur[ax], Partial) and isinstance(p, Partial)):
            cur[ax] = p
            out.append((ax, p))

    def outer_splits(pl, ax: int, dim: int) -> list[int]:
        return [b for b in range(ax) if isinstance(pl[b], Shard) and pl[b].dim == dim]

    if any(isinstance(p, Shard) for p in src):
        for ax in reversed(range(len(cur))):
            t = first[ax]
            if isinstance(t, Shard) and outer_splits(cur, ax, t.dim) != outer_splits(first, ax, t.dim):
                t = Replicate()
            move(ax, t)
    for pl in (first, dst):
        for ax in range(len(cur)):
            move(ax, pl[ax])
    return out


def gathers_only(src: tuple, dst: tuple) -> bool:
    """Whether ``redistribute_steps(src, dst)`` is all-gathers only, at least one (every step a
    Shard made Replicate): an edge whose consumer saves the value may keep ``src``'s piece and
    gather it again in backward (``runtime/regather.py``)."""
    steps = redistribute_steps(src, dst)
    return bool(steps) and all(isinstance(src[ax], Shard) and isinstance(p, Replicate) for ax, p in steps)
