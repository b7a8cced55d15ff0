"""kernels/_launch.Tuned's tuning policy: autotune in a one-process world only (unless told), so
the ranks of a distributed run all launch the same config (tuning_allowed)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels import _launch


@triton.jit
def _copy_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


def _world(monkeypatch, size: int) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: size > 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)


@pytest.mark.parametrize("env,world,allowed", [
    (None, 0, True), (None, 1, True), (None, 2, False), ("single", 4, False),
    ("always", 2, True), ("never", 1, False), (" ", 2, False),
])
def test_tuning_allowed(monkeypatch, env, world, allowed):
    _world(monkeypatch, world)
    if env is None:
        monkeypatch.delenv(_launch.TUNE_ENV, raising=False)
    else:
        monkeypatch.setenv(_launch.TUNE_ENV, env)
    assert _launch.tuning_allowed() is allowed


def test_unknown_mode_is_an_error(monkeypatch):
    monkeypatch.setenv(_launch.TUNE_ENV, "sometimes")
    with pytest.raises(ValueError, match="AUTOPAR_KERNELS_TUNE='sometimes'.*single"):
        _launch.tuning_allowed()


class _NoTuning:
    def __getitem__(self, grid):
        raise AssertionError("the autotuner ran in a distributed world")


@pytest.mark.parametrize("world,tunes", [(1, True), (2, False)])
def test_distributed_run_launches_the_first_config(monkeypatch, world, tunes):
    """The CUDA path of Tuned (taken here under the interpreter): in a 2-rank world it launches
    configs[0] without the autotuner; in a one-process world it autotunes."""
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    monkeypatch.delenv(_launch.TUNE_ENV, raising=False)
    _world(monkeypatch, world)
    tuned = _launch.Tuned(_copy_kernel, [triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})],
                          key=["n"])
    calls = []

    class _Stub:
        best_config = tuned.configs[1]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(grid)

    monkeypatch.setattr(tuned, "_autotuner", _Stub() if tunes else _NoTuning())
    x, y = torch.arange(100.0), torch.full((100,), float("nan"))
    ran = tuned.run(lambda meta: (triton.cdiv(100, meta["BLOCK"]),), x, y, 100)
    if tunes:
        assert calls and ran is tuned.configs[1]
    else:
        assert ran is tuned.configs[0]
        torch.testing.assert_close(y, x)
