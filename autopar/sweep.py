"""`autopar sweep`: plan models over GPU counts and write what the planner predicts as a CSV and
PNG plots (benchmark sweeps people can look at).

    autopar sweep --models gpt3-1.3b,llama3-8b --gpus 8,64,512 --gpu h100 --compare-force tp=8 --out sweep

For every (model, GPU count, config) one plan: the free plan ("free", or the ``--force`` string),
and with ``--compare-force`` the forced one too. One node holds ``gpus_per_node`` GPUs; fewer GPUs
than that are one node with that many. A config that cannot be planned (infeasible, a forced
degree that does not divide) is a row whose ``error`` says why; the sweep goes on. Rows are
appended to ``DIR/sweep.csv`` as they are planned, so ``resume=True`` continues a killed sweep: a
row already there (same model, gpus, config) is kept, not re-planned. Then ``DIR/throughput.png``
(TFLOP/s per GPU and MFU vs GPUs, degrees annotated), ``DIR/memory.png`` (per-GPU memory by
category, stacked) and ``DIR/solve_time.png``.
"""
from __future__ import annotations

import csv
import dataclasses
import os
import re
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from autopar.solver import plan_model

CSV_NAME = "sweep.csv"
PLOT_NAMES = ("throughput.png", "memory.png", "solve_time.png")
GB = 1e9


@dataclass(frozen=True)
class SweepRow:
    """One plan of a sweep (one CSV row). Plan fields are None where ``error`` says it failed."""
    model: str
    gpus: int
    nodes: int
    gpus_per_node: int
    gpu: str
    config: str                 # "free" or the forced string, e.g. "tp=8,pp=2"
    dtype: str
    global_batch: Optional[int] = None
    seq_len: Optional[int] = None
    dp: Optional[int] = None
    tp: Optional[int] = None
    pp: Optional[int] = None
    cp: Optional[int] = None    # context parallel (cp_mode: "ring" / "ulysses" / "none")
    cp_mode: Optional[str] = None
    zero: Optional[int] = None
    sp: Optional[str] = None    # "on" / "off"
    mbs: Optional[int] = None
    micro_batches: Optional[int] = None
    recompute: Optional[str] = None
    offload: Optional[str] = None
    schedule: Optional[str] = None
    virtual_stages: Optional[int] = None
    step_time_s: Optional[float] = None
    tflops_per_gpu: Optional[float] = None
    mfu: Optional[float] = None
    peak_memory_bytes: Optional[int] = None
    params_bytes: Optional[int] = None
    grads_bytes: Optional[int] = None
    optimizer_bytes: Optional[int] = None
    activations_bytes: Optional[int] = None
    other_bytes: Optional[int] = None
    memory_budget_bytes: Optional[int] = None
    solve_time_s: Optional[float] = None     # the planner's; for an error row, the time to fail
    error: str = ""

    @property
    def key(self) -> tuple[str, int, str]:
        return self.model, self.gpus, self.config

    @property
    def degrees(self) -> str:
        """"tp8 pp2 dp4" (" z3" with ZeRO), or "" for an error row."""
        if self.error or self.dp is None:
            return ""
        return (f"tp{self.tp} pp{self.pp} dp{self.dp}" + (f" cp{self.cp}" if self.cp and self.cp > 1 else "")
                + (f" z{self.zero}" if self.zero else ""))


COLUMNS = tuple(f.name for f in dataclasses.fields(SweepRow))
_KINDS = {f.name: int if "int" in f.type else float if "float" in f.type else str
          for f in dataclasses.fields(SweepRow)}


# ---- input --------------------------------------------------------------------------------------

def split_models(text: str) -> list[str]:
    """``--models``: names separated by ';' or ','. A comma-separated item of the form key=value
    (no ':' before its '=') continues the custom spec before it, so
    "gpt2,gpt:hidden=1024,layers=8,llama3-8b" is three models."""
    out: list[Optional[str]] = []
    for part in text.split(";"):
        for item in (s.strip() for s in part.split(",")):
            if not item:
                continue
            head = item.split("=", 1)[0]
            if "=" in item and ":" not in head and out and out[-1] is not None:
                out[-1] += "," + item
            else:
                out.append(item)
        out.append(None)            # a ';' ends a spec
    models = [m for m in out if m is not None]
    if not models:
        raise ValueError("--models is empty; give names from `autopar models` or specs, "
                         "e.g. gpt2;gpt:hidden=1024,layers=8")
    return list(dict.fromkeys(models))


def parse_gpus(text: str) -> list[int]:
    """``--gpus 8,64,512`` -> [8, 64, 512]; each a whole number >= 1."""
    out = []
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        if not re.fullmatch(r"\d+", item) or int(item) < 1:
            raise ValueError(f"--gpus {item!r} is not a positive whole number; give GPU counts like 8,64,512")
        out.append(int(item))
    if not out:
        raise ValueError("--gpus is empty; give GPU counts like 8,64,512")
    return list(dict.fromkeys(out))


def layout(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) for ``gpus`` GPUs: whole nodes, or one smaller node."""
    if gpus <= gpus_per_node:
        return 1, gpus
    if gpus % gpus_per_node:
        raise ValueError(f"--gpus {gpus} is not a multiple of {gpus_per_node} GPUs per node; give whole nodes "
                         f"(or at most {gpus_per_node} GPUs, one node)")
    return gpus // gpus_per_node, gpus_per_node


def config_label(force: Optional[str]) -> str:
    return re.sub(r"\s+", "", force or "") or "free"


def _csv_in(out_dir: str) -> str:
    """``out_dir``/sweep.csv, the directory made; ValueError if it cannot be made or written to."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out_dir}: cannot create the directory ({e.strerror or e})") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out_dir}: the directory is not writable; give another --out")
    return os.path.join(out_dir, CSV_NAME)


# ---- CSV ----------------------------------------------------------------------------------------

def _cell(name: str, text: str):
    if text == "" and name != "error":
        return None
    try:
        return _KINDS[name](text)
    except ValueError:
        raise ValueError(f"{CSV_NAME}: column {name} holds {text!r}, not a number; use another --out "
                         "or drop --resume") from None


def read_rows(path: str) -> list[SweepRow]:
    """The rows of a sweep CSV written by ``run_sweep`` (ValueError if it is not one)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{path} does not have the columns of an autopar sweep CSV; use another --out "
                             "or drop --resume to overwrite it")
        return [SweepRow(**{k: _cell(k, v or "") for k, v in r.items()}) for r in reader]


def _append(path: str, row: SweepRow) -> None:
    with open(path, "a", newline="") as f:
        csv.writer(f).writerow(["" if v is None else v for v in dataclasses.astuple(row)])


def row_from_plan(plan, model: str, config: str, gpus: int) -> SweepRow:
    from autopar.report import mfu

    s, m, c = plan.summary(), plan.memory, plan.cluster
    return SweepRow(
        model=model, gpus=gpus, nodes=c.nodes, gpus_per_node=c.gpus_per_node, gpu=c.gpu, config=config,
        dtype=plan.dtype, global_batch=plan.global_batch, seq_len=plan.seq_len, dp=plan.dp, tp=plan.tp,
        pp=plan.pp, cp=plan.context_parallel, cp_mode=plan.context_parallel_mode, zero=plan.zero_stage, sp="on" if plan.sequence_parallel else "off",
        mbs=plan.micro_batch_size, micro_batches=plan.num_micro_batches, recompute=plan.recompute,
        offload=plan.offload, schedule=plan.pipeline_schedule if plan.pp > 1 else "-",
        virtual_stages=plan.virtual_stages, step_time_s=s["estimated_step_time_s"],
        tflops_per_gpu=s["estimated_tflops_per_gpu"], mfu=mfu(plan), peak_memory_bytes=m.total_bytes,
        params_bytes=m.params_bytes, grads_bytes=m.grads_bytes, optimizer_bytes=m.optimizer_bytes,
        activations_bytes=m.activations_bytes, other_bytes=m.other_bytes,
        memory_budget_bytes=c.memory_budget_bytes, solve_time_s=plan.solve_time_s)


# ---- the sweep ----------------------------------------------------------------------------------

def _plan_row(graph, cluster, base: dict, force, budget: Optional[int]) -> SweepRow:
    """One plan as a row; a config that cannot be planned is a row whose error says why."""
    t0 = time.perf_counter()
    try:
        plan = plan_model(graph, cluster, global_batch=base["global_batch"], seq_len=base["seq_len"],
                          dtype=base["dtype"], memory_budget_bytes=budget, force=force)
    except (ValueError, NotImplementedError) as e:     # PlanningError, InfeasibleError, unsupported
        message = " ".join(str(e).split())
        return SweepRow(**base, solve_time_s=time.perf_counter() - t0, error=f"{type(e).__name__}: {message}")
    return row_from_plan(plan, base["model"], base["config"], base["gpus"])


@dataclass(frozen=True)
class SweepResult:
    rows: tuple[SweepRow, ...]      # this sweep's rows, in model, GPU count, config order
    planned: int                    # plans made now (the others were in the CSV already)
    reused: int
    csv_path: str
    plots: tuple[str, ...]


def run_sweep(models: Sequence[str], gpus: Sequence[int], *, out_dir: str, gpu: str = "a100-80g",
              gpus_per_node: int = 8, force: str = "", compare_force: Optional[str] = None,
              batch: Optional[int] = None, seq_len: Optional[int] = None, memory_gb: Optional[float] = None,
              resume: bool = False, console: Optional[Console] = None) -> SweepResult:
    """Plan every model at every GPU count (module docstring). Bad input (unknown model or GPU, a
    GPU count that is not whole nodes, a malformed force, an unwritable ``out_dir``) raises
    ValueError before anything is planned."""
    from autopar.cost.hardware import resolve_cluster
    from autopar.models import build_model
    from autopar.solver.forcing import parse_force
    from autopar.trace import trace_model

    if not models or not gpus or any(int(g) < 1 for g in gpus):
        raise ValueError("give at least one model and GPU counts >= 1")
    layouts = {int(g): layout(int(g), gpus_per_node) for g in gpus}
    configs = list(dict.fromkeys([config_label(force)] + ([config_label(compare_force)] if compare_force else [])))
    forces = {c: parse_force("" if c == "free" else c) for c in configs}
    gpu_spec = resolve_cluster(gpu, nodes=1, gpus_per_node=gpus_per_node).gpu
    dtype = gpu_spec.fastest_dtype()
    bundles = {m: build_model(m, batch=batch, seq_len=seq_len, device="meta") for m in models}
    csv_path = _csv_in(out_dir)
    done: dict[tuple, SweepRow] = {}
    if resume and os.path.exists(csv_path):
        for r in read_rows(csv_path):
            same_layout = layouts.get(r.gpus, (r.nodes, r.gpus_per_node)) == (r.nodes, r.gpus_per_node)
            if r.gpu != gpu_spec.name or not same_layout:
                raise ValueError(f"{csv_path} has rows for {r.gpu} with {r.gpus_per_node} GPUs per node, not "
                                 f"{gpu_spec.name} with {gpus_per_node}; use another --out or drop --resume")
            done[r.key] = r
    else:
        with open(csv_path, "w", newline="") as f:
            csv.writer(f).writerow(COLUMNS)
    budget = int(memory_gb * 1e9) if memory_gb else None
    rows: list[SweepRow] = []
    planned = 0
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console or Console(quiet=True), transient=True) as progress:
        task = progress.add_task("planning", total=len(models) * len(layouts) * len(configs))
        for model in models:
            graph, trace_error, bundle = None, "", bundles[model]
            if any((model, g, c) not in done for g in layouts for c in configs):
                progress.update(task, description=escape(f"tracing {model}"))
                try:
                    graph = trace_model(bundle.module, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                        example_target=bundle.example_target, model_name=bundle.name)
                except (ValueError, NotImplementedError) as e:
                    trace_error = f"tracing failed: {type(e).__name__}: {' '.join(str(e).split())}"
            global_batch = batch or int(bundle.example_inputs[0].shape[0])
            for g, (nodes, per_node) in layouts.items():
                for c in configs:
                    if (model, g, c) in done:
                        rows.append(done[(model, g, c)])
                        progress.advance(task)
                        continue
                    progress.update(task, description=escape(f"{model} on {g} GPUs ({c})"))
                    base = dict(model=model, gpus=g, nodes=nodes, gpus_per_node=per_node, gpu=gpu_spec.name,
                                config=c, dtype=dtype, global_batch=global_batch, seq_len=bundle.seq_len)
                    cluster = resolve_cluster(gpu, nodes=nodes, gpus_per_node=per_node)
                    row = (SweepRow(**base, error=trace_error) if trace_error
                           else _plan_row(graph, cluster, base, forces[c], budget))
                    planned += 1
                    _append(csv_path, row)
                    rows.append(row)
                    progress.advance(task)
    plots = write_plots(rows, out_dir)
    return SweepResult(rows=tuple(rows), planned=planned, reused=len(rows) - planned, csv_path=csv_path, plots=plots)


# ---- plots and table ----------------------------------------------------------------------------

def _short(model: str, n: int = 24) -> str:
    return model if len(model) <= n else model[: n - 1] + "…"


def _log2_x(ax, gpus: Sequence[int]) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(gpus))
    ax.set_xticklabels([str(g) for g in sorted(gpus)])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(True, alpha=0.3)


def _series(rows: Sequence[SweepRow], model: str, config: str, attr: str) -> list[SweepRow]:
    return sorted((r for r in rows if r.model == model and r.config == config and getattr(r, attr) is not None
                   and not r.error), key=lambda r: r.gpus)


def write_plots(rows: Sequence[SweepRow], out_dir: str) -> tuple[str, ...]:
    """The three PNGs (module docstring), drawn with matplotlib's Agg canvas (no pyplot state)."""
    from matplotlib.figure import Figure

    models = list(dict.fromkeys(r.model for r in rows))
    configs = list(dict.fromkeys(r.config for r in rows))
    gpus = sorted({r.gpus for r in rows})
    styles = {c: ("-", "o") if i == 0 else ("--", "s") for i, c in enumerate(configs)}
    colors = {m: f"C{i % 10}" for i, m in enumerate(models)}
    paths = tuple(os.path.join(out_dir, n) for n in PLOT_NAMES)

    fig = Figure(figsize=(5.5 * max(1, len(models)), 7.5))
    axes = fig.subplots(2, max(1, len(models)), squeeze=False, sharey="row")
    for j, model in enumerate(models):
        top, bottom = axes[0][j], axes[1][j]
        for i, c in enumerate(configs):
            ls, mk = styles[c]
            pts = _series(rows, model, c, "tflops_per_gpu")
            top.plot([r.gpus for r in pts], [r.tflops_per_gpu for r in pts], ls, marker=mk, label=c,
                     color=colors[model], alpha=1.0 if i == 0 else 0.7)
            for r in pts:
                top.annotate(r.degrees, (r.gpus, r.tflops_per_gpu), textcoords="offset points",
                             xytext=(0, 7 if i == 0 else -13), ha="center", fontsize=7)
            pts = _series(rows, model, c, "mfu")
            bottom.plot([r.gpus for r in pts], [100 * r.mfu for r in pts], ls, marker=mk, label=c,
                        color=colors[model], alpha=1.0 if i == 0 else 0.7)
        failed = sum(1 for r in rows if r.model == model and r.error)
        top.set_title(_short(model, 40) + (f" ({failed} failed)" if failed else ""), fontsize=10)
        top.set_ylabel("predicted TFLOP/s per GPU")
        bottom.set_ylabel("predicted MFU (%)")
        bottom.set_xlabel("GPUs")
        for ax in (top, bottom):
            _log2_x(ax, gpus)
            ax.margins(x=0.1, y=0.15)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)

    ok = [r for r in rows if not r.error and r.peak_memory_bytes is not None]
    fig = Figure(figsize=(max(6.0, 1.0 * len(ok) + 2), 5))
    ax = fig.subplots()
    bottom_gb = [0.0] * len(ok)
    for name in ("params", "grads", "optimizer", "activations", "other"):
        heights = [getattr(r, f"{name}_bytes") / GB for r in ok]
        ax.bar(range(len(ok)), heights, bottom=bottom_gb, label=name)
        bottom_gb = [b + h for b, h in zip(bottom_gb, heights)]
    budgets = {r.memory_budget_bytes / GB for r in ok if r.memory_budget_bytes}
    budget = budgets.pop() if len(budgets) == 1 else None
    if budget and max(bottom_gb) >= 0.2 * budget:        # else the bars would be too flat to read
        ax.axhline(budget, color="k", ls=":", lw=1, label="budget")
    ax.set_xticks(range(len(ok)))
    ax.set_xticklabels([f"{_short(r.model, 13)}\n{r.gpus} GPUs\n{_short(r.config, 13)}" for r in ok], fontsize=7)
    ax.set_ylabel("peak memory per GPU (GB)")
    ax.set_title("Memory per GPU by category (most loaded stage)" + ("" if ok else ": no plan succeeded")
                 + (f", budget {budget:.1f} GB" if budget else ""), fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for model in models:
        for c in configs:
            pts = _series(rows, model, c, "solve_time_s")
            ax.plot([r.gpus for r in pts], [r.solve_time_s for r in pts], styles[c][0], marker=styles[c][1],
                    color=colors[model], label=_short(model) + ("" if len(configs) == 1 else f" ({_short(c, 16)})"))
    _log2_x(ax, gpus)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("solve time (s)")
    ax.set_title("Planner solve time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    return paths


def summary_table(rows: Sequence[SweepRow]) -> Table:
    t = Table(title="Sweep: predicted per plan", title_justify="left")
    for col in ("model", "GPUs", "config", "degrees", "mbs x n", "recompute", "step (s)", "TFLOP/s/GPU",
                "MFU", "peak GB", "solve (s)"):
        t.add_column(col, justify="left" if col in ("model", "config", "degrees") else "right",
                     overflow="fold")
    for r in rows:
        head = [escape(r.model), str(r.gpus), escape(r.config)]
        if r.error:
            t.add_row(*head, f"[red]{escape(r.error)}[/red]", *[""] * 7)
            continue
        t.add_row(*head, r.degrees, f"{r.mbs} x {r.micro_batches}", r.recompute, f"{r.step_time_s:.4f}",
                  f"{r.tflops_per_gpu:.1f}", "-" if r.mfu is None else f"{100 * r.mfu:.1f}%",
                  f"{r.peak_memory_bytes / GB:.2f}", f"{r.solve_time_s:.2f}")
    return t
