"""What a user sees when their model cannot be planned or trained: one short message per distinct
error (with the ranks that raised it), the `fix:` hint visible, no torch debugging dumps."""
from __future__ import annotations

import logging
import textwrap

import pytest

from autopar.models import build_model
from autopar.cli_run import run_command
from autopar.runtime.launch import RankFailure
from autopar.trace import TraceError, trace_model

MODEL_FILE = '''
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:          # data-dependent Python control flow
            h = h * 2
        return self.b(h)


def with_loss():
    return Net(), torch.randn(8, 16), (lambda o, t: F.cross_entropy(o, t)), torch.zeros(8, dtype=torch.long)


def without_loss():
    return Net(), torch.randn(8, 16)
'''


@pytest.fixture
def model_file(tmp_path):
    f = tmp_path / "branchy.py"
    f.write_text(textwrap.dedent(MODEL_FILE))
    return str(f)


def test_trace_error_comes_without_torch_dumps(model_file, capsys, caplog):
    b = build_model(f"{model_file}:with_loss")
    with caplog.at_level(logging.WARNING), pytest.raises(TraceError) as e:
        trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    assert "fix:" in str(e.value) and "branchy.py:15" in str(e.value)
    err = capsys.readouterr().err
    assert "def forward" not in err                 # torch.export's partial FX graph, printed twice before
    assert not [r for r in caplog.records if r.name.startswith("torch")], caplog.records


@pytest.mark.slow
def test_run_reports_each_distinct_error_once_with_its_ranks(model_file, capsys):
    with pytest.raises(RankFailure) as e:
        run_command(f"{model_file}:with_loss", nproc=2, steps=1, timeout_s=30)
    summary = e.value.summary()
    assert summary.startswith("ranks 0, 1: TraceError: could not trace"), summary
    assert "fix:" in summary and "Traceback" not in summary
    assert summary.count("could not trace") == 1
    err = capsys.readouterr().err
    assert "fix:" in err and len(err.splitlines()) <= 6, err
    assert set(e.value.errors) == {0, 1}
    assert "Traceback" in str(e.value)              # the tracebacks are kept for debugging


def test_run_without_a_loss_says_what_to_return(model_file):
    with pytest.raises(ValueError, match=r"without a loss; `autopar run` trains, so return \(module, "
                                         r"example_inputs, loss_fn, example_target\)"):
        run_command(f"{model_file}:without_loss", nproc=2, steps=1)
