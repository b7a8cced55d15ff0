"""The command line end to end: plan -> JSON -> inspect, forced choices, and errors that say what to
change (exit code 2, no traceback)."""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest
from rich.console import Console

from autopar.cli import main
from autopar.plan import SUMMARY_KEYS, Plan
from readme_examples import README_POD
from autopar.report import render

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
    path = tmp_path / "plan.json"
    rc = main(["plan", MODEL, "--gpu", "h100", "--batch", "64", "--json", str(path), *args])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "error:" not in out                                  # errors go to stderr, one line
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    assert not path.exists()


def test_infeasible_memory_says_which_memory_gb_would_do(tmp_path, capsys):
    rc = main(["plan", MODEL, "--gpu", "h100", "--batch", "64", "--memory-gb", "0.001"])
    err = capsys.readouterr().err
    assert rc == 2
    need = float(re.search(r"needs >= ([\d.]+) GB", err).group(1))
    suggested = re.search(r"--memory-gb ([\d.]+) if the GPUs have that much free", err)
    assert suggested, err
    assert float(suggested.group(1)) >= need and float(suggested.group(1)) > 0
    rc = main(["plan", MODEL, "--gpu", "h100", "--batch", "64", "--memory-gb", suggested.group(1)])
    assert rc == 0, capsys.readouterr().err                     # the suggestion is a budget that works


def test_inspect_rejects_a_file_that_is_not_a_plan(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    assert main(["inspect", str(bad)]) == 2
    assert "is not a plan JSON file" in " ".join(capsys.readouterr().err.split())
    assert main(["inspect", str(tmp_path / "missing.json")]) == 2


def test_inspect_a_directory_is_a_one_line_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path} is a directory; give ") and err.count("\n") == 1
    assert "--json FILE" in err


# ---- --cluster, --gpu, --nodes, --gpus-per-node (issue 14, item 1) ---------------------------------



def _cluster_plan(tmp_path, capsys, *args):
    """Plan MODEL with ``args``; (the saved Plan, stdout, stderr)."""
    path = tmp_path / "plan.json"
    rc = main(["plan", MODEL, "--batch", "64", "--json", str(path), *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return Plan.load(str(path)), out, err


def test_cluster_toml_is_planned_as_the_file_says(tmp_path, capsys):
    toml = tmp_path / "my-h100-pod.toml"
    toml.write_text(README_POD)
    plan, out, _ = _cluster_plan(tmp_path, capsys, "--cluster", str(toml))
    c = plan.cluster
    assert (c.name, c.gpu, c.nodes, c.gpus_per_node) == ("my-h100-pod", "h100", 4, 8)
    assert "overriding" not in out
    budget_80gb = c.memory_budget_bytes
    assert budget_80gb < 80e9

    plan, out, _ = _cluster_plan(tmp_path, capsys, "--cluster", str(toml), "--gpu", "a100-80g")
    c = plan.cluster
    assert (c.name, c.gpu, c.nodes, c.gpus_per_node) == ("my-h100-pod", "a100-80g", 4, 8)
    assert c.memory_budget_bytes == budget_80gb                 # the file's memory_GB still applies
    assert "note: cluster my-h100-pod with --gpu a100-80g overriding h100 (the file's [gpu_overrides] " \
           "memory_GB applied to a100-80g)\n" in out
    assert "overriding h100" in Plan.load(str(tmp_path / "plan.json")).notes[0]   # inspect shows it too


@pytest.mark.parametrize("args, expected", [
    (["--cluster", "dgx-h100", "--nodes", "2"], ("dgx-h100x2", "h100", 2, 8)),
    (["--cluster", "cpu"], ("cpux1", "cpu", 1, 8)),
    (["--cluster", "dgx-h200", "--gpus-per-node", "4"], ("dgx-h200x1", "h200", 1, 4)),
    ([], ("a100-80gx1x8", "a100-80g", 1, 8)),                   # neither --cluster nor --gpu: the default
])
def test_builtin_cluster_is_not_overridden_by_defaults(tmp_path, capsys, args, expected):
    plan, _, _ = _cluster_plan(tmp_path, capsys, *args)
    c = plan.cluster
    assert (c.name, c.gpu, c.nodes, c.gpus_per_node) == expected


@pytest.mark.parametrize("flag", ["--nodes", "--gpus-per-node"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_non_positive_cluster_size_is_an_error(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        main(["plan", MODEL, flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {value} is not >= 1" in err


# ---- --dtype (item 4) -----------------------------------------------------------------------------

def test_dtype_defaults_to_the_gpus_fastest_and_mfu_uses_its_peak(tmp_path, capsys):
    plan, out, err = _cluster_plan(tmp_path, capsys, "--gpu", "v100")
    assert plan.dtype == "float16" and not err
    tflops = plan.summary()["estimated_tflops_per_gpu"]
    assert f"MFU {100 * tflops / 125:.1f}% of the 125 TFLOP/s float16 peak" in out
    plan, out, _ = _cluster_plan(tmp_path, capsys, "--gpu", "h100")
    assert plan.dtype == "bfloat16" and "of the 989.4 TFLOP/s bfloat16 peak" in out


def test_dtype_the_gpu_only_emulates_is_planned_with_a_warning(tmp_path, capsys):
    plan, out, err = _cluster_plan(tmp_path, capsys, "--gpu", "v100", "--dtype", "bf16")
    assert plan.dtype == "bfloat16"
    assert err.startswith("warning: v100 has no bfloat16 tensor cores") and err.count("\n") == 1
    assert "--dtype fp16" in err and "warning" not in out
    assert "of the 15.7 TFLOP/s bfloat16 peak" in out


# ---- the rendered report (item 15) ----------------------------------------------------------------

def _rendered(plan: Plan) -> str:
    console = Console(file=io.StringIO(), width=140)
    render(plan, console)
    return console.file.getvalue()


def test_throughput_line_is_one_left_aligned_line(tmp_path, capsys):
    plan, _, _ = _cluster_plan(tmp_path, capsys, "--gpu", "h100")
    lines = _rendered(plan).splitlines()
    (line,) = [x for x in lines if "model TFLOP/s per GPU" in x]
    assert re.fullmatch(r"[\d.]+ model TFLOP/s per GPU, MFU [\d.]+% of the 989.4 TFLOP/s bfloat16 peak; "
                        r"solved in [\d.]+ s", line), line


def test_zero3_sharded_parameters_are_not_labelled_replicate(tmp_path, capsys):
    plan, _, _ = _cluster_plan(tmp_path, capsys, "--gpu", "h100", "--force", "zero=3,tp=2")
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in _rendered(plan).splitlines()
            if line.startswith("│")]
    params = [r for r in rows if len(r) == 4 and r[1] == "param"]
    assert params and all(r[3].startswith("S(0)") for r in params)
    assert all(r[2].endswith("ZeRO-3 shard") for r in params), params
    assert not [r for r in rows if len(r) == 4 and r[2] == "replicate" and r[3].split(" -> ")[-1].startswith("S(")]


# ---- fast answers: no torch for --help, argument errors, models (item 17) --------------------------

_NO_TORCH = """
import sys
import autopar.cli
for argv in {argvs!r}:
    try:
        rc = autopar.cli.main(argv)
    except SystemExit as e:
        rc = e.code
    assert "torch" not in sys.modules, (argv, sorted(m for m in sys.modules if m.startswith("torch"))[:5])
    print("rc", argv[0], rc)
"""


def test_help_argument_errors_and_models_do_not_import_torch():
    argvs = [["--help"], ["plan", "--help"], ["plan", "gpt2", "--nodes", "0"], ["plan"], ["models"]]
    r = subprocess.run([sys.executable, "-c", _NO_TORCH.format(argvs=argvs)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    rcs = [line for line in r.stdout.splitlines() if line.startswith("rc ")]
    assert rcs == ["rc --help 0", "rc plan 0", "rc plan 2", "rc plan 2", "rc models 0"]
    assert "gpt2\ngpt2-medium" in r.stdout


def test_models_lists_the_zoo_without_importing_it():
    from autopar.models import BUILTIN_NAMES, list_models
    from autopar.models.zoo import BUILTINS

    assert tuple(BUILTINS) == BUILTIN_NAMES and list_models() == list(BUILTIN_NAMES)


def test_public_names_still_load_lazily():
    import autopar

    assert autopar.autoparallelize.__module__ == "autopar.api"
    assert autopar.optim.LAMB.__name__ == "LAMB"
    from autopar import ParallelModel  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        autopar.nope
    from autopar.cli import GPU_CHOICES
    from autopar.cost.hardware import GPU_NAMES
    assert GPU_CHOICES == ", ".join(GPU_NAMES)


def test_offload_flags_set_the_host_budgets_the_report_shows(tmp_path, capsys):
    rc, path, out = _plan(tmp_path, capsys, "--force", "offload=optimizer+nvme", "--host-memory-gb", "1000",
                          "--nvme-gb", "800")
    assert rc == 0
    plan = Plan.load(str(path))
    assert plan.offload == "optimizer+nvme" and plan.memory.nvme_bytes > 0
    assert plan.cluster.host_budget_bytes == int(1000e9 * 0.9 / 8)          # per GPU, less the 10% reserve
    assert plan.cluster.nvme_budget_bytes == int(800e9 / 8)
    assert "host memory (offload=optimizer+nvme)" in out and "of 112.50 GB" in out and "nvme:io" in out
