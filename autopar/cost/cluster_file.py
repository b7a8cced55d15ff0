"""The cluster TOML format of ``hardware.py``'s docstring: read (``load_cluster``, from a parsed
mapping ``cluster_from_dict``) and written back (``cluster_to_toml``; ``load_cluster`` of it
round-trips). Unknown keys are errors naming the allowed ones."""
from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Union

from autopar.cost.compute import MEMORY_CLASSES
from autopar.cost.hardware import (_T, _US, GB, TRAINING_DTYPES, ClusterSpec, LinkSpec, _canonical_dtype, get_gpu,
                                   make_cluster)


# offload's host side: TOML key -> ClusterSpec field (decimal GB, GB/s)
_HOST_KEYS = (("host_memory_gb", "host_memory_bytes"), ("host_GBps", "host_Bps"), ("nvme_gb", "nvme_bytes"),
              ("nvme_GBps", "nvme_Bps"))
_TOP_KEYS = ("name", "gpu", "nodes", "gpus_per_node", "pcie_GBps", "intra", "inter", "gpu_overrides",
             "measured", "overlap_slowdown", "overlap_slowdown_source", "cores_per_node") + tuple(
                 k for k, _ in _HOST_KEYS)
_LINK_KEYS = ("busbw_GBps", "latency_us", "call_latency_us", "name", "source", "busbw_scale")
_EFFICIENCIES = ("matmul_efficiency", "attention_efficiency", "attention_noncausal_efficiency", "memory_efficiency",
                 "optimizer_efficiency")
_OVERRIDE_KEYS = ("memory_GB", "hbm_GBps", *_EFFICIENCIES, "peak_TFLOPs", "op_overhead_us", "dtensor_op_overhead_us",
                  "dtensor_2d_op_overhead_us", "step_overhead_us", "ring_attention_overhead_us",
                  "zero3_group_overhead_us", "source")
# memory-bound ops measured apart, by class (``compute.MEMORY_CLASSES``): bytes/s / hbm_Bps
_CLASS_KEYS = tuple((f"{c}_memory_efficiency", c) for c in MEMORY_CLASSES)
_OVERRIDE_KEYS += tuple(k for k, _ in _CLASS_KEYS)
_OVERHEADS = (("op_overhead_us", "op_overhead_s"), ("dtensor_op_overhead_us", "dtensor_op_overhead_s"),
              ("dtensor_2d_op_overhead_us", "dtensor_2d_op_overhead_s"), ("step_overhead_us", "step_overhead_s"),
              ("ring_attention_overhead_us", "ring_attention_overhead_s"),
              ("zero3_group_overhead_us", "zero3_group_overhead_s"))
_PEAK_DTYPES = TRAINING_DTYPES + ("float8_e4m3fn", "vector")


def _check_keys(where: str, table: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    bad = [k for k in table if k not in allowed]
    if bad:
        raise ValueError(f"{where}: unknown key(s) {bad}; allowed: {list(allowed)}")


def _link_from_table(where: str, t: Any, default: LinkSpec) -> LinkSpec:
    if not isinstance(t, dict):
        raise ValueError(f"{where}: must be a table like [intra] busbw_GBps = 370.0")
    _check_keys(where, t, _LINK_KEYS)
    if "busbw_GBps" not in t:
        raise ValueError(f"{where}: missing required key 'busbw_GBps'")
    lat = float(t["latency_us"]) * _US if "latency_us" in t else default.latency_s
    call = float(t["call_latency_us"]) * _US if "call_latency_us" in t else default.call_latency_s
    if not (lat >= 0 and call >= 0):
        raise ValueError(f"{where}: latency_us and call_latency_us must be >= 0, got {lat / _US} and {call / _US}")
    return LinkSpec(name=str(t.get("name", default.name)), busbw_Bps=float(t["busbw_GBps"]) * GB,
                    latency_s=lat, source=str(t.get("source", f"user TOML ({where})")),
                    busbw_scale=_busbw_scale(where, t.get("busbw_scale", {})),
                    all_reduce_tree=default.all_reduce_tree,     # the GPU type's collectives: NCCL or gloo
                    call_latency_s=call)


def _busbw_scale(where: str, t: Any) -> tuple:
    """``busbw_scale = { all_gather = 0.53, p2p = 3.8 }``: each kind's busbw relative to the link's."""
    from autopar.cost.collectives import COLLECTIVE_KINDS

    if not isinstance(t, dict):
        raise ValueError(f"{where}: busbw_scale must be a table like {{ all_gather = 0.5 }}")
    _check_keys(f"{where} busbw_scale", t, COLLECTIVE_KINDS)
    out = []
    for kind, factor in t.items():
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(f"{where}: busbw_scale.{kind} must be a number > 0 (its busbw relative to "
                             f"busbw_GBps), got {factor!r}")
        out.append((kind, float(factor)))
    return tuple(out)


def cluster_from_dict(d: Mapping[str, Any], where: str = "cluster") -> ClusterSpec:
    """Build a ClusterSpec from the parsed TOML mapping (format in the module docstring)."""
    _check_keys(where, d, _TOP_KEYS)
    if "measured" in d and not isinstance(d["measured"], dict):
        raise ValueError(f"{where}: 'measured' must be a table ([measured]); it is read and ignored")
    for req in ("gpu", "nodes"):
        if req not in d:
            raise ValueError(f"{where}: missing required key {req!r}")
    base = make_cluster(str(d["gpu"]), int(d["nodes"]), int(d.get("gpus_per_node", 8)),
                        name=str(d["name"]) if "name" in d else None)
    gpu = base.gpu
    if "gpu_overrides" in d:
        o = d["gpu_overrides"]
        _check_keys(f"{where} [gpu_overrides]", o, _OVERRIDE_KEYS)
        changes: dict[str, Any] = {}
        if "memory_GB" in o:
            changes["hbm_bytes"] = int(round(float(o["memory_GB"]) * GB))
        if "hbm_GBps" in o:
            changes["hbm_Bps"] = float(o["hbm_GBps"]) * GB
        for k in _EFFICIENCIES:
            if k in o:
                changes[k] = float(o[k])
        if "peak_TFLOPs" in o:
            changes["peak_flops"] = _peaks_with(gpu.peak_flops, o["peak_TFLOPs"], f"{where} [gpu_overrides]")
        classes = dict(gpu.memory_class_efficiency)
        for key, mclass in _CLASS_KEYS:
            if key in o:
                eff = float(o[key])
                if not 0.0 < eff < float("inf"):
                    raise ValueError(f"{where} [gpu_overrides] {key} = {o[key]!r}: give the class's bytes/s over "
                                     f"hbm_GBps, a number > 0")
                classes[mclass] = eff
        if classes:
            changes["memory_class_efficiency"] = tuple(sorted(classes.items()))
        for key, field_ in _OVERHEADS:
            if key in o:
                us = float(o[key])
                if not 0.0 <= us < float("inf"):
                    raise ValueError(f"{where} [gpu_overrides] {key} = {o[key]!r}: give microseconds >= 0")
                changes[field_] = us * _US
        changed = [k for k in o if k != "source"]
        changes["source"] = str(o.get("source", f"{gpu.source}; overridden by {where}: {', '.join(changed)}"))
        gpu = replace(gpu, **changes)
    intra = _link_from_table(f"{where} [intra]", d["intra"], base.intra) if "intra" in d else base.intra
    inter = _link_from_table(f"{where} [inter]", d["inter"], base.inter) if "inter" in d else base.inter
    pcie = float(d["pcie_GBps"]) * GB if "pcie_GBps" in d else base.pcie_Bps
    host = {f: float(d[k]) * GB for k, f in _HOST_KEYS if k in d}
    for k in (k for k, f in _HOST_KEYS if k in d and not 0 < host[f] < float("inf")):
        raise ValueError(f"{where}: {k} = {d[k]!r} must be a positive number")
    if "overlap_slowdown" in d:
        try:
            slow = float(d["overlap_slowdown"])
        except (TypeError, ValueError):
            slow = float("nan")
        if not 0.0 <= slow < float("inf"):
            raise ValueError(f"{where}: overlap_slowdown = {d['overlap_slowdown']!r} must be a fraction >= 0 (0.1: "
                             "compute runs 10% slower beside an overlapped collective)")
        host["overlap_slowdown"] = slow
        host["overlap_slowdown_source"] = str(d.get("overlap_slowdown_source", f"user TOML ({where})"))
    elif "overlap_slowdown_source" in d:
        raise ValueError(f"{where}: overlap_slowdown_source without overlap_slowdown; give both")
    if "cores_per_node" in d:
        cores = d["cores_per_node"]
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
            raise ValueError(f"{where}: cores_per_node = {cores!r} must be a whole number >= 0 (the CPU cores a "
                             "node's ranks share; 0: a device per rank)")
        host["cores_per_node"] = cores
    return replace(base, gpu=gpu, intra=intra, inter=inter, pcie_Bps=pcie, **host)


def _peaks_with(peaks: tuple[tuple[str, float], ...], table: Any, where: str) -> tuple[tuple[str, float], ...]:
    """``peaks`` with the dtypes of ``table`` ({dtype: TFLOP/s}) replaced (new ones appended)."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: peak_TFLOPs must be a table like {{ float32 = 0.05, bfloat16 = 0.03 }}")
    new: dict[str, float] = {}
    for k, v in table.items():
        key = _canonical_dtype(k)
        if key not in _PEAK_DTYPES:
            raise ValueError(f"{where}: peak_TFLOPs has unknown dtype {k!r}; allowed: {list(_PEAK_DTYPES)}")
        try:
            tflops = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: peak_TFLOPs.{k} = {v!r} is not a number") from None
        if not 0.0 < tflops < float("inf"):
            raise ValueError(f"{where}: peak_TFLOPs.{k} = {v!r} must be a positive finite TFLOP/s figure")
        new[key] = tflops * _T
    out = tuple((d, new.pop(d, f)) for d, f in peaks)
    return out + tuple(new.items())


def _read_toml(path: Union[str, Path]) -> dict[str, Any]:
    p = Path(path)
    try:
        d = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{p}: not valid TOML: {e}") from None
    except IsADirectoryError:
        raise ValueError(f"{p} is a directory; give a cluster TOML file") from None
    d.setdefault("name", p.stem)
    return d


def load_cluster(path: Union[str, Path]) -> ClusterSpec:
    """Read a cluster TOML file (format in the module docstring); name defaults to the file stem."""
    return cluster_from_dict(_read_toml(path), where=str(path))


def toml_value(x: Any) -> str:
    """A string, bool, int or float as a TOML value."""
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, str):
        return json.dumps(x)  # TOML basic strings use JSON-compatible escapes
    return repr(x)


def cluster_to_toml(c: ClusterSpec) -> str:
    """Write ``c`` in the TOML format ``load_cluster`` reads; everything is written explicitly."""
    base = get_gpu(c.gpu.name)
    lines = [f"name = {toml_value(c.name)}", f"gpu = {toml_value(c.gpu.name)}", f"nodes = {c.nodes}",
             f"gpus_per_node = {c.gpus_per_node}", f"pcie_GBps = {toml_value(c.pcie_Bps / GB)}"]
    lines += [f"{k} = {toml_value(getattr(c, f) / GB)}" for k, f in _HOST_KEYS]
    lines += [f"overlap_slowdown = {toml_value(c.overlap_slowdown)}",
              f"overlap_slowdown_source = {toml_value(c.overlap_slowdown_source)}"]
    lines += [f"cores_per_node = {c.cores_per_node}"] if c.cores_per_node else []
    lines.append("")
    for tname, link in (("intra", c.intra), ("inter", c.inter)):
        lines += [f"[{tname}]", f"name = {toml_value(link.name)}", f"busbw_GBps = {toml_value(link.busbw_Bps / GB)}",
                  f"latency_us = {toml_value(link.latency_s / _US)}",
                  f"call_latency_us = {toml_value(link.call_latency_s / _US)}", f"source = {toml_value(link.source)}"]
        if link.busbw_scale:
            lines.append("busbw_scale = { " + ", ".join(f"{k} = {toml_value(f)}" for k, f in link.busbw_scale) + " }")
        lines.append("")
    over = []
    if c.gpu.hbm_bytes != base.hbm_bytes:
        over.append(f"memory_GB = {toml_value(c.gpu.hbm_bytes / GB)}")
    if c.gpu.hbm_Bps != base.hbm_Bps:
        over.append(f"hbm_GBps = {toml_value(c.gpu.hbm_Bps / GB)}")
    for k in _EFFICIENCIES:
        if getattr(c.gpu, k) != getattr(base, k) and getattr(c.gpu, k) is not None:
            over.append(f"{k} = {toml_value(getattr(c.gpu, k))}")
    for key, field_ in _OVERHEADS:
        if getattr(c.gpu, field_) != getattr(base, field_):
            over.append(f"{key} = {toml_value(getattr(c.gpu, field_) / _US)}")
    base_classes = dict(base.memory_class_efficiency)
    for key, mclass in _CLASS_KEYS:
        eff = dict(c.gpu.memory_class_efficiency).get(mclass)
        if eff is not None and eff != base_classes.get(mclass):
            over.append(f"{key} = {toml_value(eff)}")
    if c.gpu.peak_flops != base.peak_flops:
        changed = [(d, f) for d, f in c.gpu.peak_flops if (d, f) not in base.peak_flops]
        over.append("peak_TFLOPs = { " + ", ".join(f"{d} = {toml_value(f / _T)}" for d, f in changed) + " }")
    if over or c.gpu.source != base.source:
        lines += ["[gpu_overrides]", *over, f"source = {toml_value(c.gpu.source)}", ""]
    return "\n".join(lines)
