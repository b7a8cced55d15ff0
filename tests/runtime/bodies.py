"""What the test ranks run (module-level functions: spawned ranks import them), and the
single-process reference they are compared with."""
from __future__ import annotations

from collections import Counter
from typing import Optional

import torch

BATCH = 4
STEPS = 3
DATA_SEED = 1


def adamw(params):
    # eps 1e-6, not 1e-8: Adam divides by sqrt(v) + eps, so a gradient entry near 0 turns
    # rounding-level differences (any change of reduction order, DDP included) into parameter
    # differences of up to lr/eps times them; 1e-6 keeps that below the 1e-5 tolerance.
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.01)


LLAMA_TINY = "llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"


def build(meta: bool, spec: str = "gpt-tiny"):
    from autopar.models import build_model

    if meta:
        return build_model(spec, device="meta", batch=BATCH)
    torch.manual_seed(0)
    return build_model(spec, device="cpu", batch=BATCH)


def batches(b, n: int = STEPS):
    gen = torch.Generator().manual_seed(DATA_SEED)
    return [b.make_batch(BATCH, gen) for _ in range(n + 1)]     # the last one for a forward check


def train_job(rank: int, world: int, job: dict) -> dict:
    from autopar.api import autoparallelize
    from autopar.plan import Plan

    b = build(job.get("meta", False))
    data = batches(b)
    kwargs = {k: job[k] for k in ("bucket_bytes", "dp_mode") if k in job}
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         optimizer=adamw, plan=Plan.from_json(job["plan"]), seed=job.get("seed", 0),
                         timeout_s=30, **kwargs)
    pm.reset_collectives()
    losses = [pm.step(x, y) for x, y in data[:STEPS]]
    issued = [c.key() for c in pm.collectives]
    sd = pm.full_state_dict()
    grads = pm.full_grad_dict()
    out = pm(data[STEPS][0]) if job.get("forward") else None
    res = {"losses": losses, "issued": issued, "coord": tuple(pm.mesh.get_coordinate()),
           "fallbacks": sorted(pm.fallbacks)}
    if rank == 0:
        res.update(sd=sd, grads=grads, out=out)
    return res


def train_jobs(rank: int, world: int, jobs: list) -> list:
    return [train_job(rank, world, job) for job in jobs]


def reference(meta: bool, seed: int = 0) -> dict:
    """Same model, same batches, one process."""
    from autopar.runtime.init import materialize

    b = build(meta)
    m = materialize(b.module, seed) if meta else b.module
    opt = adamw(m.parameters())
    data = batches(b)
    losses = []
    for x, y in data[:STEPS]:
        opt.zero_grad(set_to_none=True)
        loss = b.loss_fn(m(*x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        out = m(*data[STEPS][0])
    named = dict(m.named_parameters(remove_duplicate=False))
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in named.items()},
            "grads": {k: v.grad.clone() for k, v in named.items()}, "out": out}


def max_diff(a: dict, b: dict) -> tuple[float, Optional[str]]:
    worst, where = 0.0, None
    assert set(a) == set(b), f"names differ: {sorted(set(a) ^ set(b))[:6]}"
    for k in a:
        d = (a[k].float() - b[k].float()).abs().max().item()
        if d > worst:
            worst, where = d, k
    return worst, where


def check_against_reference(results: list, ref: dict, tol: float = 1e-5) -> None:
    for r, res in enumerate(results):
        for got, want in zip(res["losses"], ref["losses"]):
            assert abs(got - want) <= tol, f"rank {r}: losses {res['losses']} vs reference {ref['losses']}"
    top = results[0]
    d, k = max_diff(top["sd"], ref["params"])
    assert d <= tol, f"parameter {k} differs by {d:.3e}"
    d, k = max_diff(top["grads"], ref["grads"])
    assert d <= tol, f"gradient {k} differs by {d:.3e}"
    if top["out"] is not None:
        d = (top["out"] - ref["out"]).abs().max().item()
        assert d <= tol, f"forward output differs by {d:.3e}"


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
                             optimizer=adamw, plan=Plan.from_json(job["plan"]), timeout_s=60,
                             kernels=job["kernels"], **kwargs)
        pm.reset_collectives()
        t0 = time.perf_counter()
        losses = [pm.step(x, y) for x, y in data[:job["steps"]]]
        res = {"losses": losses, "fused": list(pm.fused_kernels), "fallbacks": sorted(pm.fallbacks),
               "step_s": (time.perf_counter() - t0) / job["steps"],
               "issued": [c.key() for c in pm.collectives], "coord": tuple(pm.mesh.get_coordinate())}
        sd, grads = pm.full_state_dict(), pm.full_grad_dict()
        if rank == 0:
            res.update(sd=sd, grads=grads)
        out.append(res)
    return out
