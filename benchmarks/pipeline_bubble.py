"""Measured pipeline bubble per schedule against the cost model's, on CPU gloo ranks, one run.

    python benchmarks/pipeline_bubble.py              # gpipe, 1f1b, interleaved_1f1b (vpp=2) x pp 2, 4 x m = pp, 2 pp
    python benchmarks/pipeline_bubble.py --quick      # one config (1f1b, pp=2, m=2): a smoke run
    python benchmarks/pipeline_bubble.py --pp 2 --steps 8 --spec "gpt:hidden=128,layers=8,heads=4,vocab=256,seq=64"
    python benchmarks/pipeline_bubble.py --pp 2 --schedules 1f1b interleaved_zb zbv dualpipev

For each configuration autopar plans the model with ``--force pp=P,dp=1,tp=1,mbs=MBS,schedule=S``
(global batch = m * MBS, so the plan has m micro-batches) and runs it with ``autoparallelize`` on
P CPU ranks (``spawn_ranks``, gloo). Every rank times, on the machine's shared monotonic clock:

* the schedule's ``step`` (torch's ``PipelineScheduleSingle.step`` / ``PipelineScheduleMulti.step``),
* its own compute inside it: ``forward_one_chunk``, ``backward_one_chunk``,
  ``backward_weight_one_chunk`` of torch's pipeline stages and the schedule's loss
  (``_maybe_compute_loss``), by wrapping those torch methods in the rank processes (autopar's code
  is untouched; the wrappers cost a ``perf_counter`` pair per call).

Per step the pipeline's window runs from the first rank entering ``step`` to the last rank leaving
it (all ranks start after a barrier); a rank's idle time is the window minus its compute. The cost
model (``autopar.cost.flops.pipeline_bubble_fraction``) states the idle time of the slowest rank
relative to its compute, m * t: (p - 1) / m for GPipe and 1F1B, (p - 1) / (v m) for interleaved
1F1B. The table shows, per configuration, the median over timed steps of each rank's
idle / compute, the slowest (most compute) rank's value against the prediction (``meas/pred``),
and the mean and max over ranks. Everything is a ratio of times measured side by side in one run:
no absolute time is promised, and on a loaded machine (more ranks than cores: pp=4 on 2 cores)
ranks that compute at the same time share cores, which inflates compute and hides idle.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time

SPEC = "gpt:hidden=64,layers=8,heads=4,vocab=256,seq=32"
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2),
             ("dualpipev", 2))
DEFAULT_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

# ---- in the rank processes: timing hooks on torch's pipelining ---------------------------------

_EVENTS: list = []          # (kind, t0, t1), this rank, in order


def _action(kind: str, args: tuple) -> tuple:
    """(stage index, micro-batch) of a wrapped call, None for a schedule step."""
    if kind in "FBW":                    # stage.forward_one_chunk(chunk_id, ...) etc.
        return args[0].stage_index, args[1]
    if kind == "L":                      # schedule._maybe_compute_loss(stage, output, targets, mb_index)
        return args[1].stage_index, args[4]
    return None


def _timed(kind: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _EVENTS.append((kind, t0, time.perf_counter(), _action(kind, args)))
    wrapper.__bench_wrapped__ = True
    return wrapper


def install_hooks() -> None:
    """Wrap torch's stage compute and schedule step methods (once per process)."""
    from torch.distributed.pipelining import schedules, stage

    base = stage._PipelineStageBase
    for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                       ("backward_weight_one_chunk", "W")):
        fn = getattr(base, name)
        if not getattr(fn, "__bench_wrapped__", False):
            setattr(base, name, _timed(kind, fn))
    targets = [(schedules._PipelineSchedule, "_maybe_compute_loss", "L"),
               (schedules.PipelineScheduleSingle, "step", "S"),
               (schedules.PipelineScheduleMulti, "step", "S")]
    for cls, name, kind in targets:
        fn = cls.__dict__[name]
        if not getattr(fn, "__bench_wrapped__", False):
            setattr(cls, name, _timed(kind, fn))
    # every class the plans use must reach the wrapped methods (no override below them)
    for cls in (schedules.ScheduleGPipe, schedules.Schedule1F1B, schedules.ScheduleInterleaved1F1B,
                schedules.ScheduleInterleavedZeroBubble, schedules.ScheduleZBVZeroBubble, schedules.ScheduleDualPipeV):
        assert getattr(cls.step, "__bench_wrapped__", False), cls
    for name in ("forward_one_chunk", "backward_one_chunk"):
        assert getattr(getattr(stage.PipelineStage, name), "__bench_wrapped__", False), name


def _steps_of(events: list) -> list[dict]:
    """Per schedule step: its start and end and this rank's compute inside it."""
    out = []
    # events are appended at their end: a compute event precedes the step that contains it
    pending = []
    for kind, t0, t1, what in events:
        if kind == "S":
            comp = [e for e in pending if e[1] >= t0 and e[2] <= t1]
            out.append({"start": t0, "end": t1, "compute": sum(b - a for _, a, b, _ in comp),
                        "n": {k: sum(1 for c in comp if c[0] == k) for k in "FBWL"},
                        "actions": [(k, w[0], w[1], b - a) for k, a, b, w in comp]})
            pending = []
        else:
            pending.append((kind, t0, t1, what))
    return out


def bench_rank(rank: int, world: int, jobs: list, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    from autopar.api import autoparallelize
    from autopar.models import build_model
    from autopar.plan import Plan

    install_hooks()
    models = {}
    for job in jobs:
        torch.manual_seed(0)
        b = build_model(job["spec"], device="cpu", batch=job["batch"])
        gen = torch.Generator().manual_seed(1)
        data = [b.make_batch(job["batch"], gen) for _ in range(2)]
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3), plan=Plan.from_json(job["plan"]),
                             timeout_s=cfg["timeout_s"], record_collectives=False)
        models[job["name"]] = (pm, data)

    def run(name: str, n: int) -> list[dict]:
        pm, data = models[name]
        steps = []
        for i in range(n):
            x, y = data[i % len(data)]
            dist.barrier()
            _EVENTS.clear()
            pm.step(x, y)
            got = _steps_of(_EVENTS)
            assert len(got) == 1, f"{name}: {len(got)} schedule steps in one optimizer step"
            steps.append(got[0])
        return steps

    names = [j["name"] for j in jobs]
    for name in names:                               # warm-up
        run(name, cfg["warmup"])
    out: dict = {n: [] for n in names}
    rounds = cfg["rounds"]
    per_round = max(1, math.ceil(cfg["steps"] / rounds))
    for r in range(rounds):                          # interleaved rounds: load hits all configs alike
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name] += run(name, per_round)
    return out


# ---- in the parent: plans, launch, table --------------------------------------------------------

def make_jobs(spec: str, pp: int, mbs: int, ms: list[int], schedules) -> list[dict]:
    from autopar.cost.hardware import resolve_cluster
    from autopar.models import build_model
    from autopar.solver import plan_model
    from autopar.solver.errors import PlanningError
    from autopar.trace import trace_model

    jobs = []
    for m in ms:
        batch = m * mbs
        b = build_model(spec, device="cpu", batch=batch)
        g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
        for sched, v in schedules:
            force = f"pp={pp},dp=1,tp=1,mbs={mbs},schedule={sched}" + (f",vpp={v}" if v > 1 else "")
            try:
                plan = plan_model(g, resolve_cluster("cpu", nodes=1, gpus_per_node=pp), global_batch=batch,
                                  seq_len=None, dtype="float32", force=force)
            except PlanningError as e:           # e.g. DualPipeV with fewer than 2 pp micro-batches
                print(f"skipped {sched}, pp={pp}, m={m}: {e}")
                continue
            got = (plan.pp, plan.pipeline_schedule, plan.virtual_stages, plan.num_micro_batches)
            assert got == (pp, sched, v, m), (force, got)
            jobs.append({"name": f"{sched}|{pp}|{v}|{m}", "spec": spec, "batch": batch, "plan": plan.to_json(),
                         "schedule": sched, "pp": pp, "v": v, "m": m})
    return jobs


def simulate(per_rank: list[list[tuple]], uniform: bool = False) -> list[float]:
    """Each rank's idle / compute if the actions each rank ran (in its order, ``(kind, stage, mb,
    seconds)``) took their measured time (``uniform``: forward 1, backward 2, loss 0; a backward
    split into an input pass B and a weight pass W: 1 each) and nothing else took time: no
    transfer, no schedule bookkeeping. A forward waits for the previous stage's forward of its
    micro-batch, a backward for the next stage's backward."""
    split = {(st, mb) for r in per_rank for k, st, mb, _ in r if k == "W"}

    def unit(k: str, st: int, mb: int) -> float:
        if k in "BW":
            return 1.0 if (st, mb) in split else 2.0 if k == "B" else 0.0
        return 1.0 if k == "F" else 0.0
    acts = [[(k, st, mb, unit(k, st, mb) if uniform else d) for k, st, mb, d in r] for r in per_rank]
    done: dict = {}
    free = [0.0] * len(acts)
    pos = [0] * len(acts)
    while any(p < len(a) for p, a in zip(pos, acts)):
        moved = False
        for r, a in enumerate(acts):
            while pos[r] < len(a):
                k, st, mb, d = a[pos[r]]
                dep = ("F", st - 1, mb) if k == "F" and st > 0 else ("B", st + 1, mb) if k == "B" else None
                if dep is not None and dep[1] < n_stages(acts) and dep not in done:
                    break
                t = max(free[r], done.get(dep, 0.0))
                free[r] = done[(k, st, mb)] = t + d
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the recorded action orders deadlock")
    span = max(free)
    comp = [sum(x[3] for x in a) for a in acts]
    return [(span - c) / c if c > 0 else float("inf") for c in comp]


def n_stages(acts: list) -> int:
    return 1 + max(st for a in acts for _, st, _, _ in a)


def summarize(job: dict, per_rank: list[list[dict]]) -> dict:
    """Per rank median over steps of idle / compute, with idle = the pipeline window - compute;
    the same from the dependency simulation of the recorded actions."""
    from autopar.cost.flops import pipeline_bubble_fraction

    n_steps = len(per_rank[0])
    fracs = [[] for _ in per_rank]
    comps = [[] for _ in per_rank]
    sims = [[] for _ in per_rank]
    windows = []
    for i in range(n_steps):
        window = max(r[i]["end"] for r in per_rank) - min(r[i]["start"] for r in per_rank)
        windows.append(window)
        for k, (r, f) in enumerate(zip(per_rank, simulate([r[i]["actions"] for r in per_rank]))):
            c = r[i]["compute"]
            comps[k].append(c)
            fracs[k].append((window - c) / c if c > 0 else float("inf"))
            sims[k].append(f)
    frac = [statistics.median(f) for f in fracs]
    comp = [statistics.median(c) for c in comps]
    sim = [statistics.median(f) for f in sims]
    order = min(simulate([r[0]["actions"] for r in per_rank], uniform=True))
    slow = max(range(len(comp)), key=comp.__getitem__)
    pred = pipeline_bubble_fraction(job["pp"], job["m"], job["schedule"], job["v"])
    return {"frac": frac, "slowest": slow, "meas": frac[slow], "pred": pred, "ratio": frac[slow] / pred,
            "sim": sim[slow], "order": order, "mean": statistics.fmean(frac), "max": max(frac),
            "window_ms": 1e3 * statistics.median(windows), "comp_ms": [1e3 * c for c in comp],
            "counts": per_rank[0][0]["n"]}


def print_table(rows: list[tuple[dict, dict]], title: str) -> None:
    cols = ["schedule", "pp", "vpp", "m", "pred", "torch order", "sim", "measured", "meas/pred", "meas/sim",
            "mean/pred", "idle/compute per rank", "window ms"]
    cells = []
    for job, s in rows:
        cells.append([job["schedule"], str(job["pp"]), str(job["v"]), str(job["m"]), f"{s['pred']:.3f}",
                      f"{s['order']:.3f}", f"{s['sim']:.3f}", f"r{s['slowest']} {s['meas']:.3f}",
                      f"{s['ratio']:.2f}", f"{s['meas'] / s['sim']:.2f}", f"{s['mean'] / s['pred']:.2f}",
                      " ".join(f"{f:.2f}" for f in s["frac"]), f"{s['window_ms']:.1f}"])
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Table = None
    if Table is not None:
        t = Table(title=title)
        for c in cols:
            t.add_column(c, justify="left" if c in ("schedule", "idle/compute per rank") else "right")
        for row in cells:
            t.add_row(*row)
        Console(width=200).print(t)
        return
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    print(title)
    print(" | ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in cells:
        print(" | ".join(x.ljust(w) for x, w in zip(r, widths)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=SPEC, help="model spec (autopar.models.build_model)")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (= CPU ranks)")
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch size")
    ap.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES),
                    choices=[s for s, _ in SCHEDULES],
                    help="default: the ones the solver picks freely; the zero-bubble ones run when forced")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds the timed steps are split into")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one configuration (1f1b, pp=2, m=2), few steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.pp, args.schedules, args.steps, args.rounds, args.warmup = [2], ["1f1b"], 3, 1, 1
    schedules = [(s, v) for s, v in SCHEDULES if s in args.schedules]
    cfg = {"steps": args.steps, "rounds": args.rounds, "warmup": args.warmup, "timeout_s": 300}

    from autopar.runtime.launch import spawn_ranks

    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    print(f"model {args.spec}, micro-batch size {args.mbs}; {args.warmup} warm-up + {args.steps} timed steps per "
          f"configuration in {args.rounds} interleaved rounds; CPU gloo ranks, 1 thread each")
    rows = []
    for pp in args.pp:
        ms = [pp] if args.quick else [pp, 2 * pp]
        jobs = make_jobs(args.spec, pp, args.mbs, ms, schedules)
        res = spawn_ranks(bench_rank, pp, (jobs, cfg), timeout_s=cfg["timeout_s"], grace_s=120)
        for job in jobs:
            rows.append((job, summarize(job, [res[r][job["name"]] for r in range(pp)])))
    print_table(rows, "pipeline idle / compute per step: measured (median over steps) vs cost model")
    print("idle / compute of the slowest (most compute) rank:  pred = autopar.cost.flops.pipeline_bubble_fraction; "
          "torch order = torch's action order with forward 1, backward 2, no transfer time;  sim = the same "
          "order with each action's measured time, no transfer time;  measured = pipeline window - own compute. "
          "mean/pred: measured, mean over ranks.")
    for job, s in rows:
        if not all(math.isfinite(f) for f in s["frac"]):
            print(f"non-finite idle fraction in {job['name']}", file=sys.stderr)
            return 1
    print(f"total {time.perf_counter() - t_start:.0f} s; 1-minute load average {load0:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs (idle includes waiting for a CPU "
          "when the load exceeds the CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
