"""Search quality: the free plan is never slower than any forced configuration of the same problem
(the branch and bound must not prune the optimum), and bounds are bounds."""
import functools

from hypothesis import HealthCheck, assume, given, settings, strategies as st

from autopar.cost import make_cluster
from autopar.solver import PlanningError, plan_model, solve
from autopar.solver.problem import lower_bound_summary
from autopar.solver.timing import OuterConfig, evaluate

from solver_helpers import traced

MODEL = "gpt:hidden=512,layers=4,heads=8,vocab=8192,seq=512"
CLUSTER = make_cluster("h100", 1)
BATCH = 64


@functools.lru_cache(maxsize=None)
def free_result(budget):
    g, b = traced(MODEL)
    return solve(g, CLUSTER, global_batch=BATCH, seq_len=b.seq_len, memory_budget_bytes=budget)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4]), zero=st.sampled_from([0, 1, 3]),
       rc=st.sampled_from(["none", "selective", "full"]), mbs=st.sampled_from([1, 2, 4]), sp=st.booleans(),
       budget=st.sampled_from([None, 3e9]))
def test_free_plan_never_slower_than_forced(tp, pp, zero, rc, mbs, sp, budget):
    assume(not (sp and tp == 1))
    g, b = traced(MODEL)
    force = f"tp={tp},pp={pp},zero={zero},recompute={rc},mbs={mbs},sp={'on' if sp else 'off'}"
    try:
        forced = plan_model(g, CLUSTER, global_batch=BATCH, seq_len=b.seq_len, force=force, memory_budget_bytes=budget)
    except PlanningError:
        assume(False)
    free = free_result(budget).plan
    assert free.step_time.total_s <= forced.step_time.total_s * (1 + 1e-9)


def test_lower_bounds_are_below_exact_evaluations():
    r = free_result(None)
    g, b = traced(MODEL)
    searcher_tabs = r.solution.tables
    lb = lower_bound_summary(searcher_tabs)
    for pp in (1, 2, 4):
        for rc in ("none", "selective", "full"):
            for zero in (0, 1, 3):
                cfg = OuterConfig(searcher_tabs.t, pp, 8 // (searcher_tabs.t * pp) or 1, searcher_tabs.mbs,
                                  max(pp, 4), rc, zero, searcher_tabs.sp)
                if cfg.tp * cfg.pp * cfg.dp != 8:
                    continue
                lo = evaluate(lb, cfg, CLUSTER, r.profile, r.budget_bytes)
                ex = evaluate(r.solution.summary, cfg, CLUSTER, r.profile, r.budget_bytes)
                assert lo.step.total_s <= ex.step.total_s * (1 + 1e-12)
                assert lo.memory.total_bytes <= ex.memory.total_bytes


def test_cheap_step_time_bound_is_below_the_table_bound_for_every_schedule():
    """The search queues configurations by ``step_time_lower_bound`` before evaluating them on the
    lower-bound tables; it must never exceed that evaluation (nor the exact one)."""
    from autopar.solver.timing import step_time_lower_bound
    r = free_result(None)
    tabs = r.solution.tables
    lb = lower_bound_summary(tabs)
    for pp, sched, v in ((1, "1f1b", 1), (2, "1f1b", 1), (2, "gpipe", 1), (2, "interleaved_1f1b", 2),
                         (2, "zbv", 2), (4, "1f1b", 1), (2, "interleaved_zb", 2)):
        dp = 8 // (tabs.t * pp)
        if dp < 1:
            continue
        for rc in ("none", "selective", "full"):
            for zero in (0, 2, 3):
                cfg = OuterConfig(tabs.t, pp, dp, tabs.mbs, max(2 * pp, 4), rc, zero, tabs.sp, sched, v)
                cheap = step_time_lower_bound(lb, cfg, CLUSTER, r.profile)
                lo = evaluate(lb, cfg, CLUSTER, r.profile, r.budget_bytes)
                ex = evaluate(r.solution.summary, cfg, CLUSTER, r.profile, r.budget_bytes)
                assert 0 < cheap <= lo.step.total_s, (cfg, cheap, lo.step.total_s)
                assert step_time_lower_bound(r.solution.summary, cfg, CLUSTER, r.profile) <= ex.step.total_s
