"""What cannot be traced gives a TraceError naming the user's line and the fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.trace import TraceError, trace_model


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # data-dependent branch
            return y * 2
        return y


class _ItemShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y[:, : int(y.max().item())]  # shape from data


class _NoTensorOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        self.fc(x)
        return {"note": "nothing"}


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_data_dependent_branch_names_source_line(device):
    with torch.device(device):
        m = _Branchy()
    with pytest.raises(TraceError) as info:
        trace_model(m, (torch.randn(2, 8),))
    err = info.value
    assert isinstance(err, ValueError)
    assert "test_trace_errors.py" in err.source and "if y.sum() > 0" in err.source
    assert "torch.where" in str(err) and "data-dependent" in str(err)


def test_item_in_shape_names_source_line():
    with torch.device("meta"):
        m = _ItemShape()
    with pytest.raises(TraceError, match=r"\.item\(\)") as info:
        trace_model(m, (torch.randn(2, 8),))
    assert "int(y.max().item())" in info.value.source


def test_output_without_tensor():
    with torch.device("meta"):
        m = _NoTensorOut()
    with pytest.raises(TraceError, match="no tensor"):
        trace_model(m, (torch.randn(2, 8),))


def test_bad_arguments():
    m = nn.Linear(8, 8, device="meta")
    with pytest.raises(TypeError, match="example_inputs"):
        trace_model(m, ([1, 2],))
    with pytest.raises(ValueError, match="together"):
        trace_model(m, (torch.randn(2, 8),), loss_fn=lambda o, t: o.sum())


class _WrongWidth(nn.Module):
    """A Linear over the wrong dim (what a fuzzed conv model did): fails in plain PyTorch too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.transpose(1, 2))          # x is (B, 5, 8): the Linear gets 5 features


def test_shape_error_says_the_model_fails_when_simply_run():
    """An op that rejects its operands' shapes is the model's (or the inputs') fault, not
    torch.export's: the hint says so instead of the generic "make forward() pure"."""
    with torch.device("meta"):
        m = _WrongWidth()
    with pytest.raises(TraceError) as info:
        trace_model(m, (torch.randn(2, 5, 8),))
    err = info.value
    assert "self.fc(x.transpose(1, 2))" in err.source
    assert "fails on these example inputs when simply run" in err.hint
    assert "pure function" not in err.hint
