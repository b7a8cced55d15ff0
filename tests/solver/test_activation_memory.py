"""The saved-activation model (solver/saved.py) against Korthikanti et al.'s per-layer formula
(cost.memory.transformer_layer_activation_bytes; "selective" = without the attention-score terms,
which fused attention never materializes, and no dropout masks: the zoo GPT has dropout 0)."""
import pytest

from autopar.cost import make_cluster
from autopar.cost.memory import transformer_layer_activation_bytes
from autopar.solver import MEGATRON_RUNTIME, solve

from solver_helpers import traced

H, A, S = 2048, 16, 2048
MODEL = f"gpt:hidden={H},layers=4,heads={A},vocab=32768,seq={S}"


@pytest.mark.parametrize("t,sp", [(1, False), (2, True), (4, True)])
def test_layer_activations_match_korthikanti(t, sp):
    g, _ = traced(MODEL)
    r = solve(g, make_cluster("h100", 1), global_batch=8, seq_len=S, runtime=MEGATRON_RUNTIME,
              force=f"tp={t},pp=1,mbs=1,sp={'on' if sp else 'off'},recompute=none")
    if sp:   # the layout Korthikanti's TP+SP formula describes
        assert all(s.name == "seq" for s in r.plan.strategies if "layer_norm" in s.key)
    mine = r.solution.summary.parts["block"].saved_bytes
    ref = transformer_layer_activation_bytes(S, 1, H, A, t, sp=sp, recompute="selective")
    assert mine == pytest.approx(ref, rel=0.01)


@pytest.mark.parametrize("t, field", [(1, "op_overhead_s"), (2, "dtensor_op_overhead_s")])
def test_host_overhead_per_node_enters_every_op_once(t, field):
    """``autopar calibrate``'s per-node host cost: each op node of the tables (weighted by how
    often it runs) gains it in its forward, whatever its strategy; plain tensors at tp == 1,
    DTensor's figure at tp > 1."""
    from dataclasses import replace

    from autopar.solver.problem import build_tables
    from autopar.solver.strategies import graph_facts

    g, _ = traced("gpt:hidden=64,layers=2,heads=4,vocab=128,seq=16")
    cluster = make_cluster("h100", 1, 8)
    slow = replace(cluster, gpu=replace(cluster.gpu, **{field: 1e-3}))
    facts = graph_facts(g, 16)
    base, more = (build_tables(facts, c, t, False, 2, "bfloat16", MEGATRON_RUNTIME) for c in (cluster, slow))
    ops = [k for k in base.keys if base.kinds[k] not in ("param", "input", "buffer")]
    assert ops
    for k in ops:
        for a, b in zip(base.costs[k], more.costs[k]):
            assert b.fwd_s == pytest.approx(a.fwd_s + 1e-3) and b.bwd_s == a.bwd_s
