"""Context parallelism in the planner (``solver/context.py``): which models can split their
sequences, what the search then tries and costs, the plan it writes, and the errors of forced
choices that cannot work."""
from __future__ import annotations

import pytest
import torch

from autopar.cost.hardware import make_cluster
from autopar.plan import Plan
from autopar.solver import plan_model
from autopar.solver.context import context_problem, cp_choices, position_sources
from autopar.solver.errors import PlanningError
from autopar.solver.forcing import parse_force
from autopar.solver.strategies import graph_facts, scaled_metas
from solver_helpers import traced

LLAMA_TINY = "llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"
BERT_TINY = "bert:hidden=64,layers=2,heads=4,ffn=128,vocab=128,seq=16"
VIT_TINY = "vit:image=32,patch=8,layers=2,hidden=64,heads=4,mlp=128,classes=10"
MLP_TINY = "mlp:width=32,depth=3"


def _facts(spec: str):
    g, b = traced(spec)
    return graph_facts(g, b.seq_len)


def _plan(spec: str, force: str, gpus: int = 8):
    g, b = traced(spec)
    return plan_model(g, make_cluster("a100-80g", 1, gpus), global_batch=g.batch_size, seq_len=b.seq_len,
                      dtype="bfloat16", force=parse_force(force))


@pytest.mark.parametrize("spec", ["gpt-tiny", LLAMA_TINY, BERT_TINY])
def test_token_wise_models_can_split_their_sequences(spec):
    assert context_problem(_facts(spec)) is None


def test_models_that_mix_tokens_or_have_none_cannot():
    g, _ = traced(VIT_TINY)                        # 16 patches + the class token, pooled per image
    assert "per sample" in context_problem(graph_facts(g, 17))
    assert "no sequence dim" in context_problem(_facts(MLP_TINY))


def test_position_sources_are_the_arange_and_the_rope_slices():
    g, _ = traced("gpt-tiny")
    assert [k.split("|")[1] for k in position_sources(g, 32)] == ["aten.arange.start"]
    g, _ = traced(LLAMA_TINY)
    assert sorted(k.split("|")[1] for k in position_sources(g, 16)) == ["aten.slice.Tensor"] * 2
    assert position_sources(g, 8) == frozenset()           # traced at 16 tokens: nothing of length 8


def test_free_search_splits_only_long_sequences():
    facts = _facts("gpt-tiny")                             # 32 tokens: below CP_MIN_FREE_SEQ
    assert cp_choices(facts, 8, 1, None, None, None) == [(1, "none")]
    # forced: every kind whose constraints hold (Ulysses: 4 heads over cp=4 ok, over tp=2 x cp=4 not)
    assert cp_choices(facts, 8, 1, 4, None, None) == [(4, "ring"), (4, "ulysses")]
    assert cp_choices(facts, 8, 2, 4, None, None) == [(4, "ring")]
    assert cp_choices(facts, 6, 1, 4, None, None) == []               # 4 does not divide 6 ranks
    # fewer rows than ranks: data parallelism cannot use them all, so cp is tried at any length
    assert cp_choices(facts, 8, 1, None, None, None, global_batch=2) == [
        (1, "none"), (2, "ring"), (2, "ulysses"), (4, "ring"), (4, "ulysses"), (8, "ring")]


def test_token_dims_shrink_by_cp():
    """Per rank, cp=2 halves every sequence dim and the flattened (batch x sequence) rows of the
    loss, and leaves weights alone."""
    facts = _facts("gpt-tiny")
    one, two = scaled_metas(facts, 2, "bfloat16", 1), scaled_metas(facts, 2, "bfloat16", 2)
    g = facts.graph
    logits_rows = next(n for n in g.nodes if n.target == "aten.cross_entropy_loss.default").inputs[0].key
    attn = next(n.key for n in g.nodes if n.target == "aten.scaled_dot_product_attention.default")
    assert two[attn][0].shape[2] * 2 == one[attn][0].shape[2] == 32         # (B, H, T, D)
    assert two[logits_rows][0].shape[0] * 2 == one[logits_rows][0].shape[0] == 2 * 32
    wte = next(n.key for n in g.nodes if n.kind == "param")
    assert two[wte] == one[wte]


def test_forced_cp_plan_fields_mesh_and_round_trip():
    plan = _plan("gpt-tiny", "cp=2,cpmode=ulysses,tp=2,pp=1")
    assert (plan.context_parallel, plan.context_parallel_mode) == (2, "ulysses")
    assert plan.mesh.axes == ("dp", "cp", "tp") and plan.mesh.shape == (2, 2, 2)
    assert plan.stage_mesh.size_of("dp") == plan.dp * 2           # the graph's data axis: dp x cp ranks
    s = plan.summary()
    assert (s["context_parallel"], s["context_parallel_mode"]) == (2, "ulysses")
    assert Plan.from_json(plan.to_json()) == plan
    assert any(k.startswith("cp:") for k, _ in plan.step_time.comm_s)   # attention's exchange is costed


def test_cp_halves_activations_and_adds_the_exchange():
    """The same configuration with cp=2 instead of dp=2 (same ranks): each rank holds half of every
    sequence instead of half of the rows -- the same activation bytes -- and pays the ring."""
    dp = _plan("gpt-tiny", "dp=2,tp=1,pp=1,mbs=1,zero=0,recompute=none", gpus=2)
    cp = _plan("gpt-tiny", "dp=1,cp=2,cpmode=ring,tp=1,pp=1,mbs=2,zero=0,recompute=none", gpus=2)
    assert cp.memory.activations_bytes == pytest.approx(dp.memory.activations_bytes, rel=0.02)
    assert dict(cp.step_time.comm_s).get("cp:ring", 0) > 0 and "cp:ring" not in dict(dp.step_time.comm_s)


@pytest.mark.parametrize("mode, priced", [("ring", True), ("ulysses", False)])
def test_a_ring_attention_node_pays_its_host_cost_per_micro_batch(mode, priced):
    """``GPUSpec.ring_attention_overhead_s`` (measured by ``autopar calibrate``): each ring
    attention node adds it once per micro-batch to the step (gpt-tiny: 2 layers, one attention
    each, m micro-batches); Ulysses' all-to-alls do not run the ring."""
    from dataclasses import replace

    g, b = traced("gpt-tiny")
    base = make_cluster("a100-80g", 1, 2)
    host = replace(base, gpu=replace(base.gpu, ring_attention_overhead_s=1e-3))
    force = parse_force(f"dp=1,cp=2,cpmode={mode},tp=1,pp=1,mbs=1,zero=0,recompute=none")
    a, c = (plan_model(g, cl, global_batch=g.batch_size, seq_len=b.seq_len, dtype="bfloat16", force=force)
            for cl in (base, host))
    assert a.num_micro_batches == c.num_micro_batches > 1
    want = 1e-3 * 2 * a.num_micro_batches if priced else 0.0
    assert c.step_time.compute_s - a.step_time.compute_s == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("force, words", [
    ("cp=3,tp=1,pp=1", ["2 x cp = 6", "32 tokens", "divisible by 6"]),     # on 6 GPUs
    ("cp=8,cpmode=ulysses,tp=1,pp=1", ["4 heads", "cpmode=ring"]),
    ("cp=1,cpmode=ring", ["needs cp > 1"]),
])
def test_forced_choices_that_cannot_work_say_what_to_change(force, words):
    with pytest.raises(PlanningError) as e:
        _plan("gpt-tiny", force, gpus=6 if "cp=3" in force else 8)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_forcing_cp_on_a_model_that_mixes_tokens_names_the_op():
    g, b = traced(VIT_TINY)
    with pytest.raises(PlanningError, match="cp=2: .*drop cp=2"):
        plan_model(g, make_cluster("a100-80g", 1, 8), global_batch=g.batch_size, seq_len=b.seq_len,
                   dtype="bfloat16", force=parse_force("cp=2"))


@pytest.mark.slow
def test_a_million_tokens_plan_splits_the_sequence():
    """The issue's case: LLaMA-3 8B with a 1M-token sequence on 64 H100s plans with context
    parallelism and keeps tensor parallelism inside a node."""
    from autopar.models import build_model
    from autopar.trace import trace_model

    b = build_model("llama3-8b", seq_len=1 << 20, batch=2)
    g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                    model_name="llama3-8b")
    plan = plan_model(g, make_cluster("h100", 8, 8), global_batch=64, seq_len=1 << 20)
    assert plan.context_parallel > 1 and plan.tp <= 8, plan.summary()


def test_a_one_sequence_trace_cannot_split_its_tokens():
    """At one sequence the batch dim is a size-1 dim no rule shards, so the folded batch could not
    be laid out over the dp x cp ranks: forcing cp says to trace more sequences."""
    g, b = traced("gpt-tiny", batch=1)
    with pytest.raises(PlanningError, match="traced at one sequence.*2 or more sequences"):
        plan_model(g, make_cluster("a100-80g", 1, 2), global_batch=1, seq_len=b.seq_len, dtype="bfloat16",
                   force=parse_force("cp=2"))


def test_tensor_parallel_modes_are_read_and_unknown_ones_refused_by_name():
    assert parse_force("tpmode=1d,tp=2").tp == 2
    assert parse_force("tpmode=2D,tp=4").tensor_parallel_mode == "2d"       # searched: solver/tensor_axes.py
    assert parse_force("tpmode=2p5d,tp=8").tensor_parallel_mode == "2.5d"
    with pytest.raises(ValueError) as e:
        parse_force("tpmode=4d")
    for w in ["tpmode=4d", "1d, 2d, 2.5d, 3d"]:
        assert w in str(e.value), str(e.value)


class _PosTokens(torch.nn.Module):
    """Tokens, a learned position table (added whole, or indexed by positions), one attention."""

    def __init__(self, seq: int, hidden: int, indexed: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, hidden)
        self.pos = torch.nn.Parameter(torch.randn(seq, hidden))
        self.qkv, self.head = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, 32)
        self.indexed = indexed

    def forward(self, x):
        h = self.embed(x)
        h = h + (self.pos[torch.arange(x.shape[1])] if self.indexed else self.pos)
        q, k, v = self.qkv(h).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(o.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("hidden", [16, 8])          # 16: weights and biases the sequence's size too
def test_a_position_table_added_whole_cannot_follow_the_chunks(hidden):
    """A parameter broadcast onto the tokens with a dim of the sequence's length on their sequence
    dim (``h + self.pos``) cannot be read by a rank that holds T / cp tokens: cp is refused, naming
    the op, the parameter and what to write instead. Indexed by positions (``pos[arange(T)]``),
    each rank gets its chunk's rows and cp plans; a weight or bias that only happens to be T long
    (hidden == T) is no such table."""
    from autopar.trace import trace_model

    x, y = torch.randint(0, 32, (2, 16)), torch.randint(0, 32, (2, 16))

    def loss(out, t):
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())

    for indexed in (False, True):
        g = trace_model(_PosTokens(16, hidden, indexed), (x,), loss_fn=loss, example_target=y)
        why = context_problem(graph_facts(g, 16))
        if indexed:
            assert why is None
        else:
            assert why is not None and "pos" in why and "(16, %d)" % hidden in why and "torch.arange" in why
            with pytest.raises(PlanningError, match="cp=2: .*pos.*drop cp=2"):
                plan_model(g, make_cluster("a100-80g", 1, 2), global_batch=2, seq_len=16, dtype="bfloat16",
                           force=parse_force("cp=2"))


def test_a_model_that_fails_on_its_chunk_says_cp_did_it():
    """Where planning let cp through and the trace at a rank's chunk still fails, the error says
    that cp traced T / cp tokens and how to make positions follow the chunks (``build.py``)."""
    from autopar.build import _chunk_trace_error
    from autopar.codegen.context_run import ContextRun
    from autopar.trace import TraceError

    e = TraceError("could not trace the model: RuntimeError: shape '[2, 16, 8]' is invalid",
                   source="m.py:3 in forward: x.view(2, 16, 8)", hint="(the eager hint)")
    out = _chunk_trace_error(e, ContextRun.make(None, 0, 2, "ring", 16, 1, "cpu"))
    assert isinstance(out, TraceError) and out.source == e.source
    assert "cp=2" in str(out) and "8 of each sequence's 16 tokens" in str(out) and "invalid" in str(out)
    assert "torch.arange" in out.hint and "(the eager hint)" not in str(out)
