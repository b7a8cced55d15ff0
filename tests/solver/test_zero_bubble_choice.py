"""The zero-bubble schedules in the free search: the split backward's cost terms
(``cost/split_backward.py``) worked by hand, the free plan choosing them where the model says
they win (a large GPT on GPUs, few micro-batches) and not where host overhead dominates (a tiny
GPT on the cpu cluster with a measured per-node overhead), and never with a recompute region
that issues collectives (the runtime refuses those: ``plan.split_backward_problem``)."""
import dataclasses
import math
from types import SimpleNamespace

import pytest

from autopar.cost import make_cluster
from autopar.cost.split_backward import (HOST_NODES_PER_PARAM_TENSOR, pending_weight_chunks, rank_held_bytes,
                                         rank_split_times, split_held_bytes, split_host_s, split_layers,
                                         split_recompute_replays)
from autopar.plan import ZERO_BUBBLE_SCHEDULES, plan_problems, split_backward_problem
from autopar.solver import plan_model
from autopar.solver.configs import outer_configs
from autopar.solver.forcing import Force

from solver_helpers import traced

BIG = "gpt:hidden=1024,layers=16,heads=16,vocab=8192,seq=1024"
TINY = "gpt:hidden=64,layers=8,heads=4,vocab=256,seq=32"
H100 = make_cluster("h100", 1)
# the cpu cluster (2 gloo ranks) with a measured host cost per graph node: 60 us plain, 240 us
# DTensor (the order ``autopar calibrate`` finds on a CPU; uncalibrated clusters have 0)
_CPU = make_cluster("cpu", 1, gpus_per_node=2)
CPU_MEASURED = dataclasses.replace(_CPU, gpu=dataclasses.replace(_CPU.gpu, op_overhead_s=60e-6,
                                                                  dtensor_op_overhead_s=240e-6))


# ---- the cost terms, by hand ----------------------------------------------------------------------

def test_split_layers_skip_stage_zero():
    # stage 0 runs one full backward: rank 0 of zbv (stages 0 and 2p-1) splits only its second stage
    assert split_layers("zbv", 0, 6, 2) == 6 - 3
    assert split_layers("interleaved_zb", 0, 8, 4) == 8 - 2          # stages 0, p, 2p, 3p: 3 of 4 split
    assert split_layers("interleaved_zb", 1, 8, 4) == 8
    assert split_layers("dualpipev", 3, 5, 2) == 5
    assert split_layers("1f1b", 1, 8, 1) == 0 and split_layers("interleaved_1f1b", 1, 8, 2) == 0


def test_host_and_replay_terms_by_hand():
    assert HOST_NODES_PER_PARAM_TENSOR == 1.0
    # 12 parameter tensors (a GPT layer) at 60 us per node: one node's host cost each
    assert split_host_s(12, 60e-6) == pytest.approx(12 * 60e-6)
    assert split_host_s(12, 0.0) == 0.0                     # uncalibrated GPUs: no host term
    # a recomputed layer is one checkpoint region: replayed once per weight-pass group (<= tensors)
    assert split_recompute_replays("full", 12) == 12
    assert split_recompute_replays("partial", 9) == 9
    assert split_recompute_replays("selective", 12) == 0            # the attention core holds no parameter
    assert split_recompute_replays("ops:attention+norm", 12) == 2   # a norm and the projection it feeds
    assert split_recompute_replays("ops:mlp_act", 12) == 2
    assert split_recompute_replays("none", 12) == 0


def test_rank_times_by_hand():
    # zbv, pp=2: rank 0 holds stage 0 (2 of its 4 layers, full backward) and the last stage (2
    # layers + the head: 3 tensors + 1 tied) -> 2 * 12 + 3 + 1 = 28 tensors split, at 100 us each
    from dataclasses import replace

    from autopar.cost.hardware import get_gpu

    cfg = SimpleNamespace(schedule="zbv", pp=2, v=2, m=4, tp=1, recompute="full", dtensor_mesh_axes=1)
    summary = SimpleNamespace(parts={"block": SimpleNamespace(param_tensors=12.0),
                                     "post": SimpleNamespace(param_tensors=3.0, max_out_bytes=0.0)},
                              shared_param_tensors=1.0, layer_input_bytes=0.0)
    gpu = replace(get_gpu("h100"), op_overhead_s=1e-4, dtensor_op_overhead_s=5e-4, dtensor_2d_op_overhead_s=9e-4)
    compute, recompute = rank_split_times(cfg, summary, gpu, 0, 4, 0.010, 0.004)
    assert compute == pytest.approx(0.010 + 28 * 1e-4)
    # recompute 0.004 s (4 layers x 1 ms); the 2 split layers replay 12 more times each: + 2 * 12 ms
    assert recompute == pytest.approx(0.004 + 2 * 12 * 0.001)
    # rank 1 (stages 1 and 2): 4 layers, all split, no head; under tp the DTensor overhead
    tp2 = SimpleNamespace(**{**vars(cfg), "tp": 2, "recompute": "none"})
    compute, recompute = rank_split_times(tp2, summary, gpu, 1, 4, 0.010, 0.0)
    assert compute == pytest.approx(0.010 + 4 * 12 * 5e-4) and recompute == 0.0
    # the same over a dp x tp mesh: DTensor's 2-D figure
    tp2_dp2 = SimpleNamespace(**{**vars(tp2), "dtensor_mesh_axes": 2})
    assert rank_split_times(tp2_dp2, summary, gpu, 1, 4, 0.010, 0.0)[0] == pytest.approx(0.010 + 4 * 12 * 9e-4)
    # not a zero-bubble schedule: unchanged
    one = SimpleNamespace(**{**vars(cfg), "schedule": "1f1b", "v": 1})
    assert rank_split_times(one, summary, gpu, 0, 4, 0.010, 0.004) == (0.010, 0.004)


def test_pending_weight_chunks_by_hand():
    assert [pending_weight_chunks("interleaved_zb", 4, r, 8) for r in range(4)] == [1, 2, 3, 4]     # r + 1
    assert [pending_weight_chunks("zbv", 4, r, 8) for r in range(4)] == [1, 3, 5, 7]                # 2r + 1
    assert [pending_weight_chunks("zbv", 4, r, 5) for r in range(4)] == [1, 3, 3, 3]                # 2(m-p) + 1
    assert [pending_weight_chunks("zbv", 4, r, 4) for r in range(4)] == [1, 1, 1, 1]
    assert pending_weight_chunks("dualpipev", 4, 1, 8) == 2
    assert pending_weight_chunks("1f1b", 4, 1, 8) == 0 and pending_weight_chunks("interleaved_1f1b", 4, 1, 8) == 0


def _torch_pending(cls_name: str, p: int, v: int, m: int) -> list[int]:
    """Max over torch 2.13's action list of (input passes done - weight passes done) per rank,
    stage 0 excluded (it runs a full backward in its W slot)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.schedules import _ComputationType as CT
    cls = getattr(schedules, cls_name)
    o = cls.__new__(cls)
    o.pp_group_size, o.n_local_stages, o._n_microbatches = p, v, m
    o.num_stages = o._num_stages = p * v
    o.number_of_rounds = max(1, m // p)
    o.microbatches_per_round = m // o.number_of_rounds
    out = []
    for r in range(p):
        o.rank = r
        cur = best = 0
        for a in o._calculate_single_rank_operations(r):
            for x in ((a.sub_actions if a.computation_type == CT.OVERLAP_F_B else [a]) if a is not None else []):
                if x.stage_index == 0:
                    continue
                cur += {CT.BACKWARD_INPUT: 1, CT.BACKWARD_WEIGHT: -1}.get(x.computation_type, 0)
                best = max(best, cur)
        out.append(best)
    return out


@pytest.mark.parametrize("name,cls_name,p,v,m", [
    ("interleaved_zb", "ScheduleInterleavedZeroBubble", 4, 2, 8),
    ("interleaved_zb", "ScheduleInterleavedZeroBubble", 3, 3, 4),
    ("zbv", "ScheduleZBVZeroBubble", 4, 2, 8),
    ("zbv", "ScheduleZBVZeroBubble", 4, 2, 4),
    ("zbv", "ScheduleZBVZeroBubble", 6, 2, 9),           # m < 2p - 1: an upper bound
    ("dualpipev", "ScheduleDualPipeV", 4, 2, 8),
])
def test_pending_chunks_bound_torch_action_lists(name, cls_name, p, v, m):
    torch_max = _torch_pending(cls_name, p, v, m)
    ours = [pending_weight_chunks(name, p, r, m) for r in range(p)]
    assert all(t <= o for t, o in zip(torch_max, ours))
    if name != "zbv" or m >= 2 * p - 1:
        assert torch_max == ours                          # exact


def test_held_bytes_by_hand():
    # zbv p=4 m=8, rank 3: 7 pending chunks of 6 / 2 layers, 12 join gradients of 1 MB per layer
    assert split_held_bytes("zbv", 4, 3, 8, 2, 6, 12, 1e6) == pytest.approx(7 * 3 * 12e6)
    # rank 0 holds the head (V): 1 chunk of 3 layers + ceil(1 / 2) = 1 head gradient of 5 MB
    assert split_held_bytes("zbv", 4, 0, 8, 2, 6, 12, 1e6, 5e6) == pytest.approx(36e6 + 5e6)
    # interleaved_zb p=4 v=4 rank 3 (last stage): 4 chunks of 8 / 4 layers, ceil(4 / 4) = 1 head
    assert split_held_bytes("interleaved_zb", 4, 3, 8, 4, 8, 12, 1e6, 5e6) == pytest.approx(4 * 2 * 12e6 + 5e6)
    assert split_held_bytes("interleaved_1f1b", 4, 3, 8, 4, 8, 12, 1e6, 5e6) == 0.0
    cfg = SimpleNamespace(schedule="zbv", pp=4, v=2, m=8, tp=1, recompute="none")
    summary = SimpleNamespace(parts={"block": SimpleNamespace(param_tensors=12.0),
                                     "post": SimpleNamespace(param_tensors=3.0, max_out_bytes=5e6)},
                              shared_param_tensors=1.0, layer_input_bytes=1e6)
    assert rank_held_bytes(cfg, summary, 0, 6) == pytest.approx(41e6)
    assert rank_held_bytes(cfg, summary, 3, 6) == pytest.approx(7 * 3 * 12e6)     # no head on rank 3


def test_evaluation_charges_the_split(monkeypatch):
    """A forced zbv plan's rank time grows by exactly the hand-counted host term: rank 1 (stages 1
    and 6, only layers) splits every layer, each reading 12 parameter tensors (this GPT's block)."""
    import autopar.cost.split_backward as sb
    g, _ = traced(BIG)
    o = 1e-4
    slow = dataclasses.replace(H100, gpu=dataclasses.replace(H100.gpu, op_overhead_s=o))
    force = "tp=1,pp=4,dp=2,mbs=1,zero=1,recompute=none,schedule=zbv"
    plan = plan_model(g, slow, global_batch=8, seq_len=1024, force=force)
    monkeypatch.setattr(sb, "HOST_NODES_PER_PARAM_TENSOR", 0.0)
    base = plan_model(g, slow, global_batch=8, seq_len=1024, force=force)
    rank1 = [s for s in plan.stages if s.index in (1, 6)]
    assert [(s.first_layer, s.last_layer) for s in rank1] == \
        [(s.first_layer, s.last_layer) for s in base.stages if s.index in (1, 6)]
    layers = sum(s.last_layer - s.first_layer for s in rank1)
    grow = sum(s.time_per_microbatch_s for s in rank1) - sum(s.time_per_microbatch_s for s in base.stages
                                                             if s.index in (1, 6))
    assert grow == pytest.approx(layers * 12 * o, rel=1e-6)


# ---- the free choice ------------------------------------------------------------------------------

def _is_clean(plan) -> bool:
    return not plan_problems(plan) and split_backward_problem(
        plan.pipeline_schedule, plan.recompute, plan.tp, plan.context_parallel, plan.dp, plan.zero_stage,
        plan.offload) is None


def test_free_search_offers_zero_bubble_but_not_dualpipev():
    configs = outer_configs(Force(), 8, 16, True, 16)
    scheds = {(c.schedule, c.v) for c in configs if c.pp == 4}
    assert {("interleaved_zb", 2), ("interleaved_zb", 4), ("zbv", 2)} <= scheds
    assert {("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("1f1b", 1)} <= scheds
    assert not any(s == "dualpipev" for s, _ in scheds)
    assert any(c.schedule == "dualpipev" for c in outer_configs(Force(schedule="dualpipev"), 8, 16, True, 16))
    # zbv needs 2 stages of >= 1 layer per rank: not with pp=8 on 8 layers
    assert not any(c.schedule == "zbv" for c in outer_configs(Force(pp=8), 8, 8, True, 16))


@pytest.mark.parametrize("offload_free", [False, True])
def test_free_configs_never_pair_zero_bubble_with_refused_recompute(offload_free):
    """Every configuration listed passes the runtime's check, also with the params offload the
    offload pass may add to ZeRO-3 later (``offload_choice.offload_variants``)."""
    seen = set()
    for c in outer_configs(Force(), 8, 16, True, 16, offload_free=offload_free):
        if c.schedule not in ZERO_BUBBLE_SCHEDULES:
            continue
        seen.add((c.recompute, c.tp > 1, c.zero))
        off = "optimizer+params" if c.zero == 3 else "none"
        assert split_backward_problem(c.schedule, c.recompute, c.tp, c.cp, c.dp, c.zero, off) is None, c
    assert ("none", True, 0) in seen and ("full", False, 0) in seen      # both kinds still offered


def test_large_gpt_few_micro_batches_picks_zero_bubble():
    g, _ = traced(BIG)
    plan = plan_model(g, H100, global_batch=8, seq_len=1024, force="pp=4")
    assert plan.num_micro_batches <= 2 * plan.pp
    assert plan.pipeline_schedule in ("interleaved_zb", "zbv") and _is_clean(plan)
    for other in ("1f1b", "interleaved_1f1b"):
        forced = plan_model(g, H100, global_batch=8, seq_len=1024, force=f"pp=4,schedule={other}")
        assert plan.step_time.total_s < forced.step_time.total_s
        assert plan.step_time.bubble_s < forced.step_time.bubble_s


@pytest.mark.parametrize("batch", [2, 4])
def test_tiny_model_on_cpu_with_host_overhead_keeps_one_f_one_b_family(batch):
    """hidden 64 on 2 gloo ranks: the split's host time outweighs the bubble it saves (the README's
    measured zero-bubble windows were 1.1-1.7x 1F1B's there)."""
    g, _ = traced(TINY)
    force = "pp=2,dp=1,tp=1,mbs=1"
    plan = plan_model(g, CPU_MEASURED, global_batch=batch, seq_len=32, dtype="float32", force=force)
    assert plan.pipeline_schedule not in ZERO_BUBBLE_SCHEDULES
    one = plan_model(g, CPU_MEASURED, global_batch=batch, seq_len=32, dtype="float32", force=force + ",schedule=1f1b")
    zbv = plan_model(g, CPU_MEASURED, global_batch=batch, seq_len=32, dtype="float32", force=force + ",schedule=zbv")
    assert 1.0 < zbv.step_time.total_s / one.step_time.total_s < 1.7
    assert zbv.step_time.bubble_s < one.step_time.bubble_s           # the bubble alone would favour it


@pytest.mark.parametrize("force,budget,recomputes", [
    ("pp=2", 1.2e9, True),                 # memory binds: recompute
    ("pp=4,tp=2", 0.6e9, True),            # recompute under tp: its regions issue collectives
    ("pp=8,tp=1", 0.5e9, True),            # nothing fits the GPU: the offload pass (ZeRO-3 on one data rank)
    ("pp=4,recompute=none", None, False),
])
def test_free_plans_never_run_refused_zero_bubble(force, budget, recomputes):
    g, _ = traced(BIG)
    plan = plan_model(g, H100, global_batch=16, seq_len=1024, force=force, memory_budget_bytes=budget)
    assert (plan.recompute != "none") == recomputes
    assert _is_clean(plan), (plan.pipeline_schedule, plan.recompute, plan.tp, plan.zero_stage, plan.offload)
    if plan.pipeline_schedule in ZERO_BUBBLE_SCHEDULES and plan.recompute != "none":
        assert plan.tp == 1 and plan.context_parallel == 1
    assert math.isfinite(plan.step_time.total_s)
