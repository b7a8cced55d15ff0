"""Tensor parallelism over several mesh axes in the planner (``solver/tensor_axes.py``): the mesh of
each family, the per-axis solve, the plan it writes, and the errors of forced shapes that cannot work."""
from __future__ import annotations

import pytest

from autopar.cost.hardware import make_cluster
from autopar.mesh import tensor_axes
from autopar.placements import Shard
from autopar.plan import plan_problems
from autopar.solver import plan_model
from autopar.solver.errors import PlanningError
from autopar.solver.forcing import parse_force
from autopar.solver.tensor_axes import axis_names, tensor_shape
from solver_helpers import traced

GPT = "gpt:hidden=4096,layers=4,heads=32,vocab=50304,seq=2048"


def _plan(force: str, spec: str = GPT, gpus: int = 8):
    g, b = traced(spec, 8)
    return plan_model(g, make_cluster("h100", 1, gpus), global_batch=8, seq_len=b.seq_len, force=parse_force(force))


@pytest.mark.parametrize("mode,tp,shape", [("1d", 8, ()), ("2d", 4, (2, 2)), ("2d", 16, (4, 4)),
                                           ("2.5d", 8, (2, 2, 2)), ("2.5d", 16, (4, 2, 2)),
                                           ("2.5d", 32, (2, 4, 4)), ("3d", 8, (2, 2, 2)), ("3d", 27, (3, 3, 3))])
def test_family_meshes(mode, tp, shape):
    assert tensor_shape(mode, tp) == shape


@pytest.mark.parametrize("mode,tp,fix", [("2d", 8, "tp=4, 9, 16"), ("2d", 2, "tp=4, 9, 16"),
                                         ("3d", 16, "tp=8, 27, 64"), ("2.5d", 4, "tp=8, 16")])
def test_a_tp_without_the_family_shape_says_which_tp_would(mode, tp, fix):
    with pytest.raises(PlanningError, match=fix):
        tensor_shape(mode, tp)


def test_axis_names_are_inside_out():
    assert axis_names((2, 2)) == ("tp2", "tp") and axis_names((2, 2, 2)) == ("tp3", "tp2", "tp")


@pytest.mark.parametrize("force,axes,shape", [("tp=4,tpmode=2d,dp=2", ("dp", "tp2", "tp"), (2, 2, 2)),
                                              ("tp=8,tpmode=3d", ("tp3", "tp2", "tp"), (2, 2, 2))])  # no dp axis of size 1
def test_forced_families_split_on_every_axis_and_never_one_dim_twice(force, axes, shape):
    p = _plan(force)
    assert (p.mesh_axes, p.mesh_shape) == (axes, shape) and not plan_problems(p)
    assert p.idle_axes() == ()                         # every tensor axis shards something
    for s in p.strategies:
        for pls in (s.output, *s.inputs):
            dims = [x.dim for x in pls[len(pls) - len(tensor_axes(p.mesh_axes)):] if isinstance(x, Shard)]
            assert len(dims) == len(set(dims)), (s.key, pls)      # no nested shard of one dim
    # every matrix of a layer is stored split over some tensor axis
    for name in ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"):
        w = next(s for s in p.strategies if f"{name}|param" in s.key)
        assert any(isinstance(x, Shard) for x in w.output[len(w.output) - len(tensor_axes(p.mesh_axes)):]), (name, w)


def test_the_second_axis_costs_what_it_moves():
    """The 2-D plan's step carries collectives on both tensor axes, and its compute per rank is
    split about as the 1-D plan's over the same 4 ranks (per rank: a quarter of 4 sequences'
    work, up to the ops one axis cannot split); here it moves more than Megatron's 1-D layout,
    so it is slower."""
    two = _plan("tp=4,tpmode=2d,dp=2")
    one = _plan("tp=4,dp=2")
    kinds = {k.split(":")[0] for k, _ in two.step_time.comm_s}
    assert {"tp", "tp2"} <= kinds, two.step_time.comm_s
    assert two.step_time.compute_s == pytest.approx(one.step_time.compute_s, rel=0.25)
    assert two.step_time.total_s > one.step_time.total_s


def test_forced_tpmode_needs_tp_and_sides_that_divide_the_model():
    with pytest.raises(PlanningError, match="force tp too"):
        _plan("tpmode=2d")
    with pytest.raises(PlanningError, match="not a square"):
        _plan("tp=8,tpmode=2d")
    odd = "gpt:hidden=96,layers=2,heads=3,vocab=128,seq=16"
    with pytest.raises(PlanningError, match="does not divide the hidden size 96|attention heads"):
        _plan("tp=4,tpmode=2d", spec=odd, gpus=4)


# ---- the free search over families -----------------------------------------------------------------

DIMS = {"hidden": 4096, "heads": 32, "layers": 4}


@pytest.mark.parametrize("force,tp,dims,shapes", [
    ("", 16, DIMS, [(), (4, 4), (4, 2, 2)]),             # 16: 2-D 4 x 4, 2.5-D 4 x 2 x 2, not a cube
    ("", 8, DIMS, [(), (2, 2, 2)]),                      # 8: 2.5-D's widest grid is the 3-D mesh
    ("", 2, DIMS, [()]),                                 # too few ranks for two axes
    ("tpmode=1d", 16, DIMS, [()]),
    ("sp=on", 16, DIMS, [(), (4, 4), (4, 2, 2)]),        # sequence parallelism on the inner axis of each
    ("tpmode=2d,tp=16", 16, DIMS, [(4, 4)]),
    ("", 16, {"hidden": 96, "heads": 6, "layers": 2}, [(), (4, 2, 2)]),   # 2-D's inner 4: not 6 heads
    ("", 4, {"hidden": 96, "heads": 6, "layers": 2}, [(), (2, 2)]),
    ("", 16, None, [()]),                                # no model facts: one axis
])
def test_the_free_search_tries_each_family_that_fits(force, tp, dims, shapes):
    from autopar.solver.configs import tensor_shapes

    assert tensor_shapes(parse_force(force), tp, dims) == shapes


def test_outer_configs_try_several_axes_with_sequence_parallelism_where_forced_on():
    from autopar.solver.configs import outer_configs
    from autopar.solver.forcing import Force

    configs = outer_configs(Force(tp=16), 16, 4, True, 16, dims=DIMS)
    assert {c.tp_shape for c in configs} == {(), (4, 4), (4, 2, 2)}
    assert {(c.tp_shape, c.sp) for c in configs} == {((), False), ((), True), ((4, 4), False), ((4, 2, 2), False)}
    on = outer_configs(Force(tp=16, sequence_parallel=True), 16, 4, True, 16, dims=DIMS)
    assert {(c.tp_shape, c.sp) for c in on} == {((), True), ((4, 4), True), ((4, 2, 2), True)}
    assert {c.tp_shape for c in outer_configs(Force(tp=16), 16, 4, True, 16)} == {()}


def test_the_search_picks_a_family_where_it_pays():
    """tp=16 over two nodes of 8 A100s (a hidden-4096 GPT, 4 sequences): one axis of 16 puts every
    Megatron all-reduce on the inter-node link; the free search (tp forced, the family free)
    chooses a multi-axis mesh, predicted faster than the forced 1-D plan of the same degree."""
    spec = "gpt:hidden=4096,layers=2,heads=32,vocab=50304,seq=512"
    g, b = traced(spec, 4)
    cluster = make_cluster("a100-80g", 2, 8)
    free = plan_model(g, cluster, global_batch=4, seq_len=b.seq_len, force=parse_force("tp=16"))
    one = plan_model(g, cluster, global_batch=4, seq_len=b.seq_len, force=parse_force("tp=16,tpmode=1d"))
    assert free.summary()["tensor_parallel_mode"] != "1d" and len(tensor_axes(free.mesh_axes)) >= 2, free.mesh_axes
    assert free.step_time.total_s < one.step_time.total_s
    assert not plan_problems(free)


def test_a_two_axis_plan_over_budget_is_fitted_by_the_constrained_ilp():
    """Everything but the per-operator choice forced (2-D, dp 2, mbs 4, no recompute, ZeRO or
    offload): at 95% of the unconstrained plan's memory the memory-constrained ILP on the inner
    axis (outer axis kept) finds placements that fit, where the search used to drop the configuration."""
    from autopar.solver.search import solve

    g, b = traced(GPT, 8)
    cluster = make_cluster("h100", 1, 8)
    force = parse_force("tp=4,tpmode=2d,dp=2,mbs=4,recompute=none,zero=0,offload=none,sp=off")
    free = solve(g, cluster, global_batch=8, seq_len=b.seq_len, force=force)
    budget = 0.95 * free.evaluation.memory.total_bytes
    tight = solve(g, cluster, global_batch=8, seq_len=b.seq_len, force=force, memory_budget_bytes=int(budget))
    assert tight.stats.ilp_constrained >= 1 and tight.evaluation.memory.total_bytes <= budget
    assert tight.plan.summary()["tensor_parallel_mode"] == "2d" and not plan_problems(tight.plan)
    for s in tight.plan.strategies:
        for pls in (s.output, *s.inputs):
            dims = [x.dim for x in pls[len(pls) - len(tensor_axes(tight.plan.mesh_axes)):] if isinstance(x, Shard)]
            assert len(dims) == len(set(dims)), (s.key, pls)


def test_further_sweeps_keep_only_what_lowers_the_step(monkeypatch):
    """With the family forced, coordinate descent over the tensor axes repeats while the combined
    time falls: LLaMA-3 8B 2-D (2 x 2) on 64 H100s was 1.174 s per step with one sweep and 1.137 s
    with more (measured when the sweeps came in); a sweep that finds nothing better leaves the plan
    as it was."""
    import autopar.solver.tensor_axes as ta

    def plans(spec, gpus, force, gb):
        g, b = traced(spec, 2)
        out = []
        for n in (1, ta.MAX_SWEEPS):
            monkeypatch.setattr(ta, "MAX_SWEEPS", n)
            out.append(plan_model(g, make_cluster("h100", gpus // 8 or 1, min(gpus, 8)), global_batch=gb,
                                  seq_len=None, force=parse_force(force)))
        return out

    # dp and pp pinned: with one sweep the free search prefers dp=16 with ZeRO-3 (1.169 s) to this
    # configuration, which more sweeps bring lower
    one, more = plans("llama3-8b", 64, "tp=4,tpmode=2d,dp=8,pp=2", 64)
    assert more.step_time.total_s < 0.99 * one.step_time.total_s
    assert more.mesh_shape == one.mesh_shape
    one, more = plans(GPT, 8, "tp=4,tpmode=2d", 8)
    assert more.strategies == one.strategies and more.step_time.total_s == one.step_time.total_s


def test_a_forced_2p5d_mesh_with_d_equal_q_is_reported_as_3d_and_says_so():
    """tp=8 as 2.5-D is d x q x q = 2 x 2 x 2, the 3-D mesh: the plan reports 3d, and its report
    says why (the forced family's name differs from the plan's)."""
    from autopar.report import forced_family_notes

    small = "gpt:hidden=256,layers=2,heads=8,vocab=512,seq=64"
    p = _plan("tp=8,tpmode=2.5d", small)
    assert p.mesh_shape == (2, 2, 2) and p.summary()["tensor_parallel_mode"] == "3d"
    (note,) = forced_family_notes(p)
    assert "tensor_parallel_mode=2.5d" in note and "2 x 2 x 2" in note and "3d mesh" in note
    assert forced_family_notes(_plan("tp=8,tpmode=3d", small)) == []
