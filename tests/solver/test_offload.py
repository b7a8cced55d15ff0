"""The planner chooses CPU / NVMe offload only when nothing fits the GPUs without it."""
from dataclasses import replace

import pytest

from autopar.cost.hardware import make_cluster
from autopar.plan import Plan
from autopar.solver import plan_model
from autopar.solver.errors import InfeasibleError, PlanningError
from autopar.solver.forcing import parse_force
from autopar.solver.timing import HOST_MEMORY_RESERVE_FRACTION
from solver_helpers import traced

GPT_10B = "gpt:hidden=4096,layers=50,heads=32"      # ZeRO-Offload's 10B GPT-2 (50 layers, h=4096, 32 heads)
V100_32G = 32e9 * 0.95                               # one 32 GB V100 less the planner's reserve
SMALL = "gpt2"


def _one_v100(**host):
    return replace(make_cluster("v100", 1, gpus_per_node=1), **host)


def _small(force=None, budget=None):
    g, _ = traced(SMALL)
    return plan_model(g, make_cluster("a100-80g", 1), global_batch=64, seq_len=1024, force=force,
                      memory_budget_bytes=budget)


def _strip(d):
    return {k: v for k, v in d.items() if k not in ("solve_time_s", "summary", "forced", "notes")}


def test_fits_without_offload_plans_none_as_before():
    free = _small()
    assert free.offload == "none" and free.memory.host_bytes == 0 and free.memory.nvme_bytes == 0
    assert "host_bytes" not in free.to_dict()["memory"]           # old readers see the old file
    assert _strip(free.to_dict()) == _strip(_small(force="offload=none").to_dict())


def test_ten_billion_on_one_32g_v100_needs_optimizer_offload():
    """ZeRO-Offload (parallelism_facts.md §4.1): a 10-13B GPT trains on one 32 GB V100."""
    g, _ = traced(GPT_10B)
    with pytest.raises(InfeasibleError, match="needs >="):
        plan_model(g, _one_v100(), global_batch=8, seq_len=1024, memory_budget_bytes=V100_32G, force="offload=none")
    plan = plan_model(g, _one_v100(), global_batch=8, seq_len=1024, memory_budget_bytes=V100_32G)
    classes = plan.offload.split("+")
    assert "optimizer" in classes and plan.memory.optimizer_bytes == 0
    assert plan.memory.total_bytes <= V100_32G
    # 10.3e9 params x 16 B (fp32 master, 2 moments, grad buffer) on the host, within 512 GB x 0.9
    assert plan.memory.host_bytes >= 16 * 10e9
    assert plan.memory.host_bytes <= plan.cluster.host_budget_bytes
    assert plan.cluster.host_budget_bytes == pytest.approx(512e9 * (1 - HOST_MEMORY_RESERVE_FRACTION), rel=1e-6)
    assert plan.step_time.optimizer_s > 1.0                        # the CPU step: 10e9 x 28 B at 15 GB/s
    assert Plan.from_dict(plan.to_dict()) == plan                  # the new fields round-trip and validate


def test_tiny_host_memory_is_infeasible_naming_the_host_budget():
    g, _ = traced(GPT_10B)
    # every model state on NVMe, the host still holds a gather's rows (a layer's 0.8 GB) and the step's chunks
    with pytest.raises(InfeasibleError, match="host budget") as e:
        plan_model(g, _one_v100(host_memory_bytes=0.2e9), global_batch=8, seq_len=1024, memory_budget_bytes=V100_32G)
    assert "--host-memory-gb" in str(e.value)


def test_parameter_rows_and_gradients_go_to_nvme_when_the_host_cannot_hold_them():
    """ZeRO-Infinity (parallelism_facts.md §4.2): the 10B GPT on one 32 GB V100 with 32 GB of host
    memory. The device needs the parameters off it (ZeRO-3 with params offload); neither their 41 GB
    of fp32 rows nor the 41 GB of fp32 gradients fit the host, so both stay in NVMe files (the rows
    in the masters', nvme_params, read twice per micro-batch a group ahead of their gathers;
    nvme_grads)."""
    g, _ = traced(GPT_10B)
    cluster = _one_v100(host_memory_bytes=32e9, nvme_bytes=2e12)
    kw = dict(global_batch=8, seq_len=1024, memory_budget_bytes=V100_32G)
    plan = plan_model(g, cluster, **kw)
    classes = set(plan.offload.split("+"))
    assert {"params", "nvme", "nvme_params", "nvme_grads"} <= classes and plan.zero_stage == 3
    assert plan.memory.total_bytes <= V100_32G and plan.memory.host_bytes <= plan.cluster.host_budget_bytes
    for on_host in ("nvme_params", "nvme_grads"):
        with pytest.raises(InfeasibleError, match="host budget"):
            plan_model(g, cluster, force="zero=3,offload=" + "+".join(sorted(classes - {on_host})), **kw)
    comm = dict(plan.step_time.comm_s)
    # fp32 rows, read for the forward's gathers and the backward's, per micro-batch, at the node's
    # NVMe bandwidth (one GPU per node), a group ahead: 1.47 s a pass (10.3e9 x 4 / 28e9), hidden
    # behind the pass's compute; exposed, each pass's first group, at most the largest: 2 x 4 x G x m /
    # nvme_Bps, G the tied embedding's 50,257 x 4,096 = 205.9e6 rows (a layer's: 201.4e6)
    per_param = 2 * 4 * plan.num_micro_batches / cluster.nvme_Bps
    assert 201e6 < comm["nvme:params"] / per_param < 206e6
    assert "host:h2d" not in comm and "host:copy" not in comm       # the updated rows stay in the files


def test_saved_activations_go_to_nvme_rather_than_recompute():
    """With 64 GB of host memory the same GPT's saved activations do not all fit beside the
    gradients; in NVMe files (nvme_activations) they cost a write and a read at the node's NVMe
    bandwidth, less than recomputing: no layer recomputes, a faster step than the best plan that
    keeps them in host memory."""
    g, _ = traced(GPT_10B)
    cluster = _one_v100(host_memory_bytes=64e9, nvme_bytes=2e12)
    kw = dict(global_batch=8, seq_len=1024, memory_budget_bytes=V100_32G)
    plan = plan_model(g, cluster, **kw)
    assert "nvme_activations" in plan.offload.split("+") and plan.recompute == "none"
    on_host = plan_model(g, cluster, force="zero=3,offload=" + plan.offload.replace("+nvme_activations", ""), **kw)
    assert on_host.recompute != "none" and plan.step_time.total_s < on_host.step_time.total_s
    assert on_host.memory.host_bytes <= plan.cluster.host_budget_bytes
    assert dict(plan.step_time.comm_s)["nvme:activations"] > 0


def test_forced_optimizer_and_activations_offload():
    pins = "tp=1,pp=1,dp=8,mbs=8,zero=1,recompute=none"
    base = _small(force=pins)
    plan = _small(force=pins + ",offload=activations+optimizer")
    assert plan.offload == "optimizer+activations" and ("offload", "optimizer+activations") in plan.forced
    # the device keeps the largest saved tensor while the rest is on the host, twice (the node's own
    # and the next one, prefetched on the side stream): the loss's fp32 copy of one micro-batch's
    # bf16 logits (autocast runs cross-entropy in fp32), 8 x 1024 x 50,257 x 4 B
    assert plan.memory.activations_bytes == 2 * 8 * 1024 * 50257 * 4 < base.memory.activations_bytes
    assert plan.memory.optimizer_bytes == 0 and plan.memory.host_bytes > 0
    kinds = dict(plan.step_time.comm_s)
    assert "host:h2d" in kinds and plan.step_time.total_s >= base.step_time.total_s
    assert Plan.from_dict(plan.to_dict()) == plan


def test_side_stream_copies_hide_in_their_windows_on_gpus():
    """autopar's runtime copies saved activations on a side stream on GPUs: the forward's copies
    down and the backward's up cost only what exceeds that pass's compute (``cost/offload.py``);
    on the compute stream (a runtime profile without ``host_copy_overlap``) they cost in full."""
    from autopar.solver import AUTOPAR_RUNTIME

    g, _ = traced(SMALL)
    pins = "tp=1,pp=1,dp=8,mbs=8,zero=1,recompute=none,offload=activations"

    def plan(runtime):
        return plan_model(g, make_cluster("a100-80g", 1), global_batch=64, seq_len=1024, force=pins,
                          runtime=runtime)

    side, compute = plan(AUTOPAR_RUNTIME), plan(replace(AUTOPAR_RUNTIME, host_copy_overlap=()))
    s, c = dict(side.step_time.comm_s), dict(compute.step_time.comm_s)
    assert 0 < s["host:d2h"] < c["host:d2h"] and 0 < s["host:h2d"] < c["host:h2d"]
    # the windows are the passes' compute: the side stream saves at most the forward and backward
    hidden = c["host:d2h"] + c["host:h2d"] - s["host:d2h"] - s["host:h2d"]
    assert hidden <= compute.step_time.compute_s + 1e-9
    assert side.step_time.total_s < compute.step_time.total_s
    why = {o.axis + ":" + o.kind: o.why for o in side.step_time.overlap}
    assert "side stream" in why["host:d2h"] and "compute stream" in {
        o.axis + ":" + o.kind: o.why for o in compute.step_time.overlap}["host:d2h"]


def test_forced_params_offload_pins_zero3_or_says_why():
    plan = _small(force="tp=1,pp=1,dp=8,mbs=8,recompute=none,offload=optimizer+params")
    assert plan.zero_stage == 3 and plan.memory.params_bytes == 0
    with pytest.raises(PlanningError, match="needs ZeRO-3"):
        _small(force="zero=1,offload=optimizer+params")


def test_offload_parse_errors_say_what_to_write():
    with pytest.raises(ValueError, match="write optimizer\\+grads"):
        parse_force("offload=grads")
    with pytest.raises(ValueError, match="unknown class 'gpu'"):
        parse_force("offload=gpu")
    assert parse_force("offload=activations+optimizer").offload == "optimizer+activations"


def test_resident_weight_copies_are_recast_not_offloaded(monkeypatch):
    """Under autocast a matmul saves a 16-bit copy of its weight; activation offload makes it again
    from the resident weight in the backward (``runtime/activation_offload.cast_of_resident``), so it crosses
    PCIe only where the weight is gathered (ZeRO-3 over dp > 1). On the compute stream every copy
    is exposed: the two plans' d2h differ by exactly the copies' bytes over PCIe, counted here from
    the model's Linear weights (the tied head once), 2 bytes each; and the resident plan pays the
    casts (4 bytes read, 2 written per element) in its compute."""
    import torch

    from autopar.models import build_model
    from autopar.solver import AUTOPAR_RUNTIME

    g, _ = traced(SMALL)
    cluster = make_cluster("a100-80g", 1)

    def plan(zero):
        return plan_model(g, cluster, global_batch=64, seq_len=1024, dtype="bfloat16",
                          force=f"tp=1,pp=1,dp=8,mbs=8,zero={zero},recompute=none,offload=activations",
                          runtime=replace(AUTOPAR_RUNTIME, host_copy_overlap=()))

    resident, gathered = plan(1), plan(3)
    weights = {id(m.weight): m.weight.numel() for m in build_model(SMALL, device="meta").module.modules()
               if isinstance(m, torch.nn.Linear)}
    copies = 2.0 * sum(weights.values())
    d2h = {p: dict(p.step_time.comm_s)["host:d2h"] for p in (resident, gathered)}
    assert (d2h[gathered] - d2h[resident]) * cluster.pcie_Bps == pytest.approx(copies, rel=1e-9)
    # the same resident plan priced as if the copies were offloaded: d2h up by them, the casts gone
    monkeypatch.setattr("autopar.solver.timing.recast_per_microbatch", lambda *a, **k: 0.0)
    sent = plan(1)
    assert (dict(sent.step_time.comm_s)["host:d2h"] - d2h[resident]) * cluster.pcie_Bps == pytest.approx(copies)
    gpu = cluster.gpu
    cast = 3.0 * copies / (gpu.hbm_Bps * gpu.memory_efficiency)
    assert resident.step_time.compute_s - sent.step_time.compute_s == pytest.approx(cast)


def test_offload_variants_without_an_nvme_budget_have_no_nvme_tier():
    """The search evaluates each variant: without NVMe it skips the tiers that could never fit
    (ZeRO-3 over dp=2: 9 variants in host memory; 50 with the NVMe tiers, none repeated: activations
    alone 2, with optimizer offload and no nvme 2 x 2 x (1 + 2), with nvme 2 x (2 + 4 + 4 + 8))."""
    from autopar.solver.offload_choice import offload_variants
    from autopar.solver.outer_config import OuterConfig

    cfg = OuterConfig(tp=1, pp=1, dp=2, mbs=2, m=1, recompute="full", zero=3, sp=False)
    every, host = offload_variants(cfg), offload_variants(cfg, nvme=False)
    assert len({c.offload for c in every}) == len(every) == 50
    assert len(host) == 9 and not any("nvme" in c.offload for c in host)
    assert {c.offload for c in host} <= {c.offload for c in every}



def test_the_cpu_step_is_priced_beside_the_next_forward_where_the_runtime_overlaps_it():
    """``runtime/host_step.py``: on GPUs autopar's runtime steps the offloaded optimizer chunk by
    chunk while the next forward runs, unless a collective follows the step (ZeRO-1/2 over dp > 1);
    the planner charges the first chunk and what the first micro-batch's forward does not cover."""
    from autopar.solver import AUTOPAR_RUNTIME

    g, _ = traced(SMALL)
    kw = dict(global_batch=64, seq_len=1024)
    cluster = make_cluster("a100-80g", 1)
    sync = replace(AUTOPAR_RUNTIME, host_step_overlap=False)
    for force, overlaps in (("dp=8,zero=0,offload=optimizer+grads", True), ("dp=8,zero=3,offload=optimizer", True),
                            ("dp=8,zero=1,offload=optimizer", False)):
        over = plan_model(g, cluster, force=force, **kw)
        after = plan_model(g, cluster, force=force, runtime=sync, **kw)
        if overlaps:
            assert over.step_time.optimizer_s < after.step_time.optimizer_s, force
        else:
            assert over.step_time == after.step_time, force
        assert over.step_time.total_s - after.step_time.total_s == pytest.approx(
            over.step_time.optimizer_s - after.step_time.optimizer_s
            + sum(dict(over.step_time.comm_s).values()) - sum(dict(after.step_time.comm_s).values()), abs=1e-9)
        assert any("beside the next step's forward" in n for n in over.notes) == overlaps, force
