"""NCCL bus factors, collective times, axis links, roofline op times against hand-worked numbers."""
import pytest

from autopar.cost.collectives import (all_gather_s, all_reduce_s, all_to_all_s, axis_link, bus_factor,
                                      collective_s, p2p_s, reduce_scatter_s, stage_link)
from autopar.cost.compute import backward_factor, memory_class, op_kind, op_time_s
from autopar.cost.hardware import LinkSpec, get_gpu, make_cluster

A100_NVSWITCH = LinkSpec("t", 230e9, 2e-6, "test: nccl_busbw_reference.csv 8x A100 all_reduce 230 GB/s")


def test_bus_factors_hand_values():
    assert bus_factor("all_reduce", 8) == 1.75
    assert bus_factor("all_gather", 8) == 0.875
    assert bus_factor("reduce_scatter", 4) == 0.75
    assert bus_factor("all_to_all", 2) == 0.5
    assert bus_factor("p2p", 2) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("allreduce", 8)


def test_all_reduce_1GB_on_8_a100():
    t = all_reduce_s(10**9, 8, A100_NVSWITCH)
    assert t == pytest.approx(1.75 * 1e9 / 230e9 + 2 * 7 * 2e-6)   # 7.609 ms + 28 us
    assert t == pytest.approx(7.637e-3, rel=1e-3)


def test_ag_rs_sum_to_all_reduce_and_dispatch():
    n, nb = 8, 3 * 2**27
    assert all_gather_s(nb, n, A100_NVSWITCH) + reduce_scatter_s(nb, n, A100_NVSWITCH) == pytest.approx(
        all_reduce_s(nb, n, A100_NVSWITCH))
    assert all_to_all_s(nb, n, A100_NVSWITCH) == pytest.approx(7 * 2e-6 + 7 / 8 * nb / 230e9)
    assert p2p_s(nb, A100_NVSWITCH) == pytest.approx(2e-6 + nb / 230e9)
    for kind, fn in (("all_reduce", all_reduce_s), ("all_gather", all_gather_s),
                     ("reduce_scatter", reduce_scatter_s), ("all_to_all", all_to_all_s)):
        assert collective_s(kind, nb, n, A100_NVSWITCH) == fn(nb, n, A100_NVSWITCH)
        assert collective_s(kind, nb, 1, A100_NVSWITCH) == 0.0
    assert collective_s("p2p", nb, 2, A100_NVSWITCH) == p2p_s(nb, A100_NVSWITCH)


def test_a_links_call_latency_is_paid_once_per_collective():
    """``LinkSpec.call_latency_s``: each collective's fixed time, once, beside its steps' latency
    (a ring all-reduce over 4 ranks: 1 call + 6 steps; over 2: 1 + 2); none on one rank or for
    nothing sent."""
    from dataclasses import replace

    from autopar.cost.collectives import broadcast_s

    link = replace(A100_NVSWITCH, call_latency_s=1e-3)
    nb = 2**20
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for n in (2, 4):
            assert collective_s(kind, nb, n, link) == pytest.approx(1e-3 + collective_s(kind, nb, n, A100_NVSWITCH))
        assert collective_s(kind, nb, 1, link) == 0.0
    assert all_reduce_s(4, 4, link) == pytest.approx(1e-3 + 6 * 2e-6 + 1.5 * 4 / 230e9)
    assert p2p_s(nb, link) == pytest.approx(1e-3 + p2p_s(nb, A100_NVSWITCH)) and p2p_s(0, link) == 0.0
    assert broadcast_s(nb, 4, link, True) == pytest.approx(1e-3 + broadcast_s(nb, 4, A100_NVSWITCH, True))
    assert broadcast_s(nb, 1, link, True) == 0.0


def test_axis_link_dp16_tp8_on_8gpu_nodes():
    c = make_cluster("h100", nodes=16)
    assert axis_link(c, (16, 8), 1) == c.intra      # tp: 8 adjacent ranks, one node
    assert axis_link(c, (16, 8), 0) == c.inter      # dp: stride 8, one rank per node
    assert axis_link(c, (8, 16), 1) == c.inter      # tp=16 spans two nodes
    assert axis_link(c, (2, 4), 0) == c.intra       # 2x4 fits in a node
    assert axis_link(c, (32, 4), 0) == c.inter
    assert axis_link(c, (3, 8), 0) == c.inter
    assert axis_link(c, (16, 1), 1) == c.intra      # size-1 axis: no communication
    # gpus_per_node not a multiple of the span -> crosses nodes somewhere
    c6 = make_cluster("a100-80g", nodes=4, gpus_per_node=6)
    assert axis_link(c6, (6, 4), 1) == c6.inter
    assert axis_link(c6, (12, 2), 1) == c6.intra
    with pytest.raises(ValueError, match="axis"):
        axis_link(c, (16, 8), 2)


def test_axis_link_nic_aggregation():
    c = make_cluster("a100-80g", nodes=4)
    # tp=16 contiguous: 8 members per node -> min(230, 8 * 24) = 192 GB/s (csv: DGX-A100 multi-node 192)
    assert axis_link(c, (2, 16), 1, nic_aggregation=True).busbw_Bps == pytest.approx(192e9)
    # dp with stride 2 (tp=2): 4 members per node -> 4 NICs
    assert axis_link(c, (16, 2), 0, nic_aggregation=True).busbw_Bps == pytest.approx(96e9)
    # dp with stride 8: one member per node -> plain inter
    assert axis_link(c, (4, 8), 0, nic_aggregation=True) == c.inter


def test_stage_link():
    c = make_cluster("h100", nodes=4)
    assert stage_link(c, 8) == c.inter
    assert stage_link(c, 4) == c.intra


def test_op_kind():
    assert op_kind("aten.linear.default") == "matmul"
    assert op_kind("aten.mm.default") == "matmul"
    assert op_kind("aten.baddbmm.default") == "matmul"
    assert op_kind("aten.einsum.default") == "matmul"
    assert op_kind("aten.scaled_dot_product_attention.default") == "attention"
    assert op_kind("aten._scaled_dot_product_flash_attention.default") == "attention"
    assert op_kind("aten._flash_attention_forward.default") == "attention"
    for v in ("aten.view.default", "aten.transpose.int", "aten.t.default", "aten.permute.default",
              "aten.expand.default", "aten.unsqueeze.default", "aten.detach.default", "aten.alias.default",
              "aten.slice.Tensor", "aten.split.Tensor", "getitem", "<built-in function getitem>",
              "operator.getitem", "aten.reshape.default", "aten._unsafe_view.default"):
        assert op_kind(v) == "free", v
    for m in ("aten.add.Tensor", "aten.layer_norm.default", "aten.gelu.default", "aten._softmax.default",
              "aten.embedding.default", "aten.clone.default", "aten.dropout.default"):
        assert op_kind(m) == "memory", m


def test_roofline_hand_cases():
    g = get_gpu("h100")
    # GEMM 8192 x 8192 x 8192 bf16: 2*8192^3 = 1.0995e12 FLOPs; bytes 3 * 8192^2 * 2 = 402,653,184
    flops, nbytes = 2 * 8192**3, 3 * 8192**2 * 2
    want = flops / (989.4e12 * g.matmul_efficiency)
    assert op_time_s(flops, nbytes, "bfloat16", g, "matmul") == pytest.approx(want)
    assert op_time_s(flops, nbytes, "torch.bfloat16", g, "matmul") == pytest.approx(want)
    # fp32 matmuls run at the TF32 peak (494.7 TFLOP/s): twice as long
    assert op_time_s(flops, nbytes, "float32", g, "matmul") == pytest.approx(2 * want)
    # Elementwise add of 1 GiB bf16 tensors: read 2, write 1 -> bytes bound at 3350 GB/s * eff
    n = 2**29
    t = op_time_s(n, 3 * 2 * n, "bfloat16", g, "memory")
    assert t == pytest.approx(3 * 2 * n / (3350e9 * g.memory_efficiency))
    assert op_time_s(10**12, 10**9, "bfloat16", g, "free") == 0.0
    # attention uses the attention efficiency
    assert op_time_s(1e12, 0, "bfloat16", g, "attention") == pytest.approx(1e12 / (989.4e12 * g.attention_efficiency))
    assert backward_factor("matmul") == 2.0 and backward_factor("attention") == 2.5
    assert backward_factor("memory") == 2.0 and backward_factor("free") == 0.0
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        op_time_s(1, 1, "float8_e4m3fn", get_gpu("a100-80g"), "matmul")


@pytest.mark.parametrize("target, mclass", [
    ("aten.layer_norm.default", "norm"), ("aten.native_layer_norm.default", "norm"), ("aten.rms_norm.default", "norm"),
    ("aten.gelu.default", "activation"), ("aten.silu.default", "activation"),
    ("aten._log_softmax.default", "softmax"), ("aten.cross_entropy_loss.default", "softmax"),
    ("aten.add.Tensor", "elementwise"), ("aten.native_dropout.default", "elementwise"),
])
def test_memory_classes(target, mclass):
    assert memory_class(target) == mclass


def test_layer_norm_on_the_h200_runs_at_its_measured_bandwidth():
    """calibration.json's H200 entry: layer_norm over h=4096 measured 0.58 of the 4.8 TB/s datasheet
    (``measured.elementwise.layer_norm_efficiency``), a copy 0.88: a layer norm moving 1 GB takes
    1e9 / (4.8e12 x 0.5797) s; a gelu (not measured apart) the copy's 1e9 / (4.8e12 x 0.8837)."""
    g = get_gpu("h200")
    assert op_time_s(0, 1e9, "bfloat16", g, "memory", mclass="norm") == pytest.approx(1e9 / (4.8e12 * 0.5797))
    assert op_time_s(0, 1e9, "bfloat16", g, "memory", mclass="activation") == pytest.approx(1e9 / (4.8e12 * 0.8837))
    assert get_gpu("h100").memory_eff_for("norm") == get_gpu("h100").memory_efficiency     # not measured there


def test_noncausal_attention_is_priced_at_its_measured_efficiency():
    """BERT/ViT attention: calibration.json's H200 entry holds the measured non-causal SDPA
    efficiency (benchmarks/calibrate.py, FULL FLOP count: ~0.60 against 0.98 for causal kernels,
    which skip half the counted work). A family without the figure prices a non-causal kernel at
    half the causal figure (the same true utilisation)."""
    import json

    from autopar.cost.compute import op_time_s
    from autopar.cost.hardware import DEFAULT_CALIBRATION_PATH, get_gpu

    measured = json.loads(open(DEFAULT_CALIBRATION_PATH).read())["families"]["h200"]["measured"]["sdpa"]
    h200, a100 = get_gpu("h200"), get_gpu("a100-80g")
    assert h200.attention_noncausal_efficiency == pytest.approx(measured["noncausal_fwdbwd_efficiency_H32"], rel=1e-3)
    assert get_gpu("h100").attention_noncausal_efficiency == h200.attention_noncausal_efficiency   # compute_from
    flops = 1e12
    peak = h200.peak_flops_for("bfloat16")
    assert op_time_s(flops, 0, "bfloat16", h200, "attention", causal=False) == pytest.approx(
        flops / (peak * h200.attention_noncausal_efficiency))
    assert op_time_s(flops, 0, "bfloat16", h200, "attention") == pytest.approx(flops / (peak * h200.attention_efficiency))
    assert a100.attention_noncausal_efficiency is None
    assert a100.attention_eff(False) == a100.attention_efficiency / 2


def test_sdpa_nodes_know_whether_they_are_causal():
    from autopar.models import build_model
    from autopar.solver.problem import causal_attention
    from autopar.trace import trace_model

    for spec, causal in (("gpt-tiny", True), ("bert-large", False)):
        b = build_model(spec, device="meta", batch=1, seq_len=16)
        g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
        sdpa = [n for n in g.nodes if "scaled_dot_product" in n.target]
        assert sdpa and all(causal_attention(n) == causal for n in sdpa), spec
