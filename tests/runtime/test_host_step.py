"""The offloaded optimizer's host step overlapped with the next forward (``runtime/host_step.py``):
the same arithmetic as the step taken at once, so each plan trains bit for bit as with
``host_step="sync"`` and as one process within ``bodies.py``'s bounds; the overlap really ran
(chunks still being stepped when ``pm.step`` returned, parameter reads that waited for theirs);
where it cannot run (a collective beside the step) ``host_step="overlap"`` is refused naming why;
a step failing on its thread fails the next ``pm.step`` on every rank, no rank waiting."""
from __future__ import annotations

import dataclasses

import pytest

from autopar.runtime.launch import spawn_ranks
from bodies import check_against_reference, full_trace, reference, train_jobs
from handplans import hand_plan

pytestmark = pytest.mark.slow

PAUSE_S = 0.05         # per optimizer call (a chunk): the next forward starts before the step ends

CASES = {              # name: (hand_plan kwargs, offload)
    "dp_zero0_optimizer_grads": (dict(dp=2, tp=1), "optimizer+grads"),
    # ZeRO-3's rows are the masters, stepped in place: each group's gather (and its prefetch of
    # the next) waits for the rows it sends
    "dp_zero3_params_micro_batches": (dict(dp=2, tp=1, zero=3, mbs=1), "optimizer+grads+params"),
    # one dp rank: the rows copied up a group ahead on the side stream's path
    "tp_sp_params_activations": (dict(dp=1, tp=2, family="megatron_sp"), "optimizer+grads+params+activations"),
    # ZeRO-3's rows on the device, stepped on the host and copied up before each gather
    "dp_zero3_optimizer": (dict(dp=2, tp=1, zero=3), "optimizer+grads"),
    # each stage's optimizer on its own rank, its forward waiting while the other stage's runs
    "pp_optimizer_activations": (dict(dp=1, tp=1, pp=2, mbs=1), "optimizer+activations"),
    # the NVMe tier: the chunks read, stepped and written back on the thread, the gradients read
    # from their files
    "dp_nvme_grads": (dict(dp=2, tp=1), "optimizer+grads+nvme+nvme_grads"),
    # the files are the rows: each gather reads them after its chunk is written (the reads a group
    # ahead only for chunks already written)
    "dp_zero3_nvme_params_micro_batches": (dict(dp=2, tp=1, zero=3, mbs=1), "optimizer+grads+params+nvme+nvme_params"),
}


def _jobs(graph, nvme_dir):
    from test_offload_runtime import _collapsed

    jobs = []
    for name, (kw, offload) in CASES.items():
        plan = hand_plan(_collapsed(graph.batch_size) if kw.get("pp", 1) > 1 else graph, **kw)
        plan = dataclasses.replace(plan, offload=offload, zero_stage=3 if "params" in offload else plan.zero_stage)
        for mode in ("overlap", "sync"):
            jobs.append({"plan": plan.to_json(), "name": f"{name}/{mode}", "host_step": mode, "pause_s": PAUSE_S,
                         "nvme_dir": nvme_dir})
    return jobs


def test_overlapped_host_step_trains_as_the_step_at_once(tmp_path):
    graph = full_trace(4)
    jobs = _jobs(graph, str(tmp_path))
    # a scheduler changing the learning rate as pm.step returns: the step running on takes the rate
    # it was started with (the next step the new one), as stepping at once does
    sched = dataclasses.replace(hand_plan(graph, dp=2, tp=1), offload="optimizer")
    for mode in ("overlap", "sync"):
        jobs.append({"plan": sched.to_json(), "name": f"scheduler/{mode}", "host_step": mode, "pause_s": PAUSE_S,
                     "scheduler": True})
    zero1 = dataclasses.replace(hand_plan(graph, dp=2, tp=1, zero=1), offload="optimizer")
    jobs.append({"plan": zero1.to_json(), "name": "zero1", "host_step": "overlap", "expect_error": True})
    failing = dataclasses.replace(hand_plan(graph, dp=2, tp=1), offload="optimizer")
    jobs.append({"plan": failing.to_json(), "name": "failing", "host_step": "overlap", "pause_s": 0.0,
                 "fail_at": 3, "expect_step_error": True})
    results = spawn_ranks(train_jobs, 2, args=(jobs,), timeout_s=120)
    ref = reference(False)
    by_name = {job["name"]: i for i, job in enumerate(jobs)}
    for r, rank_results in enumerate(results):
        err = rank_results[by_name["zero1"]]["error"]
        assert err.startswith("ValueError: host_step='overlap'") and "ZeRO-1 all-gathers" in err \
            and "host_step='sync'" in err, err
        # the optimizer's third call raises on the thread of the first step (8 chunks, one call
        # each): the second pm.step says so on every rank
        fail = rank_results[by_name["failing"]]
        assert fail["steps"] == 1 and "optimizer step on the host" in fail["error"] \
            and "failing at call 3" in fail["error"], (r, fail)
    for rank_results in results:
        a, b = rank_results[by_name["scheduler/overlap"]], rank_results[by_name["scheduler/sync"]]
        assert a["losses"] == b["losses"] and a["overlap"][0] >= 2, (a["losses"], b["losses"], a["overlap"])
    sd_a, sd_b = results[0][by_name["scheduler/overlap"]]["sd"], results[0][by_name["scheduler/sync"]]["sd"]
    assert all((sd_a[k] == sd_b[k]).all() for k in sd_b), "the scheduler's rate reached a step started before it"
    bad = []
    for name in CASES:
        over, sync = by_name[f"{name}/overlap"], by_name[f"{name}/sync"]
        try:
            check_against_reference([rr[over] for rr in results], ref)
        except AssertionError as e:
            bad.append(f"{name}: {e}")
        for r, rank_results in enumerate(results):
            a, b = rank_results[over], rank_results[sync]
            assert a["losses"] == b["losses"] and a["issued"] == b["issued"], (name, r)
            assert b["overlap"] is None
            behind, waited = a["overlap"]
            # two steps overlapped the next forward (the third is waited for by full_state_dict):
            # chunks were left to step when pm.step returned, and parameter reads waited for them
            # (not on a pipeline's last stage, whose step ends while it waits for the first's sends)
            assert behind >= 2 and (waited >= 2 or (name.startswith("pp") and r == 1)), (name, r, behind, waited)
        sd_a, sd_b = results[0][over]["sd"], results[0][sync]["sd"]
        assert all((sd_a[k] == sd_b[k]).all() for k in sd_b), name
    assert not bad, "\n".join(bad)
