"""The memory-constrained tp-axis ILP's budget rows: each rank's memory as a linear function of the
strategy choice (``search._Searcher._constrained_fit`` adds them to the ILP)."""
from __future__ import annotations

from autopar.cost.memory import pipeline_inflight_microbatches
from autopar.recompute_ops import is_per_op
from autopar.solver.ilp import LinearConstraint
from autopar.solver.layer_memory import last_stage_outputs_held
from autopar.solver.problem import AxisTables
from autopar.solver.runtime_profile import RuntimeProfile
from autopar.solver.timing import Evaluation, OuterConfig, _grads_const, _state_bytes_per_param


def memory_constraints(tab: AxisTables, cfg: OuterConfig, unconstrained: Evaluation, profile: RuntimeProfile,
                       budget: float, layer_input_bytes: float, by_moments: bool = True) -> tuple[LinearConstraint, ...]:
    """Memory of each rank evaluated (at the unconstrained solution's cut) as a linear function of the
    strategy choice: the sum of each category's peak. Where the evaluation takes the peak by moments
    (``step_memory.py``: without a pipeline), the categories do not all peak at once; ``by_moments``
    gives the constraint the unconstrained solution's difference between the two as room (the
    search evaluates the constrained choice by moments and retries without it if that fails)."""
    per_param = _state_bytes_per_param(cfg, profile)
    # activation offload: no saved tensor stays on the device but what the backward brings back,
    # the evaluation's resident bytes (``timing._rank_memory``), a constant of the choice here
    act_off = "activations" in cfg.classes
    ops = tab.op_sets.get(cfg.recompute) if is_per_op(cfg.recompute) else None
    drop = ops.drop if ops is not None else (tab.core if cfg.recompute == "selective" else frozenset())
    extra = ops.extra if ops is not None else frozenset()
    out = []
    for st in unconstrained.stages:
        s = st.index
        first, last, lps = st.has_pre, st.has_post, st.layers
        inflight = 0.0 if act_off else pipeline_inflight_microbatches(cfg.pp, s, cfg.m, cfg.schedule, cfg.v)
        coeffs = []
        for k in tab.keys:
            kind = tab.kinds[k]
            if kind == "param":
                parts = tab.facts.param_parts[k]
                copies = lps if "block" in parts else (1 if ((("pre" in parts) and first) or (("post" in parts) and last)) else 0)
                coeffs.append(tuple(c.param_numel * per_param * copies for c in tab.costs[k]))
            elif kind in ("input", "buffer"):
                coeffs.append(tuple(0.0 for _ in tab.costs[k]))
            else:
                part = tab.facts.part[k]
                if part == "block":
                    keep = cfg.recompute == "none" or (is_per_op(cfg.recompute) and k not in drop)
                    mult = lps if keep else 0
                    if k in extra:          # held only as a recompute region's input
                        coeffs.append(tuple(c.out_bytes * inflight * mult for c in tab.costs[k]))
                        continue
                else:
                    mult = 1 if (part == "pre" and first) or (part == "post" and last) else 0
                    if mult and cfg.pp > 1 and k in tab.facts.loss_inputs and not act_off:
                        # ``layer_memory.held_loss_input_bytes`` (offloading activations: in ``const``)
                        held = last_stage_outputs_held(cfg) * tab.wire_factor(k)
                        coeffs.append(tuple(c.saved_bytes * inflight + c.out_bytes * held for c in tab.costs[k]))
                        continue
                coeffs.append(tuple(c.saved_bytes * inflight * mult for c in tab.costs[k]))
        const = st.memory.other_bytes + _grads_const(cfg) + (st.memory.activations_bytes if act_off else 0.0)
        if by_moments:
            const -= st.memory.categories_bytes - st.memory.total_bytes
        if cfg.recompute == "full":        # each layer keeps its input (the carried stream), fixed here
            const += inflight * lps * layer_input_bytes
        out.append(LinearConstraint(f"stage{s}", tuple(coeffs), budget - const))
    return tuple(out)
