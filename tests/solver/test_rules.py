"""Strategy rules and resharding on hand-made graphs (no tracing)."""
import pytest

from autopar.cost import collective_s, make_cluster
from autopar.ir import Ref, TensorMeta
from autopar.placements import Partial, Replicate, Shard
from autopar.solver.reshard import grad_target, reshard_kind, reshard_s
from autopar.solver.rules import broadcast_protos, einsum_protos, view_dim_map
from autopar.solver.strategies import enumerate_strategies, graph_facts, scaled_metas

from solver_helpers import linear_chain_graph, node, tensor

R, P = Replicate(), Partial()


def test_einsum_linear_gives_col_row_and_data():
    x, w = TensorMeta((4, 8, 64), "float32"), TensorMeta((256, 64), "float32")
    protos = {p.name or str(p.output): p for p in einsum_protos(["abk", "nk"], "abn", [x, w],
                                                                   names={"n": "colwise", "k": "rowwise"})}
    assert protos["colwise"].inputs == (R, Shard(0)) and protos["colwise"].output == Shard(2)
    assert protos["rowwise"].inputs == (Shard(2), Shard(1)) and protos["rowwise"].output == P
    assert protos["S(0)"].inputs == (Shard(0), R)          # batch: weight replicated


def test_broadcast_shards_only_full_or_broadcast_dims():
    """A dim sharded on the output is sharded on each input that has it at full size and replicated
    on each that broadcasts it (missing or of size 1). In a table of local tensors an input may
    have it at neither size (its producer's piece, which the op reads gathered on another axis: a
    data-axis gather into a batch-replicated loss, ``benchmarks/fuzz.py --seed 40``): then no
    split of that dim, where it read as a broadcast split the output from replicated inputs."""
    out = TensorMeta((8, 3), "float32")
    full, row, col = TensorMeta((8, 3), "float32"), TensorMeta((1, 3), "float32"), TensorMeta((3,), "float32")
    by_dim = lambda ins: {p.output.dim: p.inputs for p in broadcast_protos(ins, out)}
    assert by_dim([full, row]) == {0: (Shard(0), R), 1: (Shard(1), Shard(1))}
    assert by_dim([full, col]) == {0: (Shard(0), R), 1: (Shard(1), Shard(0))}
    piece = TensorMeta((4, 3), "float32")                   # 4 of the 8 rows
    assert by_dim([piece, full]) == {1: (Shard(1), Shard(1))}


@pytest.mark.parametrize("a,b,expected", [
    ((2, 8, 64), (16, 64), {0: 0, 2: 1}),                  # merge (B, S) -> B*S: only the leading dim
    ((2, 8, 64), (2, 8, 4, 16), {0: 0, 1: 1, 2: 2}),       # split hidden into heads: leading = heads
    ((6, 4), (4, 6), {0: 0}),                              # many-to-many: leading to leading
    ((2, 1, 3), (2, 3), {0: 0, 2: 1}),                     # size-1 dims are dropped
])
def test_view_dim_map(a, b, expected):
    assert view_dim_map(a, b) == expected


def test_linear_chain_strategies_and_gradients():
    g = linear_chain_graph()
    facts = graph_facts(g, None)
    metas = scaled_metas(facts, 4, "bfloat16")
    fc1 = next(n for n in g.nodes if n.key == "fc1")
    strats = {s.name: s for s in enumerate_strategies(facts, fc1, metas, 2, False)}
    assert set(strats) >= {"replicate", "colwise", "rowwise", "data"}
    assert strats["colwise"].input_grads == (P, Shard(0))     # Megatron f: the input grad is Partial
    assert strats["data"].input_grads == (Shard(0), P)        # weight grad all-reduce
    assert strats["colwise"].compute_scale == 0.5 and strats["replicate"].compute_scale == 1.0
    # bf16 local bytes: (4, 256) / 2
    assert strats["colwise"].out_bytes_local == 4 * 256 * 2 // 2
    # t=3 divides nothing: no shard survives (a Partial input stays possible: linear is linear in x)
    assert all(not isinstance(p, Shard) for s in enumerate_strategies(facts, fc1, metas, 3, False)
               for p in (s.output,) + s.inputs)


def test_seq_shards_need_sequence_parallel():
    from solver_helpers import traced
    g, b = traced("gpt-tiny")
    facts = graph_facts(g, b.seq_len)
    metas = scaled_metas(facts, 2, "bfloat16")
    ln = next(n for n in g.nodes if "ln_1" in n.key and n.kind == "op")
    assert 1 in facts.seq_dims[ln.key] and 0 in facts.batch_dims[ln.key]
    off = {s.output for s in enumerate_strategies(facts, ln, metas, 2, False)}
    on = {s.output for s in enumerate_strategies(facts, ln, metas, 2, True)}
    assert Shard(1) not in off and Shard(1) in on


def test_unknown_target_is_replicated_and_listed():
    from autopar.ir import GraphIR
    nodes = (node("x", "input", outs=[tensor(4, 8)]),
             node("w", "param", outs=[tensor(8, 8)]),
             node("mm", "op", "aten.linear.default", [Ref("x"), Ref("w")], [tensor(4, 8)], flops=512, bytes_moved=512),
             node("odd", "op", "aten.frobnicate.default", [Ref("mm")], [tensor(4, 8)], flops=32, bytes_moved=256))
    g = GraphIR(nodes, (), 4, 64, 512, "x")
    facts = graph_facts(g, None)
    assert facts.unknown_targets == ("aten.frobnicate.default",)
    strats = enumerate_strategies(facts, nodes[3], scaled_metas(facts, 4, "float32"), 2, False)
    assert [s.name for s in strats] == ["replicate"]


def test_reshard_semantics_and_times():
    link = make_cluster("h100", 1).intra
    nbytes, n = 64e6, 8
    assert reshard_kind(Shard(1), R) == "all_gather"
    assert reshard_kind(P, R) == "all_reduce"
    assert reshard_kind(P, Shard(0)) == "reduce_scatter"
    assert reshard_kind(Shard(0), Shard(1)) == "all_to_all"
    assert reshard_kind(R, Shard(0)) is None and reshard_kind(R, P) is None and reshard_kind(Shard(2), Shard(2)) is None
    assert reshard_s(Shard(1), R, nbytes, n, link) == collective_s("all_gather", nbytes, n, link)
    assert reshard_s(P, Shard(1), nbytes, n, link) == collective_s("reduce_scatter", nbytes, n, link)
    assert reshard_s(Shard(0), Shard(1), nbytes, n, link) == collective_s("all_to_all", nbytes / n, n, link)
    assert reshard_s(P, R, nbytes, 1, link) == 0.0
    assert grad_target(P) == R and grad_target(Shard(1)) == Shard(1)


def test_partial_sums_only_add_tensors():
    """x_P + y_P is a partial sum; x_P + 1e-5 would add the scalar on every rank."""
    from autopar.solver.rules import find_rule
    x = tensor(4, 8)
    both = node("a", "op", "aten.add.Tensor", [Ref("x"), Ref("y")], [x])
    scalar = node("b", "op", "aten.add.Tensor", [Ref("x"), 1e-5], [x])
    rule = find_rule("aten.add.Tensor")
    assert any(p.output == P for p in rule(both, [x, x], [x]))
    assert not any(p.output == P for p in rule(scalar, [x], [x]))


def test_no_fold_of_a_matmul_is_split_along_an_inner_row_dim():
    """``x @ W`` with x (B, T, k) and W 2-D runs as one ``mm`` of x's rows flattened: a split of T is
    a strided split there (``strategies._inner_row_split``), so the tables leave it out, as for a
    linear; a batched matmul (a ``bmm``) keeps its row split."""
    from autopar.ir import GraphIR
    nodes = (node("x", "input", outs=[tensor(4, 8, 16)]),
             node("w", "param", outs=[tensor(16, 32)]),
             node("y", "input", outs=[tensor(4, 16, 32)]),
             node("fold", "op", "aten.matmul.default", [Ref("x"), Ref("w")], [tensor(4, 8, 32)], flops=32768,
                  bytes_moved=4096),
             node("batched", "op", "aten.matmul.default", [Ref("x"), Ref("y")], [tensor(4, 8, 32)], flops=32768,
                  bytes_moved=4096))
    g = GraphIR(nodes, (), 4, 64, 4096, "x")
    facts = graph_facts(g, None)
    metas = scaled_metas(facts, 4, "float32")

    def row_splits(n):
        return [s for s in enumerate_strategies(facts, n, metas, 2, False) if s.inputs and s.inputs[0] == Shard(1)]

    fold, batched = nodes[3], nodes[4]
    assert row_splits(fold) == [] and row_splits(batched)
    kept = {s.inputs[0] for s in enumerate_strategies(facts, fold, metas, 2, False)}
    assert {Shard(0), Shard(2)} <= kept                      # the batch and the contraction stay


def test_no_split_moves_past_a_batch_of_one_row_in_a_reshape():
    """(B, T, V) -> (B*T, V) with B = 1 row a rank: the view rule alone lets T's split through (the
    size-1 dim is dropped), but DTensor reshapes the global tensor, whose batch holds every data
    rank's rows, and gathers it; the tensor axes' strategies leave that split out
    (``strategies._past_a_batch_of_one``). At 2 rows the rule itself never offered it."""
    from autopar.models import build_model
    from autopar.trace import trace_model

    b = build_model("gpt-tiny", batch=2, device="meta")
    g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target, model_name="m")
    facts = graph_facts(g, None)
    ce = next(n for n in g.nodes if n.target == "aten.cross_entropy_loss.default")
    view = next(n for n in g.nodes if n.key == facts.inputs[ce.key][0].key)
    for mbs in (1, 2):
        metas = scaled_metas(facts, mbs, "float32")
        a, out = metas[facts.inputs[view.key][0].key][0].shape, metas[view.key][0].shape
        moves = {(s.inputs[0], s.output) for s in enumerate_strategies(facts, view, metas, 2, True)}
        assert (view_dim_map(a, out).get(1) == 0) == (mbs == 1)          # the rule's own answer
        assert (Shard(1), Shard(0)) not in moves and (Shard(2), Shard(1)) in moves, (mbs, moves)
