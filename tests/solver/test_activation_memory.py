"""The saved-activation model (solver/saved.py) against Korthikanti et al.'s per-layer formula
(cost.memory.transformer_layer_activation_bytes; "selective" = without the attention-score terms,
which fused attention never materializes, and no dropout masks: the zoo GPT has dropout 0)."""
import pytest

from autopar.cost import make_cluster
from autopar.cost.memory import transformer_layer_activation_bytes
from autopar.solver import MEGATRON_RUNTIME, solve

from solver_helpers import traced

H, A, S = 2048, 16, 2048
MODEL = f"gpt:hidden={H},layers=4,heads={A},vocab=32768,seq={S}"


@pytest.mark.parametrize("t,sp", [(1, False), (2, True), (4, True)])
def test_layer_activations_match_korthikanti(t, sp):
    g, _ = traced(MODEL)
    r = solve(g, make_cluster("h100", 1), global_batch=8, seq_len=S, runtime=MEGATRON_RUNTIME,
              force=f"tp={t},pp=1,mbs=1,sp={'on' if sp else 'off'},recompute=none")
    if sp:   # the layout Korthikanti's TP+SP formula describes
        assert all(s.name == "seq" for s in r.plan.strategies if "layer_norm" in s.key)
    mine = r.solution.summary.parts["block"].saved_bytes
    ref = transformer_layer_activation_bytes(S, 1, H, A, t, sp=sp, recompute="selective")
    assert mine == pytest.approx(ref, rel=0.01)
