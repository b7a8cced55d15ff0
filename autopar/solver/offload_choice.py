"""Which tensor classes to offload (``plan.OFFLOAD_CLASSES``) for one outer configuration.

Offload never makes a step faster (``cost.offload``: it only adds exposed transfers, and the CPU
optimizer step, at host memory bandwidth, is slower than the device's at HBM bandwidth), so the
search (``search.py``) plans without it first and tries offload only when nothing fits the GPUs:
then every configuration's variants (the valid sets of classes; params only under ZeRO-3) are
evaluated and the fastest that fits the device, host and NVMe budgets kept. The memory bounds
that prune configurations take the leanest variant (every class offloaded: device memory only
falls as classes are added, except that params offload keeps a gathered working window, so the
leaner of with / without params), and the step-time bounds the variant without offload.
"""
from __future__ import annotations

import math
from dataclasses import replace
from itertools import product
from typing import Optional

from autopar.plan import offload_name
from autopar.solver.timing import Evaluation, OuterConfig, evaluate, host_budgets

GB = 1e9


def offload_variants(cfg: OuterConfig, nvme: bool = True) -> list[OuterConfig]:
    """``cfg`` with each valid non-empty set of offloaded classes (optimizer first: grads, params
    and nvme need it; params needs ZeRO-3; nvme_params needs params and nvme, nvme_grads nvme,
    nvme_activations activations), fewest classes first. ``nvme`` False (no NVMe budget): none
    with an NVMe tier."""
    out = []
    files = (False, True) if nvme else (False,)
    for act, opt in product((False, True), (False, True)):
        if not opt:
            if act:
                out += [("activations",)] + ([("activations", "nvme_activations")] if nvme else [])
            continue
        for grads, params, on_nvme in product((False, True), (False, True), files):
            if params and cfg.zero != 3:
                continue
            cls = ("optimizer",) + (("grads",) if grads else ()) + (("params",) if params else ()) \
                + (("activations",) if act else ()) + (("nvme",) if on_nvme else ())
            # on NVMe beside the state: the parameter rows (ZeRO-3), the gradients, both, or neither;
            # the saved activations (offloaded) in files or in host memory
            tiers = [()] if not on_nvme else [(), ("nvme_grads",)] + (
                [("nvme_params",), ("nvme_params", "nvme_grads")] if params else [])
            for more, on_disk in product(tiers, files if act else (False,)):
                out.append(cls + more + (("nvme_activations",) if on_disk else ()))
    if cfg.data == 1 and cfg.zero == 3:        # ZeRO-3 on one rank is only worth it to offload params
        out = [c for c in out if "params" in c]
    out.sort(key=len)
    return [replace(cfg, offload=offload_name(c)) for c in out]


def lean_configs(cfg: OuterConfig) -> list[OuterConfig]:
    """The variants of least device memory: every class offloaded (the parameter rows and gradients
    on NVMe, the least host memory too), and (ZeRO-3) the same without params, whose gathered window
    can outweigh a rank's own rows."""
    full = ("optimizer", "grads", "activations", "nvme", "nvme_grads", "nvme_activations")
    out = [replace(cfg, offload=offload_name(full))]
    if cfg.zero == 3:
        out.append(replace(cfg, offload=offload_name(full + ("params", "nvme_params"))))
        if cfg.data == 1:
            out = out[1:]
    return out


def lean_memory(memory_of, cfg: OuterConfig) -> float:
    """The least device bytes over ``cfg``'s offload variants: ``memory_of(config) -> bytes``."""
    return min(memory_of(c) for c in lean_configs(cfg))


def best_variant(summary, cfg: OuterConfig, cluster, profile,
                 budget: float) -> tuple[Optional[Evaluation], Evaluation, Optional[Evaluation]]:
    """(the fastest variant of ``cfg`` that fits, or None; the variant of least device memory, for
    the memory-constrained ILP; the variant that fits the GPU but not the host / NVMe with the
    least host bytes, or None, for the infeasibility message)."""
    best = lean = blocked = None
    for c in offload_variants(cfg, nvme=host_budgets(cluster)[1] > 0):
        ev = evaluate(summary, c, cluster, profile, budget)
        if ev.fits and (best is None or ev.step.total_s < best.step.total_s):
            best = ev
        if lean is None or ev.memory.total_bytes < lean.memory.total_bytes:
            lean = ev
        if ev.fits_device and not ev.fits and (blocked is None or ev.memory.host_bytes < blocked.memory.host_bytes):
            blocked = ev
    return best, lean, blocked


def host_note(ev: Optional[Evaluation], cluster) -> str:
    """Why an evaluated offload plan did not fit the host or NVMe, with what to change ('' if it
    fit them)."""
    if ev is None or not ev.config.classes:
        return ""
    host_b, nvme_b = host_budgets(cluster)
    m = ev.memory
    g = cluster.gpus_per_node
    if m.host_bytes > host_b:
        need = math.ceil(m.host_bytes * g / GB / (host_b * g / cluster.host_memory_bytes) / 10) * 10
        extra = "" if "nvme" in ev.config.classes else " or nvme offload (--force offload=...+nvme)"
        return (f"; with offload={ev.config.offload} it needs {m.host_bytes / GB:.1f} GB of host memory per GPU, "
                f"over the host budget of {host_b / GB:.1f} GB per GPU ({cluster.host_memory_bytes / GB:.3g} GB "
                f"per node, less a reserve, over {g} GPUs); try --host-memory-gb {need:.0f}{extra}")
    if m.nvme_bytes > nvme_b:
        need = math.ceil(m.nvme_bytes * g / GB)
        return (f"; with offload={ev.config.offload} it needs {m.nvme_bytes / GB:.1f} GB of NVMe per GPU, over the "
                f"NVMe budget of {nvme_b / GB:.1f} GB per GPU ({cluster.nvme_bytes / GB:.0f} GB per node); "
                f"try --nvme-gb {need}")
    return ""
