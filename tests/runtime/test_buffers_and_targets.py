"""Buffers a forward mutates, the random-ops warning, and autoparallelize without example_target,
on 2 gloo ranks against one process (``buffer_bodies.py``).

BatchNorm2d / BatchNorm1d running statistics and ``num_batches_tracked``, a cache written with
``copy_`` and a counter (``+= 1``) must equal one process after 3 SGD steps, under dp=2, tp=2 and
the free plan, with and without recompute, and so must the eval-mode forward that reads them: on
the emitted modules, and twice on the interpreter.
Every plan here computes BatchNorm's batch statistics over the GLOBAL batch (the solver has no
sharding rule for batch_norm: its input is gathered on dp, replicated on tp), which is what one
process computes on the same global batch.

Tolerance 1e-5 (absolute; values are O(1)): fp32 with SGD, whose update is linear in the gradient,
so the only differences are the reduction orders of sharded matmuls and all-reduces (~1e-7 per
op, observed <= 2e-7 here). The bugs these tests guard show as 1e-2..1e-1 differences in the
running statistics and as integer differences in the counters (compared exactly).
"""
from __future__ import annotations

import pytest
import torch

from autopar.runtime.launch import spawn_ranks
from buffer_bodies import STEPS, all_jobs, reference

pytestmark = pytest.mark.slow

TOL = 1e-5

BN_JOBS = {
    "dp2": dict(force="dp=2"),
    "tp2": dict(force="tp=2"),
    "free": dict(force=None),
    "tp2_recompute_full": dict(force="tp=2,recompute=full"),
    "dp2_recompute_full": dict(force="dp=2,recompute=full"),
    "free_deferred": dict(force=None, deferred=True),
    "tp2_deferred": dict(force="tp=2", deferred=True),
    # the emitted modules run the cases above (``emit_runtime.write_back``, ``recompute(written=)``);
    # the interpreter's write-back twice
    "dp2_interpreter": dict(force="dp=2", engine="interpreter"),
    "tp2_recompute_full_interpreter": dict(force="tp=2,recompute=full", engine="interpreter"),
}
DROPOUT_PS = (0.1, 0.0)


@pytest.fixture(scope="module")
def ranks():
    per_rank = spawn_ranks(all_jobs, 2, (list(BN_JOBS.values()), list(DROPOUT_PS)), timeout_s=120)
    return {"bn": {name: [per_rank[r]["bn"][i] for r in range(2)] for i, name in enumerate(BN_JOBS)},
            "warnings": [per_rank[r]["warnings"] for r in range(2)]}


@pytest.fixture(scope="module")
def ref():
    return reference()


def _ok(res: dict, where: str) -> dict:
    assert "error" not in res, f"{where}: {res['error']}"
    return res


def _check_state(got: dict, want: dict, where: str) -> None:
    assert set(got) == set(want), f"{where}: names differ: {sorted(set(got) ^ set(want))}"
    for k, w in want.items():
        g = got[k]
        if w.is_floating_point():
            d = (g.float() - w.float()).abs().max().item()
            assert d <= TOL, f"{where}: {k} differs by {d:.3e}: {g.flatten()[:4]} vs {w.flatten()[:4]}"
        else:                                   # num_batches_tracked, counters: exact
            assert torch.equal(g, w), f"{where}: {k} is {g.tolist()}, one process {w.tolist()}"


@pytest.mark.parametrize("name", list(BN_JOBS))
def test_buffers_match_one_process(name, ranks, ref):
    results = [_ok(res, f"{name}, rank {r}") for r, res in enumerate(ranks["bn"][name])]
    spec = BN_JOBS[name]
    top = results[0]
    assert all(r["engine"] == spec.get("engine", "emitted") for r in results), (name, top["engine"], top["reason"])
    if spec["force"]:                                     # the plan is the one forced
        degrees = dict(kv.split("=") for kv in spec["force"].split(","))
        assert top["dims"] == (int(degrees.get("dp", 1)), int(degrees.get("tp", 1)))
        if degrees.get("recompute") == "full":
            assert top["recompute"] == "full" and top["regions"] >= 2    # the BatchNorm1d blocks
    for r, res in enumerate(results):
        assert len(res["losses"]) == STEPS
        for got, want in zip(res["losses"], ref["losses"]):
            assert abs(got - want) <= TOL, f"rank {r}: losses {res['losses']} vs one process {ref['losses']}"
    # parameters and EVERY buffer (running_mean, running_var, num_batches_tracked, last, calls)
    _check_state(top["state"], ref["state"], name)
    assert int(top["state"]["bn2d.num_batches_tracked"]) == STEPS
    d = (top["eval_out"] - ref["eval_out"]).abs().max().item()
    assert d <= TOL, f"{name}: eval-mode forward differs by {d:.3e}"


@pytest.mark.parametrize("name", ["free_deferred", "tp2_deferred"])
def test_without_example_target(name, ranks):
    """Built on the first step from its targets: the same numbers as the eager build (the same
    plan and program, so bit for bit); pm(inputs) before that step is a clear error."""
    eager = _ok(ranks["bn"][name.removesuffix("_deferred")][0], "eager build")
    for r, res in enumerate(ranks["bn"][name]):
        _ok(res, f"{name}, rank {r}")
        assert "first pm.step(inputs, targets)" in res["early_call"], res["early_call"]
        assert res["dims"] == eager["dims"]
        assert res["losses"] == eager["losses"], f"rank {r}: {res['losses']} vs eager {eager['losses']}"
    top = ranks["bn"][name][0]
    for k, v in eager["state"].items():
        assert torch.equal(top["state"][k], v), k
    assert torch.equal(top["eval_out"], eager["eval_out"])


def test_random_ops_warn_once(ranks):
    """Dropout p=0.1: one RandomOpsWarning per ParallelModel (setup, 2 steps and forwards in
    train and eval mode: three traced graphs); p=0 draws nothing: no warning."""
    for r, counts in enumerate(ranks["warnings"]):
        for c in counts:
            assert not isinstance(c, dict), f"rank {r}: {c}"
        assert dict(zip(DROPOUT_PS, counts)) == {0.1: 1, 0.0: 0}, f"rank {r}: {counts}"


def test_random_ops_skip_attention_and_dropout_that_draw_nothing():
    """SDPA carries ATen's nondeterministic_seeded tag whatever its dropout_p: only p > 0 counts."""
    import torch
    import torch.nn.functional as F

    from autopar.trace.random_ops import random_ops

    class Attn(torch.nn.Module):
        def __init__(self, p):
            super().__init__()
            self.p = p

        def forward(self, q):
            return F.dropout(F.scaled_dot_product_attention(q, q, q, dropout_p=self.p), self.p).sum()

    q = torch.randn(1, 2, 4, 8)
    assert random_ops(torch.export.export(Attn(0.0), (q,), strict=False).graph_module.graph) == {}
    assert random_ops(torch.export.export(Attn(0.1), (q,), strict=False).graph_module.graph) == {
        "scaled_dot_product_attention.default": 1, "dropout.default": 1}


def test_idle_forced_axis_warns_and_planning_errors_keep_their_class():
    """A forced tp that the solver leaves all-replicated (gpt-tiny on the CPU cluster) is an
    IdleAxisWarning on rank 0 (silence elsewhere); a planning error raised on rank 0 is raised as
    the same class on every rank, so ``except PlanningError`` works everywhere."""
    from buffer_bodies import plan_outcome_job

    out = spawn_ranks(plan_outcome_job, 2, ("gpt-tiny", "tp=2"), timeout_s=60)
    assert len(out[0]["idle"]) == 1 and "tp axis" in out[0]["idle"][0] and out[1]["idle"] == []
    assert out[0]["where"] == ["buffer_bodies.py"]      # the caller's autoparallelize line, not autopar's
    out = spawn_ranks(plan_outcome_job, 2, ("gpt:hidden=32,layers=2,heads=1,vocab=64,seq=16", "tp=2"), timeout_s=60)
    assert [o["error"] for o in out] == ["PlanningError"] * 2
    assert out[0]["message"].startswith("planning failed on rank 0: PlanningError: tp=2 does not divide")
