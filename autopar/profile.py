"""``autopar profile``: run a plan on N ranks under ``torch.profiler`` and put what it measured next to
what the planner predicted.

    autopar profile gpt-tiny --nproc 4 --steps 3 --cluster cluster.toml --force tp=2,dp=2 --json p.json

Each rank runs ``--warmup`` steps, ``--steps`` timed ones, then ``--steps`` profiled ones
(``runtime/profiling.py``) and writes
a Chrome/TensorBoard trace (``--trace-dir``, one file per rank; chrome://tracing or Perfetto). The
report compares:

- the step time: measured (per step, the slowest rank's wall time, averaged over the steps; ``--json``:
  ``"step_times_s"`` has each step's, to see how much they spread) against
  the plan's ``step_time.total_s`` for the cluster it was planned for (``--cluster``: a file from
  ``autopar calibrate`` makes that the machine it runs on);
- the step by category: compute and optimizer against the plan's compute + recompute and optimizer
  times, and the compute by operator class (matmul, attention, memory-bound ops, views) against
  the plan's compute split as the cost model splits the rank's work (``compute_shares``: each
  class's forward and backward time in the solver's tables, recomputed layers' forwards again;
  ``--json``: ``"by_class"``, where ``"memory_passes"`` is the predicted part of the memory-bound
  row that is the runtime's own gradient and gather copies); each collective kind's in-situ time against the
  plan's exposed time for it; the host overhead (the step's wall time less all of those: autopar's
  executor, DTensor dispatch, autograd, Python between ops) against the per-node overhead the
  cluster file gives (``autopar calibrate`` measures it; 0, not modelled, otherwise), which the
  plan's compute time includes and the compute row leaves out, a ring attention node's own
  (``ring_attention_overhead_us``, likewise), ZeRO-3's gather groups' (``zero3_group_overhead_us``,
  likewise) and the step's fixed host cost (``step_overhead_us``:
  ``StepTime.host_s``); with a pipeline, together with the plan's bubble (``PIPELINE_HOST``: a stage
  waiting for its neighbour blocks inside torch's schedule, in ``work.wait()``, which the profiler
  does not record, so its waits are measured as host time);
- every collective issued (kind, mesh axis, bytes, calls per step): the time measured inside its
  launch and the wait for it (``collectives.collective_range``: the profiler's self time of what
  runs there, mean over the ranks that issued it; on gloo a blocked rank's wait for the slowest one
  is in it; ``--json``: ``"measured_s_per_step"``) against the cost model's time for it on its link
  (``cost/collectives.py``; all of it, overlapped or not). A pipeline's sends and receives, issued
  inside torch's schedule, are counted in their kind's row of the step table only;
- per rank: step time and busy time by class (with pp > 1 each rank is a pipeline stage), and the
  peak memory of one more step, measured by category, against the plan's memory model
  (``runtime/memory_measure.py``; ``--json``: ``"memory"``).
"""
from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from typing import Optional

from autopar.runtime.world import DEFAULT_TIMEOUT_S

HOST = "host overhead (executor, dispatch, autograd)"
PIPELINE_HOST = "host overhead and pipeline waits (bubble)"

COMPUTE_CLASSES = ("matmul", "attention", "memory", "free")
CLASS_LABELS = {"matmul": "matmul", "attention": "attention", "memory": "memory-bound ops", "free": "views"}
_P2P = {"send": "p2p", "recv": "p2p"}


def _profile_rank(rank: int, world: int, model: str, plan_json: Optional[str], force, cluster: Optional[str],
                  batch: Optional[int], seq_len: Optional[int], seed: int, timeout_s: float, warmup: int,
                  steps: int, trace_dir: Optional[str], optimizer: str, dtype: Optional[str] = None) -> dict:
    import torch

    from autopar.api import autoparallelize
    from autopar.cli_run import make_optimizer
    from autopar.ir import SDPA_TARGET
    from autopar.models import build_model
    from autopar.plan import Plan
    from autopar.runtime.memory_measure import measure_step
    from autopar.runtime.profiling import profile_steps

    b = build_model(model, batch=batch, seq_len=seq_len, device="meta")
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         plan=Plan.from_json(plan_json) if plan_json else None, force=force, cluster=cluster,
                         seed=seed, timeout_s=timeout_s, model_name=model, dtype=dtype,
                         optimizer=lambda params: make_optimizer(optimizer, params))
    gen = torch.Generator().manual_seed(seed)
    rows = b.example_inputs[0].shape[0]
    batches = (b.make_batch(rows, gen) for _ in range(warmup + 2 * steps))
    trace = os.path.join(trace_dir, f"rank{rank}.trace.json") if trace_dir else None
    if pm.device.type == "cpu":
        # Kineto (torch 2.13) prints a "USDT: ... profiler_start/stop" line per rank and profile at
        # a level above its errors; on CPU ranks (no CUPTI) nothing it logs concerns the user, so
        # this rank process quiets it unless KINETO_LOG_LEVEL says otherwise
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    prof = profile_steps(pm, batches, warmup=warmup, steps=steps, trace_path=trace)
    _, memory = measure_step(pm, *b.make_batch(rows, gen))      # one more step, its peak by category
    # graph nodes this rank runs per micro-batch (its executors: all of them, or its pipeline stages')
    runs = [n for ex in pm._made for n in pm._train_graph.nodes
            if n.kind == "op" and n.outputs and (ex.part is None or n.name in ex.part)]
    ring = pm.plan.context_parallel > 1 and pm.plan.context_parallel_mode == "ring"
    m = pm.plan.num_micro_batches
    out = {"profile": prof.to_json(), "nodes": len(runs) * m,
           "ring_nodes": sum(1 for n in runs if n.target == SDPA_TARGET) * m if ring else 0,
           "memory": dataclasses.asdict(memory)}
    if rank == 0:
        out["plan"] = pm.plan.to_json()
    return out


def predicted_collective_s(plan, cluster, kind: str, axis: str, nbytes: int) -> float:
    """The cost model's time of one collective of ``kind`` on mesh ``axis`` (``cost/collectives``)."""
    from autopar.cost.collectives import COLLECTIVE_KINDS, axis_link, collective_s, stage_link
    from autopar.mesh import CONTEXT, PIPELINE
    from autopar.solver.overlap import pipeline_collective_s

    kind = _P2P.get(kind, kind)
    if axis == PIPELINE and kind in ("broadcast", "all_reduce"):   # the loss; the tied weights' gradients
        return pipeline_collective_s(kind, nbytes, plan.pp, plan.stage_mesh.size, cluster)
    if axis == PIPELINE:
        return collective_s("p2p", nbytes, 2, stage_link(cluster, plan.stage_mesh.size))
    # the cp axis is the whole mesh's; the DATA axis the graph's mesh (dp x cp ranks)
    stage = plan.mesh.drop(PIPELINE) if axis == CONTEXT else plan.stage_mesh
    if axis not in stage.axes or kind not in COLLECTIVE_KINDS:
        return float("nan")
    i = stage.axes.index(axis)
    link = axis_link(cluster, tuple(stage.shape), i)
    if axis == CONTEXT and plan.context_parallel_mode == "ring":
        return collective_s("p2p", nbytes, 2, link)   # a ring rotation: the whole buffer to the next rank
    return collective_s(kind, nbytes, stage.shape[i], link)


def compute_shares(evaluation, summary, profile, cluster, passes_apart: bool = False) -> dict[str, float]:
    """Operator class -> its share of the plan's predicted compute on its busiest pipeline rank (the
    most layers): per part the rank runs, each class's forward + backward compute in the solver's
    tables (``PartCost.by_kind``, host cost excluded) times its copies, plus the forward again for
    the layers recomputed in full, and the gradients' passes through the reducer's buffers and
    ZeRO-3's gather copies as memory-bound (``overlap.memory_pass_s``; with ``passes_apart``, under
    their own key ``"memory_passes"``, out of ``"memory"``). ``evaluation, summary, profile``: the
    plan's (``memory_predict.plan_evaluation``) on ``cluster``."""
    from autopar.solver.layer_memory import recomputed_layers
    from autopar.solver.overlap import memory_pass_s
    from autopar.solver.layer_memory import rank_parts

    ev = evaluation
    st = max(ev.stages, key=lambda s: s.layers)
    acc: dict[str, float] = defaultdict(float)
    for part, copies, _ in rank_parts(summary, st.layers, st.has_pre, st.has_post):
        for kind, (f, b) in part.by_kind.items():
            acc[kind] += copies * (f + b)
    again = recomputed_layers(ev.config, st.layers, for_memory=False)
    for kind, (f, _) in summary.parts["block"].by_kind.items():
        acc[kind] += again * f
    acc["memory_passes" if passes_apart else "memory"] += memory_pass_s(ev.config, st.param_numel, profile,
                                                                         cluster.gpu)    # as solver/timing.py
    total = sum(acc.values())
    return {k: v / total for k, v in acc.items()} if total > 0 else {}


def group_host_s(evaluation, summary, cluster) -> float:
    """Seconds per step of the host's work on ZeRO-3's gather groups (``overlap.zero3_host_s``) on
    ``compute_shares``' rank, which the plan's compute holds."""
    from autopar.solver.layer_memory import gather_group_count, rank_parts
    from autopar.solver.overlap import zero3_host_s

    st = max(evaluation.stages, key=lambda s: s.layers)
    parts = rank_parts(summary, st.layers, st.has_pre, st.has_post)
    cfg = evaluation.config
    return cfg.m * zero3_host_s(cfg, cluster.gpu, gather_group_count(summary, parts, st.has_pre or st.has_post))


def summarize(plan, cluster, profiles: list[dict], nodes: Optional[list[int]] = None,
              shares: Optional[dict] = None, ring_nodes: Optional[list[int]] = None,
              groups_host_s: float = 0.0) -> dict:
    """The measured-vs-predicted report of ``autopar profile`` as plain data (module docstring).
    ``nodes``: per rank, the graph nodes it runs per step (for the host overhead), ``ring_nodes``
    the ring attention nodes among them (their own host cost); ``shares``: ``compute_shares``
    (the compute's rows by operator class; none without it); ``groups_host_s``: ``group_host_s``."""
    steps = profiles[0]["steps"]
    slowest = [max(p["step_times_s"][i] for p in profiles) for i in range(steps)]
    measured_step = sum(slowest) / steps
    st = plan.step_time
    mean = defaultdict(float)
    for p in profiles:
        for k, v in p["by_class_s"].items():
            mean[k] += v / len(profiles)
    # the ring's rotations run as all_to_all_single on the cp group (codegen/context_attention._rotate)
    comm_pred = {("cp:all_to_all" if k == "cp:ring" else k): v for k, v in st.comm_s}
    stage = plan.stage_mesh
    per_node = cluster.gpu.node_overhead_s(plan.tp > 1, sum(1 for n in stage.shape if n > 1))
    node_host = per_node * max(nodes) if nodes else 0.0      # inside the plan's compute (solver/problem.py)
    node_host += cluster.gpu.ring_attention_overhead_s * max(ring_nodes) if ring_nodes else 0.0
    node_host += groups_host_s
    host_pred = node_host + st.host_s                          # + the step's own (solver/timing.py)
    measured_compute = sum(mean[c] for c in COMPUTE_CLASSES)
    profiled = sum(mean.values())
    compute_pred = st.compute_s + st.recompute_s - node_host
    categories = [("compute", measured_compute, compute_pred)]
    by_class = {}
    if shares is not None:
        passes = compute_pred * shares.get("memory_passes", 0.0)     # the profiler counts them with the ops
        by_class = {c: {"measured_s": mean[c], "predicted_s": compute_pred * shares.get(c, 0.0)
                        + (passes if c == "memory" else 0.0)} for c in COMPUTE_CLASSES}
        by_class["memory_passes"] = {"measured_s": None, "predicted_s": passes}
        categories += [(f"  {CLASS_LABELS[c]}", by_class[c]["measured_s"], by_class[c]["predicted_s"])
                       for c in COMPUTE_CLASSES]
    categories.append(("optimizer", mean["optimizer"], st.optimizer_s))
    kinds = sorted({k.split(":", 1)[1] for k in mean if k.startswith("collective:")}
                   | {k.split(":", 1)[-1] for k in comm_pred})
    for kind in kinds:
        pred = sum(v for k, v in comm_pred.items() if k.split(":", 1)[-1] == kind)
        categories.append((f"comm {kind}", mean.get(f"collective:{kind}", 0.0), pred))
    # host: what no aten op or collective accounts for (executor, dispatch, autograd, Python between
    # ops): the step's wall time less the profiled compute, collectives and optimizer
    other = profiled - mean["runtime"]
    if plan.pp > 1:      # a stage waiting for its neighbour blocks in torch's schedule, unprofiled: host time here
        categories.append((PIPELINE_HOST, measured_step - other, host_pred + st.bubble_s))
    else:
        categories.append((HOST, measured_step - other, host_pred if host_pred > 0 else None))
    collectives = collective_rows(plan, cluster, profiles)
    ranks = [{"rank": p["rank"], "coordinates": p["coordinates"],
              "step_time_s": sum(p["step_times_s"]) / steps,
              "compute_s": sum(p["by_class_s"].get(c, 0.0) for c in COMPUTE_CLASSES),
              "by_class_s": p["by_class_s"], "trace": p.get("trace_path")} for p in profiles]
    return {"measured_step_time_s": measured_step, "predicted_step_time_s": st.total_s,
            "step_times_s": slowest, "step_time_error": measured_step / st.total_s - 1 if st.total_s > 0 else None,
            "categories": [{"category": c, "measured_s": m, "predicted_s": p} for c, m, p in categories],
            "by_class": by_class, "optimizer": {"measured_s": mean["optimizer"], "predicted_s": st.optimizer_s},
            "collectives": collectives, "ranks": ranks, "cluster": cluster.name, "plan": plan.summary(),
            "dtype": plan.dtype}


def collective_rows(plan, cluster, profiles: list[dict]) -> list[dict]:
    """One row per collective (kind, axis, bytes) the ranks logged: calls per step (the most any
    rank issued), the cost model's time for them, and the measured: the self time inside their
    ``collective_range`` (``profiling.step_profile``), mean over the ranks that issued them (None
    where no rank's profile has these times)."""
    seen: dict = {}
    issued: dict = defaultdict(list)
    for p in profiles:
        timed = {(k, a, n): t for k, a, n, t in p.get("collective_s", ())}
        for kind, axis, nbytes, calls in p["collectives"]:
            key = (kind, axis, nbytes)
            seen[key] = max(seen.get(key, 0), calls)
            if "collective_s" in p:
                issued[key].append(timed.get(key, 0.0))
    return [{"kind": k, "axis": a, "bytes": n, "calls_per_step": c,
             "predicted_s_per_step": c * predicted_collective_s(plan, cluster, k, a, n),
             "measured_s_per_step": sum(issued[k, a, n]) / len(issued[k, a, n]) if issued[k, a, n] else None}
            for (k, a, n), c in sorted(seen.items())]


def render(report: dict, console) -> None:
    from rich.table import Table

    def s(x) -> str:
        return "-" if x is None or x != x else f"{x * 1e3:.2f} ms"

    def err(m, p) -> str:
        return "" if m is None or p is None or not p > 0 else f"{(m / p - 1) * 100:+.0f}%"

    dtype = f", {report['dtype']} compute" if report.get("dtype") else ""
    console.print(f"plan: {report['plan']} on cluster {report['cluster']}{dtype}", markup=False, highlight=False)
    t = Table(title="step, by category (per step; measured: mean over ranks of profiler self time; on GPUs, of its kernels)")
    for col in ("category", "measured", "predicted", "measured / predicted - 1"):
        t.add_column(col, justify="left" if col == "category" else "right")
    for row in report["categories"]:
        t.add_row(row["category"], s(row["measured_s"]), s(row["predicted_s"]), err(row["measured_s"], row["predicted_s"]))
    t.add_row("step (wall, slowest rank)", s(report["measured_step_time_s"]), s(report["predicted_step_time_s"]),
              err(report["measured_step_time_s"], report["predicted_step_time_s"]), style="bold")
    steps = report.get("step_times_s") or []
    if len(steps) > 1:
        t.caption = f"measured step: the mean of {len(steps)} steps, {s(min(steps))} to {s(max(steps))}"
    console.print(t)
    if report["collectives"]:
        c = Table(title="collectives issued, per step (predicted: the cost model's time on the axis' link, overlap not "
                        "subtracted; measured: profiler self time of each one's launch and wait, mean over the ranks "
                        "issuing it, which on gloo includes waiting for the slowest of them)")
        for col in ("kind", "axis", "bytes", "calls / step", "measured", "predicted", "measured / predicted - 1"):
            c.add_column(col, justify="left" if col in ("kind", "axis") else "right")
        for row in report["collectives"]:
            m, p = row.get("measured_s_per_step"), row["predicted_s_per_step"]
            c.add_row(row["kind"], row["axis"], f"{row['bytes']:,}", str(row["calls_per_step"]), s(m), s(p), err(m, p))
        console.print(c)
    r = Table(title="ranks (peak memory: one more step, measured by category; runtime/memory_measure.py)")
    for col in ("rank", "mesh coordinates", "step", "compute", "peak memory", "predicted", "error", "trace"):
        r.add_column(col, justify="left" if col in ("rank", "mesh coordinates", "trace") else "right")
    memory = {m["rank"]: m for m in report.get("memory", [])}
    for row in report["ranks"]:
        coords = ",".join(f"{k}={v}" for k, v in row["coordinates"].items())
        m = memory.get(row["rank"])
        mem = ((f"{m['measured_peak_bytes'] / 2**20:.2f} MiB", f"{m['predicted_peak_bytes'] / 2**20:.2f} MiB",
                err(m["measured_peak_bytes"], m["predicted_peak_bytes"])) if m else ("", "", ""))
        r.add_row(str(row["rank"]), coords, s(row["step_time_s"]), s(row["compute_s"]), *mem, row["trace"] or "")
    console.print(r)


def profile_command(model: str, nproc: int, steps: int, *, warmup: int = 1, cluster: Optional[str] = None,
                    plan_path: Optional[str] = None, force=None, batch: Optional[int] = None,
                    seq_len: Optional[int] = None, seed: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S,
                    optimizer: str = "adamw", json_path: Optional[str] = None,
                    trace_dir: Optional[str] = None, dtype: Optional[str] = None, console=None) -> dict:
    """``autopar profile`` (module docstring); returns the report (``summarize``). ``dtype``
    (``--dtype``): bf16/fp16 plan and run mixed precision, as ``autopar run --dtype``."""
    import json

    from autopar.cli_run import _check_trainable, check_plan_dtype
    from autopar.cost.hardware import resolve_cluster
    from autopar.plan import Plan
    from autopar.report import make_console
    from autopar.runtime.launch import spawn_ranks
    from autopar.runtime.memory_measure import compare_ranks, traced_for_prediction
    from autopar.runtime.memory_predict import plan_evaluation

    if nproc < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"profile: need --nproc >= 1, --steps >= 1 and --warmup >= 0 (got {nproc}, {steps}, {warmup})")
    if plan_path and (force or cluster):
        raise ValueError("--plan runs that plan as it is: drop --force/--cluster (or drop --plan to plan here)")
    _check_trainable(model, batch, seq_len)
    plan_json = Plan.load(plan_path).to_json() if plan_path else None
    check_plan_dtype(plan_path, plan_json, dtype)
    spec = resolve_cluster(cluster or "cpu", nodes=1, gpus_per_node=nproc)
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
    outs = spawn_ranks(_profile_rank, nproc, (model, plan_json, force, cluster, batch, seq_len, seed, timeout_s,
                                              warmup, steps, trace_dir, optimizer, dtype), timeout_s=timeout_s)
    plan = Plan.from_json(outs[0]["plan"])
    if plan_path:
        spec = resolve_cluster(plan.cluster.gpu, nodes=plan.cluster.nodes, gpus_per_node=plan.cluster.gpus_per_node)
    graph, dtype = traced_for_prediction(model, batch, seq_len)
    evaluation = plan_evaluation(plan, graph, spec)          # once: the class split and the memory
    report = summarize(plan, spec, [o["profile"] for o in outs], [o["nodes"] for o in outs],
                       compute_shares(*evaluation, spec, passes_apart=True), [o["ring_nodes"] for o in outs],
                       group_host_s(*evaluation[:2], spec))
    report["memory"] = [r.to_json() for r in compare_ranks(plan, graph, [o["memory"] for o in outs], dtype, optimizer,
                                                           evaluation=evaluation)]
    render(report, console or make_console())
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report
