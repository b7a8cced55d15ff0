"""Microbenchmarks shared by ``autopar calibrate`` (``autopar/calibrate.py``) and
``benchmarks/calibrate.py``: timing, GEMMs at transformer-training shapes, SDPA, memory copy.

Every function measures on the device it is given (``torch.device("cuda", i)`` or ``"cpu"``) and
returns seconds or rates; none decides what the figures mean for the cost model (the callers do).

- ``time_per_call(fn, device)``: mean seconds per call: 2 warm-up calls, an estimate, then a timed
  batch of >= 3 calls (CUDA events on a GPU, ``perf_counter`` on the CPU). With ``window_s`` (CPU
  ranks that share cores: ``autopar calibrate --nproc 4`` on 2 cores) the calls run back to back
  for that long instead. Every rank measures at once, so a window of the same length on every rank
  keeps them busy together and the rate is each rank's share of the cores, as in a training step.
  A batch sized by an estimate ends at different times on different ranks and timed a rank while
  others idled: on 4 ranks over 2 cores a 256 x 256 x 768 fp32 GEMM measured 86-120 GFLOP/s per
  rank so (102 on average) where all four running for 2 s got 76-83 each; windows of 0.1 s, 79-85.
- ``gemm_shapes(tokens, hiddens, splits)``: weights (N, K=h) of a transformer layer, N in
  {h, 3h/t, 4h/t : t in splits} (QKV, MLP-up and their tensor-parallel shards), for M tokens.
  ``time_gemm`` times forward Y = X W^T, dgrad dX = dY W and wgrad dW = dY^T X, each 2*M*N*K FLOPs;
  ``summarize_gemms`` turns the times into the FLOP-weighted harmonic rate (total FLOPs / total
  time: the one constant that makes the summed roofline prediction equal the summed time).
- ``time_sdpa``: ``F.scaled_dot_product_attention`` forward and forward+backward.
  ``SDPA_FWD_FLOPS`` is the FULL count 4*B*H*T*T*D (not halved for causal), as autopar/trace counts
  it, and ``SDPA_TRAIN_FACTOR`` = 3.5 (forward + backward = 1 + 2.5, ``compute.backward_factor``).
- ``copy_Bps``: ``dst.copy_(src)`` bytes read + written per second.
- ``memory_class_Bps``: the same per memory-bound op class (norm, activation, softmax, elementwise)
  at transformer activation shapes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

SDPA_TRAIN_FACTOR = 3.5      # forward + backward FLOPs / forward FLOPs (compute.backward_factor("attention") + 1)
GEMM_PASSES = ("fwd", "dgrad", "wgrad")
GPU_FAMILIES = ("h200", "h100", "a100", "v100")
# Calls ``time_per_call`` makes once one call outlasts min_time_s / 3: 3 untimed + 3 timed (budgeting).
CALLS_PER_MEASUREMENT = 6
SHARED_WINDOW_S = 0.1        # ``time_per_call``'s window where CPU ranks share cores (module docstring)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_batch(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def time_per_call(fn: Callable[[], Any], device: torch.device, min_time_s: float = 0.03,
                  max_reps: int = 100, window_s: float = 0.0) -> float:
    """Mean seconds per call of ``fn``: 2 warm-up calls, an estimate, then a timed batch of >= 3
    calls lasting about ``min_time_s`` (at most ``max_reps``); with ``window_s`` > 0, the calls
    made back to back in that much wall time (module docstring)."""
    fn(); fn(); sync(device)
    if window_s > 0:
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            sync(device)
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= window_s:
                return elapsed / calls
    t0 = time.perf_counter(); fn(); sync(device)
    est = max(time.perf_counter() - t0, 1e-7)
    reps = int(min(max_reps, max(3, min_time_s / est)))
    return _timed_batch(fn, device, reps)


def shared_window_s(device_type: str, ranks: int, threads: int, cores: int) -> float:
    """``time_per_call``'s window for ``ranks`` CPU ranks of ``threads`` threads each measuring at
    once on ``cores`` cores: ``SHARED_WINDOW_S`` where they share them, else 0 (a GPU's events, or
    cores enough for all: a batch is timed as before)."""
    return SHARED_WINDOW_S if device_type == "cpu" and ranks * threads > cores else 0.0


def measurement_s(call_s: float, window_s: float = 0.0) -> float:
    """About how long ``time_per_call`` takes for calls of ``call_s`` (budgeting)."""
    return max(CALLS_PER_MEASUREMENT * call_s, window_s + 2 * call_s)


@dataclass(frozen=True)
class GemmShape:
    m: int      # tokens
    k: int      # hidden (the weight's input features)
    n: int      # the weight's output features

    @property
    def flops(self) -> float:
        """FLOPs of ONE of the three passes (2*M*N*K)."""
        return 2.0 * self.m * self.n * self.k

    def label(self) -> str:
        return f"M={self.m} K={self.k} N={self.n}"


def gemm_shapes(tokens: Sequence[int], hiddens: Sequence[int], splits: Sequence[int] = (1, 2, 8)) -> tuple[GemmShape, ...]:
    """Transformer-layer GEMMs, hidden ascending (the order a time budget cuts from the end)."""
    out = []
    for h in hiddens:
        ns = sorted({h} | {3 * h // t for t in splits} | {4 * h // t for t in splits})
        for m in tokens:
            out += [GemmShape(m, h, n) for n in ns if n >= 1]
    return tuple(out)


def time_gemm(shape: GemmShape, dtype: torch.dtype, device: torch.device, min_time_s: float = 0.01,
              max_reps: int = 50, window_s: float = 0.0) -> dict[str, float]:
    """Seconds per call of each pass (GEMM_PASSES) of ``shape`` in ``dtype``."""
    x = torch.randn(shape.m, shape.k, dtype=dtype, device=device)
    w = torch.randn(shape.n, shape.k, dtype=dtype, device=device)
    dy = torch.randn(shape.m, shape.n, dtype=dtype, device=device)
    fns = {"fwd": lambda: torch.mm(x, w.t()), "dgrad": lambda: torch.mm(dy, w), "wgrad": lambda: torch.mm(dy.t(), x)}
    return {name: time_per_call(fns[name], device, min_time_s=min_time_s, max_reps=max_reps, window_s=window_s)
            for name in GEMM_PASSES}


@dataclass(frozen=True)
class GemmSummary:
    """Rates of a set of timed GEMMs (FLOP/s); efficiencies are these over a peak, by the caller."""
    flops: float                           # all passes of all shapes
    seconds: float
    rate: float                            # flops / seconds: the FLOP-weighted harmonic mean
    mean_rate: float                       # FLOP-weighted arithmetic mean of per-call rates
    per_pass: tuple[tuple[str, float], ...]
    per_hidden: tuple[tuple[int, float], ...]
    worst: tuple[float, str]               # (rate, "fwd M=.. K=.. N=..")
    shapes: int


def summarize_gemms(timed: Iterable[tuple[GemmShape, dict[str, float]]]) -> GemmSummary:
    """Aggregate ``(shape, {pass: seconds})`` records (``time_gemm``'s)."""
    flops = seconds = weighted = 0.0
    per_pass: dict[str, list[float]] = {}
    per_h: dict[int, list[float]] = {}
    worst = (float("inf"), "")
    shapes = 0
    for shape, times in timed:
        shapes += 1
        for name, t in times.items():
            f = shape.flops
            flops += f; seconds += t; weighted += f * (f / t)
            pp = per_pass.setdefault(name, [0.0, 0.0]); pp[0] += f; pp[1] += t
            ph = per_h.setdefault(shape.k, [0.0, 0.0]); ph[0] += f; ph[1] += t
            if f / t < worst[0]:
                worst = (f / t, f"{name} {shape.label()}")
    if not seconds:
        raise RuntimeError("no GEMM was measured within the time budget; raise --budget-s (autopar calibrate) "
                           "or BUDGET_S (benchmarks/calibrate.py)")
    return GemmSummary(flops, seconds, flops / seconds, weighted / flops,
                       tuple((k, v[0] / v[1]) for k, v in per_pass.items()),
                       tuple((k, v[0] / v[1]) for k, v in sorted(per_h.items())), worst, shapes)


def sdpa_fwd_flops(b: int, h: int, t: int, d: int) -> float:
    """FULL forward FLOP count of SDPA (not halved for causal), as autopar/trace counts it."""
    return 4.0 * b * h * t * t * d


def time_sdpa(b: int, h: int, t: int, d: int, dtype: torch.dtype, device: torch.device, causal: bool,
              min_time_s: float = 0.02, forward: bool = True, window_s: float = 0.0) -> tuple[float, float]:
    """(forward seconds, forward+backward seconds) of SDPA on (B, H, T, D); forward 0.0 if not
    ``forward``."""
    q, k, v = (torch.randn(b, h, t, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    go = torch.randn(b, h, t, d, dtype=dtype, device=device)

    def fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwdbwd():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(o, (q, k, v), go)

    tf = time_per_call(fwd, device, min_time_s=min_time_s, window_s=window_s) if forward else 0.0
    return tf, time_per_call(fwdbwd, device, min_time_s=min_time_s, window_s=window_s)


def copy_Bps(nbytes: int, dtype: torch.dtype, device: torch.device, min_time_s: float = 0.03,
             window_s: float = 0.0) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` of ``nbytes``."""
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    src = torch.empty(n, dtype=dtype, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = time_per_call(lambda: dst.copy_(src), device, min_time_s=min_time_s, window_s=window_s)
    return 2.0 * n * src.element_size() / t


def memory_class_Bps(tokens: Sequence[int], hiddens: Sequence[int], dtype: torch.dtype, device: torch.device,
                     min_time_s: float = 0.01, window_s: float = 0.0) -> dict[str, float]:
    """Bytes read + written per second of each memory-bound op class (``cost.compute.memory_class``)
    at transformer activation shapes (M tokens x h): "norm" ``layer_norm`` over h, "activation"
    ``gelu`` of the MLP's M x 4h, "softmax" over h, "elementwise" ``a + b``; per class the total
    bytes over the total time of every shape (the rate that makes the summed prediction the summed
    time), forward only, as ``compute.op_time_s`` prices a forward."""
    cases = {"norm": lambda m, h: _norm_case(m, h, dtype, device),
             "activation": lambda m, h: _unary_case(F.gelu, m, 4 * h, dtype, device),
             "softmax": lambda m, h: _unary_case(lambda x: torch.softmax(x, -1), m, h, dtype, device),
             "elementwise": lambda m, h: _add_case(m, h, dtype, device)}
    out = {}
    for name, case in cases.items():
        nbytes = seconds = 0.0
        for m in tokens:
            for h in hiddens:
                fn, b = case(m, h)
                seconds += time_per_call(fn, device, min_time_s=min_time_s, max_reps=1000, window_s=window_s)
                nbytes += b
        out[name] = nbytes / seconds
    return out


def _norm_case(m: int, h: int, dtype: torch.dtype, device: torch.device):
    x = torch.randn(m, h, dtype=dtype, device=device)
    w, b = torch.ones(h, dtype=dtype, device=device), torch.zeros(h, dtype=dtype, device=device)
    return (lambda: F.layer_norm(x, (h,), w, b)), 2 * x.numel() * x.element_size()


def _unary_case(fn, m: int, n: int, dtype: torch.dtype, device: torch.device):
    x = torch.randn(m, n, dtype=dtype, device=device)
    return (lambda: fn(x)), 2 * x.numel() * x.element_size()


def _add_case(m: int, h: int, dtype: torch.dtype, device: torch.device):
    a, b = torch.randn(m, h, dtype=dtype, device=device), torch.randn(m, h, dtype=dtype, device=device)
    c = torch.empty_like(a)
    return (lambda: torch.add(a, b, out=c)), 3 * a.numel() * a.element_size()


def elementwise_flops(numel: int, device: torch.device, min_time_s: float = 0.02, window_s: float = 0.0) -> float:
    """fp32 ``torch.mul(a, b, out=c)`` elements (1 FLOP each) per second on ``numel`` elements."""
    a = torch.rand(numel, device=device); b = torch.rand(numel, device=device); c = torch.empty_like(a)
    return numel / time_per_call(lambda: torch.mul(a, b, out=c), device, min_time_s=min_time_s, max_reps=1000,
                                 window_s=window_s)


def op_overhead_s(device: torch.device) -> float:
    """Seconds of one tiny op (a 1-element add): the per-op dispatch cost the roofline leaves out."""
    a = torch.ones(1, device=device); c = torch.empty_like(a)
    return time_per_call(lambda: torch.add(a, a, out=c), device, min_time_s=0.01, max_reps=2000)


def family_of(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA H100 80GB HBM3' -> 'h100'; 'NVIDIA A100-SXM4-40GB' -> 'a100'."""
    n = device_name.lower()
    for fam in GPU_FAMILIES:
        if fam in n:
            return fam
    raise ValueError(f"unknown GPU family for device {device_name!r}; known: {', '.join(GPU_FAMILIES)} "
                     f"(add its datasheet to autopar/cost/hardware.py)")


def gpu_name_for(family: str, total_bytes: int) -> str:
    """The autopar GPU name (hardware.GPU_NAMES) of a family and its memory size."""
    if family == "a100":
        return "a100-80g" if total_bytes > 50e9 else "a100-40g"
    return family
