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
