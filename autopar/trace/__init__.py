"""Tracing: nn.Module -> GraphIR on fake/meta tensors (``torch.export`` training IR).

    from autopar.trace import trace_model
    ir = trace_model(model, (tokens,), loss_fn=loss, example_target=targets)   # collapsed repeats

See ``export_trace.py`` (API), ``build_ir.py`` (keys), ``repeats.py`` (repeated blocks),
``flops.py`` (FLOP / byte conventions), ``execute.py`` (running a traced graph on real tensors),
``causal_masks.py`` (constant causal attention masks folded to ``is_causal=True``).
"""
from autopar.trace.build_ir import base_key
from autopar.trace.errors import TraceError
from autopar.trace.execute import (constant_values, graph_on_device, node_key_map,
                                   placeholder_values, run_graph)
from autopar.trace.export_trace import primary_output, trace_model
from autopar.trace.repeats import RepeatInfo, collapsed_clone, find_repeats

__all__ = [
    "TraceError", "trace_model", "primary_output", "base_key", "node_key_map", "run_graph",
    "placeholder_values", "constant_values", "graph_on_device", "find_repeats", "collapsed_clone",
    "RepeatInfo",
]
