"""TraceError: what could not be traced, where in the user's source, and what to change.

``torch.export`` failures are long and point into PyTorch internals. ``trace_error_from`` finds the
innermost frame of the user's own code (any file outside ``torch/`` and ``autopar/trace/``) in
the exception's traceback or in torch's "The following call raised this error" note, and turns
the failure into one ``TraceError`` that names that line and a fix.
"""
from __future__ import annotations

import os
import re
import traceback
from typing import Optional

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TRACE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CALL_NOTE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


class TraceError(ValueError):
    """The model could not be traced into a GraphIR.

    ``source`` is ``"file.py:LINE in fn: code"`` of the user's line where known ("" otherwise);
    ``hint`` says what to change.
    """

    def __init__(self, message: str, *, source: str = "", hint: str = "") -> None:
        self.source = source
        self.hint = hint
        text = message
        if source:
            text += f"\n  at {source}"
        if hint:
            text += f"\n  fix: {hint}"
        super().__init__(text)


def _is_user_file(filename: str) -> bool:
    path = os.path.abspath(filename)
    return not (path.startswith(_TORCH_DIR) or path.startswith(_TRACE_DIR)
                or filename.startswith("<"))


def user_source_line(exc: BaseException) -> str:
    """``"file.py:LINE in fn: code"`` of the innermost user frame that led to ``exc``, or ""."""
    note = _CALL_NOTE.search(str(exc))
    if note and _is_user_file(note.group(1)):
        return f"{note.group(1)}:{note.group(2)} in {note.group(3)}: {note.group(4).strip()}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_DATA_DEPENDENT_HINT = (
    "the model branches on or reads tensor *values* (`if x.sum() > 0`, `.item()`, `.tolist()`, "
    "`int(t)`, a shape computed from data); planning traces with fake tensors that have shapes but "
    "no values. Replace the Python branch with tensor ops (`torch.where(cond, a, b)`, or "
    "`torch.cond` for whole sub-graphs), keep shapes independent of data, and pass sizes as Python "
    "ints instead of computing them from tensors."
)
_DATA_ACCESS_HINT = (
    "the model reads tensor data on the host (`.numpy()`, `.tolist()`, `.item()`, printing a "
    "tensor). Planning traces with fake tensors that have no data: remove the host read from "
    "forward() or compute the value outside the model."
)
_GENERIC_HINT = (
    "torch.export could not trace forward(). Make forward() a pure function of its tensor inputs "
    "(no data-dependent Python control flow, no host reads, no global state), or wrap the "
    "untraceable part outside the module; `torch.export.draft_export(model, inputs)` lists every "
    "issue at once."
)


_EAGER_HINT = (
    "forward() (with the loss) fails on these example inputs when simply run, not only under "
    "torch.export: an op rejected its operands (shapes, dtypes). Run `loss_fn(model(*example_inputs), "
    "example_target)` once in plain PyTorch and fix the model or the example inputs' shapes."
)


def trace_error_from(exc: BaseException, *, model_name: str = "", fails_eagerly: bool = False) -> TraceError:
    """Classify an exception raised while exporting ``model_name`` into a TraceError.
    ``fails_eagerly``: the model raises when simply run on the example inputs too."""
    name = type(exc).__name__
    text = str(exc)
    what = f"could not trace {model_name or 'the model'}"
    source = user_source_line(exc)
    if name.startswith("GuardOnDataDependent") or "data-dependent" in text:
        return TraceError(f"{what}: data-dependent Python control flow or value read "
                          f"({_first_line(exc)})", source=source, hint=_DATA_DEPENDENT_HINT)
    if "data pointer" in text or "Cannot access storage" in text or ".numpy()" in text:
        return TraceError(f"{what}: forward() reads tensor data ({_first_line(exc)})",
                          source=source, hint=_DATA_ACCESS_HINT)
    return TraceError(f"{what}: {name}: {_first_line(exc)}", source=source,
                      hint=_EAGER_HINT if fails_eagerly else _GENERIC_HINT)


def describe_source(stack_trace: Optional[str]) -> str:
    """Innermost user frame of an FX node's stack_trace as ``"file.py:N in fn"`` (export records
    the line in the innermost module's forward; ops of a Linear show ``linear.py`` of torch, so
    frames inside torch are skipped); ``"loss_fn"`` for ops of the loss / output wrapper."""
    if not stack_trace:
        return ""
    hits = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', stack_trace)
    if not hits:
        return ""
    user = [h for h in hits if _is_user_file(h[0])]
    if not user:   # only the traced wrapper's forward: the op comes from loss_fn / output handling
        return "loss_fn" if any(h[0].startswith(_TRACE_DIR) for h in hits) else ""
    f, line, fn = user[-1]
    return f"{os.path.basename(f)}:{line} in {fn}"
