"""Emitted stage modules (autopar/codegen/emit.py): printable, and the same forward as the executor."""
from __future__ import annotations

import re

import pytest

from autopar.codegen.emit import emit_stage, fmt, parse
from autopar.codegen.program import compile_program
from autopar.codegen.stages import cut_pipeline
from autopar.placements import Partial, Replicate, Shard
from handplans import hand_plan


def test_placement_text_round_trip():
    pl = (Shard(0), None, Replicate(), Partial())
    assert fmt(pl) == "S(0)_RP" and parse("S(0)_RP") == pl


def _mlp_lines(code: str, layer: int) -> list[str]:
    """The printed lines from layer ``layer``'s c_fc weight to the residual add after c_proj."""
    lines = code.splitlines()
    start = next(i for i, l in enumerate(lines) if f"transformer_h_{layer}_mlp_c_fc_weight = param" in l)
    end = next(i for i in range(start, len(lines)) if "torch.ops.aten.add.Tensor" in lines[i])
    return lines[start:end + 1]


def _result(lines: list[str], i: int) -> str:
    """The name line ``i``'s value goes on under: its pinned name when the next line pins it to the
    plan's output placement (``pin(rt, x, ...)``, which moves nothing when DTensor's rule agrees)."""
    name = lines[i].split(" = ")[0].strip()
    if i + 1 < len(lines) and f"= pin(rt, {name}, " in lines[i + 1]:
        return lines[i + 1].split(" = ")[0].strip()
    return name


def test_megatron_mlp_code(tiny_full):
    """Column- then row-parallel linear: nothing moves between them; the row-parallel output
    (Partial on tp) is all-reduced (P -> R) before the residual add."""
    code = emit_stage(tiny_full, compile_program(tiny_full, hand_plan(tiny_full, dp=1, tp=2))).code
    mlp = _mlp_lines(code, 0)
    fc = next(i for i, l in enumerate(mlp) if "aten.linear.default" in l)
    proj = next(i for i in range(fc + 1, len(mlp)) if "aten.linear.default" in mlp[i])
    fc_out = _result(mlp, fc)
    g = next(i for i, l in enumerate(mlp) if "aten.gelu.default" in l)
    assert f"aten.gelu.default({fc_out})" in mlp[g], mlp           # no move between fc and gelu
    m = re.search(r"= torch\.ops\.aten\.linear\.default\((\w+), \w+, (\w+)\)", mlp[proj])
    assert m.group(1) == _result(mlp, g), mlp                      # nor between gelu and c_proj
    out = m.group(2)
    assert not any(re.search(rf"\b{fc_out}\b|\bgelu\w*\b", l) for l in mlp if "redistribute(" in l), mlp
    assert any(f"{out} = redistribute(" in l and "'RP'" in l for l in mlp), "bias added once (R -> P)"
    linear = _result(mlp, proj)
    assert any(re.search(rf"= redistribute\({linear}, 'RR'\)", l) for l in mlp[proj + 1:]), mlp
    assert "param(rt, 'transformer.h.0.mlp.c_fc.weight')" in code
    assert "strided_split(" in code and "return cross_entropy_loss" in code


def test_pipeline_stages_code(tiny_full, tiny_bundle):
    from autopar.cost.hardware import resolve_cluster
    from autopar.solver import plan_model
    from autopar.trace import trace_model

    b = tiny_bundle
    plan = plan_model(trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target),
                      resolve_cluster("cpu", nodes=1, gpus_per_node=2), global_batch=4, seq_len=b.seq_len,
                      force="pp=2,mbs=1,schedule=1f1b")
    prog = compile_program(tiny_full, plan)
    cut = cut_pipeline(tiny_full, plan)
    first = emit_stage(tiny_full, prog, cut=cut, stage=0).code
    last = emit_stage(tiny_full, prog, cut=cut, stage=1).code
    assert "transformer.wte.weight" in first and "transformer.h.1." not in first
    assert "transformer.h.1." in last and "cross_entropy_loss" in last
    assert re.search(r"def forward\(self, \w+, \w+\)", last)        # the received value, the target
    with pytest.raises(ValueError, match="stage 2 is out of range"):
        emit_stage(tiny_full, prog, cut=cut, stage=2)


def test_recompute_regions_are_submodules(tiny_full):
    gm = emit_stage(tiny_full, compile_program(tiny_full, hand_plan(tiny_full, dp=2, tp=1, recompute="full")))
    assert "recompute(recompute_0, rt" in gm.code and hasattr(gm, "recompute_1")
    assert "aten.layer_norm.default" in gm.recompute_0.code


@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 2)])
def test_emitted_forward_equals_executor(tiny_full, dp, tp):
    from autopar.runtime.launch import spawn_ranks
    from emit_bodies import emitted_vs_executor

    plan = hand_plan(tiny_full, dp=dp, tp=tp)
    out = spawn_ranks(emitted_vs_executor, dp * tp, (plan.to_json(),), timeout_s=120)
    for r in out:
        assert r["got"] == pytest.approx(r["want"], rel=1e-6, abs=1e-6)
    assert "redistribute(" in out[0]["code"]


def test_cli_inspect_code(tmp_path, capsys):
    from dataclasses import replace

    from autopar.cli import main
    from autopar.plan import Plan

    path = str(tmp_path / "plan.json")
    assert main(["plan", "gpt-tiny", "--gpus-per-node", "2", "--force", "tp=2", "--json", path]) == 0
    capsys.readouterr()
    assert main(["inspect", path, "--code"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# stage 0: layers 0..1, mesh dp=1 x tp=2")
    assert "def forward(self" in out and "param(rt, 'transformer.wte.weight')" in out
    assert "cross_entropy" in out
    assert main(["inspect", path, "--code", "--stage", "1"]) == 2
    err = capsys.readouterr().err
    assert "--stage 1 is out of range" in err and len(err.strip().splitlines()) == 1
    moved = str(tmp_path / "moved.json")
    replace(Plan.load(path), model_name=str(tmp_path / "gone.py") + ":build").save(moved)
    assert main(["inspect", moved, "--code"]) == 2
    err = capsys.readouterr().err
    assert "cannot rebuild the plan's model" in err and len(err.strip().splitlines()) == 1


def test_cli_inspect_code_of_a_context_parallel_plan(tmp_path, capsys):
    """A cp=2 ring plan prints as the runtime runs it: traced on the folded batch (each sequence's
    chunk of 16 tokens as rows), the learned positions' ``arange`` given this rank's chunk
    (``context_positions``) and each attention run over the cp ranks (``context_attention``)."""
    from autopar.cli import main

    path = str(tmp_path / "plan.json")
    assert main(["plan", "gpt-tiny", "--gpus-per-node", "2", "--force", "cp=2,cpmode=ring", "--json", path]) == 0
    capsys.readouterr()
    assert main(["inspect", path, "--code"]) == 0
    out = capsys.readouterr().out
    assert "context_positions(rt, torch.ops.aten.arange.start, 'aten.arange.start', 0, 16" in out, out[:2000]
    assert out.count("context_attention(rt, ") == 2 and "scaled_dot_product_attention.default(" not in out
