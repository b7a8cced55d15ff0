"""The pipeline cut (codegen/stages.py) on traced graphs, in one process: what each stage runs,
receives and sends; the loss part; free nodes recomputed; how micro-batch losses combine."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from autopar.codegen.stages import cut_pipeline, loss_reduction
from autopar.cost.hardware import resolve_cluster
from autopar.models import build_model
from autopar.solver import plan_model
from autopar.trace import trace_model

LLAMA_4 = "llama:hidden=64,layers=4,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"


def _traced(spec: str, loss: bool = True):
    b = build_model(spec, device="meta", batch=4)
    kw = dict(loss_fn=b.loss_fn, example_target=b.example_target) if loss else {}
    full = trace_model(b.module, b.example_inputs, collapse_repeats=False, **kw)
    plan = plan_model(trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target),
                      resolve_cluster("cpu", nodes=1, gpus_per_node=2), global_batch=4, seq_len=b.seq_len,
                      force="pp=2,mbs=1,schedule=1f1b")
    return full, plan


def test_gpt_cut_sends_the_residual_stream_and_shares_the_tied_embedding():
    g, plan = _traced("gpt-tiny")
    cut = cut_pipeline(g, plan)
    s0, s1 = cut.stages
    by_name = {n.name: n for n in g.nodes}
    assert s0.recv == () and s1.recv == s0.send and len(s0.send) == 1
    assert by_name[s0.send[0]].out.shape == (4, 32, 64)                 # (B, T, hidden)
    assert {by_name[x].layer_id for x in s0.nodes if by_name[x].block} == {0}
    assert {by_name[x].layer_id for x in s1.nodes if by_name[x].block} == {1}
    assert cut.target in cut.loss and by_name[cut.loss_output].target == "aten.cross_entropy_loss.default"
    assert cut.inputs and all(x in s0.nodes for x in cut.inputs) and not set(cut.inputs) & set(s1.nodes)
    tied = cut.params_of(g, [0]) & cut.params_of(g, [1])
    assert tied == {"transformer.wte.weight"}                            # the embedding is lm_head too


def test_llama_rope_tables_are_recomputed_not_sent():
    g, plan = _traced(LLAMA_4)
    cut = cut_pipeline(g, plan)
    by_name = {n.name: n for n in g.nodes}
    s0, s1 = cut.stages
    assert len(s0.send) == 1 and by_name[s0.send[0]].out.shape == (4, 16, 64)
    rope = {x for x in s0.nodes if by_name[x].kind == "buffer"} & {x for x in s1.nodes if by_name[x].kind == "buffer"}
    assert rope, "both stages read the RoPE tables themselves"


def test_forward_only_cut_ends_in_the_model_output():
    g, plan = _traced("gpt-tiny", loss=False)
    cut = cut_pipeline(g, plan)
    assert cut.loss == () and cut.target == ""
    assert cut.stages[-1].send == (cut.loss_output,)


def test_a_plan_for_more_layers_is_refused():
    g, plan = _traced("gpt-tiny")
    st = plan.stages
    bigger = replace(plan, stages=(st[0], replace(st[1], last_layer=5)))
    with pytest.raises(ValueError, match="the model has 2"):
        cut_pipeline(g, bigger)


def test_loss_reduction_mean_sum_or_error():
    x, t = torch.randn(4, 5), torch.randint(0, 5, (4,))
    lin = torch.nn.Linear(5, 5)

    def red(loss_fn):
        return loss_reduction(trace_model(lin, (x,), loss_fn=loss_fn, example_target=t))

    assert red(lambda o, y: F.cross_entropy(o, y)) == "mean"
    assert red(lambda o, y: F.cross_entropy(o, y, reduction="sum")) == "sum"
    assert red(lambda o, y: (o.float() - y[:, None]).pow(2).mean()) == "mean"
    with pytest.raises(ValueError, match="neither a mean nor a sum"):
        red(lambda o, y: F.cross_entropy(o, y).exp())
