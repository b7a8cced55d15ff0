"""Bad input gets a clear error on EVERY rank, and nothing hangs."""
from __future__ import annotations

import time

import pytest

from autopar.models import build_model
from autopar.runtime.launch import RankFailure, spawn_ranks
from autopar.trace import trace_model
from bodies import BATCH, bad_input_cases, dies_early, stalls
from handplans import hand_plan

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def errors(tiny_full):
    g = tiny_full
    other = build_model("gpt:hidden=32,layers=2,heads=4,vocab=256,seq=32", device="cpu", batch=BATCH)
    other_graph = trace_model(other.module, other.example_inputs, loss_fn=other.loss_fn,
                              example_target=other.example_target)
    dp2 = hand_plan(g, dp=2, tp=1)
    cases = [
        ("world_size", [hand_plan(g, dp=2, tp=2).to_json()] * 2, None, "gpt-tiny"),
        ("other_model", [hand_plan(other_graph, dp=2, tp=1).to_json()] * 2, None, "gpt-tiny"),
        ("different_plans", [dp2.to_json(), hand_plan(g, dp=2, tp=1, zero=1).to_json()], None, "gpt-tiny"),
        ("force_not_dividing", None, {"tp": 3}, "gpt-tiny"),
        ("force_product", None, "dp=1,tp=1,pp=1", "gpt-tiny"),
        ("good_after_bad", [dp2.to_json()] * 2, None, "gpt-tiny"),
    ]
    t0 = time.monotonic()
    out = spawn_ranks(bad_input_cases, 2, (cases,), timeout_s=30)
    return out, time.monotonic() - t0


@pytest.mark.parametrize("case,expect", [
    ("world_size", "WORLD_SIZE(2)"),
    ("other_model", "made for another model"),
    ("different_plans", "ranks hold different plans"),
    ("force_not_dividing", "--force tp=3 does not divide the world size 2"),
    ("force_product", "!= WORLD_SIZE(2)"),
])
def test_every_rank_gets_the_error(errors, case, expect):
    out, _ = errors
    for rank, res in enumerate(out):
        assert expect in res[case], f"rank {rank}: {res[case]}"


def test_world_still_usable_after_errors(errors):
    out, elapsed = errors
    assert all(res["good_after_bad"] == "no error" for res in out)
    assert elapsed < 60


def test_dead_rank_fails_the_run_fast():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="boom: rank 1 failed"):
        spawn_ranks(dies_early, 2, timeout_s=3, grace_s=10)
    assert time.monotonic() - t0 < 25


def test_stuck_rank_times_out_the_others():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn_ranks(stalls, 2, timeout_s=3, grace_s=20)
    msg = str(info.value)
    assert "rank 0" in msg and ("timed out" in msg.lower() or "timeout" in msg.lower()), msg
    assert time.monotonic() - t0 < 25
