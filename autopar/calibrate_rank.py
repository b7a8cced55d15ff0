"""What each rank of ``autopar calibrate`` runs (started by ``autopar.runtime.launch.spawn_ranks``).

Every rank measures at the same time, as training ranks compute at the same time (on a CPU they
share its cores and memory bandwidth, each with the one thread ``spawn_ranks`` gives a rank), then
all take part in the collectives. Rank 0 alone decides whether the next measurement still fits the
time budget and broadcasts the decision over the default (gloo) group, so every rank runs the same
measurements; rank 0 also writes the progress file the launcher's progress bar reads.

Order: per-op overhead, memory copy, memory-bound op classes (norm, activation, softmax,
elementwise, at the GEMMs' token and hidden sizes), elementwise rate (CPU), GEMMs per dtype, SDPA, collectives
(on CPU ranks each also in situ, after a GEMM pair: ``calibrate_comm.time_collective_in_situ``;
all-reduces over pairs of ranks too, ``pair_groups``),
GEMMs beside async all-reduces (``calibrate_overlap.py``, outside the budget: ~1-2 s), then (CPU)
autopar's per-node step overhead (``calibrate_runtime.py``, outside the budget: ~10 s, ~20 s on 4
ranks or more, which also time DTensor on a 2-D mesh; with a ring attention and a ZeRO-3 fit).
After the ranks return, ``autopar.calibrate.measure`` trains a reference GPT on fresh ranks under the
profiler (``calibrate_step.py``, CPU, ~10 s).
Each phase has a deadline, cumulative shares of the budget (``PHASE_SHARES``), so time a phase
leaves unused goes to the next; the collectives, last, take whatever remains, smallest size first.
The first GEMM of each dtype and the first SDPA run whatever the budget says.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from autopar.calibrate_bench import (GEMM_PASSES, SDPA_TRAIN_FACTOR, copy_Bps, elementwise_flops, gemm_shapes,
                                     measurement_s, memory_class_Bps, op_overhead_s, sdpa_fwd_flops, shared_window_s,
                                     time_gemm, time_sdpa)
from autopar.calibrate_comm import collective_op, time_collective, time_collective_in_situ
from autopar.runtime.launch import report_progress
from autopar.runtime.precision import parse_dtype

PHASE_SHARES = {"gemm": 0.35, "sdpa": 0.45}   # cumulative fractions of the budget left when ranks start
RESERVE_S = 1.0                               # kept for gathering results and writing the file
COLLECTIVE_BATCHES = 5           # timed batches per collective and size; their median is the time
COLLECTIVE_BATCH_S = 0.01        # a batch's length (at least one call)
COLLECTIVE_MAX_REPS = 50
# CPU ranks time each collective in situ too (``calibrate_comm.time_collective_in_situ``): after a
# GEMM pair of this shape (M, K, N) in float32, up to a back-to-back time of IN_SITU_MAX_RATIO
# compute blocks (beyond it the block is noise on the collective: measured the same either way)
IN_SITU_GEMM = (256, 256, 768)
IN_SITU_MAX_RATIO = 8.0


class _Gate:
    """Rank 0's budget decisions, broadcast to every rank, and the progress file."""

    def __init__(self, rank: int, cfg: dict, total: int) -> None:
        self.rank, self.path, self.total, self.done = rank, cfg["progress_path"], total, 0
        now = time.monotonic()
        self.end = cfg["start"] + cfg["budget_s"] - RESERVE_S
        left = max(0.0, self.end - now)
        self.deadline = {k: now + share * left for k, share in PHASE_SHARES.items()}
        self.deadline["collectives"] = self.end

    def go(self, predicted_s: float, deadline: float, first: bool = False) -> bool:
        """Whether every rank runs the next measurement: rank 0's clock says it ends by ``deadline``.
        The ``first`` of a phase always runs (the same on every rank: nothing to broadcast), so the
        file gets every figure however small the budget."""
        if first:
            return True
        flag = torch.tensor([1 if time.monotonic() + predicted_s <= deadline else 0], dtype=torch.int32)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def step(self, label: str) -> None:
        self.done += 1
        report_progress()
        if self.rank == 0 and self.path:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump({"done": self.done, "total": self.total, "label": label}, f)
            os.replace(tmp, self.path)


def _gemms(gate: _Gate, cfg: dict, device: torch.device, deadline: float, out: dict, window_s: float) -> None:
    start = time.monotonic()
    shapes = gemm_shapes(cfg["gemm_tokens"], cfg["gemm_hiddens"], cfg["gemm_splits"])
    dtypes = cfg["dtypes"]
    for i, name in enumerate(dtypes):
        # each dtype gets an equal slice of the GEMM phase; what one leaves goes to the next
        dt_deadline = start + (deadline - start) * (i + 1) / len(dtypes)
        rate: Optional[float] = None
        rows, skipped = [], 0
        for shape in shapes:
            predicted = 0.0 if rate is None else len(GEMM_PASSES) * measurement_s(shape.flops / rate, window_s)
            if gate.go(predicted, dt_deadline, first=rate is None and not skipped):
                times = time_gemm(shape, parse_dtype(name), device, window_s=window_s)
                rows.append([shape.m, shape.k, shape.n] + [times[p] for p in GEMM_PASSES])
                rate = len(GEMM_PASSES) * shape.flops / sum(times.values())
            else:
                skipped += 1
            gate.step(f"GEMM {name} {shape.label()}")
        out["gemm"][name] = rows
        out["gemm_skipped"][name] = skipped


def _sdpa(gate: _Gate, cfg: dict, device: torch.device, out: dict, window_s: float) -> None:
    s = cfg["sdpa"]
    b, t, d, dtype = s["batch"], s["seq"], s["head_dim"], parse_dtype(s["dtype"])
    rate: Optional[float] = None
    for h in s["heads"]:
        flops = SDPA_TRAIN_FACTOR * sdpa_fwd_flops(b, h, t, d)
        if gate.go(0.0 if rate is None else 2 * measurement_s(flops / rate, window_s), gate.deadline["sdpa"],
                   first=rate is None):
            fwd, fwdbwd = time_sdpa(b, h, t, d, dtype, device, causal=True, window_s=window_s)
            out["sdpa"].append([h, fwd, fwdbwd])
            rate = flops / fwdbwd
        gate.step(f"SDPA causal H={h}")
    h = s["heads"][len(s["heads"]) // 2]
    flops = SDPA_TRAIN_FACTOR * sdpa_fwd_flops(b, h, t, d)
    if gate.go(0.0 if rate is None else 2 * measurement_s(flops / rate, window_s), gate.deadline["sdpa"]):
        out["sdpa_noncausal"] = [h, time_sdpa(b, h, t, d, dtype, device, causal=False, forward=False,
                                              window_s=window_s)[1]]
    gate.step(f"SDPA non-causal H={h}")


def _in_situ_compute(device: torch.device) -> Optional[tuple[Callable[[], None], float]]:
    """(the compute block a CPU collective is timed after, seconds per block); None on a GPU."""
    if device.type != "cpu":
        return None
    m, k, n = IN_SITU_GEMM
    x, w = torch.randn(m, k), torch.randn(n, k)

    def block() -> None:
        torch.mm(x, w.t())
        torch.mm(x, w.t())
    block()
    return block, time_collective(block, 10, device, batches=3)


def pair_groups(world: int) -> bool:
    """Whether all-reduces are also timed over pairs of ranks (every pair at once): with an even
    count of 4 ranks or more, so that the link's call latency can be told from its per-step latency
    (``calibrate_comm.fit_link``); plans' tensor-, pipeline- and context-parallel groups are often
    pairs."""
    return world > 2 and world % 2 == 0


def _measurements(kinds: list[str], world: int) -> list[tuple[str, int]]:
    """(kind, group size) of each collective timed at every message size."""
    return [(k, world) for k in kinds] + ([("all_reduce", 2)] if pair_groups(world) else [])


def _collectives(gate: _Gate, cfg: dict, rank: int, world: int, device: torch.device, group, out: dict) -> None:
    last: dict = {}                    # (kind, group size) -> seconds per call at the previous size
    stopped: set = set()
    in_situ = _in_situ_compute(device)
    pair = None
    if pair_groups(world):             # every rank makes every pair (new_subgroups): its own, and the others
        pair, _ = dist.new_subgroups(group_size=2, backend="nccl" if device.type == "cuda" else None)
    for size in cfg["sizes"]:
        for kind, n in _measurements(cfg["kinds"], world):
            label = f"{kind} {size >> 10} KiB" if size < 1 << 20 else f"{kind} {size >> 20} MiB"
            label += f" ({n} ranks)" if n != world else ""
            key = (kind, n)
            if key in stopped:
                gate.step(label)
                continue
            # the next size is 4x: warm-up, estimate and the timed calls, each ~4x the last call
            # (twice that where each is timed in situ too)
            predicted = 0.0 if key not in last else 4 * last[key] * (2 + COLLECTIVE_BATCHES) * (1 + bool(in_situ))
            if not gate.go(predicted, gate.deadline["collectives"]):
                stopped.add(key)
                gate.step(label)
                continue
            fn, nbytes, factor = collective_op(kind, size, rank % n, n, device, group if n == world else pair)
            fn()
            est = time_collective(fn, 1, device)
            reps = int(min(COLLECTIVE_MAX_REPS, max(1, COLLECTIVE_BATCH_S / max(est, 1e-9))))
            per_call = time_collective(fn, reps, device, batches=COLLECTIVE_BATCHES)
            last[key] = per_call
            timed = per_call
            if in_situ is not None and per_call < IN_SITU_MAX_RATIO * in_situ[1]:
                block, block_s = in_situ
                reps = int(min(COLLECTIVE_MAX_REPS, max(1, COLLECTIVE_BATCH_S / (per_call + block_s))))
                # never below back to back: what the compute adds is >= 0 (a negative difference is noise)
                timed = max(per_call, time_collective_in_situ(fn, block, reps, device, batches=COLLECTIVE_BATCHES))
            out["collectives"].append([kind, n, nbytes, timed * factor, per_call * factor])
            del fn
            gate.step(label)


def total_steps(cfg: dict, world: int) -> int:
    """How many progress steps a rank makes (what the launcher's bar counts to)."""
    shapes = gemm_shapes(cfg["gemm_tokens"], cfg["gemm_hiddens"], cfg["gemm_splits"])
    basics = 4 if cfg["vector_numel"] else 3
    comm = len(cfg["sizes"]) * len(_measurements(cfg["kinds"], world)) + 1 if world > 1 else 0   # + the overlap
    runtime = 1 if cfg["device"] == "cpu" else 0
    return basics + len(shapes) * len(cfg["dtypes"]) + len(cfg["sdpa"]["heads"]) + 1 + comm + runtime


def rank_main(rank: int, world: int, cfg: dict) -> dict[str, Any]:
    """One rank's measurements (``cfg`` is built by ``autopar.calibrate``); plain numbers, lists
    and strings, as ``spawn_ranks`` carries results."""
    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        group = dist.new_group(backend="nccl") if world > 1 else None
        props = torch.cuda.get_device_properties(device)
        name, memory = props.name, props.total_memory
    else:
        device, group, name, memory = torch.device("cpu"), None, "cpu", 0
    out: dict[str, Any] = {"device_name": name, "total_memory": memory, "threads": torch.get_num_threads(), "gemm": {},
                           "gemm_skipped": {}, "sdpa": [], "sdpa_noncausal": [], "collectives": []}
    gate = _Gate(rank, cfg, total_steps(cfg, world))
    if group is not None:                       # the first NCCL call makes the communicator: not timed
        dist.all_reduce(torch.ones(1, device=device), group=group)
        torch.cuda.synchronize(device)
    out["overhead_s"] = op_overhead_s(device)
    gate.step("per-op overhead")
    # CPU ranks that share cores time each measurement over a window, all at once (calibrate_bench.py)
    window_s = shared_window_s(device.type, world, torch.get_num_threads(), os.cpu_count() or 1)
    out["copy_Bps"] = copy_Bps(cfg["copy_bytes"], parse_dtype(cfg["copy_dtype"]), device, window_s=window_s)
    gate.step("memory copy")
    out["memory_classes"] = memory_class_Bps(cfg["gemm_tokens"], cfg["gemm_hiddens"], parse_dtype(cfg["copy_dtype"]),
                                             device, window_s=window_s)
    gate.step("memory-bound ops")
    if cfg["vector_numel"]:
        out["vector_flops"] = elementwise_flops(cfg["vector_numel"], device, window_s=window_s)
        gate.step("elementwise")
    _gemms(gate, cfg, device, gate.deadline["gemm"], out, window_s)
    _sdpa(gate, cfg, device, out, window_s)
    if world > 1:
        _collectives(gate, cfg, rank, world, device, group, out)
        from autopar.calibrate_overlap import CPU_SETUP, GPU_SETUP, measure_overlap

        # compute beside an async all-reduce (calibrate_overlap.py: ~1 s, outside the budget)
        out["overlap"] = measure_overlap(device, group, GPU_SETUP if device.type == "cuda" else CPU_SETUP)
        gate.step("GEMM beside all_reduce")
    if device.type == "cpu":                   # host per-node cost of a step (serial with CPU compute)
        from autopar.calibrate_runtime import runtime_overheads

        out["runtime_overhead"] = runtime_overheads(world)
        gate.step("runtime overhead")
    dist.barrier()
    return out
