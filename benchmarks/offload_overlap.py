"""Activation offload on one GPU: its copies on a side stream against the compute stream, measured
and predicted side by side.

    python benchmarks/offload_overlap.py                    # on a CUDA machine (the lent H200)
    python benchmarks/offload_overlap.py --dry-run          # a tiny GPT on the CPU: the plumbing only

One process, one GPU. The model is planned for ``--cluster`` (default the H200 file ``autopar
calibrate`` wrote, ``benchmarks/results/calibrate_h200.toml``) with dp = tp = pp = 1, no recompute,
``--dtype`` (bf16: torch.autocast over fp32 parameters, as ``autopar run`` trains it), and run six
ways on the same batches, one after the other:

    none            no offload
    compute stream  every saved activation copied to pinned host memory in the forward and back in
                    the backward on the compute stream (``AUTOPAR_OFFLOAD_STREAM=0``: the runtime
                    before ``runtime/copy_stream.py``)
    side stream     the same copies on a side stream, the backward prefetching saved tensors ahead
    checkpoints     full recompute with the side stream's offload: only each layer's input goes down
                    (ZeRO-Infinity's offloaded activation checkpoints), the rest is recomputed
    params, compute ZeRO-3 with the parameters and the optimizer in host memory (ZeRO-Infinity on one
                    GPU: the optimizer steps on the CPU, the same in both params ways), each
                    layer's rows copied up a group ahead on the compute stream
    params, side    the same copies on the side stream (``runtime/prefetch.py``)
    step, sync      the optimizer (and the gradients) in host memory, its CPU step taken before
                    ``pm.step`` returns (``autoparallelize(host_step="sync")``)
    step, overlap   the same step on a thread, chunk by chunk, beside the next step's forward
                    (``runtime/host_step.py``; each parameter read waits for its chunk)
    nvme, sync      the optimizer state and the gradients in files under ``--nvme-dir`` (default a
                    temporary directory), the step streaming them chunk by chunk before ``pm.step``
                    returns
    nvme, overlap   the same chunks on the step's thread beside the next step's forward

Per way: the median step time of ``--steps`` (after a warm-up step) and its ratio to "none", the
planner's predicted step and its offload rows (``host:d2h``, ``host:h2d``: exposed seconds; the
compute-stream prediction from the runtime profile without ``host_copy_overlap``), the allocator's
peak and that peak above the memory at rest (parameters, gradients and optimizer state after the
warm-up step: what the step's activations and copies add), the weight copies a step made again
from the weights instead of offloading them (``activation_offload.cast_of_resident``), the share of saved tensors the prefetch brought back, and the losses (equal in all:
the copies are exact; on a GPU within ``--rtol``). ``--profile``: what one more step sends down
(sizes, layouts, pinned or not) and each way's top ops (torch.profiler). First, the pinned copy
bandwidth down and up (1 GiB) against the cluster's ``pcie_GBps``. Exit 0 when the losses agree,
1 when they do not, 2 when it cannot run here.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CLUSTER = ROOT / "benchmarks" / "results" / "calibrate_h200.toml"
DEFAULT_SPEC = "gpt:hidden=4096,layers=4,heads=32,vocab=8192,seq=2048"
DRY_SPEC = "gpt:hidden=64,layers=2,heads=4,vocab=256,seq=32"
# (label, recompute, offload, AUTOPAR_OFFLOAD_STREAM, ZeRO stage, host_step); GROUPS: ``--groups``
GROUPS = {"activations": ("compute stream", "side stream", "checkpoints"), "params": ("params, compute", "params, side"),
          "step": ("step, sync", "step, overlap"), "nvme": ("nvme, sync", "nvme, overlap")}
WAYS = (("none", "none", "none", "1", 0, "auto"), ("compute stream", "none", "activations", "0", 0, "auto"),
        ("side stream", "none", "activations", "1", 0, "auto"), ("checkpoints", "full", "activations", "1", 0, "auto"),
        ("params, compute", "none", "optimizer+params", "0", 3, "auto"),
        ("params, side", "none", "optimizer+params", "1", 3, "auto"),
        ("step, sync", "none", "optimizer+grads", "1", 0, "sync"),
        ("step, overlap", "none", "optimizer+grads", "1", 0, "overlap"),
        ("nvme, sync", "none", "optimizer+grads+nvme+nvme_grads", "1", 0, "sync"),
        ("nvme, overlap", "none", "optimizer+grads+nvme+nvme_grads", "1", 0, "overlap"))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_bandwidth(device, nbytes: int) -> tuple[float, float]:
    """(down, up) GB/s of one pinned copy of ``nbytes`` (the best of 3)."""
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    out = []
    for dst, src in ((host, dev), (dev, host)):
        best = float("inf")
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        out.append(nbytes / best / 1e9)
    return out[0], out[1]


def run_way(b, graph, cluster, args, recompute: str, offload: str, stream: str, zero: int, host_step: str,
            device) -> dict:
    import torch

    from autopar.api import autoparallelize
    from autopar.runtime.copy_stream import STREAM_ENV
    from autopar.solver import AUTOPAR_RUNTIME, plan_model

    runtime = AUTOPAR_RUNTIME if stream == "1" else dataclasses.replace(AUTOPAR_RUNTIME, host_copy_overlap=())
    if host_step == "sync":
        runtime = dataclasses.replace(runtime, host_step_overlap=False)
    force = f"tp=1,pp=1,dp=1,zero={zero},recompute={recompute},mbs={args.batch},offload={offload}"
    plan = plan_model(graph, cluster, global_batch=args.batch, seq_len=args.seq_len, dtype=args.dtype,
                      force=force, runtime=runtime)
    os.environ[STREAM_ENV] = stream
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         plan=plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3), seed=2, timeout_s=300,
                         host_step=host_step, nvme_dir=args.nvme_dir if "nvme" in offload else None)
    gen = torch.Generator().manual_seed(1)
    batches = [b.make_batch(args.batch, gen) for _ in range(args.steps + 1)]
    losses, times, rest = [], [], 0
    for i, (x, y) in enumerate(batches):
        if i == 1 and device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            rest = torch.cuda.memory_allocated(device)      # parameters, gradients, optimizer state
        _sync(device)
        t0 = time.perf_counter()
        losses.append(pm.step(x, y))
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    act = pm.offload.activations if pm.offload is not None else None
    recast = act.recast / len(batches) if act is not None else 0      # weight copies made again, a step
    if args.profile:                    # one more step under torch.profiler: where the time goes
        from torch.profiler import ProfilerActivity, profile

        act = pm.offload.activations if pm.offload is not None else None
        if act is not None:             # what goes down: sizes, layouts, pinned or not
            seen, to_host = [], act.to_host

            def spy(local):
                host = to_host(local)
                whole = local.untyped_storage().nbytes() == local.nbytes       # not a view of a larger one
                seen.append((local.nbytes, tuple(local.shape), local.stride(), str(local.dtype), whole,
                             host.is_pinned(), host.nbytes))
                return host

            act.to_host = spy
            pm.step(*batches[-1])
            act.to_host = to_host
            print(f"--- saved tensors sent down in one step: {len(seen)}, {sum(x[0] for x in seen) / 1e9:.2f} GB "
                  f"(host copies {sum(x[6] for x in seen) / 1e9:.2f} GB); a view of a larger storage: "
                  f"{sum(not x[4] for x in seen)}; host copy not pinned: {sum(not x[5] for x in seen)}; largest:")
            for x in sorted(seen, reverse=True)[:8]:
                print("   ", x)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            pm.step(*batches[-1])
            _sync(device)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"--- recompute {recompute}, offload {offload}, side stream {stream}: top ops by {key}, "
              "then by self CPU time")
        print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=50))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    act = pm.offload.activations if pm.offload is not None else None
    served = act.prefetched / act.unpacked if act is not None and act.unpacked else 0.0
    pm.close()
    comm = dict(plan.step_time.comm_s)
    return dict(step_s=statistics.median(times), predicted_s=plan.step_time.total_s,
                d2h_s=comm.get("host:d2h", 0.0), h2d_s=comm.get("host:h2d", 0.0), peak=peak, rest=rest, served=served, recast=recast,
                losses=losses)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default=None, help=f"model spec (default {DEFAULT_SPEC})")
    ap.add_argument("--seq-len", type=int, default=None, help="default 2048 (dry run 32)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--cluster", default=str(DEFAULT_CLUSTER))
    ap.add_argument("--dry-run", action="store_true", help="a tiny GPT on the CPU (plumbing only)")
    ap.add_argument("--nvme-dir", default=None, help="the nvme ways' files (default: a temporary directory)")
    ap.add_argument("--groups", default=",".join(GROUPS),
                    help=f"which ways beside 'none', comma-separated: {', '.join(GROUPS)} (default all)")
    ap.add_argument("--profile", action="store_true", help="print each way's top ops of one more step (torch.profiler)")
    ap.add_argument("--rtol", type=float, default=1e-3,
                    help="losses' relative agreement (default 1e-3: a GPU's atomic-add kernels, the embedding's "
                         "backward among them, do not sum in a fixed order, so even two runs without offload differ "
                         "in bf16 by ~1e-5 after a step)")
    args = ap.parse_args(argv)
    groups = [g for g in args.groups.split(",") if g]
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        ap.error(f"--groups {','.join(bad)}: choose from {', '.join(GROUPS)}")
    if "nvme" in groups and args.nvme_dir is None:    # the store's own directory inside is removed at the end
        args.nvme_dir = tempfile.mkdtemp(prefix="autopar-offload-overlap-")
    wanted = {"none"} | {label for g in groups for label in GROUPS[g]}

    import torch

    from autopar.cost.cluster_file import load_cluster
    from autopar.models import build_model
    from autopar.trace import trace_model

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run here, or on a GPU (benchmarks/gpu_check.sh)")
        return 2
    device = torch.device("cuda" if not args.dry_run else "cpu")
    spec = args.spec or (DRY_SPEC if args.dry_run else DEFAULT_SPEC)
    args.seq_len = args.seq_len or (32 if args.dry_run else 2048)
    cluster = load_cluster(args.cluster)
    down, up = pinned_bandwidth(device, 2**20 if args.dry_run else 2**30)
    print(f"{spec}, seq {args.seq_len}, batch {args.batch}, {args.dtype}, {args.steps} timed steps, "
          f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    print(f"pinned copies: down {down:.1f} GB/s, up {up:.1f} GB/s (the cluster file says {cluster.pcie_Bps / 1e9:.1f})")
    b = build_model(spec, batch=args.batch, seq_len=args.seq_len, device="meta")
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                        model_name=spec)
    rows = {label: run_way(b, graph, cluster, args, *way, device) for label, *way in WAYS if label in wanted}
    base = rows["none"]
    print(f"{'':16}{'step ms':>9}{'x none':>8}{'predicted':>11}{'x none':>8}{'d2h+h2d pred':>14}"
          f"{'peak MiB':>10}{'above rest':>12}{'prefetched':>12}{'recast':>8}")
    for label, r in rows.items():
        print(f"{label:16}{r['step_s'] * 1e3:9.1f}{r['step_s'] / base['step_s']:8.2f}{r['predicted_s'] * 1e3:11.2f}"
              f"{r['predicted_s'] / base['predicted_s']:8.2f}{(r['d2h_s'] + r['h2d_s']) * 1e3:14.2f}"
              f"{r['peak'] / 2**20:10.0f}{(r['peak'] - r['rest']) / 2**20:12.0f}{r['served']:12.0%}{r['recast']:8.0f}")
    for side, compute in (("side stream", "compute stream"), ("params, side", "params, compute"),
                          ("step, overlap", "step, sync"), ("nvme, overlap", "nvme, sync")):
        if side not in rows:
            continue
        s_, c_ = rows[side], rows[compute]
        print(f"{side} / {compute}: measured {s_['step_s'] / c_['step_s']:.2f}, "
              f"predicted {s_['predicted_s'] / c_['predicted_s']:.2f}")
    worst = max(abs(a - b) / abs(b) for r in rows.values() for a, b in zip(r["losses"], base["losses"]))
    same = worst <= args.rtol
    print(f"losses: largest relative difference from 'none' {worst:.1e} "
          + ("(within" if same else "(OUTSIDE") + f" --rtol {args.rtol:g})")
    if not same:
        print(repr({k: r["losses"] for k, r in rows.items()}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
