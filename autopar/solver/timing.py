"""Step time and memory of one outer configuration, from a tp-axis solution summary.

Per micro-batch of ``mbs`` sequences, pipeline stage ``s`` (``L/pp`` layers of the repeated block;
the nodes before the block on the first stage, the nodes after it on the last) takes

    t_stage = compute (fwd + bwd) + recompute + exposed TP comm + pipeline p2p + per-micro-batch ZeRO-2/3 comm

with recompute "full" re-running each layer's forward (compute and its TP comm) and "selective"
re-running the attention core's forward. 1F1B / GPipe step time (Megatron §2.2.1):

    T = (m + pp - 1) * max_s t_stage  +  max_s exposed DP sync  +  max_s optimizer step

DP sync (per step, on the dp axis link) by ZeRO stage, each exposed as ``max(0, comm - window)``
when the runtime profile overlaps it (``runtime_profile.py``):
  0: all_reduce(grads)                       window: backward of the last micro-batch
  1: reduce_scatter(grads) + all_gather(params after the step)    windows: last backward / first forward
  2: reduce_scatter(grads) every micro-batch (in t_stage) + all_gather(params)
  3: all_gather(params) fwd and bwd + reduce_scatter(grads), every micro-batch (in t_stage)
Gradients are ``profile.grad_bytes`` per element, parameters 2 bytes (bf16/fp16).

Pipeline p2p: each micro-batch sends its activation forward and its gradient backward across a
stage boundary (one ``layer_input_bytes`` message each way), not overlapped.

Optimizer step (memory bound): per local parameter it reads the 16-bit param, the gradient, the
fp32 master copy and the two Adam moments and writes the param, master and moments back
(``OPTIMIZER_BYTES_PER_PARAM`` + grad bytes), at HBM bandwidth x memory efficiency, divided by dp
under ZeRO >= 1 (each rank updates its shard).

Memory of stage s (``MemoryUse``): model states by ``cost.memory.model_state_bytes`` on the stage's
local (tp-sharded) parameters; activations = in-flight micro-batches (1F1B: ``pp - s``) x the
bytes the stage's ops save per micro-batch (full recompute: each layer's input only; selective:
minus the attention core's intermediates); other = a workspace of the largest single local output
(one transient gradient), plus one layer's re-materialized activations under recompute, plus
``ZERO3_PREFETCH_LAYERS`` layers of gathered parameters under ZeRO-3.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.collectives import axis_link, collective_s, stage_link
from autopar.cost.flops import pipeline_bubble_fraction, pipeline_step_time_s
from autopar.cost.hardware import ClusterSpec
from autopar.cost.memory import model_state_bytes, pipeline_inflight_microbatches
from autopar.plan import MemoryUse, StepTime
from autopar.solver.problem import AxisSummary, PartCost
from autopar.solver.runtime_profile import RuntimeProfile

MEMORY_RESERVE_FRACTION = 0.05       # of HBM kept free for the CUDA context, NCCL buffers, fragmentation
PARAM_BYTES = 2                      # 16-bit parameters
# Adam step traffic per parameter besides the gradient: read param 2 + master 4 + m 4 + v 4,
# write param 2 + master 4 + m 4 + v 4.
OPTIMIZER_BYTES_PER_PARAM = 28
ZERO3_PREFETCH_LAYERS = 2            # gathered layers resident at once under ZeRO-3 (current + prefetch)


@dataclass(frozen=True)
class OuterConfig:
    tp: int
    pp: int
    dp: int
    mbs: int
    m: int                 # micro-batches per step
    recompute: str         # "none" | "selective" | "full"
    zero: int              # 0..3
    sp: bool

    def short(self) -> str:
        return (f"tp={self.tp}, pp={self.pp}, dp={self.dp}, mbs={self.mbs}, zero={self.zero}, "
                f"recompute={self.recompute}, sp={'on' if self.sp else 'off'}")


@dataclass(frozen=True)
class StageEval:
    index: int
    time_per_microbatch_s: float
    compute_s: float
    recompute_s: float
    comm: dict                       # kind -> exposed seconds per micro-batch
    dp_sync: dict                    # kind -> exposed seconds per step
    optimizer_s: float
    memory: MemoryUse
    param_numel: float


@dataclass(frozen=True)
class Evaluation:
    config: OuterConfig
    step: StepTime
    memory: MemoryUse                # the most loaded stage
    stages: tuple                    # StageEval for the first and (if pp > 1) the last stage
    budget_bytes: float

    @property
    def fits(self) -> bool:
        return self.memory.total_bytes <= self.budget_bytes


def _stage_parts(summary: AxisSummary, pp: int, first: bool, last: bool) -> list[tuple[PartCost, float, str]]:
    lps = summary.count // pp
    parts = [(summary.parts["block"], float(lps), "block")]
    if first:
        parts.append((summary.parts["pre"], 1.0, "pre"))
    if last:
        parts.append((summary.parts["post"], 1.0, "post"))
    return parts


def _merge(into: dict, src: dict, scale: float) -> None:
    for k, v in src.items():
        if v:
            into[k] = into.get(k, 0.0) + v * scale


def _exposed(comm_s: float, window_s: float, overlapped: bool) -> float:
    return max(0.0, comm_s - window_s) if overlapped else comm_s


def evaluate(summary: AxisSummary, cfg: OuterConfig, cluster: ClusterSpec, profile: RuntimeProfile,
             budget_bytes: float, all_stages: bool = False) -> Evaluation:
    """Step time and memory of ``cfg``. Only the first and last stages are evaluated unless
    ``all_stages`` (middle stages hold no more layers and fewer in-flight micro-batches than the
    first, so they never bind)."""
    gpu = cluster.gpu
    dp_link = axis_link(cluster, (cfg.dp, cfg.tp), 0)
    pp_link = stage_link(cluster, cfg.dp * cfg.tp)
    blk = summary.parts["block"]
    lps = summary.count // cfg.pp
    stage_ids = list(range(cfg.pp)) if all_stages else ([0] if cfg.pp == 1 else [0, cfg.pp - 1])
    stages = []
    for s in stage_ids:
        first, last = s == 0, s == cfg.pp - 1
        parts = _stage_parts(summary, cfg.pp, first, last)
        compute = sum(c * (p.fwd_compute_s + p.bwd_compute_s) for p, c, _ in parts)
        win_f = sum(c * p.window_fwd_s for p, c, _ in parts)
        win_b = sum(c * p.window_bwd_s for p, c, _ in parts)
        comm: dict = {}
        for p, c, _ in parts:
            _merge(comm, p.comm_fwd, c)
            _merge(comm, p.comm_bwd, c)
        if cfg.recompute == "full":
            recompute = lps * blk.fwd_compute_s
            _merge(comm, blk.comm_fwd, lps)          # the re-run forward repeats its TP comm
        elif cfg.recompute == "selective":
            recompute = lps * blk.core_fwd_s
        else:
            recompute = 0.0
        if cfg.pp > 1:
            comm["pp:p2p"] = 2 * collective_s("p2p", summary.layer_input_bytes, 2, pp_link)
        numel = sum(c * p.param_numel for p, c, _ in parts) + (summary.shared_param_numel if (first or last) else 0.0)
        grad_b = numel * profile.grad_bytes
        param_b = numel * PARAM_BYTES
        dp_sync: dict = {}
        if cfg.dp > 1:
            rs = collective_s("reduce_scatter", grad_b, cfg.dp, dp_link)
            ag = collective_s("all_gather", param_b, cfg.dp, dp_link)
            if cfg.zero == 0:
                dp_sync["dp:all_reduce"] = _exposed(collective_s("all_reduce", grad_b, cfg.dp, dp_link), win_b,
                                                    profile.grad_reduce_overlap)
            elif cfg.zero == 1:
                dp_sync["dp:reduce_scatter"] = _exposed(rs, win_b, profile.grad_reduce_overlap)
                dp_sync["dp:all_gather"] = _exposed(ag, win_f, profile.param_gather_overlap)
            elif cfg.zero == 2:
                comm["dp:reduce_scatter"] = _exposed(rs, win_b, profile.grad_reduce_overlap)
                dp_sync["dp:all_gather"] = _exposed(ag, win_f, profile.param_gather_overlap)
            else:
                # forward gather against the forward; the backward gather and the reduce-scatter
                # share the backward window (exposed time split between them pro rata)
                exp_b = _exposed(ag + rs, win_b, profile.grad_reduce_overlap and profile.param_gather_overlap)
                share = ag / (ag + rs) if ag + rs > 0 else 0.0
                comm["dp:all_gather"] = _exposed(ag, win_f, profile.param_gather_overlap) + exp_b * share
                comm["dp:reduce_scatter"] = exp_b * (1 - share)
        t_stage = compute + recompute + sum(comm.values())
        opt = numel * (OPTIMIZER_BYTES_PER_PARAM + profile.grad_bytes) / (gpu.hbm_Bps * gpu.memory_efficiency)
        if cfg.zero >= 1:
            opt /= cfg.dp
        mem = _stage_memory(summary, cfg, profile, s, parts, numel)
        stages.append(StageEval(s, t_stage, compute, recompute, comm, dp_sync, opt, mem, numel))

    bottleneck = max(stages, key=lambda st: st.time_per_microbatch_s)
    t_max = bottleneck.time_per_microbatch_s
    pipeline_s = pipeline_step_time_s(t_max, cfg.pp, cfg.m)                    # (m + pp - 1) t_max
    bubble_s = pipeline_bubble_fraction(cfg.pp, cfg.m) * cfg.m * t_max        # (pp - 1) t_max
    dp_stage = max(stages, key=lambda st: sum(st.dp_sync.values()))
    opt_s = max(st.optimizer_s for st in stages)
    comm_total: dict = {}
    _merge(comm_total, bottleneck.comm, cfg.m)
    _merge(comm_total, dp_stage.dp_sync, 1.0)
    total = pipeline_s + sum(dp_stage.dp_sync.values()) + opt_s
    step = StepTime(compute_s=cfg.m * bottleneck.compute_s, recompute_s=cfg.m * bottleneck.recompute_s,
                    comm_s=tuple(sorted(comm_total.items())), bubble_s=bubble_s,
                    optimizer_s=opt_s, total_s=total)
    heaviest = max(stages, key=lambda st: st.memory.total_bytes)
    return Evaluation(cfg, step, heaviest.memory, tuple(stages), budget_bytes)


def activation_bytes_per_layer(blk: PartCost, summary: AxisSummary, recompute: str) -> float:
    if recompute == "full":
        return summary.layer_input_bytes
    if recompute == "selective":
        return blk.saved_bytes - blk.core_saved_bytes
    return blk.saved_bytes


def _stage_memory(summary: AxisSummary, cfg: OuterConfig, profile: RuntimeProfile, s: int, parts, numel: float) -> MemoryUse:
    states = model_state_bytes(int(numel), cfg.dp, cfg.zero, param_bytes=PARAM_BYTES, grad_bytes=profile.grad_bytes)
    inflight = pipeline_inflight_microbatches(cfg.pp, s, cfg.m, profile.schedule)
    blk = summary.parts["block"]
    lps = summary.count // cfg.pp
    per_mb = lps * activation_bytes_per_layer(blk, summary, cfg.recompute)
    per_mb += sum(p.saved_bytes for p, _, name in parts if name != "block")
    activations = inflight * per_mb
    other = max(p.max_out_bytes for p, _, _ in parts)
    if cfg.recompute == "full":
        other += blk.saved_bytes
    elif cfg.recompute == "selective":
        other += blk.core_saved_bytes
    if cfg.zero == 3 and cfg.dp > 1:
        other += ZERO3_PREFETCH_LAYERS * blk.param_numel * PARAM_BYTES * (1 - 1 / cfg.dp)
    params, grads, optim = (int(states["params"]), int(states["grads"]), int(states["optimizer"]))
    total = params + grads + optim + int(activations) + int(other)
    return MemoryUse(params, grads, optim, int(activations), int(other), total)


def default_budget_bytes(cluster: ClusterSpec) -> float:
    return cluster.gpu.hbm_bytes * (1.0 - MEMORY_RESERVE_FRACTION)
