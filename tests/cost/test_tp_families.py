"""Tensor-parallel families (1d, 2d, 2.5d, 3d) and context parallelism (ring, Ulysses) against
numbers worked by hand from the papers' equations (shared/reference/parallelism_facts.md §1.3, §2)."""
import pytest

from autopar.cost.context_parallel import (RingTraffic, attention_flops_per_rank, best_cp_kind, ring_time, ring_traffic,
                                           ulysses_time_s, ulysses_traffic)
from autopar.cost.hardware import LinkSpec, make_cluster
from autopar.cost.tensor_parallel import (TPFamily, family_links, layer_comm, layer_comm_time, layer_memory,
                                          parse_tp_mode, tp_shapes)

H, S, A = 1024, 2048, 16          # hidden, sequence, heads; fp16 (2 bytes) throughout
LAYER = dict(hidden=H, seq=S, heads=A)
FAST = LinkSpec("fast", 1e12, 0.0, "test")
SLOW = LinkSpec("slow", 1e9, 0.0, "test")


def _bytes(comm, prefix):
    return sum(c.traffic_bytes for c in comm.collectives if c.what.startswith(prefix))


def test_tp_shapes_and_parse():
    assert [str(f) for f in tp_shapes(8)] == ["1d t=8", "2.5d 2x2x2", "3d 2x2x2"]
    assert [str(f) for f in tp_shapes(64)] == ["1d t=64", "2d 8x8", "2.5d 2x2x16", "2.5d 4x4x4", "3d 4x4x4"]
    assert [str(f) for f in tp_shapes(12)] == ["1d t=12", "2.5d 2x2x3"]     # 12 = 2*2*3
    assert [str(f) for f in tp_shapes(6)] == ["1d t=6"]
    assert {str(f) for f in tp_shapes(4096)} >= {"2d 64x64", "3d 16x16x16", "2.5d 8x8x64"}
    assert all(f.ranks == 512 for f in tp_shapes(512))
    assert parse_tp_mode(" 2.5D ") == parse_tp_mode("2p5d") == "2.5d"
    with pytest.raises(ValueError, match="unknown tensor-parallel mode '4d'; choose one of 1d, 2d, 2.5d, 3d"):
        parse_tp_mode("4d")
    with pytest.raises(ValueError, match="only 2.5d has a depth"):
        TPFamily("2d", 4, d=2)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        tp_shapes(0)


def test_1d_megatron_8bsh():
    # Megatron: 8 b s h (t-1)/t elements per layer; b=1, t=2: 8 * 2,097,152 * 1/2 * 2 B = 16,777,216
    comm = layer_comm(TPFamily("1d", 2), batch=1, **LAYER)
    assert comm.bytes() == 16_777_216
    assert comm.bytes("fwd") == 8_388_608
    assert [(c.kind, c.count, c.nbytes) for c in comm.collectives] == [("all_reduce", 2, 4_194_304)] * 2
    sp = layer_comm(TPFamily("1d", 2), batch=1, sequence_parallel=True, **LAYER)
    assert sp.bytes() == 16_777_216                      # AG + RS = AR
    assert sorted(c.kind for c in sp.collectives) == ["all_gather"] * 2 + ["reduce_scatter"] * 2
    assert "heads=96 not divisible by 64" in layer_comm(TPFamily("1d", 64), hidden=12288, seq=2048, batch=1,
                                                        heads=96).notes[0]


def test_2d_summa_hand_worked():
    # q=2, b=2 (N = 4096 tokens, batch covers the 2-way token split: no seq-split attention)
    # per linear 3 (q-1) (N k + k n) / q^2 elements x 2 B:
    #   qkv  k=1024 n=3072: (4,194,304 + 3,145,728) * 3/4 * 2 = 11,010,048
    #   proj k=1024 n=1024: (4,194,304 + 1,048,576) * 1.5    =  7,864,320
    #   fc1  k=1024 n=4096: (4,194,304 + 4,194,304) * 1.5    = 12,582,912
    #   fc2  k=4096 n=1024: (16,777,216 + 4,194,304) * 1.5   = 31,457,280
    # layernorm: 8 all-reduces of N/q = 2048 stats x 2 B, bus factor 1: 32,768
    comm = layer_comm(TPFamily("2d", 2), batch=2, **LAYER)
    assert _bytes(comm, "qkv") == 11_010_048
    assert _bytes(comm, "fc2") == 31_457_280
    assert comm.bytes() == 11_010_048 + 7_864_320 + 12_582_912 + 31_457_280 + 32_768
    assert comm.notes == ()
    # forward is 1/3 of the SUMMA traffic (one GEMM of three)
    assert sum(c.traffic_bytes for c in comm.collectives if c.phase == "fwd" and c.what.startswith("qkv")) \
        == 11_010_048 / 3


def test_2p5d_tesseract_hand_worked():
    # q=2, d=2, b=4 (N = 8192; token split d q = 4 = b). qkv, k=1024, n=3072:
    #   X: 3 (q-1) N k / (d q^2) = 3 * 8,388,608 / 8   = 3,145,728
    #   W: 3 (q-1) k n / q^2     = 3 * 3,145,728 / 4   = 2,359,296
    #   depth all-reduce of dW: 2 (d-1)/d k n / q^2    =   786,432
    #   (6,291,456 elements) x 2 B = 12,582,912
    comm = layer_comm(TPFamily("2.5d", 2, 2), batch=4, **LAYER)
    assert _bytes(comm, "qkv") == 12_582_912
    dep = [c for c in comm.collectives if c.axes == ("dep",)]
    assert len(dep) == 4 and all(c.per_step and c.kind == "all_reduce" for c in dep)


def test_3d_hand_worked():
    # q=2, b=4 (N = 8192; token split q^2 = 4). qkv: 2 (q-1)/q^3 (N k + k n + N n)
    #   = 2/8 * (8,388,608 + 3,145,728 + 25,165,824) = 9,175,040 elements x 2 B = 18,350,080
    comm = layer_comm(TPFamily("3d", 2), batch=4, **LAYER)
    assert _bytes(comm, "qkv") == 18_350_080
    gathers = {c.what.split(":")[0]: c.axes for c in comm.collectives if c.what.endswith("gather X")}
    assert gathers == {"qkv": ("x",), "proj": ("z",), "fc1": ("x",), "fc2": ("z",)}   # swap_in_out_group


def test_seq_split_attention_when_batch_is_one():
    # 2d q=2, b=1: K|V per device [N/q, h/q] each -> gathered over 2 ranks: 2 * 2048 * 512 * 2 B = 4,194,304
    # bytes output, half of it received; same for dK|dV backward
    comm = layer_comm(TPFamily("2d", 2), batch=1, **LAYER)
    extra = [c for c in comm.collectives if c.what.startswith("seq-split")]
    assert [(c.kind, c.nbytes, c.traffic_bytes) for c in extra] == [("all_gather", 4_194_304, 2_097_152),
                                                                    ("reduce_scatter", 4_194_304, 2_097_152)]
    assert "sequence" in comm.notes[0]


def test_layer_memory_korthikanti():
    # 1d t=2: s b h (10 + 24/t + 5 a s/(h t)); sbh = 2,097,152; 5*16*2048/(1024*2) = 80 -> 102 sbh
    m = layer_memory(TPFamily("1d", 2), batch=1, **LAYER)
    assert m.activation_bytes == 102 * 2_097_152 == 213_909_504
    assert m.param_bytes == 12 * H * H * 2 / 2 == 12_582_912
    # with SP: 34/t + 80 = 97 sbh
    assert layer_memory(TPFamily("1d", 2), batch=1, sequence_parallel=True, **LAYER).activation_bytes == 203_423_744
    # 3d q=2: linear inputs 14 sbh / q^2 = 7,340,032; the rest (20 sbh + 5 a s^2 b) / q^3
    #   = (41,943,040 + 335,544,320) / 8 = 47,185,920; weights 12h^2*2/8, gathered 12h^2*2/4
    m3 = layer_memory(TPFamily("3d", 2), batch=1, **LAYER)
    assert (m3.param_bytes, m3.gathered_weight_bytes, m3.activation_bytes) == (3_145_728, 6_291_456, 54_525_952)
    assert layer_memory(TPFamily("2d", 2), batch=1, **LAYER).activation_bytes == (34 * 2_097_152 + 335_544_320) / 4


def test_layer_comm_time_links():
    h100 = make_cluster("h100", nodes=2)
    # 1d t=8 in one node (370 GB/s, 2 us/hop; NCCL's all-reduce on trees: 2 ceil(log2 8) = 6 steps):
    #   one AR of 4,194,304 B = 6*2us + 1.75*4,194,304/370e9 = 12 us + 19.8379 us = 31.8379 us; 2 per phase
    t8 = layer_comm_time(layer_comm(TPFamily("1d", 8), batch=1, **LAYER), h100)
    assert t8.forward_s == pytest.approx(2 * 31.8379e-6, rel=1e-5)
    assert t8.total_s == pytest.approx(4 * 31.8379e-6, rel=1e-5)
    # 1d t=16 on 2 nodes -> NIC (48 GB/s, 8 us): 2*4*8us + 1.875*4,194,304/48e9 = 64 + 163.84 us
    t16 = layer_comm_time(layer_comm(TPFamily("1d", 16), batch=1, **LAYER), h100)
    assert t16.forward_s == pytest.approx(2 * 227.84e-6)
    # inner axes fill a node first
    assert family_links(TPFamily("2d", 8), make_cluster("h100", 8)) == {"col": h100.inter, "row": h100.intra}
    links3 = family_links(TPFamily("3d", 4), make_cluster("h100", 8))
    assert (links3["x"], links3["y"], links3["z"]) == (h100.intra, h100.inter, h100.inter)
    # a function axis -> link; broadcast = (n-1) latencies + nbytes / busbw, q of them per GEMM
    comm = layer_comm(TPFamily("2d", 2), batch=2, **LAYER)
    t = layer_comm_time(comm, lambda axis: SLOW)
    assert t.total_s == pytest.approx(comm.bytes() * 2 / 1e9 - 32_768 / 1e9)   # q/(q-1) = 2 on SUMMA bytes
    # the 2.5d depth all-reduce is paid once per step under gradient accumulation
    c25 = layer_comm(TPFamily("2.5d", 2, 2), batch=4, **LAYER)
    dep = sum(c.time_s(SLOW) for c in c25.collectives if c.per_step)
    one, four = (layer_comm_time(c25, lambda a: SLOW, micro_batches=m).backward_s for m in (1, 4))
    assert one - four == pytest.approx(dep * 3 / 4)


def test_ring_and_ulysses_bytes():
    # cp=4, s=8192, b=1, a=32, a_kv=8, d=128, 2 B
    # ring block 2 * 8 * 2048 * 128 * 2 = 8,388,608; fwd 3 blocks, bwd 3 + 4 blocks
    r = ring_traffic(4, 8192, 1, 8, 128)
    assert (r.block_bytes, r.forward_bytes, r.backward_bytes) == (8_388_608, 25_165_824, 58_720_256)
    # Ulysses: one head 2048 * 128 * 2 = 524,288 B; q, o 32 heads = 16,777,216; k, v 8 heads = 4,194,304
    # sent per direction (n-1)/n * 41,943,040 = 31,457,280 -> more than ring's 25,165,824 (GQA)
    u = ulysses_traffic(4, 8192, 1, 32, 8, 128)
    assert u.all_to_all_bytes == (16_777_216, 4_194_304, 4_194_304, 16_777_216)
    assert u.forward_bytes == u.backward_bytes == 31_457_280
    # MHA (a_kv = 32): ring 4x bigger (100,663,296 forward), Ulysses 3/4 * 4 * 16,777,216 = 50,331,648
    assert ring_traffic(4, 8192, 1, 32, 128).forward_bytes == 100_663_296
    assert ulysses_traffic(4, 8192, 1, 32, 32, 128).forward_bytes == 50_331_648
    # GQA with a_kv < cp: K|V repeated to lcm(8, 16) = 16 heads
    assert ulysses_traffic(16, 8192, 1, 32, 8, 128).kv_heads_sent == 16
    with pytest.raises(ValueError, match="heads=24, cp=16"):
        ulysses_traffic(16, 8192, 1, 24, 8, 128)
    # Ulysses time: 4 all-to-alls each way, (n-1)/n of each buffer over busbw (latency 0 on SLOW)
    assert ulysses_time_s(u, 4, SLOW) == pytest.approx((31_457_280 / 1e9,) * 2)


def test_ring_exposed_fast_and_slow_link():
    r = ring_traffic(4, 8192, 1, 8, 128)              # block 8,388,608 B
    # fast link: one block 8.388608 us < block compute (1 ms fwd, 2.5 ms bwd): only the final dK|dV
    # send home is exposed
    fast = ring_time(r, 4, FAST, 1e-3, 2.5e-3)
    assert (fast.forward_exposed_s, fast.backward_exposed_s) == (0.0, pytest.approx(8.388608e-6))
    # slow link: one block 8.388608 ms, two blocks 16.777216 ms
    #   fwd 3 * (8.388608 - 1) = 22.165824 ms
    #   bwd (8.388608 - 2.5) + 2 * (16.777216 - 2.5) + (8.388608 - 2.5) + 8.388608 = 48.720256 ms
    slow = ring_time(r, 4, SLOW, 1e-3, 2.5e-3)
    assert slow.forward_exposed_s == pytest.approx(22.165824e-3)
    assert slow.backward_exposed_s == pytest.approx(48.720256e-3)
    assert slow.forward_comm_s + slow.backward_comm_s == pytest.approx(r.total_bytes / 1e9)
    assert ring_time(ring_traffic(1, 8192, 1, 8, 128), 1, SLOW, 0, 0).exposed_s == 0.0
    # fp32 dK|dV accumulators (autopar's engine) on bf16 K|V: the gradient block is twice the size,
    # 16.777216 ms on the slow link; K|V + dK|dV 25.165824 ms
    #   bwd (8.388608 - 2.5) + 2 * (25.165824 - 2.5) + (16.777216 - 2.5) + 16.777216 = 82.274688 ms
    r32 = RingTraffic(r.block_bytes, r.forward_bytes, 3 * r.block_bytes + 4 * 2 * r.block_bytes, 2 * r.block_bytes)
    slow32 = ring_time(r32, 4, SLOW, 1e-3, 2.5e-3)
    assert slow32.forward_exposed_s == pytest.approx(22.165824e-3)
    assert slow32.backward_exposed_s == pytest.approx(82.274688e-3)
    assert slow32.forward_comm_s + slow32.backward_comm_s == pytest.approx(r32.total_bytes / 1e9)
    # with the compute's slowdown beside a collective (overlap_slowdown 0.5): each step adds 0.5 x
    # what it hides. Fast link: every overlapped transfer hidden, forward 3 blocks, backward
    # 1 + 2 x 2 + 1 = 6 blocks (8.388608 us each), and the final send home as before
    half = ring_time(r, 4, FAST, 1e-3, 2.5e-3, slowdown=0.5)
    assert half.forward_exposed_s == pytest.approx(0.5 * 3 * 8.388608e-6)
    assert half.backward_exposed_s == pytest.approx(0.5 * 6 * 8.388608e-6 + 8.388608e-6)
    #   slow link: fwd 22.165824 + 0.5 x 3 x 1 ms; bwd 48.720256 + 0.5 x 4 x 2.5 ms
    slow_half = ring_time(r, 4, SLOW, 1e-3, 2.5e-3, slowdown=0.5)
    assert slow_half.forward_exposed_s == pytest.approx(22.165824e-3 + 1.5e-3)
    assert slow_half.backward_exposed_s == pytest.approx(48.720256e-3 + 5e-3)


def test_attention_flops_and_best_kind():
    # 4 b a s^2 d / cp = 4 * 32 * 8192^2 * 128 / 4 = 274,877,906,944; causal half; backward 2.5x
    assert attention_flops_per_rank(4, 8192, 1, 32, 128, causal=False) == 274_877_906_944
    assert attention_flops_per_rank(4, 8192, 1, 32, 128) == 137_438_953_472
    assert attention_flops_per_rank(4, 8192, 1, 32, 128, backward=True) == 343_597_383_680
    node = make_cluster("h100", 1)
    ch = best_cp_kind(node, 8, 131072, 1, 32, 8, 128)
    assert ch.kind == "ring" and ch.ulysses_s > ch.ring_s > 0
    bad = best_cp_kind(make_cluster("h100", 2), 16, 8192, 1, 24, 8, 128)
    assert (bad.kind, bad.ulysses_s) == ("ring", None) and "heads=24, cp=16" in bad.note
    # MHA over 4 nodes at 8K: ring K|V (4x the GQA size) barely hides; Ulysses moves less
    mha = best_cp_kind(make_cluster("h100", 4), 32, 8192, 1, 32, 32, 128)
    assert mha.kind == "ulysses" and mha.ulysses_s < mha.ring_s
