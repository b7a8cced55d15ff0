"""Pipelines on CPU ranks that outnumber their node's cores (``timing.py``'s "Shared cores"): a rank
computes up to ranks / cores times faster while others idle, so the pipeline part of the step is
the larger of the ranks' work spread over all of them and the schedule at that speed."""
from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.cost import make_cluster
from autopar.cost.cluster_file import cluster_from_dict, cluster_to_toml, load_cluster
from autopar.cost.hardware import LinkSpec
from autopar.solver.problem import AxisSummary, PartCost
from autopar.solver.runtime_profile import AUTOPAR_RUNTIME
from autopar.solver.timing import OuterConfig, evaluate, step_time_lower_bound


def _summary(layers: int) -> AxisSummary:
    """``layers`` layers of 1 s forward, 2 s backward; no pre/post; 1 MB between layers."""
    zero = PartCost(0.0, 0.0, {}, {}, 0.0, 0.0, 0.0, 0.0, 0.0)
    blk = PartCost(1.0, 2.0, {}, {}, 0.0, 0.0, 0.0, 0.0, 1e6, 1.0, 2.0)
    return AxisSummary(1, False, 1, {"pre": zero, "block": blk, "post": zero}, 0.0, 1e6, layers, 0.0)


def _cluster(cores: int, nodes: int = 1):
    """``nodes`` x 8 ranks sharing ``cores`` cores a node, a 1 GB/s link without latency."""
    c = make_cluster("h100", nodes)
    link = LinkSpec("test", busbw_Bps=1e9, latency_s=0.0, source="test")
    return replace(c, intra=link, inter=link, cores_per_node=cores)


def _pipeline_s(ev) -> float:
    st = ev.step
    return st.total_s - sum(v for k, v in st.comm_s if k.startswith("dp:")) - st.optimizer_s - st.host_s


CFG = OuterConfig(tp=1, pp=2, dp=4, mbs=1, m=2, recompute="none", zero=0, sp=False)


@pytest.mark.parametrize("layers, g", [(2, 2 / 3), (3, 0.5)])
def test_a_pipeline_on_shared_cores_by_hand(layers, g):
    """8 ranks on 4 cores (S = 2), pp=2, two micro-batches of 1F1B: (m + 1) t_max alone.
    Balanced (2 layers: t = 3 s + 2 ms p2p on each rank): max(2 t, 3 t / 2) = 2 t, 2/3 of 3 t.
    Unbalanced (3 layers cut 2 + 1: t_max = 6 s + p2p, t_min = 3 s + p2p): max(t_max + t_min,
    3 t_max / 2) over 3 t_max, 1/2 up to the p2p. Compute, comm and bubble scale alike."""
    s = _summary(layers)
    own = evaluate(s, CFG, _cluster(0), AUTOPAR_RUNTIME, 1e15, all_stages=True)
    shared = evaluate(s, CFG, _cluster(4), AUTOPAR_RUNTIME, 1e15, all_stages=True)
    times = sorted(st.time_per_microbatch_s for st in own.stages)
    expect = max(2 * sum(times) / 2, 3 * times[-1] / 2) / (3 * times[-1])
    assert expect == pytest.approx(g, rel=1e-3)
    assert _pipeline_s(shared) == pytest.approx(expect * _pipeline_s(own))
    for field in ("compute_s", "bubble_s"):
        assert getattr(shared.step, field) == pytest.approx(expect * getattr(own.step, field))
    assert dict(shared.step.comm_s)["pp:p2p"] == pytest.approx(expect * dict(own.step.comm_s)["pp:p2p"])
    assert 0 < step_time_lower_bound(s, CFG, _cluster(4), AUTOPAR_RUNTIME) <= shared.step.total_s


def test_no_sharing_no_change():
    """A core per rank (or more), no core count, several nodes, or no pipeline: the step as before."""
    s = _summary(3)
    own = evaluate(s, CFG, _cluster(0), AUTOPAR_RUNTIME, 1e15).step
    for c in (_cluster(8), _cluster(16), _cluster(4, nodes=2)):
        cfg = CFG if c.nodes == 1 else replace(CFG, dp=8)
        ref = own if c.nodes == 1 else evaluate(s, cfg, _cluster(0, nodes=2), AUTOPAR_RUNTIME, 1e15).step
        assert evaluate(s, cfg, c, AUTOPAR_RUNTIME, 1e15).step.total_s == pytest.approx(ref.total_s)
    flat = replace(CFG, pp=1, dp=8)
    assert evaluate(s, flat, _cluster(4), AUTOPAR_RUNTIME, 1e15).step.total_s == pytest.approx(
        evaluate(s, flat, _cluster(0), AUTOPAR_RUNTIME, 1e15).step.total_s)
    assert _cluster(4).rank_speedup == 2.0 and _cluster(0).rank_speedup == _cluster(16).rank_speedup == 1.0


def test_cores_per_node_in_the_cluster_file(tmp_path):
    d = {"name": "cpus", "gpu": "cpu", "nodes": 1, "gpus_per_node": 4, "cores_per_node": 2}
    c = cluster_from_dict(d)
    assert c.cores_per_node == 2 and c.rank_speedup == 2.0
    p = tmp_path / "c.toml"
    p.write_text(cluster_to_toml(c))
    assert load_cluster(p) == c and "cores_per_node = 2" in p.read_text()
    assert "cores_per_node" not in cluster_to_toml(cluster_from_dict({**d, "cores_per_node": 0}))
    for bad in (-1, 2.5, "2", True):
        with pytest.raises(ValueError, match="cores_per_node"):
            cluster_from_dict({**d, "cores_per_node": bad})
