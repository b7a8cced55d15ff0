"""Step time and memory of one outer configuration, from a tp-axis solution summary.

Per micro-batch of ``mbs`` sequences, pipeline stage ``s`` (``L/pp`` layers of the repeated block;
the nodes before the block on the first stage, the nodes after it on the last) takes

    t_stage = compute (fwd + bwd) + recompute + exposed TP comm + pipeline p2p + per-micro-batch ZeRO-2/3 comm

with recompute "full" re-running each layer's forward (compute and its TP comm) and per-operator
recompute ("selective" = "ops:attention", "ops:..." in ``autopar/recompute_ops.py``) re-running
its regions' forward (compute and collectives: ``op_classes.rc_costs``; a zero-bubble split backward: ``cost.split_backward``). Step time (``cost.flops``):

    T = (m + U) * max_r t_rank  +  max_r exposed DP sync  +  max_r optimizer step  +  host per step

(host per step: ``GPUSpec.step_overhead_s``, what a step costs beside its graph's nodes; measured
by ``autopar calibrate`` on CPUs, 0 otherwise)

t_rank: one pp rank's time per micro-batch over all its stages; U: the schedule's bubble in units
of it (p - 1 for GPipe/1F1B, Megatron §2.2.1; (p - 1)/v interleaved; ... ``pipeline_bubble_units``).
The cut (layers per rank) is ``choose_cuts``: the fastest that fits, from an affine model of each
rank's time and memory in its layer count (``balance``).

Shared cores (a one-node CPU cluster whose ranks outnumber its cores, ``ClusterSpec.cores_per_node``):
the file's rates are a rank's with every rank busy, and a rank computes up to S = ranks / cores
times faster while others idle, as a pipeline's ranks do in its bubble and while a lighter stage
waits on a heavier one. The pipeline part, (m + U) t_max, becomes the larger of two lower bounds,
the ranks' whole work spread over all of them (m x the mean of t_rank over the p ranks) and the
schedule run at S times the speed ((m + U) t_max / S), never above (m + U) t_max; all its terms
scale alike (``shared_core_speedup``). On 4 ranks sharing 2 cores a 3-layer LLaMA at pp=2 stepped in
209 ms where (m + U) t_max priced 352.

DP sync (per step, on the dp axis link) by ZeRO stage (``overlap.dp_sync``), each costing
``max(0, comm - window) + overlap_slowdown * min(comm, window)`` when the runtime profile overlaps
it (``runtime_profile.py``; ``overlap.account`` says per collective how much is hidden, and why):
  0: all_reduce(grads)                       window: backward of the last micro-batch
  1: reduce_scatter(grads) + all_gather(params after the step)    windows: last backward / first forward
  2: reduce_scatter(grads) every micro-batch (in t_stage) + all_gather(params)
  3: all_gather(params) fwd and bwd + reduce_scatter(grads), every micro-batch (in t_stage)
Gradients are ``profile.grad_bytes`` per element, parameters ``profile.param_bytes`` (2 for 16-bit
plans, 4 for fp32 ones: ``runtime_profile.for_dtype``). Under context parallelism the group that
syncs gradients and shards ZeRO state is the dp x cp ranks (``OuterConfig.data``): a cp rank holds
the same parameters as its dp peers.

Pipeline p2p: each micro-batch sends its activation forward and its gradient backward across
each of a rank's v stage boundaries (one ``layer_input_bytes`` message each way), not overlapped.
Once a step, after the schedule, with the DP sync: the loss's broadcast over the pipeline and the
tied parameters' gradient all-reduce between the first and the last stage's ranks
(``overlap.pipeline_sync_s``). The last stage's loss: its one-value all-reduces over the batch shards, each micro-batch
(``overlap.loss_scalars_s``).

Gradient passes (a runtime with ``RuntimeProfile.grad_passes``): the reducer's copies of the
gradients into its buffers and the micro-batches' accumulating adds (``overlap.grad_pass_bytes``),
at HBM bandwidth x memory efficiency, in the rank's compute (per micro-batch: 1/m of the step's);
likewise ZeRO-3's gathers' copies into and out of their buffers (``gather_passes``,
``overlap.gather_pass_bytes``, every micro-batch), and the host's work on its gather groups beside
their collectives (``GPUSpec.zero3_group_overhead_s`` per group per micro-batch, measured on CPU
ranks: ``overlap.zero3_host_s``).

Optimizer step (memory bound): per local parameter it reads the 16-bit param, the gradient, the
fp32 master copy and the two Adam moments and writes the param, master and moments back
(``OPTIMIZER_BYTES_PER_PARAM`` + grad bytes), at HBM bandwidth x memory efficiency x
``optimizer_efficiency`` (1 unless measured), / dp under ZeRO >= 1.

Memory of stage s (``MemoryUse``): model states by ``cost.memory.model_state_bytes`` on the stage's
local (tp-sharded) parameters; activations = in-flight micro-batches
(``cost.memory.pipeline_inflight_microbatches``; 1F1B: ``pp - r``) x the bytes the stage's ops save
per micro-batch (full recompute: each layer's input only; per-operator: less what its regions drop,
``op_classes.op_set``); other = a workspace of the largest single local output (one transient
gradient), plus one layer's (per-operator: one region's) re-materialized activations under
recompute, plus ``ZERO3_PREFETCH_LAYERS`` layers of gathered parameters under ZeRO-3 (under autocast
without recompute the larger of those and the rest: ``layer_memory.workspace_bytes``).

Offload (``OuterConfig.offload``, classes of ``plan.OFFLOAD_CLASSES``): ``cost.offload`` moves the
rank's bytes to the host / NVMe and adds its exposed transfers: per micro-batch ("host:h2d",
"host:d2h" in t_stage: params, activations) and per step (gradients down, updated rows up and the
NVMe state I/O with the DP sync; the CPU optimizer step replaces the device one). The solver
assumes AdamW (2 moments). Under params offload the gathered ZeRO-3 working window stays on the
device whatever the data degree. ``Evaluation.fits`` checks the host and NVMe bytes per GPU too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autopar.cost.collectives import axis_link, collective_s, stage_link
from autopar.cost.flops import pipeline_bubble_fraction, pipeline_bubble_units, pipeline_step_time_s
from autopar.cost.hardware import ClusterSpec
from autopar.cost.memory import (backward_workspace_bytes, model_state_bytes, pipeline_inflight_microbatches,
                                 reducer_transient_bytes)
from autopar.cost.split_backward import rank_held_affine, rank_held_bytes, rank_split_times
from autopar.cost.offload import (FP32, bucket_bytes, chunk_share, offload_memory, offload_microbatch_times,
                                  offload_step_times, optimizer_rows, overlap_first_chunk,
                                  resident_saved_bytes)
from autopar.plan import V_SCHEDULES, MemoryUse, StepTime
from autopar.solver.balance import balance
from autopar.solver.problem import AxisSummary, PartCost
from autopar.solver.overlap import (account as overlap_account, accumulates_rows, dp_sync as overlap_dp_sync,
                                    grad_pieces, loss_scalars_s, memory_pass_s, pipeline_sync_s, reduces_once_per_step,
                                    zero3_host_s)
from autopar.solver.runtime_profile import RuntimeProfile
from autopar.recompute_ops import is_per_op
from autopar.solver.layer_memory import (activation_bytes_per_layer, gather_group_count, held_loss_input_bytes,
                                         largest_group_numel, rank_parts, rc_of,
                                         recast_per_microbatch, recomputed_layers, saved_per_microbatch,
                                         workspace_bytes)
from autopar.solver.outer_config import OuterConfig
from autopar.solver.step_memory import RankShape, rank_peak

MEMORY_RESERVE_FRACTION = 0.05       # of HBM kept free for the CUDA context, NCCL buffers, fragmentation
# Adam step traffic per parameter besides the gradient: read param 2 + master 4 + m 4 + v 4,
# write param 2 + master 4 + m 4 + v 4.
OPTIMIZER_BYTES_PER_PARAM = 28
HOST_MEMORY_RESERVE_FRACTION = 0.1   # of host RAM kept for the OS, the data loader, pinned buffers (rough)
MOMENTS = 2                          # optimizer moments the planner assumes (AdamW)


@dataclass(frozen=True)
class StageEval:
    """One pipeline rank (all its stages), per micro-batch unless said otherwise."""
    index: int                       # pp rank
    time_per_microbatch_s: float
    compute_s: float
    recompute_s: float
    comm: dict                       # kind -> exposed seconds per micro-batch
    dp_sync: dict                    # kind -> exposed seconds per step
    optimizer_s: float
    memory: MemoryUse
    param_numel: float
    layers: int = 0                  # layers of the repeated block on this rank (all its stages)
    has_pre: bool = False            # runs the nodes before the block (embedding)
    has_post: bool = False           # runs the nodes after the block (head, loss)
    inflight: float = 1.0            # micro-batches of activations held at the peak
    dp_rows: tuple = ()              # ``overlap.dp_sync``'s rows (the overlap accounting)


@dataclass(frozen=True)
class Evaluation:
    config: OuterConfig
    step: StepTime
    memory: MemoryUse                # the most loaded rank
    stages: tuple                    # StageEval of the ranks evaluated (all with all_stages)
    budget_bytes: float
    cuts: tuple = ()                 # layers per pp rank (len pp)
    host_budget_bytes: float = math.inf      # per GPU (``host_budgets``)
    nvme_budget_bytes: float = math.inf

    @property
    def fits_device(self) -> bool:
        return self.memory.total_bytes <= self.budget_bytes

    @property
    def fits(self) -> bool:
        return (self.memory.total_bytes <= self.budget_bytes and self.memory.host_bytes <= self.host_budget_bytes
                and self.memory.nvme_bytes <= self.nvme_budget_bytes)


def host_budgets(cluster: ClusterSpec) -> tuple[float, float]:
    """(host bytes, NVMe bytes) per GPU: a node's host RAM less ``HOST_MEMORY_RESERVE_FRACTION``
    and its NVMe, shared by its GPUs."""
    return (cluster.host_memory_bytes * (1.0 - HOST_MEMORY_RESERVE_FRACTION) / cluster.gpus_per_node,
            cluster.nvme_bytes / cluster.gpus_per_node)


def _merge(into: dict, src: dict, scale: float) -> None:
    for k, v in src.items():
        if v:
            into[k] = into.get(k, 0.0) + v * scale


def rank_holds(cfg: OuterConfig, r: int) -> tuple[bool, bool]:
    """(holds stage 0 = the embedding, holds the last stage = the head) for pp rank r."""
    return r == 0, (r == 0 if cfg.schedule in V_SCHEDULES else r == cfg.pp - 1)


# ---- stage cuts ----------------------------------------------------------------------------------

def _linear_terms(summary: AxisSummary, cfg: OuterConfig, profile: RuntimeProfile):
    """Per-layer and per-extra (embedding/head) time and memory, the affine model the cut balances."""
    blk, pre, post = summary.parts["block"], summary.parts["pre"], summary.parts["post"]

    def t_of(p: PartCost) -> float:
        return p.fwd_compute_s + p.bwd_compute_s + sum(p.comm_fwd.values()) + sum(p.comm_bwd.values())

    a = t_of(blk)
    if cfg.recompute == "full":
        a += blk.fwd_compute_s + sum(blk.comm_fwd.values())
    elif is_per_op(cfg.recompute):
        rc = rc_of(blk, cfg.recompute)
        a += blk.core_fwd_s if rc is None else rc.fwd_s + sum(rc.comm_fwd.values())
    rate = _state_bytes_per_param(cfg, profile)
    act = activation_bytes_per_layer(blk, summary, cfg.recompute)
    return a, t_of(pre), t_of(post), rate, act


def _state_bytes_per_param(cfg: OuterConfig, profile: RuntimeProfile) -> float:
    """Device model-state bytes per local parameter (offloaded classes excluded; gradients
    offloaded with one micro-batch cost a constant, ``_grads_const``)."""
    n = 1_000_000
    st = model_state_bytes(n, cfg.data, cfg.zero, param_bytes=profile.param_bytes, grad_bytes=profile.grad_bytes,
                           optimizer_bytes_per_param=profile.optimizer_bytes, full_grads=reduces_once_per_step(cfg))
    cls = cfg.classes
    if "optimizer" in cls:
        st["optimizer"] = 0.0
    if "params" in cls:
        st["params"] = 0.0
    if "grads" in cls and cfg.m == 1:
        st["grads"] = 0.0
    return sum(st.values()) / n


def _grads_const(cfg: OuterConfig) -> float:
    """Device gradient bytes that offloaded gradients keep (two buckets in flight, one micro-batch):
    an upper bound on min(G, 2 B), the affine model's constant."""
    return 2.0 * bucket_bytes() if ("grads" in cfg.classes and cfg.m == 1) else 0.0


def _memory_affine(summary: AxisSummary, cfg: OuterConfig, profile: RuntimeProfile, rate: float, act: float):
    """(slope bytes per layer, constant bytes) of each rank's memory, as ``_rank_memory`` computes it."""
    blk, pre, post = summary.parts["block"], summary.parts["pre"], summary.parts["post"]
    grads_const = _grads_const(cfg)
    offloaded = "activations" in cfg.classes       # one layer and the embedding / head stay on the device
    slopes, consts = [], []
    for r in range(cfg.pp):
        hp, hh = rank_holds(cfg, r)
        extra_numel = (pre.param_numel if hp else 0.0) + (post.param_numel if hh else 0.0) \
            + (summary.shared_param_numel if (hp or hh) else 0.0)
        extra_act = (pre.saved_bytes if hp else 0.0) + (post.saved_bytes if hh else 0.0)
        held_logits = held_loss_input_bytes(summary, cfg) if hh else 0.0    # not offloaded: no saved tensor
        largest = max([blk.max_out_bytes] + ([pre.max_out_bytes] if hp else []) + ([post.max_out_bytes] if hh else []))
        held_slope, held_const = rank_held_affine(cfg, summary, r)   # zero-bubble: gradients held from B to W
        out_b = workspace_bytes(summary, cfg, backward_workspace_bytes(largest), param_bytes=profile.param_bytes,
                                autocast=profile.autocast) + held_const
        if offloaded:
            slopes.append(rate * blk.param_numel + held_slope)
            consts.append(rate * extra_numel + act + extra_act + out_b + grads_const + held_logits)
        else:
            inflight = pipeline_inflight_microbatches(cfg.pp, r, cfg.m, cfg.schedule, cfg.v)
            slopes.append(rate * blk.param_numel + inflight * act + held_slope)
            consts.append(rate * extra_numel + inflight * extra_act + out_b + grads_const + held_logits)
    return slopes, consts


def choose_cuts(summary: AxisSummary, cfg: OuterConfig, profile: RuntimeProfile, budget_bytes: float,
                terms=None, affine=None):
    """Layers per pp rank: the fastest cut (balancing the embedding and head against layers) whose
    every rank fits ``budget_bytes``; if none fits, the cut of least peak memory. Returns
    (cuts, memory-feasible). A lower-bound summary gets the fastest cut regardless of memory (its
    memory is bounded separately in ``evaluate``). ``terms`` / ``affine``: ``_linear_terms`` /
    ``_memory_affine`` of (summary, cfg) when the caller has them already."""
    L, p, v = summary.count, cfg.pp, cfg.v
    if p == 1:
        return (L,), True
    a, e_pre, e_post, rate, act = terms if terms is not None else _linear_terms(summary, cfg, profile)
    holds = [rank_holds(cfg, r) for r in range(p)]
    t_consts = [(e_pre if hp else 0.0) + (e_post if hh else 0.0) for hp, hh in holds]
    fast = balance(L, v, [a] * p, t_consts)
    if summary.is_lower_bound:
        return tuple(fast), True
    ks, cs = affine if affine is not None else _memory_affine(summary, cfg, profile, rate, act)
    if all(k * n + c <= budget_bytes for k, n, c in zip(ks, fast, cs)):
        return tuple(fast), True
    caps = [int(math.floor((budget_bytes - c) / k)) if k > 0 else (L if c <= budget_bytes else -1)
            for k, c in zip(ks, cs)]
    fit = balance(L, v, [a] * p, t_consts, caps)
    if fit is not None:
        return tuple(fit), True
    return tuple(balance(L, v, ks, cs)), False


def _memory_lower_bound_cut(summary: AxisSummary, cfg: OuterConfig, profile: RuntimeProfile,
                            affine=None) -> tuple[int, float]:
    """(rank, layers) whose memory is a lower bound on the peak memory of every cut: each rank
    holds >= v layers, and the least-memory cut's level T satisfies sum_r (T - c_r) / k_r >= L."""
    L, p, v = summary.count, cfg.pp, cfg.v
    if affine is None:
        _, _, _, rate, act = _linear_terms(summary, cfg, profile)
        affine = _memory_affine(summary, cfg, profile, rate, act)
    ks, cs = affine
    if any(k <= 0 for k in ks):
        level = 0.0
    else:
        level = (L + sum(c / k for k, c in zip(ks, cs))) / sum(1 / k for k in ks)
    ns = [max(float(v), (level - c) / k) if k > 0 else float(v) for k, c in zip(ks, cs)]
    r = max(range(p), key=lambda i: ks[i] * ns[i] + cs[i])
    return r, ns[r]


def memory_lower_bound(summary: AxisSummary, cfg: OuterConfig, profile: RuntimeProfile, affine=None) -> MemoryUse:
    """A lower bound on the peak memory per GPU of ``cfg`` over every stage cut (the search's first,
    memory-only bound; ``summary`` is itself a lower bound). ``affine``: ``_memory_affine`` of
    (summary, cfg) when the caller has it already."""
    if cfg.pp == 1:
        r, n = 0, float(summary.count)
    else:
        r, n = _memory_lower_bound_cut(summary, cfg, profile, affine)
    hp, hh = rank_holds(cfg, r)
    parts = rank_parts(summary, n, hp, hh)
    numel = sum(c * q.param_numel for q, c, _ in parts) + (summary.shared_param_numel if (hp or hh) else 0.0)
    mem = _rank_memory(summary, cfg, profile, r, parts, numel, n)   # no prefetch counted: a bound
    if "grads" in cfg.classes and cfg.m == 1:
        # min(G, 2 buckets) is not affine in the layers: leave the gradients out of the bound
        mem = replace(mem, grads_bytes=0, total_bytes=mem.total_bytes - mem.grads_bytes)
    return mem


def shared_core_speedup(cluster: ClusterSpec) -> float:
    """S of the module docstring's "Shared cores" (``ClusterSpec.rank_speedup``; one node), else 1."""
    return cluster.rank_speedup if cluster.nodes == 1 else 1.0


def step_time_lower_bound(summary: AxisSummary, cfg: OuterConfig, cluster: ClusterSpec, profile: RuntimeProfile,
                          terms=None) -> float:
    """A cheap lower bound on ``evaluate(summary, cfg, ...).step.total_s`` (same summary), without
    cutting the layers or evaluating any rank. Proof, term by term of ``evaluate``:

    * total = (m + U) t_max + DP sync + optimizer, and DP sync, optimizer >= 0 (exposed times and
      traffic are never negative), so total >= (m + U) t_max;
    * t_max is the largest ``_rank_eval`` time over the evaluated ranks, which always include the
      slowest rank of the affine model (``slow``). ``_rank_eval``'s time of rank r with n_r layers
      is exactly the affine a n_r + e_r (compute, recompute, TP comm: ``_linear_terms``) plus the
      pipeline p2p (the same 2 v p2p on every rank, pp > 1) plus ZeRO-2/3 comm and the loss's (>= 0);
    * for any cut with n_r >= v and sum_r n_r = L (the cut ``balance`` returns), max_r (a n_r + e_r)
      >= the mean (a L + e_pre + e_post) / pp (the embedding and head each sit on one rank), and
      >= a v + e_r of the rank holding the embedding / the head (both on rank 0 for V schedules).

    The product is scaled by (1 - 1e-9) so that rounding in the different summation order cannot
    lift it above the evaluated value."""
    p, v, L = cfg.pp, cfg.v, summary.count
    if terms is None:
        terms = _linear_terms(summary, cfg, profile)
    a, e_pre, e_post = terms[0], terms[1], terms[2]
    if p == 1:
        t = a * L + e_pre + e_post
        p2p = 0.0
    else:
        mean = (a * L + e_pre + e_post) / p
        if cfg.schedule in V_SCHEDULES:
            ends = a * v + e_pre + e_post
        else:
            ends = a * v + max(e_pre, e_post)
        t = max(mean, ends)
        p2p = 2 * v * collective_s("p2p", summary.layer_input_bytes, 2, stage_link(cluster, cfg.data * cfg.tp))
    share = shared_core_speedup(cluster) if p > 1 else 1.0     # evaluate's pipeline >= (m + U) t_max / share
    return max(0.0, (cfg.m + pipeline_bubble_units(p, cfg.m, cfg.schedule, v)) * (t + p2p) * (1.0 - 1e-9) / share)


# ---- evaluation ------------------------------------------------------------------------------------

def evaluate(summary: AxisSummary, cfg: OuterConfig, cluster: ClusterSpec, profile: RuntimeProfile,
             budget_bytes: float, all_stages: bool = False) -> Evaluation:
    """Step time and memory of ``cfg`` with the cut ``choose_cuts`` picks. Ranks evaluated in full:
    all with ``all_stages``, else the first, the last and the slowest and heaviest by the affine
    model (the others can bind neither). A "partial" configuration without ``recompute_layers``
    gets the fewest recomputed layers per rank that fit (``fit_partial``); on a lower-bound
    summary it stays unset (time without recompute, memory with all of it: both lower bounds)."""
    if cfg.recompute == "partial" and cfg.recompute_layers is None and not summary.is_lower_bound:
        return fit_partial(summary, cfg, cluster, profile, budget_bytes, all_stages)
    p = cfg.pp
    # the affine terms are computed once here and shared with choose_cuts and memory_lower_bound
    # (the same pure functions of (summary, cfg) they would compute themselves)
    terms = affine = None
    if p > 1:
        terms = _linear_terms(summary, cfg, profile)
        affine = _memory_affine(summary, cfg, profile, terms[3], terms[4])
    cuts, _ = choose_cuts(summary, cfg, profile, budget_bytes, terms, affine)
    share = shared_core_speedup(cluster)
    if all_stages or p <= 2 or share > 1:
        ranks = list(range(p))
    else:
        a, e_pre, e_post, rate, act = terms
        ks, cs = affine
        heavy = max(range(p), key=lambda r: ks[r] * cuts[r] + cs[r])
        holds = [rank_holds(cfg, r) for r in range(p)]
        slow = max(range(p), key=lambda r: a * cuts[r] + (e_pre if holds[r][0] else 0) + (e_post if holds[r][1] else 0))
        ranks = sorted({0, p - 1, heavy, slow})
    stages = [_rank_eval(summary, cfg, cluster, profile, r, cuts[r]) for r in ranks]
    if all_stages and p > 1 and not summary.is_lower_bound:
        stages = [_replayed(summary, cfg, cluster, profile, st, cuts) for st in stages]

    bottleneck = max(stages, key=lambda st: st.time_per_microbatch_s)
    t_max = bottleneck.time_per_microbatch_s
    pipeline_s = pipeline_step_time_s(t_max, p, cfg.m, cfg.schedule, cfg.v)      # (m + bubble units) t_max
    bubble_s = pipeline_bubble_fraction(p, cfg.m, cfg.schedule, cfg.v) * cfg.m * t_max
    g = 1.0          # the pipeline's time on shared cores over its time on a core (or device) per rank
    if p > 1 and share > 1 and pipeline_s > 0:
        g = min(1.0, max(cfg.m * sum(st.time_per_microbatch_s for st in stages) / p, pipeline_s / share) / pipeline_s)
    pipeline_s, bubble_s = g * pipeline_s, g * bubble_s
    dp_stage = max(stages, key=lambda st: sum(st.dp_sync.values()))
    opt_s = max(st.optimizer_s for st in stages)
    comm_total: dict = {}
    _merge(comm_total, bottleneck.comm, g * cfg.m)
    _merge(comm_total, dp_stage.dp_sync, 1.0)
    host_s = cluster.gpu.step_overhead_s         # once per step, beside the graph's nodes
    total = pipeline_s + sum(dp_stage.dp_sync.values()) + opt_s + host_s
    step = StepTime(compute_s=g * cfg.m * bottleneck.compute_s, recompute_s=g * cfg.m * bottleneck.recompute_s,
                    comm_s=tuple(sorted(comm_total.items())), bubble_s=bubble_s,
                    optimizer_s=opt_s, total_s=total, host_s=host_s)
    if all_stages:           # the plan's evaluation: how much of each collective is hidden, and why
        over = profile.step_overlapped(cluster, cfg.classes, cfg.zero, cfg.data)
        step = replace(step, overlap=overlap_account(bottleneck, dp_stage, cfg.m, profile, cluster, cfg.data, over))
    heaviest = max(stages, key=lambda st: st.memory.total_bytes).memory
    if summary.is_lower_bound and p > 1:
        heaviest = memory_lower_bound(summary, cfg, profile, affine)
    host_budget = nvme_budget = math.inf
    if cfg.classes:
        # the host and NVMe bytes of the rank that needs most (each ranks' share of a node's)
        heaviest = replace(heaviest, host_bytes=max(st.memory.host_bytes for st in stages),
                           nvme_bytes=max(st.memory.nvme_bytes for st in stages))
        if not summary.is_lower_bound:       # a bound's fastest cut need not bound another cut's host bytes
            host_budget, nvme_budget = host_budgets(cluster)
    return Evaluation(cfg, step, heaviest, tuple(stages), budget_bytes, tuple(cuts), host_budget, nvme_budget)


def _rank_eval(summary: AxisSummary, cfg: OuterConfig, cluster: ClusterSpec, profile: RuntimeProfile,
               r: int, lps: int) -> StageEval:
    gpu = cluster.gpu
    dp_link = axis_link(cluster, (cfg.data, cfg.tp), 0)     # dp x cp ranks sync gradients
    blk = summary.parts["block"]
    first, last = rank_holds(cfg, r)
    parts = rank_parts(summary, lps, first, last)
    compute = sum(c * (p.fwd_compute_s + p.bwd_compute_s) for p, c, _ in parts)
    if cfg.tp > 1:       # the tables price DTensor's 1-D per-node cost; a mesh of more axes costs more
        extra = gpu.node_overhead_s(True, cfg.dtensor_mesh_axes) - gpu.dtensor_op_overhead_s
        compute += extra * sum(c * p.nodes for p, c, _ in parts)
    win_f = sum(c * p.window_fwd_s for p, c, _ in parts)
    win_b = sum(c * p.window_bwd_s for p, c, _ in parts)
    comm: dict = {}
    for p, c, _ in parts:
        _merge(comm, p.comm_fwd, c)
        _merge(comm, p.comm_bwd, c)
    if cfg.recompute in ("full", "partial"):
        k = recomputed_layers(cfg, lps, for_memory=False)
        recompute = k * blk.fwd_compute_s
        _merge(comm, blk.comm_fwd, k)            # the re-run forward repeats its TP comm
    elif is_per_op(cfg.recompute):
        rc = rc_of(blk, cfg.recompute)
        recompute = lps * (blk.core_fwd_s if rc is None else rc.fwd_s)
        if rc is not None:
            _merge(comm, rc.comm_fwd, lps)       # a region's forward collectives are issued again
    else:
        recompute = 0.0
    if cfg.pp > 1:
        # each of the rank's v stages receives its input and sends its output's gradient back
        pp_link = stage_link(cluster, cfg.data * cfg.tp)
        comm["pp:p2p"] = 2 * cfg.v * collective_s("p2p", summary.layer_input_bytes, 2, pp_link)
    numel = sum(c * p.param_numel for p, c, _ in parts) + (summary.shared_param_numel if (first or last) else 0.0)
    groups = gather_group_count(summary, parts, first or last)      # ZeRO-3's (codegen/gather_groups.py)
    param_b = numel * profile.param_bytes
    dp_comm, dp_sync, dp_rows = overlap_dp_sync(cfg, numel, profile, dp_link, win_f, win_b, cluster.overlap_slowdown,
                                                groups, () if summary.is_lower_bound else
                                                grad_pieces(summary, lps, first, last, profile.grad_wire_bytes))
    _merge(comm, dp_comm, 1.0)          # beside the data axis' own resharding (data_axis.py): same keys
    _merge(dp_sync, pipeline_sync_s(cfg, first, last, summary.shared_param_numel, profile, cluster), 1.0)
    if last:                            # the loss's one-value all-reduces over the batch shards
        _merge(comm, {"dp:all_reduce": loss_scalars_s(cfg, summary.loss_scalars, dp_link)}, 1.0)
    copies_over = profile.copies_overlapped(cluster, cfg.data)      # offload's copies on a side stream
    mem = _rank_memory(summary, cfg, profile, r, parts, numel, lps, copies_over)
    compute += memory_pass_s(cfg, numel, profile, gpu)   # gradient copies and adds, ZeRO-3's gather copies
    compute += zero3_host_s(cfg, gpu, groups)            # and its groups' Python
    cls = cfg.classes
    rows, nvme_Bps = optimizer_rows(numel, cfg.data, cfg.zero), cluster.nvme_Bps / cluster.gpus_per_node
    if cls:
        saved = saved_per_microbatch(summary, cfg, parts, lps)
        if "activations" in cls:          # weight copies made again from the weights, not offloaded
            again = recast_per_microbatch(summary, cfg, parts, lps)
            saved -= again                # the cast writes the 16-bit copy and reads the stored weight
            compute += again * (1 + profile.param_bytes / 2) / (gpu.hbm_Bps * gpu.memory_efficiency)
        _merge(comm, offload_microbatch_times(cls, host_params_bytes=param_b / cfg.data if cfg.zero == 3 else param_b,
                                              saved_bytes=saved, forward_window_s=win_f, backward_window_s=win_b,
                                              pcie_Bps=cluster.pcie_Bps, overlapped=copies_over,
                                              nvme_rows_bytes=FP32 * rows, nvme_Bps=nvme_Bps,
                                              nvme_group_bytes=FP32 * largest_group_numel(summary, parts, first or last)
                                              / cfg.data,
                                              saved_largest_bytes=max(p.max_out_bytes for p, _, _ in parts)), 1.0)
    compute, recompute = rank_split_times(cfg, summary, gpu, r, lps, compute, recompute)   # zero-bubble's split
    t_stage = compute + recompute + sum(comm.values())
    opt = numel * (OPTIMIZER_BYTES_PER_PARAM + profile.grad_bytes) / (
        gpu.hbm_Bps * gpu.memory_efficiency * gpu.optimizer_efficiency)
    if cfg.zero >= 1:
        opt /= cfg.data
    if "optimizer" in cls:                   # the CPU step and its traffic replace the device step
        # the disk's time in a forward: nvme_params' rows read, nvme_activations' saved tensors written
        disk_f = (FP32 * rows * ("nvme_params" in cls) + saved * ("nvme_activations" in cls)) / nvme_Bps
        step = offload_step_times(cls, rows=rows, grad_bytes=profile.grad_bytes,
                                  param_bytes=profile.param_bytes, backward_window_s=win_b, pcie_Bps=cluster.pcie_Bps,
                                  host_Bps=cluster.host_Bps, nvme_Bps=nvme_Bps,
                                  moments=MOMENTS, overlap_grads="grads" in copies_over,
                                  step_overlap=(win_f, overlap_first_chunk(numel * cfg.tp, MOMENTS))
                                  if profile.step_overlapped(cluster, cls, cfg.zero, cfg.data) else None,
                                  forward_disk_s=disk_f)
        opt = step.pop("cpu:optimizer")
        _merge(dp_sync, step, 1.0)
    inflight = pipeline_inflight_microbatches(cfg.pp, r, cfg.m, cfg.schedule, cfg.v)
    return StageEval(r, t_stage, compute, recompute, comm, dp_sync, opt, mem, numel, lps, first, last, inflight,
                     tuple(dp_rows))


def _replayed(summary: AxisSummary, cfg: OuterConfig, cluster: ClusterSpec, profile: RuntimeProfile,
              st: StageEval, cuts) -> StageEval:
    """Pipeline rank ``st`` with its peak from its schedule's replay (``step_memory.rank_peak``, what
    ``autopar run --memory`` predicts): the categories' sum the search fits cuts and strategies
    with can fall short of it (interleaved_zb, p=8: the first local stage holds 16 micro-batches at
    the activation peak and the second none, where the sum charges 8 of both; the head's backward
    holds two logits-sized gradients). The plan's evaluation (``evaluate(all_stages=True)``), which
    the search also checks each pipelined plan it would keep against (``search.py``)."""
    shape = RankShape(st.index, st.layers, st.has_pre, st.has_post, st.inflight, st.param_numel,
                      st.memory.activations_bytes, tuple(cuts))
    peak = _peak(summary, cfg, profile, shape, rank_parts(summary, st.layers, st.has_pre, st.has_post),
                 prefetch="activations" in profile.copies_overlapped(cluster, cfg.data))
    return replace(st, memory=replace(st.memory, total_bytes=peak))


def _peak(summary: AxisSummary, cfg: OuterConfig, profile: RuntimeProfile, shape: RankShape, parts,
          prefetch: bool) -> int:
    """``step_memory.rank_peak`` for the states ``profile`` keeps and the planner's AdamW."""
    per = {"params": profile.param_bytes, "grads": profile.grad_bytes, "optimizer": profile.optimizer_bytes}
    return int(rank_peak(summary, cfg, shape, parts, per, autocast=profile.autocast, moments=MOMENTS,
                         prefetch=prefetch, wire=profile.grad_wire_bytes / profile.grad_bytes).peak)


def fit_partial(summary: AxisSummary, cfg: OuterConfig, cluster: ClusterSpec, profile: RuntimeProfile,
                budget_bytes: float, all_stages: bool = False) -> Evaluation:
    """``cfg`` ("partial") with the fewest recomputed layers per pipeline rank that fit the budget:
    below every layer, memory falls and time grows with each layer recomputed, so the fewest that
    fit is the fastest: bisection over 0 .. count - 1. (Every layer, count, adds the workspace of a
    re-materialized layer, ``workspace_bytes``: that is "full", returned when nothing less fits.)"""
    def at(k: int) -> Evaluation:
        return evaluate(summary, replace(cfg, recompute_layers=k), cluster, profile, budget_bytes, all_stages)

    none = at(0)
    if none.fits:                        # nothing to recompute (the "none" configuration's evaluation)
        return none
    lo, hi = 1, max(1, summary.count - 1)
    best = at(hi)
    if not best.fits:
        return at(summary.count)
    while lo < hi:
        mid = (lo + hi) // 2
        ev = at(mid)
        if ev.fits:
            hi, best = mid, ev
        else:
            lo = mid + 1
    return best


def _rank_memory(summary: AxisSummary, cfg: OuterConfig, profile: RuntimeProfile, r: int, parts, numel: float,
                 lps: float, copies_over: tuple = ()) -> MemoryUse:
    states = model_state_bytes(int(numel), cfg.data, cfg.zero, param_bytes=profile.param_bytes,
                               grad_bytes=profile.grad_bytes, optimizer_bytes_per_param=profile.optimizer_bytes,
                               full_grads=reduces_once_per_step(cfg))
    inflight = pipeline_inflight_microbatches(cfg.pp, r, cfg.m, cfg.schedule, cfg.v)
    per_mb = saved_per_microbatch(summary, cfg, parts, lps)
    activations = inflight * per_mb
    largest = max(p.max_out_bytes for p, _, _ in parts)
    other = workspace_bytes(summary, cfg, backward_workspace_bytes(largest), lps,
                            param_bytes=profile.param_bytes, autocast=profile.autocast) \
        + rank_held_bytes(cfg, summary, r, lps)
    host = nvme = 0
    if cfg.classes:
        # activation offload sends every saved tensor to the host (``runtime/offload.py``: all of
        # at least 1 KiB); the backward brings back one node's at a time (``resident_saved_bytes``)
        off = offload_memory(cfg.classes, rows=optimizer_rows(numel, cfg.data, cfg.zero),
                             params_bytes=states["params"], grads_bytes=states["grads"],
                             optimizer_bytes=states["optimizer"], activations_bytes=activations,
                             resident_saved_bytes=resident_saved_bytes(largest, "activations" in copies_over),
                             saved_bytes_per_microbatch=per_mb - recast_per_microbatch(summary, cfg, parts, lps),
                             inflight=inflight, microbatches=cfg.m, moments=MOMENTS,
                             group_bytes=FP32 * largest_group_numel(summary, parts, any(rank_holds(cfg, r))) / cfg.data,
                             share=chunk_share(cfg.tp, cfg.data, cfg.zero), saved_window=largest)
        states = off
        activations = off["activations"]
        host, nvme = int(off["host"]), int(off["nvme"])
    if rank_holds(cfg, r)[1]:
        activations += held_loss_input_bytes(summary, cfg)      # torch's fwd_cache, not a saved tensor
    # (the backward's workspace and gathered layers are gone with the activations at its end)
    other += reducer_transient_bytes(numel * profile.grad_bytes, cfg.data, cfg.zero, bucket_bytes(), activations + other,
                                     accumulates_rows(cfg), profile.grad_wire_bytes / profile.grad_bytes)
    params, grads, optim = (int(states["params"]), int(states["grads"]), int(states["optimizer"]))
    if cfg.pp == 1:         # the categories peak at different moments (``step_memory.py``)
        total = _peak(summary, cfg, profile, RankShape(r, lps, *rank_holds(cfg, r), inflight, numel, activations),
                      parts, prefetch="activations" in copies_over)
    else:                   # a pipeline rank: each category's peak added, the search's measure (a replay
        # per evaluated rank would cost too much there); the plan's own is the replay (``_replayed``)
        total = params + grads + optim + int(activations) + int(other)
    return MemoryUse(params, grads, optim, int(activations), int(other), total, host, nvme)


def default_budget_bytes(cluster: ClusterSpec) -> float:
    return cluster.gpu.hbm_bytes * (1.0 - MEMORY_RESERVE_FRACTION)
