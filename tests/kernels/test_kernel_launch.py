"""autopar/kernels/_launch.Tuned's tuning policy (AUTOPAR_KERNELS_TUNE) and autopar/kernels/_agree: in a
distributed world one rank tunes each (kernel, key) and every rank launches its choice. The
multi-rank tests run real gloo worlds; the CUDA-only autotuner is replaced by a stub that "prefers"
a rank-dependent config, so ranks choosing on their own would disagree."""
from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from autopar.runtime.launch import spawn_ranks
from autopar.kernels import _agree, _launch


@triton.jit
def _copy_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


CONFIGS = [triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})]


def _grid(n):
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


class _StubAutotuner:
    """Stands in for triton.autotune on the CPU: "times" the list by preferring config
    ``prefer``, then launches it as the autotuner does; counts the keys it tuned."""

    def __init__(self, tuned: _launch.Tuned, prefer: int) -> None:
        self.tuned, self.prefer, self.tuned_keys = tuned, prefer, 0
        self.best_config = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.tuned_keys += 1
            self.best_config = self.tuned.configs[self.prefer]
            self.configs_timings = {c: [float(i != self.prefer)] for i, c in enumerate(self.tuned.configs)}
            self.tuned._launch(self.best_config, grid, args, kwargs)
        return launch


def _stubbed(prefer: int) -> _launch.Tuned:
    tuned = _launch.Tuned(_copy_kernel, CONFIGS, key=["n"])
    tuned._autotuner = _StubAutotuner(tuned, prefer)
    return tuned


def _copy(tuned: _launch.Tuned, n: int):
    x, y = torch.arange(float(n)), torch.full((n,), float("nan"))
    ran = tuned.run(_grid(n), x, y, n)
    torch.testing.assert_close(y, x)
    return ran


# ---- one process ------------------------------------------------------------------------------

@pytest.mark.parametrize("env,mode", [(None, "agree"), (" ", "agree"), ("local", "local"),
                                      ("never", "never"), ("agree", "agree")])
def test_tuning_mode(monkeypatch, env, mode):
    if env is None:
        monkeypatch.delenv(_launch.TUNE_ENV, raising=False)
    else:
        monkeypatch.setenv(_launch.TUNE_ENV, env)
    assert _launch.tuning_mode() == mode


def test_unknown_mode_is_an_error(monkeypatch):
    monkeypatch.setenv(_launch.TUNE_ENV, "sometimes")
    with pytest.raises(ValueError, match="AUTOPAR_KERNELS_TUNE='sometimes'.*agree"):
        _launch.tuning_mode()


@pytest.mark.parametrize("env,world,tunes", [(None, 1, True), ("local", 2, True), ("never", 1, False),
                                             ("never", 2, False)])
def test_tuning_modes_route_launches(monkeypatch, env, world, tunes):
    """The CUDA path of Tuned (taken here under the interpreter): "never" launches configs[0]
    without the autotuner; a one-process world and "local" autotune without any store."""
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    monkeypatch.setattr(_agree, "world_size", lambda: world)
    monkeypatch.setattr(_agree, "agreed_choice", None)          # calling it would fail
    if env is None:
        monkeypatch.delenv(_launch.TUNE_ENV, raising=False)
    else:
        monkeypatch.setenv(_launch.TUNE_ENV, env)
    tuned = _stubbed(prefer=2)
    ran = _copy(tuned, 100)
    assert tuned._autotuner.tuned_keys == int(tunes)
    assert ran is tuned.configs[2 if tunes else 0]


def test_small_launches_skip_tuning(monkeypatch):
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    tuned = _stubbed(prefer=1)
    tuned.min_numel = 1000
    assert _copy(tuned, 999) is tuned.configs[0] and tuned._autotuner.tuned_keys == 0
    assert _copy(tuned, 1000) is tuned.configs[1] and tuned._autotuner.tuned_keys == 1


# ---- gloo worlds ------------------------------------------------------------------------------

def _choices(rank: int, world: int) -> dict:
    """Every rank meets key "shared" (later ranks slightly later) and offers its own choice;
    only rank 1 meets key "mine"."""
    tuned_here = []

    def tune(name):
        def f():
            tuned_here.append(name)
            time.sleep(0.2)
            return f"config-of-rank-{rank}"
        return f

    time.sleep(0.05 * rank)
    shared = _agree.agreed_choice("test.copy", ("shared", 7), tune("shared"))
    mine = _agree.agreed_choice("test.copy", ("mine",), tune("mine")) if rank == 1 else None
    dist.barrier()
    return {"shared": shared, "mine": mine, "tuned": tuned_here}


def test_one_rank_tunes_each_key_and_all_take_its_choice():
    out = spawn_ranks(_choices, 3, timeout_s=30)
    assert len({o["shared"] for o in out}) == 1, out
    tuners = [r for r, o in enumerate(out) if "shared" in o["tuned"]]
    assert len(tuners) == 1 and out[0]["shared"] == f"config-of-rank-{tuners[0]}", out
    assert out[1]["mine"] == "config-of-rank-1" and "mine" in out[1]["tuned"]   # no wait, no hang


def _claimant_fails(rank: int, world: int) -> str:
    if rank == 0:
        def broken():
            raise RuntimeError("out of shared memory for BLOCK=128")
        try:
            _agree.agreed_choice("test.copy", ("k",), broken)
        except RuntimeError as e:
            dist.barrier()
            return f"raised: {e}"
    dist.barrier()
    start = time.monotonic()
    try:
        _agree.agreed_choice("test.copy", ("k",), lambda: "never asked")
    except _agree.TuningAgreementError as e:
        return f"{time.monotonic() - start:.1f}s {e}"
    return "no error"


def test_a_failed_tuning_fails_the_waiting_ranks_at_once():
    out = spawn_ranks(_claimant_fails, 2, timeout_s=30)
    assert out[0] == "raised: out of shared memory for BLOCK=128"
    seconds, msg = out[1].split(" ", 1)
    assert float(seconds[:-1]) < 5, out[1]
    assert "rank 0 failed to autotune kernel test.copy" in msg and "BLOCK=128" in msg, msg


def _claimant_stalls(rank: int, world: int) -> str:
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:           # claims the key and never publishes: stuck, as far as rank 1 knows
        store.compare_set(f"{_agree.PREFIX}/test.copy/k/claim", "", "0")
    dist.barrier()
    if rank == 0:
        return "claimed"
    try:
        _agree.agreed_choice("test.copy", ("k",), lambda: "never asked",
                             timeout=datetime.timedelta(seconds=1))
    except _agree.TuningAgreementError as e:
        return str(e)
    return "no error"


def test_a_stuck_claimant_times_out_with_a_clear_error():
    msg = spawn_ranks(_claimant_stalls, 2, timeout_s=30)[1]
    assert "rank 1 waited 1 s for rank 0 to autotune kernel test.copy" in msg, msg
    assert "AUTOPAR_KERNELS_TUNE=never" in msg


def _rank_device() -> None:
    """Spawned ranks do not read conftest: under AUTOPAR_TEST_DEVICE=cuda their tensors go to the
    GPU too (the kernels are compiled, not interpreted, there)."""
    if os.environ.get("AUTOPAR_TEST_DEVICE", "cpu") == "cuda":
        torch.set_default_device("cuda")


def _tuned_launches(rank: int, world: int) -> dict:
    """Tuned's own path in a gloo world, each rank's stub preferring a different config."""
    _rank_device()
    _launch.interpreting = lambda: False          # this process only: take the CUDA decision path
    tuned = _stubbed(prefer=rank)
    time.sleep(0.05 * rank)
    ran = [_launch.describe(_copy(tuned, n)) for n in (100, 100, 37)]
    dist.barrier()
    return {"ran": ran, "tuned_keys": tuned._autotuner.tuned_keys}


def test_tuned_kernels_launch_the_same_config_on_every_rank():
    out = spawn_ranks(_tuned_launches, 3, timeout_s=60)
    assert len({tuple(o["ran"]) for o in out}) == 1, out
    assert out[0]["ran"][0] == out[0]["ran"][1]
    assert sum(o["tuned_keys"] for o in out) == 2, out       # keys n=100 and n=37, once each


def _real_tuning(rank: int, world: int) -> dict:
    """Both ranks on the one GPU: LayerNorm forward and backward, autotuned for real."""
    from autopar.kernels.norms import layer_norm

    _rank_device()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    with _launch.recording() as used:
        layer_norm(x, w, None).float().square().sum().backward()
    torch.cuda.synchronize()
    dist.barrier()
    return {k: {"config": v["config"], "tuned": "tuning" in v} for k, v in used.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autotuning runs on CUDA only")
def test_real_autotuning_agrees_across_ranks():
    out = spawn_ranks(_real_tuning, 2, timeout_s=120)
    assert out[0].keys() == out[1].keys() and len(out[0]) == 2, out     # forward and backward
    for kernel in out[0]:
        assert out[0][kernel]["config"] == out[1][kernel]["config"], (kernel, out)
        assert out[0][kernel]["tuned"] + out[1][kernel]["tuned"] == 1, (kernel, out)
