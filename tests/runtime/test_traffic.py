"""A forced axis that carries nothing is visible: ``Plan.idle_axes`` and ``traffic_by_axis``."""
from __future__ import annotations

from autopar.runtime.collectives import Collective, traffic_by_axis
from handplans import hand_plan


def test_idle_axes_name_a_tp_axis_where_everything_is_replicated(tiny_full):
    assert hand_plan(tiny_full, dp=1, tp=2, family="replicate").idle_axes() == ("tp",)
    assert hand_plan(tiny_full, dp=1, tp=2, family="megatron").idle_axes() == ()
    assert hand_plan(tiny_full, dp=2, tp=1).idle_axes() == ()          # size-1 axes are never idle


def test_traffic_by_axis_counts_and_sums():
    recs = [Collective("all_reduce", "tp", 64, "forward", "dtensor"),
            Collective("all_gather", "dp", 32, "step", "zero"),
            Collective("all_reduce", "tp", 16, "backward", "dtensor")]
    assert traffic_by_axis(recs) == {"tp": {"count": 2, "bytes": 80, "kinds": {"all_reduce": 2}},
                                     "dp": {"count": 1, "bytes": 32, "kinds": {"all_gather": 1}}}


def test_report_notes_the_idle_axis(tiny_full):
    import io

    from rich.console import Console

    from autopar.report import render

    out = io.StringIO()
    render(hand_plan(tiny_full, dp=1, tp=2, family="replicate"), Console(file=out, width=140))
    assert "every node is replicated on the tp axis (tp=2)" in out.getvalue()
    out = io.StringIO()
    render(hand_plan(tiny_full, dp=1, tp=2, family="megatron"), Console(file=out, width=140))
    assert "replicated on the tp axis" not in out.getvalue()
