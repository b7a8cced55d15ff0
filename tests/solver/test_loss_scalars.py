"""The loss's one-value all-reduces (``GraphFacts.loss_scalars``): the runtime returns the loss as
one float and a mean cross-entropy divides by the global count of its targets, each an all-reduce
of 4 bytes, every micro-batch, on the rank that holds the loss, over each axis the loss is Partial
on: the data axis' batch shards (``overlap.loss_scalars_s``) and a tensor axis that splits its rows
(``problem.summarize``). On gloo they are latency-bound ring all-reduces (``autopar profile`` of
dp=4 on 4 CPU ranks: two at 6.8 ms each, 6% of the step, unpriced before)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.cost import make_cluster
from autopar.cost.collectives import all_reduce_s
from autopar.cost.hardware import LinkSpec
from autopar.solver.runtime_profile import AUTOPAR_RUNTIME
from autopar.solver.strategies import graph_facts
from autopar.solver.timing import OuterConfig, evaluate
from autopar.trace import trace_model
from solver_helpers import link_cluster, toy_summary, traced


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("loss_fn, scalars", [
    (lambda y, t: F.cross_entropy(y, t), 2),                       # the loss and its mean's count
    (lambda y, t: F.cross_entropy(y, t, reduction="sum"), 1),      # a sum: the loss alone
    (lambda y, t: F.nll_loss(F.log_softmax(y, -1), t), 2),
    (lambda y, t: F.mse_loss(y, F.one_hot(t, 4).float()), 1),      # a mean over elements: no count
    (lambda y, t: F.cross_entropy(y, t, reduction="none"), 0),     # not a scalar
])
def test_loss_scalars_of_a_traced_loss(loss_fn, scalars):
    x, t = torch.randn(4, 8), torch.randint(0, 4, (4,))
    g = trace_model(_Net(), (x,), loss_fn=loss_fn, example_target=t, model_name="net")
    assert graph_facts(g, None).loss_scalars == scalars


def test_all_reduce_steps_by_hand():
    """NCCL's tree: 2 ceil(log2 n) steps; gloo's ring: 2 (n - 1); the same bandwidth term."""
    ring = LinkSpec("t", busbw_Bps=1e9, latency_s=1e-5, source="test")
    tree = replace(ring, all_reduce_tree=True)
    assert all_reduce_s(4, 16, tree) == pytest.approx(8e-5 + 2 * 15 / 16 * 4 / 1e9)
    assert all_reduce_s(4, 5, tree) == pytest.approx(6e-5 + 2 * 4 / 5 * 4 / 1e9)
    assert all_reduce_s(4, 4, ring) == pytest.approx(6e-5 + 6e-9)
    assert all_reduce_s(4, 2, ring) == all_reduce_s(4, 2, tree) == pytest.approx(2e-5 + 4e-9)
    assert all_reduce_s(4, 1, tree) == 0.0 == all_reduce_s(4, 1, ring)
    # a bucket of 25 MiB over 1,024 ranks: 20 tree steps, where the ring takes 2,046
    mb25 = 25 * 2**20
    assert all_reduce_s(mb25, 1024, tree) == pytest.approx(20e-5 + 2 * 1023 / 1024 * mb25 / 1e9)
    assert all_reduce_s(mb25, 1024, ring) - all_reduce_s(mb25, 1024, tree) == pytest.approx(2026e-5)


def test_gpu_links_take_trees_and_cpu_links_rings():
    for gpu in ("a100-80g", "h100", "h200", "v100"):
        c = make_cluster(gpu, 2)
        assert c.intra.all_reduce_tree and c.inter.all_reduce_tree
    c = make_cluster("cpu", 2)
    assert not c.intra.all_reduce_tree and not c.inter.all_reduce_tree


@pytest.mark.parametrize("gpu, hops", [("cpu", 2 * 3), ("h100", 2 * 2)])    # dp=4: gloo's ring, NCCL's tree
def test_the_loss_all_reduces_in_the_step_by_hand(gpu, hops):
    """dp=4, m=3 micro-batches, no pipeline: the step grows by m x 2 all-reduces of 4 bytes."""
    c = link_cluster(gpu)
    cfg = OuterConfig(tp=1, pp=1, dp=4, mbs=1, m=3, recompute="none", zero=0, sp=False)
    without = evaluate(toy_summary(2, 0), cfg, c, AUTOPAR_RUNTIME, 1e15)
    with_loss = evaluate(toy_summary(2, 2), cfg, c, AUTOPAR_RUNTIME, 1e15)
    one = hops * 1e-3 + 2 * 3 / 4 * 4 / 1e9
    assert with_loss.step.total_s - without.step.total_s == pytest.approx(3 * 2 * one)
    assert dict(with_loss.step.comm_s)["dp:all_reduce"] == pytest.approx(3 * 2 * one)
    one_rank = evaluate(toy_summary(2, 2), replace(cfg, dp=1), c, AUTOPAR_RUNTIME, 1e15)
    assert "dp:all_reduce" not in dict(one_rank.step.comm_s)


def test_only_the_last_pipeline_stage_reduces_the_loss():
    """pp=2 over dp=2, 4 even layers: the last stage holds the loss and alone pays its two
    all-reduces a micro-batch; the stages differ by exactly that."""
    cfg = OuterConfig(tp=1, pp=2, dp=2, mbs=1, m=2, recompute="none", zero=0, sp=False)
    c = link_cluster("cpu")
    ev = evaluate(toy_summary(4, 2), cfg, c, AUTOPAR_RUNTIME, 1e15, all_stages=True)
    by_rank = {st.index: st for st in ev.stages}
    first, last = by_rank[0], by_rank[max(by_rank)]
    one = all_reduce_s(4, 2, c.intra)
    assert last.comm.get("dp:all_reduce", 0.0) == pytest.approx(2 * one)
    assert "dp:all_reduce" not in first.comm
    assert math.isclose(last.time_per_microbatch_s - first.time_per_microbatch_s, 2 * one, rel_tol=1e-9)


def test_a_planned_step_says_where_the_loss_all_reduces_went():
    """A GPT planned dp=4 on the CPU cluster: its data axis' all-reduce row carries the loss's two
    ring all-reduces per micro-batch beside the gradients', and says so."""
    from autopar.solver import plan_model

    spec = "gpt:hidden=64,layers=2,heads=4,vocab=128,seq=32"
    g, _ = traced(spec, batch=8)
    c = make_cluster("cpu", 1)
    plan = plan_model(g, c, global_batch=8, seq_len=32, dtype="float32", force="dp=4,mbs=1")
    row = next(o for o in plan.step_time.overlap if (o.axis, o.kind) == ("dp", "all_reduce"))
    loss = plan.num_micro_batches * 2 * all_reduce_s(4, 4, c.intra)
    assert "the loss" in row.why and row.exposed_s >= loss
    assert row.total_s - row.hidden_s == pytest.approx(row.exposed_s)


@pytest.mark.parametrize("gpu, t, tree", [("cpu", 2, False), ("h100", 4, True)])
def test_a_tensor_axis_the_loss_is_partial_on_prices_its_all_reduces(gpu, t, tree):
    """tp=t tables: where the chosen strategy leaves the loss Partial on tp (its rows split there),
    the summary's tp all-reduces gain the loss's (``GraphFacts.loss_scalars``: gloo's ring on the
    CPU cluster, NCCL's tree on GPUs, 4 hops at t=4 where the ring takes 6); where it is not
    Partial, nothing. ``summarize`` of the same choice with the count set to 0 is the reference."""
    from autopar.placements import Partial
    from autopar.solver.problem import build_tables, summarize
    from autopar.solver.runtime_profile import AUTOPAR_RUNTIME as PROFILE

    g, _ = traced("gpt:hidden=64,layers=2,heads=4,vocab=128,seq=16")
    facts = graph_facts(g, 16)
    assert facts.loss_scalars == 2 and facts.loss_key is not None
    tab = build_tables(facts, make_cluster(gpu, 1), t, False, 2, "float32", PROFILE)
    none = replace(tab, facts=replace(facts, loss_scalars=0))
    lk, part = facts.loss_key, facts.part[facts.loss_key]
    kinds = {isinstance(s.output, Partial): i for i, s in enumerate(tab.strategies[lk])}
    assert set(kinds) == {True, False}              # the rows split (Partial) and the vocab-parallel loss
    for partial, i in kinds.items():
        choice = {k: 0 for k in tab.keys} | {lk: i}
        got = summarize(tab, choice).parts[part].comm_fwd.get("tp:all_reduce", 0.0)
        ref = summarize(none, choice).parts[part].comm_fwd.get("tp:all_reduce", 0.0)
        assert tab.link.all_reduce_tree == tree
        assert got - ref == pytest.approx(2 * all_reduce_s(4, t, tab.link) if partial else 0.0)
        if partial and tree:
            assert got - ref < 2 * all_reduce_s(4, t, replace(tab.link, all_reduce_tree=False))
