"""An op with no sharding rule (here ``aten.one_hot``) reading batch-sharded data runs replicated
on the dp axis too: its input is gathered, the result is exact. (It used to be planned Partial on
dp, as if it reduced over the batch, and the run failed on a dtype mismatch.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.runtime.launch import spawn_ranks
from one_process import one_process_losses


class OneHotLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 16)

    def forward(self, tokens):
        return self.head(F.one_hot(tokens, 16).float())


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _data():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 16, (4, 8), generator=gen) for _ in range(3)]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _train(rank: int, world: int, force: str, dp_mode: str) -> dict:
    from autopar.api import autoparallelize

    torch.manual_seed(0)
    data = _data()
    pm = autoparallelize(OneHotLM(), (data[0],), loss_fn=_loss, example_target=data[0], force=force,
                         dp_mode=dp_mode, optimizer=_sgd, timeout_s=30)
    return {"losses": [pm.step((t,), t) for t in data], "notes": pm.plan.notes}


def _reference() -> list[float]:
    torch.manual_seed(0)
    return one_process_losses(OneHotLM(), _data(), _loss, _sgd)


@pytest.mark.parametrize("force,dp_mode", [("dp=2", "auto"), ("dp=2", "dtensor"), ("tp=2", "dtensor")])
def test_unknown_op_on_batch_shards_is_exact(force, dp_mode):
    out = spawn_ranks(_train, 2, (force, dp_mode), timeout_s=60)
    want = _reference()
    for o in out:
        # SGD is linear in the gradients (no Adam 1/sqrt(v) magnification): losses ~2.8 stay within a
        # few ulps (2.4e-7 each) of one process; a wrong run moves step 2 by ~lr*|g|^2 >> 1e-6.
        torch.testing.assert_close(o["losses"], want, rtol=0, atol=1e-6)
        assert any("aten.one_hot.default" in n for n in o["notes"]), o["notes"]     # and it says so
