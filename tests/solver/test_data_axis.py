"""The DATA axis' placements from the op rules (``solver/data_axis.py``): the batch shards are the
DATA ILP's optimum where every op offers them (checked by solving that ILP), and where one does
not (a reduction over the batch that does not sum) the DATA axis is solved and priced."""
from __future__ import annotations

import pytest
import torch

from autopar.cost.hardware import make_cluster
from autopar.mesh import DATA
from autopar.placements import Partial, Replicate, Shard
from autopar.solver import solve
from autopar.solver.data_axis import batch_shard_placements, solve_data_axis, unbatched_ops
from autopar.solver.forcing import parse_force
from autopar.solver.problem import ilp_problem_objective
from autopar.solver.rules import find_rule
from autopar.solver.search import _Searcher, _table_key
from autopar.solver.strategies import graph_facts
from autopar.trace import trace_model
from batch_stat_models import attention_batch_max, batch_max_norm
from solver_helpers import traced


def batch_max_graph():
    m, x, loss, y = batch_max_norm()
    return trace_model(m, x, loss_fn=loss, example_target=y, model_name="batch-max")


def _searcher(graph, force: str, gpus: int = 4, batch: int = 8, seq_len=None):
    """A search's state as ``solve`` leaves it for ``force`` (its tables and solutions), and its result."""
    cluster = make_cluster("h100", 1, gpus)
    r = solve(graph, cluster, global_batch=batch, seq_len=seq_len, force=parse_force(force))
    s = _Searcher(graph, cluster, batch, seq_len, r.dtype, r.budget_bytes, parse_force(force), None, r.profile)
    return s, r


@pytest.mark.parametrize("spec,force", [("gpt-tiny", "dp=2,tp=2,pp=1"), ("gpt-tiny", "dp=4,tp=1,pp=1"),
                                        ("vit:image=32,patch=8,layers=2,hidden=64,heads=4,mlp=128,classes=10",
                                         "dp=2,tp=2,pp=1")])
def test_the_batch_shards_are_the_data_ilp_optimum(spec, force):
    """Where ``unbatched_ops`` finds nothing, the batch shards are an optimum of the DATA axis' ILP
    (solved here anyway; ties, such as a view's placement, may pick another) and the tensor axes'
    costs given its choice are those the search used: the certificate it relies on to skip it."""
    g, b = traced(spec, 8)
    facts = graph_facts(g, b.seq_len)
    assert unbatched_ops(facts) == ()
    s, r = _searcher(g, force, seq_len=b.seq_len)
    cfg = r.evaluation.config
    sol = s.solution(*_table_key(cfg))
    tab, choice, summary, axes = solve_data_axis(s, sol.tables, sol.choice, sol.axes, cfg)
    data_tab, data_choice = next((t, c) for a, t, c in axes if a == DATA)
    out, read = batch_shard_placements(facts, data_tab.keys, 0)
    shards = {}
    for k in data_tab.keys:          # the batch shards as a choice in the DATA tables
        want = tuple(read.get(ref.key, Replicate()) for ref in facts.inputs[k])
        shards[k] = next(i for i, x in enumerate(data_tab.strategies[k]) if x.output == out[k]
                         and (facts.nodes[k].kind != "op" or tuple(x.inputs) == want))
    optimum = ilp_problem_objective(data_tab, data_choice)
    assert ilp_problem_objective(data_tab, shards) <= optimum * (1 + 1e-12)
    assert choice == sol.choice
    for name, part in summary.parts.items():
        want = sol.summary.parts[name]
        assert part.fwd_s == pytest.approx(want.fwd_s, rel=1e-9) and part.bwd_s == pytest.approx(want.bwd_s, rel=1e-9)
        assert part.comm_fwd == pytest.approx(want.comm_fwd) and part.comm_bwd == pytest.approx(want.comm_bwd)
        assert part.saved_bytes == pytest.approx(want.saved_bytes)


def test_a_max_over_the_batch_is_gathered_and_priced():
    """The batch shards would call ``amax`` over the batch a Partial (a sum of per-rank maxima):
    its rule offers no such strategy, so the DATA axis is solved: ``amax`` reads its input
    Replicate (an all-gather over dp, priced in the step), and what follows stays Replicate."""
    g = batch_max_graph()
    facts = graph_facts(g, None)
    amax = next(n.key for n in g.nodes if "amax" in n.target)
    assert unbatched_ops(facts)[0] == amax          # and what reads its claimed Partial after it
    out, _ = batch_shard_placements(facts, [n.key for n in g.nodes if n.kind != "output"], 0)
    assert isinstance(out[amax], Partial)                # what the batch shards alone would claim
    plan = solve(g, make_cluster("h100", 1, 2), global_batch=8, seq_len=None, force=parse_force("dp=2")).plan
    by_key = {s.key: s for s in plan.strategies}
    di = plan.mesh_axes.index(DATA)
    assert by_key[amax].output[di] == Replicate() and by_key[amax].inputs[0][di] == Replicate()
    div = next(k for k in by_key if "div" in k)
    assert by_key[div].output[di] == Shard(0)
    assert dict(plan.step_time.comm_s).get("dp:all_gather", 0.0) > 0
    row = next(o for o in plan.step_time.overlap if (o.axis, o.kind) == ("dp", "all_gather"))
    assert "data axis moves activations" in row.why         # the report says which gather it is
    assert any(n.startswith("dp-axis ILP") and amax in n for n in plan.notes)


def test_a_class_token_broadcast_to_the_batch_carries_it():
    """ViT's class token, a parameter expanded to (B, 1, H) and concatenated with the patches:
    the expand's first dim is a batch dim (it lines up with the patches' in ``cat``)."""
    g, b = traced("vit:image=32,patch=8,layers=2,hidden=64,heads=4,mlp=128,classes=10", 4)
    facts = graph_facts(g, b.seq_len)
    expand = next(n.key for n in g.nodes if "expand" in n.target)
    assert facts.batch_dims[expand] == frozenset({0})


@pytest.mark.parametrize("shape,src,dst", [((2, 3, 4, 5), 1, -1), ((2, 3, 4, 5), -1, 1), ((2, 3, 4), (0, 2), (2, 0)),
                                           ((2, 3, 4, 5), (1, 2), (0, 3))])
def test_movedim_rule_moves_the_shard_as_torch_moves_the_dim(shape, src, dst):
    from autopar.ir import NodeInfo, TensorMeta

    x = torch.randn(shape)
    y = torch.movedim(x, src, dst)
    node = NodeInfo("m", "m", "op", "aten.movedim.int", (None, src, dst), (), (TensorMeta(tuple(y.shape), "float32"),),
                    0, 0, "")
    protos = [p for p in find_rule(node.target)(node, [TensorMeta(shape, "float32")], node.outputs)
              if isinstance(p.output, Shard)]
    assert len(protos) == len(shape)
    for p in protos:
        i, j = p.inputs[0].dim, p.output.dim
        assert torch.equal(torch.movedim(x.narrow(i, 0, 1), src, dst), y.narrow(j, 0, 1))


def test_context_parallelism_is_refused_where_the_data_axis_is_solved():
    """cp folds each sequence's chunks into the DATA axis' batch: a model whose ops do not run on
    the batch shards there cannot take it, and the error names the op."""
    from autopar.solver.errors import PlanningError

    m, x, loss, y = attention_batch_max()
    g = trace_model(m, x, loss_fn=loss, example_target=y, model_name="attention-batch-max")
    with pytest.raises(PlanningError, match=r"amax.*data axis' batch shards"):
        solve(g, make_cluster("h100", 1, 2), global_batch=4, seq_len=8, force=parse_force("cp=2"))
