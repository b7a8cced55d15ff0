"""``aten._assert_tensor_metadata`` (torch.export writes it for a ``.to(dtype)`` that changes
nothing, as HF's mask building does) runs on DTensors against their global metadata: no sharding
rule is needed, nothing is gathered, and a wrong assertion still fails."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.codegen import fallback
from autopar.runtime.launch import spawn_ranks
from one_process import one_process_losses


class MaskedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        keep = (tokens > 0).to(torch.bool)                  # -> aten._assert_tensor_metadata
        return self.head(self.emb(tokens) * keep.unsqueeze(-1).to(torch.float32))


def _loss(logits, target):
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _data():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (4, 8), generator=gen) for _ in range(3)]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _train(rank: int, world: int, force: str) -> dict:
    from autopar.api import autoparallelize

    torch.manual_seed(0)
    model = MaskedLM()
    data = _data()
    pm = autoparallelize(model, (data[0],), loss_fn=_loss, example_target=data[0], force=force,
                         dp_mode="dtensor", optimizer=_sgd, timeout_s=30)
    return {"losses": [pm.step((t,), t) for t in data], "fallbacks": sorted(pm.fallbacks)}


def _reference() -> list[float]:
    torch.manual_seed(0)
    return one_process_losses(MaskedLM(), _data(), _loss, _sgd)


@pytest.mark.parametrize("force", ["dp=2", "tp=2"])
def test_metadata_asserts_run_on_dtensors(force):
    out = spawn_ranks(_train, 2, (force,), timeout_s=60)
    want = _reference()
    for o in out:
        assert fallback.ASSERT_METADATA not in o["fallbacks"]
        # SGD is linear in the gradients (no Adam 1/sqrt(v) magnification): losses ~3.5 stay within a
        # few ulps (2.4e-7 each) of one process; a wrong run moves step 2 by ~lr*|g|^2 >> 1e-6.
        torch.testing.assert_close(o["losses"], want, rtol=0, atol=1e-6)


def test_a_wrong_assertion_still_fails():
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        x = DTensor.from_local(torch.zeros(4, 3, dtype=torch.bool), mesh, [Shard(0)])
        fallback.assert_global_metadata(x, dtype=torch.bool, device=torch.device("cpu"))
        with pytest.raises(RuntimeError, match="dtype"):
            fallback.assert_global_metadata(x, dtype=torch.float32)
        with pytest.raises(RuntimeError, match="device"):
            fallback.assert_global_metadata(x, device=torch.device("meta"))
    finally:
        dist.destroy_process_group()
