"""autopar.cost: hardware as data and pure cost functions (units in names: _s, _bytes, _flops, _Bps).

- ``hardware``    GPUSpec / LinkSpec / ClusterSpec, built-in GPUs and clusters, cluster TOML.
- ``collectives`` NCCL ring bus-bandwidth algebra; which link a mesh axis crosses.
- ``compute``     op kinds and roofline op time; backward factors.
- ``memory``      ZeRO model states, Korthikanti activations, pipeline in-flight micro-batches.
- ``flops``       Megatron closed-form FLOPs, pipeline bubble and step time.
Empirical efficiencies live in ``calibration.json`` (written by ``benchmarks/calibrate.py``).
"""
from autopar.cost.cluster_file import load_cluster
from autopar.cost.hardware import (CLUSTER_NAMES, GPU_NAMES, ClusterSpec, GPUSpec, LinkSpec, get_gpu,
                                   make_cluster, resolve_cluster)
from autopar.cost.collectives import axis_link, bus_factor, collective_s, stage_link
from autopar.cost.compute import backward_factor, op_kind, op_time_s

__all__ = [
    "CLUSTER_NAMES", "GPU_NAMES", "ClusterSpec", "GPUSpec", "LinkSpec", "get_gpu", "load_cluster",
    "make_cluster", "resolve_cluster", "axis_link", "bus_factor", "collective_s", "stage_link",
    "backward_factor", "op_kind", "op_time_s",
]
