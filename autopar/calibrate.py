"""``autopar calibrate``: measure this machine, write a cluster TOML that ``autopar plan --cluster`` uses.

    autopar calibrate --nproc 4 --out cluster.toml
    autopar plan gpt-tiny --cluster cluster.toml

Ranks are started with ``autopar.runtime.launch.spawn_ranks`` (gloo; on a GPU machine each rank
takes GPU ``rank`` and the collectives run over an NCCL group) and measure at the same time
(``autopar/calibrate_rank.py``): per-op overhead, memory copy, GEMMs at transformer shapes per dtype
(``autopar/calibrate_bench.py``), causal and non-causal SDPA, then every collective of
``autopar.cost.collectives`` from 1 KiB up to 256 MiB, as far as the time budget allows, over all
ranks; on CPU ranks each is also timed in situ, after a block of compute as a training step issues
it, and that time is the one fitted (``calibrate_comm.time_collective_in_situ``; the back-to-back
times are kept in ``[measured]``). With 4 ranks or more (an even count) all-reduces are timed
over pairs of ranks too, every pair at once. A latency and a bus bandwidth are fitted to each
collective's times with the cost model's own formulas (``autopar/calibrate_comm.py``), and a call
latency where a kind was timed over two group sizes (the all-reduce); the file's ``[intra]`` link is the all_reduce fit
(data-parallel gradients and tensor-parallel layers use all_reduce), and the other collectives run
at their own fitted busbw relative to it (its ``busbw_scale``: gloo's reduce_scatter and all_gather
run at a fraction of its all_reduce busbw, its send/recv at a multiple; NCCL's kinds alike, about
1); every fit, and one fitted to all together, are in ``[measured]``.

What the file says, so that peak x efficiency is the MEASURED rate the cost model divides by
(``compute.op_time_s``; format in ``autopar/cost/hardware.py``):
- CPU (``gpu = "cpu"``, no datasheet): ``peak_TFLOPs`` per dtype = the measured GEMM rate (FLOP-
  weighted over all shapes and passes); ``vector`` = the measured fp32 elementwise rate;
  ``hbm_GBps`` = the measured copy rate (read + write) and ``memory_efficiency = 1.0``. Rates are
  per rank with every rank busy, one thread each, as an ``autopar run`` rank computes. A training
  dtype not measured within the budget is priced at the slowest measured one (the file's source
  says so). Then a reference GPT trains on the ranks under the profiler, and ``matmul_efficiency``,
  the attention efficiencies, every memory-bound class's efficiency and ``optimizer_efficiency``
  are the fractions of those rates its ops reached inside the step (``autopar/calibrate_step.py``;
  1.0 and the SDPA loop's where it failed). The memory-bound classes' own loop rates are recorded
  in ``[measured]``, not priced: at the GEMMs' shapes they run from cache at up to 3x the copy's
  rate. ``cores_per_node`` = the machine's cores (ranks that outnumber them run faster while
  others idle: ``solver/timing.py``, "Shared cores").
- GPU: datasheet peaks; ``matmul_efficiency`` = bf16 GEMM rate / bf16 peak; other dtypes whose
  rate differs get ``peak_TFLOPs`` = their rate / matmul_efficiency (fp32 runs as torch is set:
  TF32 only if ``torch.backends.cuda.matmul.allow_tf32``); ``memory_efficiency`` = copy / datasheet,
  ``<class>_memory_efficiency`` = each memory-bound op class's rate / datasheet.
- ``attention_efficiency`` = SDPA causal forward+backward rate / peak of its dtype (fp32 on CPU,
  bf16 on GPU), FLOPs counted FULL and x3.5, as autopar/trace and ``compute.backward_factor`` do.
- ``overlap_slowdown`` (2+ ranks): compute's slowdown beside an overlapped collective, fitted to a
  GEMM loop alone, an all-reduce loop alone and both at once (``autopar/calibrate_overlap.py``).
- ``[measured]``: the raw figures, per-collective fits, date, torch version and device (the loader
  ignores it).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import tempfile
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autopar.calibrate_file import calibration_toml, cluster_dict, measured_dict
from autopar.cost.collectives import COLLECTIVE_KINDS, SCALAR_BYTES, all_reduce_s
from autopar.cost.cluster_file import cluster_from_dict
from autopar.cost.hardware import GB, ClusterSpec, short_dtype

if TYPE_CHECKING:       # torch is imported when measuring, not for `autopar --help`
    from autopar.calibrate_bench import GemmSummary
    from autopar.calibrate_comm import CollectivePoint, LinkFit
    from autopar.calibrate_overlap import OverlapFigures
    from autopar.calibrate_step import StepRates

SIZES = tuple(1024 * 4**i for i in range(10))          # 1 KiB, 4 KiB, ..., 256 MiB

# measurement budget: with start-up, the step fits, the reference step and writing, under 2 minutes
# (4 CPU ranks here: 112 s at 80 on a slow day, where 90 took 117-122 and 75 took 109; 96-99 s at 90 on a quiet one)
DEFAULT_BUDGET_S = 80.0
DEFAULT_OUT = "cluster.toml"
CPU_SETUP = dict(dtypes=["float32", "bfloat16", "float16"], gemm_tokens=[256, 1024], gemm_hiddens=[64, 256, 1024],
                 gemm_splits=[1, 2], sdpa=dict(batch=1, seq=512, head_dim=64, heads=[2, 4, 8], dtype="float32"),
                 copy_bytes=128 << 20, copy_dtype="float32", vector_numel=1 << 20)
GPU_SETUP = dict(dtypes=["bfloat16", "float16", "float32"], gemm_tokens=[4096, 8192],
                 gemm_hiddens=[2048, 4096, 8192, 12288], gemm_splits=[1, 2, 8],
                 sdpa=dict(batch=1, seq=4096, head_dim=128, heads=[16, 32, 64], dtype="bfloat16"),
                 copy_bytes=2 << 30, copy_dtype="bfloat16", vector_numel=0)


@dataclass(frozen=True)
class SdpaFigures:
    dtype: str
    shape: str                      # "B=1 T=512 D=64 H=2,4,8"
    train_rate: float               # causal: 3.5 x FULL forward FLOPs / (fwd+bwd seconds)
    fwd_rate: float                 # causal: FULL forward FLOPs / forward seconds
    bwd_over_fwd: float             # measured backward / forward time (the model says 2.5)
    noncausal_train_rate: Optional[float]


@dataclass(frozen=True)
class Calibration:
    """Figures measured by ``measure``; rates are per rank, with every rank measuring at once."""
    device_kind: str                # "cpu" | "cuda"
    device_name: str
    gpu: str                        # autopar GPU name: "cpu", "h200", ...
    nproc: int
    threads_per_rank: int
    torch_version: str
    date: str
    gemm: tuple[tuple[str, GemmSummary, int], ...]     # (dtype, summary, shapes skipped for time)
    sdpa: Optional[SdpaFigures]
    copy_Bps: float
    vector_flops: Optional[float]   # fp32 elementwise FLOP/s (CPU only)
    overhead_s: float               # one tiny op
    points: tuple[CollectivePoint, ...]
    fits: tuple[tuple[str, LinkFit], ...]              # per collective kind
    link: Optional[LinkFit]         # the [intra] link: the all_reduce fit (else ``joint``)
    link_kind: str                  # "all_reduce" | "all kinds" | "" (no link)
    joint: Optional[LinkFit]        # one latency + busbw fitted to every collective together
    link_note: str                  # why there is no link ("" when there is one)
    measure_s: float                # wall time of ``measure``
    runtime_overhead: Optional[tuple[float, float]] = None   # (plain, DTensor) s per graph node per step (CPU)
    runtime_overhead_slope: tuple[bool, bool] = (True, True)   # measured as the slope (False: noise, upper bound)
    runtime_overhead_2d: Optional[tuple[float, bool]] = None   # (s, slope) DTensor on a dp x tp mesh (4+ ranks)
    step_overhead: Optional[float] = None    # s per autopar step beside its graph's nodes (CPU; _step_host)
    step_intercept: Optional[float] = None   # the fit's whole intercept, the loss's all-reduces in
    ring_attention_overhead: Optional[float] = None   # s per ring attention node per micro-batch (CPU)
    zero3_group_overhead: Optional[float] = None      # s per ZeRO-3 gather group per micro-batch (CPU)
    overlap: Optional[OverlapFigures] = None   # compute beside an async all-reduce (calibrate_overlap.py)
    memory_classes: tuple[tuple[str, float], ...] = ()   # (class, bytes/s) of memory-bound ops (calibrate_bench)
    in_step: Optional[StepRates] = None      # the op classes inside a training step (CPU; calibrate_step.py)
    cores: int = 0                           # CPU cores the ranks shared (CPU; 0 on GPUs)


def _setup(device_kind: str) -> dict:
    return dict(GPU_SETUP if device_kind == "cuda" else CPU_SETUP, kinds=list(COLLECTIVE_KINDS), sizes=list(SIZES))


def check_nproc(nproc: Optional[int]) -> tuple[str, int]:
    """(device kind, ranks): CUDA if available (default: every GPU), else CPU (default 2)."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        n = count if nproc is None else nproc
        if n > count:
            raise ValueError(f"--nproc {n}: only {count} GPU(s) visible here; give --nproc {count} or fewer "
                             f"(one rank per GPU)")
        from autopar.calibrate_bench import family_of

        family_of(torch.cuda.get_device_name(0))     # a GPU without a datasheet here: say so before measuring
        kind = "cuda"
    else:
        kind, n = "cpu", 2 if nproc is None else nproc
    if n < 1:
        raise ValueError(f"--nproc {n}: need at least 1 rank")
    return kind, n


def _hmean(xs: list[float]) -> float:
    """Per-rank rates combined as the rate of the whole (harmonic mean)."""
    return len(xs) / sum(1.0 / x for x in xs)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _aggregate(results: list[dict], cfg: dict, kind: str, nproc: int, start: float) -> Calibration:
    import torch

    from autopar.calibrate_bench import (GEMM_PASSES, SDPA_TRAIN_FACTOR, GemmShape, family_of, gpu_name_for,
                                         sdpa_fwd_flops, summarize_gemms)
    from autopar.calibrate_comm import CollectivePoint, fit_link
    from autopar.calibrate_overlap import overlap_figures

    gemm = []
    for dtype in cfg["dtypes"]:
        per_rank = [r["gemm"][dtype] for r in results]
        if not per_rank[0]:
            continue
        timed = [(GemmShape(*row[:3]), {p: _mean([rr[i][3 + j] for rr in per_rank]) for j, p in
                                        enumerate(GEMM_PASSES)}) for i, row in enumerate(per_rank[0])]
        gemm.append((dtype, summarize_gemms(timed), results[0]["gemm_skipped"][dtype]))
    s = cfg["sdpa"]
    sdpa = None
    if results[0]["sdpa"]:
        fl = [sdpa_fwd_flops(s["batch"], row[0], s["seq"], s["head_dim"]) for row in results[0]["sdpa"]]
        fwd = [_mean([r["sdpa"][i][1] for r in results]) for i in range(len(fl))]
        fb = [_mean([r["sdpa"][i][2] for r in results]) for i in range(len(fl))]
        nc = None
        if results[0]["sdpa_noncausal"]:
            h = results[0]["sdpa_noncausal"][0]
            nc = SDPA_TRAIN_FACTOR * sdpa_fwd_flops(s["batch"], h, s["seq"], s["head_dim"]) / _mean(
                [r["sdpa_noncausal"][1] for r in results])
        heads = ",".join(str(row[0]) for row in results[0]["sdpa"])
        sdpa = SdpaFigures(s["dtype"], f"B={s['batch']} T={s['seq']} D={s['head_dim']} H={heads}",
                           SDPA_TRAIN_FACTOR * sum(fl) / sum(fb), sum(fl) / sum(fwd),
                           (sum(fb) - sum(fwd)) / sum(fwd), nc)
    points = tuple(CollectivePoint(k, int(n), int(b), float(t), float(b2b) if b2b != t else 0.0)
                   for k, n, b, t, b2b in results[0]["collectives"])
    fits = []
    tree = kind == "cuda"                    # NCCL's all-reduces take trees (collectives.all_reduce_s)
    for k in cfg["kinds"]:
        try:
            fits.append((k, fit_link([p for p in points if p.kind == k], tree)))
        except ValueError:
            pass                        # too few sizes of this kind, or times that do not grow: no fit
    joint, note = None, "1 rank: no collectives" if nproc == 1 else ""
    if nproc > 1:
        try:
            joint = fit_link(points, tree)
        except ValueError as e:
            note = f"collectives not fitted ({e})"
    by_kind = dict(fits)
    link = by_kind.get("all_reduce", joint)
    link_kind = "all_reduce" if "all_reduce" in by_kind else "all kinds" if joint else ""
    intercept = _mean([r["runtime_overhead"]["step"] for r in results]) if "runtime_overhead" in results[0] else None
    return Calibration(
        device_kind=kind, device_name=results[0]["device_name"], gpu="cpu" if kind == "cpu" else gpu_name_for(
            family_of(results[0]["device_name"]), results[0]["total_memory"]),
        nproc=nproc, threads_per_rank=int(results[0]["threads"]), torch_version=torch.__version__,
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), gemm=tuple(gemm), sdpa=sdpa,
        copy_Bps=_hmean([r["copy_Bps"] for r in results]),
        vector_flops=_hmean([r["vector_flops"] for r in results]) if cfg["vector_numel"] else None,
        overhead_s=_mean([r["overhead_s"] for r in results]), points=points, fits=tuple(fits), link=link,
        link_kind=link_kind, joint=joint, link_note=note, measure_s=time.monotonic() - start,
        runtime_overhead=(_mean([r["runtime_overhead"]["plain"] for r in results]),
                          _mean([r["runtime_overhead"]["dtensor"] for r in results]))
        if "runtime_overhead" in results[0] else None,
        runtime_overhead_slope=tuple(all(r["runtime_overhead"][f"{k}_slope"] for r in results)
                                     for k in ("plain", "dtensor")) if "runtime_overhead" in results[0] else (True, True),
        runtime_overhead_2d=(_mean([r["runtime_overhead"]["dtensor_2d"] for r in results]),
                             all(r["runtime_overhead"]["dtensor_2d_slope"] for r in results))
        if "dtensor_2d" in results[0].get("runtime_overhead", {}) else None,
        step_overhead=_step_host(intercept, nproc, link), step_intercept=intercept,
        ring_attention_overhead=_ring_host(results, link),
        zero3_group_overhead=_zero3_host(results, by_kind, link),
        overlap=overlap_figures(results[0]["overlap"]) if "overlap" in results[0] else None,
        memory_classes=tuple((c, _hmean([r["memory_classes"][c] for r in results]))
                             for c in results[0]["memory_classes"]),
        cores=(os.cpu_count() or 1) if kind == "cpu" else 0)


def _step_host(intercept: Optional[float], nproc: int, link: Optional[LinkFit]) -> Optional[float]:
    """The step's host cost beside its nodes: ``calibrate_runtime``'s ``intercept`` (None where it
    was not measured) less the loss's one-value all-reduces over the ``nproc`` ranks
    (``calibrate_runtime.LOSS_ALL_REDUCES``, one micro-batch), which the cost model prices on the
    link (``overlap.loss_scalars_s``)."""
    from autopar.calibrate_runtime import LOSS_ALL_REDUCES

    if intercept is None or link is None:
        return intercept
    loss_s = all_reduce_s(SCALAR_BYTES, nproc, link.link("fit", ""))
    return max(0.0, intercept - LOSS_ALL_REDUCES * loss_s)


def _ring_host(results: list[dict], link: Optional[LinkFit]) -> Optional[float]:
    """The ring attention's host cost per node per micro-batch (``calibrate_runtime``), less its
    rotations' latency on the fitted link (a few KB each), which the cost model prices there
    (``context_parallel``: ``collectives.p2p_s``, a call latency and one step each)."""
    from autopar.calibrate_runtime import RING_ROTATIONS

    if "ring_attention" not in results[0].get("runtime_overhead", {}):
        return None
    ring = _mean([r["runtime_overhead"]["ring_attention"] for r in results])
    return max(0.0, ring - RING_ROTATIONS * (link.link("fit", "").latency_of(1) if link else 0.0))


def _zero3_host(results: list[dict], fits: dict, link: Optional[LinkFit]) -> Optional[float]:
    """ZeRO-3's host cost per gather group per micro-batch (``calibrate_runtime``), less its
    collectives' link latency (two all-gathers and a reduce-scatter of a few KB), which the cost
    model prices on the link."""
    from autopar.calibrate_runtime import ZERO3_COLLECTIVES

    if "zero3_group" not in results[0].get("runtime_overhead", {}):
        return None
    group = _mean([r["runtime_overhead"]["zero3_group"] for r in results])
    latency = sum(n * (fit.link("fit", "").latency_of(1) if (fit := fits.get(kind, link)) else 0.0)
                  for kind, n in ZERO3_COLLECTIVES)
    return max(0.0, group - latency)


def measure(nproc: Optional[int] = None, budget_s: float = DEFAULT_BUDGET_S, console: Optional[Console] = None,
            start: Optional[float] = None) -> Calibration:
    """Run the microbenchmarks on ``nproc`` ranks within ``budget_s`` seconds of ``start`` (a
    ``time.monotonic()``, default now); a progress bar on ``console`` if given."""
    from autopar.calibrate_rank import rank_main, total_steps
    from autopar.runtime.launch import spawn_ranks

    start = time.monotonic() if start is None else start
    if not budget_s > 0 or not math.isfinite(budget_s):
        raise ValueError(f"--budget-s {budget_s}: give a positive number of seconds")
    kind, n = check_nproc(nproc)
    with tempfile.TemporaryDirectory(prefix="autopar-calibrate-") as tmp:
        cfg = dict(_setup(kind), device=kind, start=start, budget_s=float(budget_s),
                   progress_path=os.path.join(tmp, "progress.json"))
        stop = threading.Event()
        watcher = None
        if console is not None:
            watcher = threading.Thread(target=_show_progress, args=(console, cfg["progress_path"],
                                                                    total_steps(cfg, n), n, kind, stop), daemon=True)
            watcher.start()
        try:
            results = spawn_ranks(rank_main, n, (cfg,), timeout_s=max(120.0, 2 * budget_s))
        finally:
            stop.set()
            if watcher is not None:
                watcher.join()
    cal = _aggregate(results, cfg, kind, n, start)
    if kind == "cpu":          # the classes inside a training step, priced on what was just measured
        from autopar.calibrate_step import REF_MODEL, measure_in_step

        with console.status(f"training {REF_MODEL} on {n} rank(s) under the profiler…") if console else nullcontext():
            steps = measure_in_step(cluster_from_dict(cluster_dict(cal), where="calibration"), n)
        cal = replace(cal, in_step=steps, measure_s=time.monotonic() - start)
    return cal


def _show_progress(console: Console, path: str, total: int, n: int, kind: str, stop: threading.Event) -> None:
    import json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"starting {n} {kind} rank(s)…", total=total)
        while not stop.wait(0.2):
            try:
                with open(path) as f:
                    state = json.load(f)
            except (OSError, ValueError):
                continue
            progress.update(task, completed=state["done"], description=state["label"])


# ---- the command ------------------------------------------------------------------------------

def add_parser(subparsers) -> argparse.ArgumentParser:
    """``autopar calibrate`` on an ``add_subparsers()`` object."""
    from autopar.cli import _positive_float, _positive_int

    p = subparsers.add_parser("calibrate", help="measure this machine (GEMMs, attention, memory, collectives) "
                              "-> a cluster TOML for `autopar plan --cluster`")
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="ranks to measure with (default: every GPU; 2 on a CPU machine)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"cluster TOML to write (default {DEFAULT_OUT})")
    p.add_argument("--budget-s", type=_positive_float, default=DEFAULT_BUDGET_S,
                   help=f"seconds for measuring; larger messages and shapes are left out when it runs out "
                        f"(default {DEFAULT_BUDGET_S:g})")
    p.add_argument("--nodes", type=_positive_int, default=1, help="nodes written to the file (default 1)")
    return p


def cmd_calibrate(args, console: Console) -> int:
    from autopar.runtime.launch import RankFailure

    start = time.monotonic()
    out = Path(args.out)
    if not out.parent.exists():
        raise ValueError(f"--out {out}: no such directory {out.parent}")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give a file such as {out / DEFAULT_OUT}")
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"--out {out}: not writable here; give another path")
    kind, n = check_nproc(args.nproc)
    cores = os.cpu_count() or 1
    if kind == "cpu" and n > cores:
        console.print(f"note: {n} ranks share {cores} CPU core(s); each rank's figures include that sharing, "
                      f"as a {n}-rank gloo run's would", highlight=False)
    try:
        cal = measure(n, args.budget_s, console, start=start)
    except RankFailure as e:
        console.print(f"[bold red]calibration failed:[/] {escape(e.summary())}", highlight=False)
        return 1
    cluster = cluster_from_dict(cluster_dict(cal, args.nodes), where="calibration")
    wall = time.monotonic() - start
    out.write_text(calibration_toml(cluster, measured_dict(cal, args.budget_s, wall)))
    console.print(figures_table(cal, cluster))
    console.print(f"wrote {out} in {time.monotonic() - start:.1f} s; plan with it: autopar plan MODEL --cluster {out}",
                  highlight=False, soft_wrap=True)
    return 0


def figures_table(cal: Calibration, cluster: ClusterSpec) -> Table:
    t = Table(title=escape(f"{cal.device_name}: {cal.nproc} rank(s) x {cal.threads_per_rank} thread(s), torch "
                           f"{cal.torch_version}"), title_justify="left")
    for col in ("measured", "per rank", "in the cluster file"):
        t.add_column(col, justify="left" if col == "measured" else "right")
    g = cluster.gpu
    for d, s, skipped in cal.gemm:
        t.add_row(f"GEMM {short_dtype(d)} ({s.shapes} shapes{f', {skipped} skipped' if skipped else ''})",
                  f"{s.rate / 1e12:.4g} TFLOP/s",
                  f"peak {g.peak_flops_for(d) / 1e12:.4g} x matmul_eff {g.matmul_efficiency:.3g}")
    if cal.sdpa is not None:
        t.add_row(f"SDPA causal fwd+bwd {short_dtype(cal.sdpa.dtype)} ({cal.sdpa.shape})",
                  f"{cal.sdpa.train_rate / 1e12:.4g} TFLOP/s", f"attention_eff {g.attention_efficiency:.3g}")
        if cal.sdpa.noncausal_train_rate:
            t.add_row("SDPA non-causal fwd+bwd", f"{cal.sdpa.noncausal_train_rate / 1e12:.4g} TFLOP/s",
                      f"attention_noncausal_eff {g.attention_noncausal_efficiency:.3g}")
    t.add_row("memory copy (read + write)", f"{cal.copy_Bps / GB:.4g} GB/s",
              f"{g.hbm_Bps / GB:.4g} GB/s x memory_eff {g.memory_efficiency:.3g}")
    for c, bps in cal.memory_classes:
        t.add_row(f"memory-bound: {c}", f"{bps / GB:.4g} GB/s",
                  f"{c}_memory_eff {g.memory_eff_for(c):.3g}" if dict(g.memory_class_efficiency).get(c)
                  else "(recorded)")
    if cal.vector_flops:
        t.add_row("elementwise fp32", f"{cal.vector_flops / 1e9:.4g} GFLOP/s", "peak vector")
    t.add_row("per-op overhead (1-element add)", f"{cal.overhead_s * 1e6:.3g} us", "(recorded)")
    if cal.runtime_overhead:
        how = " / ".join("slope" if ok else "noisy: whole step / node" for ok in cal.runtime_overhead_slope)
        t.add_row("autopar step, per graph node (plain / DTensor)",
                  f"{cal.runtime_overhead[0] * 1e6:.3g} / {cal.runtime_overhead[1] * 1e6:.3g} us",
                  f"op_overhead_us / dtensor_op_overhead_us ({how})")
    if cal.runtime_overhead_2d:
        s, ok = cal.runtime_overhead_2d
        t.add_row("autopar step, per graph node (DTensor on a dp x tp mesh)", f"{s * 1e6:.3g} us",
                  f"dtensor_2d_op_overhead_us ({'slope' if ok else 'noisy: whole step / node'})")
    if cal.step_overhead is not None:
        t.add_row("autopar step, beside its nodes", f"{cal.step_overhead * 1e3:.3g} ms",
                  "step_overhead_us (the intercept less the loss's all-reduces)")
    if cal.ring_attention_overhead is not None:
        t.add_row("ring attention (cp=2), per node per micro-batch", f"{cal.ring_attention_overhead * 1e6:.3g} us",
                  "ring_attention_overhead_us (less the rotations' latency)")
    if cal.zero3_group_overhead is not None:
        t.add_row("ZeRO-3, per gather group per micro-batch", f"{cal.zero3_group_overhead * 1e6:.3g} us",
                  "zero3_group_overhead_us (less its collectives' latency)")
    for k, f in cal.fits + ((("all kinds", cal.joint),) if cal.joint else ()):
        top = max(p.nbytes for p in cal.points if k == "all kinds" or p.kind == k)
        role = ("\\[intra] link" if k == cal.link_kind else
                f"{f.busbw_Bps / cal.link.busbw_Bps:.2g}x the link's busbw" if cal.link else "")
        call = f", call {f.call_latency_s * 1e6:.3g} us" if f.call_latency_s else ""
        t.add_row(f"{k} (up to {top / 2**20:.4g} MiB)",
                  f"busbw {f.busbw_Bps / GB:.3g} GB/s, lat {f.latency_s * 1e6:.3g} us{call}",
                  f"{role}, fit error {100 * f.rel_rms:.0f}% RMS")
    if cal.link is None:
        t.add_row("collectives", escape(cal.link_note), f"\\[intra] default {cluster.intra.name}")
    if cal.overlap is not None:
        o = cal.overlap
        t.add_row(escape(f"GEMM beside async all_reduce ({o.setup})"),
                  f"alone {o.gemm_s * 1e3:.3g} + {o.comm_s * 1e3:.3g} ms, together {o.both_s * 1e3:.3g} ms",
                  f"overlap_slowdown {cluster.overlap_slowdown:.3g}")
    if cal.in_step is not None:
        _in_step_rows(t, cal.in_step, g)
    return t


def _in_step_rows(t: Table, step: StepRates, g) -> None:
    """``figures_table``'s rows of the reference training step (``calibrate_step.py``)."""
    t.add_row(escape(f"a training step of {step.model}, {step.force}"),
              escape(step.note) if step.note else "profiled, a step", "(not used)" if step.note else "")
    files = {"matmul": f"matmul_eff {g.matmul_efficiency:.3g}",
             "attention": f"attention_eff {g.attention_efficiency:.3g}",
             "memory": f"<class>_memory_eff {g.memory_eff_for('elementwise'):.3g}",
             "optimizer": f"optimizer_eff {g.optimizer_efficiency:.3g}"}
    labels = {"memory": "memory-bound ops (less the runtime's copies)"}
    for c, measured, predicted in step.classes:
        f = step.raw_factor(c)
        t.add_row(f"  {labels.get(c, c)}", f"{measured * 1e3:.3g} ms, {predicted * 1e3:.3g} at the rates above",
                  files[c] if step.factor(c) is not None else
                  f"(not used: x{f:.3g})" if f is not None else "(not measured)")
