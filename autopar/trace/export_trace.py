"""trace_model: nn.Module + example inputs -> GraphIR via ``torch.export`` (non-strict, training IR).

The graph is ``torch.export.export(wrapper, inputs (+ target), strict=False)`` where ``wrapper``
calls the user's module (or its collapsed clone, see ``repeats.py``), reduces its output to one tensor
and, when ``loss_fn`` is given, returns ``loss_fn(output, target)`` so the loss is in the graph.

Always traced on the meta device: a module already on meta is traced as it is (the model zoo builds
there); a module with real weights is traced through a meta copy (``copy.deepcopy`` with every
parameter and buffer pre-mapped to an empty meta tensor: no weight is copied, and with collapsed
repeats only one copy of each block is cloned at all). One device for every trace matters: fake
tensors take their strides from the device's kernels (CPU ``scaled_dot_product_attention`` returns
a layout in which ``.transpose(1, 2).contiguous()`` is a no-op that export drops, meta does not),
and the graph, its keys and its fingerprint must be the same whether the planner or the runtime
traced it. Run the graph on real tensors with ``autopar.trace.execute.run_graph``.

Output reduction (``primary_output``): a tensor is used as is; an object or mapping with a
tensor ``logits`` (HuggingFace ``ModelOutput``) gives ``logits``; otherwise the first tensor found
in a dataclass / mapping (in field order) or tuple / list (nanoGPT's ``(logits, loss)``).
Modules whose ``forward`` takes ``use_cache`` (HuggingFace) are called with ``use_cache=False``.
Attention masks that are constant and causal (HuggingFace builds them in ``forward``) become
``is_causal=True`` (``causal_masks.py``).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import io
import logging
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.ir import GraphIR
from autopar.trace.build_ir import WRAPPER_ATTR, build_graph_ir, canonical_names, chain_violations
from autopar.trace.causal_masks import fold_causal_masks
from autopar.trace.errors import TraceError, trace_error_from
from autopar.trace.repeats import collapsed_clone, find_repeats, not_sequential


def _find_tensor(x: Any) -> Optional[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return x
    logits = x.get("logits") if isinstance(x, Mapping) else getattr(x, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(x, Mapping):
        values = list(x.values())
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        values = [getattr(x, f.name) for f in dataclasses.fields(x)]
    elif isinstance(x, (tuple, list)):
        values = list(x)
    else:
        return None
    for v in values:
        t = _find_tensor(v)
        if t is not None:
            return t
    return None


def primary_output(out: Any) -> torch.Tensor:
    """The tensor a model's output stands for (see the module docstring)."""
    t = _find_tensor(out)
    if t is None:
        raise TraceError(f"the model returned {type(out).__name__} with no tensor in it",
                         hint="return a tensor (or a tuple / dataclass / dict holding the logits)")
    return t


class _TraceWrapper(nn.Module):
    """What is exported: ``forward(*inputs[, target])`` -> output tensor or scalar loss."""

    def __init__(self, model: nn.Module, loss_fn: Optional[Callable], num_inputs: int) -> None:
        super().__init__()
        setattr(self, WRAPPER_ATTR, model)
        self._loss_fn = loss_fn
        self._num_inputs = num_inputs
        params = inspect.signature(model.forward).parameters
        self._call_kwargs = {"use_cache": False} if "use_cache" in params else {}

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        inputs = args[:self._num_inputs]
        out = primary_output(getattr(self, WRAPPER_ATTR)(*inputs, **self._call_kwargs))
        if self._loss_fn is None:
            return out
        return self._loss_fn(out, args[self._num_inputs])


# torch.export logs a warning and prints the partial FX graph to stderr (twice, once per wrapper)
# before it raises on data-dependent control flow; the TraceError raised from that exception says
# the same with the user's line and the fix.
_EXPORT_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export")


class _DropWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def _export_quietly():
    """Hold back torch.export's warnings and its partial-graph printout while one export runs (a
    filter on its loggers and a stderr buffer, both removed after): on failure what they say reaches
    the user as the TraceError, once; everything else written to stderr meanwhile is passed on."""
    loggers = [logging.getLogger(n) for n in _EXPORT_LOGGERS]
    f = _DropWarnings()
    for lg in loggers:
        lg.addFilter(f)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            yield
    except Exception as e:
        partial = getattr(e, "partial_fx_graph", None)
        sys.stderr.write(err.getvalue().replace(f"{partial}\n", "") if partial else err.getvalue())
        raise
    else:
        sys.stderr.write(err.getvalue())
    finally:
        for lg in loggers:
            lg.removeFilter(f)


def _export(model: nn.Module, args: tuple, loss_fn: Optional[Callable], num_inputs: int):
    wrapper = _TraceWrapper(model, loss_fn, num_inputs)
    with _export_quietly():
        return wrapper, torch.export.export(wrapper, args, strict=False)


def meta_copy(module: nn.Module, canonical: dict[int, str]) -> tuple[nn.Module, dict[int, str]]:
    """``module`` with every parameter and buffer on the meta device, and ``canonical`` re-keyed to
    the ids of the meta tensors. Modules already entirely on meta are returned as they are."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    if all(t.device.type == "meta" for t in tensors.values()):
        return module, canonical
    memo: dict[int, Any] = {}
    for key, t in tensors.items():
        empty = torch.empty_like(t, device="meta")
        memo[key] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(
            t, nn.Parameter) else empty
    try:
        clone = copy.deepcopy(module, memo)
    except Exception as exc:  # deepcopy raises whatever an attribute's __deepcopy__ raises
        raise TraceError(f"could not make a meta-device copy of {type(module).__name__} to trace "
                         f"({type(exc).__name__}: {exc})",
                         hint="build the model under `with torch.device('meta'):` and trace that "
                              "(planning needs no weights), or make its attributes deep-copyable"
                         ) from exc
    return clone, {id(memo[k]): name for k, name in canonical.items() if k in memo}


def _fake_forward(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Any:
    """``model(*inputs)`` eagerly on fake tensors (libraries such as HuggingFace skip their
    data-dependent fast paths when they see fake tensors, as under export)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        return _TraceWrapper(model, None, len(inputs))(*(mode.from_tensor(x) for x in inputs))


def _fails_eagerly(model: nn.Module, args: tuple, loss_fn: Optional[Callable], num_inputs: int) -> bool:
    """Whether ``loss_fn(model(*inputs), target)`` also raises when simply run (eagerly, on fake
    tensors): then the model or its example inputs are wrong, whatever torch.export says."""
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            _TraceWrapper(model, loss_fn, num_inputs)(*(mode.from_tensor(x) for x in args))
    except Exception:  # any failure: the model does not run on these inputs
        return True
    return False


def _is_data_dependent(exc: BaseException) -> bool:
    return type(exc).__name__.startswith("GuardOnDataDependent") or "data-dependent" in str(exc)


def trace_model(module: nn.Module, example_inputs: Any, *, loss_fn: Optional[Callable] = None,
                example_target: Optional[torch.Tensor] = None, collapse_repeats: bool = True,
                model_name: str = "") -> GraphIR:
    """Trace ``module(*example_inputs)`` (and ``loss_fn(output, example_target)``) into a GraphIR.

    collapse_repeats: trace one copy of each repeated block (planning; cost independent of depth).
        False traces every copy (the graph the runtime executes). Keys agree between the two.
    If collapsing fails for a model (it indexes its layer list by position, or the identical
    modules are used side by side rather than one after another), that block is traced in full
    with a warning.
    """
    inputs = (tuple(example_inputs) if isinstance(example_inputs, (tuple, list))
              else (example_inputs,))
    if not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
        raise TypeError("example_inputs must be a tensor or a tuple of tensors, got "
                        f"{[type(x).__name__ for x in inputs]}")
    if (loss_fn is None) != (example_target is None):
        raise ValueError("pass loss_fn and example_target together (or neither)")
    inputs = tuple(x.to("meta") for x in inputs)
    if example_target is not None:
        example_target = example_target.to("meta")
    args = inputs + ((example_target,) if example_target is not None else ())

    repeats = find_repeats(module)
    canonical = canonical_names(module)
    collapsed = frozenset(r.path for r in repeats) if collapse_repeats else frozenset()
    if collapsed:
        # Run a two-copy clone eagerly on fake tensors: are the copies chained (0 -> 1)?
        paths = tuple(sorted(collapsed))
        probe, _ = meta_copy(collapsed_clone(module, paths, keep=2), canonical)
        bad = not_sequential(probe, paths, lambda m: _fake_forward(m, inputs))
        if bad:
            warnings.warn(f"{sorted(bad)} hold identical modules that do not run one after "
                          "another; they are not treated as repeated blocks", stacklevel=2)
            repeats = tuple(r for r in repeats if r.path not in bad)
            collapsed = collapsed - bad
    while True:
        traced, names = meta_copy(collapsed_clone(module, tuple(sorted(collapsed))), canonical)
        try:
            wrapper, ep = _export(traced, args, loss_fn, len(inputs))
        except TraceError:
            raise
        except Exception as exc:  # torch.export raises many types; all become a TraceError
            if not collapsed or _is_data_dependent(exc):
                raise trace_error_from(exc, model_name=model_name,
                                       fails_eagerly=_fails_eagerly(traced, args, loss_fn, len(inputs))) from exc
            warnings.warn(f"tracing {model_name or 'the model'} with one copy of "
                          f"{sorted(collapsed)} failed ({type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); "
                          "tracing every copy instead", stacklevel=2)
            collapsed = frozenset()
            continue
        fold_causal_masks(ep.graph_module)
        while True:
            ir = build_graph_ir(ep, wrapper, names, repeats, collapsed, num_inputs=len(inputs),
                                has_target=example_target is not None, model_name=model_name)
            bad = set(chain_violations(ir.nodes, ir.blocks))
            if not bad:
                return ir
            warnings.warn(f"{sorted(bad)} hold identical modules that do not run one after "
                          "another; they are not treated as repeated blocks", stacklevel=2)
            repeats = tuple(r for r in repeats if r.path not in bad)
            if bad & collapsed:          # the collapsed trace is wrong for them: trace again
                collapsed = collapsed - bad
                break

