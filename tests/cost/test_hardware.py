"""GPU specs, calibration file, built-in clusters, cluster TOML round trip and errors."""
import json
from dataclasses import replace

import pytest

from autopar.cost.cluster_file import cluster_to_toml, load_cluster
from autopar.cost.hardware import (CLUSTER_NAMES, GPU_NAMES, cluster_overrides, get_gpu, load_calibration,
                                   make_cluster, resolve_cluster)
from readme_examples import README_POD


def test_gpu_datasheet_figures():
    h100 = get_gpu("h100")
    assert h100.peak_flops_for("bfloat16") == 989.4e12      # gpu_specs.csv H100 dense bf16
    assert h100.peak_flops_for("float32") == 494.7e12       # TF32 tensor dense
    assert h100.peak_flops_for("fp8") == 1979e12
    assert h100.hbm_Bps == 3350e9
    assert h100.hbm_bytes == 81559 * 2**20
    h200 = get_gpu("H200")
    assert h200.hbm_bytes == 143771 * 2**20 and h200.hbm_Bps == 4800e9
    assert get_gpu("a100-40g").peak_flops_for("bf16") == 312e12
    assert get_gpu("a100-80g").hbm_Bps == 2039e9
    assert get_gpu("v100").peak_flops_for("float16") == 125e12
    for name in GPU_NAMES + ("cpu",):
        g = get_gpu(name)
        assert 0 < g.matmul_efficiency <= 1 and 0 < g.attention_efficiency <= 1 and 0 < g.memory_efficiency <= 1
        assert g.source
    with pytest.raises(ValueError, match="a100-40g"):
        get_gpu("b200")


def test_h100_takes_compute_efficiency_from_h200():
    h100, h200 = get_gpu("h100"), get_gpu("h200")
    assert (h100.matmul_efficiency, h100.attention_efficiency) == (h200.matmul_efficiency, h200.attention_efficiency)
    assert "h200" in h100.source


def test_calibration_file_is_single_source(tmp_path):
    cal = json.loads((__import__("autopar.cost.hardware", fromlist=["x"]).DEFAULT_CALIBRATION_PATH).read_text())
    cal["families"]["h200"]["matmul_efficiency"] = 0.5
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(cal))
    assert get_gpu("h100", calibration=p).matmul_efficiency == 0.5
    assert set(load_calibration(p)) == {"a100", "h100", "h200", "v100", "cpu"}
    cal["families"]["a100"]["matmul_eff"] = 0.5
    p.write_text(json.dumps(cal))
    with pytest.raises(ValueError, match="matmul_eff"):
        load_calibration(p)
    del cal["families"]["a100"]["matmul_eff"]
    for bad, message in (({"gelu": 0.5}, "unknown class 'gelu'"), ({"norm": 1.5}, r"outside \(0, 1\]")):
        cal["families"]["a100"]["memory_class_efficiency"] = bad
        p.write_text(json.dumps(cal))
        with pytest.raises(ValueError, match=message):
            load_calibration(p)


def test_make_cluster_defaults():
    c = make_cluster("h100", nodes=4)
    assert c.num_gpus == 32
    assert c.intra.busbw_Bps == 370e9 and c.inter.busbw_Bps == 48e9
    a = make_cluster("a100-40g", nodes=2, gpus_per_node=4)
    assert a.num_gpus == 8 and a.intra.busbw_Bps == 230e9 and a.inter.busbw_Bps == 24e9
    assert make_cluster("v100", 1).inter.busbw_Bps == 12.2e9
    with pytest.raises(ValueError, match="nodes"):
        make_cluster("h100", nodes=0)


def test_resolve_builtin_names():
    for name in CLUSTER_NAMES:
        c = resolve_cluster(name, nodes=2)
        assert c.nodes == 2 and c.gpus_per_node == 8
    assert resolve_cluster("dgx-h200").gpu.name == "h200"
    assert resolve_cluster("h100", nodes=3, gpus_per_node=4).num_gpus == 12
    assert resolve_cluster("dgx-a100", gpu="a100-40g").gpu.name == "a100-40g"
    with pytest.raises(ValueError, match="dgx-h100"):
        resolve_cluster("no-such-cluster")


@pytest.mark.parametrize("gpu", GPU_NAMES + ("cpu",))
def test_toml_round_trip(tmp_path, gpu):
    c = make_cluster(gpu, nodes=3, gpus_per_node=4, name=f"rt-{gpu}")
    p = tmp_path / "c.toml"
    p.write_text(cluster_to_toml(c))
    assert load_cluster(p) == c


def test_toml_round_trip_with_overrides(tmp_path):
    c = make_cluster("h100", nodes=2)
    c = replace(c, gpu=replace(c.gpu, hbm_bytes=80 * 10**9, matmul_efficiency=0.61, source="ours"),
                intra=replace(c.intra, busbw_Bps=333.5e9, latency_s=3e-6, source="our nccl-tests"),
                pcie_Bps=40e9)
    p = tmp_path / "pod.toml"
    p.write_text(cluster_to_toml(c))
    assert load_cluster(p) == c
    assert resolve_cluster(p, nodes=5).nodes == 5


def test_link_busbw_scale_round_trip_and_prices(tmp_path):
    """A link measured per collective kind (gloo's, ``autopar calibrate``): each kind runs at its
    own busbw. By hand on 4 ranks, 1 GB/s, 1 ms latency: an all-gather of 8 MB at 0.5x the busbw
    takes 3 ms + 3/4 x 8 MB / 0.5 GB/s = 15 ms; an all-reduce (unlisted) 6 ms + 3/2 x 8 MB / 1 GB/s
    = 18 ms; a p2p at 4x 1 ms + 8 MB / 4 GB/s = 3 ms."""
    from autopar.cost.collectives import collective_s

    c = make_cluster("cpu", nodes=1, gpus_per_node=4)
    link = replace(c.intra, busbw_Bps=1e9, latency_s=1e-3, busbw_scale=(("all_gather", 0.5), ("p2p", 4.0)))
    assert collective_s("all_gather", 8e6, 4, link) == pytest.approx(0.015)
    assert collective_s("all_reduce", 8e6, 4, link) == pytest.approx(0.018)
    assert collective_s("p2p", 8e6, 4, link) == pytest.approx(0.003)
    c = replace(c, intra=link)
    p = tmp_path / "gloo.toml"
    p.write_text(cluster_to_toml(c))
    assert "busbw_scale = { all_gather = 0.5, p2p = 4.0 }" in p.read_text()
    assert load_cluster(p) == c
    for bad, match in (("{ all_gather = 0 }", "must be a number > 0"), ("{ allgather = 0.5 }", "allgather.*all_gather"),
                       ("0.5", "must be a table")):
        p.write_text(f'gpu = "cpu"\nnodes = 1\n[intra]\nbusbw_GBps = 1\nbusbw_scale = {bad}\n')
        with pytest.raises(ValueError, match=match):
            load_cluster(p)


def test_toml_user_file_and_errors(tmp_path):
    p = tmp_path / "mypod.toml"
    p.write_text('gpu = "h100"\nnodes = 2\n[inter]\nbusbw_GBps = 25\n[gpu_overrides]\nmemory_GB = 80\n')
    c = load_cluster(p)
    assert c.name == "mypod" and c.num_gpus == 16
    assert c.inter.busbw_Bps == 25e9 and c.inter.latency_s == make_cluster("h100", 1).inter.latency_s
    assert c.inter.all_reduce_tree and c.intra.all_reduce_tree          # a GPU's links: NCCL's trees
    p.write_text('gpu = "cpu"\nnodes = 1\ngpus_per_node = 4\n[intra]\nbusbw_GBps = 1\n')
    assert not load_cluster(p).intra.all_reduce_tree                    # CPU ranks' gloo: rings
    assert c.gpu.hbm_bytes == 80 * 10**9 and "memory_GB" in c.gpu.source
    p.write_text('gpu = "h100"\nnodes = 2\ngpu_per_node = 8\n')
    with pytest.raises(ValueError, match=r"gpu_per_node.*gpus_per_node"):
        load_cluster(p)
    p.write_text('gpu = "h100"\nnodes = 2\n[intra]\nbandwidth = 3\n')
    with pytest.raises(ValueError, match=r"bandwidth.*busbw_GBps"):
        load_cluster(p)
    p.write_text('gpu = "h100"\nnodes = 2\n[gpu_overrides]\nhbm_GB = 3\n')
    with pytest.raises(ValueError, match=r"hbm_GB.*memory_GB"):
        load_cluster(p)
    p.write_text('nodes = 2\n')
    with pytest.raises(ValueError, match="gpu"):
        load_cluster(p)


def test_calibration_entries_are_labelled():
    raw = json.loads((__import__("autopar.cost.hardware", fromlist=["x"]).DEFAULT_CALIBRATION_PATH).read_text())
    for fam, e in raw["families"].items():
        if e.get("measured"):
            assert e["source"].startswith("measured by benchmarks/calibrate.py"), fam
            assert not e["measured"]["errors"], (fam, e["measured"]["errors"])
        else:
            assert "uncalibrated default" in e["source"] or e["source"].startswith("rough"), fam


def test_megatron_h100_mfu_below_calibrated_matmul_efficiency():
    # Megatron-Core's H100 runs reach 41-49% MFU (megatron_readme_h100_weak_scaling.csv); a whole
    # training step cannot beat the GEMM efficiency the calibration measured.
    assert get_gpu("h100").matmul_efficiency > 0.49




def test_resolve_toml_keeps_the_file_unless_a_value_is_given(tmp_path):
    p = tmp_path / "my-h100-pod.toml"
    p.write_text(README_POD)
    c = resolve_cluster(p)
    assert (c.name, c.gpu.name, c.nodes, c.gpus_per_node, c.gpu.hbm_bytes) == ("my-h100-pod", "h100", 4, 8, 80 * 10**9)
    assert cluster_overrides(p) is None
    swapped = resolve_cluster(p, gpu="a100-40g", nodes=2)
    assert (swapped.gpu.name, swapped.nodes, swapped.gpus_per_node) == ("a100-40g", 2, 8)
    assert swapped.gpu.hbm_bytes == 80 * 10**9                   # [gpu_overrides] applied to the new GPU
    assert swapped.gpu.peak_flops_for("bf16") == 312e12
    for link in ("intra", "inter"):                             # the file's link figures are kept
        new, old = getattr(swapped, link), getattr(c, link)
        assert (new.busbw_Bps, new.latency_s) == (old.busbw_Bps, old.latency_s)
    line = cluster_overrides(p, gpu="a100-40g", nodes=2)
    assert line == ("cluster my-h100-pod with --gpu a100-40g overriding h100, --nodes 2 overriding 4 "
                    "(the file's [gpu_overrides] memory_GB applied to a100-40g)")
    assert cluster_overrides(p, gpu="h100", nodes=4, gpus_per_node=8) is None   # same as the file: no override


def test_resolve_toml_without_links_takes_the_swapped_gpus_links(tmp_path):
    p = tmp_path / "bare.toml"
    p.write_text('gpu = "h100"\nnodes = 2\n')
    assert resolve_cluster(p, gpu="v100").inter == make_cluster("v100", 1).inter


def test_resolve_builtin_uses_its_own_gpu_and_size_unless_given():
    assert resolve_cluster("cpu").gpu.name == "cpu"
    c = resolve_cluster("dgx-h100", nodes=2)
    assert (c.gpu.name, c.nodes, c.gpus_per_node) == ("h100", 2, 8)
    assert cluster_overrides("dgx-h100", nodes=2) is None        # a built-in has no node count to override
    assert cluster_overrides("dgx-h100", gpu="a100-80g") == "cluster dgx-h100 with --gpu a100-80g overriding h100"
    assert cluster_overrides("cpu", gpus_per_node=4) == "cluster cpu with --gpus-per-node 4 overriding 8"


@pytest.mark.parametrize("size", [dict(nodes=0), dict(gpus_per_node=0), dict(nodes=-1)])
@pytest.mark.parametrize("where", ["dgx-h100", "toml"])
def test_resolve_rejects_non_positive_sizes(tmp_path, size, where):
    if where == "toml":
        where = tmp_path / "pod.toml"
        where.write_text(README_POD)
    (what, value), = size.items()
    with pytest.raises(ValueError, match=rf"{what}={value}: .*positive"):
        resolve_cluster(where, **size)


def test_resolve_directory_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        resolve_cluster(tmp_path)


def test_fastest_dtype_skips_dtypes_without_tensor_cores():
    assert {name: get_gpu(name).fastest_dtype() for name in GPU_NAMES + ("cpu",)} == {
        "a100-40g": "bfloat16", "a100-80g": "bfloat16", "h100": "bfloat16", "h200": "bfloat16",
        "v100": "float16", "cpu": "bfloat16"}
    v100 = get_gpu("v100")
    assert v100.emulated == ("bfloat16",)
    warning = v100.dtype_warning("bf16")
    assert "no bfloat16 tensor cores" in warning and "--dtype fp16" in warning and "\n" not in warning
    assert v100.dtype_warning("fp16") is None and v100.dtype_warning("fp32") is None
    assert get_gpu("h100").dtype_warning("bf16") is None


def test_toml_peak_overrides_and_measured_table(tmp_path):
    # `autopar calibrate` writes measured per-dtype peaks and a [measured] table the loader ignores
    p = tmp_path / "cal.toml"
    p.write_text('gpu = "cpu"\nnodes = 1\ngpus_per_node = 4\n[gpu_overrides]\n'
                 'peak_TFLOPs = { fp32 = 0.0234, bfloat16 = 0.0363, vector = 0.003 }\nmatmul_efficiency = 1.0\n'
                 '[measured]\ndevice = "cpu"\n[measured.gemm.float32]\nTFLOPs = 0.0234\n')
    c = load_cluster(p)
    assert c.gpu.peak_flops_for("float32") == 0.0234e12 and c.gpu.peak_flops_for("bf16") == 0.0363e12
    assert c.gpu.peak_flops_for("fp16") == get_gpu("cpu").peak_flops_for("fp16")      # not listed: kept
    assert c.gpu.peak_flops_for("vector") == 0.003e12 and c.gpu.fastest_dtype() == "float16"
    p.write_text(cluster_to_toml(c))
    assert "peak_TFLOPs = { " in p.read_text() and load_cluster(p) == c
    for bad, words in (("{ fp64 = 1.0 }", r"unknown dtype 'fp64'"), ("{ fp32 = -1.0 }", "positive finite"),
                       ("3.0", "must be a table")):
        p.write_text(f'gpu = "cpu"\nnodes = 1\n[gpu_overrides]\npeak_TFLOPs = {bad}\n')
        with pytest.raises(ValueError, match=words):
            load_cluster(p)
    p.write_text('gpu = "cpu"\nnodes = 1\nmeasured = 3\n')
    with pytest.raises(ValueError, match="'measured' must be a table"):
        load_cluster(p)
