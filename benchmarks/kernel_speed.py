"""Benchmark autopar's fused Triton kernels against torch eager and torch.compile on one GPU.

    python benchmarks/kernel_speed.py --json kernels.json            # H200: about 3 minutes
    python benchmarks/kernel_speed.py --quick --json kernels.json    # fewer repetitions
    python benchmarks/kernel_speed.py --only rms_norm attention      # rows whose name contains these
    python benchmarks/kernel_speed.py --dry-run --json /tmp/k.json   # CPU + Triton interpreter, tiny
                                                                # shapes: exercises table and JSON

What it prints: first the ceilings, measured at start (HBM bandwidth from a device-to-device copy
counting bytes read + written; bf16 dense FLOP/s from an 8192^3 matmul) next to the datasheet's
(H200 SXM: 4.8 TB/s, 989 TFLOP/s dense bf16); then one table row per (kernel, pass) with the
median time of the Triton kernel, torch eager and torch.compile (triton.testing.do_bench, which
flushes L2 between runs), the Triton kernel's throughput, the percentage of the measured and the
datasheet ceiling, and pass/fail columns for the goals:
    memory-bound norms, softmax, cross-entropy:  >= 80 % of the measured HBM bandwidth
    attention forward:                           >= 50 % of the measured bf16 matmul rate
    every row:                                   Triton time <= torch.compile time
Bytes count the traffic the fused algorithm must move (each row spells its formula out); eager
and torch.compile are timed on the same work, so their throughput is the same ratio of times.
"err" is max|triton - eager| / max|eager| on the row's first output (a sanity check, not a test).
Kernels launched through autopar/kernels/_launch.Tuned (norms, softmax, cross-entropy, ...) autotune: a
row's first Triton call tunes them, untimed, and the timed calls reuse the choice; a
"config <kernel>" footnote per row names the config that ran (and, where the row tuned it, the
fastest and second-fastest times), and the JSON row's "tuned" field holds the same with every
config's median time (triton.autotune's do_bench of that kernel alone).

Each row fails soft: an exception is printed and recorded for that row (and a torch.compile
failure only for its column), and the run goes on. ``--budget-s`` (default 200) stops starting
new rows, and new torch.compile columns past 80 % of it, so the script ends in time. Rows run
in order of importance (norms, softmax, cross-entropy, attention, then the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

# the rows come from benchmarks/kernel_cases.py, imported as benchmarks.kernel_cases
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--dry-run" in sys.argv:  # must precede the first import of triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from benchmarks.kernel_cases import (  # noqa: E402  (re-exported: tests use bench.Case)
    ATTENTION_GOAL_PCT, MEMORY_GOAL_PCT, Case, build_cases, grads_of)
from autopar.kernels import _launch  # noqa: E402

DATASHEET_HBM_BPS = 4.8e12  # H200 SXM, HBM3e
DATASHEET_BF16_FLOPS = 989e12  # H200 SXM, dense bf16 tensor core


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ceilings:
    device: str
    hbm_Bps: float  # measured: device-to-device copy, bytes read + written per second
    bf16_flops: float  # measured: n^3 bf16 matmul (n = matmul_n)
    copy_bytes: int = 2 << 30
    matmul_n: int = 8192
    hbm_Bps_datasheet: float = DATASHEET_HBM_BPS
    bf16_flops_datasheet: float = DATASHEET_BF16_FLOPS


@dataclass
class Row:
    name: str  # "rms_norm fwd+bwd"
    shape: str  # "16384x8192 bf16"
    bound: str  # "memory" (work in bytes) or "compute" (work in FLOPs)
    work: float  # bytes or FLOPs per call
    work_formula: str
    goal_pct: float | None = None  # of the measured ceiling; None: no throughput goal
    triton_ms: float | None = None
    eager_ms: float | None = None
    compile_ms: float | None = None
    throughput: float | None = None  # bytes/s or FLOP/s of the Triton kernel
    pct_ceiling: float | None = None  # of the measured ceiling
    pct_datasheet: float | None = None
    goal_met: bool | None = None
    beats_compile: bool | None = None
    err: float | None = None
    error: str | None = None  # the row's failure, if any
    notes: list[str] = field(default_factory=list)
    # autotuned kernels the Triton column ran: {kernel: {"config": ..., "tuning": {config: ms}}}
    # ("tuning" only where the autotuner timed its list during this row)
    tuned: dict = field(default_factory=dict)


def fill_derived(row: Row, ceilings: Ceilings) -> Row:
    """Throughput, percentages and goal columns from the measured times (pure; tested)."""
    if row.triton_ms is not None and row.triton_ms > 0:
        row.throughput = row.work / (row.triton_ms * 1e-3)
        ceiling = ceilings.hbm_Bps if row.bound == "memory" else ceilings.bf16_flops
        sheet = ceilings.hbm_Bps_datasheet if row.bound == "memory" else ceilings.bf16_flops_datasheet
        row.pct_ceiling = 100.0 * row.throughput / ceiling
        row.pct_datasheet = 100.0 * row.throughput / sheet
        if row.goal_pct is not None:
            row.goal_met = row.pct_ceiling >= row.goal_pct
        if row.compile_ms is not None:
            row.beats_compile = row.triton_ms <= row.compile_ms
    return row


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def make_timer(device: torch.device, quick: bool):
    """(fn) -> median ms. do_bench on CUDA; a wall-clock loop for the CPU dry run."""
    if device.type == "cuda":
        import triton.testing

        warmup, rep = (5, 20) if quick else (25, 100)
        return lambda fn: float(triton.testing.do_bench(fn, warmup=warmup, rep=rep,
                                                        return_mode="median"))

    def wall(fn, reps=2):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]

    return wall


def measure_ceilings(device: torch.device, timer, dry_run: bool) -> Ceilings:
    n_bytes = (1 << 20) if dry_run else (2 << 30)  # 2 GiB: many times the 60 MB L2
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    hbm = 2 * n_bytes / (copy_ms * 1e-3)  # read + write
    del src, dst
    n = 256 if dry_run else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = timer(lambda: a @ b)
    flops = 2 * n**3 / (mm_ms * 1e-3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    return Ceilings(device=name, hbm_Bps=hbm, bf16_flops=flops, copy_bytes=n_bytes, matmul_n=n)


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def _first_tensor(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def _rel_err(a, b) -> float:
    a, b = _first_tensor(a).float(), _first_tensor(b).float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _compiled(spec: dict, backend: str):
    """torch.compile of the eager function as a no-argument callable: forward only, or forward
    and backward when the spec has a "dy" key (None for a scalar loss)."""
    compiled = torch.compile(spec["fn"], dynamic=False, backend=backend)
    args = spec["args"]
    if "dy" not in spec:
        return lambda: compiled(*args)
    return grads_of(compiled, args, spec["dy"], spec.get("wrt"))


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def config_note(kernel: str, tuned: dict) -> str:
    """The footnote for one autotuned kernel: its config, and the margin when it was tuned here."""
    note = f"config {kernel}: {tuned['config']}"
    times = sorted(tuned.get("tuning", {}).values())
    if len(times) > 1:
        note += f" (fastest of {len(times)}: {times[0]:.3f} ms; next {times[1]:.3f} ms)"
    return note


def run_case(case: Case, timer, ceilings: Ceilings, *, compile_backend: str | None,
             device, skip_compile_note: str | None = None) -> Row:
    """One row: check, time Triton and eager, then torch.compile with compile_backend (None:
    no compile column; skip_compile_note says why when that is news)."""
    row = Row(case.name, case.shape, case.bound, case.work, case.work_formula, case.goal_pct)
    impls = None
    try:
        impls = case.build()
        with _launch.recording() as row.tuned:  # the first call autotunes; the timed ones reuse
            out_t = impls["triton"]()
        row.notes += [config_note(name, t) for name, t in row.tuned.items()]
        if impls.get("check", True):
            row.err = _rel_err(out_t, impls["eager"]())
            if row.err > 5e-2:
                row.notes.append(f"err {row.err:.1e} > 5e-2: the Triton output disagrees with eager")
        del out_t
        row.triton_ms = timer(impls["triton"])
        row.eager_ms = timer(impls["eager"])
    except Exception as e:  # fail soft: record this row's failure and go on with the others
        row.error = _error_text(e)
        traceback.print_exc(file=sys.stderr)
    if impls is not None and row.error is None:
        if compile_backend is None:
            if skip_compile_note:
                row.notes.append(skip_compile_note)
        elif impls.get("compile") is None:  # the case opts out of the column, saying why
            row.notes.append(impls.get("compile_note", "torch.compile not timed for this row"))
        else:
            try:
                row.compile_ms = timer(_compiled(impls["compile"], compile_backend))
            except Exception as e:  # only this column is lost
                row.notes.append("torch.compile failed: " + _error_text(e))
                traceback.print_exc(file=sys.stderr)
    del impls
    if device.type == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return fill_derived(row, ceilings)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

COLUMNS = ("kernel", "shape", "triton ms", "eager ms", "compile ms", "throughput", "% ceil",
           "% sheet", "goal", "met", "<= compile", "err")


def _fmt(x, spec="{:.3f}"):
    return "-" if x is None else spec.format(x)


def _yes_no(b):
    return "-" if b is None else ("PASS" if b else "FAIL")


def table_rows(rows: list[Row]) -> list[tuple[str, ...]]:
    out = []
    for r in rows:
        if r.error:
            out.append((r.name, r.shape, "ERROR", r.error, "", "", "", "", "", "", "", ""))
            continue
        unit, scale = ("GB/s", 1e9) if r.bound == "memory" else ("TFLOP/s", 1e12)
        thr = "-" if r.throughput is None else f"{r.throughput / scale:.0f} {unit}"
        goal = "-" if r.goal_pct is None else f">={r.goal_pct:.0f}%"
        out.append((r.name, r.shape, _fmt(r.triton_ms), _fmt(r.eager_ms), _fmt(r.compile_ms), thr,
                    _fmt(r.pct_ceiling, "{:.1f}"), _fmt(r.pct_datasheet, "{:.1f}"), goal,
                    _yes_no(r.goal_met), _yes_no(r.beats_compile), _fmt(r.err, "{:.1e}")))
    return out


def format_ceilings(c: Ceilings) -> str:
    return (f"device: {c.device}\n"
            f"HBM bandwidth   measured {c.hbm_Bps / 1e12:.2f} TB/s "
            f"({c.copy_bytes / 2**30:g} GiB d2d copy, read+write)   "
            f"datasheet {c.hbm_Bps_datasheet / 1e12:.2f} TB/s\n"
            f"bf16 dense      measured {c.bf16_flops / 1e12:.0f} TFLOP/s "
            f"({c.matmul_n}^3 matmul)   datasheet {c.bf16_flops_datasheet / 1e12:.0f} TFLOP/s\n"
            f"% ceil = of the measured ceiling (goals use it); % sheet = of the datasheet")


def format_table(rows: list[Row]) -> str:
    """Plain-text table (also the fallback when rich is missing)."""
    body = [COLUMNS] + table_rows(rows)
    widths = [max(len(r[i]) for r in body) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"  {r.name}: bytes/FLOPs = {r.work_formula}" for r in rows]
    notes += [f"  {r.name}: {n}" for r in rows for n in r.notes]
    return "\n".join(lines + ["", "work counted per row:"] + notes)


def print_table(rows: list[Row], ceilings: Ceilings) -> None:
    print(format_ceilings(ceilings))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(rows))
        return
    table = Table(title="autopar fused kernels")
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("kernel", "shape") else "right")
    for r in table_rows(rows):
        table.add_row(*r)
    console = Console(width=200)
    console.print(table)
    for r in rows:
        console.print(f"  {r.name}: bytes/FLOPs = {r.work_formula}", highlight=False)
        for n in r.notes:
            console.print(f"  {r.name}: {n}", highlight=False)


def to_json(rows: list[Row], ceilings: Ceilings, elapsed_s: float, args) -> dict:
    import triton

    return dict(ceilings=asdict(ceilings), rows=[asdict(r) for r in rows], elapsed_s=elapsed_s,
                torch=torch.__version__, triton=triton.__version__, quick=args.quick,
                dry_run=args.dry_run,
                goals=dict(memory_pct=MEMORY_GOAL_PCT, attention_fwd_pct=ATTENTION_GOAL_PCT,
                           beats_compile=True))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument("--quick", action="store_true", help="fewer repetitions per timing")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU + TRITON_INTERPRET=1, tiny shapes, no torch.compile: tests the script")
    p.add_argument("--only", nargs="*", default=None, help="run rows whose name contains any")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default inductor on CUDA; a dry run compiles "
                        "only when this is given, e.g. 'eager' to test the wiring cheaply)")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="start no new row after this many seconds (default 200), and no new "
                        "torch.compile column after 80 %% of it")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--dry-run needs TRITON_INTERPRET=1 set before triton is imported", file=sys.stderr)
            return 2
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("benchmarks/kernel_speed.py needs a CUDA GPU (torch.cuda.is_available() is False). "
                  "Run it on the GPU machine, or pass --dry-run to exercise it on the CPU.",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda")
    timer = make_timer(device, args.quick)
    ceilings = measure_ceilings(device, timer, args.dry_run)
    print(format_ceilings(ceilings), flush=True)
    cases = build_cases(device, args.dry_run)
    if args.only:
        cases = [c for c in cases if any(s in c.name for s in args.only)]
    rows = []
    for case in cases:
        elapsed = time.perf_counter() - t0
        if elapsed > args.budget_s:
            rows.append(Row(case.name, case.shape, case.bound, case.work, case.work_formula,
                            case.goal_pct, error=f"skipped: time budget ({args.budget_s:.0f} s) spent"))
            continue
        backend = args.compile_backend or (None if args.dry_run else "inductor")
        note = None
        if args.no_compile:
            backend = None
        elif backend is not None and elapsed > 0.8 * args.budget_s:
            backend, note = None, "torch.compile skipped: 80 % of the time budget spent"
        row = run_case(case, timer, ceilings, compile_backend=backend, device=device,
                       skip_compile_note=note)
        rows.append(row)
        print(f"[{time.perf_counter() - t0:6.1f} s] {row.name}: triton {_fmt(row.triton_ms)} ms, "
              f"eager {_fmt(row.eager_ms)} ms, compile {_fmt(row.compile_ms)} ms"
              + (f"  ERROR {row.error}" if row.error else ""), flush=True)
    elapsed = time.perf_counter() - t0
    print()
    print_table(rows, ceilings)
    print(f"\n{len(rows)} rows, {sum(r.error is not None for r in rows)} errors, {elapsed:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(rows, ceilings, elapsed, args), indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
