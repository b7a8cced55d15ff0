"""Rank bodies for test_emit.py: the emitted stage module against the GraphExecutor."""
from __future__ import annotations


def emitted_vs_executor(rank: int, world: int, plan_json: str) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from autopar.api import autoparallelize
    from autopar.codegen.emit import bind, constants_of, emit_stage
    from autopar.plan import Plan
    from bodies import batches, build, sgd

    b = build(False)
    x, y = batches(b)[0]
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         optimizer=sgd, plan=Plan.from_json(plan_json), timeout_s=30)
    mesh = pm.mesh

    def full(v):
        return v.full_tensor() if isinstance(v, DTensor) else v

    with torch.no_grad():
        want = full(pm._user_output(pm._train_graph, pm._train.run(x, y)))
        gm = emit_stage(pm._train_graph, pm.program, fallbacks=sorted(pm.fallbacks))
        bind(gm, mesh=mesh, params=pm.store, buffers=pm._buffers, constants=constants_of(pm._train_graph))
        rep = [Replicate()] * mesh.ndim
        got = full(gm(*[distribute_tensor(t, mesh, rep) for t in (*x, y)]))
    return {"want": float(want), "got": float(got), "code": gm.code if rank == 0 else ""}


def engine_jobs(rank: int, world: int, jobs: list) -> list:
    """``bodies.train_job`` per job, each with its ``job["engine"]``."""
    from bodies import train_job

    return [train_job(rank, world, job) for job in jobs]


def gap_job(rank: int, world: int) -> dict:
    """gpt-tiny planned dp=2 with fused kernels on (``kernels="on"``: substituted per node from the
    run-time placements, ``codegen/fused.py``): "auto" builds on the interpreter, "emitted" raises.
    (No step: the kernels run under Triton's interpreter here; ``test_fused_kernels.py`` trains them.)"""
    from autopar.api import autoparallelize
    from bodies import build, sgd

    b = build(False)
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         optimizer=sgd, force="dp=2", timeout_s=60, engine="auto", kernels="on")
    out = {"engine": pm.engine, "reason": pm.engine_reason,
           "runners": sorted({type(ex).__name__ for ex in pm._made})}
    try:
        autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                        optimizer=sgd, plan=pm.plan, timeout_s=60, engine="emitted", kernels="on")
        out["error"] = "no error"
    except Exception as e:  # the test inspects what every rank raised
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def two_rank_cases(rank: int, world: int, jobs: list) -> dict:
    return {"jobs": engine_jobs(rank, world, jobs), "gap": gap_job(rank, world)}
