"""Elementwise losses (MSE, smooth L1, Huber) split over the batch: each rank computes its rows'
share (``solver/rules.py``'s ``_pointwise_loss``, run by ``codegen/fallback.py``: DTensor's own
decomposition gets a split mean's gradient wrong by the rank count). Before, no rule covered them:
the data axis was solved and gathered the model's output over dp to compute the loss whole. Each
run equals one process (losses, every step's gradients, final weights), issues exactly the
predicted collectives, and gathers nothing over dp in its forward."""
from __future__ import annotations

import pytest

from autopar.codegen.expected import expected_collectives
from autopar.cost.hardware import resolve_cluster
from autopar.mesh import DATA
from autopar.placements import Partial, Shard
from autopar.runtime.launch import spawn_ranks
from autopar.solver.forcing import parse_force
from autopar.solver.search import plan_model
from bodies import BATCH, check_against_reference, check_collectives, full_trace, reference, train_jobs
from pointwise_loss_models import HUBER_NONE, MSE, SMOOTH_L1_SUM

pytestmark = pytest.mark.slow
LOSSES = ("mse_loss", "smooth_l1_loss", "huber_loss")
CASES = {2: [(MSE, "dp=2"), (SMOOTH_L1_SUM, "dp=2,mbs=1"), (HUBER_NONE, "dp=2")], 4: [(MSE, "dp=2,tp=2")]}


def _plan(spec: str, force: str, world: int):
    graph = full_trace(BATCH, spec)
    return graph, plan_model(graph, resolve_cluster("h100", nodes=1, gpus_per_node=world), global_batch=BATCH,
                             seq_len=None, dtype="float32", force=parse_force(force))


@pytest.fixture(scope="module", params=sorted(CASES))
def runs(request):
    world = request.param
    planned = [(spec, *_plan(spec, force, world)) for spec, force in CASES[world]]
    jobs = [{"plan": plan.to_json(), "spec": spec} for spec, _, plan in planned]
    per_rank = spawn_ranks(train_jobs, world, (jobs,), timeout_s=180)
    return [(spec, graph, plan, [r[i] for r in per_rank]) for i, (spec, graph, plan) in enumerate(planned)]


def test_a_split_loss_runs_exactly(runs):
    for spec, graph, plan, results in runs:
        di = plan.mesh_axes.index(DATA)
        loss = next(s for s in plan.strategies if any(name in s.key for name in LOSSES))
        assert loss.inputs[0][di] == Shard(0) and loss.inputs[1][di] == Shard(0), loss
        assert isinstance(loss.output[di], Partial) or loss.output[di] == Shard(0), loss   # "none": rows
        check_against_reference(results, reference(False, 0, spec))
        check_collectives(results, lambda tp_rank: expected_collectives(graph, plan, tp_rank=tp_rank))
        assert not any(k[0] == "all_gather" and k[1] == "dp" and k[3] == "forward" for k in results[0]["issued"])
