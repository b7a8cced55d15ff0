"""The optimizer step an offloaded optimizer runs on the CPU (``autopar/runtime/offload.py``):
torch's AdamW per-tensor, foreach and fused, and autopar's LAMB, on one process, over a model's
worth of fp32 parameters (default 32M), timed side by side in one run (median of 5 steps after a
warm-up step). Absolute times swing with this machine's load; the ratios of one run compare.

    python benchmarks/cpu_optimizer_step.py [--params 32] [--threads N]

ZeRO-Offload reports its CPU-Adam 5-7x faster than torch's CPU Adam (reference/parallelism_facts.md
§4.1); ``autopar.optim.adamw`` (the default optimizer) takes torch's fused kernel on the CPU."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

def _time(opt, steps: int = 5) -> float:
    opt.step()                                   # the state is created
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=32, help="millions of parameters (default 32)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from autopar.optim import LAMB, adamw

    n = int(args.params * 1e6)
    rows = max(1, n // 4096)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(rows // 8 or 1, 4096, generator=gen)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    kinds = {
        "AdamW per-tensor": lambda: torch.optim.AdamW(params, lr=1e-3, foreach=False),
        "AdamW foreach": lambda: torch.optim.AdamW(params, lr=1e-3, foreach=True),
        "AdamW fused (autopar.optim.adamw)": lambda: adamw(params, lr=1e-3),
        "LAMB (autopar.optim)": lambda: LAMB(params, lr=1e-3),
    }
    times = {name: _time(make()) for name, make in kinds.items()}
    numel = sum(p.numel() for p in params)
    base = times["AdamW foreach"]
    print(f"{numel / 1e6:.1f}M fp32 parameters, {torch.get_num_threads()} threads (one run; ratios compare)")
    for name, t in times.items():
        gbps = numel * 28 / t / 1e9              # Adam's 28 B of traffic per parameter (cost/offload.py)
        print(f"  {name:36s} {t * 1e3:9.1f} ms   {base / t:6.2f}x foreach   {gbps:6.1f} GB/s at 28 B/param")
    return {"numel": numel, "seconds": times}


if __name__ == "__main__":
    main()
