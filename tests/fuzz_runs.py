"""Running fuzz cases (``fuzz_models.py``) on gloo ranks and judging them against one process:
every case either matches the reference within ``tests/runtime/bodies.py``'s bounds (or, for an
ill-conditioned model, within what one fp32 process itself misses float64 by) or gets a clear
error, raised on purpose by autopar on every rank; anything else is a bug."""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                               # fuzz_models
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime"))   # bodies

from fuzz_models import batches, build, case_repr, fast_links_cluster  # noqa: E402

# ---- what the ranks run ----------------------------------------------------------------------

STEPS = 3
INIT_SEED = 7
JOB_TIMEOUT_S = 30.0


def _sgd(params):
    from bodies import sgd

    return sgd(params)


def run_case(rank: int, world: int, case: dict) -> dict:
    """autoparallelize the case's model under its forced plan and train STEPS steps."""
    from autopar.api import autoparallelize

    spec = case["spec"]
    module, x, lf, y = build(spec, "meta" if case["meta"] else "cpu")
    cluster = fast_links_cluster(world) if case["cluster"] == "free" else None
    plan = None
    if case.get("plan"):                          # a given plan (a regression test's hand edit)
        from autopar.plan import Plan

        plan = Plan.from_json(case["plan"])
    pm = autoparallelize(module, x, loss_fn=lf, example_target=y, optimizer=_sgd,
                         force=None if plan else case["force"], plan=plan,
                         cluster=cluster, seed=INIT_SEED, timeout_s=JOB_TIMEOUT_S)
    try:
        pm.reset_collectives()
        losses, grads = [], []
        data = batches(spec, STEPS + 1)
        for xb, yb in data[:STEPS]:
            losses.append(pm.step(xb, yb))
            grads.append(pm.full_grad_dict())       # gathers outside the recorder
        issued = [c.key() for c in pm.collectives]
        sd = pm.full_state_dict()
        out = pm(data[STEPS][0]) if case["forward"] else None
    except Exception as e:
        e.autopar_phase = "step"
        raise
    res = {"losses": losses, "issued": issued, "coords": pm.coordinates, "plan": pm.plan.to_json(),
           "fallbacks": sorted(pm.fallbacks)}
    if rank == 0:
        res.update(sd=sd, grads=grads, out=out)
    return res


def fuzz_jobs(rank: int, world: int, jobs: list) -> list:
    """Each case in turn; an error is recorded as ``{"error", "traceback", "phase"}``. After each
    case every rank posts its status to the store (independent of collective order): the ranks go
    on only when all of them finished the case or all raised during setup (autopar's setup errors
    are raised on every rank alike); otherwise this rank stops (the driver reruns the rest)."""
    import logging
    import traceback

    import torch.distributed as dist

    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)   # refused shapes: judged here
    store = dist.distributed_c10d._get_default_store()
    out = []
    for i, case in enumerate(jobs):
        try:
            res = run_case(rank, world, case)
            status = "ok"
        except Exception as e:  # recorded, judged by the driver
            phase = getattr(e, "autopar_phase", "setup")
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(), "phase": phase}
            status = f"error-{phase}"
        out.append(res)
        store.set(f"case{i}/rank{rank}", status)
        try:
            store.wait([f"case{i}/rank{r}" for r in range(world)], datetime.timedelta(seconds=JOB_TIMEOUT_S + 10))
            everyone = {store.get(f"case{i}/rank{r}").decode() for r in range(world)}
        except Exception:  # a rank is stuck or gone: stop here
            break
        if everyone not in ({"ok"}, {"error-setup"}):
            break
    return out


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def reference(case: dict, dtype: torch.dtype = torch.float32, pieces: int = 1) -> dict:
    """The same model, batches and SGD steps in one process (``dtype`` float64: the same run in
    nearly exact arithmetic). ``pieces`` > 1: each step's batch in that many equal pieces, each
    piece's loss over ``pieces``, gradients accumulated (a plan's dp x micro-batch summation, in
    one process). The batch-mean losses make the sum of the pieces the whole batch's loss."""
    from autopar.runtime.init import materialize

    spec = case["spec"]
    module, _, lf, _ = build(spec, "meta" if case["meta"] else "cpu")
    m = (materialize(module, INIT_SEED) if case["meta"] else module).to(dtype)
    opt = _sgd(m.parameters())
    data = [(tuple(_cast(t, dtype) for t in x), _cast(y, dtype)) for x, y in batches(spec, STEPS + 1)]
    named = dict(m.named_parameters(remove_duplicate=False))
    losses, grads = [], []
    for x, y in data[:STEPS]:
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for xs, ys in zip(zip(*(t.chunk(pieces) for t in x)), y.chunk(pieces)):
            part = lf(m(*xs), ys) / pieces
            part.backward()
            loss = loss + part.detach()
        opt.step()
        losses.append(float(loss))
        grads.append({k: (v.grad.clone() if v.grad is not None else torch.zeros_like(v)) for k, v in named.items()})
    with torch.no_grad():
        out = m(*data[STEPS][0])
    sd = {k: v.detach().clone() for k, v in named.items()}
    sd.update({k: v.detach().clone() for k, v in m.named_buffers()})
    return {"losses": losses, "sd": sd, "grads": grads, "out": out}


def forward_at(case: dict, state: dict, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The model's output on the forward-check batch, in one process, at the parameters (and
    buffers) ``state``: what ``pm(inputs)`` must return after training. Compared with the ranks'
    own trained parameters, not the reference's: those differ within the training bounds, and a
    small model can amplify that difference in its output (a LayerNorm over 3 channels of nearly
    equal values: 60x in a fuzzed case), which says nothing about the forward."""
    module, _, _, _ = build(case["spec"])
    module.load_state_dict(state)
    module.to(dtype)
    with torch.no_grad():
        return module(*(_cast(x, dtype) for x in batches(case["spec"], STEPS + 1)[STEPS][0]))


# ---- judging ---------------------------------------------------------------------------------

# What autopar raises on purpose (messages say what to change); anything else is a bug.
CLEAR_TYPES = frozenset({"ValueError", "PlanningError", "InfeasibleError", "TraceError", "PlanMismatchError",
                         "NotImplementedError"})
_PLANNING_FAILED = "RuntimeError: planning failed on rank 0: "
_PEER = "RankCommunicationError"


def error_type(msg: str) -> str:
    """The type of an error "Type: message" (rank 0's planning error re-raised: its own type)."""
    if msg.startswith(_PLANNING_FAILED):
        msg = msg[len(_PLANNING_FAILED):]
    return msg.split(":", 1)[0]


def raised_in_torch(tb: str) -> bool:
    """Whether the innermost frame of a formatted traceback is PyTorch's own code: its message is
    torch's, not one of autopar's (which say what to change), even when its type is ValueError."""
    import re

    frames = re.findall(r'File "([^"]+)", line \d+', tb)
    return bool(frames) and os.path.abspath(frames[-1]).startswith(os.path.dirname(torch.__file__) + os.sep)


def is_clear(msg: str, tb: str = "") -> bool:
    return error_type(msg) in CLEAR_TYPES and not raised_in_torch(tb)


@dataclass
class Outcome:
    case: dict
    status: str                     # "pass" | "clear" | "fail"
    message: str = ""               # the clear error, or what failed
    detail: str = ""                # a traceback, the ratios
    tp_used: Optional[bool] = None  # tp > 1: did the plan split anything on tp
    traffic: dict = field(default_factory=dict)   # axis -> collectives the ranks issued
    unpredicted: str = ""           # issued collectives that differ from codegen/expected.py's

    def line(self) -> str:
        return f"{self.status.upper()}: {case_repr(self.case)}" + (f"\n  {self.message}" if self.message else "")


def _judge_error(case: dict, results: list) -> Outcome:
    errors = [(r, res) for r, res in enumerate(results) if "error" in res]
    root = [(r, res) for r, res in errors if not res["error"].startswith(_PEER)] or errors
    r, res = root[0]
    msg = res["error"]
    if not is_clear(msg, res.get("traceback", "")):
        return Outcome(case, "fail", f"rank {r} raised {msg.splitlines()[0][:400]}", res["traceback"])
    if len(errors) < len(results) and res["phase"] == "setup":
        return Outcome(case, "fail", f"only ranks {[r for r, _ in errors]} raised {msg.splitlines()[0][:300]}",
                       res["traceback"])
    return Outcome(case, "clear", msg)


# A run over the bounds is still round-off when one fp32 process is as far from exact arithmetic:
# the distributed run may be at most this many times farther from the float64 run than the fp32
# reference is (a wrong run -- a missing reduction, a wrong shard -- is off by O(1) of the values,
# thousands of times the bounds).
FLOAT64_FACTOR = 4.0


def _one_tensor(run: dict, k: str) -> dict:
    return {"losses": run["losses"], "grads": [{k: g[k]} if k in g else {} for g in run["grads"]],
            "sd": {k: run["sd"][k]}}


def _beyond_float64(got: dict, refs32: list, ref64: dict) -> list[str]:
    """Per tensor and check, where ``got`` is farther from the float64 run than FLOAT64_FACTOR
    times the farthest of the fp32 one-process runs ``refs32`` is (and beyond the bounds)."""
    from bodies import training_ratios

    out: list[str] = []
    for k in ref64["sd"]:
        mine = training_ratios(_one_tensor(got, k), _one_tensor(ref64, k))
        ones = [training_ratios(_one_tensor(r, k), _one_tensor(ref64, k)) for r in refs32]
        for check, (r, where) in mine.items():
            r32 = max(one.get(check, (0.0, ""))[0] for one in ones)
            msg = f"{check} {r:.1f} x the bound from float64 (one fp32 process: {r32:.1f} x): {where}"
            if r > max(1.0, FLOAT64_FACTOR * r32) and msg not in out:
                out.append(msg)
    return out


def _numbers(case: dict, results: list, ref: dict, pieces: int) -> tuple[list[str], str]:
    """(problems, note) of the numbers: losses on every rank, rank 0's gradients and parameters
    (``bodies.training_ratios``: the project's bounds) and the forward output; a check over its
    bound is judged again against a float64 run (``FLOAT64_FACTOR``), and passes with a note when
    the model is that ill-conditioned (a LayerNorm over 3 channels of nearly equal values;
    vanishing gradients summed over ``pieces`` = dp x micro-batches pieces of the batch, which
    one fp32 process summing the same pieces is as far off). The fp32 one-process runs: the batch
    at once, in ``pieces``, and row by row (a kernel may reduce a split batch in another order:
    fuzz seed 105's conv2d model grows an fp32 error 20x a step, and one process summing its rows
    one by one lands where every parallel plan of it did, 36x the bound from float64 at step 3)."""
    from bodies import RTOL_LOSS, RTOL_OUT, _amax, training_ratios

    problems = []
    for r, res in enumerate(results):
        for t, (a, b) in enumerate(zip(res["losses"], ref["losses"])):
            if abs(a - b) > RTOL_LOSS * abs(b):
                problems.append(f"rank {r} loss at step {t + 1}: {a!r} vs {b!r}")
    for check, (ratio, where) in training_ratios(results[0], ref).items():
        if ratio > 1.0:
            problems.append(f"{check} {ratio:.1f} x the bound: {where}")
    notes = []
    if problems:
        ref64 = reference(case, torch.float64)
        refs32 = [ref] + [reference(case, pieces=p) for p in sorted({pieces, case["spec"]["batch"]} - {1})]
        again = _beyond_float64(results[0], refs32, ref64)
        for r, res in enumerate(results[1:], 1):
            again += [f"rank {r}: {m}" for m in _beyond_float64(dict(results[0], losses=res["losses"]), refs32, ref64)
                      if m.startswith("loss")]
        if again:
            return again, ""
        notes.append(f"ill-conditioned: over the bounds ({problems[0]}) but no farther from float64 than "
                     "one fp32 process")
    if case["forward"]:
        want = forward_at(case, results[0]["sd"])
        got = results[0]["out"]
        d, bound = _amax(got - want), RTOL_OUT * _amax(want)
        if d > bound:
            want64 = forward_at(case, results[0]["sd"], torch.float64)
            d64, d32 = _amax(got.double() - want64), _amax(want.double() - want64)
            if d64 > max(bound, FLOAT64_FACTOR * d32):
                return [f"forward output differs by {d:.3e}, bound {bound:.3e} (from float64: {d64:.3e}, "
                        f"one fp32 process: {d32:.3e})"], ""
            notes.append(f"ill-conditioned forward: differs by {d:.3e} > {bound:.3e}, one fp32 process by "
                         f"{d32:.3e} from float64")
    return [], "; ".join(notes)


def _unpredicted(case: dict, plan, results: list) -> list[str]:
    """Every rank issued exactly STEPS times the collectives ``codegen/expected.py`` predicts
    from the plan (kind, axis, bytes, phase), as ``tests/runtime/test_random_plans.py`` checks."""
    from collections import Counter

    from autopar.codegen.expected import expected_collectives
    from autopar.trace import trace_model

    module, x, lf, y = build(case["spec"])
    n = x[0].shape[0] // plan.num_micro_batches        # predicted from one micro-batch's trace
    x, y = tuple(t[:n] for t in x), y[:n]
    if plan.context_parallel > 1:                      # the folded batch cp runs
        from autopar.codegen.context_run import ContextRun

        run = ContextRun.make(None, 0, plan.context_parallel, plan.context_parallel_mode, x[0].shape[1], plan.dp, "cpu")
        x, y = tuple(run.fold(t) for t in x), run.fold(y)
    graph = trace_model(module, x, loss_fn=lf, example_target=y, collapse_repeats=False)
    out = []
    for r, res in enumerate(results):
        want = Counter()
        for key, k in Counter(c.key() for c in expected_collectives(graph, plan, tp_rank=res["coords"].get("tp", 0))).items():
            want[key] = k * STEPS
        got = Counter(tuple(k) for k in res["issued"])
        if got != want:
            out.append(f"rank {r} issued-but-not-predicted {dict(got - want)}, predicted-but-not-issued "
                       f"{dict(want - got)}")
    return out[:1]


def judge(case: dict, results: list, ref: Optional[dict] = None, check_prediction: bool = False) -> Outcome:
    """Every rank's result of ``case`` against the one-process run. ``check_prediction``: also
    compare what the ranks issued with ``codegen/expected.py``'s prediction (``Outcome.unpredicted``;
    reported, not a failure: the numbers are right, the planner's model of the traffic is not)."""
    from autopar.mesh import TENSOR_AXES
    from autopar.plan import Plan
    from autopar.solver.tensor_axes import tensor_shape

    if any("error" in res for res in results):
        return _judge_error(case, results)
    plan = Plan.from_json(results[0]["plan"])
    f = case["force"]
    want = {"dp": f["dp"], "tp": f["tp"], "pp": f["pp"], "zero_stage": f.get("zero", plan.zero_stage),
            "recompute": f["recompute"], "micro_batch_size": f.get("mbs", plan.micro_batch_size)}
    # the wide cases' keys (``fuzz_models.forced_plans``), where forced
    for key, attr in (("cp", "context_parallel"), ("cpmode", "context_parallel_mode"),
                      ("schedule", "pipeline_schedule"), ("offload", "offload")):
        if key in f:
            want[attr] = f[key]
    got = {k: getattr(plan, k) for k in want}
    if "tpmode" in f:        # the mesh, not the family's name: 2.5-D's 2 x 2 x 2 is the 3-D mesh (mesh.tensor_mode)
        want["tensor_mesh"] = tuple(n for n in tensor_shape(f["tpmode"], f["tp"]) or (f["tp"],) if n > 1)
        got["tensor_mesh"] = tuple(n for a, n in zip(plan.mesh_axes, plan.mesh_shape) if a in TENSOR_AXES and n > 1)
    if got != want:
        return Outcome(case, "fail", f"the plan is not the forced one: {got} != {want}")
    problems, note = _numbers(case, results, ref if ref is not None else reference(case),
                              plan.dp * plan.num_micro_batches)
    traffic: dict = {}
    for res in results:
        for kind, axis, nbytes, phase in res["issued"]:
            traffic[axis] = traffic.get(axis, 0) + 1
    idle = plan.idle_axes()
    for axis, size in zip(plan.mesh_axes, plan.mesh_shape):
        if size > 1 and axis in idle and traffic.get(axis):
            problems.append(f"axis {axis} is idle in the plan but carried {traffic[axis]} collectives")
        if size > 1 and axis not in idle and not traffic.get(axis):
            problems.append(f"the plan splits on axis {axis} (size {size}) but no rank issued a collective on it")
    tp_used = None if f["tp"] == 1 else "tp" not in idle
    if problems:
        return Outcome(case, "fail", "wrong numbers: " + "; ".join(problems[:4]), tp_used=tp_used, traffic=traffic)
    unpredicted = "; ".join(_unpredicted(case, plan, results)) if plan.pp == 1 and check_prediction else ""
    return Outcome(case, "pass", note, tp_used=tp_used, traffic=traffic, unpredicted=unpredicted)


def run_cases(cases_: list, world: int, *, progress=None, check_prediction: bool = False) -> list[Outcome]:
    """Run ``cases_`` on ``world`` gloo ranks (as few launches as errors allow) and judge each."""
    from autopar.runtime.launch import RankFailure, spawn_ranks

    outcomes: list[Outcome] = []
    todo = list(cases_)
    while todo:
        try:
            per_rank = spawn_ranks(fuzz_jobs, world, (todo,), timeout_s=JOB_TIMEOUT_S * len(todo) + 30)
        except RankFailure as e:         # a rank died outside the per-case handler
            outcomes.append(Outcome(todo[0], "fail", f"launch failed: {e.summary()[:400]}", str(e)))
            todo = todo[1:]
            continue
        done = min(len(r) for r in per_rank)
        if done == 0:                     # a rank could not even start the first case
            outcomes.append(Outcome(todo[0], "fail", "no rank result for the case"))
            done = 1
        for i in range(min(done, len(todo))):
            results = [per_rank[r][i] if i < len(per_rank[r]) else {"error": "missing", "traceback": "",
                                                                    "phase": "step"}
                       for r in range(world)]
            try:
                o = judge(todo[i], results, check_prediction=check_prediction)
            except Exception as e:       # a check that could not run is a failure too
                import traceback

                o = Outcome(todo[i], "fail", f"judging raised {type(e).__name__}: {e}", traceback.format_exc())
            outcomes.append(o)
            if progress:
                progress(o)
        todo = todo[done:]
    return outcomes
