"""A FULL trace runs on real CPU tensors and matches eager PyTorch (loss and gradients)."""
from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from autopar.models import build_model
from autopar.trace import graph_on_device, placeholder_values, run_graph, trace_model


@pytest.mark.parametrize("spec", ["gpt-tiny", "llama:hidden=64,layers=2,heads=4,kv_heads=2,"
                                  "ffn=96,vocab=128,seq=16", "mlp:width=32,depth=3"])
def test_full_trace_matches_eager_loss_and_grads(spec):
    torch.manual_seed(0)
    b = build_model(spec, batch=4, device="cpu")
    inputs, target = b.make_batch(4, torch.Generator().manual_seed(1))
    ir = trace_model(b.module, inputs, loss_fn=b.loss_fn, example_target=target,
                     collapse_repeats=False)
    assert all(t.device.type == "cpu" for t in b.module.parameters())   # the module is untouched
    params = dict(b.module.named_parameters())
    tensors = {**params, **dict(b.module.named_buffers())}

    loss = run_graph(ir, tensors, inputs, target)
    loss.backward()
    graph_grads = {k: p.grad.clone() for k, p in params.items()}
    b.module.zero_grad()
    want = b.loss_fn(b.module(*inputs), target)
    want.backward()
    torch.testing.assert_close(loss, want)
    for k, p in params.items():
        torch.testing.assert_close(graph_grads[k], p.grad, msg=k)


def test_meta_planning_graph_runs_with_real_weights():
    """The graph traced from the meta-device zoo model executes with a CPU model's tensors."""
    meta = build_model("gpt-tiny", batch=2)
    ir = trace_model(meta.module, meta.example_inputs, loss_fn=meta.loss_fn,
                     example_target=meta.example_target, collapse_repeats=False)
    torch.manual_seed(0)
    cpu = build_model("gpt-tiny", batch=2, device="cpu")
    inputs, target = cpu.make_batch(2, torch.Generator().manual_seed(0))
    tensors = dict(cpu.module.named_parameters())
    gm = graph_on_device(ir, "cpu")
    assert not any(isinstance(a, torch.device) and a.type == "meta"
                   for n in gm.graph.nodes for a in [*n.args, *n.kwargs.values()])
    got = fx.Interpreter(gm).run(*placeholder_values(ir, tensors, inputs, target))[0]
    torch.testing.assert_close(got, cpu.loss_fn(cpu.module(*inputs), target))


def test_missing_tensor_is_named():
    b = build_model("gpt-tiny", batch=2)
    ir = trace_model(b.module, b.example_inputs, collapse_repeats=False)
    with pytest.raises(KeyError, match="transformer.wte.weight"):
        placeholder_values(ir, {}, b.example_inputs)


class _CNN(nn.Module):
    """Conv + BatchNorm (in-place running-stat updates) + a tensor constant made in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.fc(y) * torch.tensor(2.0)


def test_batchnorm_constants_and_conv_flops():
    torch.manual_seed(0)
    model, twin = _CNN(), _CNN()
    twin.load_state_dict(model.state_dict())
    x, t = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    loss_fn = nn.functional.cross_entropy
    ir = trace_model(model, (x,), loss_fn=loss_fn, example_target=t, collapse_repeats=False)
    assert ir.node("bn.running_mean|buffer|0").param_name == "bn.running_mean"
    assert ir.node("lifted_tensor_0|constant|0").kind == "buffer"
    assert ir.node("conv|aten.conv2d.default|0").flops == 2 * (4 * 8 * 8 * 8) * (3 * 3 * 3)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    torch.testing.assert_close(run_graph(ir, tensors, (x,), t), loss_fn(twin(x), t))
    torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean)   # updated in place
    assert int(model.bn.num_batches_tracked) == int(twin.bn.num_batches_tracked) == 1
