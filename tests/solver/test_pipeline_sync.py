"""A pipelined step's collectives once a step, after the schedule (``overlap.pipeline_sync_s``):
``PipelineRunner.step`` (``runtime/pipeline.py``) broadcasts the loss (one fp32) from the last
stage's rank over the pipeline, and the first and the last stage's ranks all-reduce the gradients of
the parameters both read (a tied embedding and head). ``autopar profile`` of pp=2 x dp=2 on 4 CPU
ranks listed both (2 MiB tied all-reduce, 4-byte broadcast) while the step model priced neither."""
from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.cost import make_cluster
from autopar.cost.collectives import all_reduce_s, broadcast_s
from autopar.cost.hardware import LinkSpec
from autopar.solver.runtime_profile import AUTOPAR_RUNTIME
from autopar.solver.timing import OuterConfig, evaluate
from solver_helpers import link_cluster, toy_summary, traced

LINK = LinkSpec("t", busbw_Bps=1e9, latency_s=1e-3, source="test")
PROFILE = replace(AUTOPAR_RUNTIME, grad_passes=False, gather_passes=False)   # the tied weight costs no copies


def test_broadcast_by_hand():
    """gloo: a binomial tree, ceil(log2 n) rounds of the whole message; NCCL: a ring from the root,
    n - 1 hops, the message pipelined along it."""
    assert broadcast_s(1000, 2, LINK, binomial=True) == pytest.approx(1e-3 + 1e-6)
    assert broadcast_s(1000, 4, LINK, binomial=True) == pytest.approx(2 * (1e-3 + 1e-6))
    assert broadcast_s(1000, 5, LINK, binomial=True) == pytest.approx(3 * (1e-3 + 1e-6))
    assert broadcast_s(1000, 4, LINK, binomial=False) == pytest.approx(3e-3 + 1e-6)
    assert broadcast_s(1000, 1, LINK, binomial=True) == 0.0 == broadcast_s(0, 4, LINK, binomial=False)
    with pytest.raises(ValueError, match="nbytes"):
        broadcast_s(-1, 2, LINK, binomial=True)


@pytest.mark.parametrize("gpu, schedule, pp, broadcast_hops, tied", [
    ("cpu", "1f1b", 2, 1, True),          # gloo's tree over 2 ranks; first and last stage on ranks 0, 1
    ("cpu", "1f1b", 4, 2, True),          # over 4: 2 rounds
    ("h100", "1f1b", 4, 3, True),         # NCCL's ring over 4: 3 hops
    ("cpu", "zbv", 2, 1, False),          # the V puts the first and the last stage on rank 0: no all-reduce
])
def test_the_pipeline_sync_in_the_step_by_hand(gpu, schedule, pp, broadcast_hops, tied):
    """The step grows by the broadcast and, where two ranks hold the tied weight, a 2-rank
    all-reduce of its gradient (fp32 on the wire here): once a step, not per micro-batch."""
    c = link_cluster(gpu)
    cfg = OuterConfig(tp=1, pp=pp, dp=1, mbs=1, m=4, recompute="none", zero=0, sp=False, schedule=schedule,
                      v=2 if schedule == "zbv" else 1)
    numel = 1000.0
    base = evaluate(toy_summary(4), cfg, c, PROFILE, 1e15, all_stages=True)
    ev = evaluate(toy_summary(4, tied=numel), cfg, c, PROFILE, 1e15, all_stages=True)
    bcast = broadcast_hops * 1e-3 + (broadcast_hops if gpu == "cpu" else 1) * 4 / 1e9
    ar = all_reduce_s(numel * PROFILE.grad_wire_bytes, 2, c.intra) if tied else 0.0
    comm = dict(ev.step.comm_s)
    assert comm["pp:broadcast"] == pytest.approx(bcast) == dict(base.step.comm_s)["pp:broadcast"]
    assert comm.get("pp:all_reduce", 0.0) == pytest.approx(ar)
    # beside the tied weight's optimizer step, the step grows by its all-reduce
    assert ev.step.total_s - base.step.total_s - (ev.step.optimizer_s - base.step.optimizer_s) == pytest.approx(ar)
    ranks = {st.index: st for st in ev.stages}
    assert set(ranks) == set(range(pp))
    for r, st in ranks.items():
        assert st.dp_sync["pp:broadcast"] == pytest.approx(bcast)
        holds = r in (0, pp - 1) and tied
        assert st.dp_sync.get("pp:all_reduce", 0.0) == pytest.approx(ar if holds else 0.0)
    rows = {(o.axis, o.kind): o for o in ev.step.overlap}
    assert "loss" in rows["pp", "broadcast"].why and rows["pp", "broadcast"].hidden_s == 0.0
    if tied:
        assert "tied" in rows["pp", "all_reduce"].why
        assert rows["pp", "all_reduce"].exposed_s == pytest.approx(ar)


def test_the_pipeline_issues_only_these_after_its_schedule():
    from autopar.solver.overlap import pipeline_collective_s

    with pytest.raises(ValueError, match="no 'all_gather'"):
        pipeline_collective_s("all_gather", 4, 2, 1, link_cluster("cpu"))


def test_no_pipeline_no_pipeline_sync():
    c = link_cluster("cpu")
    cfg = OuterConfig(tp=1, pp=1, dp=2, mbs=1, m=4, recompute="none", zero=0, sp=False)
    comm = dict(evaluate(toy_summary(4, tied=1000.0), cfg, c, PROFILE, 1e15).step.comm_s)
    assert not any(k.startswith("pp:") for k in comm)


def test_a_planned_gpt_pipeline_prices_what_profile_lists():
    """A tied GPT planned pp=2 x dp=2 on the CPU cluster: the step's pp broadcast and all-reduce
    are what ``autopar profile`` prices for the collectives the runtime is expected to issue
    (``codegen.expected_pipeline``: the 4-byte loss, the tied weight's fp32 gradient)."""
    from autopar.codegen.expected_pipeline import expected_pipeline_collectives
    from autopar.profile import predicted_collective_s
    from autopar.solver import plan_model
    from autopar.trace import trace_model

    spec = "gpt:hidden=64,layers=2,heads=4,vocab=128,seq=32"
    g, b = traced(spec, batch=8)
    c = make_cluster("cpu", 1)
    plan = plan_model(g, c, global_batch=8, seq_len=32, dtype="float32", force="pp=2,dp=2,mbs=2")
    comm = dict(plan.step_time.comm_s)
    full = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                       collapse_repeats=False, model_name=spec)       # every layer: what the runtime cuts
    issued = {(x.kind, x.nbytes) for x in expected_pipeline_collectives(full, plan, pp_rank=0, coord=(0, 0))
              if x.axis == "pp"}
    assert ("broadcast", 4) in issued and ("all_reduce", 128 * 64 * 4) in issued
    assert comm["pp:broadcast"] == pytest.approx(predicted_collective_s(plan, c, "broadcast", "pp", 4))
    assert comm["pp:all_reduce"] == pytest.approx(predicted_collective_s(plan, c, "all_reduce", "pp", 128 * 64 * 4))
