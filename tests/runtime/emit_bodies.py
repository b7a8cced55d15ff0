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
    """A model whose constant causal mask is checked on the first step (``causal_check.py``; the
    trace-time fold turned off on this rank, as ``tests/trace/test_causal_masks.py`` does) planned
    dp=2: "auto" falls back to the interpreter (one step runs), "emitted" raises."""
    import torch

    from autopar.api import autoparallelize
    from autopar.trace import causal_masks
    from masked_attention import T, MaskedAttention, loss

    causal_masks.MAX_ELEMENTS = 0               # this rank only: nothing folds at trace time
    torch.manual_seed(0)
    x = torch.randint(0, 16, (4, T), generator=torch.Generator().manual_seed(1))
    sgd = lambda params: torch.optim.SGD(params, lr=0.5)      # noqa: E731
    pm = autoparallelize(MaskedAttention("causal"), (x,), loss_fn=loss, example_target=x, optimizer=sgd,
                         force="dp=2", timeout_s=60, engine="auto")
    pm.step((x,), x)
    out = {"engine": pm.engine, "reason": pm.engine_reason,
           "runners": sorted({type(ex).__name__ for ex in pm._made})}
    try:
        autoparallelize(MaskedAttention("causal"), (x,), loss_fn=loss, example_target=x, optimizer=sgd,
                        plan=pm.plan, timeout_s=60, engine="emitted")
        out["error"] = "no error"
    except Exception as e:  # the test inspects what every rank raised
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def two_rank_cases(rank: int, world: int, jobs: list) -> dict:
    return {"jobs": engine_jobs(rank, world, jobs), "gap": gap_job(rank, world)}
