"""One autotuning choice for every rank of a torch.distributed world.

Ranks that tune independently can pick configs with different reduction orders. Where
tensor-parallel ranks compute the same replicated value (a LayerNorm weight gradient), its rounding
would then differ across ranks and replicated parameters would drift apart. ``agreed_choice`` makes
the choice once per (kernel, key) for the whole world, through the process group's store
(no collective, so nothing has to line up across ranks):

- the first rank to reach a key claims it (``compare_set`` on ``<key>/claim``), tunes it alone and
  publishes the winner (``<key>/choice``); a key only one rank ever meets is tuned by that rank;
- every other rank reaching the key waits for the choice (bounded by the store's timeout, the
  process group's) and launches it;
- a claimant whose tuning raises publishes the error, so the waiting ranks fail at once with it
  instead of at the timeout.

The wait cannot deadlock: a claimant publishes as soon as its own tuning ends, and tuning needs no
other rank. (On CUDA, tuning synchronizes the device; a collective still in flight there completes
because an SPMD program enqueues the same collectives on every rank before it reaches the same
kernel launch.)
"""
from __future__ import annotations

import datetime
from typing import Callable, Optional

import torch.distributed as dist

PREFIX = "autopar/tune"
_ERROR = "error:"


class TuningAgreementError(RuntimeError):
    """A rank could not learn the config another rank chose for a kernel."""


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agreed_choice(kernel: str, key: tuple, tune: Callable[[], str], *,
                  timeout: Optional[datetime.timedelta] = None) -> str:
    """The config (a string naming it, from ``tune()`` on whichever rank tuned this key) that every
    rank launches for ``kernel`` at ``key``. Call it in an initialized process group."""
    store = dist.distributed_c10d._get_default_store()
    base = f"{PREFIX}/{kernel}/{'/'.join(map(str, key))}"
    rank = str(dist.get_rank())
    if store.compare_set(f"{base}/claim", "", rank).decode() == rank:
        try:
            choice = tune()
        except BaseException as e:
            store.set(f"{base}/choice", f"{_ERROR}{type(e).__name__}: {e}")
            raise
        store.set(f"{base}/choice", choice)
        return choice
    claimant = store.get(f"{base}/claim").decode()
    timeout = timeout or store.timeout
    try:
        store.wait([f"{base}/choice"], timeout)
    except RuntimeError as e:   # DistStoreError: the claimant stopped, or is stuck
        raise TuningAgreementError(
            f"rank {rank} waited {timeout.total_seconds():.0f} s for rank {claimant} to autotune "
            f"kernel {kernel} at key {key} and publish its choice; that rank stopped or is stuck. "
            "Look at its error, or set AUTOPAR_KERNELS_TUNE=never to launch every kernel's first "
            "config without tuning") from e
    choice = store.get(f"{base}/choice").decode()
    if choice.startswith(_ERROR):
        raise TuningAgreementError(f"rank {claimant} failed to autotune kernel {kernel} at key "
                                   f"{key}: {choice[len(_ERROR):]}")
    return choice
