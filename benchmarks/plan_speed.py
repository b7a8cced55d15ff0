"""How long planning takes, end to end (build the model on meta, trace, plan), and peak memory.

    python benchmarks/plan_speed.py                       # the two targets below, each in a fresh process
    python benchmarks/plan_speed.py --one gpt3-175b a100-80g 128 1536

Targets: gpt3-175b on 128 nodes x 8 A100-80GB (1024 GPUs), global batch 1536, seq 2048: <= 20 s;
llama3-8b on 8 nodes x 8 H100, its default batch: <= 5 s; planner memory <= 4 GB. Wall times
exclude the interpreter start but include importing torch/autopar (printed separately).
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

CASES = (
    ("gpt3-175b", "a100-80g", 128, 1536, 20.0),
    ("llama3-8b", "h100", 8, 0, 5.0),          # 0: the model's default batch
)


def one(model: str, gpu: str, nodes: int, batch: int) -> None:
    t0 = time.perf_counter()
    from autopar.cost import make_cluster
    from autopar.models import build_model
    from autopar.solver import solve
    from autopar.trace import trace_model
    t1 = time.perf_counter()
    b = build_model(model, batch=2)
    t2 = time.perf_counter()
    g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target, model_name=model)
    t3 = time.perf_counter()
    batch = batch or b.default_batch
    r = solve(g, make_cluster(gpu, nodes), global_batch=batch, seq_len=b.seq_len)
    t4 = time.perf_counter()
    p, s = r.plan, r.stats
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6     # KiB on Linux -> GB
    print(f"{model} on {nodes}x8 {gpu}, batch {batch}: total {t4 - t0:.2f} s "
          f"(import {t1 - t0:.2f}, build {t2 - t1:.2f}, trace {t3 - t2:.2f}, plan {t4 - t3:.2f}); "
          f"peak RSS {rss_gb:.2f} GB")
    print(f"  plan: tp={p.tp} pp={p.pp} dp={p.dp} sp={p.sequence_parallel} zero={p.zero_stage} "
          f"mbs={p.micro_batch_size} recompute={p.recompute}; step {p.step_time.total_s:.3f} s, "
          f"{p.summary()['estimated_tflops_per_gpu']:.0f} TFLOP/s/GPU, {p.memory.total_bytes / 1e9:.1f} GB/GPU")
    print(f"  search: {s.configs} configs, {s.pruned_memory_quick + s.pruned_memory} pruned by memory, "
          f"{s.pruned_bound} by bound, {s.evaluated} evaluated, {s.tables_built} cost tables; "
          f"ILP: {s.ilp_solves} solves ({s.ilp_constrained} memory-constrained, {s.solver}), {s.ilp_time_s:.2f} s, "
          f"largest {s.ilp_max_variables} vars / {s.ilp_max_constraints} constraints")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--one", nargs=4, metavar=("MODEL", "GPU", "NODES", "BATCH"))
    args = ap.parse_args()
    if args.one:
        m, gpu, nodes, batch = args.one
        one(m, gpu, int(nodes), int(batch))
        return
    for m, gpu, nodes, batch, target in CASES:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--one", m, gpu, str(nodes), str(batch)],
                             capture_output=True, text=True, check=True).stdout
        wall = time.perf_counter() - t0
        print(out.rstrip())
        print(f"  process wall {wall:.2f} s; target <= {target:.0f} s: {'OK' if wall <= target else 'MISSED'}")


if __name__ == "__main__":
    main()
