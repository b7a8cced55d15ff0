"""autopar command line.

    autopar plan gpt3-175b --gpu a100-80g --nodes 128 --json plan.json
    autopar inspect plan.json
    autopar run gpt-tiny --nproc 4 --steps 3 --force tp=2,dp=2
    autopar sweep --models gpt3-1.3b,llama3-8b --gpus 8,64,512 --gpu h100 --compare-force tp=8 --out sweep
    autopar calibrate --nproc 4 --out cluster.toml
    autopar profile gpt-tiny --nproc 4 --steps 3 --cluster cluster.toml --trace-dir traces
    autopar models
"""
from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from rich.text import Text

from autopar.report import make_console

GIB = 1 << 30
GPU_CHOICES = "a100-40g, a100-80g, h100, h200, v100"   # autopar.cost.hardware.GPU_NAMES (not imported: fast --help)


def _positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a cluster of 0 nodes or 0 GPUs per node is a typo)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1; give a positive number")
    return value


def _positive_float(text: str) -> float:
    """argparse type: a number > 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give seconds > 0") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value:g} is not a positive finite number of seconds")
    return value


def _add_problem_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in name (see `autopar models`), a spec like "
                   "gpt:hidden=4096,layers=32,heads=32,vocab=50304, or path/to/file.py:fn")
    p.add_argument("--batch", type=int, default=None, help="global batch size (default: the model's)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--force", default="", help="pin choices, e.g. tp=8,pp=8,dp=1,mbs=1,recompute=full,sp=off,zero=1 or cp=4,cpmode=ring; "
                   "recompute: none, full, partial, selective (= ops:attention) or per op "
                   "ops:attention+mlp_act+norm")
    p.add_argument("--json", dest="json_path", default=None, help="write the result as JSON to this file")


RUN_DTYPE_HELP = ("compute dtype (default fp32): bf16/fp16 run mixed precision (autocast, fp32 master weights, "
                  "gradients reduced in that dtype; fp16 with a dynamic loss scale)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autopar", description="Plan and run distributed training of PyTorch models.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a model for a cluster (no GPU needed)")
    _add_problem_args(p)
    p.add_argument("--gpu", default=None, help=f"{GPU_CHOICES} (default: the --cluster's GPU, else a100-80g); "
                   "with --cluster, replaces its GPU")
    p.add_argument("--nodes", type=_positive_int, default=None,
                   help="number of nodes (default: the --cluster file's, else 1)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=None,
                   help="GPUs per node (default: the --cluster file's, else 8)")
    p.add_argument("--cluster", default=None, help="built-in cluster name or a TOML file describing your cluster; "
                   "--gpu/--nodes/--gpus-per-node given with it override it (the report says so)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"),
                   help="compute dtype (default: the GPU's fastest: bf16, or fp16 on v100)")
    p.add_argument("--memory-gb", type=float, default=None, help="memory budget per GPU in GB (default: the GPU's HBM minus a reserve)")
    p.add_argument("--host-memory-gb", type=_positive_float, default=None, metavar="G",
                   help="host RAM per node in GB that offload may use (less a reserve; default: the cluster's)")
    p.add_argument("--nvme-gb", type=_positive_float, default=None, metavar="G",
                   help="NVMe capacity per node in GB for offloaded optimizer state (default: the cluster's)")
    p.add_argument("--verbose", action="store_true", help="show every operator's strategy")

    p = sub.add_parser("inspect", help="render a plan JSON written by `autopar plan --json`")
    p.add_argument("plan_file")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--code", action="store_true", help="print each pipeline stage's generated module "
                   "(torch.fx code with the plan's placements); rebuilds the plan's model on the meta device")
    p.add_argument("--stage", type=int, default=None, metavar="K", help="with --code: only stage K")

    p = sub.add_parser("run", help="train a few steps on N CPU ranks (gloo) and compare with one process")
    _add_problem_args(p)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--plan", dest="plan_file", default=None, help="a plan JSON to run instead of planning")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=_positive_float, default=300.0, metavar="SECONDS",
                   help="how long a collective waits for another rank, and (plus 30 s) how long the run "
                   "may go without any rank finishing a step (default 300; a run that keeps stepping "
                   "is never cut short). A dead rank ends the run at once, a stuck one after 30 s "
                   "without heartbeat")
    p.add_argument("--optimizer", choices=("adamw", "lamb", "lars"), default="adamw",
                   help="AdamW, autopar.optim.LAMB or autopar.optim.LARS (per-tensor trust ratio / local "
                   "rate exact under tp and ZeRO shards)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save a checkpoint here at the end (and every --checkpoint-every steps); any plan "
                   "and world size can resume from it")
    p.add_argument("--checkpoint-every", type=_positive_int, default=None, help="also save every K steps")
    p.add_argument("--resume", action="store_true",
                   help="continue from the last checkpoint in --checkpoint-dir up to --steps (re-planned "
                   "for this world; resharded on load)")
    p.add_argument("--memory", action="store_true",
                   help="measure the last step's peak memory per rank by category (parameters, gradients, "
                   "optimizer state, activations, temporaries) next to the plan's prediction; with --json "
                   "also as \"memory\"")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"), help=RUN_DTYPE_HELP
                   + "; the reference is one process under torch.autocast (and GradScaler)")
    p.add_argument("--nvme-dir", default=None, metavar="DIR",
                   help="for a plan with an NVMe tier (offload classes nvme, nvme_params, nvme_grads, "
                   "nvme_activations, e.g. --force offload=optimizer+nvme): a directory on a fast local disk; "
                   "each rank's files are removed at the end")
    p.add_argument("--engine", default="auto", choices=("auto", "emitted", "interpreter"),
                   help="what runs the graph: the emitted fx.GraphModule per stage, the interpreter, or "
                   "(auto, default) the emitted modules where they cover the plan")
    p.add_argument("--host-step", default="auto", choices=("auto", "overlap", "sync"),
                   help="with the optimizer offloaded: its CPU step on a thread beside the next step's forward "
                   "(overlap; each parameter read waits for its chunk), before the step returns (sync), or "
                   "(auto, default) overlapped on GPUs where nothing communicates beside it")

    p = sub.add_parser("sweep", help="plan models at several GPU counts -> DIR/sweep.csv and PNG plots")
    p.add_argument("--models", required=True,
                   help="models separated by ',' or ';': built-in names (see `autopar models`), specs, "
                   "path/to/file.py:fn. A ',' followed by key=value continues a spec, so "
                   "'gpt2,gpt:hidden=1024,layers=8,llama3-8b' is three models; ';' always separates")
    p.add_argument("--gpus", required=True, help="GPU counts, e.g. 8,64,512,4096: whole nodes of "
                   "--gpus-per-node GPUs, or fewer GPUs as one node")
    p.add_argument("--gpu", default=None, help=f"{GPU_CHOICES} (default a100-80g)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--force", default="", help="pin choices for every plan (the config is then labelled "
                   "with this string instead of 'free'), e.g. zero=1")
    p.add_argument("--compare-force", default=None, help="also plan this forced config at every point and "
                   "plot it beside the other, e.g. tp=8 or Megatron's tp=8,pp=4,mbs=1")
    p.add_argument("--batch", type=_positive_int, default=None, help="global batch size (default: each model's)")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="sequence length (default: each model's)")
    p.add_argument("--memory-gb", type=_positive_float, default=None,
                   help="memory budget per GPU in GB (default: the GPU's HBM minus a reserve)")
    p.add_argument("--out", default="sweep", help="directory for sweep.csv, throughput.png, memory.png, "
                   "solve_time.png (default ./sweep)")
    p.add_argument("--resume", action="store_true", help="keep the rows already in DIR/sweep.csv (same model, "
                   "GPUs and config) and plan only the missing ones")

    p = sub.add_parser("profile", help="run a plan on N CPU ranks under torch.profiler: measured vs predicted "
                       "step time, categories, collectives; Chrome traces")
    _add_problem_args(p)
    p.add_argument("--nproc", type=_positive_int, default=2)
    p.add_argument("--steps", type=_positive_int, default=3, help="profiled steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=1, help="steps run before profiling (default 1)")
    p.add_argument("--cluster", default=None, help="cluster TOML to plan and predict with (e.g. from `autopar "
                   "calibrate`; default the built-in 'cpu' pseudo-GPU)")
    p.add_argument("--plan", dest="plan_file", default=None, help="a plan JSON to run instead of planning")
    p.add_argument("--optimizer", choices=("adamw", "lamb"), default="adamw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=_positive_float, default=300.0, metavar="SECONDS",
                   help="every collective's timeout and the launcher's progress deadline (as `autopar run`)")
    p.add_argument("--trace-dir", default=None, help="write rankR.trace.json (Chrome/Perfetto/TensorBoard) here")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"), help=RUN_DTYPE_HELP
                   + "; planned and predicted for it")

    from autopar.calibrate import add_parser as add_calibrate

    add_calibrate(sub)
    sub.add_parser("models", help="list the built-in models")
    return ap


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEFAULT_GPU = "a100-80g"     # with neither --cluster nor --gpu: one node of 8 A100 80GB


def _say(console: Console, label: str, style: str, message: str) -> None:
    """One unwrapped line; the message is plain text (its "[gpu_overrides]" is not rich markup)."""
    console.print(Text.assemble((label, style), " ", message), highlight=False, soft_wrap=True)


def _cluster(args):
    """The cluster to plan for, and a line saying what --gpu/--nodes/--gpus-per-node overrode in
    --cluster (None if nothing). Flags left out take the cluster's own values."""
    from autopar.cost.hardware import cluster_overrides, resolve_cluster

    given = dict(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=args.gpu)
    if args.cluster is None:
        return resolve_cluster(args.gpu or DEFAULT_GPU, nodes=args.nodes, gpus_per_node=args.gpus_per_node), None
    return resolve_cluster(args.cluster, **given), cluster_overrides(args.cluster, **given)


def _dtype(args, gpu, err: Console) -> str:
    """--dtype, or the GPU's fastest training dtype; a dtype the GPU only emulates is planned as
    asked (its cost is priced at the fallback rate), with a warning on stderr."""
    if args.dtype is None:
        return gpu.fastest_dtype()
    dtype = _DTYPES[args.dtype]
    warning = gpu.dtype_warning(dtype)
    if warning:
        _say(err, "warning:", "bold yellow", warning)
    return dtype


def cmd_plan(args, console: Console) -> int:
    from dataclasses import replace

    from autopar.solver.forcing import parse_force
    from autopar.models import build_model
    from autopar.report import render
    from autopar.solver import plan_model
    from autopar.trace import trace_model

    force = parse_force(args.force)
    cluster, overridden = _cluster(args)
    host = {f: g * 1e9 for f, g in (("host_memory_bytes", args.host_memory_gb), ("nvme_bytes", args.nvme_gb)) if g}
    cluster = replace(cluster, **host)       # offload's host-side budgets (cost.hardware.ClusterSpec)
    dtype = _dtype(args, cluster.gpu, make_console(stderr=True))
    t0 = time.perf_counter()
    with console.status("tracing on the meta device…"):
        bundle = build_model(args.model, batch=args.batch, seq_len=args.seq_len, device="meta")
        graph = trace_model(bundle.module, bundle.example_inputs, loss_fn=bundle.loss_fn,
                            example_target=bundle.example_target, model_name=bundle.name)
    t_trace = time.perf_counter() - t0
    budget = int(args.memory_gb * 1e9) if args.memory_gb else None
    global_batch = args.batch or int(bundle.example_inputs[0].shape[0])
    with console.status("solving…"):
        plan = plan_model(graph, cluster, global_batch=global_batch, seq_len=bundle.seq_len,
                          dtype=dtype, memory_budget_bytes=budget, force=force)
    if overridden:
        plan = replace(plan, notes=(overridden,) + plan.notes)
    render(plan, console, verbose=args.verbose)
    console.print(f"traced in {t_trace:.2f} s ({graph.param_count / 1e9:.2f} B parameters); "
                  f"total {time.perf_counter() - t0:.2f} s")
    if args.json_path:
        plan.save(args.json_path)
        console.print(f"plan written to {args.json_path}")
    return 0


def cmd_inspect(args, console: Console) -> int:
    from autopar.plan import Plan
    from autopar.report import render

    try:
        plan = Plan.load(args.plan_file)
    except FileNotFoundError:
        raise ValueError(f"no such plan file: {args.plan_file}") from None
    if args.stage is not None and not args.code:
        raise ValueError("--stage K selects a stage of --code; add --code")
    if args.code:
        from autopar.codegen.emit import emit_plan

        for header, gm in emit_plan(plan, args.stage):
            console.print(f"# {header}", highlight=False, markup=False)
            console.print(gm.code, highlight=False, markup=False, soft_wrap=True)
        return 0
    render(plan, console, verbose=args.verbose)
    return 0


def cmd_run(args, console: Console) -> int:
    from autopar.cli_run import run_command
    from autopar.runtime.launch import RankFailure

    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: need at least 1 rank")
    try:
        run_command(args.model, nproc=args.nproc, steps=args.steps, plan_path=args.plan_file,
                    force=args.force or None, json_path=args.json_path, batch=args.batch,
                    seq_len=args.seq_len, seed=args.seed, optimizer=args.optimizer, timeout_s=args.timeout,
                    checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                    resume=args.resume, memory=args.memory, dtype=args.dtype, nvme_dir=args.nvme_dir,
                    engine=args.engine, host_step=args.host_step)
    except RankFailure:
        return 1  # run_command printed every rank's first error lines
    except KeyboardInterrupt:
        _say(make_console(stderr=True), "interrupted:", "bold red", "every rank was stopped")
        return 130
    return 0


def cmd_sweep(args, console: Console) -> int:
    from autopar.sweep import parse_gpus, run_sweep, split_models, summary_table

    gpus, models = parse_gpus(args.gpus), split_models(args.models)
    result = run_sweep(models, gpus, out_dir=args.out, gpu=args.gpu or DEFAULT_GPU, gpus_per_node=args.gpus_per_node,
                       force=args.force, compare_force=args.compare_force, batch=args.batch, seq_len=args.seq_len,
                       memory_gb=args.memory_gb, resume=args.resume, console=console)
    console.print(summary_table(result.rows))
    failed = sum(1 for r in result.rows if r.error)
    console.print(f"{result.planned} planned, {result.reused} kept from {result.csv_path}"
                  + (f", {failed} could not be planned (see the error column)" if failed else "")
                  + "; plots: " + ", ".join(result.plots), markup=False, highlight=False, soft_wrap=True)
    return 0


def cmd_profile(args, console: Console) -> int:
    from autopar.profile import profile_command
    from autopar.runtime.launch import RankFailure

    try:
        profile_command(args.model, args.nproc, args.steps, warmup=args.warmup, cluster=args.cluster,
                        plan_path=args.plan_file, force=args.force or None, batch=args.batch, seq_len=args.seq_len,
                        seed=args.seed, timeout_s=args.timeout, optimizer=args.optimizer,
                        json_path=args.json_path, trace_dir=args.trace_dir, dtype=args.dtype, console=console)
    except RankFailure as e:
        _say(make_console(stderr=True), "error:", "bold red", f"autopar profile failed; every rank was stopped.\n{e.summary()}")
        return 1
    return 0


def cmd_calibrate(args, console: Console) -> int:
    from autopar.calibrate import cmd_calibrate as run

    return run(args, console)


def cmd_models(args, console: Console) -> int:
    from autopar.models import list_models

    for name in list_models():
        console.print(name)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = make_console()
    handler = {"plan": cmd_plan, "inspect": cmd_inspect, "run": cmd_run, "sweep": cmd_sweep,
               "models": cmd_models, "profile": cmd_profile, "calibrate": cmd_calibrate}[args.command]
    try:
        return handler(args, console)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        # Planning, tracing and input errors carry a message that says what to change: one line on stderr.
        _say(make_console(stderr=True), "error:", "bold red", str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
