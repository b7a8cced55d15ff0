"""Peak memory of one pipeline rank, replayed over its schedule's actions in torch 2.13's order.

The closed forms (``cost.memory.pipeline_inflight_microbatches``, ``step_peak_bytes``) count a
rank's peak as its activation peak with the gradients of its first backward beside it. The
zero-bubble schedules break that: their input pass (I) frees no activation (the weight pass needs
them) and creates no weight gradient, and the weight pass (W) trades activations for gradients
later, so at the activation peak of ``interleaved_zb`` no gradient exists yet, while each pending
W holds the gradients I saved where a parameter's branch joins the input's. The replay follows
every action of the rank:

    F   the chunk's activations of one micro-batch are added
    B   full backward: the chunk's pieces trade, in backward order, their activations for their
        gradients (allocated by the chunk's first backward of the step, accumulated in place
        after), counted at the pieces' boundaries (``step_peak_bytes``'s rule); a bucket buffer
        is allocated whole by the piece's first gradient, beside the piece's activations
    I   input pass: activations stay; the chunk's ``held`` join-node gradients are added
    W   weight pass: the trade of B, then ``held`` is freed

and returns the largest live sum: the peak of (activations + gradients + held + the backward's
workspace) over the step, to which the caller adds the model states. A chunk is one local stage
(``Chunk``): stage 0's I does nothing and its W is a full backward (torch: its inputs need no
gradient), so it is given ``held`` 0 and its W counts as B.

Action lists: the multi-stage schedules' are torch's own (``_calculate_single_rank_operations``,
the order ``_PipelineScheduleRuntime`` executes; DualPipeV's overlapped F+B pairs flattened, F
first as torch runs them); GPipe and 1F1B (torch runs them inline) are written here from
``Schedule1F1B._step_microbatches``: ``min(m, p - r)`` warm-up forwards, then one backward and one
forward at a time, then the remaining backwards.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

Action = tuple[str, int, int]          # (kind: F, B, I or W; global stage; micro-batch)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One local stage of a rank: ``pieces`` (activation bytes of one micro-batch, gradient bytes
    its first backward allocates) in backward order (head, layers, embedding), and ``held``: the
    bytes of join-node gradients its input pass keeps per micro-batch until the weight pass.
    ``bucketed``: the gradient bytes of a piece are bucket buffers (``runtime/reducer.py``: ZeRO-0
    over dp), allocated whole by the piece's first gradient, while its activations are still live.
    ``output``: bytes of its output that torch's fwd_cache holds from a micro-batch's forward to
    the end of its backward (or input pass): the last stage's logits, which the loss reads.
    ``workspace``: per piece, the transient bytes while it runs its backward (``step_peak_bytes``'s
    ``piece_workspace``); empty: the replay's one ``workspace`` for every piece."""
    pieces: tuple[tuple[float, float], ...]
    held: float = 0.0
    bucketed: bool = False         # the gradient bytes are whole buckets, allocated at the piece's first gradient
    output: float = 0.0
    workspace: tuple[float, ...] = ()

    @property
    def activations(self) -> float:
        return sum(a for a, _ in self.pieces)


def activations_only(chunk: Chunk) -> Chunk:
    """``chunk`` without gradients, held gradients or workspace: replayed, the rank's activation peak
    (its saved tensors and the last stage's held output)."""
    return Chunk(tuple((a, 0.0) for a, _ in chunk.pieces), output=chunk.output)


def rank_actions(schedule: str, pp: int, rank: int, num_micro_batches: int, virtual_stages: int = 1) -> list[Action]:
    """Pipeline ``rank``'s computation actions in the order it runs them (module docstring)."""
    p, r, m = pp, rank, num_micro_batches
    if not 0 <= r < p or m < 1:
        raise ValueError(f"rank {r} of pp={p} with {m} micro-batches")
    if schedule == "gpipe":
        return [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(m, p - r)
        out = [("F", r, i) for i in range(warm)]
        for i in range(m):
            out.append(("B", r, i))
            if warm + i < m:
                out.append(("F", r, warm + i))
        return out
    from autopar.runtime.pipeline import SCHEDULES      # the plan's schedule name -> torch's class

    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    return _torch_actions(SCHEDULES[schedule], p, r, m, virtual_stages)


def _torch_actions(cls_name: str, p: int, r: int, m: int, v: int) -> list[Action]:
    """torch's action list for rank ``r`` of a multi-stage schedule class, built without a process
    group (the attributes its ``__init__`` would set from one)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.schedules import _ComputationType as CT

    cls = getattr(schedules, cls_name)
    o = cls.__new__(cls)
    o.pp_group_size, o.n_local_stages, o._n_microbatches, o.rank = p, v, m, r
    o.num_stages = o._num_stages = p * v
    o.number_of_rounds = max(1, m // p)
    o.microbatches_per_round = m // o.number_of_rounds
    kind = {CT.FORWARD: "F", CT.FULL_BACKWARD: "B", CT.BACKWARD_INPUT: "I", CT.BACKWARD_WEIGHT: "W"}
    out = []
    for a in o._calculate_single_rank_operations(r):
        if a is None:
            continue
        for x in (a.sub_actions if a.computation_type == CT.OVERLAP_F_B else (a,)):
            if x.computation_type in kind:
                out.append((kind[x.computation_type], x.stage_index, x.microbatch_index))
    return out


def replay_peak_bytes(actions: Sequence[Action], chunks: Mapping[int, Chunk], workspace: float = 0.0,
                      forward_workspace: Optional[float] = None) -> float:
    """The largest live sum of activations, gradients and held join-node gradients over
    ``actions`` (module docstring; ``chunks`` by global stage index), with the backward's
    ``workspace`` (``cost.memory.backward_workspace_bytes``: the gradients at the op with the
    largest output) beside it, or in a chunk's backward its own per piece (``Chunk.workspace``).
    An input pass's own held gradients are made after that op's (the loss's, at the logits, comes
    first; the logits' gradient is one of them): it adds the larger of the two, not both. A split
    stage's weight pass computes no input gradient: no workspace. ``forward_workspace``: beside a
    forward instead (default ``workspace``), where the backward's own transients (a replayed
    layer, saved tensors brought back from the host) do not exist."""
    fwd = workspace if forward_workspace is None else forward_workspace
    acts = grads = held = 0.0
    best = workspace
    started: set[int] = set()            # chunks whose gradients exist
    for kind, stage, _ in actions:
        c = chunks[stage]
        if kind == "F":
            acts += c.activations + c.output
            best = max(best, acts + grads + held + fwd)
        elif kind == "I":
            if c.held > 0:
                best = max(best, acts + grads + held + max(workspace, c.held))
                held += c.held
            acts -= c.output
        elif kind in ("B", "W"):
            first = stage not in started
            started.add(stage)
            weight_only = kind == "W" and c.held > 0           # a weight pass has no input gradients
            spaces = c.workspace or (workspace,) * len(c.pieces)
            for (a, g), ws in zip(c.pieces, spaces):   # before each piece: the later pieces' activations live
                g = g if first else 0.0
                ws = 0.0 if weight_only else ws
                best = max(best, acts + grads + held + ws + (g if c.bucketed else 0.0))
                acts -= a
                grads += g
            best = max(best, acts + grads + held + ws)
            if kind == "W":
                held -= c.held
            elif kind == "B":
                acts -= c.output
    return best


__all__ = ["Action", "Chunk", "activations_only", "rank_actions", "replay_peak_bytes"]
