"""Predicted vs measured step time and peak memory on this machine, five plan families side by side.

    python benchmarks/prediction_accuracy.py [--cluster FILE.toml | --recalibrate] [--nproc 4] [--steps 5] [--rounds 3]
                                             [--model SPEC]

(``--nproc 2`` runs the same families on 2 ranks: dp=2, tp=2, pp=2, ZeRO-3 over dp=2, cp=2.)

Without ``--cluster`` it first runs ``autopar calibrate --nproc N`` (100-120 s on 4 ranks here) and plans
with the file it writes, so the predictions are for this machine. Then a CPU-sized GPT
(``MODEL``, or ``--model``) is profiled (``autopar profile``) under five forced plan families: data parallel,
tensor x data parallel, pipeline x data parallel, ZeRO-3, and ring context x data parallel. Prints, per family, the step time
(measured: per step the slowest rank's wall time, mean over ``--steps``) and the peak memory (the
largest rank's, measured by category) next to the predictions, and the ratios. Goals from issue
12: step time within 25%, peak memory within 10%. Figures swing with the machine's load: run it
on a quiet machine, and calibrate under the same load it runs under.

``--rounds R`` profiles every family R times, the families taking turns (a slow spell of a shared
machine then lands on all of them, not on one family's only run). The table shows each family's
median round (its measured step and peak memory; the predictions do not change between rounds)
and the range of the step-time ratio over the rounds; the worst figures are the medians'.

``--recalibrate`` runs ``autopar calibrate`` again before every round, each round's predictions
from its own calibration (about 3.5 minutes a round on 4 ranks): the ratio's range then holds the
calibrations' spread too, and the table shows the median prediction and the median ratio.

"vs dp" is each family's ratio over the dp family's at the same time (median over the rounds): a
shared machine drifts between the calibration and the profiles, and a spell that runs 20% slow runs
so for every family (thirty-third session: dp=4 and cp x dp alternated four times measured 1.11-1.35
and 1.07-1.37 of their predictions, their ratio to each other 0.95-1.13). Each round opens with the
dp family and closes with it once more (not counted in its row), and a family's reference is the dp
ratio interpolated, by the time it was profiled at, between the two: a machine that slows down
through a round (one run's rounds: 0.94-1.10, then 1.04-1.30, then 1.16-1.41, later families
slower) slows the reference with it. What is left is the step model's error on one plan family
against another, which is what ranks the plans a search compares.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = "gpt:hidden=256,layers=4,heads=4,vocab=2048,seq=128"
BATCH = 8
FAMILIES = {"dp": "dp={n}", "tp x dp": "tp=2,dp={h}", "pp x dp": "pp=2,dp={h},mbs=2", "dp ZeRO-3": "dp={n},zero=3",
            "cp x dp": "cp=2,cpmode=ring,dp={h}"}      # on n ranks (h = n / 2)


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    from autopar.profile import profile_command
    from autopar.report import make_console

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default=None, help="a cluster TOML from `autopar calibrate` (default: calibrate now)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="profile every family this many times, in turns (default 3)")
    ap.add_argument("--model", default=MODEL, help=f"a model spec with a sequence divisible by 4 (default {MODEL})")
    ap.add_argument("--families", default=",".join(FAMILIES), help="which of: " + ", ".join(FAMILIES))
    ap.add_argument("--recalibrate", action="store_true", help="calibrate again before every round")
    args = ap.parse_args()
    if args.recalibrate and args.cluster:
        ap.error("--recalibrate calibrates before every round: drop --cluster")
    if args.nproc < 2 or args.nproc % 2:
        ap.error(f"--nproc {args.nproc}: give an even number of ranks (each family splits one axis in two)")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give 1 or more")
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        ap.error(f"--families {args.families!r}: choose among {', '.join(FAMILIES)}")
    if "dp" in names:                   # the reference opens every round (and closes it: ``summarize``)
        names = ["dp"] + [n for n in names if n != "dp"]
    console = make_console()
    cluster = args.cluster
    runs: dict = {name: [] for name in names}
    closing: list = []
    start = time.monotonic()
    with open(os.devnull, "w") as devnull:
        quiet = Console(file=devnull)

        def profile(name: str, label: str) -> tuple:
            force = FAMILIES[name].format(n=args.nproc, h=args.nproc // 2)
            rep = profile_command(args.model, args.nproc, args.steps, warmup=1, cluster=cluster, force=force,
                                  batch=BATCH, console=quiet)
            top = max(rep["memory"], key=lambda m: m["measured_peak_bytes"])
            console.print(f"{label}: {rep['measured_step_time_s'] * 1e3:.0f} ms measured, "
                          f"{rep['predicted_step_time_s'] * 1e3:.0f} ms predicted")
            return (rep["measured_step_time_s"], rep["predicted_step_time_s"], top["measured_peak_bytes"],
                    top["predicted_peak_bytes"], time.monotonic() - start)

        for r in range(args.rounds):
            if cluster is None or args.recalibrate:
                cluster = _calibrate(args.nproc)
                if cluster is None:
                    return 1
            for name in names:
                runs[name].append(profile(name, f"round {r + 1}/{args.rounds} {name}"))
            if "dp" in names and len(names) > 1:
                closing.append(profile("dp", f"round {r + 1}/{args.rounds} dp again (the reference)"))
    where = "a calibration per round" if args.recalibrate else f"cluster {cluster}"
    rows, worst = summarize(runs, closing or None)
    t = Table(title=f"{args.model}, batch {BATCH}, {args.nproc} CPU ranks, {where}, median of {args.rounds} round(s)")
    for col in ("family", "plan", "step measured", "step predicted", "ratio", "ratio range", "vs dp",
                "peak measured", "peak predicted", "ratio"):
        t.add_column(col, justify="left" if col in ("family", "plan") else "right")
    for row in rows:
        t.add_row(row["family"], FAMILIES[row["family"]].format(n=args.nproc, h=args.nproc // 2),
                  f"{row['measured_s'] * 1e3:.0f} ms", f"{row['predicted_s'] * 1e3:.0f} ms", f"{row['ratio']:.2f}",
                  f"{row['low']:.2f}-{row['high']:.2f}", "-" if row["vs_dp"] is None else f"{row['vs_dp']:.2f}",
                  f"{row['peak_measured'] / 2**20:.2f} MiB", f"{row['peak_predicted'] / 2**20:.2f} MiB",
                  f"{row['peak_ratio']:.3f}")
    console.print(t)
    vs = "" if worst["vs_dp"] is None else f"; against the dp family's at the same time (vs dp): {worst['vs_dp']:.0%}"
    console.print(f"worst |measured / predicted - 1| of the medians: step time {worst['step']:.0%} (goal 25%), "
                  f"peak memory {worst['peak']:.0%} (goal 10%); of any one round's step time: {worst['round']:.0%}{vs}")
    return 0


def summarize(runs: dict, closing: Optional[list] = None) -> tuple[list[dict], dict]:
    """Per family (in ``runs``' order: name -> [(measured s, predicted s, measured peak, predicted
    peak, time s) per round]) its median round, the step ratio's median and range and its median over
    the dp family's ratio at the same time ("vs_dp", None without a dp family: module docstring);
    and the worst |ratio - 1| of the medians ("step", "peak", "vs_dp") and of any one round
    ("round"). ``closing``: per round, the dp family's profile once more after the others, the
    same tuple; the reference is then the dp ratio interpolated by time between the round's two dp
    profiles (without it, the round's one dp ratio)."""
    def ref(r: int, t: float) -> float:
        m, p, _, _, t0 = runs["dp"][r]
        if not closing:
            return m / p
        mc, pc, _, _, t1 = closing[r]
        w = min(1.0, max(0.0, (t - t0) / (t1 - t0))) if t1 > t0 else 0.0
        return (1 - w) * m / p + w * mc / pc

    has_ref = "dp" in runs
    rows, worst = [], {"step": 0.0, "peak": 0.0, "round": 0.0, "vs_dp": 0.0 if has_ref else None}
    for name, rounds in runs.items():
        mt, pt, mm, pm = (statistics.median(col) for col in list(zip(*rounds))[:4])
        ratios = [run[0] / run[1] for run in rounds]
        ratio = statistics.median(ratios)       # mt / pt where the prediction is one calibration's
        vs_dp = statistics.median(x / ref(r, run[4]) for r, (x, run) in enumerate(zip(ratios, rounds))) \
            if has_ref else None
        rows.append({"family": name, "measured_s": mt, "predicted_s": pt, "ratio": ratio, "low": min(ratios),
                     "high": max(ratios), "vs_dp": vs_dp, "peak_measured": mm, "peak_predicted": pm,
                     "peak_ratio": mm / pm})
        worst["step"], worst["peak"] = max(worst["step"], abs(ratio - 1)), max(worst["peak"], abs(mm / pm - 1))
        worst["round"] = max([worst["round"]] + [abs(x - 1) for x in ratios])
        if vs_dp is not None:
            worst["vs_dp"] = max(worst["vs_dp"], abs(vs_dp - 1))
    return rows, worst


def _calibrate(nproc: int):
    """``autopar calibrate --nproc N`` into a new temporary file: its path, or None if it failed."""
    from autopar.cli import main as cli

    path = os.path.join(tempfile.mkdtemp(prefix="autopar-calibrate-"), "cluster.toml")
    return path if cli(["calibrate", "--nproc", str(nproc), "--out", path]) == 0 else None


if __name__ == "__main__":
    sys.exit(main())
