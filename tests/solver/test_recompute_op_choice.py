"""Per-operator recompute in the solver (``autopar/recompute_ops.py``, ``solver/op_classes.py``):
the vocabulary and ``--force`` syntax, the plan's JSON, "selective" = attention only, and a
hand-worked budget where the search's choice is the fastest recompute that fits, by brute force
over every subset of the op classes (and full / partial) on gpt-tiny."""
from __future__ import annotations

import itertools
import json

import pytest

from autopar.cost import make_cluster
from autopar.plan import Plan
from autopar.recompute_ops import OP_CLASSES, canonical_recompute, recompute_classes, recompute_name
from autopar.solver import solve
from autopar.solver.errors import PlanningError
from autopar.solver.forcing import parse_force
from autopar.solver.op_classes import all_op_sets
from autopar.solver.strategies import graph_facts

from solver_helpers import traced

FORCE = "dp=2,tp=1,pp=1,mbs=4,zero=0"


@pytest.fixture(scope="module")
def tiny():
    g, _ = traced("gpt-tiny", batch=8)
    return g


def _solve(g, recompute=None, budget=None):
    force = FORCE + (f",recompute={recompute}" if recompute else "")
    return solve(g, make_cluster("a100-80g", 1, 2), global_batch=8, seq_len=None, dtype="float32",
                 memory_budget_bytes=budget, force=parse_force(force)).plan


def test_vocabulary_and_force_syntax():
    assert parse_force("recompute=ops:norm+attention").recompute == "ops:attention+norm"
    assert parse_force("recompute=ops:attention").recompute == "selective"      # the alias
    assert parse_force("recompute=ops:").recompute == "none"
    assert parse_force("recompute=partial").recompute == "partial"
    assert recompute_classes("selective") == ("attention",) and recompute_classes("full") is None
    assert recompute_name(["mlp_act", "attention"]) == "ops:attention+mlp_act"
    with pytest.raises(ValueError) as e:
        parse_force("recompute=ops:attention+attn")
    msg = str(e.value)
    assert "\n" not in msg and "'attn'" in msg and all(c in msg for c in OP_CLASSES)
    with pytest.raises(ValueError, match="named twice"):
        canonical_recompute("ops:norm+norm")


def test_selective_is_attention_only(tiny):
    sets = all_op_sets(graph_facts(tiny, None))
    sel = sets["selective"]
    assert sel.classes == ("attention",)
    assert sel.regions and all(kind == "attention" for kind, _ in sel.regions)
    targets = {tiny.nodes[[n.key for n in tiny.nodes].index(k)].target for _, ks in sel.regions for k in ks}
    assert targets == {"aten.scaled_dot_product_attention.default"}


def test_plan_json_round_trip(tiny):
    plan = _solve(tiny, "ops:attention+mlp_act")
    assert plan.recompute == "ops:attention+mlp_act"
    assert plan.step_time.recompute_s > 0
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.summary()["recompute"] == "ops:attention+mlp_act"
    js = json.loads(plan.to_json())
    js["recompute"] = "ops:mlp_act+attention"          # not canonical: refused
    with pytest.raises(ValueError, match="recompute"):
        Plan.from_json(json.dumps(js))


def test_missing_class_is_a_planning_error():
    g, _ = traced("llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16", batch=8)
    with pytest.raises(PlanningError, match="no norm ops.*attention, mlp_act"):
        solve(g, make_cluster("a100-80g", 1, 2), global_batch=8, seq_len=None, dtype="float32",
              force=parse_force(FORCE + ",recompute=ops:norm"))


def test_budget_picks_the_fastest_set_that_fits(tiny):
    """Every subset of the classes (and full, partial) priced alone; a budget between them; the
    search (recompute free) returns the fastest that fits, with its time and memory."""
    names = [recompute_name(cs) for n in range(len(OP_CLASSES) + 1) for cs in itertools.combinations(OP_CLASSES, n)]
    priced = {rc: _solve(tiny, rc) for rc in dict.fromkeys(names + ["full"])}
    mem = {rc: p.memory.total_bytes for rc, p in priced.items()}
    time_ = {rc: p.step_time.total_s for rc, p in priced.items()}
    # memory falls as classes are added that drop bytes; time grows with what they re-run
    assert mem["ops:attention+mlp_act+norm"] < mem["ops:mlp_act"] < mem["none"]
    assert time_["none"] < time_["ops:mlp_act"] < time_["ops:mlp_act+norm"]
    leaner = sorted({m for m in mem.values() if m < mem["none"]})
    for budget in leaner[-2:]:                        # the two leanest-but-one budgets that bind
        fits = [rc for rc in priced if mem[rc] <= budget]
        want = min(fits, key=lambda rc: (time_[rc], mem[rc]))
        got = _solve(tiny, None, budget)
        assert got.memory.total_bytes <= budget
        assert got.step_time.total_s == pytest.approx(time_[want], rel=1e-9), (budget, got.recompute, want)
        assert got.recompute == want or time_[got.recompute] == pytest.approx(time_[want], rel=1e-9)
