"""The heartbeat watchdog for torchrun-launched ranks (``runtime/watchdog.py``): a rank that stops
is named within the heartbeat timeout, long before the collective timeout."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from autopar.runtime.watchdog import Watchdog
from test_elastic import _children, _kill_tree, _progress


def test_a_silent_rank_is_named_by_rank_0_and_everyone_stops():
    store = dist.HashStore()
    seen: dict[int, str] = {}
    done = threading.Event()

    def on_stuck(rank):
        def record(message: str) -> None:
            seen[rank] = message
            if len(seen) == 2:
                done.set()
        return record

    dogs = [Watchdog(store, r, 3, stale_s=1.0, interval_s=0.1, on_stuck=on_stuck(r)).start() for r in range(3)]
    time.sleep(0.5)
    assert not seen                                  # everyone beating: nothing to say
    t0 = time.monotonic()
    dogs[2].stop()                                   # rank 2 goes silent
    assert done.wait(5.0), seen
    assert time.monotonic() - t0 < 1.0 + 1.0         # stale_s plus a few intervals
    assert sorted(seen) == [0, 1] and "rank 2 stopped responding" in seen[0] and seen[1] == seen[0]
    for d in dogs:
        d.stop()


def _rank_of(pid: int) -> int:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"])


def test_a_stopped_worker_ends_the_torchrun_job_within_the_heartbeat_timeout(tmp_path):
    ck = str(tmp_path / "ck")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node=2", "-m", "autopar.elastic", "gpt-tiny",
           "--steps", "100000", "--checkpoint-dir", ck, "--checkpoint-every", "100000",
           "--timeout", "300", "--heartbeat-timeout", "4"]
    with open(tmp_path / "log", "w") as log:
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while _progress(ck) < 2:
                assert time.monotonic() < deadline and job.poll() is None, (tmp_path / "log").read_text()[-3000:]
                time.sleep(0.1)
            workers = [p for p in _children(job.pid) if _rank_of(p) == 1]
            assert len(workers) == 1
            os.kill(workers[0], signal.SIGSTOP)
            t0 = time.monotonic()
            while "rank 1 stopped responding" not in (tmp_path / "log").read_text():
                assert time.monotonic() - t0 < 4 + 20, "no watchdog message"   # vs the 300 s collective timeout
                time.sleep(0.1)
        finally:            # (torchrun itself SIGKILLs the stopped worker after its 30 s SIGTERM grace)
            _kill_tree(job.pid)
    out = (tmp_path / "log").read_text()
    assert "rank 1 stopped responding: no heartbeat for 4 s" in out, out[-3000:]
