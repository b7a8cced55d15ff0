"""benchmarks/kernel_speed.py without a GPU: the dry run (interpreter, tiny shapes) end to end, the
refusal without CUDA, fail-soft rows, and the derived columns (throughput, %, goals)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_speed.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("autopar_kernels_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_dry_run_writes_table_and_json(bench, tmp_path, capsys):
    out = tmp_path / "k.json"
    assert bench.main(["--dry-run", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    names = [r["name"] for r in data["rows"]]
    assert len(names) == 20 and "attention fwd (causal)" in names and "lamb step" in names
    for r in data["rows"]:
        assert r["error"] is None, (r["name"], r["error"])
        assert r["triton_ms"] > 0 and r["eager_ms"] > 0 and r["throughput"] > 0
        assert r["compile_ms"] is None  # a dry run compiles only when asked
    assert data["dry_run"] and data["ceilings"]["hbm_Bps_datasheet"] == 4.8e12
    assert "bf16 dense" in printed and "cross_entropy fwd+bwd" in printed
    assert "read logits MV once" in printed  # the byte counts are spelled out
    rows = {r["name"]: r for r in data["rows"]}  # autotuned kernels name the config that ran
    assert set(rows["cross_entropy fwd+bwd"]["tuned"]) == {"ce_partial_kernel", "ce_combine_kernel",
                                                          "ce_bwd_kernel"}
    bwd = rows["rms_norm fwd+bwd"]["tuned"]["norm_bwd_kernel"]["config"]
    assert bwd.startswith("PROGRAMS_PER_SM=4 PREFETCH=True")  # configs[0] under the interpreter
    assert "config norm_bwd_kernel: PROGRAMS_PER_SM=4" in printed


def test_dry_run_compile_column_wiring(bench, tmp_path):
    """torch.compile's eager backend exercises the compile specs (forward, backward, the
    cross-entropy's gradient w.r.t. logits only, optimizer steps) without code generation."""
    out = tmp_path / "k.json"
    assert bench.main(["--dry-run", "--compile-backend", "eager", "--json", str(out), "--only",
                       "rms_norm fwd+bwd", "cross_entropy fwd+bwd", "adamw"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["rms_norm fwd+bwd", "add_rms_norm fwd+bwd",
                                         "cross_entropy fwd+bwd", "adamw step"]
    for r in rows:
        assert r["compile_ms"] is not None and r["beats_compile"] is not None, r


def test_refuses_without_cuda(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_failing_row_does_not_stop_the_others(bench):
    ceilings = bench.Ceilings("test", hbm_Bps=4e12, bf16_flops=8e14)

    def broken():
        raise RuntimeError("kernel exploded")

    bad = bench.Case("bad", "1", "memory", 1.0, "-", 80.0, broken)
    good = bench.Case("good", "1", "memory", 8.0, "-", None,
                      lambda: dict(triton=lambda: torch.ones(2), eager=lambda: torch.ones(2),
                                   compile=None))
    timer = lambda fn: 1.0  # noqa: E731  (ms)
    rows = [bench.run_case(c, timer, ceilings, compile_backend=None, device=torch.device("cpu"))
            for c in (bad, good)]
    assert rows[0].error == "RuntimeError: kernel exploded" and rows[0].triton_ms is None
    assert rows[1].error is None and rows[1].triton_ms == 1.0 and rows[1].err == 0.0
    text = bench.format_table(rows)
    assert "ERROR" in text and "kernel exploded" in text


def test_derived_columns_and_goals(bench):
    ceilings = bench.Ceilings("test", hbm_Bps=4e12, bf16_flops=8e14)
    mem = bench.Row("norm", "s", "memory", work=1e9, work_formula="-", goal_pct=80.0,
                    triton_ms=0.3, compile_ms=0.25)
    bench.fill_derived(mem, ceilings)
    assert mem.throughput == pytest.approx(1e9 / 3e-4)
    assert mem.pct_ceiling == pytest.approx(100 * (1e9 / 3e-4) / 4e12)  # 83 %
    assert mem.pct_datasheet == pytest.approx(100 * (1e9 / 3e-4) / 4.8e12)
    assert mem.goal_met is True and mem.beats_compile is False
    att = bench.Row("attn", "s", "compute", work=4e14, work_formula="-", goal_pct=50.0,
                    triton_ms=1000.0, compile_ms=None)
    bench.fill_derived(att, ceilings)
    assert att.pct_ceiling == pytest.approx(50.0) and att.goal_met is True
    assert att.beats_compile is None
    cells = bench.table_rows([mem, att])
    assert cells[0][9] == "PASS" and cells[0][10] == "FAIL" and cells[1][10] == "-"
    assert cells[1][5].endswith("TFLOP/s") and cells[0][5].endswith("GB/s")


def test_config_note_names_the_margin(bench):
    assert bench.config_note("k", {"config": "A"}) == "config k: A"
    timed = {"config": "A", "tuning": {"B": 0.3, "A": 0.2, "C": float("inf")}}  # C did not build
    assert bench.config_note("k", timed) == "config k: A (fastest of 3: 0.200 ms; next 0.300 ms)"


@pytest.mark.slow
def test_gpu_check_script_rehearsal(tmp_path):
    """benchmarks/gpu_check.sh with DRY_RUN=1 on the CPU: every step's command line is valid (the
    kernel and attention tests in both descriptor modes are collected, the benchmark and the fused
    training-step check run their --dry-run), so a lent GPU's minutes go to the check itself.
    Through the script's BENCH_ARGS / FUSED_ARGS the benchmark's dry run keeps one row (all 20 run
    in this process in test_dry_run_writes_table_and_json) and the fused step trains at batch 1
    (which kernels fuse, and how many, does not depend on it; test_fused_kernels.py checks their
    numbers): the same command lines plus those options, in about half the time."""
    import os
    import subprocess

    script = SCRIPT.parent / "gpu_check.sh"
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), BENCH_ARGS="--only adamw", FUSED_ARGS="--batch 1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    for line in ("kernel tests exit: 0", "attention tests (host descriptors) exit: 0",
                 "attention tests (device descriptors) exit: 0", "attention descriptors: host",
                 "one-GPU runtime tests exit: 0", "benchmark exit: 0", "fused step exit: 0", "calibrate exit: 0",
                 "profile exit: 0", "offload overlap exit: 0", "offload nvme exit: 0"):
        assert line in log, (line, log[-4000:])
    fused = (tmp_path / "fused_step.log").read_text()
    assert fused.rstrip().endswith("OK")
    for name in ("add_layer_norm", "rope x4", "swiglu x2", "add_rms_norm x4", "attention x2"):
        assert name in fused, fused
    bench = json.loads((tmp_path / "kernels.json").read_text())
    assert bench["dry_run"] and [r["name"] for r in bench["rows"]] == ["adamw step"], bench["rows"]
    assert bench["rows"][0]["error"] is None, bench["rows"][0]
