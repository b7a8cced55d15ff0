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


def engine_job(rank: int, world: int, job: dict) -> dict:
    """``bodies.train_job`` with ``job["engine"]``: STEPS steps, then what the test compares; also
    the engine that ran (``pm.engine``, ``pm.engine_reason``). ``job["expect_error"]``: building
    must raise; the error (type: message) is returned instead."""
    from autopar.api import autoparallelize
    from autopar.plan import Plan
    from bodies import STEPS, batches, build, sgd

    b = build(job.get("meta", False), job.get("spec", "gpt-tiny"))
    data = batches(b)
    kwargs = {k: job[k] for k in ("dp_mode",) if k in job}
    try:
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             optimizer=sgd, plan=Plan.from_json(job["plan"]), seed=job.get("seed", 0),
                             timeout_s=30, engine=job["engine"], **kwargs)
    except Exception as e:  # the test inspects what every rank raised
        if not job.get("expect_error"):
            raise
        return {"error": f"{type(e).__name__}: {e}"}
    pm.reset_collectives()
    losses, grads = [], []
    for x, y in data[:STEPS]:
        losses.append(pm.step(x, y))
        grads.append(pm.full_grad_dict())       # gathers outside the recorder: not in ``issued``
    issued = [c.key() for c in pm.collectives]
    sd = pm.full_state_dict()
    out = pm(data[STEPS][0]) if job.get("forward") else None
    res = {"losses": losses, "issued": issued, "coord": tuple(pm.mesh.get_coordinate()),
           "pp_rank": pm.coordinates.get("pp", 0), "engine": pm.engine, "reason": pm.engine_reason,
           "runners": sorted({type(ex).__name__ for ex in pm._made})}
    if rank == 0:
        res.update(sd=sd, grads=grads, out=out)
    return res


def engine_jobs(rank: int, world: int, jobs: list) -> list:
    return [engine_job(rank, world, job) for job in jobs]


def gap_job(rank: int, world: int) -> dict:
    """A model with in-place buffer writes (BatchNorm statistics, a counter; buffer_bodies.BNNet)
    planned dp=2: "auto" falls back to the interpreter (one step runs), "emitted" raises."""
    from autopar.api import autoparallelize
    from buffer_bodies import build as build_bn, data, loss_fn, sgd

    x, y = data()[0]
    pm = autoparallelize(build_bn(), x, loss_fn=loss_fn, example_target=y, optimizer=sgd, force="dp=2",
                         timeout_s=60, engine="auto")
    pm.step(x, y)
    out = {"engine": pm.engine, "reason": pm.engine_reason,
           "runners": sorted({type(ex).__name__ for ex in pm._made})}
    try:
        autoparallelize(build_bn(), x, loss_fn=loss_fn, example_target=y, optimizer=sgd, plan=pm.plan,
                        timeout_s=60, engine="emitted")
        out["error"] = "no error"
    except Exception as e:  # the test inspects what every rank raised
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def two_rank_cases(rank: int, world: int, jobs: list) -> dict:
    return {"jobs": engine_jobs(rank, world, jobs), "gap": gap_job(rank, world)}
