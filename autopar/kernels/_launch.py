"""Helpers shared by the kernel launchers: device checks, output allocation, sizes, and launch
config lists autotuned on CUDA (``Tuned``; ``recording`` reports which config ran).

Poisoned outputs: with ``AUTOPAR_KERNELS_POISON=1`` in the environment every launcher allocates
its floating-point outputs (and scratch buffers) filled with NaN instead of uninitialised memory,
so a test that compares against a reference fails on any element a kernel forgot to write.
tests/kernels/conftest.py sets it; production runs leave it unset (``torch.empty``).
"""

from __future__ import annotations

import contextlib
import os

import torch

from autopar.kernels import _agree

POISON_ENV = "AUTOPAR_KERNELS_POISON"
# Memory-bound kernels pass this as Tuned(min_numel=...): below ~2 MB of bf16 a launch is
# launch-bound and not worth timing configs for.
TUNE_MIN_NUMEL = 1 << 20
TUNE_ENV = "AUTOPAR_KERNELS_TUNE"
TUNE_MODES = ("agree", "local", "never")


def tuning_mode() -> str:
    """How ``Tuned`` chooses a config on CUDA, from AUTOPAR_KERNELS_TUNE:
    "agree" (default): autotune; in a multi-process torch.distributed world one rank tunes each
        (kernel, key) and every rank launches its choice (``kernels._agree``), so ranks computing
        the same replicated value round it the same way;
    "local": every rank tunes on its own (when each rank's rows are its own, as in pure data
        parallelism, this saves the wait);
    "never": always the list's first (hand-picked) config."""
    mode = os.environ.get(TUNE_ENV, "").strip() or "agree"
    if mode not in TUNE_MODES:
        raise ValueError(f"{TUNE_ENV}={mode!r}: use one of {TUNE_MODES} (unset means 'agree')")
    return mode


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
            "(autopar.kernels.registry.select(name, device)) on CPU, or set TRITON_INTERPRET=1 before "
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


def _torch_scratch(size: int, alignment: int, stream):
    """Triton allocator (``triton.set_allocator``) backed by PyTorch's caching allocator: ``size``
    bytes aligned to ``alignment`` on the current CUDA device. Triton holds the buffer for the
    launch; the caching allocator's stream ordering keeps it valid until the kernel is done."""
    buf = torch.empty(size + alignment, dtype=torch.int8,
                      device=torch.device("cuda", torch.cuda.current_device()))
    skip = -buf.data_ptr() % alignment
    return buf[skip:skip + size]


def ensure_triton_allocator() -> None:
    """Install ``_torch_scratch`` as Triton's allocator unless one is set already (kernels that
    build TMA descriptors on the device need global scratch for them, and Triton's default
    allocator raises). Triton keeps the allocator in a ContextVar, so a thread that never set
    one (PyTorch runs the backward of CUDA tensors on its own threads) starts without: launchers
    call this before every such launch; after the first call in a thread it is one lookup.
    A user's own allocator is kept. Nothing happens at import."""
    import triton

    try:
        from triton.runtime import _allocation
        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # other Triton internals: (re)install ours
        pass
    triton.set_allocator(_torch_scratch)


_recorders: list[dict] = []


@contextlib.contextmanager
def recording():
    """Collect, for every ``Tuned`` launch inside the block, ``{kernel name: {"config": ...}}``,
    plus ``"tuning": {config: median ms}`` for a kernel the autotuner timed inside the block:
    benchmarks/kernel_speed.py reports which config each row ran and by what margin it won. (Each
    launch inside pays a few microseconds for this: record a first call, not a timed loop.)"""
    used: dict = {}
    _recorders.append(used)
    try:
        yield used
    finally:
        _recorders.remove(used)


def describe(config) -> str:
    """A ``triton.Config`` on one line: ``BLOCK_V=16384 num_warps=16 num_stages=3``."""
    parts = [f"{k}={v}" for k, v in config.kwargs.items()]
    return " ".join(parts + [f"num_warps={config.num_warps}", f"num_stages={config.num_stages}"])


class Tuned:
    """A ``@triton.jit`` kernel with an explicit list of launch configs.

    On CUDA, the first launch per key (``key`` plus the dtypes of the tensor arguments) times
    every config through ``triton.autotune`` and keeps the fastest, so a config list that contains
    the previous fixed choice cannot end up slower than it (up to timing noise). In a distributed
    world one rank tunes each key and all ranks launch its choice (``tuning_mode``). Under the
    interpreter there is nothing to time: it launches ``configs[0]``. ``tuned.launch(i, grid,
    *args)`` runs config ``i`` on any device (tests run each config against the reference;
    benchmarks time them one by one). Every launch returns the ``triton.Config`` that ran, for
    launchers whose follow-up work depends on it (how many rows of a partial-sum buffer the chosen
    grid wrote, how many chunks a row was split into).

    ``grid`` is a tuple or a function of the config's kwargs (as for ``triton.autotune``).
    Kernels that write into an input (in-place gradients) must name it in ``restore_value``, and
    accumulators must be named in ``reset_to_zero``: autotuning runs the kernel several times.
    ``min_numel``: when the kernel's first positional argument (a tensor) has fewer elements,
    launch ``configs[0]`` without the autotuner (nor its cache, which would keep that choice for
    later large launches of the same key): such launches take microseconds, configs differ by
    noise there, and timing each costs ~0.1 s (plus its compile) per new key.
    """

    def __init__(self, kernel, configs, key, *, min_numel: int = 0, **autotune_kw) -> None:
        import triton

        if not configs:
            raise ValueError("Tuned needs at least one config")
        self.kernel = kernel
        self.name = kernel.__name__.strip("_")
        self.configs = tuple(configs)
        self.key = tuple(key)
        self.min_numel = min_numel
        self._by_description = {describe(c): c for c in self.configs}
        self._agreed: dict[tuple, object] = {}     # key -> the config the world agreed on
        self._autotuner = triton.autotune(configs=list(self.configs), key=list(key), **autotune_kw)(kernel)

    def run(self, grid, *args, config=None, **kwargs):
        """Launch ``config`` (an index into ``configs``, a ``triton.Config``, or None: the tuned
        choice on CUDA, ``configs[0]`` under the interpreter) and return the ``triton.Config``
        that ran. An explicit config's ``pre_hook`` runs first, as the autotuner runs it
        (attention sizes its TMA boxes there)."""
        c, timings, launched = config, None, False
        if config is None:
            c = self.configs[0]
            if not interpreting() and (not self.min_numel or args[0].numel() >= self.min_numel):
                mode = tuning_mode()
                if mode == "agree" and _agree.world_size() > 1:
                    c, timings, launched = self._agreed_config(grid, args, kwargs)
                elif mode != "never":
                    c, timings, launched = self._autotune(grid, args, kwargs)
        if not hasattr(c, "kwargs"):
            c = self.configs[c or 0]
        if not launched:
            self._launch(c, grid, args, kwargs)
        for used in _recorders:
            entry = used.setdefault(self.name, {})
            entry["config"] = describe(c)
            if timings:
                # do_bench quantiles (median first); inf for a config that did not build
                entry["tuning"] = {describe(k): (t[0] if isinstance(t, (list, tuple)) else t)
                                   for k, t in timings.items()}
        return c

    def _launch(self, c, grid, args, kwargs) -> None:
        if c.pre_hook is not None:
            c.pre_hook({**dict(zip(self.kernel.arg_names, args)), **kwargs, **c.kwargs})
        g = grid(c.kwargs) if callable(grid) else grid
        self.kernel[g](*args, **kwargs, **c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)

    def _autotune(self, grid, args, kwargs):
        """Launch through the autotuner (which times every config on a new key, then runs the
        best): (the config it ran, its timings if it timed them just now, launched=True)."""
        before = getattr(self._autotuner, "configs_timings", None)
        self._autotuner[grid](*args, **kwargs)
        after = getattr(self._autotuner, "configs_timings", None)
        return self._autotuner.best_config, (None if after is before else after), True

    def _agreed_config(self, grid, args, kwargs):
        """The world's config for this launch's key, as (config, timings, launched): tuned and
        launched here by the autotuner if this rank claims the key first, else another rank's
        choice (or this rank's earlier one), still to launch."""
        named = {**dict(zip(self.kernel.arg_names, args)), **kwargs}
        key = tuple(named[k] for k in self.key) + tuple(
            str(v.dtype).removeprefix("torch.") for v in named.values() if hasattr(v, "dtype"))
        if key in self._agreed:
            return self._agreed[key], None, False
        tuned = []

        def tune() -> str:
            tuned.append(self._autotune(grid, args, kwargs))
            return describe(tuned[0][0])

        choice = _agree.agreed_choice(f"{self.kernel.__module__}.{self.name}", key, tune)
        if choice not in self._by_description:
            raise RuntimeError(f"{self.name}: the agreed config {choice!r} is not in this rank's "
                               f"list {sorted(self._by_description)}; every rank must run the same "
                               "autopar version")
        self._agreed[key] = self._by_description[choice]
        return tuned[0] if tuned else (self._agreed[key], None, False)

    def launch(self, i: int, grid, *args, **kwargs):
        return self.run(grid, *args, config=i, **kwargs)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, *args, **kwargs)

    @property
    def best_config(self):
        """The config the last CUDA launch used (None before one, or under the interpreter)."""
        return getattr(self._autotuner, "best_config", None)
