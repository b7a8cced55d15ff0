"""A backend's low-level peer failure (a dead, diverging or stalled rank) re-raised with what
autopar was doing and why."""
from __future__ import annotations

import contextlib

import torch.distributed as dist


class RankCommunicationError(RuntimeError):
    """A collective failed: another rank died, diverged or stalled past the timeout."""


_PEER_FAILURE_WORDS = ("timed out", "connection closed", "connection reset", "broken pipe", "timeout")


@contextlib.contextmanager
def peer_failures(what: str, timeout_s: float):
    """Re-raise a backend's low-level peer failure with what autopar was doing and why."""
    try:
        yield
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [""])[0]
        if isinstance(e, RankCommunicationError) or not any(w in first.lower() for w in _PEER_FAILURE_WORDS):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise RankCommunicationError(
            f"rank {rank}: {what} failed: another rank died, diverged or did not answer within "
            f"{timeout_s:g} s (timeout_s). Check the other ranks' errors. Backend: {first}") from e
