"""`autopar sweep`: one row per plan in sweep.csv agreeing with `autopar plan`, valid PNG plots, a
config that cannot be planned as an error row, --resume planning only the missing rows, and bad
input as a one-line error (exit code 2)."""
from __future__ import annotations

import csv
import json
import shutil

import pytest

from autopar import sweep
from autopar.cli import main
from autopar.sweep import COLUMNS, PLOT_NAMES, parse_gpus, read_rows, run_sweep, split_models

MODEL = "gpt:hidden=256,layers=4,heads=8,vocab=1024,seq=128"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """MODEL at 4 and 8 GPUs, free and compared with dp=8 (which 4 GPUs cannot hold)."""
    out = tmp_path_factory.mktemp("sweep")
    result = run_sweep([MODEL], [4, 8], out_dir=str(out), gpu="h100", compare_force="dp=8")
    return out, result


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _count_plans(monkeypatch):
    calls = []
    real = sweep.plan_model

    def counting(graph, cluster, **kw):
        calls.append((cluster.nodes * cluster.gpus_per_node, kw["force"]))
        return real(graph, cluster, **kw)

    monkeypatch.setattr(sweep, "plan_model", counting)
    return calls


def test_split_models_keeps_custom_specs_whole():
    assert split_models("gpt2,gpt:hidden=1024,layers=8,llama3-8b") == ["gpt2", "gpt:hidden=1024,layers=8", "llama3-8b"]
    assert split_models("gpt:hidden=64,layers=2;gpt:hidden=128 ; m.py:build") == [
        "gpt:hidden=64,layers=2", "gpt:hidden=128", "m.py:build"]
    assert split_models("gpt2, gpt2") == ["gpt2"]
    assert parse_gpus("8, 64,512") == [8, 64, 512]
    for bad in ("0", "8,x", "-8", "", "1.5"):
        with pytest.raises(ValueError, match="--gpus"):
            parse_gpus(bad)


def test_sweep_rows_match_plan_and_errors_do_not_stop_it(swept, tmp_path, capsys):
    out, result = swept
    assert (result.planned, result.reused) == (4, 0)
    rows = _csv(out / "sweep.csv")
    assert tuple(rows[0]) == COLUMNS
    assert [(r["gpus"], r["nodes"], r["gpus_per_node"], r["config"]) for r in rows] == [
        ("4", "1", "4", "free"), ("4", "1", "4", "dp=8"), ("8", "1", "8", "free"), ("8", "1", "8", "dp=8")]
    bad = rows[1]
    assert "dp=8 does not divide the 4 GPUs" in bad["error"] and bad["dp"] == bad["step_time_s"] == ""
    for r in (rows[0], rows[2], rows[3]):
        assert r["error"] == "" and r["model"] == MODEL and r["gpu"] == "h100"
        assert int(r["dp"]) * int(r["tp"]) * int(r["pp"]) == int(r["gpus"])
        parts = [int(r[k]) for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                                     "other_bytes")]
        assert int(r["peak_memory_bytes"]) > 0 and min(parts) >= 0 and max(parts) > 0   # the peak: by moments
        assert 0 < float(r["mfu"]) < 1 and float(r["tflops_per_gpu"]) > 0 and float(r["solve_time_s"]) > 0
    assert rows[3]["dp"] == "8"
    assert read_rows(str(out / "sweep.csv")) == list(result.rows)

    for free, force in ((rows[2], ""), (rows[3], "dp=8")):     # the same numbers as `autopar plan`
        path = tmp_path / "plan.json"
        assert main(["plan", MODEL, "--gpu", "h100", "--nodes", "1", "--json", str(path), "--force", force]) == 0
        s = json.loads(path.read_text())["summary"]
        assert (s["data_parallel"], s["tensor_parallel"], s["pipeline_parallel"], s["zero_stage"],
                s["micro_batch_size"]) == tuple(int(free[k]) for k in ("dp", "tp", "pp", "zero", "mbs"))
        assert s["estimated_step_time_s"] == pytest.approx(float(free["step_time_s"]), rel=1e-12)
        assert s["peak_memory_bytes_per_gpu"] == int(free["peak_memory_bytes"])
    capsys.readouterr()

    for name in PLOT_NAMES:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name


def test_cli_resume_plans_only_missing_rows(swept, tmp_path, monkeypatch, capsys):
    src, _ = swept
    out = tmp_path / "resumed"
    shutil.copytree(src, out)
    lines = (out / "sweep.csv").read_text().splitlines(keepends=True)
    (out / "sweep.csv").write_text("".join(lines[:3]))        # killed after two rows
    for name in PLOT_NAMES:
        (out / name).unlink()
    calls = _count_plans(monkeypatch)
    argv = ["sweep", "--models", MODEL, "--gpus", "4,8,16", "--gpu", "h100", "--compare-force", "dp=8",
            "--out", str(out), "--resume"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert [(g, f.dp) for g, f in calls] == [(8, None), (8, 8), (16, None), (16, 8)]
    assert "4 planned, 2 kept" in printed and "Sweep: predicted per plan" in printed
    rows = read_rows(str(out / "sweep.csv"))
    assert sorted(r.key[1:] for r in rows) == sorted((g, c) for g in (4, 8, 16) for c in ("free", "dp=8"))
    assert [r.nodes for r in rows if r.gpus == 16] == [2, 2]
    assert all((out / n).read_bytes().startswith(PNG_MAGIC) for n in PLOT_NAMES)

    calls.clear()
    assert main(argv) == 0                                      # nothing left to plan
    assert calls == [] and "0 planned, 6 kept" in capsys.readouterr().out
    assert len(read_rows(str(out / "sweep.csv"))) == 6


@pytest.mark.parametrize("args, words", [
    (["--models", "gpt2,nope"], ["unknown model", "nope"]),
    (["--gpus", "8,0"], ["--gpus", "'0'", "positive"]),
    (["--gpus", "eight"], ["--gpus", "'eight'"]),
    (["--gpus", "12"], ["12", "multiple of 8"]),
    (["--compare-force", "tpp=2"], ["unknown key", "tpp"]),
    (["--gpu", "b200"], ["b200"]),
])
def test_bad_input_is_one_line(args, words, tmp_path, capsys):
    base = {"--models": MODEL, "--gpus": "8", "--out": str(tmp_path / "o")}
    base.update(dict(zip(args[::2], args[1::2])))
    assert main(["sweep", *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "o").exists()                        # nothing was planned or written


def test_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["sweep", "--models", MODEL, "--gpus", "8", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out") and "\n" not in err
