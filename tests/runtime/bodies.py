"""What the test ranks run (module-level functions: spawned ranks import them), and the
single-process reference they are compared with."""
from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Optional

import torch

BATCH = 4
STEPS = 3
DATA_SEED = 1


def adamw(params):
    # Only tests/runtime/test_gpu.py trains with this (one device against eager); the multi-rank
    # comparisons use ``sgd``: Adam divides by sqrt(v) + eps, so for a gradient entry near 0 a
    # round-off difference dg becomes a parameter difference of up to lr * dg / eps (1e3 * dg
    # here), bounded only by ~lr: no tolerance can tell round-off from a wrong run there.
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.01)


# ---- the multi-rank comparisons: optimizer and numerical bounds ---------------------------------
# SGD with momentum and weight decay: linear in the gradients, so a gradient difference dg moves
# the parameters by lr * dg per step and no more (no 1/sqrt(v) magnification), yet it keeps
# per-parameter optimizer state (the momentum buffer) that ZeRO shards like Adam's moments.
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 0.01
EPS32 = torch.finfo(torch.float32).eps                 # 2**-23, one ulp of 1.0
# Step 1 (same parameters, same batch): only the order of fp32 sums differs (dp all-reduce, tp
# partial sums, fused kernels); each entry of a sum of N <= 256 terms (hidden*4 / vocab / B*T
# contractions here) moves by <= N * EPS32/2 * sum|terms| ~ 1.5e-5 of the tensor's largest
# entry at worst, ~sqrt(N) * EPS32 ~ 2e-6 typically; bound 2e-5 * max|g| per tensor. A wrong run
# (missing all-reduce: half-batch gradients; wrong shard; a gradient scaled by 1.01) is >= 1e-2.
RTOL_GRAD_FIRST = 2e-5
# Steps 2..K: the parameters already differ (by <= the bound below), which adds H * dp to dg.
RTOL_GRAD = 5e-5
# Losses: a mean of B*T cross-entropies (log-sum-exp over the vocab): N*EPS32 ~ 4e-6 of |loss| at
# worst for N ~ 32 reordered terms per token, plus g . dp at later steps.
RTOL_LOSS = 4e-6
RTOL_OUT = 5e-5          # the forward output after training: as a later-step gradient


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


class _SlowSGD(torch.optim.SGD):
    """``sgd`` whose every step call takes ``pause_s`` more (an overlapped host step's chunks,
    ``runtime/host_step.py``, then outlast the start of the next forward on any machine) and,
    with ``fail_at``, raises at that call."""

    def __init__(self, params, pause_s: float, fail_at: int = 0) -> None:
        super().__init__(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
        self.pause_s, self.fail_at, self.calls = pause_s, fail_at, 0

    def step(self, closure=None):
        import time

        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"test optimizer: failing at call {self.calls}")
        time.sleep(self.pause_s)
        return super().step(closure)


LLAMA_TINY = "llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"


def build(meta: bool, spec: str = "gpt-tiny", rows: int = BATCH):
    from autopar.models import build_model

    if meta:
        return build_model(spec, device="meta", batch=rows)
    torch.manual_seed(0)
    return build_model(spec, device="cpu", batch=rows)


@functools.lru_cache(maxsize=None)
def full_trace(rows: int, spec: str = "gpt-tiny"):
    """``spec`` traced with every layer (what the runtime executes) at a batch of ``rows``: one
    micro-batch's graph, from which a plan's collectives and sends are predicted."""
    from autopar.trace import trace_model

    b = build(False, spec, rows)
    return trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                       collapse_repeats=False, model_name=spec)


def batches(b, n: int = STEPS):
    gen = torch.Generator().manual_seed(DATA_SEED)
    return [b.make_batch(BATCH, gen) for _ in range(n + 1)]     # the last one for a forward check


def train_job(rank: int, world: int, job: dict) -> dict:
    """STEPS steps of ``job["plan"]``, then what the tests compare (and the engine that ran:
    ``pm.engine``, ``pm.engine_reason``, the runner types). ``job["expect_error"]``: building must
    raise; the error (type: message) is returned instead. ``job["timeout_s"]``: the process
    groups' timeout (default 30 s). Also per rank: the mesh axes' names, the bytes each axis
    carried and each parameter's (local, full) element counts."""
    from autopar.api import autoparallelize
    from autopar.plan import Plan
    from autopar.runtime.collectives import traffic_by_axis

    b = build(job.get("meta", False), job.get("spec", "gpt-tiny"))
    data = batches(b)
    kwargs = {k: job[k] for k in ("bucket_bytes", "dp_mode", "nvme_dir", "engine", "host_step") if k in job}
    opt = sgd if "pause_s" not in job else functools.partial(_SlowSGD, pause_s=job["pause_s"],
                                                             fail_at=job.get("fail_at", 0))
    try:
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             optimizer=opt, plan=Plan.from_json(job["plan"]), seed=job.get("seed", 0),
                             timeout_s=job.get("timeout_s", 30), **kwargs)
    except Exception as e:  # the test inspects what every rank raised
        if not job.get("expect_error"):
            raise
        return {"error": f"{type(e).__name__}: {e}"}
    pm.reset_collectives()
    # job["scheduler"]: the learning rate halved after each step, as a user's scheduler does it
    sched = torch.optim.lr_scheduler.StepLR(pm.optimizer, 1, gamma=0.5) if job.get("scheduler") else None
    losses, grads = [], []
    for x, y in data[:STEPS]:
        try:
            losses.append(pm.step(x, y))
            if sched is not None:
                sched.step()
        except Exception as e:  # a test of a failing step inspects what every rank raised
            if not job.get("expect_step_error"):
                raise
            pm.close()
            return {"error": f"{type(e).__name__}: {e}", "steps": len(losses)}
        grads.append(pm.full_grad_dict())       # gathers outside the recorder: not in ``issued``
    host = pm.offload.optimizer.overlapped if pm.offload.optimizer is not None else None
    overlap = (host.behind, host.waited) if host is not None else None
    assert pm.host_step == (None if pm.offload.optimizer is None else "overlap" if host is not None else "sync")
    issued = [c.key() for c in pm.collectives]
    sd = pm.full_state_dict()
    out = pm(data[STEPS][0]) if job.get("forward") else None
    res = {"losses": losses, "issued": issued, "coord": tuple(pm.mesh.get_coordinate()),
           "names": tuple(pm.mesh.mesh_dim_names), "pp_rank": pm.coordinates.get("pp", 0),
           "fallbacks": sorted(pm.fallbacks), "engine": pm.engine, "reason": pm.engine_reason,
           "runners": sorted({type(ex).__name__ for ex in pm._made}),
           "traffic": {a: t["bytes"] for a, t in traffic_by_axis(pm.collectives).items()},
           "local": {s.name: (s.local.numel(), math.prod(s.plan.shape) if s.plan.shape else 1) for s in pm.store.slots},
           "regathers": _regathers(pm.store.ctx.reshard),
           "ahead": pm.store.ctx.groups.started_ahead if pm.store.ctx.groups is not None else 0,
           "nvme_rows": _nvme_rows(pm.store.ctx.nvme_rows),
           "held_bytes": sum(s.local.untyped_storage().nbytes() for s in pm.store.slots),
           "grads_written": pm.store.ctx.grad_files.written if pm.store.ctx.grad_files is not None else 0,
           "opt_rows": sum(s.opt_param.numel() for s in pm.store.slots),
           "acts_nvme": _acts_nvme(pm.offload.activations), "overlap": overlap}
    pm.close()
    if rank == 0:
        res.update(sd=sd, grads=grads, out=out)
    return res


def _acts_nvme(acts) -> tuple:
    """Offload nvme_activations (``runtime/nvme_activations.py``): (bytes written, bytes read back,
    tensors read ahead of their unpack, tensors unpacked)."""
    if getattr(acts, "writes", None) is None:
        return (0, 0, 0, 0)
    return (acts.written_bytes, acts.read_bytes, acts.read_ahead, acts.unpacked)


def _nvme_rows(rows) -> tuple:
    """Offload nvme_params (``runtime/nvme_rows.py``): (reads of rows from the files, their bytes,
    of them started ahead of their gather)."""
    return (rows.reads, rows.read_bytes, rows.read_ahead) if rows is not None else (0, 0, 0)


def _regathers(reshard) -> tuple:
    """ZeRO-3's backward re-gathers by group: (all, landed from a prefetch, prefetches never read)."""
    return (reshard.regathered, reshard.prefetched, reshard.dropped) if reshard is not None else (0, 0, 0)


def train_jobs(rank: int, world: int, jobs: list) -> list:
    return [train_job(rank, world, job) for job in jobs]


def reference(meta: bool, seed: int = 0, spec: str = "gpt-tiny") -> dict:
    """Same model, same batches, one process."""
    from autopar.runtime.init import materialize

    b = build(meta, spec)
    m = materialize(b.module, seed) if meta else b.module
    opt = sgd(m.parameters())
    data = batches(b)
    named = dict(m.named_parameters(remove_duplicate=False))
    losses, grads = [], []
    for x, y in data[:STEPS]:
        opt.zero_grad(set_to_none=True)
        loss = b.loss_fn(m(*x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        grads.append({k: v.grad.clone() for k, v in named.items()})
    with torch.no_grad():
        out = m(*data[STEPS][0])
    sd = {k: v.detach().clone() for k, v in named.items()}
    sd.update({k: v.detach().clone() for k, v in m.named_buffers()})     # as pm.full_state_dict()
    return {"losses": losses, "sd": sd,
            "grads": grads, "out": out}


def max_diff(a: dict, b: dict) -> tuple[float, Optional[str]]:
    worst, where = 0.0, None
    assert set(a) == set(b), f"names differ: {sorted(set(a) ^ set(b))[:6]}"
    for k in a:
        d = (a[k].float() - b[k].float()).abs().max().item()
        if d > worst:
            worst, where = d, k
    return worst, where


def _amax(t: torch.Tensor) -> float:
    return t.float().abs().max().item() if t.numel() else 0.0


def training_ratios(got: dict, want: dict) -> dict:
    """Per check, the worst (difference / bound, where) of run ``got`` against run ``want``: each
    {"losses": [per step], "grads": [per step {name: full grad}], "sd": {name: full param}}, the
    same K steps of ``sgd`` from the same parameters. A ratio above 1 is more than round-off."""
    worst = {}

    def note(check, d, bound, where):
        r = d / bound if bound > 0 else (0.0 if d == 0 else float("inf"))
        if r >= worst.get(check, (-1.0, None))[0]:
            worst[check] = (r, f"{where}: differs by {d:.3e}, bound {bound:.3e}")

    steps = len(want["losses"])
    assert len(got["losses"]) == steps and len(got["grads"]) == len(want["grads"]) == steps
    for t, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        note("loss", abs(a - b), RTOL_LOSS * abs(b), f"loss at step {t + 1} ({a!r} vs {b!r})")
    g_bound = {}                       # name -> sum over steps of (K - t + 1) * bound on dg_t
    for t, (ga, gb) in enumerate(zip(got["grads"], want["grads"])):
        assert set(ga) == set(gb), f"names differ: {sorted(set(ga) ^ set(gb))[:6]}"
        rtol = RTOL_GRAD_FIRST if t == 0 else RTOL_GRAD
        for k in gb:
            bound = rtol * _amax(gb[k])
            note("grad_first" if t == 0 else "grad", _amax(ga[k] - gb[k]), bound,
                 f"gradient {k} at step {t + 1}")
            g_bound[k] = g_bound.get(k, 0.0) + (steps - t) * bound
    assert set(got["sd"]) == set(want["sd"]), f"names differ: {sorted(set(got['sd']) ^ set(want['sd']))[:6]}"
    for k, p in want["sd"].items():
        if k not in g_bound:           # a buffer: no optimizer touches it
            note("buffer", _amax(got["sd"][k] - p), 4 * EPS32 * _amax(p), f"buffer {k}")
            continue
        # SGD momentum: p_K = p_0 - lr * sum_t b_t, b_t = mu * b_(t-1) + g_t + wd * p_(t-1), so with
        # mu <= 1 dp_K <= lr * sum_t (K - t + 1) * dg_t, plus <= 1 ulp of |p| per rounded update.
        bound = LR * g_bound[k] + steps * EPS32 * _amax(p)
        note("param", _amax(got["sd"][k] - p), bound, f"parameter {k} after {steps} steps")
    return worst


def check_training(got: dict, want: dict, what: str = "") -> None:
    for check, (r, msg) in training_ratios(got, want).items():
        assert r <= 1.0, f"{what}{msg}"


def check_against_reference(results: list, ref: dict) -> None:
    for r, res in enumerate(results):
        for t, (got, want) in enumerate(zip(res["losses"], ref["losses"])):
            assert abs(got - want) <= RTOL_LOSS * abs(want), \
                f"rank {r}: losses {res['losses']} vs reference {ref['losses']}"
    top = results[0]
    check_training(top, ref)
    if top["out"] is not None:
        d, bound = _amax(top["out"] - ref["out"]), RTOL_OUT * _amax(ref["out"])
        assert d <= bound, f"forward output differs by {d:.3e}, bound {bound:.3e}"


def check_collectives(results: list, expected_for_tp_rank) -> None:
    """Every rank issued exactly STEPS times the predicted (kind, axis, nbytes, phase) multiset."""
    for r, res in enumerate(results):
        want = Counter()
        for key, n in Counter(c.key() for c in expected_for_tp_rank(res["coord"][1])).items():
            want[key] = n * STEPS
        got = Counter(res["issued"])
        assert got == want, (f"rank {r}: issued-but-not-predicted {dict(got - want)}, "
                             f"predicted-but-not-issued {dict(want - got)}")


# ---- bad input -------------------------------------------------------------------------------

def bad_input_cases(rank: int, world: int, cases: list) -> dict:
    """Run each case (name, plan JSON per rank or None, force, model spec); return the error each
    raised on this rank (type name and message), or "no error"."""
    from autopar.api import autoparallelize
    from autopar.models import build_model
    from autopar.plan import Plan

    out = {}
    for name, plan_jsons, force, spec in cases:
        torch.manual_seed(0)
        b = build_model(spec, device="cpu", batch=BATCH)
        plan = Plan.from_json(plan_jsons[rank]) if plan_jsons else None
        try:
            autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                            plan=plan, force=force, timeout_s=20)
            out[name] = "no error"
        except Exception as e:  # the test inspects what every rank raised
            out[name] = f"{type(e).__name__}: {e}"
    return out


def dies_early(rank: int, world: int) -> str:
    """Rank 1 fails before the first collective; rank 0 starts autoparallelize and would wait."""
    if rank == 1:
        raise RuntimeError("boom: rank 1 failed during setup")
    b = build(False)
    from autopar.api import autoparallelize

    autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                    timeout_s=3)
    return "finished"


def stalls(rank: int, world: int) -> str:
    """Rank 1 is alive but never joins (a diverging rank); rank 0 must time out by itself."""
    import time

    if rank == 1:
        time.sleep(30)
        return "slept"
    import torch.distributed as dist

    dist.all_gather_object([None] * world, "hello")
    return "gathered"


# ---- fused kernels ---------------------------------------------------------------------------

def fused_jobs(rank: int, world: int, jobs: list) -> list:
    """Each job: a plan (JSON), ``kernels`` mode, ``steps``, optional ``dp_mode`` and ``model``
    (a spec, default gpt-tiny), ``decline`` (region kernels whose adapter then always says no,
    so their members run one by one); the batches of ``train_job``. Returns losses, fused nodes
    and (rank 0) parameters and grads."""
    import time
    from dataclasses import replace

    from autopar.codegen import fused

    from autopar.api import autoparallelize
    from autopar.plan import Plan

    out = []
    adapters = dict(fused.REGION_ADAPTERS)
    for job in jobs:
        fused.REGION_ADAPTERS.update(adapters)
        for k in job.get("decline", ()):
            fused.REGION_ADAPTERS[k] = replace(adapters[k], check=lambda m, ops: "declined by the test")
        b = build(False, job.get("model", "gpt-tiny"))
        data = batches(b, job["steps"])
        kwargs = {k: job[k] for k in ("dp_mode",) if k in job}
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             optimizer=sgd, plan=Plan.from_json(job["plan"]), timeout_s=60,
                             kernels=job["kernels"], **kwargs)
        pm.reset_collectives()
        t0 = time.perf_counter()
        losses, grads, step_s = [], [], 0.0
        for x, y in data[:job["steps"]]:
            losses.append(pm.step(x, y))
            step_s += time.perf_counter() - t0
            grads.append(pm.full_grad_dict())   # gathers outside the recorder: not in "issued"
            t0 = time.perf_counter()
        res = {"losses": losses, "fused": list(pm.fused_kernels), "fallbacks": sorted(pm.fallbacks),
               "step_s": step_s / job["steps"],
               "issued": [c.key() for c in pm.collectives], "coord": tuple(pm.mesh.get_coordinate())}
        sd = pm.full_state_dict()
        if rank == 0:
            res.update(sd=sd, grads=grads)
        out.append(res)
    return out


def check_collectives_per_rank(results: list, expected_for_rank, what: str = "") -> None:
    """As ``check_collectives``, with the prediction made from each rank's whole result
    (``expected_for_rank(res)``: its ``coord`` on the stage mesh and its ``pp_rank``)."""
    for r, res in enumerate(results):
        want = Counter()
        for key, n in Counter(c.key() for c in expected_for_rank(res)).items():
            want[key] = n * STEPS
        got = Counter(res["issued"])
        assert got == want, (f"{what}rank {r}: issued-but-not-predicted {dict(got - want)}, "
                             f"predicted-but-not-issued {dict(want - got)}")
