"""Overlap accounting (how much of each collective is hidden, and why), the contention charged for
the hidden part (overlap_slowdown), its JSON round trip and report table, and the calibrate fit."""
from __future__ import annotations

import json
import math
import tomllib
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st
from rich.console import Console

from autopar.calibrate_overlap import OverlapFigures, fit_overlap_slowdown
from autopar.comm_overlap import CommOverlap
from autopar.cost import make_cluster
from autopar.cost.cluster_file import cluster_from_dict, cluster_to_toml, load_cluster
from autopar.cost.hardware import LinkSpec
from autopar.plan import Plan
from autopar.report import comm_table, render
from autopar.cost.collectives import overlapped_cost
from autopar.solver.problem import AxisSummary, PartCost
from autopar.solver.runtime_profile import AUTOPAR_RUNTIME, MEGATRON_RUNTIME
from autopar.solver.timing import OuterConfig, evaluate


WINDOW_RULE = replace(AUTOPAR_RUNTIME, grad_bucket_bytes=0, first_grad_bucket_bytes=0)   # min(C, W)


def _summary(tp_comm: dict, layers: int = 2, numel: float = 1e9) -> AxisSummary:
    """Two layers of 1 s forward, 2 s backward compute and ``numel`` parameters each; no pre/post."""
    zero = PartCost(0.0, 0.0, {}, {}, 0.0, 0.0, 0.0, 0.0, 0.0)
    blk = PartCost(1.0, 2.0, dict(tp_comm), {}, 0.0, 0.0, 0.0, 0.0, numel, 1.0, 2.0)
    return AxisSummary(1, False, 1, {"pre": zero, "block": blk, "post": zero}, 0.0, 1e6, layers, 0.0)


def _cluster(slowdown: float):
    c = make_cluster("h100", 1)
    link = LinkSpec("test", busbw_Bps=1e9, latency_s=0.0, source="test")
    return replace(c, intra=link, inter=link, overlap_slowdown=slowdown, overlap_slowdown_source="test figure")


def _rows(ev) -> dict:
    return {o.key: o for o in ev.step.overlap}


def test_gradient_passes_by_hand():
    """``overlap.grad_pass_bytes``: per step, 3 passes per accumulating add (micro-batches after
    the first), 2 per copy into the reducer's buffer: once per step (ZeRO 0/1, or pipelined), every
    micro-batch under ZeRO 2/3 without a pipeline (then its rows add up: 3 passes over 1/data)."""
    from autopar.solver.overlap import grad_pass_bytes

    def cfg(dp, zero, pp=1):
        return OuterConfig(tp=1, pp=pp, dp=dp, mbs=1, m=4, recompute="none", zero=zero, sp=False)

    assert grad_pass_bytes(cfg(1, 0), 100, 4) == 9 * 100 * 4              # three adds, no reducer copy
    assert grad_pass_bytes(cfg(8, 0), 100, 4) == (2 + 9) * 100 * 4        # one copy into the buckets
    assert grad_pass_bytes(cfg(8, 1), 100, 4) == (2 + 9) * 100 * 4
    assert grad_pass_bytes(cfg(4, 2), 100, 4) == (8 + 9 / 4) * 100 * 4    # a send buffer per micro-batch
    assert grad_pass_bytes(cfg(4, 3, pp=2), 100, 4) == (2 + 9) * 100 * 4  # pipelined: reduced once
    # Megatron's wgrad GEMM accumulates into the main gradient: no such term
    c = cfg(8, 0)
    mega = evaluate(_summary({}), c, _cluster(0.0), MEGATRON_RUNTIME, 1e15)
    ours = evaluate(_summary({}), c, _cluster(0.0), replace(MEGATRON_RUNTIME, grad_passes=True), 1e15)
    assert ours.step.compute_s - mega.step.compute_s == pytest.approx(11 * 2e9 * 4 / (3.35e12 * 0.85))


def test_zero3_gather_passes_by_hand():
    """``overlap.gather_pass_bytes``: per micro-batch, two gathers (the forward's, the backward's
    re-gather), each 2 passes over the rank's 1/data rows (its send buffer) and 2 over every
    parameter (out of the receive buffer); only ZeRO-3 over data > 1. Autopar's runtime prices them
    in the rank's compute every micro-batch, beside its gradient passes; Megatron's has neither."""
    from autopar.solver.overlap import gather_pass_bytes, grad_pass_bytes

    def cfg(dp, zero, m=4):
        return OuterConfig(tp=1, pp=1, dp=dp, mbs=1, m=m, recompute="none", zero=zero, sp=False)

    assert gather_pass_bytes(cfg(4, 3), 100, 4) == 2 * (2 + 2 / 4) * 100 * 4       # 2,000 bytes
    assert gather_pass_bytes(cfg(4, 2), 100, 4) == gather_pass_bytes(cfg(1, 3), 100, 4) == 0.0
    c, numel = cfg(4, 3), 2e9
    base = _cluster(0.0)
    mega = evaluate(_summary({}), c, base, MEGATRON_RUNTIME, 1e15)
    grads = evaluate(_summary({}), c, base, replace(MEGATRON_RUNTIME, grad_passes=True), 1e15)
    both = evaluate(_summary({}), c, base, replace(MEGATRON_RUNTIME, grad_passes=True, gather_passes=True), 1e15)
    bw = base.gpu.hbm_Bps * base.gpu.memory_efficiency
    param_b = MEGATRON_RUNTIME.param_bytes
    assert grads.step.compute_s - mega.step.compute_s == pytest.approx(
        grad_pass_bytes(c, numel, MEGATRON_RUNTIME.grad_bytes) / bw)
    assert both.step.compute_s - grads.step.compute_s == pytest.approx(c.m * 2 * 2.5 * numel * param_b / bw)


def test_the_steps_host_cost_is_paid_once_per_step():
    """``GPUSpec.step_overhead_s`` (measured by ``autopar calibrate``): added to the step once,
    whatever the micro-batches and the pipeline, and shown as ``StepTime.host_s``."""
    for cfg in (OuterConfig(tp=1, pp=1, dp=8, mbs=1, m=4, recompute="none", zero=0, sp=False),
                OuterConfig(tp=1, pp=2, dp=4, mbs=1, m=8, recompute="none", zero=1, sp=False)):
        base = _cluster(0.25)
        host = replace(base, gpu=replace(base.gpu, step_overhead_s=0.5))
        a = evaluate(_summary({}, layers=4), cfg, base, AUTOPAR_RUNTIME, 1e15)
        b = evaluate(_summary({}, layers=4), cfg, host, AUTOPAR_RUNTIME, 1e15)
        assert b.step.total_s - a.step.total_s == pytest.approx(0.5) and b.step.host_s == 0.5 and a.step.host_s == 0.0
        assert b.step.compute_s == a.step.compute_s


def test_zero3_group_host_by_hand():
    """``GPUSpec.zero3_group_overhead_s`` (measured by ``autopar calibrate``): per gather group (one a
    layer with parameters: 2 here) per micro-batch (4) under ZeRO-3 over data > 1, in the rank's
    compute: 4 x 2 x 0.01 s; nothing under ZeRO-2 or on one data rank."""
    from autopar.solver.overlap import zero3_host_s

    base = _cluster(0.0)
    host = replace(base, gpu=replace(base.gpu, zero3_group_overhead_s=0.01))
    summary = _summary({})
    summary = replace(summary, parts={**summary.parts, "block": replace(summary.parts["block"], param_tensors=4.0)})
    for zero, dp, extra in ((3, 4, 4 * 2 * 0.01), (2, 4, 0.0), (3, 1, 0.0)):
        cfg = OuterConfig(tp=1, pp=1, dp=dp, mbs=1, m=4, recompute="none", zero=zero, sp=False)
        a = evaluate(summary, cfg, base, AUTOPAR_RUNTIME, 1e15)
        b = evaluate(summary, cfg, host, AUTOPAR_RUNTIME, 1e15)
        assert b.step.compute_s - a.step.compute_s == pytest.approx(extra), (zero, dp)
        assert zero3_host_s(cfg, host.gpu, 2.0) == pytest.approx(extra / 4)


def test_the_optimizer_step_by_hand():
    """AdamW's step: 28 bytes of state per local parameter and the gradient's (bf16: 2), at the HBM
    bandwidth x memory efficiency x ``optimizer_efficiency`` (measured on CPU ranks by
    ``autopar calibrate``, ``calibrate_step.py``): 2 layers x 1e9 parameters x 30 B at 3.35 TB/s x
    0.85, / dp under ZeRO >= 1; optimizer_efficiency 1.5 takes a third off and nothing else."""
    base = _cluster(0.0)
    fast = replace(base, gpu=replace(base.gpu, optimizer_efficiency=1.5))
    for zero, dp in ((0, 8), (1, 4)):
        cfg = OuterConfig(tp=1, pp=1, dp=dp, mbs=1, m=1, recompute="none", zero=zero, sp=False)
        a = evaluate(_summary({}), cfg, base, AUTOPAR_RUNTIME, 1e15)
        b = evaluate(_summary({}), cfg, fast, AUTOPAR_RUNTIME, 1e15)
        assert a.step.optimizer_s == pytest.approx(2e9 * 30 / (3.35e12 * 0.85) / (dp if zero else 1))
        assert b.step.optimizer_s == pytest.approx(a.step.optimizer_s / 1.5)
        assert b.step.total_s - a.step.total_s == pytest.approx(b.step.optimizer_s - a.step.optimizer_s)


def test_bucket_launches_by_hand():
    """``grad_buckets.bucket_launches``: 10 MB over 10 s of backward (1 MB per second), a 4 MB cap
    and a 1 MB first one: buckets of 1, 4, 4, 1 MB, ready at 1, 5, 9, 10 s; an atomic 6 MB piece
    (an embedding) after it closes the open 1 MB bucket and is a bucket of its own, at its end."""
    from autopar.solver.grad_buckets import GradPiece, bucket_launches

    layers = [GradPiece(5e6, 5.0), GradPiece(5e6, 5.0)]
    def flat(launches):
        return [x for pair in launches for x in pair]

    assert flat(bucket_launches(layers, 4e6, 1e6)) == pytest.approx([1.0, 1e6, 5.0, 4e6, 9.0, 4e6, 10.0, 1e6])
    emb = layers + [GradPiece(6e6, 2.0, atomic=True)]
    assert flat(bucket_launches(emb, 4e6, 1e6)) == pytest.approx([1.0, 1e6, 5.0, 4e6, 9.0, 4e6, 10.0, 1e6, 12.0, 6e6])
    assert flat(bucket_launches([GradPiece(3e6, 3.0)], 4e6, 0.0)) == pytest.approx([3.0, 3e6])   # one bucket, at its end


def test_bucketed_reduction_by_hand():
    """``grad_buckets.bucketed_overlap`` with collectives of 1 s per MB: the buckets above run
    1-2, 5-9, 9-13, 13-14 s: 4 s exposed past the 10 s backward, 6 of the 10 s hidden (the window
    rule hid all 10); with the 6 MB embedding last (backward 12 s): it runs 14-20 s, 8 s exposed. And in
    the step: dp=2 ZeRO-0 of one 50 MB layer (autopar's 25 MiB buckets, a 1 MiB first) at 1 GB/s
    exposes at least its last bucket, where the window rule hid all of it."""
    from autopar.solver.grad_buckets import GradPiece, bucketed_overlap

    layers = [GradPiece(5e6, 5.0), GradPiece(5e6, 5.0)]
    assert bucketed_overlap(layers, 4e6, 1e6, lambda b: b / 1e6) == pytest.approx((10.0, 6.0, 10.0))
    emb = layers + [GradPiece(6e6, 2.0, atomic=True)]
    assert bucketed_overlap(emb, 4e6, 1e6, lambda b: b / 1e6) == pytest.approx((16.0, 8.0, 12.0))

    cfg = OuterConfig(tp=1, pp=1, dp=2, mbs=1, m=1, recompute="none", zero=0, sp=False)
    one = _summary({}, layers=1, numel=25e6)                 # 25M params x 2 B (bf16 grads) = 50 MB, bwd 2 s
    cluster = _cluster(0.0)
    bucketed = evaluate(one, cfg, cluster, AUTOPAR_RUNTIME, 1e15, all_stages=True)
    window = evaluate(one, cfg, cluster, WINDOW_RULE, 1e15, all_stages=True)
    ar = _rows(bucketed)["dp:all_reduce"]
    assert _rows(window)["dp:all_reduce"].exposed_s == 0.0             # 0.05 s beside 2 s: hidden
    last = 50e6 - 2**20 - 25 * 2**20                                       # 1 MiB, 25 MiB, the rest
    assert ar.exposed_s == pytest.approx(last / 1e9) and "bucket by bucket" in ar.why   # 2(n-1)/n = 1


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.tuples(st.floats(1e3, 2e8), st.floats(0.0, 5.0), st.booleans()), min_size=1, max_size=6),
       cap=st.floats(1e5, 5e7), first=st.sampled_from([0.0, 2.0**20]), latency=st.floats(0.0, 1e-3))
def test_the_closed_form_schedule_is_the_bucket_by_bucket_one(pieces, cap, first, latency):
    """``bucketed_overlap`` folds runs of equal buckets in closed form: it equals the schedule of
    ``bucket_launches``' buckets run one after the other."""
    from autopar.solver.grad_buckets import GradPiece, bucket_launches, bucketed_overlap

    ps = [GradPiece(b, t, a) for b, t, a in pieces]

    def c(b):
        return latency + b / 1e9

    end = total = 0.0
    for ready, nbytes in bucket_launches(ps, cap, first):
        end = max(ready, end) + c(nbytes)
        total += c(nbytes)
    window = sum(p.seconds for p in ps)
    got = bucketed_overlap(ps, cap, first, c)
    assert got == pytest.approx((total, total - min(total, max(0.0, end - window)), window), rel=1e-9, abs=1e-9)


def test_contention_formula():
    assert overlapped_cost(7.0, 4.0, True, 0.25) == pytest.approx(3.0 + 0.25 * 4.0)     # exposed + s x hidden
    assert overlapped_cost(3.0, 4.0, True, 0.25) == pytest.approx(0.25 * 3.0)           # all hidden
    assert overlapped_cost(7.0, 4.0, True, 0.0) == pytest.approx(3.0)                   # the old rule
    assert overlapped_cost(7.0, 4.0, False, 0.25) == pytest.approx(7.0)                 # not overlapped: no contention


def test_zero0_by_hand():
    """dp=8 all-reduce of 2 layers x 1e9 params x 2 B (autopar: bf16 grads) at 1 GB/s busbw:
    2 x 7/8 x 4e9 / 1e9 = 7 s, beside the last backward (2 layers x 2 s = 4 s): hidden 4, exposed 3,
    contention 0.25 x 4 = 1. TP all-reduce: 0.1 s per layer forward x 2 layers x 4 micro-batches.
    Gradient passes (``overlap.grad_pass_bytes``): copied into the buckets once (2 passes), three
    micro-batches added (3 each): 11 x 2e9 x 2 B at 3.35 TB/s x 0.85. (The window rule: a
    runtime without buckets; ``test_bucketed_reduction_by_hand`` schedules them.)"""
    cfg = OuterConfig(tp=1, pp=1, dp=8, mbs=1, m=4, recompute="none", zero=0, sp=False)
    ev = evaluate(_summary({"tp:all_reduce": 0.1}), cfg, _cluster(0.25), WINDOW_RULE, 1e15, all_stages=True)
    rows = _rows(ev)
    dp = rows["dp:all_reduce"]
    assert (dp.total_s, dp.window_s, dp.hidden_s, dp.exposed_s, dp.contention_s) == pytest.approx((7.0, 4.0, 4.0, 3.0, 1.0))
    assert "last micro-batch's backward" in dp.why and "contention 0.25 x hidden (test figure)" in dp.why and dp.known
    tp = rows["tp:all_reduce"]
    assert (tp.total_s, tp.window_s, tp.hidden_s, tp.exposed_s, tp.contention_s) == pytest.approx((0.8, 0, 0, 0.8, 0))
    assert "synchronous" in tp.why
    comm = dict(ev.step.comm_s)
    assert comm["dp:all_reduce"] == pytest.approx(4.0) and comm["tp:all_reduce"] == pytest.approx(0.8)
    passes = 11 * 2e9 * 2 / (3.35e12 * 0.85)
    assert ev.step.total_s == pytest.approx(4 * (6.0 + 0.2) + 4.0 + passes + ev.step.optimizer_s)
    # no contention: the plain max(0, comm - window) rule, and the why says none was charged
    ev0 = evaluate(_summary({"tp:all_reduce": 0.1}), cfg, _cluster(0.0), WINDOW_RULE, 1e15, all_stages=True)
    assert dict(ev0.step.comm_s)["dp:all_reduce"] == pytest.approx(3.0)
    assert "no contention charged" in _rows(ev0)["dp:all_reduce"].why
    # only the plan's evaluation (all stages) carries the accounting
    assert evaluate(_summary({}), cfg, _cluster(0.25), AUTOPAR_RUNTIME, 1e15).step.overlap == ()


def test_zero3_megatron_by_hand():
    """ZeRO-3, Megatron profile (bf16 params 2 B, fp32 grads 4 B), dp=8, 1 GB/s: all-gather 7/8 x 4e9
    = 3.5 s, reduce-scatter 7/8 x 8e9 = 7 s per micro-batch. Forward gather beside 2 s of forward:
    hidden 2. Backward: gather + reduce-scatter (10.5 s) share 4 s of backward pro rata (1/3, 2/3)."""
    cfg = OuterConfig(tp=1, pp=1, dp=8, mbs=1, m=4, recompute="none", zero=3, sp=False)
    s, m = 0.25, 4
    ev = evaluate(_summary({"tp:all_gather": 0.05, "tp:all_reduce": 0.1}), cfg, _cluster(s), MEGATRON_RUNTIME, 1e15,
                  all_stages=True)
    rows = _rows(ev)
    ag, rs = rows["dp:all_gather"], rows["dp:reduce_scatter"]
    hid_ag = 2.0 + 4.0 / 3
    assert (ag.total_s, ag.window_s, ag.hidden_s, ag.exposed_s, ag.contention_s) == pytest.approx(
        (m * 7.0, m * hid_ag, m * hid_ag, m * (7.0 - hid_ag), m * s * hid_ag))
    assert (rs.total_s, rs.hidden_s, rs.exposed_s, rs.contention_s) == pytest.approx(
        (m * 7.0, m * 8 / 3, m * (7.0 - 8 / 3), m * s * 8 / 3))
    assert "forward" in ag.why and "backward" in ag.why
    assert not rows["tp:all_gather"].known and "GEMM" in rows["tp:all_gather"].why     # hidden upstream
    assert rows["tp:all_reduce"].known and "only all_gather/reduce_scatter" in rows["tp:all_reduce"].why


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("profile", [AUTOPAR_RUNTIME, MEGATRON_RUNTIME], ids=lambda p: p.name)
def test_rows_add_up_to_the_step_communication(zero, profile):
    cfg = OuterConfig(tp=1, pp=2, dp=4, mbs=1, m=8, recompute="none", zero=zero, sp=False)
    ev = evaluate(_summary({"tp:all_reduce": 0.1}, layers=4), cfg, _cluster(0.3), profile, 1e15, all_stages=True)
    comm = dict(ev.step.comm_s)
    rows = _rows(ev)
    assert set(rows) == set(comm)
    for k, o in rows.items():
        assert o.cost_s == pytest.approx(comm[k]), k
        assert o.hidden_s + o.exposed_s == pytest.approx(o.total_s) and o.hidden_s <= o.window_s + 1e-12
        assert o.contention_s == pytest.approx(0.3 * o.hidden_s) and o.why
    assert rows["pp:p2p"].hidden_s == 0 and "not overlapped" in rows["pp:p2p"].why
    if profile is AUTOPAR_RUNTIME and zero in (1, 2):
        assert "no prefetch" in rows["dp:all_gather"].why and rows["dp:all_gather"].hidden_s == 0


@pytest.fixture(scope="module")
def plan():
    from autopar.solver import plan_model
    from solver_helpers import traced

    g, _ = traced("gpt-tiny", batch=8)
    return plan_model(g, make_cluster("a100-80g", 1), global_batch=8, seq_len=None, force="dp=4,tp=2")


def test_plan_json_round_trip_and_old_files(plan):
    assert plan.step_time.overlap and all(isinstance(o, CommOverlap) for o in plan.step_time.overlap)
    assert sum(o.cost_s for o in plan.step_time.overlap) == pytest.approx(sum(s for _, s in plan.step_time.comm_s))
    back = Plan.from_json(plan.to_json())
    assert back.step_time == plan.step_time
    d = json.loads(plan.to_json())
    assert {"axis", "kind", "total_s", "hidden_s", "exposed_s", "why"} <= set(d["step_time"]["overlap"][0])
    del d["step_time"]["overlap"]                   # a plan file written before the field
    assert Plan.from_dict(d).step_time.overlap == ()
    d["step_time"]["overlap"] = [{"axis": "dp"}]
    with pytest.raises(ValueError, match="overlap"):
        Plan.from_dict(d)


def test_report_has_the_communication_table(plan):
    console = Console(width=200, record=True)
    render(plan, console)
    text = console.export_text()
    assert "Communication" in text and "hidden" in text and "exposed" in text
    for o in plan.step_time.overlap:
        assert o.key in text
    old = replace(plan, step_time=replace(plan.step_time, overlap=()))
    console = Console(width=200, record=True)
    render(old, console)
    assert "Communication" not in console.export_text()
    unknown = CommOverlap("tp", "all_gather", 0.5, 0.0, 0.0, 0.5, 0.0, "priced upstream", known=False)
    console = Console(width=200, record=True)
    console.print(comm_table(replace(plan, step_time=replace(plan.step_time, overlap=(unknown,)))))
    assert ">= 0.5000" in console.export_text()


def test_calibrate_fit_on_synthetic_timings():
    assert fit_overlap_slowdown(0.1, 0.1, 0.1) == pytest.approx(0.0)      # fully side by side
    assert fit_overlap_slowdown(0.1, 0.1, 0.2) == pytest.approx(1.0)      # as slow as one after the other
    assert fit_overlap_slowdown(0.1, 0.05, 0.11) == pytest.approx(0.2)    # (0.11 - 0.1) / 0.05
    assert fit_overlap_slowdown(0.05, 0.1, 0.11) == pytest.approx(0.2)
    assert fit_overlap_slowdown(0.1, 0.1, 0.09) == 0.0                     # noise, not negative contention
    # the fitted s makes the model's own cost reproduce the concurrent time
    g, c, b = 0.08, 0.12, 0.135
    s = fit_overlap_slowdown(g, c, b)
    assert g + overlapped_cost(c, g, True, s) == pytest.approx(b)
    with pytest.raises(ValueError, match="positive finite"):
        fit_overlap_slowdown(0.0, 0.1, 0.1)
    with pytest.raises(ValueError, match="positive finite"):
        fit_overlap_slowdown(0.1, math.nan, 0.1)


def test_cluster_field_defaults_file_and_calibrate(tmp_path):
    assert make_cluster("h100", 1).overlap_slowdown == pytest.approx(0.189)          # arXiv:2507.03114
    assert make_cluster("a100-80g", 1).overlap_slowdown == pytest.approx(0.189)
    assert make_cluster("v100", 1).overlap_slowdown == 0.0 and make_cluster("cpu", 1).overlap_slowdown == 0.0
    c = cluster_from_dict({"gpu": "cpu", "nodes": 1, "overlap_slowdown": 0.42})
    assert c.overlap_slowdown == 0.42 and "user TOML" in c.overlap_slowdown_source
    p = tmp_path / "c.toml"
    p.write_text(cluster_to_toml(c))
    assert load_cluster(p) == c
    for bad in (-0.1, "x", math.inf):
        with pytest.raises(ValueError, match="overlap_slowdown"):
            cluster_from_dict({"gpu": "cpu", "nodes": 1, "overlap_slowdown": bad})
    # what calibrate writes: the fitted value and how it was measured, read back by plan --cluster
    from autopar.calibrate import Calibration
    from autopar.calibrate_file import calibration_toml, cluster_dict, measured_dict

    cal = Calibration(device_kind="cpu", device_name="cpu", gpu="cpu", nproc=2, threads_per_rank=1, torch_version="x",
                      date="d", gemm=(), sdpa=None, copy_Bps=1e10, vector_flops=None, overhead_s=1e-6, points=(),
                      fits=(), link=None, link_kind="", joint=None, link_note="n", measure_s=1.0,
                      overlap=OverlapFigures(0.1, 0.1, 0.15, 0.5, 3, "GEMM 256^2 float32 x 40, all_reduce 4 MiB x 9"))
    from autopar.calibrate_bench import GemmShape, summarize_gemms
    shape = GemmShape(256, 256, 256)
    cal = replace(cal, gemm=(("float32", summarize_gemms([(shape, {"fwd": shape.flops / 1e10})]), 0),))
    c = cluster_from_dict(cluster_dict(cal))
    assert c.overlap_slowdown == pytest.approx(0.5) and "autopar calibrate" in c.overlap_slowdown_source
    p.write_text(calibration_toml(c, measured_dict(cal, 10.0, 12.0)))
    assert load_cluster(p).overlap_slowdown == pytest.approx(0.5)
    assert tomllib.loads(p.read_text())["measured"]["overlap"]["both_s"] == pytest.approx(0.15)


def test_zero3_gathers_pay_a_latency_per_layer():
    """ZeRO-3 gathers one group (a layer's parameters) per collective (``codegen/gather_groups.py``),
    and autopar's runtime prefetches the forward's next group (``zero3_prefetch``). With 2 groups,
    dp=4 and a 1 ms latency link each pass costs (2 - 1) x (4 - 1) x 1 ms more than one collective
    of the same bytes; a forward window longer than the gather hides the forward's (contention 0
    here), never the backward's (autopar waits for its re-gathers)."""
    from autopar.solver.overlap import dp_sync

    link = LinkSpec("test", busbw_Bps=1e9, latency_s=1e-3, source="test")
    cfg = OuterConfig(tp=1, pp=1, dp=4, mbs=1, m=1, recompute="none", zero=3, sp=False)
    numel = 2e6
    one = 2 * numel * 3 / 4 / 1e9 + 3 * 1e-3          # all-gather of 4 MB bf16 over 4 ranks: bytes + latency
    exposed, _, _ = dp_sync(cfg, numel, AUTOPAR_RUNTIME, link, 0.0, 0.0, 0.0, 2.0)
    assert exposed["dp:all_gather"] == pytest.approx(2 * (one + (2 - 1) * 3e-3))     # forward + backward
    single, _, _ = dp_sync(cfg, numel, AUTOPAR_RUNTIME, link, 0.0, 0.0, 0.0, 1.0)
    assert single["dp:all_gather"] == pytest.approx(2 * one)
    hidden, _, _ = dp_sync(cfg, numel, AUTOPAR_RUNTIME, link, 1.0, 0.0, 0.0, 2.0)
    assert hidden["dp:all_gather"] == pytest.approx(one + (2 - 1) * 3e-3)
    waited, _, _ = dp_sync(cfg, numel, replace(AUTOPAR_RUNTIME, zero3_prefetch=False), link, 1.0, 0.0, 0.0, 2.0)
    assert waited["dp:all_gather"] == pytest.approx(exposed["dp:all_gather"])
    assert exposed["dp:reduce_scatter"] == pytest.approx(single["dp:reduce_scatter"])

    # the step: two layers with parameter tensors are two groups. 2 layers of 1e9 parameters gather
    # 3 s per pass, longer than the 2 s forward window, so both passes pay the group's latency
    blk = replace(_summary({}).parts["block"], param_tensors=10.0)
    summ = replace(_summary({}), parts={**_summary({}).parts, "block": blk})
    ev = evaluate(summ, cfg, replace(_cluster(0.0), intra=link, inter=link), AUTOPAR_RUNTIME, 1e15, all_stages=True)
    base = evaluate(_summary({}), cfg, replace(_cluster(0.0), intra=link, inter=link), AUTOPAR_RUNTIME, 1e15,
                    all_stages=True)
    assert ev.step.total_s - base.step.total_s == pytest.approx(2 * (2 - 1) * 3e-3)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero23_reduce_where_the_runtime_does(zero):
    """ZeRO 2/3's reduce-scatter is priced as the runtime issues it (``runtime/reducer.py``): once
    per micro-batch without a pipeline (``GradReducer.each_micro_batch``), once per step after a
    pipeline's schedule (the micro-batches accumulate; ``reduces_once_per_step``, which the memory
    model then counts as one full copy of the gradients). No window: each costs its whole time, by
    hand the reduce-scatter of 2 MB bf16 gradients over 4 ranks: 3/4 x 2 MB / 1 GB/s + 3 latencies,
    and the all-gather of as many bf16 parameters the same."""
    from autopar.solver.overlap import accumulates_rows, dp_sync, reduces_once_per_step

    link = LinkSpec("test", busbw_Bps=1e9, latency_s=1e-3, source="test")
    numel = 1e6
    rs = ag = 2 * numel * 3 / 4 / 1e9 + 3e-3
    flat = OuterConfig(tp=1, pp=1, dp=4, mbs=1, m=4, recompute="none", zero=zero, sp=False)
    piped = replace(flat, pp=2)
    assert not reduces_once_per_step(flat) and reduces_once_per_step(piped)
    assert not reduces_once_per_step(replace(piped, m=1)) and not reduces_once_per_step(replace(piped, zero=1))
    assert accumulates_rows(flat) and not accumulates_rows(piped) and not accumulates_rows(replace(flat, m=1))
    per_mb, per_step, _ = dp_sync(flat, numel, AUTOPAR_RUNTIME, link, 0.0, 0.0, 0.0, 1.0)
    assert "dp:reduce_scatter" not in per_step
    got = per_mb["dp:reduce_scatter"] if zero == 2 else per_mb["dp:reduce_scatter"] + per_mb["dp:all_gather"]
    assert got == pytest.approx(rs + (0 if zero == 2 else 2 * ag))
    per_mb, per_step, rows = dp_sync(piped, numel, AUTOPAR_RUNTIME, link, 0.0, 0.0, 0.0, 1.0)
    assert "dp:reduce_scatter" not in per_mb and per_step["dp:reduce_scatter"] == pytest.approx(rs)
    assert ("step", "dp:reduce_scatter") in {(r[0], r[1]) for r in rows}
    if zero == 3:                                        # the gathers stay per micro-batch
        assert per_mb["dp:all_gather"] == pytest.approx(2 * ag) and "dp:all_gather" not in per_step


def test_ddp_buckets_over_a_thousand_gpus_pay_a_trees_latency():
    """dp=1,024 H100s under DDP (zero=0): the gradient buckets' all-reduces take NCCL's trees, 20
    latency steps each (8 us a network hop) where a ring takes 2,046 (16 ms a bucket). The data axis'
    all-reduce of a small GPT's gradients (a few buckets of at most 25 MiB) then costs its bandwidth
    and 0.16 ms a bucket."""
    from autopar.codegen.buckets import DEFAULT_BUCKET_BYTES
    from autopar.solver import plan_model
    from solver_helpers import traced

    g, _ = traced("gpt:hidden=256,layers=2,heads=4,vocab=1024,seq=128")
    cluster = make_cluster("h100", 128)
    plan = plan_model(g, cluster, global_batch=2048, seq_len=128, force="dp=1024,tp=1,pp=1,zero=0")
    (row,) = [o for o in plan.step_time.overlap if o.key == "dp:all_reduce" and o.total_s > 1e-4]
    link = cluster.inter
    assert link.all_reduce_tree and link.latency_s == 8e-6
    grad_bytes = 2 * g.param_count                   # bf16 gradients on the wire (autopar's runtime)
    buckets = math.ceil(grad_bytes / DEFAULT_BUCKET_BYTES) + 1     # and the small first one
    bandwidth = 2 * 1023 / 1024 * grad_bytes / link.busbw_Bps
    losses = 2 * plan.num_micro_batches             # the loss's two one-value all-reduces a micro-batch
    assert bandwidth < row.total_s <= bandwidth + (buckets + losses) * 20 * link.latency_s + 1e-9
    assert row.total_s < 2046 * link.latency_s          # one bucket's ring latency: 16 ms
