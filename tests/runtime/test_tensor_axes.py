"""Parameters placed on more than one tensor-parallel mesh axis (2-D tensor parallelism).

The hand plan (``handplans.tensor_2d_plan``) runs gpt-tiny on the stage mesh ("tp2", "tp") =
(2, 2), dp = 1: Megatron on "tp", the batch split on "tp2", and every weight stored Shard on
"tp2" along a dim "tp" does not shard (the big matrices: 1/4 per rank), all-gathered on "tp2"
where it is read. One 4-rank launch trains it 3 SGD steps against one process (bodies.py's
bounds), records its collectives and storage, and round-trips a checkpoint."""
from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from autopar.codegen.program import ParamPlan, compile_program
from autopar.mesh import DATA, TENSOR, TENSOR2, TENSOR_AXES, Mesh, tensor_axes
from autopar.placements import Replicate, Shard
from autopar.plan import Plan
from autopar.runtime.collectives import traffic_by_axis
from autopar.runtime.launch import spawn_ranks
from bodies import STEPS, batches, build, check_against_reference, check_collectives_per_rank, reference, sgd
from handplans import hand_plan, tensor_2d_plan

BIG = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@pytest.fixture(scope="module")
def plan_2d(tiny_full):
    return tensor_2d_plan(tiny_full)


# ---- plan vocabulary (no ranks) -------------------------------------------------------------------

def test_tensor_axes_vocabulary():
    assert TENSOR_AXES == ("tp3", "tp2", "tp")
    assert tensor_axes(("dp", "tp2", "tp")) == ("tp2", "tp")
    assert tensor_axes(Mesh(("dp", "tp"), (2, 2)).axes) == ("tp",) and tensor_axes(("dp",)) == ()


def _from(plan: Plan, **changes) -> Plan:
    d = plan.to_dict()
    d.update(changes)
    return Plan.from_dict(d)


def test_plan_problems_accept_outer_tensor_axes(plan_2d):
    assert plan_2d.mesh_axes == ("tp2", "tp") and plan_2d.tp == 4 and plan_2d.world_size == 4
    assert plan_2d.stage_mesh == Mesh(("tp2", "tp"), (2, 2), plan_2d.cluster.gpus_per_node)
    with_dp = _from(plan_2d, mesh_axes=["dp", "tp2", "tp"], mesh_shape=[1, 2, 2])
    assert with_dp.world_size == 4 and with_dp.stage_mesh.size_of(TENSOR2) == 2


@pytest.mark.parametrize("changes, message", [
    (dict(tp=2), "tp is the total tensor degree: set tp=4"),
    (dict(mesh_axes=["tp", "tp2"]), "list them outermost first: ['tp2', 'tp']"),
    (dict(mesh_axes=["tp2", "tp", "dp"], mesh_shape=[2, 2, 1]), None),       # dp may sit anywhere
    (dict(mesh_axes=["tp2", "x"]), "name axes other than dp and tp (or the outer tensor axes tp3, tp2"),
])
def test_plan_problems_reject_wrong_tensor_axes(plan_2d, changes, message):
    if message is None:
        _from(plan_2d, **changes)
        return
    with pytest.raises(ValueError) as e:
        _from(plan_2d, **changes)
    assert message in str(e.value)


def test_param_storage_of_hand_plans(tiny_full, plan_2d):
    params = {p.name: p for p in compile_program(tiny_full, plan_2d).params}
    fc = params["transformer.h.0.mlp.c_fc.weight"]
    assert fc.tp == Shard(0) and fc.storage == ((TENSOR2, Shard(1)), (TENSOR, Shard(0)))
    assert fc.placements(("tp2", "tp")) == (Shard(1), Shard(0)) and fc.on(DATA) == Replicate()
    assert params["transformer.h.0.attn.c_proj.weight"].storage == ((TENSOR2, Shard(0)), (TENSOR, Shard(1)))
    assert params["transformer.h.0.attn.c_attn.bias"].storage == ((TENSOR2, Replicate()), (TENSOR, Shard(0)))
    assert params["transformer.h.0.attn.c_attn.weight"].strided == 3
    one = {p.name: p for p in compile_program(tiny_full, hand_plan(tiny_full, dp=2, tp=2)).params}
    assert one["transformer.h.0.mlp.c_fc.weight"].storage == ((TENSOR, Shard(0)),)
    assert ParamPlan("w", (4, 4), "float32", Shard(0), 1).placements(("dp", "tp")) == (Replicate(), Shard(0))
    with pytest.raises(ValueError, match="storage"):
        ParamPlan("w", (4, 4), "float32", Shard(0), 1, storage=((TENSOR, Shard(1)),))


def _edit(plan: Plan, key_part: str, edit) -> Plan:
    out = []
    for s in plan.strategies:
        out.append(edit(s) if key_part in s.key else s)
    return dataclasses.replace(plan, strategies=tuple(out))


def test_strided_split_and_vocab_loss_stay_on_tp(tiny_full, plan_2d):
    split = _edit(plan_2d, "attn|aten.split.Tensor", lambda s: dataclasses.replace(
        s, inputs=((Shard(2), s.inputs[0][1]),)))
    with pytest.raises(ValueError, match="sharded on the tensor axis tp2"):
        compile_program(tiny_full, split)
    loss = _edit(plan_2d, "cross_entropy_loss", lambda s: dataclasses.replace(
        s, inputs=((Shard(1), s.inputs[0][1]),) + s.inputs[1:]))
    with pytest.raises(ValueError, match="vocab-parallel cross-entropy runs only on tp"):
        compile_program(tiny_full, loss)


def test_predicted_layouts_use_every_tensor_axis(tiny_full, plan_2d):
    from autopar.codegen.expected import param_layouts

    program = compile_program(tiny_full, plan_2d)
    lay = {l.name: l for l in param_layouts(program, {"tp2": 1, "tp": 1})}
    assert lay["transformer.h.0.mlp.c_fc.weight"].local_shape == (128, 32)
    assert lay["transformer.h.0.attn.c_attn.weight"].local_shape == (96, 32)
    assert lay["transformer.h.0.attn.c_attn.bias"].local_shape == (96,)
    old = {l.name: l for l in param_layouts(program, 1)}          # an int: the TENSOR coordinate
    assert old["transformer.h.0.mlp.c_fc.weight"].local_shape == (128, 32)


# ---- one 4-rank launch ---------------------------------------------------------------------------

def _train(rank: int, plan_json: str, engine: str):
    """3 SGD steps of the plan on ``engine``: (the ParallelModel, what every test compares)."""
    from autopar.api import autoparallelize

    b = build(False)
    data = batches(b)
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         optimizer=sgd, plan=Plan.from_json(plan_json), timeout_s=60, engine=engine)
    pm.reset_collectives()
    losses, grads = [], []
    for x, y in data[:STEPS]:
        losses.append(pm.step(x, y))
        grads.append(pm.full_grad_dict())       # gathers outside the recorder: not in ``issued``
    res = {"losses": losses, "issued": [c.key() for c in pm.collectives], "coord": tuple(pm.mesh.get_coordinate()),
           "names": tuple(pm.mesh.mesh_dim_names), "engine": pm.engine, "fallbacks": sorted(pm.fallbacks),
           "traffic": {a: t["bytes"] for a, t in traffic_by_axis(pm.collectives).items()},
           "local": {s.name: (s.local.numel(), math.prod(s.plan.shape) if s.plan.shape else 1)
                     for s in pm.store.slots}}
    groups = pm.store.shard_groups()          # LAMB/LARS norms: the axes holding the rest of a tensor
    res["norm_groups"] = {s.name: len(groups[s.stepped]) for s in pm.store.slots}
    sd = pm.full_state_dict()
    out = pm(data[STEPS][0])
    if rank == 0:
        res.update(sd=sd, grads=grads, out=out)
    return pm, res


def _train_job(rank: int, world: int, plan_json: str, engine: str = "auto") -> dict:
    pm, res = _train(rank, plan_json, engine)
    pm.close()
    return res


def _run_2d(rank: int, world: int, plan_json: str, directory: str, zero_json: str, solver_json: str,
            sp_json: str) -> dict:
    """The plan on both engines; on the emitted one also its storage sizes and a checkpoint saved,
    re-loaded under the same plan and read by one process. Then ``zero_json`` (dp x tp2, ZeRO-3),
    ``solver_json`` (the planner's own 2-D plan) and ``sp_json`` (its 2-D plan with sequence
    parallelism)."""
    from autopar.runtime.checkpoint import read_checkpoint

    pm, res = _train(rank, plan_json, "interpreter")
    pm.close()
    out = {"interpreter": res}
    pm, res = _train(rank, plan_json, "auto")
    sd = pm.full_state_dict()
    path = pm.save(directory)
    with torch.no_grad():
        for s in pm.store.slots:
            s.local.zero_()
    pm.load(directory)
    again = pm.full_state_dict()
    res["reloaded"] = max((again[k] - sd[k]).abs().max().item() for k in sd)
    if rank == 0:
        res["saved"] = {k[len("param/"):]: v for k, v in read_checkpoint(path).items() if k.startswith("param/")}
    pm.close()
    out["auto"] = res
    out["zero3"] = _train_job(rank, world, zero_json)
    out["solver"] = _train_job(rank, world, solver_json)
    out["sp"] = _train_job(rank, world, sp_json)
    return out


@pytest.fixture(scope="module")
def plan_zero3(tiny_full):
    """("dp", "tp2", "tp") = (2, 2, 1) under ZeRO-3: each dp rank keeps its rows of the tp2 shard."""
    return tensor_2d_plan(tiny_full, dp=2, outer=2, inner=1, zero=3)


def _free_links_plan(graph, force: str):
    """The planner's plan of ``graph`` under ``force`` for 4 GPUs whose links cost nothing, so that
    splitting gpt-tiny pays on every tensor axis."""
    from autopar.cost.hardware import LinkSpec, make_cluster
    from autopar.solver.forcing import parse_force
    from autopar.solver.search import plan_model

    free = LinkSpec("free", busbw_Bps=1e15, latency_s=0.0, source="test")
    cluster = dataclasses.replace(make_cluster("h100", 1, 4), intra=free, inter=free)
    seq = next(n.out.shape[1] for n in graph.nodes if n.kind == "input")
    return plan_model(graph, cluster, global_batch=graph.batch_size, seq_len=seq, dtype="float32",
                      force=parse_force(force))


@pytest.fixture(scope="module")
def plan_solver(tiny_full):
    """The planner's 2-D plan (``--force tp=4,tpmode=2d``, ``solver/tensor_axes.py``)."""
    return _free_links_plan(tiny_full, f"tp=4,tpmode=2d,mbs={tiny_full.batch_size}")


@pytest.fixture(scope="module")
def plan_sp(tiny_full):
    """Its 2-D plan with sequence parallelism, one sequence per micro-batch (so that the inner axis
    splits the sequence, not the batch)."""
    return _free_links_plan(tiny_full, "tp=4,tpmode=2d,sp=on,mbs=1")


@pytest.fixture(scope="module")
def ran_2d(plan_2d, plan_zero3, plan_solver, plan_sp, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ck2d") / "ck")
    return spawn_ranks(_run_2d, 4, (plan_2d.to_json(), d, plan_zero3.to_json(), plan_solver.to_json(),
                                    plan_sp.to_json()), timeout_s=120)


@functools.lru_cache(maxsize=None)
def _reference():
    return reference(False, 0)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["auto", "interpreter"])
def test_2d_tensor_parallel_trains_like_one_process(ran_2d, engine):
    runs = [r[engine] for r in ran_2d]
    check_against_reference(runs, _reference())
    assert sorted(r["coord"] for r in runs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["names"] == ("tp2", "tp") for r in runs)
    assert {r["engine"] for r in runs} == ({"emitted"} if engine == "auto" else {"interpreter"})


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["auto", "interpreter"])
def test_2d_collectives_as_predicted_on_both_tensor_axes(ran_2d, plan_2d, tiny_full, engine):
    """Every rank issued exactly the predicted collectives (its coordinates on both tensor axes
    given), with traffic on tp (Megatron's all-reduces) and tp2 (weight all-gathers at use, their
    gradients reduce-scattered, the batch's loss all-reduce)."""
    from autopar.codegen.expected import expected_collectives

    runs = [r[engine] for r in ran_2d]
    check_collectives_per_rank(runs, lambda res: expected_collectives(
        tiny_full, plan_2d, tp_rank=dict(zip(res["names"], res["coord"]))))
    for r in runs:
        assert set(r["traffic"]) == {"tp", "tp2"} and min(r["traffic"].values()) > 0, r["traffic"]
        kinds = {(k[0], k[1]) for k in r["issued"]}
        assert ("all_gather", "tp2") in kinds and ("reduce_scatter", "tp2") in kinds, kinds


@pytest.mark.slow
@pytest.mark.parametrize("run", ["auto", "zero3"])
def test_2d_big_weights_store_a_quarter(ran_2d, run):
    """2 x 2 tensor axes: 1/4 of each big matrix per rank; dp x tp2 under ZeRO-3: the dp rank's
    half of the rows of its tp2 half. LAMB/LARS norms reduce over every axis holding a part."""
    for r in ran_2d:
        big = {n: v for n, v in r[run]["local"].items() if n.endswith(BIG)}
        assert len(big) == 8
        for name, (mine, full) in big.items():
            assert mine * 4 == full, (name, mine, full)
        groups = r[run]["norm_groups"]
        assert groups["transformer.h.0.mlp.c_fc.weight"] == 2          # tp2 + tp, or tp2 + dp
        assert groups["transformer.h.0.ln_1.weight"] == (1 if run == "auto" else 2)    # tp2 (+ dp)
        if run == "auto":
            assert groups["transformer.h.0.mlp.c_fc.bias"] == 1            # tp only


@pytest.mark.slow
def test_zero3_over_tp2_storage(ran_2d, plan_zero3):
    """ZeRO-3 rows on top of the tp2-local tensor train like one process, with exactly the
    predicted collectives: a weight read Replicate on tp2 is all-gathered there first, so the op
    keeps that copy and the ZeRO-3 rows are never gathered again in backward (``expected._read_moved``)."""
    from collections import Counter

    from autopar.codegen.expected import expected_collectives
    from bodies import full_trace

    runs = [r["zero3"] for r in ran_2d]
    check_against_reference(runs, _reference())
    assert sorted(r["coord"] for r in runs) == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    for r in runs:
        want = Counter()
        coords = dict(zip(r["names"], r["coord"]))
        for key, n in Counter(c.key() for c in expected_collectives(full_trace(4), plan_zero3, tp_rank=coords)).items():
            want[key] = n * STEPS
        got = Counter(r["issued"])
        assert got == want, (dict(got - want), dict(want - got))
        assert r["traffic"]["tp2"] > 0 and r["traffic"]["dp"] > 0


@pytest.mark.slow
def test_2d_full_state_dict_and_checkpoint_round_trip(ran_2d):
    top = ran_2d[0]["auto"]
    ref = _reference()["sd"]
    for name, full in top["sd"].items():
        assert full.shape == ref[name].shape, name
    assert set(top["saved"]) <= set(top["sd"])
    for name, t in top["saved"].items():
        assert torch.equal(t, top["sd"][name]), name
    assert all(r["auto"]["reloaded"] == 0.0 for r in ran_2d)
    one = build(False).module                     # a one-process model loads the saved tensors
    one.load_state_dict({k: v for k, v in top["saved"].items()}, strict=False)
    named = dict(one.named_parameters(remove_duplicate=False))
    for name, t in top["saved"].items():
        assert torch.equal(named[name].detach(), t), name


@pytest.mark.slow
def test_the_planners_2d_plan_trains_like_one_process(ran_2d, plan_solver, tiny_full):
    """A 2-D plan the solver made (its own placements on tp2 and tp, not a hand plan) trains like
    one process, with traffic on both tensor axes, and issues exactly the predicted collectives:
    where both axes move one tensor, ``edges.redistribute`` runs one axis at a time in the order
    the prediction counts (DTensor's own multi-axis plan all-reduced on tp where a reduce-scatter
    was planned, and gathered on tp2 a tensor still whole on tp)."""
    from autopar.codegen.expected import expected_collectives

    assert plan_solver.mesh_axes == ("tp2", "tp") and plan_solver.mesh_shape == (2, 2)     # dp of 1: no axis
    assert plan_solver.summary()["tensor_parallel_mode"] == "2d" and plan_solver.idle_axes() == ()
    runs = [r["solver"] for r in ran_2d]
    check_against_reference(runs, _reference())
    for r in runs:
        assert r["traffic"]["tp"] > 0 and r["traffic"]["tp2"] > 0, r["traffic"]
    check_collectives_per_rank(runs, lambda res: expected_collectives(
        tiny_full, plan_solver, tp_rank=dict(zip(res["names"], res["coord"]))))


def _sequence_split(plan: Plan, graph, axis: str) -> list[str]:
    """Keys of the nodes whose output ``plan`` splits along the sequence (dim 1 of a (B, T, ...)
    activation) on mesh axis ``axis``."""
    i = plan.mesh_axes.index(axis)
    seq = {n.key for n in graph.nodes if n.outputs and len(n.out.shape) >= 3 and n.kind == "op"}
    return [s.key for s in plan.strategies if s.key in seq and s.output and s.output[i] == Shard(1)]


@pytest.mark.slow
def test_2d_sequence_parallel_plan_trains_like_one_process(ran_2d, plan_sp, tiny_full):
    """Sequence parallelism on a 2 x 2 tensor mesh (the inner axis, ``tensor_axes.py``): the
    planner's plan splits the norms' and residual adds' sequence on tp (and gathers it before each
    linear), trains like one process and issues exactly the predicted collectives on tp2 and tp."""
    from autopar.codegen.expected import expected_collectives
    from bodies import full_trace

    assert plan_sp.sequence_parallel and plan_sp.mesh_axes == ("tp2", "tp")
    split = _sequence_split(plan_sp, tiny_full, "tp")
    assert any("layer_norm" in k for k in split) and any("add" in k for k in split), split
    runs = [r["sp"] for r in ran_2d]
    check_against_reference(runs, _reference())
    for r in runs:
        assert r["traffic"]["tp"] > 0 and r["traffic"]["tp2"] > 0, r["traffic"]
    graph = full_trace(tiny_full.batch_size // plan_sp.num_micro_batches)     # one micro-batch's
    check_collectives_per_rank(runs, lambda res: expected_collectives(
        graph, plan_sp, tp_rank=dict(zip(res["names"], res["coord"]))))
