"""autopar.mesh: named axes, row-major rank layout, groups per axis, node locality."""
import itertools

import pytest
from hypothesis import given, strategies as st

from autopar.mesh import Mesh


def test_layout_is_row_major_last_axis_adjacent():
    m = Mesh(("pp", "dp", "tp"), (2, 2, 2), ranks_per_node=4)
    assert m.size == 8 and m.coords(5) == (1, 0, 1) and m.rank((1, 0, 1)) == 5
    assert m.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert m.groups("dp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert m.groups("pp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert m.group_of(6, "dp") == (4, 6) and m.coord(6, "pp") == 1 and m.coord(6, "cp") == 0
    assert m.inside_node("tp") and m.inside_node("dp") and not m.inside_node("pp")
    assert m.drop("pp") == Mesh(("dp", "tp"), (2, 2), 4)
    assert m.size_of("cp") == 1 and "cp" not in m and "dp" in m


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_groups_partition_the_ranks_and_coords_round_trip(shape):
    axes = tuple("abcd"[: len(shape)])
    m = Mesh(axes, tuple(shape))
    for r in range(m.size):
        assert m.rank(m.coords(r)) == r
    for a in axes:
        gs = m.groups(a)
        assert sorted(itertools.chain(*gs)) == list(range(m.size))
        assert all(len(g) == m.size_of(a) for g in gs)
        for g in gs:          # along one axis only: the other coordinates agree
            others = {tuple(c for b, c in zip(axes, m.coords(r)) if b != a) for r in g}
            assert len(others) == 1


@pytest.mark.parametrize("axes,shape,words", [
    (("dp", "tp"), (2,), "differ in length"),
    (("dp", "dp"), (2, 2), "repeat a name"),
    (("dp",), (0,), "positive integers"),
    (("dp",), (2.0,), "positive integers"),
])
def test_bad_meshes_say_why(axes, shape, words):
    with pytest.raises(ValueError, match=words):
        Mesh(axes, shape)
    m = Mesh(("dp",), (2,))
    with pytest.raises(ValueError, match="outside the mesh"):
        m.coords(2)


def test_plan_mesh_puts_pipeline_stages_outermost():
    from dataclasses import replace

    from autopar.plan import ClusterRef, MemoryUse, Plan, Stage, StepTime

    st = Stage(0, 0, 1, True, False, 1.0, 0)
    p = Plan(model_name="m", model_fingerprint="f", cluster=ClusterRef("c", "h100", 1, 8, 1), dtype="bfloat16",
             global_batch=8, seq_len=None, dp=2, tp=2, pp=2, sequence_parallel=False, zero_stage=0,
             micro_batch_size=2, num_micro_batches=2, recompute="none", offload="none",
             mesh_axes=("dp", "tp"), mesh_shape=(2, 2), strategies=(),
             stages=(st, replace(st, index=1, first_layer=1, last_layer=2, has_embedding=False, has_head=True)),
             step_time=StepTime(1.0, 0.0, (), 0.0, 0.0, 1.0), memory=MemoryUse(0, 0, 0, 0, 0, 0),
             model_flops_per_step=1.0, solve_time_s=0.0)
    assert p.mesh == Mesh(("pp", "dp", "tp"), (2, 2, 2), 8)
    assert p.stage_mesh == p.mesh.drop("pp")
