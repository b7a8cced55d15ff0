"""The predicted peak memory of one training step, per pipeline rank, by category: what
``autopar run --memory`` and ``autopar profile`` print next to the measurement
(``runtime/memory_measure.py``).

``predict_memory`` starts from the solver's evaluation of the plan's configuration for every
pipeline rank (``solver.timing.evaluate``: activations of the ops' saved outputs in the plan dtype,
in-flight micro-batches, workspace), with the model states recomputed for the dtype the parameters
actually have and the optimizer actually run (``cost.memory.state_bytes_per_param``); the peak by
moments is the plan's own model (``solver/step_memory.py``), here for what the run holds.
"""
from __future__ import annotations

import torch

from autopar.runtime.copy_stream import side_stream_enabled
from autopar.runtime.memory_measure import MemoryByCategory, PredictedMemory


def plan_evaluation(plan, graph, cluster=None):
    """The solver's evaluation of ``plan``'s configuration on ``graph`` (every pipeline rank) and
    its tp-axis summary: the plan's choices forced, the same cluster and budget, and the plan's own
    per-operator placements (``solver/plan_choice.py``; the solve's where the tables lack one). ``graph``: the
    model traced with its loss at the plan's global batch (repeated blocks collapsed, as planning
    traces it)."""
    from autopar.cost.hardware import resolve_cluster
    from autopar.solver.forcing import Force
    from autopar.solver.plan_choice import own_summary
    from autopar.solver.search import solve
    from autopar.solver.timing import evaluate

    if cluster is None:
        cluster = resolve_cluster(plan.cluster.gpu, nodes=plan.cluster.nodes,
                                  gpus_per_node=plan.cluster.gpus_per_node)
    force = Force(tp=plan.tp, pp=plan.pp, dp=plan.dp, micro_batch_size=plan.micro_batch_size,
                  num_micro_batches=plan.num_micro_batches, zero_stage=plan.zero_stage,
                  recompute=plan.recompute, sequence_parallel=plan.sequence_parallel,
                  schedule=plan.pipeline_schedule if plan.pp > 1 else None,
                  virtual_stages=plan.virtual_stages if plan.pp > 1 else None,
                  context_parallel=plan.context_parallel,
                  context_parallel_mode=plan.context_parallel_mode if plan.context_parallel > 1 else None,
                  offload=plan.offload, tensor_parallel_mode=plan.summary()["tensor_parallel_mode"])
    res = solve(graph, cluster, global_batch=plan.global_batch, seq_len=plan.seq_len, dtype=plan.dtype,
                memory_budget_bytes=plan.cluster.memory_budget_bytes, force=force)
    cfg = res.evaluation.config
    if plan.recompute_layers is not None:       # per-layer recompute: the plan's layers, not every one
        from dataclasses import replace

        cfg = replace(cfg, recompute="partial", recompute_layers=plan.recompute_layers)
    summary = own_summary(res.solution, plan) or res.solution.summary     # the plan's own placements
    ev = evaluate(summary, cfg, res.cluster, res.profile, res.budget_bytes, all_stages=True)
    return ev, summary, res.profile


def predict_memory(evaluation, summary, pp_rank: int, param_dtype: str, optimizer: str = "adamw",
                   profile=None, device: str = "cpu") -> PredictedMemory:
    """Pipeline rank ``pp_rank``'s predicted peak and its categories (``solver/step_memory.py``):
    model states for ``param_dtype`` and ``optimizer`` (``cost.memory.state_bytes_per_param``),
    activations as the solver's evaluation has them, temporaries = the backward workspace plus the
    recompute / ZeRO-3 gather buffers at the run's parameter bytes, a split backward's held
    gradients and the reducer's transient."""
    from autopar.cost.memory import optimizer_moments, state_bytes_per_param
    from autopar.solver.runtime_profile import AUTOPAR_RUNTIME
    from autopar.solver.step_memory import RankShape, rank_peak
    from autopar.solver.layer_memory import rank_parts

    profile = profile or AUTOPAR_RUNTIME           # what the evaluation was made with
    st = next(s for s in evaluation.stages if s.index == pp_rank)
    shape = RankShape(pp_rank, st.layers, st.has_pre, st.has_post, st.inflight, st.param_numel,
                      st.memory.activations_bytes, tuple(evaluation.cuts))
    r = rank_peak(summary, evaluation.config, shape, rank_parts(summary, st.layers, st.has_pre, st.has_post),
                  state_bytes_per_param(param_dtype, optimizer), autocast=profile.autocast,
                  moments=optimizer_moments(optimizer), prefetch=side_stream_enabled(torch.device(device)),
                  wire=profile.grad_wire_bytes / profile.grad_bytes)
    cats = MemoryByCategory(int(r.params), int(r.grads), int(r.optimizer), int(r.activations), int(r.workspace))
    return PredictedMemory(int(r.peak), cats, int(r.host))
