"""Codegen: Plan + GraphIR -> each rank's program, run on DTensors over the DeviceMesh of the plan's
stage mesh (``autopar.mesh.Mesh``: named axes, found by role name; codegen imports nothing from
the runtime).

    program.py    plan -> per-node placements, parameters, recompute regions, strided QKV, local-dp
    executor.py   the interpreter over the exported graph (fallbacks, checkpoint regions, stage parts)
    emit.py       per stage, an fx.GraphModule of its forward with the placements explicit
                  (``redistribute(x, 'S(0)R')`` calls; `autopar inspect --code`); runnable on DTensors
    edges.py      a value moved between placements, autograd-correct (the resharding on every edge)
    writes.py     which operands an op writes in place (BatchNorm statistics, counters)
    fallback.py   ops DTensor has no rule for, run on local tensors
    fused.py, fused_args.py, fused_regions.py, patterns.py, vocab_ce.py
                  fused-kernel substitution (single ops and multi-node regions), vocab-parallel CE
    causal_check.py  constant attention masks too large to fold at trace time, checked on step 1
    stages.py     the pipeline cut: each stage's nodes, what crosses each boundary, the loss part;
                  the point-to-point sends a step should issue
    expected.py   the collectives a step should issue, from Plan + GraphIR
    buckets.py    gradient buckets and ZeRO row chunks (shared by the reducer and the predictor)
    shards.py     which slice of a full tensor a mesh coordinate holds
"""
from autopar.codegen.expected import expected_collectives
from autopar.codegen.program import RankProgram, compile_program, local_dp_nodes

__all__ = ["RankProgram", "compile_program", "expected_collectives", "local_dp_nodes"]
