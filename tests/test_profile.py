"""``autopar profile``: profiler events classed as the cost model classes ops; the report's arithmetic
on hand-made rank profiles; one real run on two gloo ranks (JSON keys the issue names, the
collectives the reducer issued, a Chrome trace per rank)."""
from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

from autopar.cost.collectives import collective_s
from autopar.cost.hardware import resolve_cluster
from autopar.profile import predicted_collective_s, render, summarize
from autopar.runtime.profiling import op_class


def test_profiler_events_are_classed_as_the_cost_model_classes_ops():
    assert op_class("aten::addmm") == "matmul"
    assert op_class("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert op_class("aten::gelu") == "memory"
    assert op_class("aten::view") == "free"
    assert op_class("c10d::allreduce_") == "collective:all_reduce"
    assert op_class("c10d::_reduce_scatter_base_") == "collective:reduce_scatter"
    assert op_class("c10d::send") == "collective:p2p"
    assert op_class("Optimizer.step#AdamW.step") == "optimizer"
    assert op_class("autograd::engine::evaluate_function: AddmmBackward0") == "runtime"
    assert op_class("autopar::collective:all_reduce|dp|1024") == "collective:all_reduce"


def test_waiting_for_an_async_collective_counts_as_that_collective():
    """``collectives.wait_for``: the time a bucket's or a prefetch's ``work.wait()`` blocks is not in
    any c10d op (the launch returned); under the profiler it is the collective's, not host time."""
    import time
    from collections import Counter

    from torch.profiler import profile

    from autopar.runtime.collectives import wait_for

    class Work:
        def wait(self):
            time.sleep(0.02)

    with profile() as prof:
        wait_for(Work(), "all_reduce", "dp", 4096)
    by = Counter()
    for e in prof.key_averages():
        by[op_class(e.key)] += e.self_cpu_time_total * 1e-6
    assert by["collective:all_reduce"] >= 0.02 and by["runtime"] < 0.01


def test_each_collectives_launch_and_wait_are_timed_as_that_collective():
    """``collective_range`` around a launch and ``wait_for`` its wait: ``step_profile`` adds what runs
    inside (the c10d op's self time, the wait) to that collective's (kind, axis, bytes), per step; an
    aten op inside a launch stays its own class and is not the collective's; a collective op outside
    any range counts for its kind only."""
    from types import SimpleNamespace

    from autopar.runtime.collectives import COLLECTIVE_EVENT
    from autopar.runtime.profiling import step_profile

    def ev(name, self_us, parent=None):
        return SimpleNamespace(name=name, thread=1, time_range=SimpleNamespace(start=0),
                               self_cpu_time_total=self_us, cpu_parent=parent)

    launch = ev(COLLECTIVE_EVENT + "all_reduce|dp|4096", 10)
    wait = ev(COLLECTIVE_EVENT + "all_reduce|dp|4096", 6000)
    tp = ev(COLLECTIVE_EVENT + "all_gather|tp|512", 2000)
    events = [launch, ev("c10d::allreduce_", 1000, launch), ev("aten::copy_", 500, launch), wait, tp,
              ev("c10d::allreduce_", 3000)]
    by_class, by_coll = step_profile(events, 2)
    assert by_coll == {("all_reduce", "dp", 4096): pytest.approx(0.00701 / 2),
                       ("all_gather", "tp", 512): pytest.approx(0.001)}
    assert by_class["collective:all_reduce"] == pytest.approx(0.01001 / 2)
    assert by_class["memory"] == pytest.approx(0.00025)


def test_what_the_optimizer_step_runs_is_the_optimizers():
    """AdamW's step runs elementwise aten ops (``_fused_adamw_`` or foreach ones): under the profiler
    they are the optimizer's time, not the memory-bound compute's, and a matmul outside the step
    stays a matmul."""
    import torch
    from torch.profiler import profile

    from autopar.runtime.profiling import step_classes

    w = torch.nn.Parameter(torch.randn(256, 256))
    opt = torch.optim.AdamW([w], lr=1e-3)
    with profile() as prof:
        for _ in range(2):
            (w @ w).sum().backward()
            opt.step()
            opt.zero_grad()
    by = step_classes(prof.events(), 2)
    assert by["matmul"] > 0 and by["optimizer"] > 0
    inside = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is not None
              and e.cpu_parent.name.startswith("Optimizer.step#")]
    assert inside and all(op_class(e.name) != "optimizer" for e in inside)    # aten ops: reclassified
    naive = sum(e.self_cpu_time_total for e in prof.events() if op_class(e.name) == "optimizer") * 1e-6 / 2
    assert by["optimizer"] > naive


def test_a_functional_collectives_wait_is_that_collectives_time():
    """DTensor issues ``_c10d_functional`` collectives and waits for them in ``wait_tensor`` (on gloo
    most of the collective's time): each wait counts for the oldest unwaited launch of its thread,
    not as host time; a wait with nothing launched before it on its thread stays ``runtime``."""
    from types import SimpleNamespace

    from autopar.runtime.profiling import step_classes

    def ev(name, thread, start, self_us):
        return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start),
                               self_cpu_time_total=self_us, cpu_parent=None)

    events = [ev("_c10d_functional::all_reduce", 1, 0, 1000), ev("_c10d_functional::all_gather_into_tensor", 1, 1, 2000),
              ev("_c10d_functional::wait_tensor", 1, 2, 10000), ev("_c10d_functional::wait_tensor", 1, 3, 5000),
              ev("_c10d_functional::wait_tensor", 2, 4, 7000), ev("aten::mm", 1, 5, 3000)]
    by = step_classes(events, 1)
    assert by["collective:all_reduce"] == pytest.approx(0.011) and by["collective:all_gather"] == pytest.approx(0.007)
    assert by["runtime"] == pytest.approx(0.007) and by["matmul"] == pytest.approx(0.003)


def test_on_a_gpu_each_op_counts_the_kernels_it_launched():
    """Device mode: an op's class gets the GPU time of its kernels (self device time), not its host
    time, and the kernels' own events (device_type CUDA) are not counted a second time; an op that
    launched nothing (a view, the executor's Python) counts nothing."""
    from types import SimpleNamespace

    import torch

    from autopar.runtime.profiling import step_classes

    def ev(name, host_us, device_us, kind=torch.autograd.DeviceType.CPU):
        return SimpleNamespace(name=name, thread=1, time_range=SimpleNamespace(start=0), cpu_parent=None,
                               self_cpu_time_total=host_us, self_device_time_total=device_us, device_type=kind)

    events = [ev("aten::mm", 20, 4000), ev("sm90_xmma_gemm_bf16", 0, 4000, torch.autograd.DeviceType.CUDA),
              ev("aten::add", 10, 300), ev("aten::view", 5, 0), ev("autopar step", 900, 0)]
    on_gpu = step_classes(events, 2, device=True)
    assert on_gpu["matmul"] == pytest.approx(0.002) and on_gpu["memory"] == pytest.approx(0.00015)
    assert on_gpu["runtime"] == 0 and sum(on_gpu.values()) == pytest.approx(0.00215)
    on_host = step_classes(events, 2)
    assert on_host["matmul"] == pytest.approx(10e-6) and on_host["runtime"] == pytest.approx(450e-6)


def test_what_a_matmul_runs_inside_is_the_matmuls():
    """On the CPU ``addmm`` copies its bias into the output (a nested ``aten::copy_``) before the
    GEMM: that copy is the matmul's time, not the memory-bound ops'; a copy outside stays memory."""
    import torch
    from torch.profiler import profile

    from autopar.runtime.profiling import step_classes

    x, w, b = torch.randn(256, 256), torch.randn(256, 256), torch.randn(256)
    with profile() as prof:
        for _ in range(2):
            torch.addmm(b, x, w)
            x.clone()
    nested = [e for e in prof.events() if e.name == "aten::copy_" and e.cpu_parent is not None
              and e.cpu_parent.name == "aten::addmm"]
    assert nested                                            # what the rule is about exists
    by = step_classes(prof.events(), 2)
    addmm = [e for e in prof.events() if e.name == "aten::addmm"]
    assert by["matmul"] == pytest.approx(sum(e.cpu_time_total for e in addmm) * 1e-6 / 2)   # all it runs inside
    assert by["memory"] > 0                                  # the clone's copy


def test_compute_shares_split_the_rank_work_by_class(dp2_plan):
    """``compute_shares``: each class's forward + backward compute of the solver's tables over the
    rank's parts; they add up to 1, every class of a GPT has some and the views cost nothing."""
    from autopar.models import build_model
    from autopar.profile import compute_shares
    from autopar.trace import trace_model

    plan, cluster = dp2_plan
    b = build_model("gpt-tiny", device="meta")
    g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    from dataclasses import replace

    from autopar.runtime.memory_predict import plan_evaluation

    shares = compute_shares(*plan_evaluation(plan, g, cluster), cluster)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares.get("free", 0.0) == 0.0 and min(shares["matmul"], shares["memory"], shares["attention"]) > 0
    # the runtime's passes through memory (dp=2: the gradients into the reducer's buckets) apart
    apart = compute_shares(*plan_evaluation(plan, g, cluster), cluster, passes_apart=True)
    assert sum(apart.values()) == pytest.approx(1.0) and apart["memory_passes"] > 0
    assert apart["memory"] + apart["memory_passes"] == pytest.approx(shares["memory"])
    # the classes' times are the tables' compute without the host's per-node cost
    host = replace(cluster, gpu=replace(cluster.gpu, op_overhead_s=1e-4))
    _, summary, _ = plan_evaluation(plan, g, host)
    for part in summary.parts.values():
        assert sum(f + b for f, b in part.by_kind.values()) == pytest.approx(
            part.fwd_compute_s + part.bwd_compute_s - 1e-4 * part.nodes)


@pytest.fixture(scope="module")
def dp2_plan():
    from autopar.models import build_model
    from autopar.solver import plan_model
    from autopar.solver.forcing import parse_force
    from autopar.trace import trace_model

    b = build_model("gpt-tiny", device="meta")
    g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    cluster = resolve_cluster("cpu", nodes=1, gpus_per_node=2)
    return plan_model(g, cluster, global_batch=int(b.example_inputs[0].shape[0]), seq_len=b.seq_len,
                      dtype="float32", force=parse_force("dp=2,zero=0")), cluster


def test_the_zero3_groups_host_time_is_the_plans():
    """``group_host_s``: what ``GPUSpec.zero3_group_overhead_s`` adds to the plan's compute (per gather
    group per micro-batch on the busiest rank), and nothing without ZeRO-3."""
    from dataclasses import replace

    from autopar.models import build_model
    from autopar.profile import group_host_s
    from autopar.runtime.memory_predict import plan_evaluation
    from autopar.solver import plan_model
    from autopar.solver.forcing import parse_force
    from autopar.trace import trace_model

    b = build_model("gpt-tiny", device="meta")
    g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    cpu = resolve_cluster("cpu", nodes=1, gpus_per_node=2)
    host = replace(cpu, gpu=replace(cpu.gpu, zero3_group_overhead_s=1e-3))
    for zero in (3, 2):
        plan = plan_model(g, cpu, global_batch=int(b.example_inputs[0].shape[0]), seq_len=b.seq_len,
                          dtype="float32", force=parse_force(f"dp=2,zero={zero},mbs=1"))
        ev, summary, _ = plan_evaluation(plan, g, cpu)
        ev_host, _, _ = plan_evaluation(plan, g, host)
        extra = ev_host.step.compute_s - ev.step.compute_s
        assert group_host_s(ev_host, summary, host) == pytest.approx(extra, abs=1e-12)
        assert (extra >= 2 * 1e-3 * plan.num_micro_batches) if zero == 3 else extra == 0.0


def test_report_arithmetic_on_hand_made_profiles(dp2_plan):
    plan, cluster = dp2_plan
    mesh = {"dp": 0, "tp": 0}
    ranks = [{"rank": r, "coordinates": mesh, "steps": 2, "step_times_s": times, "trace_path": None,
              "by_class_s": {"matmul": 0.010 + r * 0.002, "memory": 0.004, "collective:all_reduce": 0.003,
                             "optimizer": 0.001, "runtime": 0.020},
              "collectives": [["all_reduce", "dp", 1000, 1]]}
             for r, times in enumerate(((0.05, 0.07), (0.06, 0.05)))]
    rep = summarize(plan, cluster, ranks)
    assert rep["measured_step_time_s"] == pytest.approx((0.06 + 0.07) / 2)      # slowest rank per step
    assert rep["step_times_s"] == [0.06, 0.07]                                   # each step's, in order
    console = Console(file=io.StringIO(), width=200)
    render(rep, console)
    assert "the mean of 2 steps, 60.00 ms to 70.00 ms" in console.file.getvalue()
    assert rep["predicted_step_time_s"] == plan.step_time.total_s
    cat = {c["category"]: c for c in rep["categories"]}
    assert cat["compute"]["measured_s"] == pytest.approx(0.011 + 0.004)         # mean over ranks
    assert cat["compute"]["predicted_s"] == pytest.approx(plan.step_time.compute_s + plan.step_time.recompute_s)
    assert cat["comm all_reduce"]["measured_s"] == pytest.approx(0.003)
    host = cat["host overhead (executor, dispatch, autograd)"]
    assert host["predicted_s"] is None                      # the built-in cpu cluster has no overhead figure
    # the wall time less the profiled compute, collectives and optimizer (mean over ranks)
    assert host["measured_s"] == pytest.approx(0.065 - (0.011 + 0.004 + 0.003 + 0.001))
    (row,) = rep["collectives"]
    assert row["predicted_s_per_step"] == pytest.approx(collective_s("all_reduce", 1000, 2, cluster.intra))


def test_host_overhead_is_predicted_per_node_when_the_cluster_has_it(dp2_plan):
    from dataclasses import replace

    plan, cluster = dp2_plan
    measured = replace(cluster, gpu=replace(cluster.gpu, op_overhead_s=1e-4, dtensor_op_overhead_s=5e-4))
    ranks = [{"rank": 0, "coordinates": {"dp": 0}, "steps": 1, "step_times_s": [0.05], "trace_path": None,
              "by_class_s": {"matmul": 0.01}, "collectives": []}]
    cat = {c["category"]: c for c in summarize(plan, measured, ranks, nodes=[120])["categories"]}
    assert cat["host overhead (executor, dispatch, autograd)"]["predicted_s"] == pytest.approx(120 * 1e-4)   # tp == 1
    assert cat["compute"]["predicted_s"] == pytest.approx(plan.step_time.compute_s - 120 * 1e-4)
    # ZeRO-3's gather groups' host time (``group_host_s``) moves from the compute row to the host row
    cat = {c["category"]: c for c in summarize(plan, measured, ranks, nodes=[120], groups_host_s=0.003)["categories"]}
    assert cat["host overhead (executor, dispatch, autograd)"]["predicted_s"] == pytest.approx(120 * 1e-4 + 0.003)
    assert cat["compute"]["predicted_s"] == pytest.approx(plan.step_time.compute_s - 120 * 1e-4 - 0.003)


def test_a_pipelines_waits_are_compared_with_its_bubble_on_the_host_row():
    """With pp > 1 a stage waiting for its neighbour blocks in torch's schedule, where the profiler
    records nothing: the host row then measures those waits too, and its prediction is the host's
    plus the plan's bubble (one row, no unmeasurable bubble row)."""
    from autopar.models import build_model
    from autopar.profile import HOST, PIPELINE_HOST
    from autopar.solver import plan_model
    from autopar.trace import trace_model

    b = build_model("gpt-tiny", device="meta")
    g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    cluster = resolve_cluster("cpu", nodes=1, gpus_per_node=2)
    plan = plan_model(g, cluster, global_batch=int(b.example_inputs[0].shape[0]), seq_len=b.seq_len,
                      dtype="float32", force="pp=2,mbs=1")
    assert plan.step_time.bubble_s > 0
    ranks = [{"rank": r, "coordinates": {"pp": r}, "steps": 1, "step_times_s": [0.05], "trace_path": None,
              "by_class_s": {"matmul": 0.01, "runtime": 0.002}, "collectives": []} for r in range(2)]
    cat = {c["category"]: c for c in summarize(plan, cluster, ranks)["categories"]}
    assert HOST not in cat and "pipeline bubble" not in cat
    assert cat[PIPELINE_HOST]["measured_s"] == pytest.approx(0.05 - 0.01)
    assert cat[PIPELINE_HOST]["predicted_s"] == pytest.approx(plan.step_time.host_s + plan.step_time.bubble_s)


def test_the_rings_rotations_are_compared_on_the_all_to_all_row():
    """The ring's rotations run as ``all_to_all_single`` on the cp group: the plan's ``cp:ring`` time
    is the prediction of the measured all_to_all row, not a row of its own."""
    from autopar.models import build_model
    from autopar.solver import plan_model
    from autopar.solver.forcing import parse_force
    from autopar.trace import trace_model

    b = build_model("gpt-tiny", device="meta")
    g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    cluster = resolve_cluster("cpu", nodes=1, gpus_per_node=2)
    plan = plan_model(g, cluster, global_batch=int(b.example_inputs[0].shape[0]), seq_len=b.seq_len,
                      dtype="float32", force=parse_force("cp=2,cpmode=ring,dp=1"))
    ring = dict(plan.step_time.comm_s)["cp:ring"]
    ranks = [{"rank": 0, "coordinates": {"dp": 0}, "steps": 1, "step_times_s": [0.05], "trace_path": None,
              "by_class_s": {"collective:all_to_all": 0.004}, "collectives": []}]
    cat = {c["category"]: c for c in summarize(plan, cluster, ranks)["categories"]}
    assert "comm ring" not in cat
    assert (cat["comm all_to_all"]["measured_s"], cat["comm all_to_all"]["predicted_s"]) == pytest.approx((0.004, ring))


def test_predicted_collective_time_on_the_axis_link(dp2_plan):
    plan, cluster = dp2_plan
    # ring all-reduce of 1 MB over 2 ranks: 2 (n-1)/n bytes at busbw plus 2 (n-1) latency steps
    want = 1e6 / cluster.intra.busbw_Bps + 2 * cluster.intra.latency_s
    assert predicted_collective_s(plan, cluster, "all_reduce", "dp", 10 ** 6) == pytest.approx(want)
    assert math.isnan(predicted_collective_s(plan, cluster, "all_reduce", "nope", 10))   # not an axis of the plan


@pytest.mark.slow
def test_profile_runs_two_ranks_and_writes_json_and_traces(tmp_path):
    from autopar.cli import main

    out = tmp_path / "p.json"
    assert main(["profile", "gpt-tiny", "--nproc", "2", "--steps", "1", "--force", "dp=2,zero=2",
                 "--json", str(out), "--trace-dir", str(tmp_path / "traces")]) == 0
    rep = json.loads(out.read_text())
    assert rep["measured_step_time_s"] > 0 and rep["predicted_step_time_s"] > 0
    kinds = {(c["kind"], c["axis"]) for c in rep["collectives"]}
    assert ("reduce_scatter", "dp") in kinds and ("all_gather", "dp") in kinds, kinds
    # each collective the reducer issued was timed inside its own range (launch and wait)
    timed = {(c["kind"], c["axis"]): c["measured_s_per_step"] for c in rep["collectives"]}
    assert timed["reduce_scatter", "dp"] > 0 and timed["all_gather", "dp"] > 0, timed
    assert [m["rank"] for m in rep["memory"]] == [0, 1]
    # per class, as the table's rows; the memory-bound row's prediction holds the runtime's copies
    cat = {c["category"].strip(): c for c in rep["categories"]}
    by = rep["by_class"]
    assert by["memory"]["predicted_s"] == pytest.approx(cat["memory-bound ops"]["predicted_s"])
    assert 0 < by["memory_passes"]["predicted_s"] < by["memory"]["predicted_s"]
    assert by["matmul"]["measured_s"] == pytest.approx(cat["matmul"]["measured_s"]) and by["matmul"]["measured_s"] > 0
    assert rep["optimizer"]["measured_s"] > 0 and rep["optimizer"]["predicted_s"] > 0
    assert all(m["measured_peak_bytes"] > 0 and m["predicted_peak_bytes"] > 0 for m in rep["memory"])
    for r in rep["ranks"]:
        trace = json.loads(open(r["trace"]).read())
        assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])


@pytest.mark.slow
def test_profile_times_dtensors_collectives_per_axis(tmp_path):
    """tp=2: DTensor's functional collectives on the tp axis are timed one by one (launch and the
    wait for it, ``CollectiveRecorder``), and together they are the tp-axis share of their kind's
    measured time: a collective's rows add up to no more than its kind's row of the step table."""
    from autopar.cli import main

    cluster = tmp_path / "fast.toml"      # links nearly free: the tp axis shards (on "cpu" it replicates)
    cluster.write_text('name = "fast"\ngpu = "cpu"\nnodes = 1\ngpus_per_node = 2\n'
                       '[intra]\nbusbw_GBps = 1000.0\nlatency_us = 0.0\n[inter]\nbusbw_GBps = 1000.0\nlatency_us = 0.0\n')
    out = tmp_path / "p.json"
    assert main(["profile", "gpt-tiny", "--nproc", "2", "--steps", "1", "--force", "tp=2", "--cluster", str(cluster),
                 "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    rows = [c for c in rep["collectives"] if c["axis"] == "tp"]
    assert rows and all(c["measured_s_per_step"] > 0 for c in rows), rows
    cat = {c["category"]: c["measured_s"] for c in rep["categories"]}
    for kind in {c["kind"] for c in rows}:
        timed = sum(c["measured_s_per_step"] for c in rep["collectives"] if c["kind"] == kind)
        assert 0 < timed <= cat[f"comm {kind}"] * (1 + 1e-9), (kind, timed, cat)


@pytest.mark.slow
def test_profile_runs_a_mixed_precision_plan(tmp_path):
    """``--dtype bf16``: the plan is made and run for bf16 compute (autocast over fp32 parameters, as
    ``autopar run --dtype``), and the report says so; a plan file made for another dtype is refused
    before any rank starts."""
    from autopar.cli import main
    from autopar.plan import Plan
    from autopar.profile import profile_command

    out = tmp_path / "p.json"
    assert main(["profile", "gpt-tiny", "--nproc", "1", "--steps", "1", "--dtype", "bf16", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["dtype"] == "bfloat16" and rep["measured_step_time_s"] > 0 and rep["predicted_step_time_s"] > 0
    fp32 = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--gpu", "a100-80g", "--nodes", "1", "--dtype", "fp32", "--json", str(fp32)]) == 0
    assert Plan.load(str(fp32)).dtype == "float32"
    with pytest.raises(ValueError, match="was made for float32 compute"):
        profile_command("gpt-tiny", 1, 1, plan_path=str(fp32), dtype="bf16")


def test_a_collectives_range_costs_nothing_outside_a_profiler():
    """``collective_range`` opens a profiler range only under a profiler (a ``record_function``
    costs microseconds a call even with none running, on every collective of every step)."""
    import contextlib

    from torch.profiler import profile

    from autopar.runtime.collectives import collective_range, parse_collective_event

    assert isinstance(collective_range("all_reduce", "tp", 8), contextlib.nullcontext)
    with profile() as prof:
        with collective_range("all_reduce", "tp", 8):
            pass
    assert [parse_collective_event(e.name) for e in prof.events()
            if parse_collective_event(e.name)] == [("all_reduce", "tp", 8)]
