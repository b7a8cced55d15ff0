"""`autopar calibrate`: the link fit on synthetic timings, the cluster file it writes (synthetic and
from a real, short run on 2 CPU ranks), and its errors."""
from __future__ import annotations

import argparse
import math
import os
import time
import tomllib
from dataclasses import replace

import pytest
import torch
from rich.console import Console

from autopar.calibrate import SIZES, Calibration, SdpaFigures, add_parser, check_nproc, cmd_calibrate, measure
from autopar.calibrate_file import calibration_toml, cluster_dict, measured_dict
from autopar.calibrate_bench import SHARED_WINDOW_S, GemmShape, shared_window_s, summarize_gemms, time_per_call
from autopar.calibrate_comm import CollectivePoint, fit_link, time_collective, time_collective_in_situ
from autopar.calibrate_step import CLASSES, FACTOR_BOUNDS, StepRates, class_times
from autopar.cost.collectives import COLLECTIVE_KINDS, all_reduce_s, collective_s
from autopar.cost.compute import MEMORY_CLASSES, op_time_s
from autopar.cost.cluster_file import cluster_from_dict, cluster_to_toml, load_cluster
from autopar.cost.hardware import LinkSpec, get_gpu, resolve_cluster


def _points(link: LinkSpec, n: int, noise=lambda i: 1.0) -> list[CollectivePoint]:
    pts = [CollectivePoint(k, n, size, collective_s(k, size, n, link)) for k in COLLECTIVE_KINDS for size in SIZES]
    return [replace(p, seconds=p.seconds * noise(i)) for i, p in enumerate(pts)]


def test_ranks_sharing_cores_time_over_a_window():
    """CPU ranks that share cores time each call back to back over a window, so that every rank
    measures while all are busy (``calibrate_bench``'s module docstring); a GPU, or CPU ranks with
    a core each, time a batch as before."""
    import torch

    assert shared_window_s("cpu", 4, 1, 2) == SHARED_WINDOW_S > 0
    assert shared_window_s("cpu", 2, 1, 2) == shared_window_s("cuda", 8, 1, 2) == 0.0
    calls: list = []
    # a batch of at most 3 calls but for the window: microseconds where the window were ignored
    per_call = time_per_call(lambda: calls.append(time.perf_counter()), torch.device("cpu"), min_time_s=0.0,
                             max_reps=3, window_s=0.02)
    timed = len(calls) - 2                                   # after the two warm-up calls
    assert timed > 3 and per_call * timed >= 0.02            # the window's wall time over its calls


def test_collectives_timed_in_situ_after_compute():
    """``time_collective_in_situ``: what a collective adds after a block of compute, which is what a
    training step pays, where back to back it runs warm. A stand-in collective that costs 6 ms
    right after compute and 1 ms after itself times 1 ms back to back and 6 ms in situ; the 2 ms
    compute block is taken out. One gloo rank (barriers and the MAX over ranks run for real)."""
    import torch.distributed as dist

    state = {"cold": False}

    def compute():
        time.sleep(0.002)
        state["cold"] = True

    def collective():
        time.sleep(0.006 if state["cold"] else 0.001)
        state["cold"] = False

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        cpu = torch.device("cpu")
        back_to_back = time_collective(collective, 5, cpu, batches=3)
        in_situ = time_collective_in_situ(collective, compute, 5, cpu, batches=3)
    finally:
        dist.destroy_process_group()
    assert 0.001 <= back_to_back < 0.003         # sleeps only overshoot: upper bounds leave room for load
    assert 0.0045 < in_situ < 0.0075            # the compute block taken out (8 ms with it)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_recovers_latency_and_busbw(n):
    truth = LinkSpec("t", busbw_Bps=3.2e9, latency_s=45e-6, source="")
    fit = fit_link(_points(truth, n))
    assert fit.busbw_Bps == pytest.approx(3.2e9, rel=1e-9) and fit.latency_s == pytest.approx(45e-6, rel=1e-9)
    assert fit.rel_rms < 1e-9 and fit.points == len(COLLECTIVE_KINDS) * len(SIZES)
    # +-5% deterministic jitter: still within a few percent
    noisy = fit_link(_points(truth, n, noise=lambda i: 1.0 + 0.05 * math.sin(7.0 * i)))
    assert noisy.busbw_Bps == pytest.approx(3.2e9, rel=0.05) and noisy.latency_s == pytest.approx(45e-6, rel=0.1)
    assert 0.0 < noisy.rel_rms < 0.05


def test_fit_counts_the_steps_of_the_links_all_reduce():
    """NCCL's all-reduces take trees: a GPU calibration's fit counts 2 ceil(log2 n) latency steps, as
    the cost model then prices them (``collectives.all_reduce_s``), and its link says so."""
    truth = LinkSpec("t", busbw_Bps=3.2e9, latency_s=45e-6, source="", all_reduce_tree=True)
    pts = [p for p in _points(truth, 8) if p.kind == "all_reduce"]
    fit = fit_link(pts, all_reduce_tree=True)
    assert fit.latency_s == pytest.approx(45e-6, rel=1e-9) and fit.link("x", "").all_reduce_tree
    ring = fit_link(pts)                 # the same times read as a ring's 14 steps: a smaller latency
    assert ring.latency_s < 45e-6 * 6 / 14 * 1.5 and not ring.link("x", "").all_reduce_tree


def test_fit_one_kind_and_bandwidth_only():
    truth = LinkSpec("t", busbw_Bps=1e9, latency_s=0.0, source="")
    pts = [p for p in _points(truth, 4) if p.kind == "all_reduce"]
    fit = fit_link(pts)
    assert fit.latency_s == 0.0 and fit.busbw_Bps == pytest.approx(1e9, rel=1e-9)


def test_fit_tells_the_call_latency_from_the_steps_with_two_group_sizes():
    """Times of all-reduces over 2 and 4 ranks with a per-call and a per-step latency: the fit gets
    both back; over one group size they cannot be told apart, and the call latency is 0 (the old
    one-latency fit). The cluster file carries it (``call_latency_us``) and the cost model prices it."""
    truth = LinkSpec("t", busbw_Bps=1.2e9, latency_s=1.1e-3, source="", call_latency_s=1.0e-3)
    two = [p for n in (2, 4) for p in _points(truth, n) if p.kind == "all_reduce"]
    fit = fit_link(two)
    assert fit.call_latency_s == pytest.approx(1e-3, rel=1e-6) and fit.latency_s == pytest.approx(1.1e-3, rel=1e-6)
    assert fit.busbw_Bps == pytest.approx(1.2e9, rel=1e-6) and fit.rel_rms < 1e-9
    one = fit_link([p for p in two if p.ranks == 4])
    assert one.call_latency_s == 0.0 and one.latency_s == pytest.approx(1.1e-3 + 1e-3 / 6, rel=1e-6)
    cal = _calibration("cpu", {"float32": 41.3e9}, copy=12.5e9, sdpa_rate=20e9,
                       points=two + [p for p in _points(truth, 4) if p.kind != "all_reduce"])
    c = cluster_from_dict(cluster_dict(cal))
    assert c.intra.call_latency_s == pytest.approx(1e-3, rel=1e-6)
    assert all_reduce_s(4, 2, c.intra) == pytest.approx(1e-3 + 2 * 1.1e-3 + 4 / 1.2e9, rel=1e-6)
    assert cluster_from_dict(tomllib.loads(cluster_to_toml(c))) == c


def test_calibrate_times_all_reduces_over_pairs_with_four_ranks_or_more():
    from autopar.calibrate_rank import _measurements, pair_groups

    assert pair_groups(4) and pair_groups(8) and not pair_groups(2) and not pair_groups(3)
    assert _measurements(["all_reduce", "p2p"], 4) == [("all_reduce", 4), ("p2p", 4), ("all_reduce", 2)]
    assert _measurements(["all_reduce"], 2) == [("all_reduce", 2)]


def test_fit_errors():
    flat = [CollectivePoint("all_reduce", 2, s, 1e-3) for s in SIZES]
    with pytest.raises(ValueError, match="do not grow with the message size"):
        fit_link(flat)
    with pytest.raises(ValueError, match="at least 2"):
        fit_link(flat[:1])
    with pytest.raises(ValueError, match="positive finite"):
        fit_link([CollectivePoint("p2p", 2, 1024, 0.0), CollectivePoint("p2p", 2, 4096, 1e-3)])


def _calibration(kind: str, rates: dict[str, float], copy: float, sdpa_rate: float, points=(),
                 memory_classes=()) -> Calibration:
    shape = GemmShape(1024, 1024, 1024)
    gemm = tuple((d, summarize_gemms([(shape, {"fwd": shape.flops / r})]), 0) for d, r in rates.items())
    return Calibration(device_kind=kind, device_name="NVIDIA H200" if kind == "cuda" else "cpu",
                       gpu="h200" if kind == "cuda" else "cpu", nproc=4, threads_per_rank=1, torch_version="x",
                       date="2026-01-01", gemm=gemm,
                       sdpa=SdpaFigures("bfloat16" if kind == "cuda" else "float32", "B=1", sdpa_rate, sdpa_rate, 2.5, None),
                       copy_Bps=copy, vector_flops=2e9 if kind == "cpu" else None, overhead_s=2e-6, points=tuple(points),
                       fits=tuple((k, fit_link([p for p in points if p.kind == k])) for k in COLLECTIVE_KINDS if points),
                       link=fit_link([p for p in points if p.kind == "all_reduce"]) if points else None,
                       link_kind="all_reduce" if points else "", joint=fit_link(points) if points else None,
                       link_note="" if points else "1 rank",
                       measure_s=1.0, memory_classes=tuple(memory_classes))


def _rate(gpu, dtype: str, kind: str = "matmul") -> float:
    """What the cost model predicts for a big op of ``kind``: FLOP/s."""
    return 1e12 / op_time_s(1e12, 0.0, dtype, gpu, kind)


def test_cpu_file_prices_what_was_measured(tmp_path):
    points = _points(LinkSpec("t", 1.5e9, 80e-6, ""), 4)
    cal = _calibration("cpu", {"float32": 41.3e9, "bfloat16": 77.7e9}, copy=12.5e9, sdpa_rate=20e9, points=points)
    d = cluster_dict(cal, nodes=2)
    c = cluster_from_dict(d)
    assert (c.nodes, c.gpus_per_node, c.gpu.name) == (2, 4, "cpu")
    assert _rate(c.gpu, "float32") == pytest.approx(41.3e9) and _rate(c.gpu, "bf16") == pytest.approx(77.7e9)
    assert _rate(c.gpu, "fp16") == pytest.approx(41.3e9)                  # not measured: the slowest measured
    assert c.cores_per_node == 0                                         # the cores the ranks shared: not given
    shared = cluster_from_dict(cluster_dict(replace(cal, cores=2), nodes=2))
    assert shared.cores_per_node == 2 and shared.rank_speedup == 2.0       # 4 ranks on 2 cores
    assert "fp16 not measured" in c.gpu.source
    assert _rate(c.gpu, "float32", "attention") == pytest.approx(20e9, rel=1e-3)
    assert c.gpu.hbm_Bps * c.gpu.memory_efficiency == pytest.approx(12.5e9)
    assert c.gpu.peak_flops_for("vector") == pytest.approx(2e9)
    assert c.intra.busbw_Bps == pytest.approx(1.5e9) and c.intra.latency_s == pytest.approx(80e-6)
    p = tmp_path / "c.toml"
    p.write_text(calibration_toml(c, measured_dict(cal, 10.0, 12.0)))
    assert load_cluster(p) == c
    assert tomllib.loads(p.read_text())["measured"]["gemm"]["float32"]["TFLOPs"] == pytest.approx(0.0413)
    p.write_text(cluster_to_toml(c))
    assert load_cluster(p) == c


def test_memory_bound_op_classes_priced_at_their_measured_rates(tmp_path):
    """On a GPU a class's measured bytes/s over the datasheet bandwidth is its efficiency: a layer
    norm at 2.4 TB/s on an H200 (4.8 TB/s) moves 1 GB in 1e9 / 2.4e12 s; a class not measured runs
    at the copy's rate. On a CPU the classes are recorded in [measured], not priced (measured at the
    calibration's shapes they run from cache, faster than a model's small ops do). The files
    round-trip through the TOML."""
    h200 = get_gpu("h200")
    cal = _calibration("cuda", {"bfloat16": 0.7 * h200.peak_flops_for("bf16")}, copy=4.2e12, sdpa_rate=1e15,
                       memory_classes=(("norm", 2.4e12), ("activation", 3.6e12)))
    g = cluster_from_dict(cluster_dict(cal))
    assert g.gpu.memory_eff_for("norm") == pytest.approx(0.5) and g.gpu.memory_eff_for("softmax") == pytest.approx(4.2 / 4.8)
    assert op_time_s(0.0, 1e9, "bfloat16", g.gpu, "memory", mclass="norm") == pytest.approx(1e9 / 2.4e12)
    assert op_time_s(0.0, 1e9, "bfloat16", g.gpu, "memory", mclass="activation") == pytest.approx(1e9 / 3.6e12)
    assert op_time_s(0.0, 1e9, "bfloat16", g.gpu, "memory") == pytest.approx(1e9 / 4.2e12)
    p = tmp_path / "g.toml"
    p.write_text(calibration_toml(g, measured_dict(cal, 10.0, 12.0)))
    assert load_cluster(p) == g
    classes = (("norm", 2.5e9), ("activation", 1.25e9), ("softmax", 3.125e9), ("elementwise", 15e9))
    cal = _calibration("cpu", {"float32": 41.3e9}, copy=12.5e9, sdpa_rate=20e9, memory_classes=classes)
    c = cluster_from_dict(cluster_dict(cal))
    assert c.gpu.memory_class_efficiency == () and op_time_s(0.0, 1e9, "float32", c.gpu, "memory", mclass="norm") == \
        pytest.approx(0.08)
    p.write_text(calibration_toml(c, measured_dict(cal, 10.0, 12.0)))
    assert tomllib.loads(p.read_text())["measured"]["memory_class_GBps"]["activation"] == pytest.approx(1.25)


def test_per_node_step_costs_reach_the_cluster(tmp_path):
    """The per-node host costs ``calibrate_runtime`` measures (plain, DTensor on one axis, DTensor
    on a dp x tp mesh) are the cluster's ``op_overhead_s`` / ``dtensor_op_overhead_s`` /
    ``dtensor_2d_op_overhead_s``, in the file and back; without the 2-D figure (fewer than 4 ranks)
    the 2-D cost is the 1-D one. The step's own (the intercept) is ``step_overhead_s``."""
    from dataclasses import replace

    cal = replace(_calibration("cpu", {"float32": 41.3e9}, 12.5e9, 20e9), runtime_overhead=(4.5e-4, 1.1e-3),
                  runtime_overhead_2d=(2.0e-3, True), step_overhead=0.015, ring_attention_overhead=6e-3,
                  zero3_group_overhead=4e-3)
    c = cluster_from_dict(cluster_dict(cal))
    assert (c.gpu.step_overhead_s, c.gpu.ring_attention_overhead_s) == pytest.approx((0.015, 6e-3))
    assert c.gpu.zero3_group_overhead_s == pytest.approx(4e-3)
    assert (c.gpu.op_overhead_s, c.gpu.dtensor_op_overhead_s, c.gpu.dtensor_2d_op_overhead_s) == pytest.approx(
        (4.5e-4, 1.1e-3, 2.0e-3))
    assert c.gpu.node_overhead_s(True, 2) == pytest.approx(2.0e-3) and c.gpu.node_overhead_s(True, 1) == pytest.approx(1.1e-3)
    p = tmp_path / "c.toml"
    p.write_text(calibration_toml(c, measured_dict(cal, 10.0, 12.0)))
    assert load_cluster(p) == c
    assert tomllib.loads(p.read_text())["measured"]["step_us_per_node"]["dtensor_2d"] == pytest.approx(2000.0)
    assert tomllib.loads(p.read_text())["measured"]["step_overhead_us"] == pytest.approx(15000.0)
    one = cluster_from_dict(cluster_dict(replace(cal, runtime_overhead_2d=None)))
    assert one.gpu.dtensor_2d_op_overhead_s == 0.0 and one.gpu.node_overhead_s(True, 2) == pytest.approx(1.1e-3)


def test_the_ring_attention_host_figure_leaves_its_rotations_to_the_link():
    """``calibrate._ring_host``: the ring's per-node host cost, measured with its rotations (cp=2:
    1 forward, 3 backward, each an all_to_all of a few KB), less their latency on the fitted link,
    which the cost model prices; never below 0; absent where it was not measured (an odd world)."""
    from autopar.calibrate import _ring_host
    from autopar.calibrate_comm import LinkFit

    ranks = [{"runtime_overhead": {"ring_attention": 5e-3}}, {"runtime_overhead": {"ring_attention": 7e-3}}]
    fit = LinkFit(latency_s=5e-4, busbw_Bps=1e9, rel_rms=0.1, max_rel=0.2, points=8)
    assert _ring_host(ranks, fit) == pytest.approx(6e-3 - 4 * 5e-4)
    assert _ring_host(ranks, LinkFit(latency_s=1.0, busbw_Bps=1e9, rel_rms=0.1, max_rel=0.2, points=8)) == 0.0
    assert _ring_host(ranks, None) == pytest.approx(6e-3)
    assert _ring_host([{"runtime_overhead": {"plain": 1e-4}}], fit) is None


def test_the_step_host_figure_leaves_the_loss_all_reduces_to_the_link():
    """``calibrate._step_host``: the step's intercept less the loss's two one-value all-reduces
    over the ranks (the reference GPT's mean cross-entropy: ``calibrate_runtime.LOSS_ALL_REDUCES``,
    what ``strategies._scalar_loss`` finds in it), gloo's ring on CPU ranks, NCCL's tree on GPUs
    (the fit's link says which: ``LinkFit.all_reduce_tree``); never below 0; absent where it was not
    measured."""
    from autopar.calibrate import _step_host
    from autopar.calibrate_comm import LinkFit
    from autopar.calibrate_runtime import LOSS_ALL_REDUCES, MODEL
    from autopar.models import build_model
    from autopar.solver.strategies import graph_facts
    from autopar.trace import trace_model

    b = build_model(MODEL.format(layers=1), batch=2, device="meta")
    g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target, model_name="m")
    assert graph_facts(g, None).loss_scalars == LOSS_ALL_REDUCES == 2
    fit = LinkFit(latency_s=5e-4, busbw_Bps=1e9, rel_rms=0.1, max_rel=0.2, points=8)
    small = 2 * 3 / 4 * 4 / 1e9                     # 4 bytes' bus term
    tree = replace(fit, all_reduce_tree=True)
    assert _step_host(13e-3, 4, fit) == pytest.approx(13e-3 - 2 * (6 * 5e-4 + small))     # ring: 2 (n - 1) hops
    assert _step_host(13e-3, 4, tree) == pytest.approx(13e-3 - 2 * (4 * 5e-4 + small))    # tree: 2 log2 n
    assert _step_host(13e-3, 4, replace(fit, latency_s=1.0)) == 0.0
    assert _step_host(13e-3, 4, None) == pytest.approx(13e-3)
    assert _step_host(None, 4, fit) is None


def test_the_zero3_group_host_figure_leaves_its_collectives_to_the_link():
    """``calibrate._zero3_host``: ZeRO-3's per-group host cost, measured with the group's two
    all-gathers and one reduce-scatter (a few KB each), less their latencies on each kind's fit
    (the link's where a kind has none); never below 0; absent where it was not measured (1 rank)."""
    from autopar.calibrate import _zero3_host
    from autopar.calibrate_comm import LinkFit

    def fit(lat):
        return LinkFit(latency_s=lat, busbw_Bps=1e9, rel_rms=0.1, max_rel=0.2, points=8)

    ranks = [{"runtime_overhead": {"zero3_group": 5e-3}}, {"runtime_overhead": {"zero3_group": 7e-3}}]
    fits = {"all_gather": fit(5e-4), "reduce_scatter": fit(1e-3)}
    assert _zero3_host(ranks, fits, fit(2e-4)) == pytest.approx(6e-3 - 2 * 5e-4 - 1e-3)
    assert _zero3_host(ranks, {"all_gather": fit(5e-4)}, fit(2e-4)) == pytest.approx(6e-3 - 2 * 5e-4 - 2e-4)
    assert _zero3_host(ranks, {}, fit(1.0)) == 0.0 and _zero3_host(ranks, {}, None) == pytest.approx(6e-3)
    assert _zero3_host([{"runtime_overhead": {"plain": 1e-4}}], fits, None) is None


def test_each_collective_kind_priced_at_its_measured_busbw():
    """gloo's collectives do not share one busbw (measured here: all_gather 0.53x, reduce_scatter
    0.29x, p2p 3.8x its all_reduce's): the file's link carries each kind's own, relative to the
    all_reduce fit, and the planner's collective times reproduce every kind's measured times."""
    truth = LinkSpec("t", 1.5e9, 80e-6, "", busbw_scale=(("all_gather", 0.53), ("reduce_scatter", 0.29),
                                                          ("p2p", 3.8)))
    points = _points(truth, 4)
    c = cluster_from_dict(cluster_dict(_calibration("cpu", {"float32": 41.3e9}, 12.5e9, 20e9, points=points)))
    assert c.intra.busbw_Bps == pytest.approx(1.5e9)
    assert dict(c.intra.busbw_scale) == pytest.approx({"all_gather": 0.53, "reduce_scatter": 0.29,
                                                       "all_to_all": 1.0, "p2p": 3.8}, rel=1e-3)
    for p in points:
        assert collective_s(p.kind, p.nbytes, p.ranks, c.intra) == pytest.approx(p.seconds, rel=1e-3), p


def test_the_file_fits_in_situ_times_and_keeps_the_back_to_back_ones():
    """CPU collectives timed in situ: the link is fitted to those times, the source says so, and
    the back-to-back times stay in ``[measured]`` beside them."""
    truth = LinkSpec("t", 1.0e9, 1e-3, "")
    points = [replace(p, back_to_back_s=0.5 * p.seconds) for p in _points(truth, 4)]
    cal = _calibration("cpu", {"float32": 41.3e9}, 12.5e9, 20e9, points=points)
    c = cluster_from_dict(cluster_dict(cal))
    assert (c.intra.busbw_Bps, c.intra.latency_s) == pytest.approx((1.0e9, 1e-3), rel=1e-6)
    assert "in situ" in c.intra.source
    m = measured_dict(cal, 10.0, 12.0)["collectives"]["all_reduce"]
    assert m["back_to_back_seconds"] == pytest.approx([0.5 * t for t in m["seconds"]])
    plain = measured_dict(_calibration("cpu", {"float32": 41.3e9}, 12.5e9, 20e9, points=_points(truth, 4)), 10.0, 12.0)
    assert "back_to_back_seconds" not in plain["collectives"]["all_reduce"]


def _report(matmul, attention, memory, passes, optimizer) -> dict:
    """An ``autopar profile`` report's per-class rows: (measured, predicted) seconds per step; the
    memory-bound row's prediction includes ``passes``, the runtime's copies."""
    by = {c: {"measured_s": m, "predicted_s": p} for c, (m, p) in
          (("matmul", matmul), ("attention", attention), ("memory", memory), ("free", (0.002, 0.0)))}
    by["memory_passes"] = {"measured_s": None, "predicted_s": passes}
    return {"by_class": by, "optimizer": {"measured_s": optimizer[0], "predicted_s": optimizer[1]}}


def test_in_step_factors_are_the_predicted_over_the_measured_class_times():
    """Per class, the reference step's time at the microbenchmarked rates over its measured time;
    the memory-bound ops' after the runtime's own copies (priced at the copy's rate in both) are
    taken out of each; a factor outside the bounds is recorded, not used."""
    rows = class_times(_report((0.050, 0.040), (0.008, 0.004), (0.016, 0.009), 0.002, (0.006, 0.009)))
    assert [r[0] for r in rows] == list(CLASSES)
    assert [r[1:] for r in rows] == [pytest.approx(x) for x in ((0.050, 0.040), (0.008, 0.004), (0.014, 0.007),
                                                                 (0.006, 0.009))]
    st = StepRates("m", "dp=4", rows)
    assert [st.factor(c) for c in CLASSES] == pytest.approx([0.8, 0.5, 0.5, 1.5])
    wild = StepRates("m", "dp=4", (("matmul", 0.01, 0.04), ("attention", 0.0, 0.004)))
    assert wild.raw_factor("matmul") == pytest.approx(4.0) and wild.factor("matmul") is None
    assert wild.raw_factor("attention") is None and wild.factor("memory") is None
    # the optimizer's bound is wider (AdamW's state in the cache, FACTOR_BOUNDS): 2.5 is used there only
    fast = StepRates("m", "dp=4", (("matmul", 0.004, 0.010), ("optimizer", 0.004, 0.010), ("memory", 0.001, 0.0045)))
    assert fast.factor("optimizer") == pytest.approx(2.5) and fast.factor("matmul") is None
    assert fast.raw_factor("memory") == pytest.approx(4.5) and fast.factor("memory") is None


def test_cpu_file_prices_each_class_at_its_in_step_rate(tmp_path):
    """The CPU file's efficiencies are the reference step's factors: GEMMs at 0.8 x the loop's rate,
    attention at 0.5 x the SDPA loop's, every memory-bound class at 0.5 x the copy's rate (the
    runtime's copies and the optimizer's memory_efficiency stay at the copy's), the optimizer step
    at 1.5 x; the figures are in ``[measured.in_step]`` and the file round-trips. A factor out of
    bounds keeps the microbenchmark's figure, and a failed reference step changes nothing."""
    rows = (("matmul", 0.050, 0.040), ("attention", 0.008, 0.004), ("memory", 0.014, 0.007), ("optimizer", 0.006, 0.009))
    base = _calibration("cpu", {"float32": 41.3e9}, copy=12.5e9, sdpa_rate=20e9)
    c = cluster_from_dict(cluster_dict(replace(base, in_step=StepRates("ref", "dp=4", rows))))
    assert _rate(c.gpu, "float32") == pytest.approx(0.8 * 41.3e9)
    assert _rate(c.gpu, "float32", "attention") == pytest.approx(0.5 * 20e9, rel=1e-3)
    for mclass in MEMORY_CLASSES:
        assert op_time_s(0.0, 1e9, "float32", c.gpu, "memory", mclass=mclass) == pytest.approx(1e9 / (0.5 * 12.5e9))
    assert c.gpu.hbm_Bps * c.gpu.memory_efficiency == pytest.approx(12.5e9) and c.gpu.optimizer_efficiency == 1.5
    assert "training step of ref (dp=4)" in c.gpu.source
    p = tmp_path / "c.toml"
    cal = replace(base, in_step=StepRates("ref", "dp=4", rows))
    p.write_text(calibration_toml(c, measured_dict(cal, 10.0, 12.0)))
    assert load_cluster(p) == c
    m = tomllib.loads(p.read_text())["measured"]["in_step"]
    assert m["factors"] == pytest.approx({"matmul": 0.8, "attention": 0.5, "memory": 0.5, "optimizer": 1.5})
    assert m["measured_ms"]["matmul"] == pytest.approx(50.0) and m["predicted_ms"]["memory"] == pytest.approx(7.0)

    wild = (("matmul", 0.010, 0.040),) + rows[1:]
    w = cluster_from_dict(cluster_dict(replace(base, in_step=StepRates("ref", "dp=4", wild)))).gpu
    assert w.matmul_efficiency == 1.0 and _rate(w, "float32") == pytest.approx(41.3e9)
    assert "not used" in w.source and "matmul" in w.source.split("not used")[1]
    failed = cluster_from_dict(cluster_dict(replace(base, in_step=StepRates("ref", "dp=4", note="rank 1 died")))).gpu
    plain = cluster_from_dict(cluster_dict(base)).gpu
    assert replace(failed, source="") == replace(plain, source="") and "rank 1 died" in failed.source


def test_gpu_file_keeps_datasheet_peaks_and_measures_efficiencies():
    h200 = get_gpu("h200")
    bf16 = 0.7 * h200.peak_flops_for("bf16")
    cal = _calibration("cuda", {"bfloat16": bf16, "float16": bf16, "float32": 60e12}, copy=4.2e12,
                       sdpa_rate=0.9 * h200.peak_flops_for("bf16"))
    c = cluster_from_dict(cluster_dict(cal))
    assert c.gpu.peak_flops_for("bf16") == h200.peak_flops_for("bf16") and c.gpu.matmul_efficiency == 0.7
    assert c.gpu.peak_flops_for("fp16") == h200.peak_flops_for("fp16")     # same rate as bf16: no override
    assert _rate(c.gpu, "fp32") == pytest.approx(60e12, rel=1e-3)          # fp32 without TF32: effective peak
    assert c.gpu.attention_efficiency == pytest.approx(0.9) and c.gpu.memory_efficiency == pytest.approx(4.2 / 4.8)
    assert c.intra.name == "nvlink4-nvswitch"                              # no collectives: the default link


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="at least 1"):
        check_nproc(0)
    with pytest.raises(ValueError, match="positive number of seconds"):
        measure(2, budget_s=0.0)
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["calibrate", "--out", str(tmp_path / "no" / "such" / "c.toml")])
    with pytest.raises(ValueError, match="no such directory"):
        cmd_calibrate(args, Console(quiet=True))
    with pytest.raises(SystemExit):
        ap.parse_args(["calibrate", "--nproc", "0"])


def test_real_run_writes_a_cluster_the_planner_uses(tmp_path):
    from autopar.models import build_model
    from autopar.solver import plan_model
    from autopar.trace import trace_model

    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers(dest="command"))
    out = tmp_path / "cluster.toml"
    # a 12 s budget: enough collective sizes for a link fit on a loaded 2-core machine (8 s was not)
    args = ap.parse_args(["calibrate", "--nproc", "2", "--budget-s", "12", "--out", str(out)])
    assert cmd_calibrate(args, Console(quiet=True)) == 0
    c = load_cluster(out)
    assert c == resolve_cluster(out) and c.gpus_per_node == 2 and c.gpu.name == "cpu"
    assert c.cores_per_node == os.cpu_count()
    m = tomllib.loads(out.read_text())["measured"]
    figures = [c.gpu.peak_flops_for(d) for d in ("float32", "bfloat16", "float16", "vector")] + [
        c.gpu.hbm_Bps, c.gpu.attention_efficiency, c.intra.busbw_Bps, c.intra.latency_s + 1e-12,
        m["copy_GBps"], m["op_overhead_us"], m["gemm"]["float32"]["TFLOPs"]]
    assert all(math.isfinite(x) and x > 0 for x in figures), figures
    # autopar's step cost per graph node, plain and DTensor: slopes (or, where noise left none, the
    # deep step per node), recorded and in the cluster; never 0
    per_node = m["step_us_per_node"]
    assert set(per_node) == {"plain", "dtensor"} and all(math.isfinite(x) and x > 0 for x in per_node.values())
    assert m["zero3_group_overhead_us"] >= 0 and c.gpu.zero3_group_overhead_s == pytest.approx(
        m["zero3_group_overhead_us"] * 1e-6, rel=1e-3, abs=1e-9)
    assert set(m["step_us_per_node_is_slope"]) == {"plain", "dtensor"}
    assert (c.gpu.op_overhead_s, c.gpu.dtensor_op_overhead_s) == pytest.approx(
        (per_node["plain"] * 1e-6, per_node["dtensor"] * 1e-6), rel=1e-3)
    assert c.intra.name == "measured-gloo" and set(m["collectives"]) == set(COLLECTIVE_KINDS)
    assert set(m["memory_class_GBps"]) == {"norm", "activation", "softmax", "elementwise"}
    assert all(v > 0 for v in m["memory_class_GBps"].values())
    # the reference training step: every class measured and priced; the efficiencies its factors give
    step = m["in_step"]
    assert set(step["measured_ms"]) == set(step["predicted_ms"]) == set(CLASSES)
    assert all(v > 0 for k in ("measured_ms", "predicted_ms") for v in step[k].values()), step
    bounds = step["factor_bounds"]                       # per class (FACTOR_BOUNDS): outside, recorded, not priced
    assert bounds == {c: list(b) for c, b in FACTOR_BOUNDS.items()}
    used = {k: f for k, f in step["factors"].items() if bounds[k][0] <= f <= bounds[k][1]}
    assert c.gpu.matmul_efficiency == pytest.approx(used.get("matmul", 1.0), rel=1e-3)
    assert c.gpu.optimizer_efficiency == pytest.approx(used.get("optimizer", 1.0), rel=1e-3)
    assert dict(c.gpu.memory_class_efficiency) == pytest.approx(
        {k: used["memory"] for k in MEMORY_CLASSES} if "memory" in used else {}, rel=1e-3)
    assert all(t > 0 for k in m["collectives"].values() for t in k["seconds"])

    b = build_model("gpt-tiny", device="meta")
    g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target, model_name="t")
    plan = plan_model(g, resolve_cluster(out), global_batch=8, seq_len=b.seq_len, dtype="float32")
    assert plan.summary()["estimated_step_time_s"] > 0
