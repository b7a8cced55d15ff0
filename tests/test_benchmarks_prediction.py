"""``benchmarks/prediction_accuracy.py``'s arithmetic on hand-made rounds: the median round, the
ratio's range, and each family's ratio against the dp family's at the same time ("vs dp", which a
machine running slow for a whole round, or slowing down through it, leaves unchanged)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "prediction_accuracy", Path(__file__).resolve().parents[1] / "benchmarks" / "prediction_accuracy.py")
pa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pa)

MIB = 2**20


def _run(measured: float, t: float, peak: float = 10 * MIB, predicted_peak: float = 10 * MIB) -> tuple:
    return (measured, 0.100, peak, predicted_peak, t)          # every prediction 100 ms


def test_rounds_and_the_dp_relative_ratio():
    # round 2 ran 30% slow for both families; cp's prediction is 10% short of dp's in every round
    runs = {"dp": [_run(0.110, 0), _run(0.143, 100), _run(0.100, 200)],
            "cp x dp": [_run(0.121, 10, 21 * MIB, 20 * MIB), _run(0.1573, 110, 21 * MIB, 20 * MIB),
                        _run(0.110, 210, 21 * MIB, 20 * MIB)]}
    rows, worst = pa.summarize(runs)
    dp, cp = rows
    assert (dp["family"], cp["family"]) == ("dp", "cp x dp")
    assert dp["ratio"] == pytest.approx(1.10) and (dp["low"], dp["high"]) == pytest.approx((1.00, 1.43))
    assert dp["measured_s"] == pytest.approx(0.110) and dp["vs_dp"] == pytest.approx(1.0)
    assert cp["ratio"] == pytest.approx(1.21) and cp["vs_dp"] == pytest.approx(1.10)
    assert cp["peak_ratio"] == pytest.approx(1.05)
    assert worst == pytest.approx({"step": 0.21, "peak": 0.05, "round": 0.573, "vs_dp": 0.10})


def test_a_machine_slowing_through_a_round_is_interpolated_out():
    """Each round the machine slows linearly from 1.0x to 1.4x between its two dp profiles (t = 0 and
    40 s of the round); tp, profiled at 10 s, runs its plan 5% over its prediction, cp at 30 s 20%
    over. Against the round's opening dp alone they read 1.155 and 1.56; interpolated, 1.05 and 1.20."""
    runs = {"dp": [], "tp x dp": [], "cp x dp": []}
    closing = []
    for r in range(3):
        t0 = 100 * r
        runs["dp"].append(_run(0.100, t0))
        runs["tp x dp"].append(_run(0.100 * 1.05 * 1.1, t0 + 10))
        runs["cp x dp"].append(_run(0.100 * 1.20 * 1.3, t0 + 30))
        closing.append(_run(0.140, t0 + 40))
    rows, worst = pa.summarize(runs, closing)
    vs = {row["family"]: row["vs_dp"] for row in rows}
    assert vs == pytest.approx({"dp": 1.0, "tp x dp": 1.05, "cp x dp": 1.20})
    assert worst["vs_dp"] == pytest.approx(0.20)
    rows, _ = pa.summarize(runs)                      # without the closing profiles: the opening dp only
    assert {row["family"]: row["vs_dp"] for row in rows} == pytest.approx({"dp": 1.0, "tp x dp": 1.155,
                                                                            "cp x dp": 1.56})


def test_without_a_dp_family_there_is_no_relative_ratio():
    rows, worst = pa.summarize({"tp x dp": [(0.2, 0.25, MIB, MIB, 0.0)]})
    assert rows[0]["vs_dp"] is None and worst["vs_dp"] is None
    assert rows[0]["ratio"] == pytest.approx(0.8) and worst["step"] == pytest.approx(0.2)
