"""Fuzz plan + run: random small models under random forced plans on gloo CPU ranks.

    python benchmarks/fuzz.py [--cases 32] [--world 2 4 [8]] [--seed 0] [--verbose] [--wide] [--predictions]

Each case (``tests/fuzz_models.py``: a random model of linears, norms, residuals, attention,
embeddings, convs and activations at odd sizes; a forced dp x tp x pp mesh, ZeRO stage,
recompute and micro-batch size; the free-links cluster or the running world) is planned and
trained for 3 SGD steps on the ranks and compared with one process within the tolerances of
``tests/runtime/bodies.py`` (a check over its bound is judged again against a float64 run: it
passes, noted ill-conditioned, when one fp32 process is as far from exact arithmetic). A case passes, stops with a clear error (an error autopar raises on
purpose, saying what to change), or fails (any other exception, a wrong number, a plan that is not
the forced one, an axis whose traffic contradicts the plan). Prints the figures and every distinct
clear error; exits 1 when any case failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "runtime")]


def draw_cases(n: int, world: int, seed: int, wide: bool = False) -> list:
    """``n`` distinct cases for ``world`` ranks (hypothesis examples), the same for the same seed;
    ``wide``: ``fuzz_models.forced_plans``' wider plans."""
    from hypothesis import HealthCheck, Phase, given, settings, seed as hseed

    from fuzz_models import case_repr, cases

    got: dict = {}

    @settings(max_examples=4 * n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @hseed(seed * 10 + world)
    @given(cases(world, wide=wide))
    def _draw(c):
        if len(got) < n:
            got.setdefault(case_repr(c), c)

    _draw()
    return list(got.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=32, help="cases in all, split over the world sizes")
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4], choices=[2, 4, 8],
                    help="rank counts (8: the 2.5-D and 3-D tensor meshes under --wide; slow on 2 cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="print every case and failure tracebacks")
    ap.add_argument("--wide", action="store_true",
                    help="wider plans: context parallelism, the 2-D (2.5-D, 3-D) tensor meshes, pipeline "
                         "schedules, offload")
    ap.add_argument("--predictions", action="store_true",
                    help="also compare the collectives issued with codegen/expected.py's prediction (pp=1 "
                         "cases; reported, not failures)")
    args = ap.parse_args(argv)

    from fuzz_models import case_repr
    from fuzz_runs import run_cases

    t0 = time.perf_counter()
    outcomes = []
    for i, world in enumerate(args.world):
        n = args.cases // len(args.world) + (1 if i < args.cases % len(args.world) else 0)
        cs = draw_cases(n, world, args.seed, args.wide)

        def show(o, world=world):
            if args.verbose or o.status == "fail":
                print(f"[{world} ranks] {o.line()}", flush=True)
                if args.verbose and o.detail:
                    print(o.detail, flush=True)

        outcomes += run_cases(cs, world, progress=show, check_prediction=args.predictions)
    passed = [o for o in outcomes if o.status == "pass"]
    clear = [o for o in outcomes if o.status == "clear"]
    failed = [o for o in outcomes if o.status == "fail"]
    tp_cases = [o for o in passed if o.tp_used is not None]
    print(f"cases run: {len(outcomes)}, passed: {len(passed)}, clear errors: {len(clear)}, "
          f"failures: {len(failed)} ({time.perf_counter() - t0:.0f} s)")
    ill = [o for o in passed if o.message.startswith("ill-conditioned")]
    print(f"passed with tp > 1: {len(tp_cases)}, of which tp really split tensors: "
          f"{sum(o.tp_used for o in tp_cases)}; passed over the bounds but no farther from float64 than "
          f"one fp32 process (ill-conditioned): {len(ill)}")
    if clear:
        print("clear errors:")
        for msg, n in Counter(o.message for o in clear).most_common():
            print(f"  {n} x {msg}")
    unpredicted = [o for o in passed if o.unpredicted]
    if args.predictions:
        print(f"passed but issued other collectives than codegen/expected.py predicts: {len(unpredicted)}")
        for o in unpredicted:
            print(f"  {case_repr(o.case)}\n    {o.unpredicted}")
    if failed:
        print("failures:")
        for o in failed:
            print(f"  {case_repr(o.case)}\n    {o.message}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
