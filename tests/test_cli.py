"""The command line end to end: plan -> JSON -> inspect, forced choices, and errors that say what to
change (exit code 2, no traceback)."""
from __future__ import annotations

import json

import pytest

from autopar.cli import main
from autopar.plan import SUMMARY_KEYS, Plan

MODEL = "gpt:hidden=256,layers=4,heads=8,vocab=1024,seq=128"


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")


def _plan(tmp_path, capsys, *extra):
    path = tmp_path / "plan.json"
    rc = main(["plan", MODEL, "--gpu", "h100", "--nodes", "1", "--batch", "64", "--json", str(path), *extra])
    return rc, path, capsys.readouterr().out


def test_plan_json_round_trip_and_inspect_renders_the_same_report(tmp_path, capsys):
    rc, path, out = _plan(tmp_path, capsys)
    assert rc == 0, out
    data = json.loads(path.read_text())
    assert tuple(data["summary"]) == SUMMARY_KEYS
    s = data["summary"]
    assert s["data_parallel"] * s["tensor_parallel"] * s["pipeline_parallel"] == 8
    assert s["micro_batch_size"] * s["num_micro_batches"] * s["data_parallel"] == 64
    plan = Plan.load(str(path))
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.summary() == s

    assert main(["inspect", str(path)]) == 0
    report = capsys.readouterr().out
    assert report.strip() and report.strip() in out      # `plan` printed the same report, then more


def test_forced_choices_are_honoured(tmp_path, capsys):
    rc, path, out = _plan(tmp_path, capsys, "--force", "tp=2,pp=2,recompute=full,zero=1")
    assert rc == 0, out
    s = json.loads(path.read_text())["summary"]
    assert (s["tensor_parallel"], s["pipeline_parallel"], s["recompute"], s["zero_stage"]) == (2, 2, "full", 1)
    assert s["data_parallel"] == 2


@pytest.mark.parametrize("args, words", [
    (["--force", "tp=3"], ["tp=3", "does not divide"]),
    (["--force", "tpp=2"], ["unknown key", "tpp"]),
    (["--memory-gb", "0.001"], ["needs >=", "budget", "try"]),
])
def test_bad_input_is_an_error_that_says_what_to_change(tmp_path, capsys, args, words):
    rc, path, out = _plan(tmp_path, capsys, *args)
    assert rc == 2
    assert "error:" in out and "Traceback" not in out
    flat = " ".join(out.split())
    for w in words:
        assert w in flat, (w, out)
    assert not path.exists()


def test_inspect_rejects_a_file_that_is_not_a_plan(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    assert main(["inspect", str(bad)]) == 2
    assert "is not a plan JSON file" in " ".join(capsys.readouterr().out.split())
    assert main(["inspect", str(tmp_path / "missing.json")]) == 2
