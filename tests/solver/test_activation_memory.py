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


@pytest.mark.parametrize("force, gpus, axes", [("tp=2,dp=2,mbs=4", 4, 2), ("tp=2,dp=1,mbs=8", 2, 1),
                                               ("tp=1,dp=4,mbs=2", 4, 0)])
def test_dtensor_over_a_2d_mesh_costs_its_own_figure_per_node(force, gpus, axes):
    """DTensor over a dp x tp mesh pays ``dtensor_2d_op_overhead_s`` per op node and micro-batch
    (its sharding propagation spans both axes; ``calibrate_runtime``), the 1-D figure over tp
    alone, and plain tensors nothing of either: the step grows by (2-D - 1-D) x the op nodes
    (embedding, 2 layers, head) on the 2-D mesh only; a 2-D figure below the 1-D one counts as it."""
    from dataclasses import replace

    from autopar.solver.timing import evaluate

    g, _ = traced("gpt:hidden=64,layers=2,heads=4,vocab=128,seq=16")
    cluster = make_cluster("h100", 1, gpus)
    one = replace(cluster, gpu=replace(cluster.gpu, dtensor_op_overhead_s=1e-3))
    more = replace(one, gpu=replace(one.gpu, dtensor_2d_op_overhead_s=3e-3))
    less = replace(one, gpu=replace(one.gpu, dtensor_2d_op_overhead_s=0.5e-3))
    res = solve(g, one, global_batch=8, seq_len=16, runtime=MEGATRON_RUNTIME, force=force + ",pp=1")
    summary, cfg = res.solution.summary, res.evaluation.config
    parts = summary.parts
    nodes = parts["pre"].nodes + summary.count * parts["block"].nodes + parts["post"].nodes
    assert parts["block"].nodes > 10 and nodes > summary.count * parts["block"].nodes
    steps = [evaluate(summary, cfg, c, res.profile, res.budget_bytes).step.total_s for c in (one, more, less)]
    assert steps[1] - steps[0] == pytest.approx(2e-3 * nodes if axes == 2 else 0.0, abs=1e-12)
    assert steps[2] == pytest.approx(steps[0], abs=1e-12)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_last_pipeline_stage_holds_the_logits_it_sends_to_the_loss(schedule):
    """In a pipeline the last stage's output (what the loss reads: the logits, reshaped) stays in
    torch's fwd_cache until its micro-batch's backward: the last rank's activations gain one
    micro-batch's (the last stage runs each backward right after its forward; GPipe: all m), by
    hand mbs x seq x vocab x 4 bytes; the other rank and the same model without a pipeline do
    not."""
    from dataclasses import replace

    from autopar.solver.timing import evaluate

    vocab, seq, mbs = 128, 16, 2
    g, _ = traced(f"gpt:hidden=64,layers=4,heads=4,vocab={vocab},seq={seq}", batch=8)
    cluster = make_cluster("h100", 1, 2)
    r = solve(g, cluster, global_batch=8, seq_len=seq, dtype="float32",
              force=f"tp=1,pp=2,mbs={mbs},schedule={schedule},recompute=none")
    summary, cfg = r.solution.summary, r.evaluation.config
    assert r.facts.loss_inputs == {"|aten.reshape.default|0"}
    assert summary.loss_input_bytes == mbs * seq * vocab * 4

    def activations(s):
        ev = evaluate(s, cfg, cluster, r.profile, r.budget_bytes, all_stages=True)
        return [st.memory.activations_bytes for st in sorted(ev.stages, key=lambda st: st.index)]

    with_logits, without = activations(summary), activations(replace(summary, loss_input_bytes=0.0))
    held = cfg.m if schedule == "gpipe" else 1
    assert cfg.m == 4 and with_logits[0] == without[0]
    assert with_logits[1] - without[1] == held * mbs * seq * vocab * 4
    flat = replace(cfg, pp=1, schedule="1f1b", v=1)
    assert evaluate(summary, flat, cluster, r.profile, r.budget_bytes).memory.activations_bytes == \
        evaluate(replace(summary, loss_input_bytes=0.0), flat, cluster, r.profile, r.budget_bytes).memory.activations_bytes


def test_the_last_stage_holds_its_16_bit_logits_at_the_traced_dtype():
    """Under autocast the head's matmul returns bf16 logits, but a pipeline's boundary value
    crosses at its traced dtype (``runtime/pipeline.Wire.send`` casts it back to fp32), the last
    stage's output to the loss too: held at mbs x seq x vocab x 4 bytes, not x 2; a model of
    16-bit parameters (no autocast) holds them at 2."""
    vocab, seq, mbs = 128, 16, 2
    g, _ = traced(f"gpt:hidden=64,layers=4,heads=4,vocab={vocab},seq={seq}", batch=8)
    cluster = make_cluster("h100", 1, 2)
    force = f"tp=1,pp=2,mbs={mbs},schedule=1f1b,recompute=none"
    r = solve(g, cluster, global_batch=8, seq_len=seq, dtype="bfloat16", force=force)
    assert r.profile.autocast and r.solution.summary.loss_input_bytes == mbs * seq * vocab * 4
    from autopar.solver import MEGATRON_RUNTIME

    r = solve(g, cluster, global_batch=8, seq_len=seq, dtype="bfloat16", force=force, runtime=MEGATRON_RUNTIME)
    assert not r.profile.autocast and r.solution.summary.loss_input_bytes == mbs * seq * vocab * 2
