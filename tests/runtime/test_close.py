"""``ParallelModel.close`` frees the model's memory at once (``autopar/api.py``): parameters,
gradients, optimizer state and saved activations' host copies are gone when it returns, with
Python's collector disabled around it (an FX graph is a reference cycle: without the collection in
``close`` they waited for a later full pass, and a second model built in the same process found the
first one still allocated). After it the model says it was closed; its plan and step count stay;
``with autoparallelize(...) as pm:`` closes at the block's end."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from autopar.runtime.launch import spawn_ranks


def _body(rank: int, world: int, force: str) -> dict:
    from autopar.api import autoparallelize
    from autopar.models import build_model
    from bodies import adamw

    b = build_model("gpt-tiny", device="meta")
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         force=force, seed=0, model_name="gpt-tiny", optimizer=adamw, record_collectives=False)
    x, y = b.make_batch(b.example_inputs[0].shape[0], torch.Generator().manual_seed(0))
    pm.step(x, y)
    held = [s.local for s in pm.store.slots]
    held += [t for st in pm.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    held += [s.local.grad for s in pm.store.slots if s.local.grad is not None]
    refs = [weakref.ref(t) for t in held]
    del held
    gc.collect()
    gc.disable()            # only close's own collection may free the cycles
    try:
        pm.close()
        alive_after_close = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    pm.close()              # idempotent
    with pytest.raises(AttributeError, match="closed"):
        pm.step(x, y)
    # a model never built (no example_target) is not built by a step after close; a with-block closes
    lazy = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, force=force, seed=0,
                           model_name="gpt-tiny", optimizer=adamw, record_collectives=False)
    with lazy:
        pass
    with pytest.raises(AttributeError, match="closed"):
        lazy.step(x, y)
    return {"tracked": len(refs), "alive": alive_after_close, "steps": pm.steps_done,
            "dp": pm.plan.dp, "engine": pm.engine}


@pytest.mark.parametrize("force", ["dp=1,tp=1,pp=1", "dp=1,tp=1,pp=1,offload=optimizer+activations"])
def test_close_frees_the_model_at_once(force):
    (out,) = spawn_ranks(_body, 1, (force,), timeout_s=60)
    assert out["tracked"] > 10 and out["alive"] == 0, out
    assert out["steps"] == 1 and out["dp"] == 1 and out["engine"]
