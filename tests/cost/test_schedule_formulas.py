"""Pipeline schedules: bubble, in-flight micro-batches and torch's constraints, hand-worked, and
checked against the action lists torch 2.13's own schedule classes generate (replayed with
F = B_input = W, a full backward 2F)."""
import pytest

from autopar.cost.flops import (pipeline_bubble_fraction, pipeline_bubble_units, pipeline_schedule_problem,
                                pipeline_step_time_s)
from autopar.cost.memory import pipeline_inflight_microbatches as inflight
from autopar.cost.schedule_memory import rank_actions
from autopar.plan import stage_rank


def test_bubble_hand_worked():
    # p = 4, m = 8
    assert pipeline_bubble_fraction(4, 8, "1f1b") == 3 / 8                       # (p-1)/m
    assert pipeline_bubble_fraction(4, 8, "gpipe") == 3 / 8
    assert pipeline_bubble_fraction(4, 8, "interleaved_1f1b", 2) == 3 / 16        # (p-1)/(v m)
    assert pipeline_bubble_fraction(4, 8, "interleaved_zb", 2) == pytest.approx(3 / 48)   # (p-1)/(3 v m)
    assert pipeline_bubble_fraction(4, 8, "zbv", 2) == pytest.approx(3 / 48)      # (p-1)/(6m), m >= 2p-1
    assert pipeline_bubble_fraction(4, 4, "zbv", 2) == pytest.approx((3 + 3) / 24)   # + (2p-1-m) below 2p-1
    assert pipeline_bubble_fraction(4, 8, "dualpipev", 2) == pytest.approx(3 / 48)
    assert pipeline_bubble_units(1, 8, "1f1b") == 0.0
    # step = (m + units) t: 1F1B (8 + 3) * 0.1; interleaved v=2 (8 + 1.5) * 0.1
    assert pipeline_step_time_s(0.1, 4, 8, "1f1b") == pytest.approx(1.1)
    assert pipeline_step_time_s(0.1, 4, 8, "interleaved_1f1b", 2) == pytest.approx(0.95)
    with pytest.raises(ValueError, match="schedule"):
        pipeline_bubble_fraction(4, 8, "zb2p")


def test_inflight_hand_worked():
    assert [inflight(4, r, 8, "1f1b") for r in range(4)] == [4, 3, 2, 1]
    assert inflight(4, 0, 8, "gpipe") == 8
    # interleaved 1F1B, p=4, v=2, m=8 (2 rounds of 4): rank 0 warmup (v-1)*4 + 2*3 = 10 chunks, +1 = 11
    # chunks of half a rank each = 5.5 = p + (p-1)/v (Megatron's (1 + 1/v) x 1F1B)
    assert [inflight(4, r, 8, "interleaved_1f1b", 2) for r in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert inflight(4, 0, 4, "interleaved_1f1b", 2) == 4.0                       # capped at m v chunks
    # interleaved ZB: warmup (v-1)*4 + (3-r) + 1, plus r deferred W = 8 chunks on every rank
    assert [inflight(4, r, 8, "interleaved_zb", 2) for r in range(4)] == [4.0] * 4
    assert [inflight(4, r, 8, "zbv", 2) for r in range(4)] == [4.0] * 4           # 2p chunks
    assert [inflight(4, r, 4, "zbv", 2) for r in range(4)] == [2.5, 3.0, 3.5, 4.0]  # m + 1 + r chunks
    assert [inflight(4, r, 8, "dualpipev", 2) for r in range(4)] == [4.5] * 4   # "PP+1" chunks


def test_constraints_follow_torch():
    ok = pipeline_schedule_problem
    assert ok("1f1b", 4, 1, 4, 16) is None and ok("1f1b", 1, 1, 1, 1) is None
    assert "pp > 1" in ok("zbv", 1, 2, 8, 16)
    assert "one stage per rank" in ok("1f1b", 4, 2, 8, 16)
    assert "exactly 2" in ok("zbv", 4, 4, 8, 16)
    assert "vpp >= 2" in ok("interleaved_zb", 4, 1, 8, 16)
    assert "has 6 layers" in ok("interleaved_1f1b", 4, 2, 8, 6)
    assert ">= 4 micro-batches" in ok("gpipe", 4, 1, 3, 16)
    assert ok("interleaved_1f1b", 4, 2, 10, 16) is None             # 10 % max(1, 10 // 4) == 0: torch accepts
    assert "rounds" in ok("interleaved_1f1b", 4, 2, 9, 16)          # 9 % 2 != 0
    assert "2 * pp = 8" in ok("dualpipev", 4, 2, 6, 16)


def test_stage_layouts():
    assert [stage_rank("1f1b", 4, i) for i in range(4)] == [0, 1, 2, 3]
    assert [stage_rank("interleaved_1f1b", 4, i) for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stage_rank("zbv", 4, i) for i in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
    assert generate_stage_to_rank_mapping(4, 8, style="v") == {i: stage_rank("dualpipev", 4, i) for i in range(8)}
    assert generate_stage_to_rank_mapping(4, 12) == {i: stage_rank("interleaved_zb", 4, i) for i in range(12)}


# ---- replay of torch's own action lists (``cost.schedule_memory.rank_actions``) ----------------------

def _replay(orders, p, v, m):
    """(bubble fraction, peak chunk activations per rank): every rank runs its actions in order, each
    as soon as its inputs exist; F = I = W = 1, a full backward B 2 (I and B both send the input
    gradient back)."""
    dur = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    n_st = p * v

    def deps(kind, s, mb):
        if kind == "F":
            return [(s - 1, "F", mb)] if s > 0 else []
        if kind in ("B", "I"):
            return [(s, "F", mb)] + ([(s + 1, "B", mb)] if s < n_st - 1 else [])
        return [(s, "B", mb)]

    done, ptr, clock = {}, {r: 0 for r in range(p)}, {r: 0.0 for r in range(p)}
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while ptr[r] < len(orders[r]) and all(d in done for d in deps(*orders[r][ptr[r]])):
                kind, s, mb = orders[r][ptr[r]]
                clock[r] = max([clock[r]] + [done[d] for d in deps(kind, s, mb)]) + dur[kind]
                done[(s, "B" if kind == "I" else kind, mb)] = clock[r]
                ptr[r] += 1
                moved = True
    assert all(ptr[r] == len(orders[r]) for r in range(p))
    peaks = []
    for r in range(p):
        cur = best = 0
        for kind, _, _ in orders[r]:
            cur += 1 if kind == "F" else (-1 if kind in ("B", "W") else 0)
            best = max(best, cur)
        peaks.append(best)
    ideal = 3.0 * m * v
    return (max(clock.values()) - ideal) / ideal, peaks


@pytest.mark.parametrize("name,p,v,m", [
    ("interleaved_1f1b", 4, 2, 8),
    ("interleaved_1f1b", 4, 4, 4),
    ("interleaved_1f1b", 2, 2, 6),
    ("interleaved_zb", 4, 2, 8),
    ("interleaved_zb", 4, 4, 4),
    ("zbv", 4, 2, 8),
    ("zbv", 4, 2, 4),
    ("zbv", 8, 2, 16),
    ("dualpipev", 4, 2, 8),
])
def test_formulas_match_torch_action_lists(name, p, v, m):
    bubble, peaks = _replay({r: rank_actions(name, p, r, m, v) for r in range(p)}, p, v, m)
    assert bubble == pytest.approx(pipeline_bubble_fraction(p, m, name, v), abs=1e-12)
    assert [x / v for x in peaks] == [inflight(p, r, m, name, v) for r in range(p)]
