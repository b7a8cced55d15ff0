"""Predicted vs measured TFLOP/s per GPU on Megatron-Core's published H100 weak-scaling runs.

Profile: ``MEGATRON_RUNTIME`` ("megatron-core-overlap": --overlap-grad-reduce --overlap-param-gather
--tp-comm-overlap, fp32 gradient reduction); the published (tp, pp, dp) forced; micro-batch 1
(Megatron's usual --micro-batch-size; the table lists none); efficiencies from
autopar/cost/calibration.json as they stand (nothing here is tuned to the rows). See
benchmarks/megatron_fidelity.py for the printed table.
"""
import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "megatron_fidelity", Path(__file__).resolve().parents[2] / "benchmarks" / "megatron_fidelity.py")
mf = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("megatron_fidelity", mf)     # dataclasses look their module up
_spec.loader.exec_module(mf)

ROWS = mf.reference_rows()


def _one_f_one_b(plan_model):
    """The rows ran Megatron-Core's 1F1B pipeline (the planner would otherwise pick a zero-bubble or
    interleaved schedule those runs did not use)."""
    def pinned(*args, force="", **kwargs):
        return plan_model(*args, force=force + ",schedule=1f1b", **kwargs)
    return pinned


def test_h100_table_is_consistent_and_untied():
    """The transcription checks itself: tp*pp*dp = GPUs, % of peak = TFLOP/s / 989.4 (H100 SXM dense
    bf16) and aggregate PFLOP/s = TFLOP/s x GPUs, to the table's rounding. The sizes are Megatron's
    own parameter count with the output layer untied (``megatron_param_count``): within 3% of each
    (1.745 for "1.7"), and nearer than the tied count on every row (1.477 for "1.7", 6.58 for "7.1")."""
    assert len(ROWS) == 9
    for r in ROWS:
        tp, pp, dp, n = (int(r[k]) for k in ("tp", "pp", "dp", "n_gpus"))
        t, size = float(r["tflops_per_gpu"]), float(r["model_size_b"])
        assert tp * pp * dp == n and int(r["global_batch"]) % dp == 0
        assert abs(100 * t / 989.4 - float(r["mfu_pct"])) < 1.0
        assert float(r["agg_pflops"]) == pytest.approx(t * n / 1000, rel=0.005)
        untied, tied = mf.megatron_param_count(r) / 1e9, mf.megatron_param_count(r, untied=False) / 1e9
        assert untied == pytest.approx(size, rel=0.03)
        assert abs(untied - size) < abs(tied - size)
    assert mf.megatron_param_count(ROWS[0], untied=False) / 1e9 < 1.5        # tied: "1.5B", not "1.7B"


def test_the_planned_model_is_the_untied_one():
    """The model the rows plan has Megatron's count of parameters plus what Megatron's formula leaves
    out (biases: 9h a layer; the learned position table: s x h), so an untied output layer."""
    import torch

    from autopar.models import build_model

    r = ROWS[0]
    h, L, s = (int(r[k]) for k in ("hidden", "layers", "seq_len"))
    with torch.device("meta"):
        b = build_model(mf.row_spec(r), batch=2)
    count = sum(p.numel() for p in b.module.parameters())
    assert count == mf.megatron_param_count(r) + 9 * L * h + s * h


@pytest.mark.parametrize("i", range(len(ROWS)), ids=[f"{r['model_size_b']}B" for r in ROWS])
def test_predicted_throughput_within_15_percent(i, monkeypatch):
    import autopar.solver
    monkeypatch.setattr(autopar.solver, "plan_model", _one_f_one_b(autopar.solver.plan_model))
    r = mf.predict_row(ROWS[i])
    assert r.planner_flops_ratio == pytest.approx(1.0, rel=0.02)      # traced FLOPs = Megatron's formula
    assert abs(r.rel_error) <= mf.TOLERANCE, (
        f"{r.model_size_b}B tp={r.tp} pp={r.pp} dp={r.dp}: predicted {r.predicted_tflops:.1f} TFLOP/s/GPU, "
        f"measured {r.measured_tflops:.1f} ({r.rel_error:+.1%}); plan {r.plan_summary}")


# ---- Narayanan et al. 2021 (SC'21, arXiv 2104.04473) Table 1 on A100-80GB --------------------------
# reference/megatron_a100_table1.csv (sources in its header: NVIDIA/Megatron-LM images/cases_april2021.png
# @50a4b5fa02, heads @152aab304d, tp/pp split from the paper's Table 1). benchmarks/megatron_fidelity.py
# --table a100 prints the table. The published TFLOP/s count the paper's eq. (3) (hardware FLOPs with
# full recompute); the runs' software: Megatron-LM of April 2021 (unfused attention, fp16 gradients
# all-reduced after the backward, no TP overlap, no distributed optimizer, interleaved schedule).

A100_ROWS = mf.a100_rows()

# Bound on every row: 15%, the H100 table's. What the model still ignores, all making it optimistic
# on the tp=8 rows (18B..310B: +6%..+12% today): TP all-reduces of 25-80 MB priced at the NVSwitch
# large-message bus bandwidth (230 GB/s, "at 512M still rising": NVIDIA/nccl-tests#149) instead of the
# lower mid-size figure; one GEMM efficiency for all shapes (230/312 from n=8192 square matmuls, while
# tp=8 splits the GEMMs 8 ways); the stages per rank and micro-batch size, not stated for Table 1
# (mbs=1, the release's example; the planner's fastest v).
A100_TOLERANCE = 0.15
# The rows without a pipeline and with tp <= 4 (1.7B, 3.6B, 7.5B: the worst, +25..+32% before
# the unfused attention was modelled): no inter-node TP, no bubble; left out are the hidden dropout
# and the fp32 master-weight copies / gradient clipping of the fp16 optimizer (each ~1% of the step):
# 5%.
A100_SMALL_TOLERANCE = 0.05


def test_a100_table_is_consistent():
    """The transcription checks itself: tp*pp*dp = GPUs, % of peak = TFLOP/s / 312 (the paper's peak)
    and aggregate PFLOP/s = TFLOP/s x GPUs, to the table's rounding; model sizes match the paper's
    eq. (2) to the table's one decimal, P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
    assert len(A100_ROWS) == 10
    for r in A100_ROWS:
        tp, pp, dp, n = (int(r[k]) for k in ("tp", "pp", "dp", "n_gpus"))
        t, h, l, V, s = float(r["tflops_per_gpu"]), int(r["hidden"]), int(r["layers"]), int(r["vocab"]), int(r["seq_len"])
        assert tp * pp * dp == n and int(r["global_batch"]) % dp == 0
        assert abs(100 * t / 312 - float(r["pct_peak"])) < 1.0
        assert float(r["agg_pflops"]) == pytest.approx(t * n / 1000, rel=0.005)   # t rounded to 1 TFLOP/s
        params = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
        assert round(params / 1e9, 1) == pytest.approx(float(r["model_size_b"]), abs=0.051)   # 1.65 -> "1.7"
        assert h % int(r["heads"]) == 0 and l % pp == 0


@pytest.mark.parametrize("i", range(len(A100_ROWS)), ids=[f"{r['model_size_b']}B" for r in A100_ROWS])
def test_a100_predicted_throughput_within_bound(i):
    r = mf.predict_a100_row(A100_ROWS[i])
    assert r.planner_flops_ratio == pytest.approx(1.0, rel=0.02)
    bound = A100_SMALL_TOLERANCE if (r.pp == 1 and r.tp <= 4) else A100_TOLERANCE
    assert abs(r.rel_error) <= bound, (
        f"{r.model_size_b}B tp={r.tp} pp={r.pp} dp={r.dp}: predicted {r.predicted_tflops:.1f} TFLOP/s/GPU, "
        f"published {r.measured_tflops:.1f} ({r.rel_error:+.1%}, bound {bound:.0%}); plan {r.plan_summary}")


def test_a100_fused_attention_is_what_made_the_small_rows_optimistic():
    """The 1.7B row (tp=1, pp=1) priced with a fused FlashAttention-style kernel (sdpa), which the 2021
    runs did not have, comes out > 20% optimistic; with the unfused attention they ran (the s x s
    scores through HBM: baddbmm, fused masked softmax, dropout, bmm) it is within 5%."""
    fused = mf.predict_a100_row(A100_ROWS[0], attention="sdpa")
    unfused = mf.predict_a100_row(A100_ROWS[0])
    assert fused.rel_error > 0.20
    assert abs(unfused.rel_error) <= A100_SMALL_TOLERANCE


def test_megatrons_buckets_bring_the_free_micro_batch_rows_closer():
    """With Megatron-Core's gradient buckets scheduled (``MEGATRON_BUCKETS``: max(40M, 1M x dp)
    parameters; the last, the embedding's, starts when the backward ends) the 1.7B row with the
    micro-batch left free (one micro-batch of 4: the whole reduction beside one backward) moves
    toward the measured figure; ``MEGATRON_RUNTIME`` does not schedule them yet (see its comment)."""
    from dataclasses import replace

    from autopar.solver.runtime_profile import MEGATRON_BUCKETS, MEGATRON_RUNTIME

    window = mf.predict_row(ROWS[0], MEGATRON_RUNTIME, mbs=None)
    buckets = mf.predict_row(ROWS[0], replace(MEGATRON_RUNTIME, **MEGATRON_BUCKETS), mbs=None)
    assert window.rel_error > buckets.rel_error > 0.0
