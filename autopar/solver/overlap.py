"""Overlap and contention of the step model's collectives: the data-parallel sync of one pipeline
rank (moved here from ``timing.py``) and the per-collective accounting the report prints.

Cost of a collective of time ``C`` beside compute ``W`` (``runtime_profile.py``'s rule, with the
cluster's measured ``overlap_slowdown`` s):

    overlapped:      hidden = min(C, W),  exposed = C - hidden = max(0, C - W),
                     contention = s * hidden,  cost = exposed + contention
    not overlapped:  hidden = 0, exposed = C, contention = 0, cost = C

DP sync by ZeRO stage (windows: ``win_b`` the backward, ``win_f`` the forward of one micro-batch):
  0: all_reduce(grads), per step, beside the last backward (``grad_reduce_overlap``)
  1: reduce_scatter(grads) per step beside the last backward + all_gather(params) per step beside
     the next step's first forward (``param_gather_overlap``)
  2: reduce_scatter every micro-batch beside its backward + all_gather(params) per step
  3: all_gather(params) every micro-batch beside its forward, and again in the backward together
     with the reduce_scatter (both only when both flags hold), the backward window split between
     them pro rata to their times.
Pipelined ZeRO 2/3: the runtime reduces once per step, in each stage's last backward
(``GradReducer.last_backward``), so their reduce_scatter is per step, as ZeRO-1's (ZeRO-3's gathers
stay per micro-batch). With m > 1 the gradients then accumulate in full (``reduces_once_per_step``,
for the memory model).

``account`` turns a rank's rows and exposed times into ``CommOverlap``s (``autopar/comm_overlap.py``)
per "axis:kind", per step; the sum of their ``cost_s`` is the step's communication.
"""
from __future__ import annotations

from typing import Sequence

from autopar.comm_overlap import CommOverlap
from autopar.cost.collectives import (SCALAR_BYTES, all_reduce_s, axis_link, broadcast_s, collective_s,
                                      overlapped_cost)
from autopar.cost.hardware import device_kind
from autopar.mesh import DATA, PIPELINE, TENSOR_AXES
from autopar.solver.grad_buckets import GradPiece, bucketed_overlap

MB, STEP = "mb", "step"      # a row per micro-batch (x m on the slowest rank) or per step

_WHY = {     # reason code -> (overlapped, not overlapped)
    "grad": ("overlapped with the last micro-batch's backward (bucketed reduction)",
             "exposed: the runtime reduces the gradients after the backward"),
    "grad_mb": ("overlapped with each micro-batch's backward (bucketed reduce-scatter)",
                "exposed: the runtime reduce-scatters after each backward"),
    "grad_buckets": ("overlapped with the last micro-batch's backward bucket by bucket; each bucket starts once its "
                     "gradients are complete, the last when the backward ends (solver/grad_buckets.py)", ""),
    "grad_mb_buckets": ("overlapped with each micro-batch's backward bucket by bucket; each bucket starts once its "
                        "gradients are complete, the last when the backward ends (solver/grad_buckets.py)", ""),
    "gather_step": ("overlapped with the next step's first forward (param-gather overlap)",
                    "exposed: the runtime waits for parameter all-gathers after the step (no prefetch)"),
    "gather_fwd": ("prefetched during each micro-batch's forward (ZeRO-3)",
                   "exposed: the runtime waits for parameter all-gathers at each use (no prefetch)"),
    "gather_bwd": ("re-gathers prefetched during each backward, sharing it with the reduce-scatter",
                   "exposed: the backward's re-gathers are waited for (no prefetch)"),
    "rs_z3": ("overlapped with each backward, sharing it with the re-gathers",
              "exposed: ZeRO-3's reduce-scatter is waited for after the backward"),
}


# offload transfers the step model charges whole (``cost/offload.py``): (axis, kind) -> what they are
_CHARGED_IN_FULL = {("nvme", "io"): "the optimizer state read back and written around the CPU step",
                    ("host", "copy"): "the updated masters copied into the host rows after the CPU step"}
# NVMe reads started ahead on the store's threads: (axis, kind) -> what is left exposed
_READ_AHEAD = {("nvme", "params"): "each pass's first gather group's rows (the others are read a group "
                                   "ahead, runtime/nvme_rows.py)",
               ("nvme", "activations"): "the forward's writes and the backward's first read (the others are "
                                        "read ahead, runtime/nvme_activations.py)"}
# copies after the CPU step, beside the next forward where it overlaps it: (axis, kind) -> what they are
_AFTER_STEP = {("host", "h2d"): "the updated rows' copies up", ("host", "copy"): "the masters' copies into the host rows",
               ("nvme", "io"): "the state's reads and writes around it (the NVMe tier's chunks)",
               ("nvme", "grads"): "the gradients' reads (with the writes past the backward, the last bucket's at "
                                  "least)"}
# the pipeline's collectives once a step (``pipeline_sync_s``): kind -> what they carry
_AFTER_SCHEDULE = {"broadcast": "the step's loss, broadcast from the last stage's rank",
                   "all_reduce": "the tied parameters' gradients (embedding and head), summed by the first and the "
                                 "last stage's ranks"}
# NVMe writes on the store's threads behind the backward: (axis, kind) -> what is left exposed
_WRITTEN_BEHIND = {("nvme", "grads"): "the step's reads and the writes past the backward, the last bucket's at "
                                      "least (the others are written as they come down, runtime/nvme_grads.py)"}


def reduces_once_per_step(cfg) -> bool:
    """Pipelined ZeRO 2/3 over data > 1 ranks with several micro-batches: the runtime reduces the
    gradients once per step, in each stage's last backward (``GradReducer.last_backward``), so the
    micro-batches accumulate the full local gradients on the device, not a 1/data shard. Without a
    pipeline every micro-batch reduce-scatters (``GradReducer.each_micro_batch``) and grads / data
    is what stays."""
    return cfg.zero >= 2 and cfg.data > 1 and cfg.m > 1 and cfg.pp > 1


def grad_pass_bytes(cfg, numel: float, grad_bytes: int) -> float:
    """Bytes a rank's gradients move through memory per step beside the backward's GEMMs, on a
    runtime with ``RuntimeProfile.grad_passes`` (``runtime/reducer.py``), for ``numel`` local
    parameter elements: micro-batches after the first add theirs to the gradient (read both, write:
    3 passes); over data > 1 the reducer copies them into its buffer (read, write: 2): a ZeRO-0/1 or
    pipelined plan once per step (its bucket views, its send buffer), a ZeRO-2/3 plan every
    micro-batch it reduce-scatters, whose rows then add up (3 passes over 1/data of them)."""
    m, data = cfg.m, cfg.data
    if data == 1:
        passes = 3.0 * (m - 1)
    elif cfg.zero >= 2 and not cfg.pp > 1:
        passes = 2.0 * m + 3.0 * (m - 1) / data
    else:
        passes = 2.0 + 3.0 * (m - 1)
    return passes * numel * grad_bytes


def gather_pass_bytes(cfg, numel: float, param_bytes: int) -> float:
    """Bytes a rank's ZeRO-3 gathers move through memory per micro-batch beside the passes' GEMMs, on
    a runtime with ``RuntimeProfile.gather_passes`` (``runtime/prefetch.py``), for ``numel`` local
    parameter elements: each gather concatenates the rank's rows into its send buffer (read, write:
    2 passes over 1/data of them) and copies every gathered parameter out of the receive buffer into
    its own storage (read, write: 2 passes over all of them), in the forward and again in the
    backward's re-gathers. 0 without ZeRO-3 over data > 1 ranks."""
    if cfg.zero != 3 or cfg.data <= 1:
        return 0.0
    return 2 * (2.0 + 2.0 / cfg.data) * numel * param_bytes


def memory_pass_s(cfg, numel: float, profile, gpu) -> float:
    """Seconds per micro-batch of the runtime's own passes through memory: ``grad_pass_bytes`` (1/m
    of the step's) and ``gather_pass_bytes``, at HBM bandwidth x memory efficiency; 0 for a runtime
    with neither (``RuntimeProfile.grad_passes``, ``gather_passes``)."""
    nbytes = grad_pass_bytes(cfg, numel, profile.grad_bytes) / cfg.m if profile.grad_passes else 0.0
    if profile.gather_passes:
        nbytes += gather_pass_bytes(cfg, numel, profile.param_bytes)
    return nbytes / (gpu.hbm_Bps * gpu.memory_efficiency)


def zero3_host_s(cfg, gpu, groups: float) -> float:
    """Seconds per micro-batch of the host's work on ``groups`` ZeRO-3 gather groups beside their
    collectives' link time (``GPUSpec.zero3_group_overhead_s``, measured by ``autopar calibrate``
    on CPU ranks); 0 without ZeRO-3 over data > 1."""
    return gpu.zero3_group_overhead_s * groups if cfg.zero == 3 and cfg.data > 1 else 0.0


def loss_scalars_s(cfg, scalars: int, link) -> float:
    """Seconds per micro-batch, on the rank holding the loss, of its ``scalars`` one-value
    all-reduces over the data axis' batch shards (``GraphFacts.loss_scalars``: the loss, the mean's
    count; 4 bytes each; ``collectives.all_reduce_s``: NCCL's tree on GPUs, gloo's ring on CPU
    ranks). Where the data axis is solved (``data_axis.py``) and gathers the batch before the loss,
    none are issued, and the summary it passes gives ``scalars`` = 0 (``solve_data_axis``)."""
    if cfg.data <= 1:
        return 0.0
    return scalars * all_reduce_s(SCALAR_BYTES, cfg.data, link)


def pipeline_sync_s(cfg, first: bool, last: bool, tied_numel: float, profile, cluster) -> dict:
    """Seconds per step of a pipeline rank's collectives after the schedule (``PipelineRunner.step``,
    ``runtime/pipeline.py``; each as ``pipeline_collective_s`` prices it): "pp:broadcast", the step's
    loss (one fp32) from the last stage's rank to every pipeline rank; "pp:all_reduce", on a rank
    holding the first stage or the last but not both (``first``, ``last``; the V schedules put both
    on rank 0), the sum of the tied parameters' gradients (``tied_numel`` local elements: a tied
    embedding and head, at the gradient reduction's bytes) with the other holder. Both wait for the
    other ranks' schedules to end: not overlapped. {} without a pipeline."""
    if cfg.pp <= 1:
        return {}
    ranks = cfg.data * cfg.tp                 # a stage's
    out = {f"{PIPELINE}:broadcast": pipeline_collective_s("broadcast", SCALAR_BYTES, cfg.pp, ranks, cluster)}
    if (first != last) and tied_numel > 0:
        out[f"{PIPELINE}:all_reduce"] = pipeline_collective_s("all_reduce", tied_numel * profile.grad_wire_bytes,
                                                              cfg.pp, ranks, cluster)
    return out


def pipeline_collective_s(kind: str, nbytes: float, pp: int, stage_ranks: int, cluster) -> float:
    """One of ``pipeline_sync_s``'s collectives on the pipeline group's link (its ranks
    ``stage_ranks`` apart: ``axis_link`` over (pp, stage_ranks)): "broadcast" over the pp ranks
    (gloo's binomial tree on CPU ranks, NCCL's ring on GPUs: ``collectives.broadcast_s``),
    "all_reduce" over the tied weight's two holders."""
    link = axis_link(cluster, (pp, stage_ranks), 0)
    if kind == "broadcast":
        return broadcast_s(nbytes, pp, link, binomial=device_kind(cluster) != "cuda")
    if kind == "all_reduce":
        return all_reduce_s(nbytes, 2, link)
    raise ValueError(f"the pipeline issues no {kind!r} after its schedule (broadcast, all_reduce)")


def accumulates_rows(cfg) -> bool:
    """ZeRO 2/3 over data > 1 ranks with several micro-batches and no pipeline: every micro-batch
    reduce-scatters, and each rank adds the rows to the ones of the micro-batches before (the rows
    kept sit beside the last reduction's outputs: ``cost.memory.reducer_end_bytes``)."""
    return cfg.zero >= 2 and cfg.data > 1 and cfg.m > 1 and not reduces_once_per_step(cfg)


def grad_pieces(summary, lps: int, first: bool, last: bool, wire_bytes: int) -> tuple[GradPiece, ...]:
    """A rank's gradients (``summary``: its ``AxisSummary``) in the order its backward makes them
    (``grad_buckets.py``, moved here from ``timing.py``): the head's, its layers' from the last, the
    embedding's (one tensor; with a tied weight's, complete only then), each with the backward
    seconds that make them."""
    blk, pre, post = summary.parts["block"], summary.parts["pre"], summary.parts["post"]
    shared = summary.shared_param_numel if (first or last) else 0.0
    out = []
    if last:
        out.append(GradPiece((post.param_numel + (0.0 if first else shared)) * wire_bytes, post.window_bwd_s))
    if lps:                      # the layers alike: one run at one pace (grad_buckets folds it whole)
        out.append(GradPiece(lps * blk.param_numel * wire_bytes, lps * blk.window_bwd_s))
    if first:
        out.append(GradPiece((pre.param_numel + shared) * wire_bytes, pre.window_bwd_s, atomic=True))
    return tuple(out)


def dp_sync(cfg, numel: float, profile, link, win_f: float, win_b: float, slowdown: float,
            groups: float = 1.0, pieces: Sequence[GradPiece] = ()):
    """(per-micro-batch comm, per-step sync, rows) of one rank's data-parallel traffic: dicts of
    "dp:kind" -> cost seconds, rows ``(per, key, total, window, overlapped, reason, hidden)``.
    ``groups``: the rank's ZeRO-3 gather groups (its layers, the embedding's and the head's
    parameters), one all-gather each per pass: ``(groups - 1) * (dp - 1)`` latencies over one
    collective of the bytes. ``pieces``: the rank's gradients in backward order (bytes on the
    wire, backward seconds: ``grad_buckets.GradPiece``); with them and a profile that has
    buckets, an overlapped gradient reduction is scheduled bucket by bucket
    (``grad_buckets.bucketed_overlap``), else it hides up to its window."""
    comm: dict = {}
    sync: dict = {}
    rows: list = []
    if cfg.data <= 1:
        return comm, sync, rows
    grad_b, param_b = numel * profile.grad_wire_bytes, numel * profile.param_bytes
    go, po = profile.grad_reduce_overlap, profile.param_gather_overlap
    rs = collective_s("reduce_scatter", grad_b, cfg.data, link)
    ag = collective_s("all_gather", param_b, cfg.data, link)
    if cfg.zero == 3:                # a ring's latency per collective beyond the first
        ag += max(0.0, groups - 1) * link.latency_of(cfg.data - 1)

    def reduction(kind: str, per: str, reason: str) -> float:
        """The gradients' reduction: its cost, and its row."""
        total = collective_s(kind, grad_b, cfg.data, link)
        cap, first = profile.grad_bucket_caps(cfg.data)
        if go and cap > 0 and pieces:
            total, hidden, window = bucketed_overlap(pieces, cap, first, lambda b: collective_s(kind, b, cfg.data, link))
            rows.append((per, f"dp:{kind}", total, window, True, reason + "_buckets", hidden))
            return total - hidden + slowdown * hidden
        rows.append((per, f"dp:{kind}", total, win_b, go, reason, min(total, win_b) if go else 0.0))
        return overlapped_cost(total, win_b, go, slowdown)

    if cfg.zero == 0:
        sync["dp:all_reduce"] = reduction("all_reduce", STEP, "grad")
    elif cfg.zero == 1 or (cfg.zero == 2 and reduces_once_per_step(cfg)):
        sync["dp:reduce_scatter"] = reduction("reduce_scatter", STEP, "grad")
    elif cfg.zero == 2:
        comm["dp:reduce_scatter"] = reduction("reduce_scatter", MB, "grad_mb")
    elif cfg.pp > 1:                     # ZeRO-3: gathers per micro-batch, one reduction per step
        # the next group's gather prefetched, in the forward and in the backward's re-gathers
        pz = po or profile.zero3_prefetch
        win_rs = max(0.0, win_b - ag) if pz else win_b     # the last backward's, beside its re-gathers
        comm["dp:all_gather"] = overlapped_cost(ag, win_f, pz, slowdown) + overlapped_cost(ag, win_b, pz, slowdown)
        sync["dp:reduce_scatter"] = overlapped_cost(rs, win_rs, go, slowdown)
        rows += [_row(MB, "dp:all_gather", ag, win_f, pz, "gather_fwd"),
                 _row(MB, "dp:all_gather", ag, win_b, pz, "gather_bwd"),
                 _row(STEP, "dp:reduce_scatter", rs, win_rs, go, "grad")]
    else:
        po_f = po or profile.zero3_prefetch       # the next group's gather is prefetched (both passes)
        both = go and po_f                        # the backward's re-gathers and reduce-scatters hide in it
        exp_b = overlapped_cost(ag + rs, win_b, both, slowdown)
        share = ag / (ag + rs) if ag + rs > 0 else 0.0
        comm["dp:all_gather"] = overlapped_cost(ag, win_f, po_f, slowdown) + exp_b * share
        comm["dp:reduce_scatter"] = exp_b * (1 - share)
        rows += [_row(MB, "dp:all_gather", ag, win_f, po_f, "gather_fwd"),
                 _row(MB, "dp:all_gather", ag, win_b * share, both, "gather_bwd"),
                 _row(MB, "dp:reduce_scatter", rs, win_b * (1 - share), both, "rs_z3")]
    if cfg.zero in (1, 2):              # the updated rows, gathered after the step
        sync["dp:all_gather"] = overlapped_cost(ag, win_f, po, slowdown)
        rows.append(_row(STEP, "dp:all_gather", ag, win_f, po, "gather_step"))
    return comm, sync, rows


def _row(per: str, key: str, total: float, window: float, over: bool, reason: str) -> tuple:
    """An accounting row whose hidden part is ``min(total, window)`` when overlapped."""
    return per, key, total, window, over, reason, min(total, window) if over else 0.0


def _upstream(key: str, profile, copies_over: tuple = (), step_over: bool = False,
              per_microbatch: bool = False) -> tuple[str, bool]:
    """(why, known) of a collective priced before the step model (its exposed time only);
    ``step_over``: the CPU step and the rows' copies after it overlap the next forward;
    ``per_microbatch``: a collective of the micro-batch's passes (not of the step's sync)."""
    axis, _, kind = key.partition(":")
    if axis == DATA and per_microbatch:
        if kind == "all_reduce":
            return ("exposed: the loss and its mean's count, all-reduced as one value each over the batch shards "
                    "(loss_scalars_s), and any activations the data axis moves where an op does not run on them "
                    "(solver/data_axis.py); not overlapped"), True
        return ("exposed: the data axis moves activations where an op does not run on the batch shards "
                "(solver/data_axis.py; not overlapped)"), True
    if step_over and (axis, kind) in _AFTER_STEP:
        return (f"remainder after the CPU step and {_AFTER_STEP[axis, kind]} run chunk by chunk beside the next "
                "forward, the first chunk exposed (runtime/host_step.py, cost/offload.py; hidden part not "
                "carried here)"), False
    if axis == PIPELINE and not per_microbatch and kind in _AFTER_SCHEDULE:
        return f"exposed: {_AFTER_SCHEDULE[kind]}, after the schedule (pipeline_sync_s; not overlapped)", True
    if axis == PIPELINE:
        return "exposed: pipeline sends/receives wait on the neighbouring stage (not overlapped)", True
    if axis in TENSOR_AXES:
        if kind in profile.tp_overlap_kinds:
            return ("remainder after TP comm overlap pipelines it with the adjacent GEMM (max(0, comm - GEMM) "
                    "per edge, solver/problem.py; hidden part and contention not carried here)"), False
        if profile.tp_overlap_kinds:
            return f"exposed: the runtime's TP overlap pipelines only {'/'.join(profile.tp_overlap_kinds)}", True
        return f"exposed: {axis} {kind} is synchronous in this runtime", True
    if axis == "cp":
        if kind == "ring":
            return ("remainder after each ring rotation overlaps one attention block "
                    "(solver/context.py; hidden part not carried here)"), False
        return "exposed: context-parallel all-to-alls are not overlapped", True
    if (axis, kind) in _CHARGED_IN_FULL:
        return f"exposed, charged in full: {_CHARGED_IN_FULL[axis, kind]}", True
    if (axis, kind) in _READ_AHEAD:
        return (f"remainder after the reads ahead hide behind the pass's compute: {_READ_AHEAD[axis, kind]} "
                "(cost/offload.py; hidden part not carried here)"), False
    if (axis, kind) in _WRITTEN_BEHIND:
        return (f"remainder after the writes hide behind the backward: {_WRITTEN_BEHIND[axis, kind]} "
                "(cost/offload.py; hidden part not carried here)"), False
    if axis in ("host", "nvme", "cpu"):
        if copies_over:
            return (f"remainder after the copies of {'/'.join(copies_over)} overlap compute on a side stream "
                    "(cost/offload.py); other classes' copies run on the compute stream"), False
        return "exposed: offload copies run on the compute stream (or a CPU's one memory) here", True
    return "exposed time as priced", False


def account(bottleneck, dp_stage, m: int, profile, cluster, data: int = 1,
            step_over: bool = False) -> tuple[CommOverlap, ...]:
    """The step's ``CommOverlap`` rows: the slowest rank's per-micro-batch collectives x ``m`` and
    the per-step ones of the rank with the most DP sync (the ranks ``timing.evaluate`` charges);
    ``data``: the data-parallel ranks (which offload copies overlap); ``step_over``: the CPU step
    overlaps the next forward (``RuntimeProfile.step_overlapped``)."""
    s = cluster.overlap_slowdown
    acc: dict = {}

    def add(key, total, window, hidden, exposed, contention, why, known):
        a = acc.setdefault(key, [0.0, 0.0, 0.0, 0.0, 0.0, [], True])
        for i, v in enumerate((total, window, hidden, exposed, contention)):
            a[i] += v
        if why not in a[5]:
            a[5].append(why)
        a[6] = a[6] and known

    covered: dict = {}
    for rows, scale, per in ((bottleneck.dp_rows, m, MB), (dp_stage.dp_rows, 1, STEP)):
        for row_per, key, total, window, over, reason, hidden in rows:
            if row_per != per:
                continue
            add(key, total * scale, window * scale if over else 0.0, hidden * scale, (total - hidden) * scale,
                s * hidden * scale, _WHY[reason][0 if over else 1], True)
            covered[(per, key)] = covered.get((per, key), 0.0) + (total - hidden + s * hidden) * scale
    for src, scale, per in ((bottleneck.comm, m, MB), (dp_stage.dp_sync, 1, STEP)):
        for key, v in src.items():
            rest = v * scale - covered.get((per, key), 0.0)
            if rest > 1e-12 * max(1.0, v * scale):
                why, known = _upstream(key, profile, profile.copies_overlapped(cluster, data),
                                       step_over and per == STEP, per == MB)
                add(key, rest, 0.0, 0.0, rest, 0.0, why, known)
    out = []
    for key in sorted(acc):
        total, window, hidden, exposed, contention, whys, known = acc[key]
        why = "; ".join(whys)
        if hidden > 0:
            why += (f"; contention {s:g} x hidden ({cluster.overlap_slowdown_source})" if s > 0 else
                    f"; no contention charged ({cluster.overlap_slowdown_source})")
        axis, _, kind = key.partition(":")
        out.append(CommOverlap(axis, kind, total, window, hidden, exposed, contention, why, known))
    return tuple(out)
