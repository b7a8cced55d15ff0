"""Offload executed (``runtime/offload.py``): optimizer state and step on the host, gradients off
the device as they are reduced, saved activations to the host and back, the optimizer state in
NVMe files. Each plan trains on gloo ranks exactly as the same plan without offload trains: the
same losses, per-step gradients and final parameters as one process within the bounds of
``bodies.py`` (the host step is the same fp32 SGD on the same rows), and the same collectives as
the plan without offload (offload adds copies, not traffic)."""
from __future__ import annotations

import dataclasses
import os

import pytest

from autopar.runtime.launch import spawn_ranks
from bodies import check_against_reference, full_trace, reference, train_jobs
from handplans import hand_plan

pytestmark = pytest.mark.slow

CASES_2 = {            # name: (hand_plan kwargs, offload)
    "dp_zero0": (dict(dp=2, tp=1), "none"),
    "dp_zero0_optimizer_grads": (dict(dp=2, tp=1), "optimizer+grads"),
    "dp_zero1_optimizer_activations": (dict(dp=2, tp=1, zero=1, recompute="selective"), "optimizer+activations"),
    "dp_zero2_optimizer_nvme": (dict(dp=2, tp=1, zero=2), "optimizer+grads+nvme"),
    "dp_zero3_everything": (dict(dp=2, tp=1, zero=3), "optimizer+grads+params+activations+nvme"),
    # two micro-batches, each reduce-scattered: the rows accumulate (on the host for params offload)
    # and go to the host optimizer once, after the last
    "dp_zero2_optimizer_micro_batches": (dict(dp=2, tp=1, zero=2, mbs=1), "optimizer+grads"),
    "dp_zero3_params_micro_batches": (dict(dp=2, tp=1, zero=3, mbs=1), "optimizer+grads+params"),
    # ZeRO-3 over one dp rank: parameter offload alone makes each use fetch the rows
    "tp_sp_params_micro_batches": (dict(dp=1, tp=2, family="megatron_sp", mbs=2), "optimizer+grads+params+activations"),
    "pp_optimizer_activations": (dict(dp=1, tp=1, pp=2, mbs=1), "optimizer+activations"),
    # the parameter rows on NVMe too (ZeRO-Infinity's parameter tier): read from the masters' files
    # at every gather, over two dp ranks and, the rows copied up without a gather, over one
    "dp_zero3_nvme_params_micro_batches": (dict(dp=2, tp=1, zero=3, mbs=1), "optimizer+grads+params+nvme+nvme_params"),
    # ... and the gradients wait for the step in files too (every model state on NVMe)
    "tp_sp_nvme_params": (dict(dp=1, tp=2, family="megatron_sp"),
                          "optimizer+params+activations+nvme+nvme_params+nvme_grads"),
    "dp_zero2_nvme_grads_micro_batches": (dict(dp=2, tp=1, zero=2, mbs=1), "optimizer+grads+nvme+nvme_grads"),
    # the saved activations wait for the backward in files (a pipeline's micro-batches interleaved)
    "pp_nvme_activations": (dict(dp=1, tp=1, pp=2, mbs=1), "activations+nvme_activations"),
}


def _collapsed(rows: int):
    """gpt-tiny traced with its repeated block once: what pipeline plans are made on."""
    from autopar.trace import trace_model
    from bodies import build

    b = build(False, "gpt-tiny", rows)
    return trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                       model_name="gpt-tiny")


def _jobs(graph, cases, nvme_dir):
    jobs = []
    for name, (kw, offload) in cases.items():
        plan = hand_plan(_collapsed(graph.batch_size) if kw.get("pp", 1) > 1 else graph, **kw)
        zero = 3 if "params" in offload else plan.zero_stage
        plan = dataclasses.replace(plan, offload=offload, zero_stage=zero)
        jobs.append({"plan": plan.to_json(), "nvme_dir": nvme_dir, "name": name})
    return jobs


def test_offloaded_plans_train_as_one_process(tmp_path):
    graph = full_trace(4)
    jobs = _jobs(graph, CASES_2, str(tmp_path))
    # fp16 cannot check gradients in files for overflow: refused when built, on every rank
    fp16 = dataclasses.replace(hand_plan(graph, dp=2, tp=1, zero=2), offload="optimizer+nvme+nvme_grads",
                               dtype="float16")
    jobs.append({"plan": fp16.to_json(), "nvme_dir": str(tmp_path), "name": "fp16_nvme_grads", "expect_error": True})
    results = spawn_ranks(train_jobs, 2, args=(jobs,), timeout_s=60)
    errors = [r.pop()["error"] for r in results]
    jobs.pop()
    assert all(e.startswith("ValueError: offload nvme_grads") and "--dtype bf16" in e for e in errors), errors
    ref = reference(False)
    bad = []
    for i, job in enumerate(jobs):
        try:
            check_against_reference([r[i] for r in results], ref)
        except AssertionError as e:
            bad.append(f"{job['name']}: {e}")
    assert not bad, "\n".join(bad)
    by_name = {job["name"]: i for i, job in enumerate(jobs)}
    base = by_name["dp_zero0"]
    for rank_results in results:           # offload moves nothing between ranks
        assert rank_results[by_name["dp_zero0_optimizer_grads"]]["issued"] == rank_results[base]["issued"]
    assert os.listdir(tmp_path) == [], "the NVMe files outlive the run"
    # one dp rank with its rows on the host: each layer's rows are copied up a group ahead, in the
    # forward and in the backward's re-gathers (``runtime/prefetch.py``, ZeRO-Infinity's prefetch)
    for rank_results in results:
        res = rank_results[by_name["tp_sp_params_micro_batches"]]
        regathered, prefetched, dropped = res["regathers"]
        assert res["ahead"] > 0 and prefetched > 0 and dropped == 0, (res["ahead"], res["regathers"])
    # nvme_params: no rows held in memory, every gather read them from the files: at least once per
    # parameter per micro-batch's forward (and per full tensor the test asks for), their fp32 bytes
    for rank_results in results:
        for name in ("dp_zero3_nvme_params_micro_batches", "tp_sp_nvme_params"):
            res = rank_results[by_name[name]]
            reads, nbytes, ahead = res["nvme_rows"]
            held = res["held_bytes"]
            base = rank_results[by_name["dp_zero3_params_micro_batches" if name.startswith("dp") else
                                        "tp_sp_params_micro_batches"]]
            rows = sum(local for local, _ in base["local"].values())
            assert held == 0 and reads >= len(res["local"]) * 3 and nbytes >= rows * 4 * 3, (name, held, reads, nbytes)
            # read a group ahead of their gather, but for each pass's first group, the tied weight
            # (gathered alone) and the full tensors the test asks for (measured: 252 of 310 reads, 126 of 169)
            assert ahead > reads / 2, (name, ahead, reads)
        assert rank_results[by_name["dp_zero3_nvme_params_micro_batches"]]["issued"] == \
            rank_results[by_name["dp_zero3_params_micro_batches"]]["issued"]
    # nvme_grads: each step's gradient rows went to the files (4 bytes per optimizer row per step)
    for rank_results in results:
        for name in ("tp_sp_nvme_params", "dp_zero2_nvme_grads_micro_batches"):
            res = rank_results[by_name[name]]
            assert res["grads_written"] == 3 * 4 * res["opt_rows"], (name, res["grads_written"], res["opt_rows"])
    # nvme_activations: what the plan without it sends to the host went to the files, and came back
    # read back ahead of their unpack: on the last stage, whose backward follows each micro-batch's
    # forward, most (measured 156 of 168); on the first, under 1F1B, the latest packed are often the
    # next micro-batch's (``ActivationOffload._prefetch``; measured 39 of 132)
    for rank, rank_results in enumerate(results):
        written, read, ahead, unpacked = rank_results[by_name["pp_nvme_activations"]]["acts_nvme"]
        assert written > 0 and read >= written and ahead > 0, (written, read, ahead)
        assert rank == 0 or ahead >= unpacked / 2, (ahead, unpacked)
