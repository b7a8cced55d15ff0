"""``autopar run``'s backend: N CPU ranks planned by the solver vs one process, and a failing run."""
from __future__ import annotations

import json

import pytest

from autopar.runtime.launch import RankFailure, run_command

pytestmark = pytest.mark.slow


def test_run_command_matches_reference(tmp_path, capsys):
    path = tmp_path / "run.json"
    res = run_command("gpt-tiny", nproc=2, steps=2, force="dp=2,zero=1", json_path=str(path), batch=4, seed=3)
    assert len(res["losses"]) == 2 and len(res["reference_losses"]) == 2
    assert res["max_abs_diff"] <= 1e-5
    assert res["plan"]["data_parallel"] == 2 and res["plan"]["zero_stage"] == 1
    assert json.loads(path.read_text())["losses"] == res["losses"]
    printed = capsys.readouterr().out
    assert "step 1: loss" in printed and "max |loss - reference|" in printed


def test_run_command_reports_rank_errors():
    with pytest.raises(RankFailure, match="does not divide the world size 2"):
        run_command("gpt-tiny", nproc=2, steps=1, force="tp=3", batch=4, timeout_s=20)


def test_run_command_with_lamb_under_tensor_parallelism(capsys):
    """``autopar run --optimizer lamb``: LAMB's per-tensor trust ratios stay the whole tensors'
    on tp shards, so the losses equal one process."""
    res = run_command("gpt-tiny", nproc=2, steps=3, force="tp=2", batch=4, optimizer="lamb")
    assert res["plan"]["tensor_parallel"] == 2
    assert res["max_abs_diff"] <= 1e-5, res
    with pytest.raises(ValueError, match="choose one of"):
        run_command("gpt-tiny", nproc=2, steps=1, optimizer="sgd")
