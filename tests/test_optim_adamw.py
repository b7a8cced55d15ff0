"""autopar's default optimizer (``autopar.optim.adamw``): torch's fused AdamW where it applies, the
same update as the foreach one; and the CPU optimizer-step benchmark runs."""
from __future__ import annotations

import torch

from autopar.optim import adamw


def test_default_adamw_is_fused_on_the_cpu_and_steps_as_foreach_does():
    gen = torch.Generator().manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(33, 17, generator=gen)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    fused, ref = adamw(a, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, foreach=True)
    assert fused.defaults["fused"] is True
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in a]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        ref.step()
    # the same fp32 formula per element, evaluated in another order (a few ulps of |p| + lr)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)


def test_param_groups_and_an_explicit_choice_are_kept():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = adamw([{"params": [p], "lr": 0.5}], foreach=True, fused=None)
    assert opt.param_groups[0]["lr"] == 0.5 and not opt.defaults["fused"]


def test_cpu_optimizer_step_benchmark_runs(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_optimizer_step.py"
    spec = importlib.util.spec_from_file_location("cpu_optimizer_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--params", "0.05"])
    assert set(out["seconds"]) >= {"AdamW foreach", "AdamW fused (autopar.optim.adamw)"}
    assert all(t > 0 for t in out["seconds"].values())
    assert "x foreach" in capsys.readouterr().out
