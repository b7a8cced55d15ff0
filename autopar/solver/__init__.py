"""autopar.solver: GraphIR + ClusterSpec -> Plan. The only place that makes decisions.

    from autopar.solver import plan_model
    plan = plan_model(graph, cluster, global_batch=1536, seq_len=2048)

Flow: ``strategies`` (per-node strategies on the tp axis, from the op ``rules``) -> ``problem``
(cost tables, ``reshard`` on edges, ``saved`` activations) -> ``ilp`` (the program below) ->
``search`` (outer space, ``timing`` model, ``runtime_profile`` overlap) -> Plan. ``explain`` answers
"why not this placement?". More tensor axes (2-D / 2.5-D / 3-D): one such ILP per axis given the
others' choices (``tensor_axes``); the data axis: the rules' batch shards, that axis' optimum where
every op offers them, else the same ILP on it (``data_axis``).

The tp-axis ILP (one per tensor-parallel size t, sequence-parallel flag and micro-batch size)
--------------------------------------------------------------------------------------------
Nodes V: the traced graph's ops, parameters and inputs (the repeated block once). S_v: strategies
of v (output and input placements on the tp axis). Edges E: (u, v) for every tensor v reads from
u, plus the block's "wrap" edges (layer i's output feeding layer i+1). Weights w_v, w_e: how often
the node/edge runs per micro-batch in the whole model (the block's multiplicity).

    x[v,s] in {0,1}            v runs strategy s
    y[e,a,b] >= 0              edge e = (u,v) has u on a and v on b   (only pairs with finite cost)

    minimize   sum_v sum_s  w_v (c[v,s] + eps * m[v,s]) x[v,s]   +   sum_e sum_{a,b} w_e r[e,a,b] y[e,a,b]

    (a) one_strategy[v]:     sum_s x[v,s] = 1                                  ilp.add_one_strategy
    (b) edge_out[e,a]:       sum_b y[e,a,b] = x[u,a]                            ilp.add_edge_consistency
        edge_in[e,b]:        sum_a y[e,a,b] = x[v,b]
        (with x binary this forces y[e,a,b] = x[u,a] x[v,b] exactly: the tight linearization)
    (c) memory_budget[k]:    sum_v sum_s M_k[v,s] x[v,s] <= B_k                  ilp.add_memory
        one per pipeline stage k that can bind (first, last), only when the unconstrained
        solution does not fit: M = local parameter elements x model-state bytes per element
        (ZeRO stage, dp) x layers on the stage, or saved activation bytes x in-flight
        micro-batches x layers (0 for what recompute drops); B = budget - workspace.

    c[v,s]   forward + backward compute (roofline, compute split 1/t when sharded) + in-op comm
             (under context parallelism cp: tokens and their compute split 1/cp, and attention's
             exposed ring rotations or Ulysses all-to-alls, ``context.attention_comm``)
    r[e,a,b] forward reshard of u's output to v's input placement + backward reshard of v's input
             gradient to u's output-gradient placement (+ re-gather of a saved sharded input),
             after the runtime's overlap (problem.py, reshard.py)
    m[v,s]   bytes the choice keeps (a tie-breaker, eps = problem.MEMORY_TIE_BREAK_S_PER_BYTE)

Before the MILP: parallel edges are merged, dominated strategies dropped, and leaf and series
nodes eliminated exactly (``ilp.eliminate``; replayed afterwards). Solver: HiGHS via
``pulp.HiGHS`` (CBC if HiGHS is missing), gap 0. A problem without memory rows is solved as its LP
relaxation first: an integral LP optimum is the MILP's (the relaxation bounds it from below), a
fractional one is solved again as the MILP. ``ilp.brute_force`` is the reference for tests.

The outer search and the pipeline (``search``, ``timing``; formulas in ``cost.flops`` and ``cost.memory``)
----------------------------------------------------------------------------------------------------------
For each (tp, pp, dp, mbs, ZeRO, recompute, sp, cp with its kind: ``context.cp_choices``) and,
when pp > 1, each schedule s with its stages
per rank v -- 1f1b (v = 1); interleaved_1f1b, interleaved_zb (v = 2, 4, ... with pp v <= L);
zbv (v = 2); gpipe and dualpipev only when forced -- that torch can run with m micro-batches
(m >= pp; interleaved m % max(1, m // pp) = 0; dualpipev m >= 2 pp) and, for the zero-bubble ones,
the runtime runs with the recompute chosen (``plan.split_backward_problem``), the rank cut
n_0..n_{pp-1} (layers per rank, sum L, each >= v) is

    minimize   max_r t_r(n_r)            t_r = n_r a + [r holds stage 0] e_pre + [r holds the last stage] e_post
    subject to M_r(n_r) <= B             M_r = n_r (k_state + I_s(r) k_act) + c_r       (timing.choose_cuts)

(a: one layer's fwd + bwd + recompute + TP comm per micro-batch from the ILP solution; I_s(r): the
in-flight micro-batches of rank r under s, ``cost.memory.pipeline_inflight_microbatches``). Both
sides are affine in n_r, so the optimum is a water level found by bisection (``timing.balance``).
Rank r's layers are split over its v stages; stage i runs on rank i % pp (loop) or, for zbv and
dualpipev, rank r runs stages r and 2 pp - 1 - r (V). The step time is

    T = (m + U_s(pp, m, v)) max_r t_r + exposed DP sync + optimizer step

with the bubble U_s in units of the slowest rank's micro-batch time: p - 1 (gpipe, 1f1b), (p - 1)/v
(interleaved_1f1b), (p - 1)/(3v) (interleaved_zb), (p - 1 + max(0, 2p - 1 - m))/6 (zbv, dualpipev),
``cost.flops.pipeline_bubble_units``; the configuration minimizing T with every rank within B wins.
The zero-bubble schedules' split backward adds to t_r its host time and recompute replays and to
M_r the gradients held from the input to the weight pass (``cost.split_backward``).

Column- and row-parallel linears, sequence parallelism, vocab-parallel embeddings and losses are
not written anywhere: they fall out of the einsum rules and the resharding costs.
"""
from autopar.solver.errors import InfeasibleError, PlanningError
from autopar.solver.explain import explain
from autopar.solver.runtime_profile import AUTOPAR_RUNTIME, MEGATRON_RUNTIME, PROFILES, RuntimeProfile
from autopar.solver.search import SearchResult, plan_model, solve

__all__ = [
    "plan_model", "solve", "SearchResult", "explain", "PlanningError", "InfeasibleError",
    "RuntimeProfile", "AUTOPAR_RUNTIME", "MEGATRON_RUNTIME", "PROFILES",
]
