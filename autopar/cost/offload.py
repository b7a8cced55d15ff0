"""CPU / NVMe offload: device, host and NVMe bytes and the exposed seconds each offloaded tensor
class adds, per rank, as the runtime moves them (the planner's ``solver/timing.py`` and the
runtime's predictions share these functions). Classes: ``plan.OFFLOAD_CLASSES``.

Sources (``reference/parallelism_facts.md`` §4):
- ZeRO-Offload (Ren et al., ATC'21; §4.1): fp32 master params and the Adam moments live on the
  CPU and the Adam step runs there; 16-bit gradients go GPU->CPU during the backward and the
  updated 16-bit params come back CPU->GPU: per step 2 Psi bytes down + 2 Psi up over PCIe.
  CPU-Adam is memory bound (DeepSpeedCPUAdam, AVX; "5X--7X faster than" torch's CPU Adam).
- ZeRO-Infinity (Rajbhandari et al., SC'21; §4.2): params (and optimizer state) on the host or
  NVMe, fetched before use and all-gathered (bandwidth-centric partitioning: each rank moves only
  its 1/dp share over its own PCIe link); activations offloaded with 1-4 GB/s needed; NVMe per
  DGX-2 node ~28 GB/s ("NVMe -> GPU: 28 GB/s - 1.8 TB/s (1-64 nodes)").

Notation, per rank: rows = parameter elements this rank's optimizer updates (its shard under
ZeRO >= 1: ``optimizer_rows``), m = optimizer moments (2 Adam/AdamW/LAMB, 1 LARS/SGD:
``cost.memory.optimizer_moments``), B = ``codegen.buckets.DEFAULT_BUCKET_BYTES``.

    optimizer    device optimizer bytes -> 0; host += rows (4 master + 4 m moments + 4 grad buffer);
                 per step: grads down rows x grad_bytes / PCIe (overlapped with the backward like
                 the reducer), CPU step rows x ((4 + 4 + 4m) + (4 + 4m)) / host_Bps (28 B for Adam:
                 read master, grad, moments; write master, moments; not overlapped), updated rows
                 up rows x param_bytes / PCIe (not overlapped; with params offload the rows are on
                 the host: fp32 rows without nvme ARE the masters, stepped in place, nothing to
                 copy or hold twice; else rows x (4 + param_bytes) / host_Bps). Replaces the
                 device step.
    grads        device grads -> min(G, 2 B) with one micro-batch per step, else unchanged (they
                 accumulate on the device); no time of its own
    params       (ZeRO-3) host += P (the rank's device param bytes; 0 for fp32 rows without nvme:
                 the masters), device params -> 0; per
                 micro-batch P up before the forward's gather and P again before the backward's
    activations  device activations -> ``resident_saved_bytes`` (autopar's runtime: every saved
                 tensor goes down and the backward brings back one node's at a time, at most the
                 largest output; a prefetching runtime would keep a layer); host += inflight x
                 saved bytes per micro-batch; per micro-batch the saved bytes go down in the
                 forward and up in the backward
    nvme         master + moments (rows x (4 + 4m)) in files; the host keeps 2 chunks C = 2 B of
                 it, a chunk being cut on the whole parameters (C / 12 of them, 3 fp32 tensors
                 each): the rank's share s of it (1/tp, and 1/dp of the rows under ZeRO) holds
                 C s (1 + m) / 3; per step read and written once: 2 rows (4 + 4m) / NVMe Bps per GPU
    nvme_grads   (with nvme) the gradient buffers (rows x 4) in files: each gradient written as it
                 is taken down (at most a chunk C = 2 B of writes in flight), read back by its chunk
                 in the step: host -= rows x 4, += min(rows x 4, 2 C s / 3) (the stepping and the
                 next chunk's gradients: a third of a chunk's 3 tensors); nvme += rows x 4;
                 "nvme:grads" = rows x 4 / NVMe Bps read in the step, + the writes' time beyond
                 the backward (at least the last bucket's, written once the backward ends)
    nvme_activations  (with activations) the host copies of saved tensors in files: nvme += m x
                 saved bytes per micro-batch (keys of their own per micro-batch of the step); host
                 activations -> min(inflight x saved, what the backward brings back at once + the
                 largest saved tensor read ahead), the writes being waited for one by one (their
                 aligned staging copy not counted); per micro-batch the saved bytes written in the
                 forward (exposed) and read in the backward by the store's threads ahead of their
                 use (the first, at most the largest saved tensor L, on the spot): "nvme:activations"
                 = saved / NVMe Bps + L / NVMe Bps + max(0, (saved - L) / NVMe Bps - backward window)
    nvme_params  (with params and nvme; ZeRO-3: a rank's parameter rows are its optimizer rows)
                 the rows are not kept on the host: each gather reads them from the masters'
                 files (fp32, cast to the parameter's dtype), so host -= P and the NVMe holds
                 nothing more; the host holds the rows being read (at most ``group_bytes``:
                 the largest gather group's master bytes of this rank); per micro-batch
                 rows x 4 are read for the forward's gathers and again for the backward's
                 re-gathers, by the store's threads a group ahead of each gather (a pass's first
                 group, at most ``group_bytes`` g, on the spot): 2 g / NVMe Bps exposed, the rest
                 hidden behind each pass's compute window (threads run beside compute on CPU
                 ranks too);
                 the updated rows are not copied up after the step (the files are the rows); the
                 reads come in the forward / backward, so the host peak is the larger of the
                 step's and the gradient buffers (rows x 4; nvme_grads: min(rows x 4, C)) +
                 offloaded activations + group_bytes

Transfers hidden behind compute cost ``max(0, t - window)`` (``runtime_profile.py``'s rule) when
the runtime overlaps them (``RuntimeProfile.host_copy_overlap``: on GPUs autopar's runtime copies
gradients and activations on a side stream, ``runtime/copy_stream.py``; ZeRO-3's rows and the
updated rows go up on the compute stream; on CPU ranks every copy is exposed). Per
micro-batch, the forward window hides params up (host->device) and activations down
(device->host, the other direction); the backward window hides params and activations up, which
share the host->device direction (one transfer of their sum).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

FP32 = 4                      # bytes of the host's master copy, moments and gradient buffer
HOST_CHUNKS = 2               # NVMe chunks of optimizer state held in host memory at once
OVERLAP_CHUNKS = 8            # an overlapped host step's chunks, at least (``runtime/offload.py``)


def bucket_bytes() -> int:
    """The runtime's gradient bucket (``codegen.buckets.DEFAULT_BUCKET_BYTES``; imported late:
    ``autopar.codegen`` imports torch)."""
    from autopar.codegen.buckets import DEFAULT_BUCKET_BYTES

    return DEFAULT_BUCKET_BYTES


def step_chunk_bytes() -> int:
    """State bytes (fp32 master + moments) the NVMe tier's step takes at once, and the most an
    overlapped step's chunk holds: two gradient buckets (``runtime/host_step.NVME_CHUNK_BYTES``)."""
    return 2 * bucket_bytes()


def overlap_chunk_bytes(state_bytes: float, chunks: int = OVERLAP_CHUNKS) -> int:
    """An overlapped host step's chunk (``runtime/host_step.overlap_chunk_bytes``): a ``chunks``-th
    of the ``state_bytes`` it steps, at most ``step_chunk_bytes()``, so the forward's first layers
    wait for a small part of the step."""
    return max(1, min(step_chunk_bytes(), math.ceil(state_bytes / chunks)))


def optimizer_rows(numel: float, data: int, zero: int) -> float:
    """Parameter elements a rank's optimizer updates: its 1/data shard under ZeRO >= 1."""
    return numel / data if zero >= 1 else float(numel)


def chunk_share(tp: int, data: int, zero: int) -> float:
    """The share of a chunk's state a rank holds: the NVMe step's chunks are cut on the whole
    parameters (``runtime/host_step.step_chunks``: the same cut on every rank), of which a rank steps its
    tensor-parallel shard (about 1/tp: the largest tensors are split) and under ZeRO its 1/data rows."""
    return 1.0 / tp / (data if zero >= 1 else 1)


def host_optimizer_bytes(rows: float, moments: int = 2) -> float:
    """Host bytes of optimizer offload: fp32 master, moments and gradient buffer per row."""
    return rows * FP32 * (1 + moments + 1)


def nvme_state_bytes(rows: float, moments: int = 2) -> float:
    """The optimizer state of ``rows`` elements, fp32 master + moments (no grad buffer): what NVMe
    offload keeps in files, and what a host step's chunk steps (``overlap_chunk_bytes``)."""
    return rows * FP32 * (1 + moments)


def cpu_step_bytes_per_param(moments: int = 2) -> float:
    """Host memory traffic of one CPU optimizer step per parameter: read master 4, grad 4 and
    the moments, write master and moments: (4 + 4 + 4m) + (4 + 4m) (28 for Adam)."""
    return (FP32 + FP32 + FP32 * moments) + (FP32 + FP32 * moments)


def resident_saved_bytes(largest: float, prefetch: bool) -> float:
    """Saved bytes activation offload keeps on the device at once, ``largest`` being the largest
    output: the node's own, brought back (at most that), and where the backward prefetches on a side
    stream (``runtime/copy_stream.py``) up to as much again."""
    return largest * (2.0 if prefetch else 1.0)


def _exposed(t: float, window: float) -> float:
    return max(0.0, t - window)


def offload_memory(classes: Iterable[str], *, rows: float, params_bytes: float, grads_bytes: float,
                   optimizer_bytes: float, activations_bytes: float, resident_saved_bytes: float,
                   saved_bytes_per_microbatch: float, inflight: float, microbatches: int,
                   moments: int = 2, bucket: float | None = None, group_bytes: float = 0.0,
                   share: float = 1.0, saved_window: float = 0.0) -> dict[str, float]:
    """Per-rank bytes by category with ``classes`` offloaded: device "params", "grads",
    "optimizer", "activations", and "host", "nvme" (module docstring). The ``*_bytes`` arguments
    are the rank's device bytes without offload; ``resident_saved_bytes``: what activation offload
    leaves on the device (one layer's saved bytes + the embedding's / head's); ``group_bytes``
    (nvme_params): the fp32 master bytes of the rank's largest gather group; ``share``: of a chunk
    of the NVMe step, the part this rank holds (``chunk_share``); ``saved_window``
    (nvme_activations): the saved bytes the backward reads ahead from the files (the largest saved
    tensor)."""
    cls = set(classes)
    out = {"params": float(params_bytes), "grads": float(grads_bytes), "optimizer": float(optimizer_bytes),
           "activations": float(activations_bytes), "host": 0.0, "nvme": 0.0}
    if "optimizer" in cls:
        out["optimizer"] = 0.0
        out["host"] += host_optimizer_bytes(rows, moments)
    chunk = step_chunk_bytes() if bucket is None else 2 * bucket
    bwd_grads = rows * FP32            # the host's gradient buffers, filled in the backward
    if "nvme" in cls:
        state = nvme_state_bytes(rows, moments)
        out["nvme"] += state
        # a chunk is ``chunk`` bytes of 3 fp32 tensors (Adam's) per parameter of the whole model
        out["host"] += min(state, HOST_CHUNKS * chunk * share * (1 + moments) / 3) - state
    if "nvme_grads" in cls:            # in files: the step's chunks read theirs back (a third of a
        # chunk's 3 tensors, ``runtime/host_step.step_chunks``), the backward's writes in flight <= a chunk
        out["nvme"] += rows * FP32
        out["host"] += min(rows * FP32, HOST_CHUNKS * chunk * share / 3) - rows * FP32
        bwd_grads = min(rows * FP32, chunk)
    if "grads" in cls and microbatches == 1:
        out["grads"] = min(out["grads"], 2 * (bucket_bytes() if bucket is None else bucket))
    if "params" in cls:
        # fp32 rows (params_bytes == rows x 4: ZeRO-3's rows are the optimizer's) without nvme are the
        # masters themselves (``runtime/offload.HostOptimizer``): no second copy
        masters = "nvme" not in cls and math.isclose(out["params"], rows * FP32)
        out["host"] += 0.0 if ("nvme_params" in cls or masters) else out["params"]
        out["params"] = 0.0
    act_host = inflight * saved_bytes_per_microbatch if "activations" in cls else 0.0
    if "nvme_activations" in cls:      # in files (a step's micro-batches each under keys of their own);
        # the host holds the one being written, and what the backward reads back at once and ahead
        out["nvme"] += microbatches * saved_bytes_per_microbatch
        act_host = min(act_host, resident_saved_bytes + saved_window)
    if "activations" in cls:
        out["activations"] = min(float(activations_bytes), float(resident_saved_bytes))
        out["host"] += act_host
    if "nvme_params" in cls:     # a gather's rows read from the files, in the forward / backward: beside the
        # gradient buffers and the offloaded activations, not beside the step's state read back
        out["host"] = max(out["host"], bwd_grads + act_host + group_bytes)
    return out


def offload_step_times(classes: Iterable[str], *, rows: float, grad_bytes: float, param_bytes: float,
                       backward_window_s: float, pcie_Bps: float, host_Bps: float, nvme_Bps: float,
                       moments: int = 2, overlap_grads: bool = True,
                       step_overlap: Optional[tuple[float, float]] = None,
                       forward_disk_s: float = 0.0) -> dict[str, float]:
    """Exposed seconds per step: "host:d2h" (gradients down, against the last backward when
    ``overlap_grads``), "host:h2d" (updated rows up), "cpu:optimizer" (the CPU step, which
    replaces the device step), "nvme:io" (state read + written; ``nvme_Bps`` per GPU) and with
    nvme_grads "nvme:grads" (read in the step; written behind the backward but for the last
    bucket's). With
    params offload the updated rows are copied into the host rows ("host:copy": read the fp32
    master, write the row, at ``host_Bps``), with nvme_params they stay in the files (neither).
    ``step_overlap`` = (window, first): the CPU step and the rows' copies after it run chunk by
    chunk beside the next forward's ``window`` seconds (``runtime/host_step.py``), the first chunk,
    a ``first`` fraction of both, exposed: S = step + copies costs f S + max(0, (1 - f) S - window),
    each key its share of it. With the NVMe tier S also holds the state's reads and writes and the
    gradients' reads (the step's chunks stream them), and the window loses ``forward_disk_s``, the
    seconds the forward keeps the disk busy itself (nvme_params' rows read, nvme_activations'
    writes): the step's I/O queues behind it."""
    cls = set(classes)
    out: dict[str, float] = {}
    if "optimizer" in cls:
        down = rows * grad_bytes / pcie_Bps
        out["host:d2h"] = _exposed(down, backward_window_s) if overlap_grads else down
        if "params" not in cls:
            out["host:h2d"] = rows * param_bytes / pcie_Bps
        elif "nvme_params" not in cls and ("nvme" in cls or param_bytes != FP32):
            out["host:copy"] = rows * (FP32 + param_bytes) / host_Bps     # master -> the host rows
        out["cpu:optimizer"] = rows * cpu_step_bytes_per_param(moments) / host_Bps
    if "nvme" in cls:
        out["nvme:io"] = 2 * nvme_state_bytes(rows, moments) / nvme_Bps
    grads_read = grads_written = 0.0
    if "nvme_grads" in cls:
        # read back by the step's chunks; written on the store's threads as the backward hands them
        # down (``runtime/nvme_grads.py``, a chunk in flight at most): hidden behind the backward
        # but for the last bucket's, which comes down as it ends
        grads_read = rows * FP32 / nvme_Bps
        grads_written = max(min(rows * FP32, bucket_bytes()) / nvme_Bps, _exposed(grads_read, backward_window_s))
    if step_overlap is not None and "optimizer" in cls:
        window, first = step_overlap
        if "nvme" in cls:
            window = max(0.0, window - forward_disk_s)
        keys = [k for k in ("cpu:optimizer", "host:h2d", "host:copy", "nvme:io") if k in out]
        whole = sum(out[k] for k in keys) + grads_read
        if whole > 0:
            share = (first * whole + _exposed((1 - first) * whole, window)) / whole
            for k in keys:
                out[k] *= share
            grads_read *= share
    if "nvme_grads" in cls:
        out["nvme:grads"] = grads_read + grads_written
    return out


def overlap_first_chunk(stage_numel: float, moments: int = 2) -> float:
    """The share of an overlapped host step in its first chunk (``overlap_chunk_bytes`` of the
    stage's state, cut on the whole parameters: fp32 master + Adam's moments, 3 tensors)."""
    state = nvme_state_bytes(stage_numel, moments)
    return min(1.0, overlap_chunk_bytes(state) / state) if state > 0 else 1.0


def offload_microbatch_times(classes: Iterable[str], *, host_params_bytes: float, saved_bytes: float,
                             forward_window_s: float, backward_window_s: float, pcie_Bps: float,
                             overlapped: Iterable[str] = ("params", "activations"), nvme_rows_bytes: float = 0.0,
                             nvme_Bps: float = float("inf"), nvme_group_bytes: float = 0.0,
                             saved_largest_bytes: float = 0.0) -> dict[str, float]:
    """Exposed seconds per micro-batch: "host:h2d" (params up before the forward and before the
    backward, activations up in the backward), "host:d2h" (activations down in the forward) and,
    with nvme_params, "nvme:params" (``nvme_rows_bytes``, the rank's fp32 rows, read in each pass
    a group ahead of their gather by the store's threads, ``runtime/nvme_rows.py``: hidden behind
    the pass's compute but for the pass's first group, ``nvme_group_bytes``, read on the spot), with
    nvme_activations "nvme:activations" (the saved bytes written in the forward, each write waited
    for; read back in the backward ahead of their use, ``runtime/nvme_activations.py``: hidden
    behind the backward's compute but for the first tensor, at most ``saved_largest_bytes``).
    ``host_params_bytes``: the rank's params on the host (P); ``saved_bytes``: the activations
    saved per micro-batch. Only the copies of the ``overlapped`` classes hide in the windows; the
    backward's uploads of both share the host->device direction (one window)."""
    cls, over = set(classes), set(overlapped)
    p = host_params_bytes / pcie_Bps if "params" in cls else 0.0
    a = saved_bytes / pcie_Bps if "activations" in cls else 0.0
    p_over, a_over = ("params" in over) * p, ("activations" in over) * a
    out: dict[str, float] = {}
    # each class's part that is not overlapped, then what the windows leave (no cancelling sums:
    # an overlapped class's own part is an exact 0, never -1e-17)
    up = (p - p_over + _exposed(p_over, forward_window_s)) + ((p - p_over) + (a - a_over)
                                                               + _exposed(p_over + a_over, backward_window_s))
    if up:
        out["host:h2d"] = up
    down = a - a_over + _exposed(a_over, forward_window_s)
    if down:
        out["host:d2h"] = down
    if "nvme_params" in cls:
        first = min(nvme_group_bytes, nvme_rows_bytes) / nvme_Bps
        rest = nvme_rows_bytes / nvme_Bps - first
        out["nvme:params"] = 2 * first + _exposed(rest, forward_window_s) + _exposed(rest, backward_window_s)
    if "nvme_activations" in cls:
        first = min(saved_largest_bytes, saved_bytes) / nvme_Bps
        out["nvme:activations"] = saved_bytes / nvme_Bps + first + _exposed(saved_bytes / nvme_Bps - first,
                                                                            backward_window_s)
    return out
