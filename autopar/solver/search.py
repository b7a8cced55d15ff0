"""Outer search: mesh shape, pipeline depth, micro-batching, recompute, ZeRO, sequence parallelism.

    plan_model(graph, cluster, global_batch=..., seq_len=...) -> Plan

Space: tp | world, pp | world with pp <= layers of the repeated block, dp = world / (tp pp)
dividing the global batch, micro-batch size a power of two dividing global_batch / dp (every
pipeline needs m >= pp micro-batches), recompute in none/selective/full, ZeRO 0..3 (1..3 only with
dp > 1), sequence parallelism on/off (only with tp > 1), and for pp > 1 the pipeline schedule with
its stages per rank v: 1f1b (v = 1), interleaved_1f1b and interleaved_zb (v = 2, 4, 8, ... with
pp v <= layers), zbv (v = 2), gpipe and dualpipev only when forced, each where
``cost.flops.pipeline_schedule_problem`` allows it (torch's own checks) and, zero-bubble ones, where
``plan.split_backward_problem`` does (their split backward priced by ``cost.split_backward``),
and for tp >= 4 without sequence parallelism the multi-axis tensor meshes of ``tp`` that fit the
model (2-D q x q, 2.5-D d x q x q, 3-D q x q x q: ``configs.tensor_shapes``, ``tensor_axes.py``).
The stage cut is not enumerated: ``timing.choose_cuts`` picks the fastest cut that fits for each
configuration (uneven: the embedding's and head's ranks get fewer layers). Forced choices restrict it.

Exact by branch and bound, with true lower bounds at each level:
1. a memory bound per configuration from one tp=1, mbs=1 table (batch-dim activations scale
   linearly with the micro-batch; nothing shards below 1/tp): prunes without building tables;
2. for surviving (tp, sp, mbs) triples the cost tables are built and every quantity taken at its
   own minimum over strategies (edges 0, overlap windows at their maximum): a bound on the step
   time and memory of every configuration using the triple; memory-infeasible ones are pruned.
   Evaluated lazily: each configuration is first queued with ``timing.step_time_lower_bound``
   (<= the table bound, no cut, no rank evaluated) and evaluated on the tables only when it reaches
   the head of the queue, which visits the table-bound entries in the same order as evaluating all;
3. configurations are visited in order of their bound; the first time the bound reaches the best
   step time found, the rest are pruned.
The tp-axis ILP is solved once per (tp, sp, mbs) triple (its solution does not depend on pp, ZeRO
or recompute) and cached. A configuration whose memory does not fit with that solution goes back
into the queue with a tighter bound (any memory-constrained choice has an ILP objective at least
the unconstrained optimum, and the stage times sum to that objective plus recompute, so the slowest
stage takes at least 1/pp of it) and gets the memory-constrained ILP for its own (pp, dp, ZeRO,
recompute) only if it is still a contender. "Optimal" means: over the outer space, with each
configuration's tp strategies chosen by the ILP's per-micro-batch objective (pipeline stage balance,
DP sync and the optimizer are evaluated outside the ILP).

Offload (``offload_choice.py``): only when nothing fits without it (and it is not forced) the search
runs again over each configuration's offload variants, keeping the fastest that fits the GPU, host
and NVMe budgets (memory bounds: the leanest variant; time bounds: no offload, optimizer step >= 0);
configurations that fit only with offload are not weighed against ones that fit without it.

Micro-batch scaling: the graph was traced at ``GraphIR.batch_size``; tensors' batch dims, FLOPs
and activation bytes are scaled to the micro-batch size (``strategies.py``); parameter sizes are
not. ``seq_len`` must be the traced sequence length (it seeds which dims are "sequence").

Model FLOPs per step (MFU numerator) = 3 x the traced forward FLOPs of matmul and attention ops
over the whole model (repeats included) at the global batch; recompute is not counted.
"""
from __future__ import annotations

import heapq
import math
import operator
import time
from dataclasses import dataclass, fields, replace
from typing import Callable, Optional

from autopar.cost.hardware import ClusterSpec
from autopar.cost.flops import pipeline_bubble_units
from autopar.solver.forcing import Force, parse_force
from autopar.ir import GraphIR
from autopar.plan import ClusterRef, NodeStrategy, Plan, parse_offload
from autopar.mesh import DATA, TENSOR
from autopar.solver.configs import check_force, model_dims, no_config_error, outer_configs
from autopar.solver.context import check_context_force, context_problem, cp_choices
from autopar.solver.tensor_axes import axis_names, solve_axes, with_outer_axes
from autopar.solver.errors import InfeasibleError, PlanningError
from autopar.solver.ilp import IlpResult, solve_ilp
from autopar.solver.problem import AxisSummary, AxisTables, PartCost, build_tables, ilp_problem, \
    lower_bound_summary, summarize
from autopar.solver.runtime_profile import AUTOPAR_RUNTIME, RuntimeProfile, for_dtype
from autopar.recompute_ops import is_per_op
from autopar.solver.op_classes import RcCost, recompute_candidates, scaled_rc
from autopar.solver.data_axis import data_placements, solve_data_axis, unbatched_ops
from autopar.solver.plan_parts import _recompute_fields, model_flops, plan_stages
from autopar.solver.strategies import FLOAT_DTYPES, GraphFacts, graph_facts
from autopar.solver.offload_choice import best_variant, host_note, lean_memory
from autopar.solver.memory_constraints import memory_constraints
from autopar.solver.timing import (Evaluation, OuterConfig, default_budget_bytes, evaluate, host_budgets,
                                   memory_lower_bound, step_time_lower_bound)

Progress = Callable[[str, int, int], None]
GB = 1e9
# what bound 1's memory depends on: every configuration field but sequence parallelism (it only
# changes the tables of bound 2), the tensor mesh's shape and the kind of context parallelism (the
# quick summary and the memory model read neither)
_MEMORY_FIELDS = tuple(f.name for f in fields(OuterConfig) if f.name not in ("sp", "tp_shape", "cp_mode"))
_memory_key = operator.attrgetter(*_MEMORY_FIELDS)     # the fields the memory bound reads, as a tuple


@dataclass
class SearchStats:
    configs: int = 0                 # outer configurations enumerated
    pruned_memory_quick: int = 0     # by bound 1
    pruned_memory: int = 0           # by bound 2
    pruned_bound: int = 0            # by bound 3
    evaluated: int = 0               # evaluated exactly
    pruned_replay: int = 0           # pipelined candidates over the budget by a rank's schedule replay
    tables_built: int = 0
    ilp_solves: int = 0
    ilp_constrained: int = 0
    ilp_time_s: float = 0.0
    ilp_max_variables: int = 0
    ilp_max_constraints: int = 0
    solver: str = ""


@dataclass
class AxisSolution:
    tables: AxisTables
    choice: dict                     # key -> strategy index
    summary: AxisSummary
    ilp: Optional[IlpResult]
    # more than one tensor axis (``tensor_axes.py``): tables and choice above are the innermost
    # axis'; here (axis, tables, choice) of the outer ones, outermost last
    axes: tuple = ()


@dataclass
class SearchResult:
    plan: Plan
    evaluation: Evaluation
    solution: AxisSolution
    stats: SearchStats
    facts: GraphFacts
    cluster: ClusterSpec
    profile: RuntimeProfile
    budget_bytes: float
    dtype: str


# ---- bounds ---------------------------------------------------------------------------------------

def _table_key(cfg: OuterConfig) -> tuple:
    """What a configuration's tp-axis tables depend on: (tp, sp, mbs, cp, cp mode, tensor shape)."""
    return _bound_key(cfg) + (cfg.tp_shape,)


def _bound_key(cfg: OuterConfig) -> tuple:
    """What its bounds depend on: the one-axis tables of the total tp (``table``), any mesh shape."""
    return (cfg.tp, cfg.sp, cfg.mbs, cfg.cp, cfg.cp_mode)


def _quick_summary(base: AxisSummary, cfg: OuterConfig) -> AxisSummary:
    """Memory-only bound from the tp=1, mbs=1 tables (batch-dim tensors only): activations scale as
    mbs / (tp x cp) at best, parameters as 1 / tp; weight copies as at tp=1 (the most: less offload)."""
    f = cfg.mbs / base.mbs / cfg.tp / cfg.cp
    parts = {k: PartCost(0.0, 0.0, {}, {}, p.saved_bytes * f, 0.0, p.core_saved_bytes * f, p.max_out_bytes * f,
                         p.param_numel / cfg.tp, 0.0, 0.0, scaled_rc(p.rc, f), p.param_tensors,
                         weight_copy_bytes=p.weight_copy_bytes) for k, p in base.parts.items()}
    return replace(base, t=cfg.tp, mbs=cfg.mbs, parts=parts, shared_param_numel=base.shared_param_numel / cfg.tp,
                   layer_input_bytes=base.layer_input_bytes * f, loss_input_bytes=base.loss_input_bytes * f,
                   is_lower_bound=True)


# ---- the memory-constrained ILP ----------------------------------------------------------------------

# ---- the search -------------------------------------------------------------------------------------

class _Searcher:
    def __init__(self, graph, cluster, global_batch, seq_len, dtype, budget, force, progress, profile):
        self.graph, self.cluster, self.global_batch = graph, cluster, global_batch
        self.dtype, self.budget, self.force, self.profile = dtype, budget, force, profile
        self.progress = progress or (lambda stage, done, total: None)
        self.facts = graph_facts(graph, seq_len)
        self.stats = SearchStats()
        self.tables: dict = {}
        self.solutions: dict = {}
        self._lb: dict = {}
        self._caches: dict = {}
        self._constrained_ilps: dict = {}
        # ops whose rule does not offer the batch shards: the DATA axis is solved (``data_axis.py``)
        self.unbatched = unbatched_ops(self.facts)
        self._data_solutions: dict = {}
        # second pass (nothing fit without offload, offload not forced): each configuration's
        # offload variants (``offload_choice``); configurations then carry offload "none"
        self.offload_pass = False
        self.blocked: Optional[Evaluation] = None

    def table(self, tp: int, sp: bool, mbs: int, cp: int = 1, cp_mode: str = "none") -> AxisTables:
        key = (tp, sp, mbs, cp, cp_mode)
        if key not in self.tables:
            cache = self.cache(mbs, cp)
            self.tables[key] = build_tables(self.facts, self.cluster, tp, sp, mbs, self.dtype, self.profile, cache,
                                            cp=cp, cp_mode=cp_mode)
            self.stats.tables_built += 1
        return self.tables[key]

    def cache(self, mbs: int, cp: int) -> dict:
        """The traced metas and strategy prototypes shared by the tables of one (micro-batch, cp)."""
        return self._caches.setdefault((mbs, cp), {})

    def record(self, r: IlpResult) -> None:
        """Count an ILP solve in the search's statistics."""
        self.stats.ilp_solves += 1
        self.stats.ilp_time_s += r.solve_time_s
        self.stats.ilp_max_variables = max(self.stats.ilp_max_variables, r.num_variables)
        self.stats.ilp_max_constraints = max(self.stats.ilp_max_constraints, r.num_constraints)
        self.stats.solver = r.solver

    def solution(self, tp: int, sp: bool, mbs: int, cp: int = 1, cp_mode: str = "none",
                 tp_shape=()) -> AxisSolution:
        key = (tp, sp, mbs, cp, cp_mode, tp_shape)
        if key not in self.solutions and tp_shape:
            sweeps = None if self.force.tensor_parallel_mode else 1      # tensor_axes.py: forced families only
            tab, choice, summary, outer = solve_axes(self, tp_shape, sp, mbs, cp, cp_mode, sweeps)
            self.solutions[key] = AxisSolution(tab, choice, summary, None, outer)
        if key not in self.solutions:
            tab = self.table(tp, sp, mbs, cp, cp_mode)
            if all(len(tab.strategies[k]) == 1 for k in tab.keys):
                choice = {k: 0 for k in tab.keys}
                ilp = None
            else:
                ilp = solve_ilp(ilp_problem(tab))
                self.record(ilp)
                choice = {k: ilp.choice[i] for i, k in enumerate(tab.keys)}
            self.solutions[key] = AxisSolution(tab, choice, summarize(tab, choice), ilp)
        return self.solutions[key]

    def with_data(self, sol: AxisSolution, cfg: OuterConfig) -> AxisSolution:
        """``sol`` with ``cfg``'s DATA axis: as it is where the batch shards are the DATA axis'
        optimum (``data_axis.unbatched_ops`` empty) or dp is 1; else solved (``solve_data_axis``)."""
        if not self.unbatched or cfg.dp == 1:
            return sol
        key = _table_key(cfg) + (cfg.dp,)
        if key not in self._data_solutions:
            tab, choice, summary, axes = solve_data_axis(self, sol.tables, sol.choice, sol.axes, cfg)
            self._data_solutions[key] = AxisSolution(tab, choice, summary, sol.ilp, axes)
        return self._data_solutions[key]

    def constrained(self, cfg: OuterConfig, base: AxisSolution, ev: Evaluation,
                    by_moments: bool = True) -> Optional[AxisSolution]:
        """The memory-constrained ILP; with several tensor axes, of the inner axis given the outer
        axes' choices (its tables hold the tensors as one rank of them does: ``tensor_axes.py``).
        ``by_moments``: ``memory_constraints``'."""
        tab = base.tables
        cons = memory_constraints(tab, cfg, ev, self.profile, self.budget, base.summary.layer_input_bytes, by_moments)
        if any(c.rhs < 0 for c in cons):
            return None
        # configurations that differ only outside the tables (ZeRO 1 and 2 with the same room left,
        # sequence parallelism where the tables ignore it) pose the same problem: solved once
        key = (_table_key(cfg), cons)
        ilp = self._constrained_ilps.get(key)
        if ilp is None:
            ilp = self._constrained_ilps[key] = solve_ilp(ilp_problem(tab, cons))
            self.record(ilp)
            self.stats.ilp_constrained += 1
        if ilp.status != "optimal":
            return None
        choice = {k: ilp.choice[i] for i, k in enumerate(tab.keys)}
        return AxisSolution(tab, choice, with_outer_axes(summarize(tab, choice), base.axes, cfg.tp), ilp, base.axes)

    def run(self) -> tuple[Evaluation, AxisSolution]:
        world = self.cluster.num_gpus
        layers = self.graph.blocks[0].count if len(self.graph.blocks) == 1 else 1
        problem = context_problem(self.facts, self.unbatched)
        check_context_force(self.force, self.facts, problem)

        def cp_options(rest: int, tp: int) -> list:
            return cp_choices(self.facts, rest, tp, self.force.context_parallel, self.force.context_parallel_mode,
                              problem, self.global_batch)

        configs = outer_configs(self.force, world, layers, len(self.graph.blocks) == 1, self.global_batch,
                                cp_options, offload_free=self.offload_pass,
                                recomputes=recompute_candidates(self.table(1, False, 1)), dims=model_dims(self.graph))
        if not configs:
            raise no_config_error(self.force, world, self.global_batch, layers)
        self.stats.configs = len(configs)
        # counts of this pass (the offload pass runs the search again; ILP figures accumulate)
        self.stats.pruned_memory_quick = self.stats.pruned_memory = self.stats.pruned_bound = self.stats.evaluated = 0

        # bound 1: memory from the per-sample replicated tables
        base = lower_bound_summary(self.table(1, False, 1), batch_only=True)
        smallest: Optional[tuple[float, OuterConfig]] = None
        by_triple: dict = {}
        quick: dict = {}
        need_of: dict = {}
        for cfg in configs:
            qkey = (cfg.tp, cfg.mbs, cfg.cp)
            if qkey not in quick:
                quick[qkey] = _quick_summary(base, cfg)
            nkey = _memory_key(cfg)                                        # one bound per the rest
            need = need_of.get(nkey)
            if need is None:
                q = quick[qkey]
                need = need_of[nkey] = (lean_memory(lambda c: memory_lower_bound(q, c, self.profile).total_bytes, cfg)
                                        if self.offload_pass else memory_lower_bound(q, cfg, self.profile).total_bytes)
            if smallest is None or need < smallest[0]:
                smallest = (need, cfg)
            if need > self.budget:
                self.stats.pruned_memory_quick += 1
                continue
            by_triple.setdefault(_table_key(cfg), []).append(cfg)

        # bound 2: per-triple tables. Evaluating every configuration on its triple's lower-bound
        # tables (``evaluate`` with the fastest cut, a few ranks in full) is most of the search's
        # time, and the schedule variants multiply it; most configurations are then pruned by the
        # step-time bound without ever being looked at again. So each configuration first enters
        # the queue with ``timing.step_time_lower_bound`` of the same tables (a few multiplications;
        # it is <= the table bound, see its proof) at level -1, and is evaluated on the tables only
        # when it reaches the head of the queue. This visits the configurations of level >= 0 in
        # exactly the order of the eager search -- an entry (b, tie) at level 0 is preceded by its
        # own level -1 entry (c, tie) with c <= b -- so the same configurations are evaluated and
        # the same plan wins; the ones whose cheap bound already reaches the best step time are
        # pruned without the table evaluation. Those that do not fit the memory bound are dropped
        # when they are evaluated (if nothing fits, every entry is evaluated: ``smallest`` below).
        heap: list = []
        order = 0
        lb_memory: dict = {}                        # cfg -> (tie, lower-bound memory) of evaluated ones
        lb_of: dict = {}                            # one-axis cfg -> (its table-bound evaluation, memory)
        for i, (_, cfgs) in enumerate(sorted(by_triple.items())):
            self.progress("bounds", i, len(by_triple))
            key = _bound_key(cfgs[0])
            if key not in self._lb:
                self._lb[key] = lower_bound_summary(self.table(*key))
            lb = self._lb[key]
            for cfg in cfgs:
                heapq.heappush(heap, (step_time_lower_bound(lb, cfg, self.cluster, self.profile), order, cfg, -1, None))
                order += 1
        self.progress("bounds", len(by_triple), len(by_triple))

        # bound 3: best first. Entries: (bound, tie, cfg, level, lb evaluation). Level -1: the cheap
        # bound above. Level 0: the table bound. Level 1: the unconstrained ILP solution did not fit;
        # its bound is tightened with the ILP optimum (any memory-constrained choice has an
        # objective >= it, and the objective plus recompute is the sum of the stage times, so max
        # stage >= it / pp).
        best: Optional[tuple[Evaluation, AxisSolution]] = None
        smallest_exact: Optional[Evaluation] = None
        total = len(heap)
        done = 0
        while heap:
            bound, tie, cfg, level, lb_ev = heapq.heappop(heap)
            if best is not None and bound >= best[0].step.total_s:
                self.stats.pruned_bound += 1 + len(heap)
                break
            if level == -1:
                done += 1
                self.progress("search", done, total)
                lb = self._lb[_bound_key(cfg)]
                one_axis = replace(cfg, tp_shape=()) if cfg.tp_shape else cfg      # the same bound
                if one_axis not in lb_of:
                    ev = evaluate(lb, one_axis, self.cluster, self.profile, self.budget)
                    need = ev.memory.total_bytes
                    if self.offload_pass:  # time: without offload (a bound); memory: the leanest variant
                        need = lean_memory(lambda c: evaluate(lb, c, self.cluster, self.profile,
                                                              self.budget).memory.total_bytes, one_axis)
                    lb_of[one_axis] = (ev, need)
                ev, need = lb_of[one_axis]
                ev = replace(ev, config=cfg) if cfg.tp_shape else ev
                lb_memory[cfg] = (tie, need)
                if need > self.budget:
                    self.stats.pruned_memory += 1
                    continue
                # offload pass: a variant's pipeline and DP sync take at least the variant without
                # offload's, but its (CPU) optimizer step replaces the device one: counted as >= 0
                heapq.heappush(heap, (ev.step.total_s - (ev.step.optimizer_s if self.offload_pass else 0.0),
                                      tie, cfg, 0, ev))
                continue
            sol = self.with_data(self.solution(*_table_key(cfg)), cfg)
            if level == 0:
                if self.offload_pass:          # the fastest variant that fits, else the leanest
                    fit, ev, blocked = best_variant(sol.summary, cfg, self.cluster, self.profile, self.budget)
                    self._note_blocked(blocked)
                    ev = fit or ev
                else:
                    ev = evaluate(sol.summary, cfg, self.cluster, self.profile, self.budget)
                self.stats.evaluated += 1
                if ev.fits_device and not ev.fits:
                    self._note_blocked(ev)
                if not ev.fits:
                    if smallest_exact is None or ev.memory.total_bytes < smallest_exact.memory.total_bytes:
                        smallest_exact = ev
                    if cfg.recompute == "partial":      # every layer recomputed did not fit: that is
                        continue                        # the "full" configuration, searched on its own
                    heapq.heappush(heap, (max(bound, self._constrained_bound(cfg, sol, lb_ev)), tie, cfg, 1, ev))
                    continue
            else:
                # lb_ev holds the exact evaluation here (in the offload pass: of the leanest variant)
                found = self._constrained_fit(cfg, sol, lb_ev)
                if found is None:
                    continue
                sol, ev = found
            if best is None or ev.step.total_s < best[0].step.total_s:
                if ev.config.pp > 1:                  # the plan's peak: each rank's schedule replay
                    full = evaluate(sol.summary, ev.config, self.cluster, self.profile, self.budget, all_stages=True)
                    if not full.fits:
                        self.stats.pruned_replay += 1
                        if smallest_exact is None or full.memory.total_bytes < smallest_exact.memory.total_bytes:
                            smallest_exact = full
                        continue
                best = (ev, sol)
        self.progress("search", total, total)
        if best is None:
            # nothing fit, so the queue ran dry and every configuration was evaluated on its tables:
            # the least lower-bound memory, first in the eager search's order on ties
            for cfg, (_, need) in sorted(lb_memory.items(), key=lambda kv: kv[1][0]):
                if need < smallest[0]:
                    smallest = (need, cfg)
            raise self._infeasible(smallest, smallest_exact)
        return best

    def _constrained_fit(self, cfg: OuterConfig, sol: AxisSolution,
                         ev: Evaluation) -> Optional[tuple[AxisSolution, Evaluation]]:
        """The memory-constrained ILP's choice for ``cfg`` (``ev``: its unconstrained evaluation)
        and its evaluation, when it fits: first with the room the peak by moments leaves, then,
        if that choice does not fit, with every category at its peak at once."""
        for by_moments in (True, False):
            csol = self.constrained(ev.config, sol, ev, by_moments)
            if csol is None:
                continue
            if self.offload_pass:
                fit, cev, blocked = best_variant(csol.summary, cfg, self.cluster, self.profile, self.budget)
                self._note_blocked(blocked)
                cev = fit or cev
            else:
                cev = evaluate(csol.summary, cfg, self.cluster, self.profile, self.budget)
            if cev.fits_device and not cev.fits:
                self._note_blocked(cev)
            if cev.fits:
                return csol, cev
        return None

    def _note_blocked(self, ev: Optional[Evaluation]) -> None:
        """Keep the offload plan that fit the GPU but not the host / NVMe budget with the least host
        bytes (the infeasibility message names that budget)."""
        if ev is not None and (self.blocked is None or ev.memory.host_bytes < self.blocked.memory.host_bytes):
            self.blocked = ev

    def _constrained_bound(self, cfg: OuterConfig, sol: AxisSolution, lb_ev: Evaluation) -> float:
        lb = self._lb[_bound_key(cfg)]
        blk = lb.parts["block"]
        if is_per_op(cfg.recompute):        # lower bounds: the regions' compute, no comm
            rc = blk.core_fwd_s if blk.rc is None else blk.rc.get(cfg.recompute, RcCost(0.0, {}, 0.0, 0.0)).fwd_s
        else:
            rc = {"none": 0.0, "full": blk.fwd_compute_s}[cfg.recompute]   # not "partial"
        t_stage = (sol.summary.objective_s + sol.summary.count * rc) / cfg.pp
        lb_stage = max(st.time_per_microbatch_s for st in lb_ev.stages)
        span = cfg.m + pipeline_bubble_units(cfg.pp, cfg.m, cfg.schedule, cfg.v)
        outside = lb_ev.step.total_s - span * lb_stage       # DP sync + optimizer bounds
        if self.offload_pass:                                 # the CPU step replaces the device one
            outside -= lb_ev.step.optimizer_s
        return span * max(t_stage, lb_stage) + outside

    def _infeasible(self, smallest, smallest_exact: Optional[Evaluation]) -> InfeasibleError:
        """``smallest``: the least memory bound over all configurations (a true lower bound);
        ``smallest_exact``: the least memory among configurations evaluated exactly, if any."""
        need, cfg = smallest
        forced = self.force.items()
        where = f" with the forced values ({', '.join(f'{k}={v}' for k, v in forced)})" if forced else ""
        exact = ""
        if smallest_exact is not None and smallest_exact.memory.total_bytes > need * 1.01:
            exact = (f"; the leanest plan evaluated in full needs {smallest_exact.memory.total_bytes / GB:.1f} GB "
                     f"({smallest_exact.config.short()})")
        # A budget the leanest exactly evaluated plan fits in; else the lower bound (rounded up to 0.1 GB).
        enough = smallest_exact.memory.total_bytes if smallest_exact is not None else need
        hints = ["a GPU with more memory",
                 f"--memory-gb {math.ceil(enough / GB * 10) / 10:.1f} if the GPUs have that much free"]
        if forced == (("offload", "none"),):
            hints.append("offload (drop offload=none)")
        if not [kv for kv in forced if kv != ("offload", "none")]:
            # Model states shrink about as 1/GPUs when every axis shards them; activations need not,
            # so this is the fewest nodes worth trying, not a guarantee.
            nodes = max(self.cluster.nodes + 1, math.ceil(self.cluster.nodes * need / self.budget))
            hints.insert(0, f"--nodes {nodes} or more")
        else:
            hints.insert(0, "fewer --force pins (or larger tp/pp, zero=3, recompute=full)")
        lean = " with every offload class" if self.offload_pass else ""
        if self.blocked is not None:       # an offload plan fit the GPUs, not the host / NVMe
            return InfeasibleError(f"no plan fits both the GPUs and the host{where}" + host_note(self.blocked, self.cluster)
                                   + f" ({self.blocked.config.short()}); or try --nodes {self.cluster.nodes + 1} or more")
        return InfeasibleError(
            f"needs >= {need / GB:.1f} GB per GPU{lean} at the best plan{where} ({cfg.short()}){exact}; "
            f"budget {self.budget / GB:.1f} GB per GPU; try {', '.join(hints)}")


# ---- the Plan ---------------------------------------------------------------------------------------

def _has_data_axis(cfg) -> bool:
    """Whether the plan's mesh lists the data axis: not when it has size 1 beside several tensor
    axes. DTensor expands every op's strategies over every mesh axis (``expand_to_full_mesh_op_
    strategy``: s^k combinations, each priced by ``redistribute_cost``), so a size-1 axis multiplies
    that work by s for nothing: gpt-tiny's 3-D plan on 8 gloo ranks (2 cores) finished no step in 10
    minutes with it (a first linear and sum: 0.67-0.73 s of propagation against 0.08 s on a
    (2, 2, 2) mesh, 4,352 strategies against 576; without it, and without strided linear splits,
    ``strategies._inner_row_split``, 3 steps take 18 s). A missing axis has size 1 (``Mesh.size_of``); the 1-D
    family keeps its ("dp", "tp") mesh."""
    return cfg.data > 1 or not cfg.tp_shape


def _build_plan(s: _Searcher, ev: Evaluation, sol: AxisSolution, seq_len, solve_time_s: float) -> Plan:
    cfg = ev.config
    tab = sol.tables
    dp_out, dp_ins = data_placements(s.facts, tab.keys, cfg.zero, sol.axes)
    outer = tuple(reversed([a for a in sol.axes if a[0] != DATA]))     # outermost first, as the mesh lists them
    data_axis = _has_data_axis(cfg)
    def on_data(p) -> tuple:                   # the data axis' entry, where the mesh lists that axis
        return (p,) if data_axis else ()
    strategies = []
    for k in tab.keys:
        st = tab.strategies[k][sol.choice[k]]
        sts = [t.strategies[k][c[k]] for _, t, c in outer] + [st]
        ins = tuple(on_data(dp_ins[k][i]) + tuple(x.inputs[i] for x in sts) for i in range(len(st.inputs)))
        strategies.append(NodeStrategy(k, on_data(dp_out[k]) + tuple(x.output for x in sts), ins, st.name))
    full = evaluate(sol.summary, cfg, s.cluster, s.profile, s.budget, all_stages=True)
    stages = plan_stages(full, sol.summary)
    notes = [f"runtime profile: {s.profile.name}",
             f"search: {s.stats.configs} configurations; pruned {s.stats.pruned_memory_quick + s.stats.pruned_memory} "
             f"by memory bounds, {s.stats.pruned_bound} by the step-time bound; {s.stats.evaluated} evaluated exactly"
             + (f"; {s.stats.pruned_replay} pipelined over the budget by a rank's schedule replay"
                if s.stats.pruned_replay else ""),
             f"tp-axis ILP: {s.stats.ilp_solves} solves ({s.stats.ilp_constrained} memory-constrained) with "
             f"{s.stats.solver or 'no solver (tp=1 only)'}, {s.stats.ilp_time_s:.2f} s, up to "
             f"{s.stats.ilp_max_variables} variables / {s.stats.ilp_max_constraints} constraints"]
    if s.offload_pass:
        notes.append(f"offload {cfg.offload}: no configuration fits the GPUs without offload, so each one's "
                     "offload variants were searched (the fastest that fits the GPU, host and NVMe budgets)")
    if s.profile.step_overlapped(s.cluster, cfg.classes, cfg.zero, cfg.data):
        notes.append(f"optimizer step (CPU, offloaded): {full.step.optimizer_s:.4g} s exposed, the rest runs chunk by "
                     "chunk beside the next step's forward (runtime/host_step.py; autoparallelize(host_step=...))")
    if any(a == DATA for a, _, _ in sol.axes):
        notes.append("dp-axis ILP: the batch shards are not every op's strategy (" + ", ".join(s.unbatched[:5])
                     + (", ..." if len(s.unbatched) > 5 else "") + "), so the DATA axis was solved "
                     "(solver/data_axis.py): placements there from the op rules, collectives priced as dp:*")
    if s.facts.unknown_targets:
        notes.append("no sharding rule (replicated): " + ", ".join(s.facts.unknown_targets))
    strided = [x.key for x in strategies if x.name == "strided"]
    if strided:
        notes.append("strided split (the producer's weight rows are interleaved per rank, as Megatron's fused QKV): "
                     + ", ".join(strided))
    return Plan(
        model_name=s.graph.model_name, model_fingerprint=s.graph.fingerprint,
        cluster=ClusterRef(s.cluster.name, s.cluster.gpu.name, s.cluster.nodes, s.cluster.gpus_per_node,
                           int(s.budget), *((int(b) for b in host_budgets(s.cluster)) if cfg.classes else ())),
        dtype=s.dtype, global_batch=s.global_batch, seq_len=seq_len,
        dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, sequence_parallel=cfg.sp, zero_stage=cfg.zero,
        context_parallel=cfg.cp, context_parallel_mode=cfg.cp_mode,
        pipeline_schedule=cfg.schedule, virtual_stages=cfg.v,
        micro_batch_size=cfg.mbs, num_micro_batches=cfg.m, offload=cfg.offload, **_recompute_fields(full),
        mesh_axes=on_data(DATA) + (axis_names(cfg.tp_shape) if cfg.tp_shape else (TENSOR,)),
        mesh_shape=on_data(cfg.data) + (cfg.tp_shape or (cfg.tp,)), strategies=tuple(strategies), stages=stages,
        step_time=full.step, memory=full.memory, model_flops_per_step=model_flops(s.graph, s.global_batch),
        solve_time_s=solve_time_s, forced=s.force.items(), notes=tuple(notes))


def solve(graph: GraphIR, cluster: ClusterSpec, *, global_batch: int, seq_len: Optional[int],
          dtype: str = "bfloat16", memory_budget_bytes: Optional[int] = None, force: Force = Force(),
          progress: Optional[Progress] = None, runtime: RuntimeProfile = AUTOPAR_RUNTIME) -> SearchResult:
    """Like ``plan_model`` but also returns the search's tables, solution and statistics."""
    t0 = time.perf_counter()
    if global_batch < 1:
        raise PlanningError(f"global_batch must be >= 1, got {global_batch}")
    if graph.batch_size == 1 and global_batch > 1:
        raise PlanningError(f"the graph was traced at a batch of 1 row, but the global batch is {global_batch}: a "
                            "size-1 dim does not tell the batch apart, so nothing would scale with the micro-batch; "
                            "trace the model at a batch of 2 or more rows")
    world = cluster.num_gpus
    force = parse_force(force)
    if any(b.traced > 1 for b in graph.blocks):
        # a full trace (every layer traced) is one "layer" to the stage cut: pipelines are planned
        # on the collapsed trace (trace_model's default), as autopar plan / autoparallelize do
        if force.pp is not None and force.pp > 1:
            raise PlanningError(f"pp={force.pp}: pipeline stages are planned on the trace with each repeated "
                                "block traced once (trace_model(..., collapse_repeats=True), the default); "
                                "this graph traces every layer")
        force = replace(force, pp=1)
    check_force(force, graph, world, global_batch, seq_len)
    if force.offload not in (None, "none") and "params" in parse_offload(force.offload) and force.zero_stage is None:
        force = replace(force, zero_stage=3)     # params offload runs under ZeRO-3 only
    budget = float(memory_budget_bytes) if memory_budget_bytes is not None else default_budget_bytes(cluster)
    runtime = for_dtype(runtime, dtype, param_dtype(graph))
    s = _Searcher(graph, cluster, global_batch, seq_len, dtype, budget, force, progress, runtime)
    try:
        ev, sol = s.run()
    except InfeasibleError:
        if force.offload is not None:        # pinned (or forbidden: "none")
            raise
        s.offload_pass = True                # nothing fits the GPUs: offload (offload_choice.py)
        ev, sol = s.run()
    plan = _build_plan(s, ev, sol, seq_len, time.perf_counter() - t0)
    return SearchResult(plan, ev, sol, s.stats, s.facts, cluster, runtime, budget, dtype)


def param_dtype(graph: GraphIR) -> str:
    """The dtype of the graph's float parameters: "float32" when any is (or none is a float)."""
    kinds = {m.dtype for n in graph.nodes if n.kind == "param" for m in n.outputs if m.dtype in FLOAT_DTYPES}
    return "float32" if "float32" in kinds or not kinds else sorted(kinds)[0]


def plan_model(graph: GraphIR, cluster: ClusterSpec, *, global_batch: int, seq_len: Optional[int],
               dtype: str = "bfloat16", memory_budget_bytes: Optional[int] = None, force: Force = Force(),
               progress: Optional[Progress] = None, runtime: RuntimeProfile = AUTOPAR_RUNTIME) -> Plan:
    """Plan ``graph`` on ``cluster``: the fastest configuration that fits (module docstring).

    Raises ``PlanningError`` for forced choices that cannot work and ``InfeasibleError`` when no
    configuration fits the memory budget (default: HBM minus ``timing.MEMORY_RESERVE_FRACTION``).
    ``progress(stage, done, total)`` is called with stage "bounds" and "search"."""
    return solve(graph, cluster, global_batch=global_batch, seq_len=seq_len, dtype=dtype,
                 memory_budget_bytes=memory_budget_bytes, force=force, progress=progress, runtime=runtime).plan
