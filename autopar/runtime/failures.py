"""A backend's low-level peer failure (a dead, diverging or stalled rank) re-raised with what
autopar was doing and why; ``is_peer_failure`` tells such an error (a consequence of another
rank's failure) from a rank's own error (``launch.spawn_ranks`` reports the latter as the cause)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch.distributed as dist


class RankCommunicationError(RuntimeError):
    """A collective failed: another rank died, diverged or stalled past the timeout. ``kind``:
    "broken" (the connection to a peer closed) or "timeout"."""

    kind = "broken"


_TIMEOUT_WORDS = ("timed out", "timeout")
_BROKEN_WORDS = ("connection closed", "connection reset", "broken pipe", "connection refused")


def peer_failure_kind(e: BaseException) -> Optional[str]:
    """"timeout" or "broken" (the connection to a peer closed) for a backend's peer failure, by its
    first line; None for anything else."""
    if isinstance(e, RankCommunicationError):
        return e.kind
    if not isinstance(e, RuntimeError):
        return None
    first = (str(e).strip().splitlines() or [""])[0].lower()
    if any(w in first for w in _BROKEN_WORDS):
        return "broken"
    if any(w in first for w in _TIMEOUT_WORDS):
        return "timeout"
    return None


def is_peer_failure(e: BaseException) -> bool:
    """True when ``e`` only says a collective failed because of another rank."""
    return peer_failure_kind(e) is not None


@contextlib.contextmanager
def peer_failures(what: str, timeout_s: float):
    """Re-raise a backend's low-level peer failure with what autopar was doing and why."""
    try:
        yield
    except RuntimeError as e:
        kind = peer_failure_kind(e)
        if isinstance(e, RankCommunicationError) or kind is None:
            raise
        first = str(e).strip().splitlines()[0]
        rank = dist.get_rank() if dist.is_initialized() else 0
        if kind == "broken":
            why = ("the connection to another rank broke: that rank died or failed (its own error, or "
                   "the launcher's report, says why)")
        else:
            why = (f"another rank did not answer within {timeout_s:g} s (timeout_s): it is stuck, took "
                   f"another code path, or is slower than that (then raise timeout_s, `autopar run "
                   f"--timeout SECONDS`)")
        err = RankCommunicationError(f"rank {rank}: {what} failed: {why}. Backend: {first}")
        err.kind = kind
        raise err from e
