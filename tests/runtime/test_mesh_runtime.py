"""The runtime's DeviceMesh is the plan's mesh, whatever its axes: ``build_mesh`` makes one process
group per group of ranks along every axis (``Mesh.groups``), for any number of named axes, and
nothing below the Plan reads an axis by position (a plan whose axes are listed tp-first compiles,
predicts and trains exactly as the dp-first one)."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from autopar.mesh import DATA, TENSOR, Mesh
from autopar.runtime.launch import spawn_ranks
from autopar.runtime.world import check_runtime_mesh, runtime_mesh
from handplans import hand_plan


# ---- build_mesh on gloo ranks ---------------------------------------------------------------------

def _build(rank: int, world: int, meshes: list, too_big: list) -> dict:
    import torch.distributed as dist

    from autopar.runtime.world import PlanMismatchError, build_mesh

    out = {"meshes": [], "errors": []}
    for mesh in meshes:
        dm = build_mesh(mesh, "cpu", timeout_s=30)
        groups, sums = {}, {}
        for axis in mesh.axes:
            g = dm.get_group(axis)
            groups[axis] = tuple(dist.get_process_group_ranks(g))
            t = torch.tensor([rank])
            dist.all_reduce(t, group=g)                  # the group is real: it sums its ranks
            sums[axis] = int(t.item())
        out["meshes"].append({"names": tuple(dm.mesh_dim_names), "shape": tuple(dm.shape),
                              "coord": tuple(dm.get_coordinate()), "groups": groups, "sums": sums})
    for mesh in too_big:
        try:
            build_mesh(mesh, "cpu", timeout_s=30)
            out["errors"].append("no error")
        except PlanMismatchError as e:
            out["errors"].append(str(e))
    return out


def _check(out: list, meshes: list) -> None:
    for rank, res in enumerate(out):
        for mesh, got in zip(meshes, res["meshes"]):
            assert got["names"] == mesh.axes and got["shape"] == mesh.shape
            assert got["coord"] == mesh.coords(rank)
            for axis in mesh.axes:
                assert got["groups"][axis] == mesh.group_of(rank, axis), (rank, mesh, axis)
                assert got["sums"][axis] == sum(mesh.group_of(rank, axis))


@pytest.mark.slow
def test_build_mesh_two_axes_on_two_ranks():
    meshes = [Mesh((DATA, TENSOR), (2, 1)), Mesh((DATA, TENSOR), (1, 2)), Mesh((TENSOR, DATA), (2, 1))]
    out = spawn_ranks(_build, 2, (meshes, [Mesh((DATA, TENSOR), (2, 2))]), timeout_s=60)
    _check(out, meshes)
    for res in out:
        (err,) = res["errors"]
        assert "dp=2 x tp=2" in err and "WORLD_SIZE(2)" in err, err


@pytest.mark.slow
def test_build_mesh_three_axes_on_four_ranks():
    meshes = [Mesh(("a", DATA, TENSOR), (2, 1, 2))]
    out = spawn_ranks(_build, 4, (meshes, []), timeout_s=90)
    _check(out, meshes)
    assert [r["meshes"][0]["groups"]["a"] for r in out] == [(0, 2), (1, 3), (0, 2), (1, 3)]


# ---- the runtime's checks of the plan's mesh (one process) ----------------------------------------

def test_runtime_mesh_checks():
    check_runtime_mesh(Mesh((DATA, TENSOR), (2, 2)))
    check_runtime_mesh(Mesh((TENSOR,), (2,)))
    check_runtime_mesh(Mesh(("pp", DATA), (2, 2)))                # pipeline stages run
    with pytest.raises(NotImplementedError, match=r"\['cp'\] are not supported.*pp, dp, tp"):
        check_runtime_mesh(Mesh((DATA, "cp"), (2, 2)))


def test_runtime_mesh_of_a_plan(tiny_full):
    plan = hand_plan(tiny_full, dp=2, tp=1)
    assert runtime_mesh(plan) == plan.mesh == Mesh((DATA, TENSOR), (2, 1), plan.cluster.gpus_per_node)


# ---- axes read by name: a tp-first plan is the same plan -------------------------------------------

def _reversed_axes(plan):
    """``plan`` with its mesh axes listed in the other order (every placement tuple reversed)."""
    def rev(pl):
        return tuple(reversed(pl)) if len(pl) == len(plan.mesh_axes) else pl
    strategies = tuple(replace(s, output=rev(s.output), inputs=tuple(rev(i) for i in s.inputs))
                       for s in plan.strategies)
    return replace(plan, mesh_axes=tuple(reversed(plan.mesh_axes)),
                   mesh_shape=tuple(reversed(plan.mesh_shape)), strategies=strategies)


def _rev(pl):
    return None if pl is None else tuple(reversed(pl))


@pytest.mark.parametrize("plan_kw", [dict(dp=2, tp=2, family="megatron_vocab", zero=1),
                                     dict(dp=2, tp=2, family="megatron_sp", zero=3, recompute="full"),
                                     dict(dp=2, tp=1, zero=2)])
def test_axis_order_does_not_matter_to_codegen(tiny_full, plan_kw):
    from autopar.codegen.expected import expected_collectives
    from autopar.codegen.program import compile_program, local_dp_nodes

    plan = hand_plan(tiny_full, **plan_kw)
    flipped = _reversed_axes(plan)
    assert flipped.mesh_axes == (TENSOR, DATA)
    a, b = compile_program(tiny_full, plan), compile_program(tiny_full, flipped)
    assert b.mesh == flipped.stage_mesh and b.params == a.params and b.regions == a.regions
    for na, nb in zip(a.nodes, b.nodes):
        assert nb.output == _rev(na.output), na.key
        assert nb.inputs == tuple(_rev(i) for i in na.inputs), na.key
        assert nb.strided == na.strided
    assert local_dp_nodes(tiny_full, flipped) == local_dp_nodes(tiny_full, plan)
    for tp_rank in range(plan.tp):
        want = Counter(c.key() for c in expected_collectives(tiny_full, plan, tp_rank=tp_rank))
        got = Counter(c.key() for c in expected_collectives(tiny_full, flipped, tp_rank=tp_rank))
        assert got == want and want


def _train_both(rank: int, world: int, plans: list) -> list:
    from autopar.api import autoparallelize
    from autopar.plan import Plan
    from bodies import STEPS, batches, build

    out = []
    for plan_json in plans:
        b = build(False)
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                             plan=Plan.from_json(plan_json), timeout_s=30)
        losses = [pm.step(x, y) for x, y in batches(b)[:STEPS]]
        sd = pm.full_state_dict()                        # collective: every rank calls it
        out.append({"losses": losses, "sd": sd if rank == 0 else None,
                    "names": tuple(pm.mesh.mesh_dim_names), "local_dp": pm.program.local_dp,
                    "issued": sorted(Counter(c.key() for c in pm.collectives).items())})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("plan_kw", [dict(dp=1, tp=2, family="megatron_vocab"), dict(dp=2, tp=1, zero=1)])
def test_axis_order_does_not_matter_to_the_runtime(tiny_full, plan_kw):
    plan = hand_plan(tiny_full, **plan_kw)
    flipped = _reversed_axes(plan)
    out = spawn_ranks(_train_both, 2, ([plan.to_json(), flipped.to_json()],), timeout_s=120)
    for res in out:
        a, b = res
        assert a["names"] == (DATA, TENSOR) and b["names"] == (TENSOR, DATA)
        assert a["local_dp"] == b["local_dp"]
        assert b["losses"] == a["losses"]
        assert b["issued"] == a["issued"] and a["issued"]
    a, b = out[0]
    for k in a["sd"]:
        torch.testing.assert_close(b["sd"][k], a["sd"][k], rtol=0, atol=0)
