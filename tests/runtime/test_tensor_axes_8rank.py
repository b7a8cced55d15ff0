"""The planner's multi-axis tensor parallelism on 8 ranks (``solver/tensor_axes.py``).

Plans for 8 GPUs whose links cost nothing (so that splitting gpt-tiny pays on every axis):
- ``--force tp=8,tpmode=3d``: the stage mesh ("tp3", "tp2", "tp") = (2, 2, 2) (no data axis of
  size 1: ``search._has_data_axis``);
- ``--force tp=8,tpmode=2.5d``: d x q x q with d, q >= 2 has one shape on 8 ranks, 2 x 2 x 2, and
  the planner makes the 3-D plan itself (checked without ranks, so it is not trained twice);
- ``--force pp=2,tp=4,tpmode=2d``: two pipeline stages, each on ("tp2", "tp") = (2, 2).
One 8-rank launch trains the pipelined plan 3 SGD steps against one process (bodies.py's bounds)
and records each rank's collectives and storage; the collective prediction
(``expected_pipeline_collectives``, given every tensor axis' coordinate) is checked in a test of
its own, apart from the numerics. A second launch trains the 3-D plan 3 steps against one process
(about 20 s; it took 6 minutes while the plan split a linear along the sequence, a strided split
inside DTensor that sends its sharding propagation to a shortest-path search per candidate, and
finished no step in 10 minutes with a size-1 data axis in the mesh)."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import pytest

from autopar.plan import Plan
from autopar.runtime.collectives import traffic_by_axis
from autopar.runtime.launch import spawn_ranks
from bodies import (BATCH, check_against_reference, check_collectives_per_rank, full_trace, reference, train_job,
                    train_jobs)

BIG = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
WORLD = 8


def _solve(graph, force: str) -> Plan:
    """The planner's plan of ``graph`` under ``force`` for 8 GPUs on one node with free links."""
    from autopar.cost.hardware import LinkSpec, make_cluster
    from autopar.solver.forcing import parse_force
    from autopar.solver.search import plan_model

    free = LinkSpec("free", busbw_Bps=1e15, latency_s=0.0, source="test")
    cluster = dataclasses.replace(make_cluster("h100", 1, WORLD), intra=free, inter=free)
    seq = next(n.out.shape[1] for n in graph.nodes if n.kind == "input")
    return plan_model(graph, cluster, global_batch=BATCH, seq_len=seq, dtype="float32", force=parse_force(force))


@pytest.fixture(scope="module")
def plan_3d(tiny_full):
    return _solve(tiny_full, f"tp=8,tpmode=3d,mbs={BATCH}")


@pytest.fixture(scope="module")
def plan_3d_sp(tiny_full):
    """The 3-D plan with sequence parallelism, one sequence per micro-batch (the inner axis splits
    the sequence; the degenerate free links also make it move a Partial value whose strides are not
    contiguous, ``edges._contiguous``)."""
    return _solve(tiny_full, "tp=8,tpmode=3d,sp=on,mbs=1")


@pytest.fixture(scope="module")
def plan_25d(tiny_full):
    return _solve(tiny_full, f"tp=8,tpmode=2.5d,mbs={BATCH}")


@pytest.fixture(scope="module")
def plan_pp(tiny_bundle):
    """Pipeline stages are planned on the trace with each repeated block once (the default; the
    planner refuses pp > 1 on the trace of every layer, ``tiny_full``)."""
    from autopar.trace import trace_model

    b = tiny_bundle
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                        model_name="gpt-tiny")
    return _solve(graph, "pp=2,tp=4,tpmode=2d")


# ---- the plans (no ranks) ------------------------------------------------------------------------

def test_3d_plan_lays_tp_out_on_three_axes(plan_3d):
    assert plan_3d.mesh_axes == ("tp3", "tp2", "tp") and plan_3d.mesh_shape == (2, 2, 2)
    assert plan_3d.tp == 8 and plan_3d.pp == 1 and plan_3d.world_size == WORLD
    assert plan_3d.summary()["tensor_parallel_mode"] == "3d" and plan_3d.idle_axes() == ()


def test_no_linear_is_split_along_an_inner_row_dim(plan_3d, tiny_full):
    """A linear's input split along T of (B, T, k) is a strided split inside DTensor's flattened
    matmul, whose weight-gradient matmul then gathers both operands whole (measured on this plan:
    2 + 2 + 1 all-gathers per layer beyond the prediction); the tensor axes' tables leave such
    splits out (``strategies._inner_row_split``), so here c_proj splits the batch on tp3."""
    from autopar.placements import Shard

    ndim = {n.key: len(n.out.shape) for n in tiny_full.nodes if n.outputs}
    linears = [s for s in plan_3d.strategies if "aten.linear" in s.key]
    assert len(linears) == 9
    for s in linears:
        x = s.inputs[0]
        src = next(n.inputs[0].key for n in tiny_full.nodes if n.key == s.key)
        assert not any(isinstance(p, Shard) and 0 < p.dim < ndim[src] - 1 for p in x), s


def test_25d_plan_on_8_ranks_is_the_3d_plan(plan_3d, plan_25d):
    """tp = 8 = d x q x q only as 2 x 2 x 2, which is the 3-D mesh (``mesh.tensor_mode``): the
    planner gives the same mesh and the same placements, so the 3-D launch stands for both."""
    assert plan_25d.mesh_axes == plan_3d.mesh_axes and plan_25d.mesh_shape == plan_3d.mesh_shape
    assert plan_25d.strategies == plan_3d.strategies
    assert plan_25d.summary()["tensor_parallel_mode"] == "3d"


def test_pipelined_2d_plan(plan_pp):
    assert plan_pp.pp == 2 and plan_pp.tp == 4 and plan_pp.world_size == WORLD
    assert plan_pp.mesh_axes == ("tp2", "tp") and plan_pp.mesh_shape == (2, 2)
    assert plan_pp.summary()["tensor_parallel_mode"] == "2d" and plan_pp.idle_axes() == ()


def test_pipeline_prediction_takes_every_tensor_coordinate(plan_pp):
    """``expected_pipeline_collectives`` predicts a rank's layouts from its coordinate on each
    tensor axis of the stage mesh (tp2 as well as tp), not on dp."""
    from autopar.codegen.expected_pipeline import tensor_coords

    assert tensor_coords(plan_pp.stage_mesh, (1, 0)) == {"tp2": 1, "tp": 0}


# ---- one 8-rank launch ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ran_pp(plan_pp):
    return spawn_ranks(train_job, WORLD, ({"plan": plan_pp.to_json(), "timeout_s": 120},), timeout_s=150)


@functools.lru_cache(maxsize=None)
def _reference():
    return reference(False, 0)


@pytest.mark.slow
def test_pipelined_2d_plan_trains_like_one_process(ran_pp):
    """Two stages of a 2 x 2 tensor mesh: activations sent on pp, traffic on tp2 and tp."""
    runs = ran_pp
    check_against_reference(runs, _reference())
    coords = sorted((r["pp_rank"],) + r["coord"] for r in runs)
    assert coords == list(itertools.product(range(2), repeat=3))
    for r in runs:
        assert r["names"] == ("tp2", "tp")
        assert all(r["traffic"].get(a, 0) > 0 for a in ("pp", "tp2", "tp")), r["traffic"]


def _quarters(local: dict) -> set:
    """The big matrices of ``local`` (name -> (local, full) element counts), each asserted to hold
    1/4 of its elements: sharded on two tensor axes along two dims (the planner does not nest two
    axes' shards in one dim; on the 3-D mesh the third axis keeps them whole)."""
    big = {n: v for n, v in local.items() if n.endswith(BIG)}
    for name, (mine, full) in big.items():
        assert mine * 4 == full, (name, mine, full)
    return set(big)


@pytest.mark.slow
def test_pipelined_big_weights_store_a_quarter(ran_pp):
    """A pipeline rank holds its stage's layer only (4 big matrices), 1/4 of each; the two stages
    together hold both layers."""
    held = set()
    for r in ran_pp:
        mine = _quarters(r["local"])
        assert len(mine) == 4, sorted(mine)
        held |= mine
    assert len(held) == 8


def _coords_3d():
    return [dict(zip(("tp3", "tp2", "tp"), c)) for c in itertools.product(range(2), repeat=3)]


def test_3d_predicted_storage_and_traffic_use_every_tensor_axis(plan_3d, tiny_full):
    """Without ranks: on each coordinate of the 2 x 2 x 2 mesh the predicted layouts keep 1/4 of
    each big matrix, and the predicted collectives carry bytes on tp3, tp2 and tp."""
    from autopar.codegen.expected import expected_collectives, param_layouts
    from autopar.codegen.program import compile_program

    program = compile_program(tiny_full, plan_3d)
    full = {p.name: math.prod(p.shape) for p in program.params}
    for coords in _coords_3d():
        local = {l.name: (math.prod(l.local_shape), full[l.name]) for l in param_layouts(program, coords)}
        assert len(_quarters(local)) == 8
        traffic = traffic_by_axis(expected_collectives(tiny_full, plan_3d, tp_rank=coords))
        assert all(traffic.get(a, {"bytes": 0})["bytes"] > 0 for a in ("tp3", "tp2", "tp")), (coords, traffic)


# ---- the 3-D plan trained ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ran_3d_both(plan_3d, plan_3d_sp):
    jobs = [{"plan": p.to_json(), "timeout_s": 120} for p in (plan_3d, plan_3d_sp)]
    return spawn_ranks(train_jobs, WORLD, (jobs,), timeout_s=150)


@pytest.fixture(scope="module")
def ran_3d(ran_3d_both):
    return [r[0] for r in ran_3d_both]


@pytest.mark.slow
def test_3d_plan_trains_like_one_process(ran_3d, plan_3d, tiny_full):
    """The 2 x 2 x 2 tensor mesh (the 2.5-D plan on 8 ranks too) trains 3 SGD steps like one
    process, each rank holding a quarter of every big matrix, and issues exactly the collectives
    ``expected_collectives`` predicts from its coordinates, on tp3, tp2 and tp."""
    from autopar.codegen.expected import expected_collectives

    check_against_reference(ran_3d, _reference())
    assert sorted(r["coord"] for r in ran_3d) == list(itertools.product(range(2), repeat=3))
    for r in ran_3d:
        assert r["names"] == ("tp3", "tp2", "tp") and len(_quarters(r["local"])) == 8
        assert all(r["traffic"].get(a, 0) > 0 for a in ("tp3", "tp2", "tp")), r["traffic"]
    check_collectives_per_rank(ran_3d, lambda res: expected_collectives(
        tiny_full, plan_3d, tp_rank=dict(zip(res["names"], res["coord"]))))


# ---- the collectives, against the prediction -----------------------------------------------------

@pytest.mark.slow
def test_pipelined_2d_collectives_as_predicted(ran_pp, plan_pp):
    """Every pipeline rank issued exactly what ``expected_pipeline_collectives`` predicts from its
    pipeline coordinate and its coordinates on tp2 and tp (one micro-batch's trace)."""
    from autopar.codegen.expected_pipeline import expected_pipeline_collectives

    graph = full_trace(BATCH // plan_pp.num_micro_batches)
    check_collectives_per_rank(ran_pp, lambda res: expected_pipeline_collectives(
        graph, plan_pp, pp_rank=res["pp_rank"], coord=res["coord"]), "pp: ")



@pytest.mark.slow
def test_3d_sequence_parallel_plan_trains_like_one_process(ran_3d_both, plan_3d_sp):
    """Sequence parallelism on the inner axis of the 2 x 2 x 2 mesh: the sequence split on tp
    where the norms run, one process's losses, gradients and parameters after 3 steps, and exactly
    the predicted collectives on every rank (one micro-batch's trace, four micro-batches a step).
    (Refused before: the linears then took sequence-split inputs, whose propagation in DTensor
    took 10-55 s per signature over three axes; ``strategies._inner_row_split`` removed those.)"""
    from autopar.codegen.expected import expected_collectives
    from autopar.placements import Shard

    assert plan_3d_sp.sequence_parallel and plan_3d_sp.mesh_axes == ("tp3", "tp2", "tp")
    norms = [s for s in plan_3d_sp.strategies if "layer_norm" in s.key]
    assert norms and all(s.output[2] == Shard(1) for s in norms), norms
    runs = [r[1] for r in ran_3d_both]
    check_against_reference(runs, _reference())
    graph = full_trace(BATCH // plan_3d_sp.num_micro_batches)
    check_collectives_per_rank(runs, lambda res: expected_collectives(
        graph, plan_3d_sp, tp_rank=dict(zip(res["names"], res["coord"]))))
    for r in runs:
        assert all(r["traffic"].get(a, 0) > 0 for a in ("tp3", "tp2", "tp")), r["traffic"]
