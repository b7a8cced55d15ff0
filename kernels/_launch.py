"""Helpers shared by the kernel launchers: device checks, output allocation, sizes.

Poisoned outputs: with ``AUTOPAR_KERNELS_POISON=1`` in the environment every launcher allocates
its floating-point outputs (and scratch buffers) filled with NaN instead of uninitialised memory,
so a test that compares against a reference fails on any element a kernel forgot to write.
tests/kernels/conftest.py sets it; production runs leave it unset (``torch.empty``).
"""

from __future__ import annotations

import os

import torch

POISON_ENV = "AUTOPAR_KERNELS_POISON"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def poisoning() -> bool:
    return os.environ.get(POISON_ENV, "0") == "1"


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty``, or a NaN-filled tensor when poisoning is on (floating dtypes only)."""
    if poisoning() and dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return empty(t.shape, dtype or t.dtype, t.device)


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """Raise a ValueError saying what to change when a Triton kernel cannot run on these tensors."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{name}: the Triton kernel needs CUDA tensors (got {device}); use the reference "
            "(kernels.registry.select(name, device)) on CPU, or set TRITON_INTERPRET=1 before "
            "importing triton to run the kernel in the interpreter"
        )


def num_programs_hint(device: torch.device) -> int:
    """How many persistent programs to launch: the SM count on CUDA, a handful in the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def float_dtypes_ok(name: str, *tensors: torch.Tensor) -> None:
    ok = (torch.float32, torch.bfloat16, torch.float16)
    for t in tensors:
        if t.dtype not in ok:
            raise ValueError(f"{name}: dtype {t.dtype} is not supported; use one of {ok}")


class Tuned:
    """A ``@triton.jit`` kernel with an explicit list of launch configs.

    On CUDA ``tuned[grid](*args)`` launches through ``triton.autotune`` (keyed on ``key`` plus the
    dtypes of the tensor arguments): the first launch per key times every config and keeps the
    fastest, so a config list that contains the previous fixed choice cannot end up slower than it
    (up to timing noise). Under the interpreter there is nothing to time: it launches
    ``configs[0]``. ``tuned.launch(i, grid, *args)`` runs config ``i`` on any device (tests run each
    config against the reference; benchmarks time them one by one).

    ``grid`` is a tuple or a function of the config's kwargs (as for ``triton.autotune``).
    Kernels that write into an input (in-place gradients) must name it in ``restore_value``, and
    accumulators must be named in ``reset_to_zero``: autotuning runs the kernel several times.
    """

    def __init__(self, kernel, configs, key, **autotune_kw) -> None:
        import triton

        if not configs:
            raise ValueError("Tuned needs at least one config")
        self.kernel = kernel
        self.configs = tuple(configs)
        self._autotuner = triton.autotune(configs=list(self.configs), key=list(key), **autotune_kw)(kernel)

    def launch(self, i: int, grid, *args, **kwargs):
        c = self.configs[i]
        g = grid(c.kwargs) if callable(grid) else grid
        return self.kernel[g](*args, **kwargs, **c.kwargs, num_warps=c.num_warps,
                              num_stages=c.num_stages)

    def __getitem__(self, grid):
        if interpreting():
            return lambda *args, **kwargs: self.launch(0, grid, *args, **kwargs)
        return self._autotuner[grid]

    @property
    def best_config(self):
        """The config the last CUDA launch used (None before one, or under the interpreter)."""
        return getattr(self._autotuner, "best_config", None)
