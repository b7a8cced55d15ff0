"""A heartbeat watchdog for ranks started by torchrun (or any launcher without autopar's own).

A rank that is stopped (SIGSTOP), frozen or cut off without a TCP reset leaves its peers blocked
in a collective until the collective timeout (``timeout_s``, minutes on big jobs). The watchdog
names it within ``stale_s`` instead: every rank's thread bumps a counter in the job's store every
``interval_s``; rank 0's thread reads all counters (one ``multi_get``) and every other rank's reads
rank 0's. A counter that has not moved for ``stale_s`` (measured on the reader's own clock, so no
clock agreement is needed) is a stuck rank: rank 0 posts one message for everyone, and every rank
that sees it (or that sees rank 0 stuck) prints it once on stderr and exits with status 1, which
makes the launcher tear the job down (torchrun: every worker stopped; SIGKILL also ends a stopped
process). Store load per interval: one add per rank, one get per rank, one ``multi_get`` of all
counters on rank 0.

It only sees processes that stopped running Python threads. A rank that keeps running but never
reaches the next collective (a deadlock in user code) is the collective timeout's job.

``spawn_ranks`` (``runtime/launch.py``, ``autopar run``) has its own heartbeat; ranks it starts do
not run this one.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Optional

_PREFIX = "autopar/heartbeat/"
_ABORT = "autopar/heartbeat/abort"


def _exit(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


class Watchdog:
    """Start with ``start()``; ``stop()`` ends the thread (e.g. before ``destroy_process_group``)."""

    def __init__(self, store, rank: int, world: int, *, stale_s: float = 30.0, interval_s: Optional[float] = None,
                 on_stuck: Callable[[str], None] = _exit) -> None:
        if stale_s <= 0:
            raise ValueError(f"heartbeat timeout {stale_s} s: give a positive number of seconds (or None to disable)")
        self.store, self.rank, self.world = store, rank, world
        self.stale_s = stale_s
        self.interval_s = interval_s if interval_s is not None else min(2.0, stale_s / 5)
        self.on_stuck = on_stuck
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autopar-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self.store.add(self._key(self.rank), 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _key(self, rank: int) -> str:
        return f"{_PREFIX}{rank}"

    def _run(self) -> None:
        watched = list(range(self.world)) if self.rank == 0 else [0]
        last: dict[int, bytes] = {}
        moved = {r: time.monotonic() for r in watched}
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(self._key(self.rank), 1)
                if self.store.check([_ABORT]):
                    self.on_stuck(self.store.get(_ABORT).decode())
                    return
                values = self.store.multi_get([self._key(r) for r in watched])
            except Exception:          # the store went away: the job is ending; collectives report it
                return
            now = time.monotonic()
            for r, v in zip(watched, values):
                if last.get(r) != v:
                    last[r], moved[r] = v, now
            stuck = [r for r in watched if r != self.rank and now - moved[r] > self.stale_s]
            if stuck:
                message = (f"autopar: rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} stopped "
                           f"responding: no heartbeat for {self.stale_s:g} s (stopped, frozen or cut off); "
                           f"rank {self.rank} ends the job (heartbeat_timeout_s sets this bound)")
                if self.rank == 0:
                    try:
                        self.store.set(_ABORT, message)
                    except Exception:
                        pass
                self.on_stuck(message)
                return
