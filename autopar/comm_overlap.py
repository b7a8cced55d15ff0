"""How much of each collective the step-time model hides, as plain data (``StepTime.overlap``).

One ``CommOverlap`` per collective class the step priced, keyed like ``StepTime.comm_s``
("axis:kind"), seconds per optimizer step (per-micro-batch collectives x the micro-batches of the
slowest pipeline rank, per-step ones once). Written by ``autopar/solver/overlap.py`` (the formula
is in ``autopar/solver/runtime_profile.py``'s docstring); the report prints them as the
"Communication" table. For every row ``exposed_s + contention_s`` is what the row adds to the step
(its ``comm_s`` entry).

``known`` is False where the hiding was priced before the step model (tensor-parallel collectives
pipelined with their GEMM, context-parallel ring rotations, offload copies on a side stream): only
the exposed remainder reaches the step model, so ``total_s`` is that remainder and ``hidden_s`` 0.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommOverlap:
    axis: str               # "dp" | "tp" | "pp" | "cp" | "host" | ...
    kind: str               # "all_reduce" | "reduce_scatter" | "all_gather" | "p2p" | ...
    total_s: float          # the collective's own time per step
    window_s: float         # the compute it may hide behind (0: not overlapped)
    hidden_s: float         # min(total, window) when overlapped, else 0
    exposed_s: float        # total - hidden
    contention_s: float     # extra compute time while it runs beside compute (overlap_slowdown x hidden)
    why: str
    known: bool = True      # False: hidden part priced upstream, total_s is the exposed remainder only

    @property
    def key(self) -> str:
        return f"{self.axis}:{self.kind}"

    @property
    def cost_s(self) -> float:
        """What the row adds to the step time."""
        return self.exposed_s + self.contention_s


def overlap_from_dicts(rows) -> tuple[CommOverlap, ...]:
    """``CommOverlap``s from their JSON dicts (a plan file; absent in files older than the field)."""
    return tuple(CommOverlap(**r) for r in rows)
