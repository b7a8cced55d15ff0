"""Activation offload under autocast (``runtime/offload.py``): the low-precision copy autocast makes
of a resident weight, which each matmul saves, is made again from the weight in the backward
instead of sent to the host and back (``activation_offload.cast_of_resident``, ``params.resident_source``).
Bit for bit what the same plan trains without offload (the same rounding of the same values), on
the DTensor path (tp=2) and the plain-tensor path (dp=2); one recast per weight copy the planner
counts (``solver/autocast.weight_copies``) and per micro-batch; none where the weight is gathered
(ZeRO-3: the gathered copy is not resident, it is offloaded as before). A parameter changed in place
between forward and backward is an error, not a stale copy."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.runtime.launch import spawn_ranks
from bodies import STEPS, batches, build, sgd
from handplans import hand_plan

pytestmark = pytest.mark.slow


def _train(rank: int, world: int, plan_json: str) -> dict:
    from autopar.api import autoparallelize
    from autopar.plan import Plan

    b = build(False)
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         optimizer=sgd, plan=Plan.from_json(plan_json), timeout_s=60)
    sent = []
    act = pm.offload.activations if pm.offload is not None else None
    if act is not None:
        to_host = act.to_host
        act.to_host = lambda local: sent.append(local.nbytes) or to_host(local)
    losses = [pm.step(x, y) for x, y in batches(b)[:STEPS]]
    out = {"losses": losses, "sd": pm.full_state_dict(), "recast": act.recast if act is not None else 0,
           "sent": sum(sent)}
    pm.close()
    return out


def _planned_copies(graph) -> int:
    """Weight copies autocast saves per micro-batch, as the planner counts them."""
    from autopar.solver.autocast import autocast_dtypes, weight_copies
    from autopar.solver.strategies import graph_facts

    facts = graph_facts(graph, None)
    return sum(len(v) for v in weight_copies(facts, autocast_dtypes(facts, "bfloat16", "cpu")).values())


@pytest.mark.parametrize("layout, recast", [(dict(dp=1, tp=2, family="megatron"), True),
                                            (dict(dp=2, tp=1, mbs=1), True),
                                            (dict(dp=2, tp=1, zero=3), False)],
                         ids=["tp2", "dp2-two-micro-batches", "dp2-zero3"])
def test_offloaded_weight_copies_are_recast_exactly(tiny_full, layout, recast):
    base = dataclasses.replace(hand_plan(tiny_full, **layout), dtype="bfloat16")
    runs = {off: spawn_ranks(_train, base.mesh.size, (dataclasses.replace(base, offload=off).to_json(),),
                             timeout_s=120) for off in ("none", "activations")}
    for want, got in zip(runs["none"], runs["activations"]):
        assert got["losses"] == want["losses"]
        for k, v in want["sd"].items():
            assert torch.equal(got["sd"][k], v), k
    per_step = _planned_copies(tiny_full) * base.num_micro_batches
    for r in runs["activations"]:
        assert r["recast"] == (per_step * STEPS if recast else 0), (r["recast"], per_step)
        assert r["sent"] > 0


def test_a_parameter_changed_in_place_before_the_backward_is_an_error():
    from autopar.runtime.activation_offload import _Recast, recast

    w = torch.randn(4, 3)
    saved = _Recast(w, w._version, torch.bfloat16, ((3, 4), (1, 3), 0), None)
    assert torch.equal(recast(saved), w.to(torch.bfloat16).t())
    w.add_(1.0)
    with pytest.raises(RuntimeError, match="changed between the forward and the backward"):
        recast(saved)
