"""Plans whose DATA axis differs from the batch shards run exactly and issue what is predicted
(``solver/data_axis.py``): a max over the batch (its input all-gathered over dp, then computed
whole), and ViT's class token (a parameter broadcast to the batch, whose gradient stays Partial on
dp up to the reducer, ``RankProgram.positional``), and a loss read off the batch's max (whole on
every rank: no all-reduce of its value is issued, and none is priced). Each run equals one process
(losses, every step's gradients, final weights) and every rank issues exactly the predicted
collectives; the statistic in repeated blocks under dp x tp too (one micro-batch: with several, a
statistic over the batch is each micro-batch's, as BatchNorm's)."""
from __future__ import annotations

import pytest

from autopar.codegen.expected import expected_collectives
from autopar.cost.hardware import resolve_cluster
from autopar.mesh import DATA
from autopar.placements import Replicate
from autopar.runtime.launch import spawn_ranks
from autopar.solver.forcing import parse_force
from autopar.solver.search import plan_model
from batch_stat_models import LOSS_SPEC as LOSS_MAX, SPEC as BATCH_MAX, STACK_SPEC
from bodies import BATCH, check_against_reference, check_collectives, full_trace, reference, train_jobs

pytestmark = pytest.mark.slow
VIT = "vit:image=32,patch=8,layers=2,hidden=64,heads=4,mlp=128,classes=10"


def _plan(spec: str, force: str, world: int):
    graph = full_trace(BATCH, spec)
    return graph, plan_model(graph, resolve_cluster("h100", nodes=1, gpus_per_node=world), global_batch=BATCH,
                             seq_len=None, dtype="float32", force=parse_force(force))


@pytest.mark.parametrize("spec,force,world,dp_mode", [(BATCH_MAX, "dp=2", 2, "auto"), (BATCH_MAX, "dp=2", 2, "dtensor"),
                                                      (STACK_SPEC, "dp=2,tp=2", 4, "auto"),
                                                      (VIT, "dp=2,tp=2", 4, "auto"), (LOSS_MAX, "dp=2", 2, "auto")])
def test_solved_data_axis_runs_exactly(spec, force, world, dp_mode):
    graph, plan = _plan(spec, force, world)
    if spec in (BATCH_MAX, STACK_SPEC):        # the max reads its input whole: gathered over dp
        amax = next(s for s in plan.strategies if "amax" in s.key)
        di = plan.mesh_axes.index(DATA)
        assert amax.output[di] == Replicate() and amax.inputs[0][di] == Replicate()
    job = {"plan": plan.to_json(), "spec": spec, "dp_mode": dp_mode}
    results = [r[0] for r in spawn_ranks(train_jobs, world, ([job],), timeout_s=120)]
    check_against_reference(results, reference(False, 0, spec))
    check_collectives(results, lambda tp_rank: expected_collectives(graph, plan, tp_rank=tp_rank))
    if spec in (BATCH_MAX, STACK_SPEC):
        assert any(k[0] == "all_gather" and k[1] == "dp" and k[3] == "forward" for k in results[0]["issued"])
    if spec == LOSS_MAX:     # the loss is read whole on each rank: no one-value all-reduce, and none priced
        assert not any(k[0] == "all_reduce" and k[1] == "dp" and k[3] == "forward" for k in results[0]["issued"])
        assert "dp:all_reduce" not in dict(plan.step_time.comm_s)
