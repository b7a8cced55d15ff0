"""``benchmarks/prediction_accuracy.py``'s arithmetic on hand-made rounds: the median round, the
ratio's range, and each family's ratio against the dp family's in the same round ("vs dp", which a
machine running slow for a whole round leaves unchanged)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "prediction_accuracy", Path(__file__).resolve().parents[1] / "benchmarks" / "prediction_accuracy.py")
pa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pa)

MIB = 2**20


def test_rounds_and_the_dp_relative_ratio():
    # round 2 ran 30% slow for both families; cp's prediction is 10% short of dp's in every round
    runs = {"dp": [(0.110, 0.100, 10 * MIB, 10 * MIB), (0.143, 0.100, 10 * MIB, 10 * MIB),
                   (0.100, 0.100, 10 * MIB, 10 * MIB)],
            "cp x dp": [(0.121, 0.100, 21 * MIB, 20 * MIB), (0.1573, 0.100, 21 * MIB, 20 * MIB),
                        (0.110, 0.100, 21 * MIB, 20 * MIB)]}
    rows, worst = pa.summarize(runs)
    dp, cp = rows
    assert (dp["family"], cp["family"]) == ("dp", "cp x dp")
    assert dp["ratio"] == pytest.approx(1.10) and (dp["low"], dp["high"]) == pytest.approx((1.00, 1.43))
    assert dp["measured_s"] == pytest.approx(0.110) and dp["vs_dp"] == pytest.approx(1.0)
    assert cp["ratio"] == pytest.approx(1.21) and cp["vs_dp"] == pytest.approx(1.10)
    assert cp["peak_ratio"] == pytest.approx(1.05)
    assert worst == pytest.approx({"step": 0.21, "peak": 0.05, "round": 0.573, "vs_dp": 0.10})


def test_without_a_dp_family_there_is_no_relative_ratio():
    rows, worst = pa.summarize({"tp x dp": [(0.2, 0.25, MIB, MIB)]})
    assert rows[0]["vs_dp"] is None and worst["vs_dp"] is None
    assert rows[0]["ratio"] == pytest.approx(0.8) and worst["step"] == pytest.approx(0.2)
