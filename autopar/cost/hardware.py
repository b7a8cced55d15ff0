"""Hardware as data: GPU specs, links, clusters (and a small TOML format for user clusters).

Datasheet figures (peak FLOP/s, HBM size and bandwidth) come from
``reference/gpu_specs.csv``; link bandwidths from ``reference/nccl_busbw_reference.csv``
(each cited by row below). Efficiency factors (achieved / peak) are *empirical* and live in one
place, ``autopar/cost/calibration.json``, written by ``benchmarks/calibrate.py`` on a real GPU.
Entries there whose ``source`` says "uncalibrated default" are placeholders.

Conventions
-----------
- ``peak_flops`` is dense tensor-core FLOP/s per dtype. ``"float32"`` means **TF32 tensor-core
  dense** (what cuBLAS uses for fp32 GEMMs with ``allow_tf32``); ``"vector"`` is the non-tensor
  FP32 (CUDA-core) rate, used for the FLOP term of memory-bound (elementwise/reduction) ops.
- ``hbm_bytes`` is the total that ``nvidia-smi`` / ``torch.cuda.get_device_properties`` report
  (MiB column of gpu_specs.csv), i.e. what a memory budget is compared against; V100 has no
  MiB figure in the csv and uses the vendor 16 GB.
- H100 and H200 have the same SMs and clocks (gpu_specs.csv: identical compute columns), so the
  H200-calibrated matmul/attention efficiencies are used for H100 too (``compute_from`` in the
  calibration file). Their HBM differs, so memory efficiency is per family.
- ``GPUSpec.emulated`` lists dtypes the GPU has no tensor cores for (V100: bf16), priced at the
  CUDA-core rate; ``fastest_dtype()`` (the planner's default dtype) never picks one of them.
- ``LinkSpec.busbw_Bps`` is the achievable NCCL *bus* bandwidth per GPU (nccl-tests convention,
  see ``collectives.py``); ``latency_s`` is the per-step (per ring hop) latency, ``call_latency_s``
  a collective's fixed time on top (0 unless measured).

Cluster TOML (``cluster_file.load_cluster``)::

    name = "my-h100-pod"          # optional (default: file stem)
    gpu = "h100"                  # required; one of GPU_NAMES or "cpu"
    nodes = 4                     # required
    gpus_per_node = 8             # optional (default 8)
    pcie_GBps = 50.0              # optional host<->device bandwidth per GPU (offload)
    host_memory_gb = 2000.0       # optional, offload (default per GPU type): host RAM per node,
    host_GBps = 40.0              # host memory bandwidth per GPU (CPU optimizer step),
    nvme_gb = 30000.0             # NVMe capacity per node and
    nvme_GBps = 50.0              # NVMe bandwidth per node
    overlap_slowdown = 0.12       # optional: compute slowdown beside an overlapped collective
    overlap_slowdown_source = "autopar calibrate, 2 ranks"   # optional (default: per GPU type)
    cores_per_node = 2            # optional, CPU ranks: the cores they share (default 0: a device each)

    [intra]                       # optional; default: the GPU's NVLink/NVSwitch link
    busbw_GBps = 370.0            # required inside the table
    latency_us = 2.0              # optional (default per GPU type)
    name = "nvlink4"              # optional
    source = "nccl-tests on our pod, 2025-01"   # optional
    busbw_scale = { all_gather = 0.53, p2p = 3.8 }   # optional: a kind's busbw relative to busbw_GBps

    [inter]                       # optional; default: one IB NIC per GPU (see make_cluster)
    busbw_GBps = 48.0
    latency_us = 8.0

    [gpu_overrides]               # optional; changes to the built-in GPU spec
    memory_GB = 80.0              # decimal GB (1e9 bytes)
    hbm_GBps = 3000.0
    matmul_efficiency = 0.7
    attention_efficiency = 0.5
    attention_noncausal_efficiency = 0.3   # BERT/ViT attention (default: attention_efficiency / 2)
    memory_efficiency = 0.85
    optimizer_efficiency = 1.6    # the optimizer step's bytes/s over hbm_GBps x memory_efficiency (default 1)
    norm_memory_efficiency = 0.55   # layer/RMS norms' bytes/s over hbm_GBps (default: memory_efficiency);
                                    # also activation_ (gelu, silu), softmax_ (softmax, cross-entropy),
                                    # elementwise_ (the other memory-bound ops): ``compute.memory_class``
    peak_TFLOPs = { float32 = 0.05, bfloat16 = 0.03, vector = 0.002 }   # per-dtype peaks replaced
    op_overhead_us = 60.0         # host time per graph node per step, plain tensors (default 0)
    dtensor_op_overhead_us = 250.0   # the same under DTensor (tp > 1) (default 0)
    dtensor_2d_op_overhead_us = 400.0   # under DTensor on a mesh of two axes or more (default: the above)
    step_overhead_us = 15000.0    # host time per training step that does not grow with the graph (default 0)
    ring_attention_overhead_us = 8000.0   # host time of a ring attention node per micro-batch (default 0)
    zero3_group_overhead_us = 4000.0   # host time of a ZeRO-3 gather group per micro-batch (default 0)
    source = "..."

    [measured]                    # optional, any content; read and ignored (``autopar calibrate``
    device = "..."                # records its raw figures, date, torch version and device here)

``peak_TFLOPs`` replaces the peak FLOP/s (TFLOP/s, 1e12) of the dtypes it lists (keys: bfloat16,
float16, float32, float8_e4m3fn, vector, or the short aliases bf16, fp16, fp32, fp8); the others
keep the GPU's. ``autopar calibrate`` (``autopar/calibrate.py``) writes such files: on the "cpu"
pseudo-GPU, which has no datasheet, the peaks are the MEASURED achieved GEMM rates per dtype (and
``vector`` the measured elementwise rate) with ``matmul_efficiency = 1.0``, ``hbm_GBps`` the
measured copy rate with ``memory_efficiency = 1.0``, and the efficiencies of the matmuls,
attention, memory-bound op classes and optimizer step the fractions of those rates they reached
inside a training step (``autopar/calibrate_step.py``); on a GPU the bf16 peak stays the datasheet
figure, the efficiencies are measured against it, and other dtypes whose measured rate differs
get an effective peak (measured rate / matmul_efficiency). Either way peak x efficiency is the
measured rate, which is what ``compute.op_time_s`` divides by.

Errors name the bad key and the allowed ones. ``cluster_file.cluster_to_toml`` writes this format back
(``load_cluster(cluster_to_toml(c))`` round-trips).

Built-in clusters for ``resolve_cluster``: ``"dgx-a100"`` (A100 80GB), ``"dgx-a100-40g"``,
``"dgx-h100"``, ``"dgx-h200"``, ``"dgx1-v100"``, ``"cpu"``; a bare GPU name (``"h100"``) also works;
anything else is read as a TOML path.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional, Union

DEFAULT_CALIBRATION_PATH = Path(__file__).with_name("calibration.json")

GB = 1e9
MiB = 2**20

GPU_NAMES = ("a100-40g", "a100-80g", "h100", "h200", "v100")
CPU_NAME = "cpu"

# Dtypes a training plan can compute in, in order of preference when their peaks are equal.
TRAINING_DTYPES = ("bfloat16", "float16", "float32")

_DTYPE_ALIASES = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "tf32": "float32",
    "float": "float32", "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn",
}


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator. Peaks and HBM are datasheet figures; efficiencies are empirical."""
    name: str
    peak_flops: tuple[tuple[str, float], ...]  # dtype -> dense FLOP/s ("float32" = TF32 tensor; "vector" = CUDA-core FP32)
    hbm_bytes: int                             # usable device memory (nvidia-smi total)
    hbm_Bps: float                             # datasheet HBM bandwidth, bytes/s
    matmul_efficiency: float                   # empirical: achieved GEMM FLOP/s / peak
    attention_efficiency: float                # empirical: achieved SDPA FLOP/s (FULL count) / peak
    memory_efficiency: float                   # empirical: measured copy B/s / hbm_Bps
    source: str                                # where the numbers come from
    emulated: tuple[str, ...] = ()             # dtypes priced at a fallback (CUDA-core) rate: no tensor cores
    # host time per graph node per training step (autopar's executor, autograd, Python dispatch),
    # serial with the compute; plain-tensor (tp == 1) and DTensor execution. 0 unless measured
    # (``autopar calibrate``): on GPUs it runs ahead of the device and hides behind large kernels.
    op_overhead_s: float = 0.0
    dtensor_op_overhead_s: float = 0.0
    # DTensor on a mesh of two or more axes of size > 1 (tp x dp, tp x cp, several tensor axes):
    # its sharding propagation enumerates strategies over every axis; 0: as ``dtensor_op_overhead_s``
    dtensor_2d_op_overhead_s: float = 0.0
    # host time per training step that does not grow with the graph (the step's Python, the loss's
    # all-reduce, the optimizer's launch, zeroing the gradients), once per step; 0 unless measured
    step_overhead_s: float = 0.0
    # host time of one ring attention node (cp > 1, ring) per micro-batch beyond a plain node's: its
    # blocks, merges and rotations issued from Python (``codegen/context_attention.py``); 0 unless measured
    ring_attention_overhead_s: float = 0.0
    # host time of one ZeRO-3 gather group (``codegen/gather_groups.py``: about a layer's
    # parameters) per micro-batch, dp > 1: its gathers, prefetch, re-gather and reduce-scatter
    # issued from Python (``runtime/prefetch.py``), beside their link time; 0 unless measured
    zero3_group_overhead_s: float = 0.0
    # non-causal attention (BERT, ViT): achieved FLOP/s / peak, FULL count; None: not measured
    attention_noncausal_efficiency: Optional[float] = None
    # memory-bound ops of a class (``compute.MEMORY_CLASSES``) measured apart: (class, bytes/s /
    # hbm_Bps); a class not listed runs at ``memory_efficiency``
    memory_class_efficiency: tuple[tuple[str, float], ...] = ()
    # the optimizer step (AdamW: ``timing.OPTIMIZER_BYTES_PER_PARAM`` and the gradient a parameter)
    # runs at hbm_Bps x memory_efficiency x this; measured on CPU ranks (``calibrate_step.py``)
    optimizer_efficiency: float = 1.0

    def memory_eff_for(self, mclass: str) -> float:
        """The memory efficiency of a memory-bound op of class ``mclass`` (``compute.memory_class``)."""
        for c, eff in self.memory_class_efficiency:      # (no dict: once per strategy of every node)
            if c == mclass:
                return eff
        return self.memory_efficiency

    def node_overhead_s(self, dtensor: bool, mesh_axes: int = 1) -> float:
        """The host's cost per graph node per step: plain tensors, DTensor, or DTensor over a mesh
        of ``mesh_axes`` >= 2 axes of size > 1 (never below the 1-D figure: a 2-D figure measured
        below it is noise)."""
        if not dtensor:
            return self.op_overhead_s
        if mesh_axes >= 2:
            return max(self.dtensor_op_overhead_s, self.dtensor_2d_op_overhead_s)
        return self.dtensor_op_overhead_s

    def attention_eff(self, causal: bool) -> float:
        """The attention efficiency of a causal or a non-causal kernel (FULL FLOP count, as
        ``attention_efficiency``). A causal kernel skips the masked half of the counted work, so
        one that runs at the same true utilisation either way scores twice the non-causal figure:
        without a measured non-causal efficiency, it is ``attention_efficiency / 2``."""
        if causal:
            return self.attention_efficiency
        if self.attention_noncausal_efficiency is not None:
            return self.attention_noncausal_efficiency
        return self.attention_efficiency / 2

    def peak_flops_for(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` ("bfloat16", "float16", "float32" (=TF32), "float8_e4m3fn",
        or "vector"); accepts "torch.bfloat16" and short aliases ("bf16", "fp16", "tf32", "fp8")."""
        key = _canonical_dtype(dtype)
        for d, f in self.peak_flops:
            if d == key:
                return f
        have = ", ".join(d for d, _ in self.peak_flops)
        raise ValueError(f"GPU {self.name!r} has no peak FLOP/s for dtype {dtype!r}; it has: {have}. "
                         f"Cast the model to one of those dtypes or add the figure to the GPU spec.")

    def fastest_dtype(self) -> str:
        """The training dtype (TRAINING_DTYPES) with the highest peak among those this GPU runs
        natively (not ``emulated``); equal peaks prefer bfloat16, then float16."""
        native = [d for d in TRAINING_DTYPES if d not in self.emulated]
        return max(native, key=lambda d: (self.peak_flops_for(d), -TRAINING_DTYPES.index(d)))

    def dtype_warning(self, dtype: str) -> Optional[str]:
        """One line if ``dtype`` runs here only at a fallback rate (bf16 on V100), else None."""
        key = _canonical_dtype(dtype)
        if key not in self.emulated:
            return None
        best = self.fastest_dtype()
        return (f"{self.name} has no {key} tensor cores: planning {key} at its "
                f"{self.peak_flops_for(key) / 1e12:.1f} TFLOP/s CUDA-core rate; --dtype {short_dtype(best)} "
                f"({self.peak_flops_for(best) / 1e12:.1f} TFLOP/s) is faster, or leave --dtype out")


def device_kind(cluster: "ClusterSpec") -> str:
    """torch's device type of the cluster's accelerators: "cpu" for CPU ranks, else "cuda"."""
    return "cpu" if cluster.gpu.name == CPU_NAME else "cuda"


@dataclass(frozen=True)
class LinkSpec:
    """A communication link as NCCL sees it from one GPU."""
    name: str
    busbw_Bps: float   # achievable NCCL bus bandwidth per GPU on this link (nccl-tests busbw)
    latency_s: float   # per-step (per ring hop) latency
    source: str
    # a collective kind's own bus bandwidth relative to busbw_Bps, ((kind, factor), ...), measured:
    # NCCL's kinds run alike, gloo's do not (``autopar calibrate`` writes them); unlisted kinds: 1
    busbw_scale: tuple = ()
    # all-reduces take trees, whose latency grows with log2 n (NCCL, ``collectives.all_reduce_s``);
    # False: a ring's 2(n-1) steps (gloo). ``make_cluster`` sets it on every GPU family's links.
    all_reduce_tree: bool = False
    # the fixed time of one collective call on top of its steps' latency (the alpha of an alpha-beta
    # model: its ranks' rendezvous, launch); ``autopar calibrate`` fits it where it times groups of
    # two sizes (on CPU ranks that share cores, the wait for the group's other ranks to be
    # scheduled). The built-in links: 0 (no published figure read)
    call_latency_s: float = 0.0

    def latency_of(self, steps: float) -> float:
        """The latency of one collective of ``steps`` steps: its call latency and each step's."""
        return self.call_latency_s + steps * self.latency_s

    def busbw_of(self, kind: str) -> float:
        """The bus bandwidth collectives of ``kind`` run at on this link."""
        for k, factor in self.busbw_scale:
            if k == kind:
                return self.busbw_Bps * factor
        return self.busbw_Bps


@dataclass(frozen=True)
class ClusterSpec:
    """Homogeneous cluster: ``nodes`` x ``gpus_per_node`` GPUs, NVLink inside a node, IB between."""
    name: str
    gpu: GPUSpec
    nodes: int
    gpus_per_node: int
    intra: LinkSpec     # inside one node (NVLink/NVSwitch)
    inter: LinkSpec     # between nodes, per GPU (one NIC per GPU)
    pcie_Bps: float     # host<->device per GPU (offload), rough
    host_memory_bytes: float = 1e12   # host RAM per node (offload), rough: _HOST
    host_Bps: float = 25e9            # host memory bandwidth per GPU for the CPU optimizer step, rough
    nvme_bytes: float = 15e12         # NVMe capacity per node, rough
    nvme_Bps: float = 25e9            # NVMe bandwidth per node, rough
    # fractional slowdown of compute while an overlapped collective runs beside it (SMs, HBM and
    # links shared; gloo threads on a CPU): hidden communication costs overlap_slowdown x hidden
    # seconds of extra compute (solver/overlap.py). Per family: _OVERLAP_SLOWDOWN; measured by
    # ``autopar calibrate`` (calibrate_overlap.py).
    overlap_slowdown: float = 0.0
    overlap_slowdown_source: str = "not measured: no contention modelled"
    # CPU ranks: the cores a node's ``gpus_per_node`` ranks share (``autopar calibrate`` writes it);
    # 0: each rank has a device of its own
    cores_per_node: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"cluster {self.name!r}: nodes ({self.nodes}) and gpus_per_node "
                             f"({self.gpus_per_node}) must both be >= 1")
        if self.cores_per_node < 0:
            raise ValueError(f"cluster {self.name!r}: cores_per_node ({self.cores_per_node}) must be >= 0")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def rank_speedup(self) -> float:
        """How much faster a CPU rank computes alone than with all of its node's ranks busy (the
        rates of an ``autopar calibrate`` file): ranks / cores where they outnumber the cores, else 1."""
        if not self.cores_per_node:
            return 1.0
        return max(1.0, self.gpus_per_node / self.cores_per_node)


# ---------------------------------------------------------------------------------------------
# Datasheet table (gpu_specs.csv rows). Efficiencies are filled in from calibration.json.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Datasheet:
    family: str                                # key into calibration.json
    peak_flops: tuple[tuple[str, float], ...]
    hbm_bytes: int
    hbm_Bps: float
    source: str
    emulated: tuple[str, ...] = ()             # dtypes in peak_flops only at a fallback rate


_T = 1e12
_DATASHEETS: Mapping[str, _Datasheet] = MappingProxyType({
    # gpu_specs.csv row A100-SXM4-40GB: bf16/fp16 312 dense, tf32 156, fp32 19.5, 1555 GB/s, 40960 MiB.
    "a100-40g": _Datasheet("a100", (("bfloat16", 312 * _T), ("float16", 312 * _T), ("float32", 156 * _T),
                                    ("vector", 19.5 * _T)), 40960 * MiB, 1555 * GB,
                           "gpu_specs.csv A100-SXM4-40GB (datasheet)"),
    # gpu_specs.csv row A100-SXM4-80GB: as above, HBM2e 2039 GB/s, 81920 MiB.
    "a100-80g": _Datasheet("a100", (("bfloat16", 312 * _T), ("float16", 312 * _T), ("float32", 156 * _T),
                                    ("vector", 19.5 * _T)), 81920 * MiB, 2039 * GB,
                           "gpu_specs.csv A100-SXM4-80GB (datasheet)"),
    # gpu_specs.csv row H100-SXM5-80GB: dense bf16 989.4, tf32 494.7, fp8 1979, fp32 67, 3350 GB/s, 81559 MiB.
    "h100": _Datasheet("h100", (("bfloat16", 989.4 * _T), ("float16", 989.4 * _T), ("float32", 494.7 * _T),
                                ("float8_e4m3fn", 1979 * _T), ("vector", 67 * _T)), 81559 * MiB, 3350 * GB,
                       "gpu_specs.csv H100-SXM5-80GB (datasheet, dense = half of sparse)"),
    # gpu_specs.csv row H200-SXM-141GB: compute identical to H100 SXM, HBM3e 4800 GB/s, 143771 MiB.
    "h200": _Datasheet("h200", (("bfloat16", 989.4 * _T), ("float16", 989.4 * _T), ("float32", 494.7 * _T),
                                ("float8_e4m3fn", 1979 * _T), ("vector", 67 * _T)), 143771 * MiB, 4800 * GB,
                       "gpu_specs.csv H200-SXM-141GB (datasheet)"),
    # gpu_specs.csv row V100-SXM2-16GB (UNVERIFIED third-party): fp16 tensor 125, fp32 15.7, 900 GB/s, 16 GB.
    # V100 has no bf16 or tf32 tensor cores: bf16 and fp32 matmuls run at the CUDA-core fp32 rate (rough).
    "v100": _Datasheet("v100", (("float16", 125 * _T), ("bfloat16", 15.7 * _T), ("float32", 15.7 * _T),
                                ("vector", 15.7 * _T)), 16 * 10**9, 900 * GB,
                       "gpu_specs.csv V100-SXM2-16GB (UNVERIFIED third-party catalog)", emulated=("bfloat16",)),
    # Pseudo-GPU for planning CPU/gloo runs: ROUGH effective figures, not a datasheet.
    "cpu": _Datasheet("cpu", (("bfloat16", 1 * _T), ("float16", 1 * _T), ("float32", 1 * _T),
                              ("vector", 1 * _T)), 8 * 2**30, 20 * GB,
                      "rough cpu pseudo-GPU (1 TFLOP/s, 8 GiB, 20 GB/s): for planning gloo runs only"),
})


@dataclass(frozen=True)
class Efficiency:
    """Empirical efficiency factors of one GPU family (one entry of calibration.json)."""
    matmul: float
    attention: float
    memory: float
    source: str
    attention_noncausal: Optional[float] = None     # None: not measured (GPUSpec.attention_eff)
    memory_classes: tuple[tuple[str, float], ...] = ()    # GPUSpec.memory_class_efficiency


_EFF_KEYS = ("matmul_efficiency", "attention_efficiency", "attention_noncausal_efficiency", "memory_efficiency",
             "memory_class_efficiency", "source", "compute_from", "measured")


def _memory_classes(path: str, fam: str, table: Any) -> tuple[tuple[str, float], ...]:
    """``"memory_class_efficiency": {"norm": 0.58}``: the classes of ``compute.MEMORY_CLASSES``."""
    from autopar.cost.compute import MEMORY_CLASSES

    if not isinstance(table, dict):
        raise ValueError(f"{path}: family {fam!r} memory_class_efficiency must be an object like {{\"norm\": 0.58}}")
    out = []
    for mclass, val in sorted(table.items()):
        if mclass not in MEMORY_CLASSES:
            raise ValueError(f"{path}: family {fam!r} memory_class_efficiency has unknown class {mclass!r}; "
                             f"allowed: {list(MEMORY_CLASSES)}")
        if not isinstance(val, (int, float)) or not 0.0 < val <= 1.0:
            raise ValueError(f"{path}: family {fam!r} memory_class_efficiency.{mclass}={val!r} is outside (0, 1]")
        out.append((mclass, float(val)))
    return tuple(out)


@functools.lru_cache(maxsize=8)
def _parse_calibration(path: str, text: str) -> Mapping[str, Efficiency]:
    raw = json.loads(text)
    fams: dict[str, Any] = raw.get("families")
    if not isinstance(fams, dict):
        raise ValueError(f"{path}: expected a top-level 'families' object")
    for fam, entry in fams.items():
        bad = sorted(set(entry) - set(_EFF_KEYS))
        if bad:
            raise ValueError(f"{path}: family {fam!r} has unknown key(s) {bad}; allowed: {list(_EFF_KEYS)}")
    out: dict[str, Efficiency] = {}
    for fam, entry in fams.items():
        base = entry
        src = entry.get("source", "")
        if "compute_from" in entry:
            other = entry["compute_from"]
            if other not in fams:
                raise ValueError(f"{path}: family {fam!r} has compute_from={other!r}, not a family here")
            base = fams[other]
            src = f"{src}; matmul/attention from {other}: {base.get('source', '')}"
        try:
            noncausal = base.get("attention_noncausal_efficiency")
            eff = Efficiency(float(base["matmul_efficiency"]), float(base["attention_efficiency"]),
                             float(entry["memory_efficiency"]), src,
                             float(noncausal) if noncausal is not None else None,
                             _memory_classes(path, fam, entry.get("memory_class_efficiency", {})))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: family {fam!r} lacks a number for {e.args[0]!r}") from None
        # attention may exceed 1: its FLOPs are counted FULL, so causal kernels (half the work) can
        # reach up to 2x their true utilisation.
        for what, val, hi in (("matmul_efficiency", eff.matmul, 1.0), ("attention_efficiency", eff.attention, 2.0),
                              ("attention_noncausal_efficiency", eff.attention_noncausal or 1.0, 1.0),
                              ("memory_efficiency", eff.memory, 1.0)):
            if not 0.0 < val <= hi:
                raise ValueError(f"{path}: family {fam!r} {what}={val} is outside (0, {hi}]; "
                                 f"re-run benchmarks/calibrate.py or fix the entry")
        out[fam] = eff
    return MappingProxyType(out)


def load_calibration(path: Union[str, Path, None] = None) -> Mapping[str, Efficiency]:
    """Efficiency factors per GPU family ("a100", "h100", "h200", "v100", "cpu") from a calibration
    JSON (default: ``autopar/cost/calibration.json``). Read-only mapping; parsing is cached per
    file content, so an edited file is picked up."""
    p = Path(path or DEFAULT_CALIBRATION_PATH)
    return _parse_calibration(str(p), p.read_text())


def get_gpu(name: str, calibration: Union[str, Path, None] = None) -> GPUSpec:
    """The built-in spec of ``name`` (one of GPU_NAMES, or "cpu"), efficiencies from ``calibration``."""
    key = name.lower().strip()
    if key not in _DATASHEETS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPU_NAMES + (CPU_NAME,))}")
    ds = _DATASHEETS[key]
    cal = load_calibration(calibration)
    if ds.family not in cal:
        raise ValueError(f"calibration file has no entry for GPU family {ds.family!r} (needed by {name!r}); "
                         f"run benchmarks/calibrate.py or add the family to the file")
    eff = cal[ds.family]
    return GPUSpec(name=key, peak_flops=ds.peak_flops, hbm_bytes=ds.hbm_bytes, hbm_Bps=ds.hbm_Bps,
                   matmul_efficiency=eff.matmul, attention_efficiency=eff.attention,
                   attention_noncausal_efficiency=eff.attention_noncausal, memory_efficiency=eff.memory,
                   memory_class_efficiency=eff.memory_classes,
                   source=f"peaks/HBM: {ds.source}; efficiencies (empirical): {eff.source}", emulated=ds.emulated)


def _canonical_dtype(dtype: str) -> str:
    d = str(dtype).removeprefix("torch.").lower()
    return _DTYPE_ALIASES.get(d, d)


def short_dtype(dtype: str) -> str:
    """The command-line spelling of a dtype: "bfloat16" -> "bf16" (unknown names unchanged)."""
    key = _canonical_dtype(dtype)
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(key, key)


# ---------------------------------------------------------------------------------------------
# Default links per GPU type
# ---------------------------------------------------------------------------------------------

_US = 1e-6
# Per-hop latencies are rough (order of NCCL's own tuning model: ~1-2 us per NVLink hop for the
# Simple protocol, several us per network hop); they matter for small messages and for rings of many
# ranks. NCCL's all-reduces take trees: ``make_cluster`` sets ``all_reduce_tree`` on every GPU's links.
_INTRA: Mapping[str, LinkSpec] = MappingProxyType({
    # nccl_busbw_reference.csv "8x A100-SXM (NVLink3, NVSwitch)": all_reduce busbw 230 GB/s (maintainer).
    "a100": LinkSpec("nvlink3-nvswitch", 230 * GB, 2 * _US,
                     "nccl_busbw_reference.csv: 8x A100-SXM NVSwitch all_reduce busbw 230 GB/s (NVIDIA/nccl-tests#149)"),
    # nccl_busbw_reference.csv "8x H100-SXM (NVLink4, NVSwitch)": ring / non-allreduce busbw 370 GB/s.
    # NVLS all-reduce reaches ~480 GB/s for > 256 MB messages; we use the ring figure for every op.
    "h100": LinkSpec("nvlink4-nvswitch", 370 * GB, 2 * _US,
                     "nccl_busbw_reference.csv: 8x H100-SXM ring busbw 370 GB/s (NVIDIA/nccl-tests#212); "
                     "NVLS all-reduce ~480 not modelled"),
    # Same NVLink4 as H100 (gpu_specs.csv: 900 GB/s, 18 links); csv's H200 all_reduce 475 is NVLS.
    "h200": LinkSpec("nvlink4-nvswitch", 370 * GB, 2 * _US,
                     "as H100 (same NVLink4, gpu_specs.csv); nccl_busbw_reference.csv 8x H200 all_reduce 475 is NVLS"),
    # ESTIMATE: 80% of the 150 GB/s/dir NVLink2 line rate in gpu_specs.csv V100 row; not measured.
    "v100": LinkSpec("nvlink2", 120 * GB, 3 * _US,
                     "ESTIMATE: 0.8 x 150 GB/s/dir NVLink2 (gpu_specs.csv V100 row); not a measurement"),
    "cpu": LinkSpec("gloo-loopback", 2 * GB, 50 * _US, "rough: gloo over shared memory/loopback"),
})
_INTER: Mapping[str, LinkSpec] = MappingProxyType({
    # nccl_busbw_reference.csv "1x HDR 200Gb/s NIC": 24 GB/s per NIC (one NIC per GPU on DGX A100).
    "a100": LinkSpec("ib-hdr200-per-gpu", 24 * GB, 8 * _US,
                     "nccl_busbw_reference.csv: 1x HDR 200Gb/s NIC 24 GB/s (NVIDIA/nccl#412), one NIC per GPU"),
    # nccl_busbw_reference.csv "1x NDR 400Gb/s NIC (ConnectX-7)": 46-48 GB/s per NIC.
    "h100": LinkSpec("ib-ndr400-per-gpu", 48 * GB, 8 * _US,
                     "nccl_busbw_reference.csv: 1x NDR 400Gb/s NIC 46-48 GB/s (NVIDIA/nccl-tests#290), one NIC per GPU"),
    "h200": LinkSpec("ib-ndr400-per-gpu", 48 * GB, 8 * _US,
                     "nccl_busbw_reference.csv: 1x NDR 400Gb/s NIC 46-48 GB/s (NVIDIA/nccl-tests#290), one NIC per GPU"),
    # nccl_busbw_reference.csv "1x EDR 100Gb/s NIC": 12.2 GB/s.
    "v100": LinkSpec("ib-edr100-per-gpu", 12.2 * GB, 8 * _US,
                     "nccl_busbw_reference.csv: 1x EDR 100Gb/s NIC 12.2 GB/s (NVIDIA/nccl-tests#29)"),
    "cpu": LinkSpec("tcp", 1 * GB, 100 * _US, "rough: gloo over TCP"),
})
# Host<->device per GPU, ROUGH achievable (not in the reference csvs): PCIe Gen4 x16 ~25 GB/s
# (A100), Gen5 x16 ~50 GB/s (H100/H200), Gen3 x16 ~12 GB/s (V100).
_PCIE_Bps: Mapping[str, float] = MappingProxyType({
    "a100": 25 * GB, "h100": 50 * GB, "h200": 50 * GB, "v100": 12 * GB, "cpu": 20 * GB})
# Offload's host side per family, ROUGH (not in the reference csvs): (host RAM per node, host memory
# bandwidth per GPU for a CPU Adam step ~1/8 of a 2-socket server's 150-300 GB/s, NVMe per node, NVMe
# bandwidth per node): RAM and drives as DGX-1 V100 (512 GB, 4 x 1.92 TB), DGX A100 (1 TB, 4 x 3.84 TB),
# DGX H100/H200 (2 TB, 8 x 3.84 TB); NVMe ~28 GB/s per DGX-2 node (parallelism_facts.md §4.2).
_HOST: Mapping[str, tuple[float, float, float, float]] = MappingProxyType({
    "a100": (1000 * GB, 25 * GB, 15360 * GB, 25 * GB), "h100": (2000 * GB, 40 * GB, 30720 * GB, 50 * GB),
    "h200": (2000 * GB, 40 * GB, 30720 * GB, 50 * GB), "v100": (512 * GB, 15 * GB, 7680 * GB, 28 * GB),
    "cpu": (64 * GB, 10 * GB, 1000 * GB, 3 * GB)})    # "cpu": one workstation


# Compute slowdown under overlapped communication per family, (fraction, short source). A100/H100:
# Lee et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
# Learning: Performance and Power Implications", arXiv:2507.03114 (2025), abstract: overlapping
# "can result in an average computational slowdown of 18.9%, with a maximum of 40.0%" against the
# same compute with no communication beside it (GPT and LLaMA training on 4 x A100, H100, MI250,
# MI210: an average over those GPUs, not a per-GPU figure). H200: the H100's SMs (gpu_specs.csv).
# V100 and the cpu pseudo-GPU: no published figure read, so 0 (``autopar calibrate`` measures it).
_OVERLAP_SLOWDOWN: Mapping[str, tuple[float, str]] = MappingProxyType({
    **{f: (0.189, "arXiv:2507.03114 mean over A100/H100/MI250/MI210") for f in ("a100", "h100", "h200")},
    "v100": (0.0, "no published figure read: no contention modelled"),
    "cpu": (0.0, "not measured: no contention modelled")})


def make_cluster(gpu: str, nodes: int, gpus_per_node: int = 8, name: Optional[str] = None) -> ClusterSpec:
    """A cluster of ``nodes`` x ``gpus_per_node`` ``gpu``s with the default links of that GPU type:
    NVLink/NVSwitch inside a node and one InfiniBand NIC per GPU between nodes (NDR 400 Gb/s ~48 GB/s
    for H100/H200, HDR 200 Gb/s ~24 GB/s for A100, EDR 100 Gb/s ~12.2 GB/s for V100)."""
    spec = get_gpu(gpu)
    fam = _DATASHEETS[spec.name].family
    tree = fam != "cpu"          # NCCL's all-reduces take trees, gloo's rings (``collectives.all_reduce_s``)
    return ClusterSpec(name=name or f"{spec.name}x{nodes}x{gpus_per_node}", gpu=spec, nodes=nodes,
                       gpus_per_node=gpus_per_node, intra=replace(_INTRA[fam], all_reduce_tree=tree),
                       inter=replace(_INTER[fam], all_reduce_tree=tree),
                       pcie_Bps=_PCIE_Bps[fam], host_memory_bytes=_HOST[fam][0], host_Bps=_HOST[fam][1],
                       nvme_bytes=_HOST[fam][2], nvme_Bps=_HOST[fam][3], overlap_slowdown=_OVERLAP_SLOWDOWN[fam][0],
                       overlap_slowdown_source=_OVERLAP_SLOWDOWN[fam][1])


_BUILTIN_CLUSTERS: Mapping[str, str] = MappingProxyType({
    "dgx-a100": "a100-80g", "dgx-a100-40g": "a100-40g", "dgx-h100": "h100", "dgx-h200": "h200",
    "dgx1-v100": "v100", "cpu": "cpu",
})
CLUSTER_NAMES = tuple(_BUILTIN_CLUSTERS)


def _check_size(nodes: Optional[int], gpus_per_node: Optional[int]) -> None:
    for what, v in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if v is not None and v < 1:
            raise ValueError(f"{what}={v}: a cluster needs at least 1; give a positive number")


def resolve_cluster(name_or_path: Union[str, Path], *, nodes: Optional[int] = None,
                    gpus_per_node: Optional[int] = None, gpu: Optional[str] = None) -> ClusterSpec:
    """A built-in cluster name (CLUSTER_NAMES), a GPU name (GPU_NAMES), or a TOML path.

    Each of ``nodes`` / ``gpus_per_node`` / ``gpu`` that is not None replaces the cluster's own value
    (built-ins are 1 node x 8 GPUs). For a TOML cluster the file is read as if it said them: its
    [intra]/[inter] links and [gpu_overrides] are kept (the overrides apply to the swapped GPU);
    links the file leaves out default to those of the GPU planned for."""
    _check_size(nodes, gpus_per_node)
    key = _builtin_key(name_or_path)
    if key is not None:
        n = 1 if nodes is None else nodes
        return make_cluster(gpu or _BUILTIN_CLUSTERS.get(key, key), n, 8 if gpus_per_node is None else gpus_per_node,
                            name=f"{key}x{n}" if key in _BUILTIN_CLUSTERS else None)
    p = Path(name_or_path)
    if not p.exists():
        raise ValueError(f"unknown cluster {str(name_or_path)!r}: not a built-in cluster "
                         f"({', '.join(CLUSTER_NAMES)}), not a GPU ({', '.join(GPU_NAMES)}), "
                         f"and no such TOML file")
    from autopar.cost.cluster_file import _read_toml, cluster_from_dict

    d = _read_toml(p)
    given = {"gpu": gpu, "nodes": nodes, "gpus_per_node": gpus_per_node}
    d.update({k: v for k, v in given.items() if v is not None})
    return cluster_from_dict(d, where=str(p))


def _builtin_key(name_or_path: Union[str, Path]) -> Optional[str]:
    key = str(name_or_path).lower().strip()
    return key if key in _BUILTIN_CLUSTERS or key in _DATASHEETS else None


def cluster_overrides(name_or_path: Union[str, Path], *, nodes: Optional[int] = None,
                      gpus_per_node: Optional[int] = None, gpu: Optional[str] = None) -> Optional[str]:
    """One line saying which given values replace what the cluster itself says, e.g. "cluster
    my-h100-pod with --gpu a100-80g overriding h100 (the file's [gpu_overrides] memory_GB applied to
    a100-80g)"; None when nothing is replaced. Built-in clusters have no node count to replace."""
    base = resolve_cluster(name_or_path)
    builtin = _builtin_key(name_or_path)
    new_gpu = get_gpu(gpu).name if gpu is not None else base.gpu.name
    changes = []
    if new_gpu != base.gpu.name:
        changes.append(f"--gpu {new_gpu} overriding {base.gpu.name}")
    if builtin is None and nodes is not None and nodes != base.nodes:
        changes.append(f"--nodes {nodes} overriding {base.nodes}")
    if gpus_per_node is not None and gpus_per_node != base.gpus_per_node:
        changes.append(f"--gpus-per-node {gpus_per_node} overriding {base.gpus_per_node}")
    if not changes:
        return None
    line = f"cluster {builtin or base.name} with " + ", ".join(changes)
    from autopar.cost.cluster_file import _read_toml

    overrides = {} if builtin else _read_toml(name_or_path).get("gpu_overrides", {})
    kept = [k for k in overrides if k != "source"]
    if kept and new_gpu != base.gpu.name:
        line += f" (the file's [gpu_overrides] {', '.join(kept)} applied to {new_gpu})"
    return line
