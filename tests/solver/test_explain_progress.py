"""explain() answers "why not this placement?" from the solver's own tables; progress is reported."""
import re

from autopar.cost import make_cluster
from autopar.solver import explain, solve

from solver_helpers import mlp_stack_graph


def _result():
    g = mlp_stack_graph(h=1024, layers=4, batch=2, seq=8)
    return solve(g, make_cluster("a100-80g", 1, gpus_per_node=2), global_batch=2, seq_len=None, force="tp=2")


def test_explain_prices_the_alternative():
    r = _result()
    key = "blocks.*.fc1|aten.linear.default|0"
    text = explain(r, key, "R")                                  # replicate the colwise linear
    assert "chosen colwise" in text and "Alternative replicate" in text
    delta_ms = float(re.search(r"Alternative replicate.*?: ([+-][0-9.]+) ms", text).group(1))
    assert delta_ms > 0                                          # more expensive, by the tables' numbers
    assert "Re-optimizing" in text
    assert "is what the plan chose" in explain(r, key, "colwise")
    assert "not a strategy here" in explain(r, key, "S(7)")
    assert "call autopar.solver.solve" in explain(r.plan, key, "R")


def test_progress_callback_reports_stages():
    seen = []
    g = mlp_stack_graph(h=1024, layers=4, batch=2, seq=8)
    solve(g, make_cluster("a100-80g", 1), global_batch=64, seq_len=None,
          progress=lambda stage, done, total: seen.append((stage, done, total)))
    stages = {s for s, _, _ in seen}
    assert stages == {"bounds", "search"}
    assert all(0 <= d <= t for _, d, t in seen)
    assert seen[-1][1] == seen[-1][2]                            # ends complete
