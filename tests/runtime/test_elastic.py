"""Elastic re-plan under torchrun (``autopar/elastic.py``): two agents (``--nnodes=1:2``, one worker
each) train gpt-tiny with checkpoints; one agent and its worker are SIGKILLed mid-run; the other
agent restarts its worker in a world of 1, which re-plans, reshards the last checkpoint and trains
to the end. Its losses are one process's on the same steps (the checkpoint holds the weights,
AdamW state and data position; the rest is fp32 summation order, as in test_checkpoint.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from autopar.cli_run import reference_losses
from autopar.runtime.checkpoint import CheckpointError, latest_checkpoint, read_meta
from autopar.runtime.launch import free_port

STEPS = 16


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _kill_tree(pid: int) -> None:
    for child in _children(pid):
        _kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _progress(ck: str) -> int:
    try:
        with open(os.path.join(ck, "progress")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def _saved_by_two(ck: str) -> bool:
    """A checkpoint of the two-rank world is committed (the agents may first have run alone)."""
    path = latest_checkpoint(ck)
    try:
        return path is not None and read_meta(path)["world_size"] == 2
    except (CheckpointError, OSError, KeyError):
        return False


def test_a_lost_node_is_replanned_and_resumed(tmp_path):
    ck, out = str(tmp_path / "ck"), str(tmp_path / "a.json")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.5",
           "--rdzv-conf=last_call_timeout=5,join_timeout=60,close_timeout=5,is_host=IS_HOST",
           "-m", "autopar.elastic", "gpt-tiny", "--steps", str(STEPS), "--checkpoint-dir", ck,
           "--checkpoint-every", "2", "--timeout", "30"]
    logs = [open(tmp_path / f"{n}.log", "w") for n in "ab"]
    def agent(is_host: int) -> list[str]:            # a hosts the rendezvous store, b only connects to it
        return [c.replace("IS_HOST", str(is_host)) for c in cmd]

    a = subprocess.Popen(agent(1) + ["--json", out], stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True)
    time.sleep(1.0)
    b = subprocess.Popen(agent(0), stdout=logs[1], stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _saved_by_two(ck) or _progress(ck) < 3:   # a world of 2 has saved (asynchronously)
            assert time.monotonic() < deadline and a.poll() is None, (tmp_path / "a.log").read_text()[-3000:]
            time.sleep(0.1)
        _kill_tree(b.pid)                             # the node is gone: agent and worker
        assert a.wait(timeout=180) == 0, (tmp_path / "a.log").read_text()[-3000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                _kill_tree(p.pid)
        for f in logs:
            f.close()
    with open(out) as f:
        result = json.load(f)
    assert result["world_size"] == 1
    assert "world 2 -> 1 ranks" in result["resumed"] and "steps lost" in result["resumed"]
    first = result["first_step"]
    assert 3 <= first <= STEPS and len(result["losses"]) == STEPS - first + 1
    ref = reference_losses("gpt-tiny", STEPS, batch=None, seq_len=None, seed=0)[first - 1:]
    assert result["losses"] == pytest.approx(ref, rel=1e-5)
