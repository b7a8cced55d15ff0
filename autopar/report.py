"""Render a Plan as rich tables. Reads only the Plan, so `autopar inspect plan.json` prints exactly
what `autopar plan` printed when it wrote the file."""
from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autopar.cost.tensor_parallel import parse_tp_mode
from autopar.mesh import DATA, TENSOR_AXES, tensor_mode
from autopar.placements import Partial, Shard, format_placements
from autopar.plan import NodeStrategy, Plan, stage_rank

_FREE_TARGETS = ("getitem", "aten.view", "aten.transpose", "aten.reshape", "aten.permute", "aten.split",
                 "aten.contiguous", "aten.unsqueeze", "aten.expand", "aten._unsafe_view", "aten.t.",
                 "aten.detach", "aten.alias", "aten.slice", "aten.squeeze", "aten.flatten")

GB = 1e9


def make_console(stderr: bool = False) -> Console:
    """Piped output (logs, CI) gets a wide page instead of rich's 80-column default. ``stderr``:
    a console for errors and warnings."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty() or "COLUMNS" in os.environ:
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=140)


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:,.2f} GB"


def _target_of(key: str) -> str:
    parts = key.split("|")
    return parts[1] if len(parts) >= 2 else key


def _is_free(key: str) -> bool:
    t = _target_of(key)
    return any(t.startswith(p) for p in _FREE_TARGETS)


def _peak_flops(plan: Plan) -> float | None:
    """Dense peak FLOP/s of the plan's GPU in the plan's dtype (None for an unknown GPU)."""
    from autopar.cost.hardware import get_gpu

    try:
        return get_gpu(plan.cluster.gpu).peak_flops_for(plan.dtype)
    except (KeyError, ValueError):
        return None


def mfu(plan: Plan) -> float | None:
    """Model FLOP/s per GPU over the peak of the dtype the plan computes in."""
    peak = _peak_flops(plan)
    if not peak:
        return None
    return plan.summary()["estimated_tflops_per_gpu"] * 1e12 / peak


def throughput_line(plan: Plan) -> str:
    """"187.9 model TFLOP/s per GPU, MFU 60.2% of the 312 TFLOP/s bfloat16 peak; solved in 1.01 s"."""
    tflops = plan.summary()["estimated_tflops_per_gpu"]
    peak, m = _peak_flops(plan), mfu(plan)
    mfu_text = f", MFU {100 * m:.1f}% of the {peak / 1e12:g} TFLOP/s {plan.dtype} peak" if m is not None else ""
    return f"{tflops:.1f} model TFLOP/s per GPU{mfu_text}; solved in {plan.solve_time_s:.2f} s"


def recompute_text(plan) -> str:
    """"full", or "full: first 3 layers/rank" for a per-layer choice."""
    if plan.recompute_layers is None:      # "selective" = attention; "ops:a+b": those op classes per layer
        return "selective (attention)" if plan.recompute == "selective" else plan.recompute
    return f"{plan.recompute}: first {plan.recompute_layers} layers/rank"


def degrees_table(plan: Plan) -> Table:
    c = plan.cluster
    # plan strings (model and cluster names, mesh axes, node keys) are text, not rich markup: escaped
    t = Table(title=escape(f"{plan.model_name} on {c.nodes} x {c.gpus_per_node} {c.gpu} ({c.name}), "
                           f"global batch {plan.global_batch}" + (f", seq {plan.seq_len}" if plan.seq_len else "")
                           + f", {plan.dtype}"), title_justify="left")
    for col in ("dp", "tp", "pp", "cp", "schedule", "stages/rank", "sequence parallel", "ZeRO", "micro-batch",
                "micro-batches", "recompute", "offload", "mesh"):
        t.add_column(col, justify="right")
    mesh = plan.mesh.describe()
    schedule = plan.pipeline_schedule if plan.pp > 1 else "-"
    cp = f"{plan.context_parallel} {plan.context_parallel_mode}" if plan.context_parallel > 1 else "1"
    family = tensor_mode(plan.mesh_axes, plan.mesh_shape)          # 2-D / 2.5-D / 3-D: tp2, tp3 axes
    tp = str(plan.tp) if family == "1d" else f"{plan.tp} {family}"
    t.add_row(str(plan.dp), tp, str(plan.pp), cp, schedule, str(plan.virtual_stages),
              "on" if plan.sequence_parallel else "off",
              str(plan.zero_stage), str(plan.micro_batch_size), str(plan.num_micro_batches), recompute_text(plan),
              plan.offload, escape(mesh))
    return t


def _short_target(target: str) -> str:
    for prefix in ("aten.",):
        target = target.removeprefix(prefix)
    return target.removesuffix(".default")


def strategy_label(plan: Plan, s: NodeStrategy) -> str:
    """The strategy column: ``s.name`` names the solver's choice on the tp axis only, so where that
    is "replicate" the dp axis says what happens: a parameter stored Shard on dp is ZeRO-3 sharded,
    an activation Shard on dp is split by batch ("data"), a Partial on dp (the loss) is "partial"."""
    if "dp" not in plan.mesh_axes:
        return s.name
    on_dp = s.output[plan.mesh_axes.index("dp")]
    if isinstance(on_dp, Shard) and _target_of(s.key) == "param":
        return "ZeRO-3 shard" if s.name in ("replicate", "") else f"{s.name}, ZeRO-3 shard"
    if s.name not in ("replicate", ""):
        return s.name
    if isinstance(on_dp, Shard):
        return "data"
    return "partial" if isinstance(on_dp, Partial) else s.name


def strategies_table(plan: Plan, verbose: bool = False) -> Table:
    """One row per operator; nodes of a repeated block are shown once, in a section of their own."""
    layers = plan.stages[-1].last_layer if plan.stages else 0
    folded = f"; {DATA} holds the dp x cp ranks" if plan.context_parallel > 1 else ""
    t = Table(title=escape("Per-operator strategies (placements per mesh axis " + ",".join(plan.mesh_axes) + folded + ")"),
              title_justify="left")
    t.add_column("module")
    t.add_column("operator")
    t.add_column("strategy")
    t.add_column("inputs -> output")
    hidden = 0
    sections: dict[str, list] = {}
    for s in plan.strategies:
        if not verbose and _is_free(s.key):
            hidden += 1
            continue
        path, target = (s.key.split("|") + ["", ""])[:2]
        if "*" in path:
            block, _, rest = path.partition(".*")
            title = f"each of the {layers} layers of {block}"
            where = "*" + rest
        else:
            title, where = "outside repeated blocks", path or "(top)"
        sections.setdefault(title, []).append((where, _short_target(target), s))
    for i, (title, rows) in enumerate(sections.items()):
        if i:
            t.add_section()
        t.add_row(f"[bold]{escape(title)}[/bold]", "", "", "")
        for where, target, s in rows:
            ins = ", ".join(format_placements(p) for p in s.inputs)
            t.add_row(escape(where), escape(target), escape(strategy_label(plan, s)),
                      f"{ins} -> {format_placements(s.output)}" if ins else format_placements(s.output))
    if hidden:
        t.caption = f"{hidden} view/reshape-like operators not shown (--verbose shows them)"
    return t


def time_table(plan: Plan) -> Table:
    st = plan.step_time
    t = Table(title="Estimated step time", title_justify="left")
    t.add_column("part")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    rows = [("compute", st.compute_s), ("recompute", st.recompute_s)]
    rows += [(escape(f"exposed comm: {kind}"), s) for kind, s in st.comm_s]
    cpu = plan.offload != "none" and "optimizer" in plan.offload.split("+")
    rows += [("pipeline bubble", st.bubble_s), ("optimizer step (CPU, offloaded)" if cpu else "optimizer step",
                                                st.optimizer_s)]
    if st.host_s:
        rows.append(("host, per step (beside the nodes)", st.host_s))
    for name, sec in rows:
        t.add_row(name, f"{sec:.4f}", f"{100 * sec / st.total_s:.1f}%" if st.total_s else "-")
    t.add_row("[bold]total[/bold]", f"[bold]{st.total_s:.4f}[/bold]", "100%")
    return t   # render prints throughput_line under it: a caption would be centred and wrapped to the table


def comm_table(plan: Plan) -> Table:
    """One row per collective class of the step (``StepTime.overlap``, seconds per step): its total
    time, the compute it may hide behind, the hidden and exposed parts, the contention charged for
    the hidden part, and why. Rows whose hiding was priced upstream show their exposed part only."""
    t = Table(title="Communication (per step: how much is hidden, and why)", title_justify="left")
    t.add_column("collective")
    for col in ("total", "window", "hidden", "exposed", "contention"):
        t.add_column(col, justify="right")
    t.add_column("why")
    for o in plan.step_time.overlap:
        total = f"{o.total_s:.4f}" if o.known else f">= {o.total_s:.4f}"
        t.add_row(escape(o.key), total, f"{o.window_s:.4f}" if o.window_s else "-",
                  f"{o.hidden_s:.4f}" if o.known else "?", f"{o.exposed_s:.4f}",
                  f"{o.contention_s:.4f}" if o.contention_s else "-", escape(o.why))
    t.caption = ("seconds; step cost = exposed + contention; hidden = min(total, window) when the runtime overlaps "
                 "it; contention = overlap_slowdown x hidden (compute slowed beside the collective)")
    return t


def memory_table(plan: Plan) -> Table:
    mem = plan.memory
    t = Table(title="Peak memory per GPU (most loaded stage)", title_justify="left")
    t.add_column("category")
    t.add_column("bytes", justify="right")
    for name, b in (("parameters", mem.params_bytes), ("gradients", mem.grads_bytes),
                    ("optimizer state", mem.optimizer_bytes), ("activations", mem.activations_bytes),
                    ("other (workspace, buffers)", mem.other_bytes)):
        t.add_row(name, _gb(b))
    t.add_row("[bold]peak[/bold]", f"[bold]{_gb(mem.total_bytes)}[/bold]")
    if mem.total_bytes != mem.categories_bytes:       # they do not all peak at once
        t.add_row("[dim](the categories added)[/dim]", f"[dim]{_gb(mem.categories_bytes)}[/dim]")
    t.caption = f"budget {_gb(plan.cluster.memory_budget_bytes)}"
    c = plan.cluster
    if plan.offload != "none":       # offloaded bytes per GPU against their share of the node's
        t.add_section()
        t.add_row(escape(f"host memory (offload={plan.offload})"),
                  f"{_gb(mem.host_bytes)} of {_gb(c.host_budget_bytes)}" if c.host_budget_bytes else _gb(mem.host_bytes))
        if mem.nvme_bytes or "nvme" in plan.offload.split("+"):
            t.add_row("NVMe", f"{_gb(mem.nvme_bytes)} of {_gb(c.nvme_budget_bytes)}" if c.nvme_budget_bytes
                      else _gb(mem.nvme_bytes))
        t.caption += "; host / NVMe: per GPU, of a node's (less a reserve) shared by its GPUs"
    return t


def stages_table(plan: Plan) -> Table:
    """One row per stage, in model order: its layers and the pipeline rank that runs it."""
    t = Table(title=f"Pipeline stages ({plan.pipeline_schedule}, {plan.virtual_stages} per rank)", title_justify="left")
    for col in ("stage", "pp rank", "layers", "count", "embedding", "head", "time / micro-batch", "rank memory"):
        t.add_column(col, justify="right")
    for s in plan.stages:
        t.add_row(str(s.index), str(stage_rank(plan.pipeline_schedule, plan.pp, s.index)),
                  f"{s.first_layer}..{s.last_layer - 1}", str(s.last_layer - s.first_layer),
                  "yes" if s.has_embedding else "", "yes" if s.has_head else "",
                  f"{s.time_per_microbatch_s * 1e3:.2f} ms", _gb(s.memory_bytes))
    return t


def render(plan: Plan, console: Console | None = None, verbose: bool = False) -> None:
    console = console or make_console()
    console.print(degrees_table(plan))
    console.print(strategies_table(plan, verbose=verbose))
    if plan.pp > 1:
        console.print(stages_table(plan))
    console.print(time_table(plan))
    console.print(throughput_line(plan), highlight=False, markup=False, soft_wrap=True)
    if plan.step_time.overlap:
        console.print(comm_table(plan))
    console.print(memory_table(plan))
    if plan.forced:
        console.print("forced: " + ", ".join(f"{k}={v}" for k, v in plan.forced), markup=False)
    for note in plan.notes:
        console.print(f"note: {note}", markup=False)
    for note in forced_family_notes(plan) + idle_axis_notes(plan):
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)


def forced_family_notes(plan: Plan) -> list[str]:
    """A line where the forced ``tpmode`` names another family than the plan's: 2.5-D's d x q x q
    mesh with d = q is the 3-D mesh (``mesh.tensor_mode``), e.g. tp=8 as 2 x 2 x 2."""
    forced = dict(plan.forced).get("tensor_parallel_mode")
    mode = tensor_mode(plan.mesh_axes, plan.mesh_shape)
    if forced is None or parse_tp_mode(forced) == mode:
        return []
    shape = " x ".join(str(n) for a, n in zip(plan.mesh_axes, plan.mesh_shape) if a in TENSOR_AXES)
    return [f"tensor_parallel_mode={forced} lays tp={plan.tp} out as {shape}: with d = q that is the {mode} mesh, "
            f"which the plan reports"]


def idle_axis_notes(plan: Plan) -> list[str]:
    """A line per mesh axis of size > 1 that no node is split on (``Plan.idle_axes``)."""
    sizes = dict(zip(plan.mesh_axes, plan.mesh_shape))
    return [f"every node is replicated on the {a} axis ({a}={sizes[a]}): its ranks hold and compute the same "
            f"thing and carry no {a} traffic (legal, e.g. a forced {a} on a model too small to gain from splitting)"
            for a in plan.idle_axes()]
