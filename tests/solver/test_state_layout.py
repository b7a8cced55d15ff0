"""Model-state bytes per parameter as each runtime holds them (``solver/runtime_profile.for_dtype``),
by hand and through the planner."""
from __future__ import annotations

import pytest

from autopar.cost import make_cluster
from autopar.cost.hardware import LinkSpec
from autopar.solver import plan_model
from autopar.solver.overlap import dp_sync
from autopar.solver.runtime_profile import AUTOPAR_RUNTIME, MEGATRON_RUNTIME, for_dtype
from autopar.solver.timing import OuterConfig

from solver_helpers import traced


def _row(p):
    return p.param_bytes, p.grad_bytes, p.grad_wire_bytes, p.optimizer_bytes


def test_bytes_per_parameter():
    # (params, gradients stored, gradients on the dp wire, optimizer state)
    assert _row(for_dtype(AUTOPAR_RUNTIME, "bfloat16")) == (4, 4, 2, 8)    # autocast over fp32 master params
    assert _row(for_dtype(AUTOPAR_RUNTIME, "float16")) == (4, 4, 2, 8)
    assert _row(for_dtype(AUTOPAR_RUNTIME, "float32")) == (4, 4, 4, 8)
    assert _row(for_dtype(AUTOPAR_RUNTIME, "bfloat16", "bfloat16")) == (2, 2, 2, 12)   # a model given in bf16
    assert _row(for_dtype(MEGATRON_RUNTIME, "bfloat16")) == (2, 4, 4, 12)  # bf16 params, fp32 main grads + master


def test_gradients_cross_dp_in_the_plan_dtype():
    """ZeRO-0 on 4 ranks, 1e6 gradients over a 1 GB/s link without latency: the all-reduce moves
    2 x 3/4 of the 2 MB of bf16 gradients, though the device stores them in fp32."""
    link = LinkSpec("test", busbw_Bps=1e9, latency_s=0.0, source="test")
    cfg = OuterConfig(tp=1, pp=1, dp=4, mbs=1, m=1, recompute="none", zero=0, sp=False)
    _, sync, _ = dp_sync(cfg, 1e6, for_dtype(AUTOPAR_RUNTIME, "bfloat16"), link, 0.0, 0.0, 0.0)
    assert sync["dp:all_reduce"] == pytest.approx(2 * 3 / 4 * 2e6 / 1e9)


def test_a_bf16_plan_counts_fp32_states():
    """dp=8 with ZeRO-1, bf16: 4 + 4 bytes of parameters and gradients per parameter on every rank
    and 8 / 8 of AdamW's moments (ZeRO's 2 + 2 + 12 / 8 would be 5.5 bytes, not 9)."""
    g, _ = traced("mlp", batch=64)
    plan = plan_model(g, make_cluster("a100-80g", 1), global_batch=4096, seq_len=None,
                      force="tp=1,pp=1,dp=8,zero=1", dtype="bfloat16")
    n = g.param_count
    m = plan.memory
    assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (4 * n, 4 * n, 8 * n // 8)
