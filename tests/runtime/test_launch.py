"""``autopar run``'s backend: N CPU ranks planned by the solver vs one process, and a failing run;
the launcher (``runtime/launch.py``): a dead or stopped rank named at once, a run that keeps
progressing never cut short, nothing left behind when the launcher is killed, results loaded with
weights_only=True."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from autopar.plan import Plan
from autopar.cli_run import run_command
from autopar.runtime.launch import (DEFAULT_RUN_TIMEOUT_S, HEARTBEAT_INTERVAL_S, SETTLE_S, RankFailure,
                                    spawn_ranks)
from handplans import hand_plan
from launch_bodies import returns, signals_itself, spins, steady

pytestmark = pytest.mark.slow


def test_run_command_matches_reference(tmp_path, capsys):
    path = tmp_path / "run.json"
    res = run_command("gpt-tiny", nproc=2, steps=2, force="dp=2,zero=1", json_path=str(path), batch=4, seed=3)
    assert len(res["losses"]) == 2 and len(res["reference_losses"]) == 2
    # Losses only (autopar run trains AdamW): Adam magnifies round-off only in entries whose gradient
    # is ~0, which move the loss by ~g*dp ~ 0; the rest is a few ulps of a loss ~5.5 (4.8e-7 each).
    assert res["max_abs_diff"] <= 1e-5
    assert res["summary"]["data_parallel"] == 2 and res["summary"]["zero_stage"] == 1
    written = json.loads(path.read_text())
    assert written["losses"] == res["losses"]
    assert Plan.from_dict(written["plan"]).summary() == res["summary"]      # the whole plan
    # dp=2 ZeRO-1: gradients reduced and parameters gathered on dp each step; no other axis used
    assert set(written["collectives"]) == {"dp"}, written["collectives"]
    dp = written["collectives"]["dp"]
    assert dp["count"] >= 2 * 2 and dp["bytes"] > 0 and set(dp["kinds"]) >= {"all_gather"}
    printed = capsys.readouterr().out
    assert "step 1: loss" in printed and "max |loss - reference|" in printed


def test_run_command_reports_rank_errors():
    with pytest.raises(RankFailure, match="does not divide the world size 2"):
        run_command("gpt-tiny", nproc=2, steps=1, force="tp=3", batch=4, timeout_s=20)


def test_run_command_with_lamb_under_tensor_parallelism(tiny_full, tmp_path):
    """``autopar run --optimizer lamb --plan FILE``: LAMB's per-tensor trust ratios stay the whole
    tensors' on tp shards, so the losses equal one process. The plan is Megatron's (the solver
    replicates a model this small on the "cpu" cluster, which would prove nothing): the run must
    have carried tp traffic."""
    plan_file = tmp_path / "megatron.json"
    hand_plan(tiny_full, dp=1, tp=2, family="megatron").save(str(plan_file))
    res = run_command("gpt-tiny", nproc=2, steps=3, plan_path=str(plan_file), batch=4, optimizer="lamb")
    assert res["summary"]["tensor_parallel"] == 2
    assert res["collectives"]["tp"]["count"] >= 3 * 2 * 2, res["collectives"]   # >= 2 all-reduces per layer per step
    assert res["max_abs_diff"] <= 1e-5, res
    with pytest.raises(ValueError, match="choose one of"):
        run_command("gpt-tiny", nproc=2, steps=1, optimizer="sgd")


def test_run_command_in_bf16_against_one_process_under_autocast(tiny_full, tmp_path):
    """``autopar run --dtype bf16 --plan FILE``: the plan's dtype is bf16, the ranks run it under
    autocast and the reference is one process under autocast. Losses within 8 bf16 roundings of
    their size (tests/runtime/test_precision.py derives the bound; AdamW here, 3 steps)."""
    import dataclasses

    plan_file = tmp_path / "megatron_bf16.json"
    dataclasses.replace(hand_plan(tiny_full, dp=1, tp=2, family="megatron"), dtype="bfloat16").save(str(plan_file))
    res = run_command("gpt-tiny", nproc=2, steps=3, plan_path=str(plan_file), batch=4, dtype="bf16")
    assert res["plan"]["dtype"] == "bfloat16" and res["collectives"]["tp"]["count"] > 0
    assert all(abs(a - b) <= 8 * 2 ** -8 * abs(b) for a, b in zip(res["losses"], res["reference_losses"])), res
    with pytest.raises(ValueError, match="was made for bfloat16 compute"):
        run_command("gpt-tiny", nproc=2, steps=1, plan_path=str(plan_file), batch=4, dtype="fp16", timeout_s=30)


# ---- failing fast and clearly, leaving nothing behind (runtime/launch.py) ----------------------

def _gone(pid: int) -> bool:
    """No such process, or only a zombie left for init to reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_a_killed_rank_is_named_at_once_and_printed_once(tmp_path):
    """kill -9 of rank 1 mid-run: the failure names rank 1 and SIGKILL (not the survivors'
    connection errors) within the launcher's settle time; each line once."""
    stamp = tmp_path / "killed.json"
    with pytest.raises(RankFailure) as info:
        spawn_ranks(signals_itself, 3, (1, 3, int(signal.SIGKILL), str(stamp)), timeout_s=60)
    detected = time.monotonic() - json.loads(stamp.read_text())["t"]
    e = info.value
    assert e.causes == {1: "was killed by SIGKILL after step 2"}, e.causes
    assert set(e.consequences) <= {0, 2}
    summary = e.summary()
    lines = summary.splitlines()
    assert lines[0] == "rank 1 was killed by SIGKILL after step 2", summary
    assert summary.count("SIGKILL") == 1 and len(lines) == len(set(lines)) <= 2, summary
    assert all("rank 1" not in ln and "as a consequence" in ln for ln in lines[1:]), summary
    assert str(e).startswith("rank 1 was killed by SIGKILL after step 2; every other rank was stopped")
    assert detected < SETTLE_S + 5, detected


def test_a_rank_killed_by_a_fatal_signal_shows_where_its_threads_were(tmp_path):
    """SIGABRT (a native abort: gloo's or torch's C++ throwing on a thread of their own) leaves no
    Python error: the failure carries faulthandler's stacks of the rank, naming the function that was
    running. A SIGKILL gives no stacks (nothing runs)."""
    with pytest.raises(RankFailure) as info:
        spawn_ranks(signals_itself, 2, (1, 2, int(signal.SIGABRT), str(tmp_path / "s.json")), timeout_s=60)
    text = str(info.value)
    assert info.value.causes == {1: "was killed by SIGABRT after step 1"}, info.value.causes
    assert "--- rank 1 (was killed by SIGABRT after step 1): its threads at the signal ---" in text, text
    assert "Fatal Python error: Aborted" in text and 'in signals_itself' in text, text
    with pytest.raises(RankFailure) as info:
        spawn_ranks(signals_itself, 2, (1, 2, int(signal.SIGKILL), str(tmp_path / "k.json")), timeout_s=60)
    assert "its threads at the signal" not in str(info.value), str(info.value)


def test_a_stopped_rank_is_found_by_its_heartbeat(tmp_path):
    """SIGSTOP of rank 1: its peers would wait for the 60 s collective timeout; the launcher sees
    its heartbeat stop after heartbeat_timeout_s, kills every rank and says so."""
    stamp = tmp_path / "stopped.json"
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn_ranks(signals_itself, 2, (1, 3, int(signal.SIGSTOP), str(stamp)), timeout_s=60,
                    heartbeat_timeout_s=3)
    victim = json.loads(stamp.read_text())
    detected = time.monotonic() - victim["t"]
    e = info.value
    assert set(e.causes) == {1} and not e.consequences, e.causes
    assert e.causes[1].startswith("stopped responding after step 2: no heartbeat for"), e.causes
    assert "stopped (SIGSTOP" in e.causes[1], e.causes
    assert detected < 3 + HEARTBEAT_INTERVAL_S + 5 and time.monotonic() - t0 < 40, detected
    assert _gone(victim["pid"])


def test_a_stopped_rank_is_named_when_its_peers_time_out_first(tmp_path):
    """Collective timeout (3 s) shorter than the heartbeat timeout (30 s): the peers' timeouts end
    the run, and the report still names the silent rank as the cause, the timeouts as consequences."""
    stamp = tmp_path / "stopped.json"
    with pytest.raises(RankFailure) as info:
        spawn_ranks(signals_itself, 3, (1, 3, int(signal.SIGSTOP), str(stamp)), timeout_s=3)
    e = info.value
    assert set(e.causes) == {1} and set(e.consequences) == {0, 2}, (e.causes, e.consequences)
    assert e.causes[1].startswith("stopped responding after step 2: no heartbeat for"), e.causes
    lines = e.summary().splitlines()
    assert len(lines) == 2 and lines[1].startswith("ranks 0, 2 then failed as a consequence (a peer did "
                                                   "not answer within timeout_s)"), lines


def test_a_run_that_keeps_progressing_outlives_the_progress_timeout():
    """8 s of steps every 0.2 s under a 3 s progress timeout: the deadline moves with progress."""
    out = spawn_ranks(steady, 2, (8.0, 0.2), timeout_s=30, progress_timeout_s=3)
    assert out[0]["elapsed"] >= 8 and out[0]["steps"] == out[1]["steps"] >= 10, out


def test_ranks_alive_without_progress_are_stopped():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn_ranks(spins, 2, timeout_s=30, progress_timeout_s=3)
    elapsed = time.monotonic() - t0
    e = info.value
    assert set(e.causes) == {0, 1} and "made no progress for" in e.causes[0], e.causes
    assert "--timeout" in e.summary() and len(e.summary().splitlines()) == 1, e.summary()
    assert 3 <= elapsed < 3 + 20, elapsed


def test_results_are_loaded_with_weights_only():
    import torch

    out = spawn_ranks(returns, 2, ("plain",))
    assert out[1]["l"] == [1, (2, None)] and torch.equal(out[1]["t"], torch.tensor([0, 1, 2]))
    with pytest.raises(RankFailure, match=r"rank 0 returned a result that torch.load\(weights_only=True\) "
                                          r"refuses \(it holds getattr\); return tensors"):
        spawn_ranks(returns, 2, ("object",))


def test_ranks_are_spawned_fresh_where_cuda_is(monkeypatch):
    """Where CUDA is, ranks start by spawn, not from the forkserver (whose warm-up trace initializes
    CUDA, which a forked process cannot use again: the first lent GPU failed so). Here the launcher
    is told CUDA exists; the spawned ranks (fresh interpreters, no CUDA) run on gloo and return."""
    import torch

    from autopar.runtime import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert launch._context().get_start_method() == "spawn"
    out = spawn_ranks(returns, 2, ("plain",))
    assert [o["rank"] for o in out] == [0, 1] and torch.equal(out[1]["t"], torch.tensor([0, 1, 2]))


LAUNCHER = """
import signal, sys
import multiprocessing.resource_tracker as rt
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
from autopar.runtime.launch import spawn_ranks
from launch_bodies import reports_pids
if __name__ == "__main__":
    rt.ensure_running()
    open({tracker!r}, "w").write(str(rt._resource_tracker._pid))
    spawn_ranks(reports_pids, 2, ({directory!r},), timeout_s=60)
"""


def _wait_until(check, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_launcher_takes_its_ranks_with_it(tmp_path, sig):
    """The launcher killed mid-run: its ranks exit within seconds (under SIGKILL, rank 0 is stopped
    first: it cannot act, the kernel kills it when the forkserver goes), then its forkserver and
    resource tracker, and its pymp-* temp dir is removed."""
    tracker = tmp_path / "tracker"
    code = LAUNCHER.format(tests=os.path.dirname(__file__), tracker=str(tracker), directory=str(tmp_path))
    launcher = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        files = [tmp_path / f"rank{r}.json" for r in range(2)]
        assert _wait_until(lambda: all(f.exists() for f in files), 120), launcher.stderr
        infos = [json.loads(f.read_text()) for f in files]
        if sig == signal.SIGKILL:
            os.kill(infos[0]["pid"], signal.SIGSTOP)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=60)   # EOF once the forkserver and tracker exit too
        rc = launcher.returncode
    finally:
        launcher.kill()
    assert rc == -sig if sig == signal.SIGKILL else rc == 128 + sig, (rc, err)
    if sig == signal.SIGTERM:
        assert err.count("SIGTERM received; stopping every rank") == 1, err
    assert _wait_until(lambda: all(_gone(i["pid"]) for i in infos), 10), infos
    others = [infos[0]["ppid"], int(tracker.read_text())]          # the forkserver, the resource tracker
    assert _wait_until(lambda: all(_gone(pid) for pid in others), 30), others
    tempdirs = {i["tempdir"] for i in infos} - {None}
    assert tempdirs and _wait_until(lambda: not any(os.path.exists(d) for d in tempdirs), 10), tempdirs
    assert "leaked" not in err and "Traceback" not in err, err


def test_cli_timeout_reaches_the_launcher(monkeypatch):
    import autopar.cli_run
    from autopar.cli import main

    seen = []
    monkeypatch.setattr(autopar.cli_run, "run_command", lambda *a, **kw: seen.append(kw["timeout_s"]))
    assert main(["run", "gpt-tiny", "--timeout", "7.5"]) == 0
    assert main(["run", "gpt-tiny"]) == 0
    assert seen == [7.5, DEFAULT_RUN_TIMEOUT_S]


@pytest.mark.parametrize("backend,expect,not_expect", [
    ("Connection reset by peer [127.0.0.1]:123", "the connection to another rank broke", "did not answer"),
    ("Timed out waiting 5000ms for recv operation to complete", "did not answer within 5 s", "broke"),
])
def test_peer_failures_say_what_happened(backend, expect, not_expect):
    from autopar.runtime.failures import RankCommunicationError, is_peer_failure, peer_failures

    with pytest.raises(RankCommunicationError) as info:
        with peer_failures("a training step", 5):
            raise RuntimeError(backend)
    assert expect in str(info.value) and not_expect not in str(info.value), str(info.value)
    assert is_peer_failure(info.value) and not is_peer_failure(ValueError(backend))


def test_every_module_the_forkserver_preloads_exists():
    """The forkserver skips a preload that fails to import: a renamed module would silently cost
    every rank its import again. Each one imports, and the warm-up trace runs and leaves the global
    RNG (which ranks inherit from the forkserver) as it found it."""
    import importlib

    import torch

    from autopar.runtime import forkserver_warm
    from autopar.runtime.launch import _PRELOAD

    for name in _PRELOAD:
        importlib.import_module(name)
    before = torch.get_rng_state()
    forkserver_warm.warm()
    assert torch.equal(torch.get_rng_state(), before)
