"""The cluster TOML ``autopar calibrate`` writes: how measured figures become the peaks, efficiencies
and link of ``autopar/cost/hardware.py``'s format (the rules are in ``autopar/calibrate.py``'s
docstring), and the ``[measured]`` table of raw figures.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autopar.calibrate_step import CLASSES, FACTOR_BOUNDS, ROWS_PER_RANK, STEPS
from autopar.cost.cluster_file import cluster_to_toml, toml_value
from autopar.cost.compute import MEMORY_CLASSES
from autopar.cost.hardware import GB, TRAINING_DTYPES, ClusterSpec, get_gpu, short_dtype

if TYPE_CHECKING:
    from autopar.calibrate import Calibration
    from autopar.calibrate_step import StepRates


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (the file's figures are not more precise)."""
    return float(f"{x:.{digits - 1}e}")


def cluster_dict(cal: Calibration, nodes: int = 1) -> dict[str, Any]:
    """The cluster TOML mapping (``cluster_file.cluster_from_dict``'s input) of ``cal``: the module
    docstring says how the measured figures map to peaks and efficiencies."""
    if nodes < 1:
        raise ValueError(f"--nodes {nodes}: need at least 1")
    base = get_gpu(cal.gpu)
    rates = {d: s.rate for d, s, _ in cal.gemm}
    where = f"{cal.device_name}, {cal.nproc} rank(s) x {cal.threads_per_rank} thread(s), torch {cal.torch_version}, {cal.date}"
    notes = []
    if cal.device_kind == "cpu":
        if not rates:
            raise ValueError("no GEMM was measured within the time budget; raise --budget-s")
        ref_peak, matmul_eff = None, 1.0
        peaks = {d: _sig(r / 1e12) for d, r in rates.items()}
        slowest = min(rates, key=rates.get)
        for d in TRAINING_DTYPES:
            if d not in peaks:
                peaks[d] = peaks[slowest]
                notes.append(f"{short_dtype(d)} not measured: priced as {short_dtype(slowest)}")
        if cal.vector_flops:
            peaks["vector"] = _sig(cal.vector_flops / 1e12)
        # (the memory-bound classes are recorded, not priced: at these shapes they run from cache,
        # up to 3x the copy's rate, where a model's smaller ops measured slower than the copy prices them)
        over = {"hbm_GBps": _sig(cal.copy_Bps / GB), "memory_efficiency": 1.0, "matmul_efficiency": matmul_eff}
        if cal.runtime_overhead is not None:
            over["op_overhead_us"] = _sig(cal.runtime_overhead[0] * 1e6)
            over["dtensor_op_overhead_us"] = _sig(cal.runtime_overhead[1] * 1e6)
        if cal.runtime_overhead_2d is not None:
            over["dtensor_2d_op_overhead_us"] = _sig(cal.runtime_overhead_2d[0] * 1e6)
        if cal.step_overhead is not None:
            over["step_overhead_us"] = _sig(cal.step_overhead * 1e6)
        if cal.ring_attention_overhead is not None:
            over["ring_attention_overhead_us"] = _sig(cal.ring_attention_overhead * 1e6)
        if cal.zero3_group_overhead is not None:
            over["zero3_group_overhead_us"] = _sig(cal.zero3_group_overhead * 1e6)
    else:
        if "bfloat16" not in rates:
            raise ValueError("no bf16 GEMM was measured within the time budget; raise --budget-s")
        ref_peak = base.peak_flops_for("bfloat16")
        matmul_eff = _sig(rates["bfloat16"] / ref_peak)
        peaks = {d: _sig(r / matmul_eff / 1e12) for d, r in rates.items()
                 if d != "bfloat16" and abs(r / base.peak_flops_for(d) / matmul_eff - 1) > 0.02}
        over = {"memory_efficiency": _sig(cal.copy_Bps / base.hbm_Bps), "matmul_efficiency": matmul_eff}
        over.update({f"{c}_memory_efficiency": _sig(min(1.0, bps / base.hbm_Bps)) for c, bps in cal.memory_classes})
    if cal.sdpa is not None:
        sdpa_peak = ref_peak if ref_peak is not None else peaks[cal.sdpa.dtype] * 1e12
        over["attention_efficiency"] = _sig(cal.sdpa.train_rate / sdpa_peak)
        if cal.sdpa.noncausal_train_rate:
            over["attention_noncausal_efficiency"] = _sig(cal.sdpa.noncausal_train_rate / sdpa_peak)
    else:
        notes.append("attention not measured: datasheet/default attention_efficiency kept")
    if cal.in_step is not None and cal.device_kind == "cpu":
        notes.append(_apply_in_step(cal.in_step, over))
    if cal.link is None:
        notes.append(f"[intra] link not measured: {cal.link_note}")
    if peaks:
        over["peak_TFLOPs"] = peaks
    over["source"] = f"measured by autopar calibrate on {where}" + "".join(f"; {n}" for n in notes)
    d: dict[str, Any] = {"name": f"calibrated-{cal.gpu}x{cal.nproc}", "gpu": cal.gpu, "nodes": nodes,
                         "gpus_per_node": cal.nproc, "gpu_overrides": over}
    if cal.device_kind == "cpu" and cal.cores:       # ranks sharing them run faster while others idle
        d["cores_per_node"] = cal.cores
    if cal.overlap is not None:
        o = cal.overlap
        d["overlap_slowdown"] = _sig(o.slowdown) if o.slowdown > 0 else 0.0
        d["overlap_slowdown_source"] = (f"measured by autopar calibrate: {o.setup}, alone {_sig(o.gemm_s)} s + "
                                        f"{_sig(o.comm_s)} s, together {_sig(o.both_s)} s ({cal.nproc} ranks)")
    if cal.link is not None:
        kinds = [p for p in cal.points if cal.link_kind == "all kinds" or p.kind == cal.link_kind]
        scale = {k: _sig(f.busbw_Bps / cal.link.busbw_Bps) for k, f in cal.fits
                 if k != cal.link_kind and 0 < f.busbw_Bps < float("inf")}
        others = ", ".join(f"{k} {f:.2g}x" for k, f in scale.items())
        d["intra"] = {"name": f"measured-{'nccl' if cal.device_kind == 'cuda' else 'gloo'}",
                      "busbw_GBps": _sig(cal.link.busbw_Bps / GB), "latency_us": _sig(cal.link.latency_s * 1e6),
                      "call_latency_us": _sig(cal.link.call_latency_s * 1e6),
                      "source": ("measured by autopar calibrate: "
                                 + ("call latency + " if cal.link.call_latency_s else "")
                                 + f"latency + busbw fitted to {cal.link_kind}"
                                 + (" in situ (each call after compute)" if any(p.back_to_back_s for p in kinds)
                                    else "")
                                 + " on "
                                 f"{' and '.join(str(n) for n in sorted({p.ranks for p in kinds}))} ranks, "
                                 f"{min(p.nbytes for p in kinds)} .. {max(p.nbytes for p in kinds)}"
                                 f" B (relative RMS error {100 * cal.link.rel_rms:.0f}%)"
                                 + (f"; the other collectives' own busbw, relative: {others} (busbw_scale)"
                                    if others else "")
                                 + f"; {where}")}
        if scale:                  # the cost model prices each kind at its own busbw
            d["intra"]["busbw_scale"] = scale
    return d


def _apply_in_step(step: StepRates, over: dict[str, Any]) -> str:
    """Fold the reference step's factors (``calibrate_step.py``) into the CPU file's efficiencies
    ``over``; returns the note for the source."""
    if step.note:
        return f"efficiencies of the microbenchmarks alone ({step.note})"
    used = []
    f = step.factor("matmul")
    if f is not None:
        over["matmul_efficiency"] = _sig(f)
        used.append("matmul")
    f = step.factor("attention")
    if f is not None and "attention_efficiency" in over:
        for k in ("attention_efficiency", "attention_noncausal_efficiency"):
            if k in over:
                over[k] = _sig(over[k] * f)
        used.append("attention")
    f = step.factor("memory")
    if f is not None:
        over.update({f"{c}_memory_efficiency": _sig(f) for c in MEMORY_CLASSES})
        used.append("memory-bound ops")
    f = step.factor("optimizer")
    if f is not None:
        over["optimizer_efficiency"] = _sig(f)
        used.append("optimizer")
    left = [c for c in CLASSES if step.factor(c) is None]
    return (f"{', '.join(used) or 'no class'} at the rate reached in a training step of {step.model} ({step.force})"
            + ("; not used: " + ", ".join(f"{c} (outside {FACTOR_BOUNDS[c]} or not measured)" for c in left)
               if left else ""))


def measured_dict(cal: Calibration, budget_s: float, wall_s: float) -> dict[str, Any]:
    """The raw figures for the file's ``[measured]`` table."""
    m: dict[str, Any] = {"device": cal.device_name, "device_kind": cal.device_kind, "torch": cal.torch_version,
                         "date": cal.date, "nproc": cal.nproc, "threads_per_rank": cal.threads_per_rank,
                         "budget_s": budget_s, "wall_s": round(wall_s, 2), "op_overhead_us": cal.overhead_s * 1e6,
                         "copy_GBps": cal.copy_Bps / GB}
    if cal.memory_classes:
        m["memory_class_GBps"] = {c: bps / GB for c, bps in cal.memory_classes}
    if cal.vector_flops:
        m["vector_GFLOPs"] = cal.vector_flops / 1e9
    if cal.runtime_overhead is not None:      # per graph node of an autopar step (calibrate_runtime.py)
        m["step_us_per_node"] = {"plain": cal.runtime_overhead[0] * 1e6, "dtensor": cal.runtime_overhead[1] * 1e6}
        m["step_us_per_node_is_slope"] = {"plain": cal.runtime_overhead_slope[0],
                                          "dtensor": cal.runtime_overhead_slope[1]}
        if cal.runtime_overhead_2d is not None:
            m["step_us_per_node"]["dtensor_2d"] = cal.runtime_overhead_2d[0] * 1e6
            m["step_us_per_node_is_slope"]["dtensor_2d"] = cal.runtime_overhead_2d[1]
    if cal.step_overhead is not None:
        m["step_overhead_us"] = cal.step_overhead * 1e6
    if cal.step_intercept is not None:
        m["step_intercept_us"] = cal.step_intercept * 1e6
    if cal.ring_attention_overhead is not None:
        m["ring_attention_overhead_us"] = cal.ring_attention_overhead * 1e6
    if cal.zero3_group_overhead is not None:
        m["zero3_group_overhead_us"] = cal.zero3_group_overhead * 1e6
    m["gemm"] = {d: {"TFLOPs": s.rate / 1e12, "mean_TFLOPs": s.mean_rate / 1e12, "shapes": s.shapes,
                     "skipped_for_time": skipped, "per_pass_TFLOPs": {k: v / 1e12 for k, v in s.per_pass},
                     "per_hidden_TFLOPs": {str(k): v / 1e12 for k, v in s.per_hidden},
                     "worst": f"{s.worst[0] / 1e12:.4g} TFLOP/s {s.worst[1]}"} for d, s, skipped in cal.gemm}
    if cal.sdpa is not None:
        m["sdpa"] = {"dtype": cal.sdpa.dtype, "shape": cal.sdpa.shape, "causal_train_TFLOPs": cal.sdpa.train_rate / 1e12,
                     "causal_fwd_TFLOPs": cal.sdpa.fwd_rate / 1e12, "bwd_over_fwd": cal.sdpa.bwd_over_fwd,
                     "flop_convention": "FULL 4*B*H*T*T*D forward, x3.5 forward+backward"}
        if cal.sdpa.noncausal_train_rate:
            m["sdpa"]["noncausal_train_TFLOPs"] = cal.sdpa.noncausal_train_rate / 1e12
    fits = dict(cal.fits)
    if cal.points:
        m["collectives"] = {}
        for k in dict.fromkeys(p.kind for p in cal.points):
            mine = [p for p in cal.points if p.kind == k]
            ranks = sorted({p.ranks for p in mine})      # all-reduces: over pairs of ranks too
            entry: dict[str, Any] = {"ranks": ranks[0] if len(ranks) == 1 else [p.ranks for p in mine],
                                     "bytes": [p.nbytes for p in mine], "seconds": [p.seconds for p in mine]}
            if any(p.back_to_back_s for p in mine):       # ``seconds`` in situ (calibrate_comm.py)
                entry["back_to_back_seconds"] = [p.back_to_back_s or p.seconds for p in mine]
            if k in fits:
                entry.update(busbw_GBps=fits[k].busbw_Bps / GB, latency_us=fits[k].latency_s * 1e6,
                             call_latency_us=fits[k].call_latency_s * 1e6, rel_rms=fits[k].rel_rms)
            m["collectives"][k] = entry
    for key, f, kind in (("link_fit", cal.link, cal.link_kind), ("all_kinds_fit", cal.joint, "all kinds")):
        if f is not None:
            m[key] = {"from": kind, "busbw_GBps": f.busbw_Bps / GB, "latency_us": f.latency_s * 1e6,
                      "call_latency_us": f.call_latency_s * 1e6, "rel_rms": f.rel_rms, "max_rel": f.max_rel,
                      "points": f.points}
    if cal.link_note:
        m["link_note"] = cal.link_note
    if cal.in_step is not None:
        st = cal.in_step
        m["in_step"] = {"model": st.model, "plan": st.force, "rows_per_rank": ROWS_PER_RANK, "steps": STEPS,
                        "measured_ms": {c: ms * 1e3 for c, ms, _ in st.classes},
                        "predicted_ms": {c: p * 1e3 for c, _, p in st.classes},
                        "factors": {c: f for c in CLASSES if (f := st.raw_factor(c)) is not None},
                        "factor_bounds": {c: list(b) for c, b in FACTOR_BOUNDS.items()}}
        if st.note:
            m["in_step"]["note"] = st.note
    if cal.overlap is not None:
        o = cal.overlap
        m["overlap"] = {"setup": o.setup, "gemm_s": o.gemm_s, "comm_s": o.comm_s, "both_s": o.both_s,
                        "slowdown": o.slowdown, "trials": o.trials,
                        "fit": "both = max(gemm, comm) + slowdown * min(gemm, comm)"}
    return m


def _toml_inline(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_inline(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_inline(x)}" for k, x in v.items()) + " }"
    return toml_value(v)


def _toml_table(name: str, table: dict[str, Any]) -> list[str]:
    """``[name]`` with the scalars and lists of ``table``, then its sub-tables as ``[name.key]`` (a
    table of sub-tables only gets no header of its own)."""
    scalars = [f"{k} = {_toml_inline(v)}" for k, v in table.items() if not isinstance(v, dict)]
    lines = [f"[{name}]", *scalars, ""] if scalars else []
    for k, v in table.items():
        if isinstance(v, dict):
            lines += _toml_table(f"{name}.{k}", v)
    return lines


def calibration_toml(cluster: ClusterSpec, measured: dict[str, Any]) -> str:
    """``cluster_to_toml(cluster)`` and a ``[measured]`` table of the raw figures."""
    return cluster_to_toml(cluster) + "\n" + "\n".join(_toml_table("measured", measured))
