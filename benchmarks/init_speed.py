"""autopar's deterministic init against plain ``torch.randn``, side by side in one run.

    python benchmarks/init_speed.py [--repeats 3]

Every rank draws its own shard of every parameter (``autopar/runtime/init.py``: counter-based,
a generator seeded per block of rows so that any shard equals the same slice of the full tensor).
Per shape: the seconds ``generate`` takes for the whole tensor and for a quarter of its rows (a
ZeRO / tensor-parallel shard) against ``torch.randn`` of as many values (the ceiling: one
generator, no seeding), and their ratio; then ``materialize`` of two GPTs (one wide, one narrow
and deep, where the rows are short) against ``torch.randn`` of their parameter count. Best of
``--repeats``; ratios, not absolute times, are the figures (this machine's speed swings).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = ((50304, 768), (4096, 4096), (1024, 256), (256, 1024))
MODELS = ("gpt:hidden=768,layers=12,heads=12,vocab=50304,seq=1024",
          "gpt:hidden=256,layers=200,heads=4,vocab=2048,seq=128")


def best_of(fn, repeats: int) -> float:
    out = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import torch

    from autopar.models import build_model
    from autopar.runtime.init import InitRule, generate, materialize

    rule = InitRule("normal", std=0.02)
    print(f"{'what':58}{'autopar s':>11}{'randn s':>10}{'ratio':>8}")
    for shape in SHAPES:
        n = shape[0] * shape[1]
        for label, ranges in (("whole", None), ("a quarter of the rows", ((shape[0] // 4, shape[0] // 2), (0, shape[1])))):
            numel = n if ranges is None else (ranges[0][1] - ranges[0][0]) * shape[1]
            ours = best_of(lambda: generate("w", rule, shape, ranges, 0), args.repeats)
            ref = best_of(lambda: torch.randn(numel), args.repeats)
            print(f"{f'generate {shape}, {label}':58}{ours:11.4f}{ref:10.4f}{ours / ref:8.2f}")
    for spec in MODELS:
        numel = sum(p.numel() for p in build_model(spec, device="meta").module.parameters())
        ours = best_of(lambda: materialize(build_model(spec, device="meta").module, seed=0), args.repeats)
        ref = best_of(lambda: torch.randn(numel), args.repeats)
        print(f"{f'materialize {spec[:40]}... ({numel / 1e6:.0f}M)':58}{ours:11.4f}{ref:10.4f}{ours / ref:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
