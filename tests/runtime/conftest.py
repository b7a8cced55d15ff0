import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))      # handplans / bodies, also for spawned ranks

BATCH = 4


@pytest.fixture(scope="session")
def tiny_bundle():
    import torch

    from autopar.models import build_model

    torch.manual_seed(0)
    return build_model("gpt-tiny", device="cpu", batch=BATCH)


@pytest.fixture(scope="session")
def tiny_full(tiny_bundle):
    from autopar.trace import trace_model

    b = tiny_bundle
    return trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                       collapse_repeats=False, model_name="gpt-tiny")
