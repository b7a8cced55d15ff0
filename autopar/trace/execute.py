"""Running a traced graph on real tensors (what the runtime / codegen build on).

``GraphIR.graph_module`` is ``ExportedProgram.graph_module``: an ``fx.GraphModule`` whose
placeholders are, in order, every parameter and buffer (lifted, in ``graph_signature`` order), then
the user inputs, then the loss target when a loss was traced. ``GraphIR.exported`` is the
ExportedProgram itself. The ``NodeInfo`` of a placeholder (same ``name`` as the FX node) says what
to feed it: ``param_name`` (a name in ``dict(model.named_parameters())`` /
``dict(model.named_buffers())`` of the ORIGINAL module, non-persistent buffers included),
``"|input|i"`` or ``"|target|0"``, or a lifted constant (``param_name`` None; value in
``exported.constants``). Outputs: buffer mutations first (BatchNorm running stats), then the user
output (the loss, or the model's primary output tensor).

Run a FULL trace (``collapse_repeats=False``) -- a collapsed one has one copy of each block:

    ir = trace_model(model, inputs, loss_fn=loss_fn, example_target=target, collapse_repeats=False)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    loss = run_graph(ir, tensors, inputs, target)            # == loss_fn(model(*inputs), target)
    loss.backward()                                          # grads land on model's parameters

or walk it with ``fx.Interpreter(ir.graph_module).run(*placeholder_values(ir, tensors, inputs,
target))``, looking each node up by ``node_key_map(ir)[node.name]``. Graphs are always traced on
the meta device, so ``device=meta`` is baked into factory calls (``arange``, ``to``,
``_assert_tensor_metadata``); ``graph_on_device(ir, device)`` returns a copy with those literals
rewritten (``run_graph`` does it for the device of the first input; build it once and reuse it
when running many steps).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from torch import fx
from torch.export.graph_signature import OutputKind

from autopar.ir import GraphIR

_PLACEHOLDER_KINDS = ("input", "param", "buffer")


def node_key_map(ir: GraphIR) -> dict[str, str]:
    """FX node name -> GraphIR key."""
    return {n.name: n.key for n in ir.nodes}


def _input_spec_targets(ir: GraphIR) -> dict[str, str]:
    return {s.arg.name: s.target for s in ir.exported.graph_signature.input_specs
            if hasattr(s.arg, "name")}


def constant_values(ir: GraphIR) -> dict[str, torch.Tensor]:
    """FX placeholder name -> value of each lifted tensor constant (``torch.tensor(2.0)`` made in
    forward; NodeInfo kind "buffer", key ``"<name>|constant|0"``, ``param_name`` None)."""
    spec_targets = _input_spec_targets(ir)
    return {n.name: ir.exported.constants[spec_targets[n.name]] for n in ir.nodes
            if n.kind == "buffer" and n.param_name is None}


def placeholder_values(ir: GraphIR, tensors: Mapping[str, torch.Tensor],
                       inputs: Sequence[torch.Tensor],
                       target: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """The positional arguments of ``ir.graph_module``, in placeholder order."""
    if ir.exported is None:
        raise ValueError("this GraphIR carries no exported program; trace it with trace_model()")
    constants = constant_values(ir)
    values: list[torch.Tensor] = []
    for n in ir.nodes:
        if n.kind not in _PLACEHOLDER_KINDS:
            break
        if n.kind == "input":
            if n.key == "|target|0":
                if target is None:
                    raise ValueError("the graph computes a loss: pass the target")
                values.append(target)
            else:
                values.append(inputs[int(n.key.rsplit("|", 1)[1])])
        elif n.param_name is None:
            values.append(constants[n.name])
        elif n.param_name in tensors:
            values.append(tensors[n.param_name])
        else:
            raise KeyError(f"no tensor named {n.param_name!r} for graph input {n.name}; pass "
                           "{**dict(model.named_parameters()), **dict(model.named_buffers())}")
    return values


def run_graph(ir: GraphIR, tensors: Mapping[str, torch.Tensor], inputs: Sequence[torch.Tensor],
              target: Optional[torch.Tensor] = None, *,
              graph_module: Optional[fx.GraphModule] = None) -> Any:
    """Execute the traced graph on real tensors and return the user output (loss or logits).
    Buffer mutations (BatchNorm statistics) are copied into ``tensors``. ``graph_module`` defaults
    to ``graph_on_device(ir, inputs[0].device)``."""
    gm = graph_module if graph_module is not None else graph_on_device(ir, inputs[0].device)
    flat = gm(*placeholder_values(ir, tensors, inputs, target))
    specs = ir.exported.graph_signature.output_specs
    by_target = {s.target: n.param_name for n in ir.nodes
                 for s in ir.exported.graph_signature.input_specs
                 if getattr(s.arg, "name", None) == n.name and n.param_name}
    user = []
    for spec, value in zip(specs, flat):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            with torch.no_grad():
                tensors[by_target[spec.target]].copy_(value)
        elif spec.kind == OutputKind.USER_OUTPUT:
            user.append(value)
    return user[0] if len(user) == 1 else tuple(user)


def graph_on_device(ir: GraphIR, device: Any) -> fx.GraphModule:
    """A copy of ``ir.graph_module`` with every ``torch.device`` literal replaced by ``device``."""
    device = torch.device(device)
    gm = ir.graph_module
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)

    def swap(a: Any) -> Any:
        if isinstance(a, torch.device):
            return device
        if isinstance(a, (list, tuple)):
            return tuple(swap(x) for x in a) if isinstance(a, tuple) else [swap(x) for x in a]
        return a

    for node in graph.nodes:
        node.args = swap(node.args)
        node.kwargs = {k: swap(v) for k, v in node.kwargs.items()}
    return fx.GraphModule(gm, graph)
