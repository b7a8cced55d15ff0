"""What the op classes reach inside a training step, measured for ``autopar calibrate`` on CPU ranks.

The microbenchmarks (``calibrate_bench``) time each op alone, in a loop. Inside a training step
the same ops ran slower. Measured on this project's 2-core machine, ``gpt:hidden=256,layers=4``
under dp=4 with the profiler's self times (``autopar profile``):

- GEMMs: 95 ms a step, against 74 at the microbenchmarked rate;
- attention: 13.7 ms against 8.7;
- the memory-bound ops: 22.7 ms against 17.5.

The same step on one rank, alone on a core, ran its GEMMs at 114 GFLOP/s where the loop ran the
same shapes at 152. The AdamW step went the other way: 10.6 ms against 18.5 priced at the copy's
rate.

So ``autopar calibrate`` ends by training a reference GPT (``REF_MODEL``) data parallel over all its
ranks under ``autopar profile`` (``profile.profile_command``), planned on the cluster the
microbenchmarks describe. Per class it takes the plan's time against the profiler's:

    factor(class) = predicted time at the microbenchmarked rates / measured time

and the file's efficiencies become the fractions of the microbenchmarked rates reached in a step:

- ``matmul_efficiency`` = the matmul factor (the peak stays the GEMM loop's rate);
- ``attention_efficiency`` and ``attention_noncausal_efficiency`` times the attention factor;
- every memory-bound class's ``<class>_memory_efficiency`` = the memory factor (on CPU,
  ``memory_efficiency`` is 1: the copy's rate). The runtime's own gradient and gather copies stay at
  the copy's rate: the plan's time for them is taken out of the measured and the predicted
  memory-bound time first;
- ``optimizer_efficiency`` = the optimizer factor.

The reference's GEMMs are at the CPU calibration's own shapes (hidden 256, 256 tokens a rank: the
middle of ``calibrate.CPU_SETUP``'s), so the factor is the step's, not a shape's. A factor outside
``FACTOR_BOUNDS`` is recorded and not used (``[measured.in_step]``). GPUs keep the microbenchmarked
efficiencies: a CPU-sized reference would be launch-bound there, and the GPU path is not measured
in a step.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Optional

from autopar.cost.hardware import ClusterSpec

REF_MODEL = "gpt:hidden=256,layers=2,heads=4,vocab=1024,seq=128"
ROWS_PER_RANK = 2               # 256 tokens a rank: the CPU GEMMs' M (calibrate.CPU_SETUP gemm_tokens)
STEPS = 8                       # timed steps, then as many profiled (profile.profile_command)
# a factor outside its class's bounds is taken for a failed measurement, recorded and not used. The
# optimizer's are wider: AdamW's state on the reference (2.1M parameters, 4 fp32 tensors: 34 MB)
# stays in the cache where the copy's 128 MiB a rank do not, and 4-rank calibrations measured 1.5-2.5
CLASSES = ("matmul", "attention", "memory", "optimizer")
FACTOR_BOUNDS = {c: (0.2, 4.0 if c == "optimizer" else 2.0) for c in CLASSES}


@dataclass(frozen=True)
class StepRates:
    """The reference step's times per class, per step: ``(class, measured s, predicted s)``, the
    prediction at the microbenchmarked rates (module docstring); ``note``: why none were measured."""
    model: str
    force: str
    classes: tuple[tuple[str, float, float], ...] = ()
    note: str = ""

    def raw_factor(self, cls: str) -> Optional[float]:
        """predicted / measured for ``cls``; None where either is not positive."""
        for c, measured, predicted in self.classes:
            if c == cls and measured > 0 and predicted > 0:
                return predicted / measured
        return None

    def factor(self, cls: str) -> Optional[float]:
        """``raw_factor`` where it lies within ``FACTOR_BOUNDS[cls]``, else None (not used)."""
        f, (lo, hi) = self.raw_factor(cls), FACTOR_BOUNDS[cls]
        return f if f is not None and lo <= f <= hi else None


def class_times(report: dict) -> tuple[tuple[str, float, float], ...]:
    """``(class, measured s, predicted s)`` per step for ``CLASSES`` from an ``autopar profile``
    report (``profile.summarize``): the memory-bound row less the plan's passes through memory."""
    by = report["by_class"]
    passes = by["memory_passes"]["predicted_s"]
    rows = [(c, by[c]["measured_s"], by[c]["predicted_s"]) for c in ("matmul", "attention")]
    rows.append(("memory", by["memory"]["measured_s"] - passes, by["memory"]["predicted_s"] - passes))
    rows.append(("optimizer", report["optimizer"]["measured_s"], report["optimizer"]["predicted_s"]))
    return tuple(rows)


def measure_in_step(cluster: ClusterSpec, nproc: int) -> StepRates:
    """Train ``REF_MODEL`` data parallel over ``nproc`` ranks under the profiler, planned on
    ``cluster`` (the microbenchmarks' figures), and return its times per class (module docstring)."""
    from rich.console import Console

    from autopar.cost.cluster_file import cluster_to_toml
    from autopar.profile import profile_command
    from autopar.runtime.launch import RankFailure

    force = f"dp={nproc}"
    with tempfile.TemporaryDirectory(prefix="autopar-calibrate-step-") as tmp:
        path = os.path.join(tmp, "cluster.toml")
        with open(path, "w") as f:
            f.write(cluster_to_toml(cluster))
        try:
            with open(os.devnull, "w") as quiet:
                report = profile_command(REF_MODEL, nproc, STEPS, warmup=1, cluster=path, force=force,
                                         batch=ROWS_PER_RANK * nproc, console=Console(file=quiet))
        except RankFailure as e:
            return StepRates(REF_MODEL, force, note=f"the reference step failed: {e.summary()}")
    return StepRates(REF_MODEL, force, class_times(report))
